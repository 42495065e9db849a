// moe.c — the mixture-of-experts op: a layer's routed experts computed from expert files
// (docs/formats.md "Expert file"), exactly as llama.cpp's build_moe_ffn computes them with
// separate gate and up experts:
//
//   for token t, k < n_used, e = selected[k, t], w = weights[k, t]:
//     x~    = x_t quantized to gate's (and up's) vec_dot_type     (from_float, once per token)
//     h     = act(gate_e . x~) * (up_e . x~)                       [n_ff_exp] f32 (vec_dot per row)
//     h~    = h quantized to down's vec_dot_type
//     p_k   = (down_e . h~) * w                                     [n_embd]   (vec_dot per row)
//   y_t = ((p_0 + p_1) + p_2) + ...                                 in k order, as llama.cpp adds them
//
// Every product p_k is kept until all are done and the sum is taken in k order at the end, so the
// output depends neither on the thread count nor on when reads land.
//
// Work: the batch's distinct experts ("entries") are computed one after another by all threads
// together: each thread its part of (block of down's vec_dot_type of n_ff_exp) x (pair) items of
// gate/up rows, quantizing its own items' h~ (no second barrier; gate_up_part cuts finer, with
// one, when there are fewer items than threads), one barrier, then its part of the n_embd down
// rows. h~ alternates between two buffers by entry parity: a thread writing entry i + 1's h~ has
// passed the barrier that every thread reaches only after finishing entry i - 1's down rows.
//
// Blocks: a layer's experts are the blocks of its expert file, kept in the blocks' one cache
// (cache.c: slots shared by all layers, the hot set of ls_moe_pin, pick_victim) and read by the
// blocks' one reader (io.c: each expert's CRC-32C checked on the I/O worker, while the expert
// before it computes). What is this file's own is how a layer chooses its blocks: the router's
// ids. An op pins the batch's resident experts (hits) and computes them first while the missing
// ones (misses) are read, in file order (adjacent blocks merge into one read; co-activation
// placement makes that common). Misses take slots while there are any to take; after each entry's
// barrier thread 0 lets the previous entry go and gives slots to the next misses, so a batch
// larger than the cache streams through it in waves: 2 slots free of the hot set suffice (one
// computed while the next one loads).

#include "internal.h"

#include "ggml.h"
#include "ggml-cpu.h"

#include <stdlib.h>
#include <string.h>

void ls_moe_params_init(ls_moe_params * p) {
    memset(p, 0, sizeof(*p));
    p->n_io_threads = 8;
    p->max_read_bytes = 1u << 20;
    p->verify_checksums = 1;
    p->activation = LS_ACT_SILU;
    p->act_alpha = 1.702f;   // (SwiGLU-OAI's, as build_moe_ffn hard-codes them)
    p->act_limit = 7.0f;
    p->read_ahead = LS_AHEAD_OFF;
    p->ahead_min_precision = 0.9f;
    p->ahead_max_tokens = 8;
    p->ahead_top = 3;
    p->evict = LS_EVICT_LFU;
}

static const uint8_t * block_ptr(const ls_moe * m, const ls_moe_layer * L, int32_t b) {
    return ls_cache_slot_ptr(&m->cache, L->f.slot[b]);
}

// ---- lifetime --------------------------------------------------------------------------------------

static ls_status check_params(const ls_moe_params * p, const char * const * paths) {
    if (p->n_layer <= 0 || !paths) { ls_set_error("ls_moe_create: n_layer must be > 0 and paths given"); return LS_ERR_ARG; }
    if (p->n_io_threads < 1 || p->n_io_threads > LS_MAX_IO_THREADS) {
        ls_set_error("ls_moe_create: n_io_threads %d outside [1, %d]", p->n_io_threads, LS_MAX_IO_THREADS);
        return LS_ERR_ARG;
    }
    if (p->activation < LS_ACT_SILU || p->activation > LS_ACT_SWIGLU_OAI || (p->weight_before != 0 && p->weight_before != 1)) {
        ls_set_error("ls_moe_create: unknown activation %d or weight_before %d (0 or 1)", p->activation, p->weight_before);
        return LS_ERR_ARG;
    }
    if (p->max_read_bytes == 0) { ls_set_error("ls_moe_create: max_read_bytes must be > 0"); return LS_ERR_ARG; }
    if (p->read_ahead < LS_AHEAD_OFF || p->read_ahead > LS_AHEAD_ON || !(p->ahead_min_precision >= 0.0f && p->ahead_min_precision <= 1.0f) ||
        p->ahead_max_tokens < 0 || p->ahead_top < 0 || (p->evict != LS_EVICT_LRU && p->evict != LS_EVICT_LFU)) {
        ls_set_error("ls_moe_create: read_ahead %d (0, 1 or 2), ahead_min_precision %g (0..1), ahead_max_tokens %d (>= 0), "
                     "evict %d (0 or 1)", p->read_ahead, (double) p->ahead_min_precision, p->ahead_max_tokens, p->evict);
        return LS_ERR_ARG;
    }
    return LS_OK;
}

// Layer il's expert file into L: the header's fields into L->info, the router's index -> block.
static ls_status open_layer(ls_moe * m, ls_moe_layer * L, int32_t il, const char * path) {
    ls_file_header h;
    ls_status st = ls_blockfile_open(&L->f, LS_FILE_EXPERTS, il, path, !m->hooks.buffered_io, &m->direct_io, &h);
    if (st != LS_OK) return st;
    L->info = (ls_moe_info) { .n_embd = h.n_embd, .n_ff_exp = h.n_ff, .n_expert = L->f.n_blocks, .gate_type = h.type[0],
                              .up_type = h.type[1], .down_type = h.type[2], .expert_stride = L->f.stride, .flags = h.flags };
    L->gate_off = h.extra_bytes;   // the f32 extras first: biases, then scales
    L->bias_at = h.flags & LS_EXPERT_BIASES ? 0 : -1;
    L->scale_at = h.flags & LS_EXPERT_SCALES ? (h.flags & LS_EXPERT_BIASES ? 2 * h.n_ff + h.n_embd : 0) : -1;
    L->gate_bytes = h.part_bytes[0];
    L->up_bytes = h.part_bytes[1];
    L->down_bytes = h.part_bytes[2];
    L->block_of_expert = malloc(sizeof(int32_t) * (size_t) L->f.n_blocks);
    if (!L->block_of_expert) { ls_set_error("out of memory"); return LS_ERR_NOMEM; }
    for (int32_t b = 0; b < L->f.n_blocks; b++) L->block_of_expert[L->f.ids[b]] = b;   // (a permutation: checked)
    return ls_moe_ahead_layer_init(L);
}

