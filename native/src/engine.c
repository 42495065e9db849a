// engine.c — the engine's lifetime (layers, budget -> cache slots, hot set, I/O workers), its
// error slot and counters, and the small public calls on it.

#include "internal.h"

#include "ggml.h"
#include "ggml-cpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

ls_status ls_engine_take_error(ls_engine * e, char * msg, size_t msg_size) {
    if (!e) return LS_ERR_ARG;
    return ls_error_slot_take(&e->err, msg, msg_size);
}

static uint64_t predictor_bytes(const ls_predictor * p) {
    ls_predictor_info pi;
    return p && ls_predictor_get_info(p, &pi) == LS_OK ? pi.size_bytes : 0;
}

// One layer: its block file (the header's fields into L->info), then the planner's per-block scratch.
static ls_status open_layer(ls_engine * e, ls_layer * L, int32_t il, const char * path) {
    L->e = e;
    L->il = il;
    ls_file_header h;
    ls_status st = ls_blockfile_open(&L->f, LS_FILE_NEURONS, il, path, !e->hooks.buffered_io, &e->direct_io, &h);
    if (st != LS_OK) return st;
    L->info = (ls_layer_info) {
        .n_embd = h.n_embd, .n_ff = h.n_ff, .neurons_per_block = L->f.ids_per_block, .n_blocks = L->f.n_blocks,
        .gate_type = h.type[0], .up_type = h.type[1], .down_type = h.type[2],
        .block_stride = L->f.stride, .block_payload = h.payload, .data_offset = L->f.data_offset,
    };
    L->gate_row_bytes = h.part_bytes[0];
    L->up_row_bytes = h.part_bytes[1];
    L->down_col_bytes = h.part_bytes[2];
    const ls_layer_info * in = &L->info;
    L->prio        = calloc((size_t) in->n_blocks, sizeof(float));
    L->prefetch    = malloc((size_t) in->n_blocks * sizeof(int32_t));
    L->order       = malloc((size_t) in->n_blocks * sizeof(int32_t));
    L->mark        = malloc((size_t) in->n_blocks);
    if (L->mark) memset(L->mark, 0xFF, (size_t) in->n_blocks);
    L->in_prefetch = calloc((size_t) in->n_blocks, 1);
    L->last_plan   = malloc((size_t) in->n_blocks * sizeof(int32_t));
    L->last_cand   = malloc((size_t) in->n_blocks * sizeof(int32_t));
    L->spec        = calloc((size_t) in->n_blocks, 1);
    if (!L->prio || !L->prefetch || !L->order || !L->mark || !L->in_prefetch || !L->last_plan || !L->last_cand || !L->spec) {
        ls_set_error("out of memory");
        return LS_ERR_NOMEM;
    }

    return LS_OK;
}

// The hot set (powerinfer2, leanstream): the best-ranked blocks of all layers by calibration
// frequency fill hot_fraction of the slots, never the room two layers' working sets need.
static ls_status pick_hot_set(ls_engine * e, const float * rank, int32_t working_set) {
    if (!rank) {
        if (!(e->policy->uses & LS_NEEDS_RANK)) return LS_OK;
        ls_set_error("this mode pins the blocks most often active in calibration and needs their ranking "
                     "(block_rank: the model directory's predictor/block_freq.npy); re-convert with predictors");
        return LS_ERR_ARG;
    }
    const int32_t n_hot = ls_hot_set_size(e->cache.n_slots, working_set, e->params.hot_fraction);
    if (n_hot == 0) return LS_OK;
    int32_t * nb = malloc(sizeof(int32_t) * (size_t) e->n_layers);
    uint8_t ** hot = malloc(sizeof(uint8_t *) * (size_t) e->n_layers);
    ls_status st = nb && hot ? LS_OK : LS_ERR_NOMEM;
    for (int32_t il = 0; il < e->n_layers && st == LS_OK; il++) {
        ls_layer * L = &e->layers[il];
        nb[il] = L->info.n_blocks;
        hot[il] = L->f.hot;
    }
    if (st == LS_OK) st = ls_mode_pick_hot(e->n_layers, nb, rank, n_hot, hot);
    else ls_set_error("out of memory");
    if (st == LS_OK) e->n_hot = n_hot;
    free(nb);
    free(hot);
    return st;
}

// Whether the hot set's blocks lose their sketch rows: a mode that selects through the sketch
// and pins a ranked hot set.
static bool drops_sketch_rows(const ls_engine * e, const ls_engine_params * p) {
    if (!(e->policy->uses & LS_USES_SKETCH) || !(e->policy->hot_fraction > 0.0f) || !(e->params.hot_fraction > 0.0) || !p->block_rank)
        return false;
    for (int32_t il = 0; il < e->n_layers; il++) if (e->layers[il].sketch) return true;
    return false;
}

// leanstream with a sketch: the hot set's blocks keep their exact gate/up rows resident, so
// their sketch rows are dropped (ls_sketch_drop_blocks) and the memory they held goes to more
// slots, which makes the hot set larger in turn. The largest slot count n whose slots plus the
// sketches left after dropping the rows of the hot set that n slots give fits the budget (need(n)
// grows with n: a block's sketch rows are smaller than its slot), found by bisection over the
// ranking's prefix sums.
static int64_t slots_with_dropped_rows(const ls_engine * e, const float * rank, int64_t n_slots, int32_t total_blocks,
                                       uint64_t stride, uint64_t resident, uint64_t budget, int32_t working_set) {
    int32_t * nb = malloc(sizeof(int32_t) * (size_t) e->n_layers);
    uint64_t * per = malloc(sizeof(uint64_t) * (size_t) (total_blocks > 0 ? total_blocks : 1));   // sketch bytes of flat block i
    int32_t * order = NULL;
    int64_t total = 0;
    uint64_t * freed = NULL;
    if (!nb || !per) goto done;
    for (int32_t il = 0, pos = 0; il < e->n_layers; il++) {
        const ls_layer * L = &e->layers[il];
        nb[il] = L->info.n_blocks;
        const uint64_t bytes = L->sketch ? 2 * L->sketch->row_bytes * (uint64_t) L->info.neurons_per_block : 0;
        for (int32_t b = 0; b < nb[il]; b++) per[pos++] = bytes;
    }
    if (ls_mode_rank_order(e->n_layers, nb, rank, &order, &total) != LS_OK) goto done;
    freed = malloc(sizeof(uint64_t) * (size_t) (total + 1));   // freed[i]: sketch bytes of the i best-ranked blocks
    if (!freed) goto done;
    freed[0] = 0;
    for (int64_t i = 0; i < total; i++) freed[i + 1] = freed[i] + per[order[i]];
    // need(lo) <= budget holds (no rows dropped); at most one slot short of every block, so that
    // the cache still evicts (a cache that holds every block keeps the whole sketch too)
    int64_t lo = n_slots, hi = total_blocks - 1 > n_slots ? total_blocks - 1 : n_slots;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo + 1) / 2;
        const int64_t h = ls_hot_set_size((int32_t) mid, working_set, e->params.hot_fraction);
        const uint64_t need = (uint64_t) mid * stride + resident - freed[h < total ? h : total];
        if (need <= budget) lo = mid; else hi = mid - 1;
    }
    n_slots = lo;
done:
    free(nb); free(per); free(order); free(freed);
    return n_slots;
}

// Drop the sketch rows of layer L's hot blocks (they become always-candidates); the budget's
// resident share shrinks with them.
static ls_status drop_hot_sketch_rows(ls_engine * e, ls_layer * L) {
    int32_t n_hot = 0;
    for (int32_t b = 0; b < L->info.n_blocks; b++) n_hot += L->f.hot[b] != 0;
    if (!L->sketch || n_hot == 0) return LS_OK;
    e->resident_bytes -= L->sketch->bytes;
    const ls_status st = ls_sketch_drop_blocks(L->sketch, L->f.hot, L->info.neurons_per_block);
    e->resident_bytes += L->sketch->bytes;
    L->n_always = n_hot;
    return st;
}

// ---- creation, in steps: each one either succeeds or leaves what it made for ls_engine_free ----

// What the layers' files add up to (open_layers): the cache and the plan are sized from it.
typedef struct layer_totals {
    uint64_t stride;            // the cache's slot size (ls_cache_stride; set by size_cache)
    uint64_t total_bytes;       // every block of every layer
    uint64_t resident;          // sketches + predictors, held in RAM
    size_t   xs_bytes;          // the largest sketch input (ls_sketch_xq_bytes)
    int64_t  max_rows;          // the largest n_blocks * k
    int32_t  total_blocks, max_layer_blocks;
    int32_t  max_working_set;   // the most blocks one op pins
} layer_totals;