// Every layer's expert file; the cache over all of them: memory_budget -> slots (ls_cache_slots),
// at least 2 (one expert computed while the next one loads).
static ls_status open_blocks(ls_moe * m, const char * const * paths) {
    ls_blockfile ** files = malloc(sizeof(*files) * (size_t) m->n_layer);
    if (!files) { ls_set_error("out of memory"); return LS_ERR_NOMEM; }
    int32_t n = 0;
    int64_t total = 0;
    ls_status st = LS_OK;
    for (int32_t il = 0; il < m->n_layer && st == LS_OK; il++) {
        ls_moe_layer * L = &m->layers[il];
        files[il] = &L->f;   // (a layer without experts: an empty file of no blocks)
        if (!paths[il]) continue;
        st = open_layer(m, L, il, paths[il]);
        total += L->f.n_blocks;
        n++;
    }
    if (st == LS_OK && n == 0) { ls_set_error("ls_moe_create: no layer has an expert file"); st = LS_ERR_ARG; }
    const uint64_t stride = st == LS_OK ? ls_cache_stride(files, m->n_layer) : 0;
    const int64_t n_slots = st == LS_OK ? ls_cache_slots(m->params.memory_budget, 0, stride, total) : 0;
    if (st == LS_OK && n_slots < 2 && total >= 2) {
        ls_set_error("memory_budget %llu holds %d expert slot(s) of %llu bytes (the largest layer's expert, aligned); "
                     "the MoE op needs at least 2 (%llu bytes): one expert computed while the next one loads",
                     (unsigned long long) m->params.memory_budget, (int) n_slots, (unsigned long long) stride,
                     (unsigned long long) (2 * stride));
        st = LS_ERR_BUDGET;
    }
    if (st == LS_OK) st = ls_cache_init(&m->cache, files, m->n_layer, (int32_t) n_slots);
    m->cache.evict = m->params.evict;
    free(files);
    return st;
}

static void free_moe(void * m) { ls_moe_free(m); }   // a failed create's cleanup

ls_status ls_moe_create(const ls_moe_params * p, const char * const * paths, ls_moe ** out) {
    if (!p || !out) { ls_set_error("ls_moe_create: null argument"); return LS_ERR_ARG; }
    *out = NULL;
    ls_status st = check_params(p, paths);
    if (st != LS_OK) return st;
    ls_moe * m = calloc(1, sizeof(*m));
    if (!m) { ls_set_error("out of memory"); return LS_ERR_NOMEM; }
    m->params = *p;
    m->params.test_hooks = NULL;
    if (p->test_hooks) m->hooks = *p->test_hooks;
    m->n_layer = p->n_layer;
    m->direct_io = !m->hooks.buffered_io;
    pthread_mutex_init(&m->op_mu, NULL);
    pthread_mutex_init(&m->err.mu, NULL);
    m->layers = calloc((size_t) m->n_layer, sizeof(ls_moe_layer));
    if (!m->layers) { ls_set_error("out of memory"); free(m); return LS_ERR_NOMEM; }
    for (int32_t il = 0; il < m->n_layer; il++) { m->layers[il].m = m; m->layers[il].f.il = il; m->layers[il].f.fd = -1; }
    st = open_blocks(m, paths);
    // at most one read per cache slot is ever queued (a slot is read into once, then computed)
    const ls_io_config cfg = {
        .cache = &m->cache, .err = &m->err, .hooks = &m->hooks, .n_threads = m->params.n_io_threads,
        .max_queue = m->cache.n_slots + 1, .max_read_bytes = m->params.max_read_bytes,
        .check = m->params.verify_checksums ? LS_CHECK_ON_READ : LS_CHECK_NONE,
    };
    if (st == LS_OK) st = ls_io_start(&m->io, &cfg);
    if (st != LS_OK) return ls_create_failed(st, free_moe, m);
    *out = m;
    return LS_OK;
}

static void plan_free(ls_moe_plan * P) {
    free(P->entry_block); free(P->entry_pair0); free(P->pairs); free(P->pair_entry); free(P->pair_w);
    free((void *) P->entry_state); free(P->entry_of); free(P->xq); free(P->h);
    free(P->hq[0]); free(P->hq[1]); free(P->out); free(P->xw); free(P->rq); free(P->logits); free(P->ahead_list);
}

void ls_moe_free(ls_moe * m) {
    if (!m) return;
    ls_io_stop(&m->io);
    for (int32_t il = 0; il < m->n_layer && m->layers; il++) {
        ls_blockfile_close(&m->layers[il].f);
        free(m->layers[il].block_of_expert);
        ls_moe_ahead_layer_free(&m->layers[il]);
    }
    free(m->layers);
    ls_cache_free(&m->cache);
    plan_free(&m->plan);
    pthread_mutex_destroy(&m->op_mu);
    pthread_mutex_destroy(&m->err.mu);
    free(m);
}

static ls_moe_layer * layer_of(const ls_moe * m, int32_t il) {
    if (!m || il < 0 || il >= m->n_layer || m->layers[il].f.fd < 0) return NULL;
    return &m->layers[il];
}

ls_status ls_moe_layer_info(const ls_moe * m, int32_t il, ls_moe_info * out) {
    const ls_moe_layer * L = layer_of(m, il);
    if (!L || !out) { ls_set_error("ls_moe_layer_info: layer %d has no expert file", il); return LS_ERR_ARG; }
    *out = L->info;
    return LS_OK;
}

ls_status ls_moe_take_error(ls_moe * m, char * msg, size_t msg_size) {
    if (!m) return LS_ERR_ARG;
    return ls_error_slot_take(&m->err, msg, msg_size);
}

// ---- the hot set -------------------------------------------------------------------------------