// The engine with its parameters (defaults resolved in rp) and empty layers; nothing opened yet.
static ls_status new_engine(const ls_engine_params * rp, ls_engine ** out) {
    ls_engine * e = calloc(1, sizeof(*e));
    if (!e) { ls_set_error("out of memory"); return LS_ERR_NOMEM; }
    e->params = *rp;
    e->policy = ls_mode_policy_of(rp->mode);
    if (rp->test_hooks) e->hooks = *rp->test_hooks;
    e->params.block_paths = NULL; // not owned
    e->params.predictor_paths = NULL;
    e->params.sketch_paths = NULL;
    e->params.block_rank = NULL;
    e->params.test_hooks = NULL;
    e->direct_io = true;
    pthread_mutex_init(&e->op_mu, NULL);
    pthread_mutex_init(&e->mu, NULL);
    pthread_mutex_init(&e->err.mu, NULL);
    *out = e;
    e->layers = calloc((size_t) rp->n_layers, sizeof(ls_layer));
    if (!e->layers) { ls_set_error("out of memory"); return LS_ERR_NOMEM; }
    e->n_layers = rp->n_layers;
    for (int32_t il = 0; il < e->n_layers; il++) e->layers[il].f.fd = -1;
    return LS_OK;
}

// Layer il's predictor, checked against the layer it is given for.
static ls_status load_predictor(ls_layer * L, int32_t il, const char * path) {
    ls_predictor_info pi;
    ls_status st = ls_predictor_load(path, &L->pred);
    if (st == LS_OK) st = ls_predictor_get_info(L->pred, &pi);
    if (st == LS_OK && pi.layer >= 0 && pi.layer != il) {  // -1: written without a layer
        ls_set_error("%s: predictor trained for layer %d, given for layer %d", path, pi.layer, il);
        st = LS_ERR_FORMAT;
    }
    if (st == LS_OK && (pi.n_blocks != L->info.n_blocks || pi.n_embd != L->info.n_embd)) {
        ls_set_error("%s: predictor for %d blocks of n_embd %d, layer %d has %d blocks of n_embd %lld",
                     path, pi.n_blocks, pi.n_embd, il, L->info.n_blocks, (long long) L->info.n_embd);
        st = LS_ERR_FORMAT;
    }
    return st;
}

// Layer L's blocks in the totals: its bytes, and the blocks one op on it pins (a sparse decode's
// kept blocks, a cascade's candidates, dense: all).
static void add_to_totals(const ls_engine * e, const ls_layer * L, layer_totals * t) {
    const ls_layer_info * in = &L->info;
    if ((int64_t) in->n_blocks * in->neurons_per_block > t->max_rows) t->max_rows = (int64_t) in->n_blocks * in->neurons_per_block;
    t->total_blocks += in->n_blocks;
    t->total_bytes += (uint64_t) in->n_blocks * in->block_stride;
    const int32_t ws = !e->policy->sparse ? in->n_blocks :
                       L->sketch ? ls_candidate_blocks(in->n_blocks, e->params.sparsity, e->params.candidate_ratio) :
                       ls_kept_blocks(in->n_blocks, e->params.sparsity);
    if (ws > t->max_working_set) t->max_working_set = ws;
    if (in->n_blocks > t->max_layer_blocks) t->max_layer_blocks = in->n_blocks;
}

// Every layer's block file, predictor and (modes that use one) sketch.
static ls_status open_layers(ls_engine * e, const ls_engine_params * p, layer_totals * t) {
    for (int32_t il = 0; il < p->n_layers; il++) {
        ls_layer * L = &e->layers[il];
        if (!p->block_paths[il]) { ls_set_error("block path of layer %d is NULL", il); return LS_ERR_ARG; }
        ls_status st = open_layer(e, L, il, p->block_paths[il]);
        if (st != LS_OK) return st;
        if (L->info.n_embd != e->layers[0].info.n_embd) {
            ls_set_error("%s: n_embd %lld differs from layer 0", p->block_paths[il], (long long) L->info.n_embd);
            return LS_ERR_FORMAT;
        }
        if (p->predictor_paths && p->predictor_paths[il]) {
            if ((st = load_predictor(L, il, p->predictor_paths[il])) != LS_OK) return st;
            t->resident += predictor_bytes(L->pred);
        }
        if (p->sketch_paths && p->sketch_paths[il] && (e->policy->uses & LS_USES_SKETCH)) {
            if ((st = ls_sketch_load(p->sketch_paths[il], L, &L->sketch)) != LS_OK) return st;
            t->resident += L->sketch->bytes;
            const size_t xb = ls_sketch_xq_bytes(L->sketch, L->info.n_embd);
            if (xb > t->xs_bytes) t->xs_bytes = xb;
        }
        add_to_totals(e, L, t);
    }
    return LS_OK;
}

// The layers' block files, as the cache and the reader take them (malloc'd; NULL: out of memory)
static ls_blockfile ** layer_files(ls_engine * e) {
    ls_blockfile ** files = malloc(sizeof(*files) * (size_t) e->n_layers);
    if (!files) { ls_set_error("out of memory"); return NULL; }
    for (int32_t il = 0; il < e->n_layers; il++) files[il] = &e->layers[il].f;
    return files;
}

// A budget that cannot hold one layer's working set, refused with the numbers.
static ls_status refuse_budget(const ls_engine * e, const ls_engine_params * p, const layer_totals * t) {
    const unsigned long long ws_bytes = (unsigned long long) t->max_working_set * t->stride;
    if (t->resident > 0 && p->memory_budget > 0) {
        ls_set_error("memory budget %llu bytes is too small: the sketches and predictors take %llu bytes and one "
                     "layer's working set is %d blocks x %llu bytes = %llu bytes more",
                     (unsigned long long) p->memory_budget, (unsigned long long) t->resident, t->max_working_set,
                     (unsigned long long) t->stride, ws_bytes);
    } else {
        ls_set_error("memory budget %llu bytes is too small: one layer's working set is %d blocks "
                     "x %llu bytes = %llu bytes (%s); the whole FFN is %llu bytes",
                     (unsigned long long) p->memory_budget, t->max_working_set, (unsigned long long) t->stride,
                     ws_bytes, e->policy->sparse ? "the blocks computed per token" : "dense: every block of a layer",
                     (unsigned long long) t->total_bytes);
    }
    return LS_ERR_BUDGET;
}

// Budget -> slots (ls_cache_slots). Unlimited (0) or a budget covering everything: one slot per
// block, read once and kept. Dense mode pins a whole layer while it computes. The budget covers
// the sketches and predictors too: the slots get what they leave.
static ls_status size_cache(ls_engine * e, const ls_engine_params * p, layer_totals * t) {
    ls_blockfile ** files = layer_files(e);
    if (!files) return LS_ERR_NOMEM;
    t->stride = ls_cache_stride(files, e->n_layers);
    e->resident_bytes = t->resident;
    int64_t n_slots = ls_cache_slots(p->memory_budget, t->resident, t->stride, t->total_blocks);
    if (n_slots < t->total_blocks && n_slots >= t->max_working_set && drops_sketch_rows(e, p))
        n_slots = slots_with_dropped_rows(e, p->block_rank, n_slots, t->total_blocks, t->stride, t->resident,
                                          p->memory_budget, t->max_working_set);
    const ls_status st = n_slots >= t->max_working_set ? ls_cache_init(&e->cache, files, e->n_layers, (int32_t) n_slots)
                                                       : refuse_budget(e, p, t);
    free(files);
    return st;
}

// The plan's block lists and the cascade's scratch, for the widest layer.
static ls_status alloc_plan(ls_engine * e, const layer_totals * t) {
    ls_plan * P = &e->plan;
    ls_cascade * C = &P->cascade;
    const size_t nb = (size_t) t->max_layer_blocks, rows = (size_t) (t->max_rows > 0 ? t->max_rows : 1);
    P->blocks   = malloc(sizeof(int32_t) * nb);
    P->scratch  = malloc(sizeof(int32_t) * nb);
    P->scratch2 = malloc(sizeof(int32_t) * nb);
    C->score    = malloc(sizeof(float) * nb);
    C->hscore   = malloc(sizeof(float) * nb);
    C->loaded   = malloc(nb);
    C->sel      = malloc(sizeof(int32_t) * nb);
    C->hval     = malloc(sizeof(float) * rows);
    C->dh       = malloc(sizeof(float) * rows);
    C->dcols    = malloc(sizeof(void *) * rows);
    C->xs       = malloc(t->xs_bytes > 0 ? t->xs_bytes : 1);
    if (!P->blocks || !P->scratch || !P->scratch2 || !C->score || !C->hscore || !C->loaded || !C->sel || !C->hval ||
        !C->dh || !C->dcols || !C->xs) {
        ls_set_error("out of memory");
        return LS_ERR_NOMEM;
    }
    return LS_OK;
}