// The blocks of `want` absent from the cache read now, by file order (each holds the hot set's
// pin once loaded); returns how many could not be (their slots freed, out of the hot set).
static int32_t load_hot(ls_moe * m, ls_moe_layer * L, const uint8_t * want, int32_t * load) {
    ls_blockfile * F = &L->f;
    int32_t n = 0, failed = 0, slot;
    bool miss;
    for (int32_t b = 0; b < F->n_blocks; b++)
        if (want[b] && F->slot[b] < 0 && ls_cache_acquire(&m->cache, F, b, &slot, &miss) == LS_OK) load[n++] = b;
    ls_io_submit(&m->io, F, load, n, NULL);
    for (int32_t i = 0; i < n; i++) {
        const int32_t b = load[i];
        ls_wait_while(&F->state[b], LS_BLK_LOADING, &m->io.sleepers);
        if (atomic_load_explicit(&F->state[b], memory_order_acquire) == LS_BLK_READY) {
            ls_cache_release(&m->cache, F, b, false);   // (the hot set's pin stays)
            continue;
        }
        ls_cache_drop(&m->cache, F, b, false);
        F->hot[b] = 0;
        m->n_hot--;
        failed++;
    }
    atomic_fetch_add(&L->stats.pin_loads, (uint64_t) (n - failed));
    return failed;
}

// want[b] = 1 for the blocks of experts[n]; LS_ERR_ARG for an expert the layer has not
static ls_status blocks_wanted(const ls_moe_layer * L, const int32_t * experts, int32_t n, uint8_t * want, int32_t * n_new) {
    *n_new = 0;
    for (int32_t i = 0; i < n; i++) {
        if (experts[i] < 0 || experts[i] >= L->info.n_expert) {
            ls_set_error("ls_moe_pin: layer %d has no expert %d (it has %d)", L->f.il, experts[i], L->info.n_expert);
            return LS_ERR_ARG;
        }
        const int32_t b = L->block_of_expert[experts[i]];
        *n_new += !want[b];
        want[b] = 1;
    }
    return LS_OK;
}

static ls_status pin_locked(ls_moe * m, ls_moe_layer * L, const int32_t * experts, int32_t n) {
    ls_blockfile * F = &L->f;
    uint8_t * want = calloc((size_t) F->n_blocks, 1);
    int32_t * load = malloc((size_t) F->n_blocks * sizeof(int32_t));
    int32_t n_new = 0, n_old = 0;
    ls_status st = want && load ? blocks_wanted(L, experts, n, want, &n_new) : LS_ERR_NOMEM;
    if (st == LS_ERR_NOMEM) ls_set_error("out of memory");
    for (int32_t b = 0; b < F->n_blocks; b++) n_old += F->hot[b];
    if (st == LS_OK && n_new > 0 && m->n_hot - n_old + n_new > m->cache.n_slots - 2) {
        ls_set_error("ls_moe_pin: layer %d: %d hot experts (%d in all layers) leave fewer than 2 of the cache's %d slots "
                     "to stream the others through", F->il, n_new, m->n_hot - n_old + n_new, m->cache.n_slots);
        st = LS_ERR_BUDGET;
    }
    if (st == LS_OK) {
        // the old hot set let go (evictable from now on), the new one kept (its resident blocks pinned)
        for (int32_t b = 0; b < F->n_blocks; b++)
            if (F->hot[b] != want[b]) ls_cache_set_hot(&m->cache, F, b, want[b]);
        m->n_hot += n_new - n_old;
        const int32_t failed = load_hot(m, L, want, load);
        if (failed) {
            char msg[LS_MAX_ERRMSG];
            st = ls_moe_take_error(m, msg, sizeof(msg));
            if (st == LS_OK) st = LS_ERR_IO;
            ls_set_error("ls_moe_pin: %d of layer %d's hot experts could not be loaded: %s", failed, F->il, msg);
        }
    }
    free(want);
    free(load);
    return st;
}

ls_status ls_moe_pin(ls_moe * m, int32_t il, const int32_t * experts, int32_t n) {
    ls_moe_layer * L = layer_of(m, il);
    if (!L || n < 0 || (n > 0 && !experts)) { ls_set_error("ls_moe_pin: bad arguments (layer %d)", il); return LS_ERR_ARG; }
    pthread_mutex_lock(&m->op_mu);
    const ls_status st = pin_locked(m, L, experts, n);
    pthread_mutex_unlock(&m->op_mu);
    return st;
}

// ---- the op: planning (thread 0) ---------------------------------------------------------------

// Where the op finds its inputs: x rows, the router's choices and weights by (k, t) byte strides.
typedef struct moe_args {
    ls_moe_layer * L;
    const float *  x;
    size_t         x_stride;
    const uint8_t * ids;
    size_t         ids_k, ids_t;
    const uint8_t * w;
    size_t         w_k, w_t;
    int32_t        n_used;
    int64_t        n_tokens;
    float *        y;
    size_t         y_stride;
} moe_args;

static bool grow_plan(ls_moe_plan * P, const ls_moe_layer * L, int64_t n_pairs) {
    const size_t ne = (size_t) L->info.n_expert + 1, np = (size_t) n_pairs;
    size_t cap = P->entry_cap;   // the entry arrays share one capacity (each grown from it)
    bool ok = true;
#define GROW_E(f) do { size_t c = cap; ok = ok && ls_grow((void **) &P->f, &c, ne, sizeof(*P->f)); } while (0)
    if (ne > P->entry_cap) { GROW_E(entry_block); GROW_E(entry_pair0); GROW_E(entry_state); GROW_E(entry_of); }
    if (ok && ne > P->entry_cap) P->entry_cap = ne;
#undef GROW_E
    cap = P->pair_cap;
#define GROW_P(f) do { size_t c = cap; ok = ok && ls_grow((void **) &P->f, &c, np, sizeof(*P->f)); } while (0)
    if (np > P->pair_cap) { GROW_P(pairs); GROW_P(pair_entry); GROW_P(pair_w); }
    if (ok && np > P->pair_cap) P->pair_cap = np;
#undef GROW_P
    return ok;
}

// compute scratch for this batch: x~ rows, h, h~ (two), the products p
static bool grow_compute(ls_moe_plan * P, const ls_moe_layer * L) {
    const ls_moe_info * in = &L->info;
    const enum ggml_type vg = ls_cpu_traits(in->gate_type)->vec_dot_type, vu = ls_cpu_traits(in->up_type)->vec_dot_type;
    const enum ggml_type vd = ls_cpu_traits(in->down_type)->vec_dot_type;
    P->xq_gate_row = ggml_row_size(vg, in->n_embd);
    P->xq_up_row = vu == vg ? 0 : ggml_row_size(vu, in->n_embd);
    P->hq_row = ggml_row_size(vd, in->n_ff_exp);
    P->ff_blk = ggml_blck_size(vd);
    const size_t T = (size_t) P->n_tokens, mp = (size_t) P->max_pairs;
    P->x_rows = L->m->params.weight_before ? P->n_tokens * P->n_used : P->n_tokens;
    if (L->m->params.weight_before && !ls_grow((void **) &P->xw, &P->xw_cap, (size_t) P->nth * (size_t) in->n_embd, sizeof(float)))
        return false;
    return ls_grow((void **) &P->xq, &P->xq_cap, (size_t) P->x_rows * (P->xq_gate_row + P->xq_up_row), 1) &&
           ls_grow((void **) &P->h, &P->h_cap, mp * (size_t) in->n_ff_exp, sizeof(float)) &&
           ls_grow((void **) &P->hq[0], &P->hq_cap[0], mp * P->hq_row, 1) &&
           ls_grow((void **) &P->hq[1], &P->hq_cap[1], mp * P->hq_row, 1) &&
           ls_grow((void **) &P->out, &P->out_cap, T * (size_t) P->n_used * (size_t) in->n_embd, sizeof(float));
}

// The router's choices read into pair_entry (for now: the block of each pair's expert) and pair_w,
// entry_of[b] = 0 for each block used; the first bad index recorded.
static void read_routes(ls_moe * m, ls_moe_plan * P, const moe_args * a) {
    ls_moe_layer * L = P->L;
    const int32_t ne = L->info.n_expert;
    for (int32_t b = 0; b < ne; b++) P->entry_of[b] = -1;
    int64_t bad = -1;
    int32_t bad_e = 0;
    for (int64_t t = 0; t < a->n_tokens; t++) {
        for (int32_t k = 0; k < a->n_used; k++) {
            const int64_t p = t * a->n_used + k;
            int32_t e;
            memcpy(&e, a->ids + (size_t) t * a->ids_t + (size_t) k * a->ids_k, 4);
            memcpy(&P->pair_w[p], a->w + (size_t) t * a->w_t + (size_t) k * a->w_k, 4);
            if (e < 0 || e >= ne) { P->pair_entry[p] = -1; if (bad < 0) { bad = p; bad_e = e; } continue; }
            P->pair_entry[p] = L->block_of_expert[e];
            P->entry_of[P->pair_entry[p]] = 0;   // used
            L->routed_count[e]++;
        }
    }
    if (bad >= 0)
        ls_error_record(&m->err, LS_ERR_ARG, "%s: layer %d: token %lld routes to expert %d, the layer has %d (its product is left out)",
                        L->f.path, L->f.il, (long long) (bad / a->n_used), bad_e, ne);
}

// Where a block the batch uses stands: 0 resident, 1 landing (a read-ahead's read in flight), 2 absent
// (a read-ahead's failed read dropped first: the op reads it again, and the error is kept).
static int block_where(ls_moe * m, ls_blockfile * F, int32_t b) {
    if (F->slot[b] < 0) return 2;
    const int32_t st = atomic_load_explicit(&F->state[b], memory_order_acquire);
    if (st == LS_BLK_READY) return 0;
    if (st == LS_BLK_LOADING) return 1;
    ls_cache_drop(&m->cache, F, b, false);
    return 2;
}

// The distinct blocks made entries (resident ones first, then those landing, then the missing
// ones, each group in file order) and each entry's pairs listed; read-ahead scored.
static void group_pairs(ls_moe * m, ls_moe_plan * P, const moe_args * a) {
    ls_blockfile * F = &P->L->f;
    const int64_t n_pairs = a->n_tokens * a->n_used;
    read_routes(m, P, a);
    ls_moe_ahead_score(m, P);
    P->n_entries = 0;
    for (int pass = 0; pass < 3; pass++) {          // resident, landing, missing
        for (int32_t b = 0; b < F->n_blocks; b++) {
            if (P->entry_of[b] != 0 || block_where(m, F, b) != pass) continue;
            P->entry_of[b] = P->n_entries + 1;      // (1-based while marking)
            P->entry_block[P->n_entries++] = b;
        }
        if (pass == 0) P->n_hits = P->n_entries;
        if (pass == 1) P->n_landing = P->n_entries - P->n_hits;
    }
    for (int32_t i = 0; i <= P->n_entries; i++) P->entry_pair0[i] = 0;
    for (int64_t p = 0; p < n_pairs; p++) {
        if (P->pair_entry[p] < 0) continue;
        P->pair_entry[p] = P->entry_of[P->pair_entry[p]] - 1;
        P->entry_pair0[P->pair_entry[p] + 1]++;
    }
    P->max_pairs = 1;
    for (int32_t i = 0; i < P->n_entries; i++) {
        const int32_t c = P->entry_pair0[i + 1];
        if (c > P->max_pairs) P->max_pairs = c;
        P->entry_pair0[i + 1] += P->entry_pair0[i];
    }
    int32_t * fill = P->entry_of;                   // reused: next free position of each entry
    for (int32_t i = 0; i < P->n_entries; i++) fill[i] = P->entry_pair0[i];
    for (int64_t p = 0; p < n_pairs; p++)
        if (P->pair_entry[p] >= 0) P->pairs[fill[P->pair_entry[p]]++] = (int32_t) p;
}

// Slots for the next missing entries while any can be had, their reads queued in compute order,
// each setting its entry's state as it lands.
static void top_up(ls_moe * m, ls_moe_plan * P) {
    ls_blockfile * F = &P->L->f;
    const int32_t i0 = P->next_read;
    int32_t slot;
    bool miss;
    while (!P->starved && P->next_read < P->n_entries &&
           ls_cache_acquire(&m->cache, F, P->entry_block[P->next_read], &slot, &miss) == LS_OK) P->next_read++;
    if (P->next_read > i0) {
        ls_io_submit(&m->io, F, P->entry_block + i0, P->next_read - i0, P->entry_state + i0);
        atomic_fetch_add(&P->L->stats.misses, (uint64_t) (P->next_read - i0));
    }
}