// Dense mode's pinned set given a block_rank: every layer's best-ranked blocks, ranked by runs of
// one read's length (max_read_bytes), so that the blocks left to stream form runs that one read
// each brings in (pinned single blocks scattered over a layer cut its reads into IOPS-bound pieces:
// x3 the pass time on Qwen2.5-1.5B); each layer's order is kept for the draft's fraction.
static ls_status rank_dense_set(ls_engine * e, const float * block_rank, uint64_t stride, const int32_t * nb,
                                int32_t n_pin, uint8_t ** hot) {
    const int32_t run = (int32_t) (e->params.max_read_bytes / stride) > 1 ? (int32_t) (e->params.max_read_bytes / stride) : 1;
    int64_t total = 0;
    for (int32_t il = 0; il < e->n_layers; il++) total += nb[il];
    float * grank = malloc(sizeof(float) * (size_t) total);
    if (!grank) { ls_set_error("out of memory"); return LS_ERR_NOMEM; }
    for (int32_t il = 0, off = 0; il < e->n_layers; off += nb[il], il++)
        ls_mode_run_rank(nb[il], block_rank + off, run, grank + off);
    ls_status st = ls_mode_pick_hot_per_layer(e->n_layers, nb, grank, n_pin, hot);
    for (int32_t il = 0, off = 0; il < e->n_layers && st == LS_OK; off += nb[il], il++)
        st = ls_mode_rank_layer(nb[il], grank + off, &e->layers[il].rank_order);
    free(grank);
    return st;
}

// Dense decode scans every block of every layer in the same order each token: LRU evicts each
// block just before it is needed again and reads the whole FFN per token. Keep a fixed set
// resident instead (the optimal policy for a cyclic scan) and stream the rest through the slots
// one layer needs: given a block_rank, every layer's best-ranked blocks (an equal share of each
// layer: what the draft FFN of speculative decoding computes with, ls_engine_set_draft); else a
// prefix of the scan.
static ls_status pin_dense_set(ls_engine * e, const float * block_rank, const layer_totals * t) {
    const int32_t n_pin = e->cache.n_slots - t->max_layer_blocks;
    int32_t * nb = malloc(sizeof(int32_t) * (size_t) e->n_layers);
    uint8_t ** hot = malloc(sizeof(uint8_t *) * (size_t) e->n_layers);
    ls_status st = LS_OK;
    if (!nb || !hot) { ls_set_error("out of memory"); st = LS_ERR_NOMEM; }
    for (int32_t il = 0; il < e->n_layers && n_pin > 0 && st == LS_OK; il++) {
        ls_layer * L = &e->layers[il];
        nb[il] = L->info.n_blocks;
        hot[il] = L->f.hot;
    }
    if (st == LS_OK && n_pin > 0) {
        if (block_rank) {
            st = rank_dense_set(e, block_rank, t->stride, nb, n_pin, hot);
        } else {
            for (int32_t il = 0, left = n_pin; il < e->n_layers && left > 0; il++)
                for (int32_t b = 0; b < nb[il] && left > 0; b++, left--) hot[il][b] = 1;
        }
        for (int32_t il = 0; il < e->n_layers && st == LS_OK; il++)
            for (int32_t b = 0; b < nb[il]; b++) e->n_hot += hot[il][b];
    }
    free(nb);
    free(hot);
    return st;
}

// The blocks kept resident for good: dense mode's pinned set, or the hot set of the modes whose
// row has one (the others ignore hot_fraction), whose sketch rows then go.
static ls_status pick_resident_sets(ls_engine * e, const ls_engine_params * p, const layer_totals * t) {
    ls_status st = LS_OK;
    if (!e->policy->sparse && !e->cache.never_evicts) st = pin_dense_set(e, p->block_rank, t);
    if (st == LS_OK && e->policy->hot_fraction > 0.0f && e->params.hot_fraction > 0.0)
        st = pick_hot_set(e, p->block_rank, t->max_working_set);
    // (the slots were sized for it: slots_with_dropped_rows)
    if (st == LS_OK && drops_sketch_rows(e, p) && !e->cache.never_evicts)
        for (int32_t il = 0; il < e->n_layers && st == LS_OK; il++) st = drop_hot_sketch_rows(e, &e->layers[il]);
    return st;
}