// After entry i's barrier (thread 0): entry i - 1 let go, slots for the next misses. Entry i + 1
// always gets one (2 slots free of the hot set: at most entry i holds one); should it not, the
// rest of the batch fails rather than wait for ever.
static void next_wave(ls_moe * m, ls_moe_plan * P, int32_t i) {
    ls_moe_layer * L = P->L;
    if (i > 0 && i - 1 < P->next_read) ls_cache_release(&m->cache, &L->f, P->entry_block[i - 1], true);
    top_up(m, P);
    if (!P->starved && i + 1 < P->n_entries && P->next_read <= i + 1) {
        ls_error_record(&m->err, LS_ERR_BUDGET, "%s: layer %d: no cache slot for expert %d (%d slots, %d hot)",
                        L->f.path, L->f.il, L->f.ids[P->entry_block[i + 1]], m->cache.n_slots, m->n_hot);
        P->starved = true;
        for (int32_t j = P->next_read; j < P->n_entries; j++) {
            atomic_store_explicit(&P->entry_state[j], LS_BLK_FAILED, memory_order_seq_cst);
            ls_wake(&P->entry_state[j], &m->io.sleepers);
        }
    }
}

static void plan_op(ls_moe * m, const moe_args * a, int nth) {
    ls_moe_plan * P = &m->plan;
    ls_moe_layer * L = a->L;
    P->L = L;
    P->n_tokens = a->n_tokens;
    P->n_used = a->n_used;
    P->nth = nth;
    P->x = a->x;
    P->x_stride = a->x_stride;
    P->n_entries = P->n_hits = P->n_landing = P->next_read = 0;
    P->starved = false;
    P->stall_ns = 0;
    if (!grow_plan(P, L, a->n_tokens * a->n_used)) {
        ls_error_record(&m->err, LS_ERR_NOMEM, "layer %d: out of memory planning the MoE op", L->f.il);
        P->n_tokens = 0;   // nothing computed, y zeroed
        return;
    }
    group_pairs(m, P, a);
    if (!grow_compute(P, L)) {
        ls_error_record(&m->err, LS_ERR_NOMEM, "layer %d: out of memory for the MoE op's scratch (%lld tokens)", L->f.il, (long long) a->n_tokens);
        for (int64_t p = 0; p < a->n_tokens * a->n_used; p++) P->pair_entry[p] = -1;
        P->n_entries = 0;
        return;
    }
    int32_t slot;
    bool miss;
    const int32_t held = P->n_hits + P->n_landing;   // resident or landing: a pin each
    for (int32_t i = 0; i < P->n_entries; i++) {
        atomic_store_explicit(&P->entry_state[i], i < P->n_hits ? LS_BLK_READY : 0, memory_order_relaxed);
        if (i < held) ls_cache_acquire(&m->cache, &L->f, P->entry_block[i], &slot, &miss);
    }
    P->next_read = held;
    for (int32_t i = 0; i < P->n_entries; i++) {   // LFU's counts, one per op that computes the block
        uint32_t * u = &L->f.uses[P->entry_block[i]];   // (each held or absent now: out of the cache's list)
        if (*u < UINT32_MAX) (*u)++;
    }
    top_up(m, P);
    atomic_fetch_add(&L->stats.hits, (uint64_t) P->n_hits);
    atomic_fetch_add(&L->stats.experts, (uint64_t) P->n_entries);
    atomic_fetch_add(&L->stats.routed, (uint64_t) P->entry_pair0[P->n_entries]);
    ls_moe_ahead_plan(m, P);   // the next layer's experts, behind this one's misses
}

// ---- the op: computing (every thread) ----------------------------------------------------------

// x~ rows: one per token, or with weight_before one per pair, of w_k * x_t (build_moe_ffn's
// ggml_mul of the repeated input by the weights, then quantized as mul_mat_id quantizes it)
static void quantize_x(const ls_moe_plan * P, int ith, int nth) {
    const ls_moe_info * in = &P->L->info;
    const struct ggml_type_traits_cpu * vg = ls_cpu_traits(ls_cpu_traits(in->gate_type)->vec_dot_type);
    const struct ggml_type_traits_cpu * vu = ls_cpu_traits(ls_cpu_traits(in->up_type)->vec_dot_type);
    const bool per_pair = P->x_rows != P->n_tokens;
    float * xw = per_pair ? P->xw + (size_t) ith * (size_t) in->n_embd : NULL;
    for (int64_t r = ith; r < P->x_rows; r += nth) {
        const int64_t t = per_pair ? r / P->n_used : r;
        const float * xt = (const float *) ((const uint8_t *) P->x + (size_t) t * P->x_stride);
        if (per_pair) {
            for (int64_t c = 0; c < in->n_embd; c++) xw[c] = xt[c] * P->pair_w[r];
            xt = xw;
        }
        vg->from_float(xt, P->xq + (size_t) r * P->xq_gate_row, in->n_embd);
        if (P->xq_up_row) vu->from_float(xt, P->xq + (size_t) P->x_rows * P->xq_gate_row + (size_t) r * P->xq_up_row, in->n_embd);
    }
}

// the f32 extras of a slot: biases (bias_at), scales (scale_at); NULL where the file has none
static const float * slot_f32(const uint8_t * blk, int64_t at) { return at < 0 ? NULL : (const float *) blk + at; }

// h[j][r] = glu(gate_r . x~, up_r . x~) of entry i's pair j, rows [r0, r1); each product times
// its expert's scale, plus its bias, where the file has them (mul_mat_id, then the scale, then
// add_id, as build_moe_ffn orders them)
static void gate_up_rows(ls_moe * m, const ls_moe_plan * P, int32_t i, int32_t j0, int32_t j1, int64_t r0, int64_t r1) {
    const ls_moe_layer * L = P->L;
    const ls_moe_info * in = &L->info;
    const ls_moe_params * pa = &m->params;
    const struct ggml_type_traits_cpu * tg = ls_cpu_traits(in->gate_type), * tu = ls_cpu_traits(in->up_type);
    const uint8_t * blk = block_ptr(m, L, P->entry_block[i]);
    const float * bias = slot_f32(blk, L->bias_at), * scale = slot_f32(blk, L->scale_at);
    const uint8_t * gate = blk + L->gate_off, * up = gate + L->gate_bytes;
    const size_t rg = ggml_row_size(in->gate_type, in->n_embd), ru = ggml_row_size(in->up_type, in->n_embd);
    const int32_t p0 = P->entry_pair0[i];
    const bool per_pair = P->x_rows != P->n_tokens;
    const uint8_t * xu0 = P->xq_up_row ? P->xq + (size_t) P->x_rows * P->xq_gate_row : P->xq;
    const size_t xu_row = P->xq_up_row ? P->xq_up_row : P->xq_gate_row;
    for (int64_t r = r0; r < r1; r++) {   // a row's bytes stay in cache across the pairs
        const uint8_t * grow = gate + (size_t) r * rg, * urow = up + (size_t) r * ru;
        for (int32_t j = j0; j < j1; j++) {
            const int64_t xr = per_pair ? P->pairs[p0 + j] : P->pairs[p0 + j] / P->n_used;
            float g, u;
            tg->vec_dot((int) in->n_embd, &g, 0, grow, 0, P->xq + (size_t) xr * P->xq_gate_row, 0, 1);
            tu->vec_dot((int) in->n_embd, &u, 0, urow, 0, xu0 + (size_t) xr * xu_row, 0, 1);
            if (scale) { g *= scale[0]; u *= scale[1]; }
            if (bias) { g += bias[r]; u += bias[in->n_ff_exp + r]; }
            P->h[(size_t) j * (size_t) in->n_ff_exp + (size_t) r] = ls_glu(pa->activation, g, u, pa->act_alpha, pa->act_limit);
        }
    }
}