// The I/O workers (each block's checksum checked by the compute thread that first uses it), and
// the disk model: only a sparse mode under a budget reads blocks with gaps between them.
static ls_status start_io(ls_engine * e) {
    int32_t max_blocks = 0;
    for (int32_t il = 0; il < e->n_layers; il++)
        if (e->layers[il].info.n_blocks > max_blocks) max_blocks = e->layers[il].info.n_blocks;
    // the queue holds one layer's reads, the next layer's prefetch and reads of prefetched blocks
    // that were let go before they landed, at one block a read
    const ls_io_config cfg = {
        .cache = &e->cache, .err = &e->err, .hooks = &e->hooks, .n_threads = e->params.n_io_threads,
        .max_queue = 3 * max_blocks + 3, .max_read_bytes = e->params.max_read_bytes,
        .check = e->params.verify_checksums ? LS_CHECK_ON_USE : LS_CHECK_NONE,
    };
    ls_status st = ls_io_start(&e->io, &cfg);
    if (st == LS_OK)
        st = ls_io_plan_model(&e->io, e->params.bridge_bytes < 0 && e->policy->sparse && !e->cache.never_evicts,
                              e->params.bridge_bytes);
    return st;
}

static void free_engine(void * e) { ls_engine_free(e); }   // a failed create's cleanup

ls_status ls_engine_create(const ls_engine_params * p, ls_engine ** out) {
    if (out) *out = NULL;   // on every failure
    if (!p || !out || p->n_layers <= 0 || !p->block_paths) { ls_set_error("ls_engine_create: bad arguments"); return LS_ERR_ARG; }
    if (p->activation != LS_ACT_SILU && p->activation != LS_ACT_GELU) { ls_set_error("unknown activation %d", p->activation); return LS_ERR_ARG; }
    ls_engine_params rp = *p;
    ls_status st = ls_params_resolve(&rp);
    if (st != LS_OK) return st;
    if (!ls_cpu_ready()) {
        ls_set_error("ggml's CPU backend is not loaded (no libggml-cpu*.so next to libggml)");
        return LS_ERR_UNSUPPORTED;
    }
    ls_engine * e = NULL;
    layer_totals t = {0};
    st = new_engine(&rp, &e);
    if (st == LS_OK) st = open_layers(e, p, &t);
    if (st == LS_OK) st = size_cache(e, p, &t);
    if (st == LS_OK) st = alloc_plan(e, &t);
    if (st == LS_OK) st = pick_resident_sets(e, p, &t);
    if (st == LS_OK) st = start_io(e);
    if (st != LS_OK) return ls_create_failed(st, free_engine, e);
    *out = e;
    return LS_OK;
}

void ls_engine_free(ls_engine * e) {
    if (!e) return;
    ls_io_stop(&e->io);
    for (int32_t il = 0; il < e->n_layers && e->layers; il++) {
        ls_layer * L = &e->layers[il];
        ls_blockfile_close(&L->f);
        free(L->prio); free(L->prefetch); free(L->order); free(L->mark); free(L->in_prefetch); free(L->last_plan);
        free(L->rank_order);
        if (L->pred) ls_predictor_free(L->pred);
        ls_sketch_free(L->sketch);
        free(L->last_cand); free(L->spec);
        free(L->gu_ptr); free(L->dn_ptr);
    }
    free(e->layers);
    ls_ctrl_free(e);
    ls_cache_free(&e->cache);
    const ls_plan * P = &e->plan;
    free(P->blocks); free(P->scratch); free(P->scratch2);
    const ls_cascade * C = &P->cascade;
    free(C->score); free(C->hscore); free(C->loaded); free(C->sel); free(C->hval); free(C->xs); free(C->dh); free((void *) C->dcols);
    free(P->buf.xq); free(P->buf.acc); free(P->buf.work);
    ls_head_free(&e->head);
    pthread_mutex_destroy(&e->op_mu);
    pthread_mutex_destroy(&e->mu);
    pthread_mutex_destroy(&e->err.mu);
    free(e);
}

ls_status ls_engine_get_params(const ls_engine * e, ls_engine_params * out) {
    if (!e || !out) { ls_set_error("ls_engine_get_params: bad arguments"); return LS_ERR_ARG; }
    *out = e->params;
    return LS_OK;
}

ls_status ls_engine_layer_info(const ls_engine * e, int32_t il, ls_layer_info * out) {
    if (!e || !out || il < 0 || il >= e->n_layers) { ls_set_error("layer %d out of range", il); return LS_ERR_ARG; }
    *out = e->layers[il].info;
    out->split_layout = e->layers[il].gu_ptr != NULL;
    return LS_OK;
}

// layer L's counters and its file's reads added into s
static void add_layer_stats(ls_stats * s, const ls_layer * L) {
#define LS_ADD_COUNTER(name) s->name += atomic_load(&L->stats.name);
    LS_LAYER_COUNTERS(LS_ADD_COUNTER)
#undef LS_ADD_COUNTER
#define LS_ADD_READS(name) s->name += atomic_load(&L->f.stats.name);
    LS_READ_COUNTERS(LS_ADD_READS)
#undef LS_ADD_READS
}

ls_status ls_engine_stats(const ls_engine * e, int32_t il, ls_stats * out) {
    if (!e || !out || il < -1 || il >= e->n_layers) { ls_set_error("layer %d out of range", il); return LS_ERR_ARG; }
    memset(out, 0, sizeof(*out));
    if (il >= 0) {
        add_layer_stats(out, &e->layers[il]);
    } else {
        // totals: every counter summed over layers except tokens (and draft_tokens), which every
        // layer sees once (the model's token rows, so that bytes_read / tokens is bytes per token)
        uint64_t tokens = 0, draft_tokens = 0;
        for (int32_t i = 0; i < e->n_layers; i++) {
            add_layer_stats(out, &e->layers[i]);
            uint64_t t = atomic_load(&e->layers[i].stats.tokens), d = atomic_load(&e->layers[i].stats.draft_tokens);
            if (t > tokens) tokens = t;
            if (d > draft_tokens) draft_tokens = d;
        }
        out->tokens = tokens;
        out->draft_tokens = draft_tokens;
    }
    pthread_mutex_lock((pthread_mutex_t *) &e->mu);
    if (il >= 0) {
        int32_t n = 0;
        for (int32_t b = 0; b < e->layers[il].info.n_blocks; b++) n += e->layers[il].f.slot[b] >= 0;
        out->cache_bytes = (uint64_t) n * e->cache.stride;
    } else {
        out->cache_bytes = (uint64_t) e->cache.n_resident * e->cache.stride;
    }
    pthread_mutex_unlock((pthread_mutex_t *) &e->mu);
    out->cache_capacity = (uint64_t) e->cache.n_slots * e->cache.stride;
    out->direct_io = e->direct_io ? 1 : 0;
    out->io_cpu_ns = atomic_load(&e->io.cpu_ns);
    out->io_per_io_ns = e->io.per_io_ns;
    out->io_bandwidth = e->io.bandwidth;
    out->bridge_bytes = e->io.bridge_bytes;
    out->hot_blocks = (uint64_t) e->n_hot;
    if (il >= 0) {
        const ls_layer * L = &e->layers[il];
        out->resident_bytes = (L->sketch ? L->sketch->bytes : 0) + predictor_bytes(L->pred);
    } else {
        out->resident_bytes = e->resident_bytes;
    }
    return LS_OK;
}

void ls_engine_reset_stats(ls_engine * e) {
    if (!e) return;
#define LS_RESET_COUNTER(name) atomic_store(&L->stats.name, 0);
#define LS_RESET_READS(name) atomic_store(&L->f.stats.name, 0);
    for (int32_t i = 0; i < e->n_layers; i++) {
        ls_layer * L = &e->layers[i];
        LS_LAYER_COUNTERS(LS_RESET_COUNTER)
        LS_READ_COUNTERS(LS_RESET_READS)
    }
#undef LS_RESET_COUNTER
#undef LS_RESET_READS
    atomic_store(&e->io.cpu_ns, 0);
}

ls_status ls_engine_set_draft(ls_engine * e, int32_t on, float fraction) {
    if (!e || !(fraction > 0.0f && fraction <= 1.0f)) { ls_set_error("ls_engine_set_draft: fraction must be in (0, 1], got %g", (double) fraction); return LS_ERR_ARG; }
    ls_engine_lock_between_ops(e);
    e->draft = on != 0;
    e->draft_fraction = fraction;
    ls_engine_unlock_between_ops(e);
    return LS_OK;
}

ls_status ls_engine_set_priorities(ls_engine * e, int32_t il, const float * prio, int32_t n_blocks) {
    if (!e || !prio || il < 0 || il >= e->n_layers || n_blocks != e->layers[il].info.n_blocks) {
        ls_set_error("ls_engine_set_priorities: bad arguments (layer %d, %d blocks)", il, n_blocks);
        return LS_ERR_ARG;
    }
    ls_engine_lock_between_ops(e);
    memcpy(e->layers[il].prio, prio, sizeof(float) * (size_t) n_blocks);
    e->layers[il].prio_ready = true;
    ls_engine_unlock_between_ops(e);
    return LS_OK;
}