// h~ of pair j, values [r0, r1) (whole blocks of down's vec_dot_type: the bytes a whole-row
// from_float gives, so any cut gives the same h~)
static void quantize_h(const ls_moe_plan * P, uint8_t * hq, int32_t j, int64_t r0, int64_t r1) {
    const ls_moe_info * in = &P->L->info;
    const enum ggml_type vd = ls_cpu_traits(in->down_type)->vec_dot_type;
    ls_cpu_traits(vd)->from_float(P->h + (size_t) j * (size_t) in->n_ff_exp + (size_t) r0,
                                  hq + (size_t) j * P->hq_row + ggml_row_size(vd, r0), r1 - r0);
}

// h and h~ of entry i's pairs (h~ into hq). The work is cut into items (a block of ff_blk neurons
// for one pair: its h~ bytes are that item's alone), each thread a contiguous run of them, chunk
// by chunk so that a chunk's rows are reused across pairs. When the items do not share out evenly
// (decode of a K-quant expert: n_ff_exp / 256 items, 3 for 768 neurons) the rows are cut finer
// instead and h~ made after a barrier: a decision every thread takes alike (shapes only).
static void gate_up_part(ls_moe * m, const ls_moe_plan * P, int32_t i, uint8_t * hq, int ith, int nth) {
    const int64_t n_ff = P->L->info.n_ff_exp, n_chunks = n_ff / P->ff_blk;
    const int32_t np = P->entry_pair0[i + 1] - P->entry_pair0[i];
    const int64_t n_items = n_chunks * np;
    if (n_items % nth == 0 || n_items >= 4 * nth) {   // items share out evenly enough
        const int64_t lo = n_items * ith / nth, hi = n_items * (ith + 1) / nth;
        for (int64_t c = lo / np; c * np < hi; c++) {   // the run's pairs of chunk c together
            const int32_t j0 = (int32_t) (lo > c * np ? lo - c * np : 0);
            const int32_t j1 = (int32_t) (hi < (c + 1) * np ? hi - c * np : np);
            gate_up_rows(m, P, i, j0, j1, c * P->ff_blk, (c + 1) * P->ff_blk);
            for (int32_t j = j0; j < j1; j++) quantize_h(P, hq, j, c * P->ff_blk, (c + 1) * P->ff_blk);
        }
        return;
    }
    gate_up_rows(m, P, i, 0, np, n_ff * ith / nth, n_ff * (ith + 1) / nth);
    ls_barrier_wait(&m->barrier, nth);
    for (int64_t it = ith; it < n_items; it += nth)
        quantize_h(P, hq, (int32_t) (it % np), it / np * P->ff_blk, (it / np + 1) * P->ff_blk);
}

// p of entry i's pairs for this thread's output rows
static void down_part(ls_moe * m, const ls_moe_plan * P, int32_t i, const uint8_t * hq, int ith, int nth) {
    const ls_moe_layer * L = P->L;
    const ls_moe_info * in = &L->info;
    const struct ggml_type_traits_cpu * td = ls_cpu_traits(in->down_type);
    const uint8_t * blk = block_ptr(m, L, P->entry_block[i]);
    const uint8_t * dn = blk + L->gate_off + L->gate_bytes + L->up_bytes;
    const float * bias = slot_f32(blk, L->bias_at), * scale = slot_f32(blk, L->scale_at);
    const float * db = bias ? bias + 2 * in->n_ff_exp : NULL;
    const bool weighted = !m->params.weight_before;   // (weight_before: w scaled the input)
    const size_t rd = ggml_row_size(in->down_type, in->n_ff_exp);
    const int32_t p0 = P->entry_pair0[i], np = P->entry_pair0[i + 1] - p0;
    const int64_t c0 = in->n_embd * ith / nth, c1 = in->n_embd * (ith + 1) / nth;
    for (int64_t c = c0; c < c1; c++) {
        for (int32_t j = 0; j < np; j++) {
            const int32_t p = P->pairs[p0 + j];
            float v;
            td->vec_dot((int) in->n_ff_exp, &v, 0, dn + (size_t) c * rd, 0, hq + (size_t) j * P->hq_row, 0, 1);
            if (scale) v *= scale[2];
            if (db) v += db[c];
            P->out[(size_t) p * (size_t) in->n_embd + (size_t) c] = weighted ? v * P->pair_w[p] : v;
        }
    }
}

// y_t = ((p_0 + p_1) + p_2) + ... over the pairs whose expert was computed; this thread's share of
// the output values
static void reduce(const ls_moe_plan * P, float * y, size_t y_stride, int ith, int nth) {
    const int64_t n_embd = P->L->info.n_embd, total = P->n_tokens * n_embd;
    const int64_t lo = total * ith / nth, hi = total * (ith + 1) / nth;
    for (int64_t idx = lo; idx < hi; idx++) {
        const int64_t t = idx / n_embd, c = idx % n_embd;
        float acc = 0.0f;
        for (int32_t k = 0; k < P->n_used; k++) {
            const int64_t p = t * P->n_used + k;
            const int32_t i = P->pair_entry[p];
            if (i < 0 || atomic_load_explicit(&P->entry_state[i], memory_order_relaxed) != LS_BLK_READY) continue;
            const float v = P->out[(size_t) p * (size_t) n_embd + (size_t) c];
            acc = k == 0 ? v : acc + v;
        }
        ((float *) ((uint8_t *) y + (size_t) t * y_stride))[c] = acc;
    }
}

// entry i of those landing (a read-ahead's read): its block's state once landed, as the entry's
static void await_landing(ls_moe * m, ls_moe_plan * P, int32_t i) {
    _Atomic int32_t * state = &P->L->f.state[P->entry_block[i]];
    ls_wait_while(state, LS_BLK_LOADING, &m->io.sleepers);
    atomic_store_explicit(&P->entry_state[i], atomic_load_explicit(state, memory_order_acquire), memory_order_release);
}

static void op_entries(ls_moe * m, ls_moe_plan * P, int ith, int nth) {
    for (int32_t i = 0; i < P->n_entries; i++) {
        if (atomic_load_explicit(&P->entry_state[i], memory_order_acquire) == 0) {
            const uint64_t t0 = ith == 0 ? ls_now_ns() : 0;
            if (i >= P->n_hits && i < P->n_hits + P->n_landing) await_landing(m, P, i);
            else ls_wait_while(&P->entry_state[i], 0, &m->io.sleepers);
            if (ith == 0) P->stall_ns += ls_now_ns() - t0;
        }
        const bool ok = atomic_load_explicit(&P->entry_state[i], memory_order_acquire) == LS_BLK_READY;
        if (ok) gate_up_part(m, P, i, P->hq[i & 1], ith, nth);
        ls_barrier_wait(&m->barrier, nth);
        if (ith == 0) next_wave(m, P, i);
        if (ok) down_part(m, P, i, P->hq[i & 1], ith, nth);
    }
}

// thread 0 at the end: the last entry let go, the counters
static void op_end(ls_moe * m, ls_moe_plan * P, uint64_t t0) {
    ls_moe_layer * L = P->L;
    if (P->n_entries > 0 && P->n_entries - 1 < P->next_read) ls_cache_release(&m->cache, &L->f, P->entry_block[P->n_entries - 1], true);
    const uint64_t ns = ls_now_ns() - t0;
    atomic_fetch_add(&L->stats.op_calls, 1);
    atomic_fetch_add(&L->stats.tokens, (uint64_t) P->n_tokens);
    atomic_fetch_add(&L->stats.stall_ns, P->stall_ns);
    atomic_fetch_add(&L->stats.compute_ns, ns > P->stall_ns ? ns - P->stall_ns : 0);
}

static void moe_run(ls_moe * m, const moe_args * a, int ith, int nth) {
    ls_moe_plan * P = &m->plan;
    uint64_t t0 = 0;
    if (ith == 0) {
        t0 = ls_now_ns();
        pthread_mutex_lock(&m->op_mu);
        plan_op(m, a, nth);
    }
    ls_barrier_wait(&m->barrier, nth);
    if (P->n_tokens == 0) {   // planning failed: zeros (the error is recorded)
        for (int64_t t = ith; t < a->n_tokens; t += nth) memset((uint8_t *) a->y + (size_t) t * a->y_stride, 0, sizeof(float) * (size_t) a->L->info.n_embd);
    } else {
        quantize_x(P, ith, nth);
        ls_barrier_wait(&m->barrier, nth);
        op_entries(m, P, ith, nth);
        ls_barrier_wait(&m->barrier, nth);
        reduce(P, a->y, a->y_stride, ith, nth);
    }
    ls_barrier_wait(&m->barrier, nth);
    if (ith == 0) {
        op_end(m, P, t0);
        pthread_mutex_unlock(&m->op_mu);
    }
}

// ---- the ggml node -----------------------------------------------------------------------------

static void moe_compute(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    ls_moe_layer * L = userdata;
    const struct ggml_tensor * cur = dst->src[0], * sel = dst->src[1], * w = dst->src[2];
    const bool w3 = w->ne[0] == 1 && w->ne[1] == sel->ne[0] && w->ne[2] == sel->ne[1];   // [1, n_used, n_tokens]
    const moe_args a = {
        .L = L, .x = cur->data, .x_stride = cur->nb[1],
        .ids = sel->data, .ids_k = sel->nb[0], .ids_t = sel->nb[1],
        .w = w->data, .w_k = w3 ? w->nb[1] : w->nb[0], .w_t = w3 ? w->nb[2] : w->nb[1],
        .n_used = (int32_t) sel->ne[0], .n_tokens = cur->ne[1], .y = dst->data, .y_stride = dst->nb[1],
    };
    moe_run(L->m, &a, ith, nth);
}

struct ggml_tensor * ls_moe_build(struct ggml_context * ctx0, struct ggml_tensor * cur, struct ggml_tensor * selected,
                                  struct ggml_tensor * weights, int32_t il, void * moe) {
    ls_moe * m = moe;
    if (!m || !ctx0 || !cur || !selected || !weights) return NULL;
    ls_moe_layer * L = layer_of(m, il);
    if (!L) {
        ls_error_record(&m->err, LS_ERR_ARG, "llama.cpp asked for the experts of layer %d, which has no expert file", il);
        return NULL;
    }
    const int64_t T = cur->ne[1], U = selected->ne[0];
    const bool w_ok = weights->type == GGML_TYPE_F32 && weights->ne[3] == 1 &&
                      ((weights->ne[0] == 1 && weights->ne[1] == U && weights->ne[2] == T) ||
                       (weights->ne[0] == U && weights->ne[1] == T && weights->ne[2] == 1));
    if (cur->type != GGML_TYPE_F32 || cur->ne[0] != L->info.n_embd || cur->ne[2] * cur->ne[3] != 1 || cur->nb[0] != sizeof(float) ||
        selected->type != GGML_TYPE_I32 || selected->ne[1] != T || selected->ne[2] * selected->ne[3] != 1 ||
        U < 1 || U > L->info.n_expert || !w_ok) {
        ls_error_record(&m->err, LS_ERR_UNSUPPORTED, "layer %d: MoE input [%lld, %lld] %s, selected [%lld, %lld] %s, weights [%lld, %lld, %lld] %s "
                            "do not fit the expert file (n_embd %lld, %d experts)", il,
                            (long long) cur->ne[0], (long long) cur->ne[1], ggml_type_name(cur->type),
                            (long long) selected->ne[0], (long long) selected->ne[1], ggml_type_name(selected->type),
                            (long long) weights->ne[0], (long long) weights->ne[1], (long long) weights->ne[2],
                            ggml_type_name(weights->type), (long long) L->info.n_embd, L->info.n_expert);
        return NULL;
    }
    ls_moe_ahead_find_router(L, selected, (int32_t) U);
    struct ggml_tensor * args[3] = { cur, selected, weights };
    return ggml_custom_4d(ctx0, GGML_TYPE_F32, cur->ne[0], T, 1, 1, args, 3, moe_compute, GGML_N_TASKS_MAX, L);
}