ls_status ls_engine_set_hot_blocks(ls_engine * e, int32_t il, const int32_t * blocks, int32_t n) {
    if (!e || il < 0 || il >= e->n_layers || n < 0 || (n > 0 && !blocks)) {
        ls_set_error("ls_engine_set_hot_blocks: bad arguments");
        return LS_ERR_ARG;
    }
    ls_layer * L = &e->layers[il];
    ls_engine_lock_between_ops(e);
    ls_status st = LS_OK;
    for (int32_t i = 0; i < n && st == LS_OK; i++) {
        if (blocks[i] < 0 || blocks[i] >= L->info.n_blocks) { ls_set_error("hot block %d out of range", blocks[i]); st = LS_ERR_ARG; }
        else if (!L->f.hot[blocks[i]]) { ls_cache_set_hot(&e->cache, &L->f, blocks[i], true); e->n_hot++; }
    }
    // a hot block is scored exactly: its sketch rows go (leanstream)
    if (st == LS_OK && (e->policy->uses & LS_USES_SKETCH) && !e->cache.never_evicts) st = drop_hot_sketch_rows(e, L);
    ls_engine_unlock_between_ops(e);
    return st;
}

int32_t ls_engine_last_plan(const ls_engine * e, int32_t il, int32_t * blocks, int32_t cap) {
    if (!e || il < 0 || il >= e->n_layers) return 0;
    const ls_layer * L = &e->layers[il];
    pthread_mutex_lock((pthread_mutex_t *) &e->mu);
    int32_t n = L->n_last_plan;
    if (blocks) memcpy(blocks, L->last_plan, sizeof(int32_t) * (size_t) (n < cap ? n : cap));
    pthread_mutex_unlock((pthread_mutex_t *) &e->mu);
    return n;
}

int32_t ls_engine_last_candidates(const ls_engine * e, int32_t il, int32_t * blocks, int32_t cap) {
    if (!e || il < 0 || il >= e->n_layers) return 0;
    const ls_layer * L = &e->layers[il];
    pthread_mutex_lock((pthread_mutex_t *) &e->mu);
    int32_t n = L->n_last_cand;
    if (blocks) memcpy(blocks, L->last_cand, sizeof(int32_t) * (size_t) (n < cap ? n : cap));
    pthread_mutex_unlock((pthread_mutex_t *) &e->mu);
    return n;
}

ls_status ls_engine_sketch_scores(ls_engine * e, int32_t il, const float * x, float * score, int32_t n_blocks) {
    if (!e || !x || !score || il < 0 || il >= e->n_layers || n_blocks != e->layers[il].info.n_blocks) {
        ls_set_error("ls_engine_sketch_scores: bad arguments");
        return LS_ERR_ARG;
    }
    const ls_layer * L = &e->layers[il];
    if (!L->sketch) { ls_set_error("layer %d has no sketch", il); return LS_ERR_UNSUPPORTED; }
    void * xq = malloc(ls_sketch_xq_bytes(L->sketch, L->info.n_embd));
    if (!xq) { ls_set_error("out of memory"); return LS_ERR_NOMEM; }
    ls_sketch_quantize_x(L->sketch, x, xq, L->info.n_embd);
    ls_sketch_score(L->sketch, xq, L->info.n_embd, e->params.activation, L->info.neurons_per_block, 0, n_blocks, score);
    free(xq);
    return LS_OK;
}

ls_status ls_engine_resident(const ls_engine * e, int32_t il, uint8_t * resident, int32_t n_blocks) {
    if (!e || !resident || il < 0 || il >= e->n_layers || n_blocks != e->layers[il].info.n_blocks) {
        ls_set_error("ls_engine_resident: bad arguments");
        return LS_ERR_ARG;
    }
    pthread_mutex_lock((pthread_mutex_t *) &e->mu);
    for (int32_t b = 0; b < n_blocks; b++) resident[b] = e->layers[il].f.slot[b] >= 0;
    pthread_mutex_unlock((pthread_mutex_t *) &e->mu);
    return LS_OK;
}

ls_status ls_engine_set_capture(ls_engine * e, int32_t il, float * h, int32_t rows) {
    if (!e || il < 0 || il >= e->n_layers || (h && rows <= 0)) {
        ls_set_error("ls_engine_set_capture: bad arguments");
        return LS_ERR_ARG;
    }
    ls_layer * L = &e->layers[il];
    ls_engine_lock_between_ops(e);
    L->capture = h;
    L->capture_rows = h ? rows : 0;
    L->capture_n = 0;
    ls_engine_unlock_between_ops(e);
    return LS_OK;
}

int32_t ls_engine_capture_rows(const ls_engine * e, int32_t il) {
    if (!e || il < 0 || il >= e->n_layers) return 0;
    return e->layers[il].capture_n;
}