// ---- the op outside a graph ----------------------------------------------------------------------

static void eval_thread(void * p, int ith, int nth) {
    const moe_args * a = p;
    moe_run(a->L->m, a, ith, nth);
}

ls_status ls_moe_eval(ls_moe * m, int32_t il, const float * x, int64_t n_tokens, const int32_t * ids, const float * weights,
                      int32_t n_used, float * y, int32_t n_threads) {
    ls_moe_layer * L = layer_of(m, il);
    if (!L || !x || !ids || !weights || !y || n_tokens <= 0 || n_used < 1 || n_used > L->info.n_expert) {
        ls_set_error("ls_moe_eval: bad arguments (layer %d%s)", il, L ? "" : ": no expert file");
        return LS_ERR_ARG;
    }
    if (n_threads <= 0) n_threads = 1;
    if (n_threads > LS_MAX_TEAM) n_threads = LS_MAX_TEAM;
    const size_t row = sizeof(float) * (size_t) L->info.n_embd;
    const moe_args a = { .L = L, .x = x, .x_stride = row, .ids = (const uint8_t *) ids, .ids_k = 4, .ids_t = 4 * (size_t) n_used,
                         .w = (const uint8_t *) weights, .w_k = 4, .w_t = 4 * (size_t) n_used, .n_used = n_used,
                         .n_tokens = n_tokens, .y = y, .y_stride = row };
    if (!ls_run_team(eval_thread, (void *) &a, n_threads)) { ls_set_error("ls_moe_eval: cannot start %d threads", n_threads); return LS_ERR_NOMEM; }
    return ls_error_slot_raise(&m->err);
}

// ---- counters ----------------------------------------------------------------------------------

static void add_layer(const ls_moe * m, const ls_moe_layer * L, ls_moe_counters * out) {
    // every counter sums over layers but tokens: each layer sees the same token rows, so the
    // model's are the most any layer saw (the dense engine's totals do the same)
    const uint64_t tokens = out->tokens;
#define LS_MOE_ADD(name) out->name += atomic_load(&L->stats.name);
    LS_MOE_COUNTERS(LS_MOE_ADD)
#undef LS_MOE_ADD
    const uint64_t mine = atomic_load(&L->stats.tokens);
    out->tokens = tokens > mine ? tokens : mine;
    const ls_blockfile * F = &L->f;   // the reads: the expert file's
    out->bytes_read += atomic_load(&F->stats.bytes_read);
    out->reads += atomic_load(&F->stats.reads_issued);
    out->checksum_ns += atomic_load(&F->stats.checksum_ns);
    for (int32_t b = 0; b < F->n_blocks; b++) {
        if (F->slot[b] < 0 || atomic_load(&F->state[b]) != LS_BLK_READY) continue;
        out->resident++;
        out->pinned += F->hot[b] != 0;
    }
    out->router_known += L->router != NULL;
    out->ahead_on += L->router != NULL && m->params.read_ahead != LS_AHEAD_OFF &&
                     (m->params.read_ahead == LS_AHEAD_ON || !L->ahead_off);
}

ls_status ls_moe_set_uses(ls_moe * m, int32_t il, const uint32_t * uses, int32_t n_expert) {
    ls_moe_layer * L = layer_of(m, il);
    if (!L || !uses || n_expert != L->info.n_expert) {
        ls_set_error("ls_moe_set_uses: layer %d%s", il, L ? ": n_expert does not match" : " has no expert file");
        return LS_ERR_ARG;
    }
    pthread_mutex_lock(&m->op_mu);
    for (int32_t e = 0; e < n_expert; e++) L->f.uses[L->block_of_expert[e]] = uses[e];
    ls_cache_reorder(&m->cache);
    pthread_mutex_unlock(&m->op_mu);
    return LS_OK;
}

ls_status ls_moe_routing_counts(const ls_moe * m, int32_t il, uint64_t * counts, int32_t n_expert) {
    const ls_moe_layer * L = layer_of(m, il);
    if (!L || !counts || n_expert != L->info.n_expert) {
        ls_set_error("ls_moe_routing_counts: layer %d%s", il, L ? ": n_expert does not match" : " has no expert file");
        return LS_ERR_ARG;
    }
    ls_moe * mm = (ls_moe *) m;   // the lock only
    pthread_mutex_lock(&mm->op_mu);
    memcpy(counts, L->routed_count, sizeof(uint64_t) * (size_t) n_expert);
    pthread_mutex_unlock(&mm->op_mu);
    return LS_OK;
}

ls_status ls_moe_stats(const ls_moe * m, int32_t il, ls_moe_counters * out) {
    if (!m || !out || il < -1 || il >= m->n_layer) { ls_set_error("ls_moe_stats: bad arguments (layer %d)", il); return LS_ERR_ARG; }
    memset(out, 0, sizeof(*out));
    ls_moe * mm = (ls_moe *) m;   // the lock only: the cache is read between ops
    pthread_mutex_lock(&mm->op_mu);
    for (int32_t l = 0; l < m->n_layer; l++)
        if (il < 0 || l == il) add_layer(m, &m->layers[l], out);
    pthread_mutex_unlock(&mm->op_mu);
    out->cache_slots = (uint64_t) m->cache.n_slots;
    out->slot_bytes = m->cache.stride;
    out->direct_io = m->direct_io ? 1 : 0;
    return LS_OK;
}

void ls_moe_reset_stats(ls_moe * m) {
    if (!m) return;
    for (int32_t il = 0; il < m->n_layer; il++) {
#define LS_MOE_ZERO(name) atomic_store(&m->layers[il].stats.name, 0);
#define LS_READS_ZERO(name) atomic_store(&m->layers[il].f.stats.name, 0);
        LS_MOE_COUNTERS(LS_MOE_ZERO)
        LS_READ_COUNTERS(LS_READS_ZERO)
        if (m->layers[il].routed_count) memset(m->layers[il].routed_count, 0, sizeof(uint64_t) * (size_t) m->layers[il].info.n_expert);
#undef LS_MOE_ZERO
#undef LS_READS_ZERO
    }
}
