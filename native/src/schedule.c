// schedule.c — which blocks an FFN op computes, in what order, what it pins and what it loads ahead.
//
// Runs on ggml's thread 0 only, inside the op (e->op_mu); op.c takes e->mu around every call that
// pins, unpins or records (all but the draft's planner and the final selection). One planner per
// path of the op (op.c):
//
//   dense      every block in file order, cut into chunks the budget holds; the next chunk is
//              pinned when the one before has been computed and let go
//   predicted  the top (1 - sparsity) blocks by priority (the previous op's layer-ahead
//              prediction, an oracle's, or the layer's own predictor on its input), in file order
//              so that reads merge
//   cascade    the top candidate_ratio x kept blocks by sketch score, in file order; after their
//              exact gate/up, the kept blocks are the candidates with the largest sum |h|
//   prefetch   (sparse paths, modes that prefetch) layer il+1's predictor on x_il picks its likely
//              blocks, pinned and queued behind this layer's reads
//   draft      (speculative decoding's draft) the resident, loaded blocks, in file order
//   finish     unpin; blocks stay cached (LRU) except in oneshot mode (no cache)

#include "internal.h"

#include <stdlib.h>
#include <string.h>

// ---- selection -------------------------------------------------------------------------------

// Partition idx[lo, hi) so that idx[lo, k) hold the k-lo largest prio (quickselect, O(n)).
static void select_top(int32_t * idx, int32_t lo, int32_t hi, int32_t k, const float * prio) {
    while (hi - lo > 1 && k > lo && k < hi) {
        const float pivot = prio[idx[lo + (hi - lo) / 2]];
        int32_t i = lo, j = hi - 1;
        while (i <= j) {
            while (prio[idx[i]] > pivot) i++;
            while (prio[idx[j]] < pivot) j--;
            if (i <= j) { int32_t t = idx[i]; idx[i] = idx[j]; idx[j] = t; i++; j--; }
        }
        // [lo, j] >= pivot >= [i, hi)
        if (k <= j + 1) hi = j + 1;
        else if (k >= i) lo = i;
        else return;
    }
}

// The n best blocks of L by prio into out[0, n), in file order (one scan: no sort).
static void select_in_file_order(ls_layer * L, const float * prio, int32_t n, int32_t * out) {
    const int32_t nb = L->info.n_blocks;
    int32_t * idx = L->order;
    for (int32_t b = 0; b < nb; b++) idx[b] = b;
    select_top(idx, 0, nb, n, prio);
    uint8_t * mark = L->mark;
    for (int32_t i = 0; i < n; i++) mark[idx[i]] = 0;
    int32_t m = 0;
    for (int32_t b = 0; b < nb; b++) {
        if (mark[b] == 0xFF) continue;
        out[m++] = b;
        mark[b] = 0xFF;
    }
}

static int32_t n_kept(const ls_engine * e, const ls_layer * L) {
    return ls_kept_blocks(L->info.n_blocks, e->params.sparsity);
}

static bool selects_by_sketch(const ls_engine * e, const ls_layer * L) {
    return (e->policy->uses & LS_USES_SKETCH) && L->sketch != NULL;
}

ls_path ls_sched_path(const ls_engine * e, const ls_layer * L, int64_t n_tokens) {
    if (e->draft) return LS_PATH_DRAFT;
    if (n_tokens != 1 || !e->policy->sparse) return LS_PATH_DENSE;
    return selects_by_sketch(e, L) ? LS_PATH_CASCADE : LS_PATH_PREDICTED;
}

// Blocks a sparse decode op pins: the candidates of a cascade, else the kept blocks. A cascade's
// hot blocks whose sketch rows were dropped are always candidates (their rows are resident, so
// computing them exactly reads nothing); the other blocks get the usual share of candidates, so
// that the blocks read per token stay what they were.
static int32_t n_wanted_at(const ls_engine * e, const ls_layer * L, float candidate_ratio) {
    if (!selects_by_sketch(e, L)) return n_kept(e, L);
    const int32_t nb = L->info.n_blocks, nc = ls_candidate_blocks(nb, e->params.sparsity, candidate_ratio);
    if (L->n_always == 0) return nc;
    const int64_t n = L->n_always + ((int64_t) nc * (nb - L->n_always) + nb - 1) / nb;
    return (int32_t) (n < nb ? n : nb);
}

static int32_t n_wanted(const ls_engine * e, const ls_layer * L) { return n_wanted_at(e, L, e->params.candidate_ratio); }

static ls_status run_predictor(ls_engine * e, ls_layer * L, const float * x) {
    const uint64_t t0 = ls_now_ns();
    ls_status st = ls_predictor_eval(L->pred, x, L->prio, L->info.n_blocks);
    atomic_fetch_add(&L->stats.predictor_ns, ls_now_ns() - t0);
    if (st != LS_OK) {
        ls_engine_record_error(e, st, "layer %d predictor: %s", L->il, ls_errmsg());
        return st;
    }
    L->prio_ready = true;
    return LS_OK;
}

// ---- pins ------------------------------------------------------------------------------------

// Pin blocks[0, n) of L; misses are queued for reading in that order. Stops at the first block
// the budget cannot hold (returns how many were pinned).
static int32_t acquire_and_read(ls_engine * e, ls_layer * L, const int32_t * blocks, int32_t n,
                                int32_t * missing) {
    int32_t n_missing = 0, i = 0;
    for (; i < n; i++) {
        int32_t slot;
        bool miss;
        if (ls_cache_acquire(&e->cache, &L->f, blocks[i], &slot, &miss) != LS_OK) break;
        if (miss) missing[n_missing++] = blocks[i];
    }
    ls_io_submit(&e->io, &L->f, missing, n_missing, NULL);
    return i;
}

// Unpin blocks[0, n); keep: they stay cached (else their slots are freed: oneshot).
static void release_blocks(ls_engine * e, ls_layer * L, const int32_t * blocks, int32_t n, bool computed, bool keep) {
    for (int32_t i = 0; i < n; i++) {
        const int32_t b = blocks[i];
        const int32_t st = atomic_load_explicit(&L->f.state[b], memory_order_acquire);
        if (st == LS_BLK_READY && keep) {
            ls_cache_release(&e->cache, &L->f, b, computed);
        } else if (st == LS_BLK_READY || st == LS_BLK_FAILED) {
            // no cache (oneshot), or a failed read: free the slot, the next call re-reads
            if (computed && st == LS_BLK_READY) ls_cache_release(&e->cache, &L->f, b, true);
            ls_cache_drop(&e->cache, &L->f, b, st == LS_BLK_READY);
        } else {
            // still loading (a prefetch no one waited for): keep the pin count honest; the
            // block becomes evictable once its read lands
            ls_cache_release(&e->cache, &L->f, b, false);
        }
    }
}

// ---- prefetch of the next layer ----------------------------------------------------------------

// Pin + queue the likely blocks of layer N from its predictor on this layer's input x_il (the
// layer-ahead input), in file order, budget permitting.
static void prefetch_next_layer(ls_engine * e, ls_layer * N, const float * x_res) {
    if (!N->pred || N->pinned_forever || run_predictor(e, N, x_res) != LS_OK) return;
    ls_plan * P = &e->plan;
    int32_t * want = P->scratch;
    const int32_t n = n_wanted(e, N);
    select_in_file_order(N, N->prio, n, want);
    int32_t n_new = 0;   // (blocks still prefetched from an earlier call keep their pin)
    for (int32_t i = 0; i < n; i++)
        if (!N->in_prefetch[want[i]]) want[n_new++] = want[i];
    const int32_t got = acquire_and_read(e, N, want, n_new, P->scratch2);
    for (int32_t i = 0; i < got; i++) {
        N->in_prefetch[want[i]] = 1;
        N->prefetch[N->n_prefetch++] = want[i];
    }
    atomic_fetch_add(&N->stats.blocks_prefetched, (uint64_t) got);
}

// Pin the plan's blocks P->blocks[0, P->n) (prefetched ones change hands), then prefetch layer
// il+1 from the layer-ahead input.
static ls_status pin_sparse_plan(ls_engine * e, ls_layer * L, const float * x_res) {
    ls_plan * P = &e->plan;
    P->pin_lo = P->n_pinned = 0;
    if (L->pinned_forever) return LS_OK;   // every block resident for good: nothing to pin or prefetch
    uint8_t * chosen = L->mark;            // 0xFF between calls
    for (int32_t i = 0; i < P->n; i++) chosen[P->blocks[i]] = 1;
    // prefetched blocks that were not chosen are let go first, so their slots can be reused
    int32_t n_unchosen = 0;
    for (int32_t i = 0; i < L->n_prefetch; i++)
        if (chosen[L->prefetch[i]] != 1) P->scratch[n_unchosen++] = L->prefetch[i];
    release_blocks(e, L, P->scratch, n_unchosen, false, true);
    P->n_pinned = acquire_and_read(e, L, P->blocks, P->n, P->scratch2);
    // the chosen prefetched blocks now hold two pins: drop the prefetch's
    for (int32_t i = 0; i < L->n_prefetch; i++) {
        const int32_t b = L->prefetch[i];
        if (chosen[b] == 1) ls_cache_release(&e->cache, &L->f, b, false);
        L->in_prefetch[b] = 0;
    }
    L->n_prefetch = 0;
    for (int32_t i = 0; i < P->n; i++) chosen[P->blocks[i]] = 0xFF;
    if (P->n_pinned < P->n) return LS_ERR_BUDGET;
    if (e->policy->prefetch && x_res && L->il + 1 < e->n_layers) prefetch_next_layer(e, &e->layers[L->il + 1], x_res);
    return LS_OK;
}

// ---- dense -----------------------------------------------------------------------------------

// The blocks of the next dense layer that are not resident for good, pinned and queued behind this
// layer's reads, as far as the budget goes (mode dense: decode reads every layer in turn, so
// layer il + 1, and after the last layer the first one of the next pass, is what comes next).
// Its reads then run while this layer and the attention between the two compute, and while a
// speculative draft computes (it reads nothing). Dense mode's pinned set leaves one layer of
// slots beside it: at half the FFN resident that is the streamed part of two layers.
static void prefetch_next_dense(ls_engine * e, ls_layer * L) {
    ls_layer * N = &e->layers[(L->il + 1) % e->n_layers];
    if (N == L || N->pinned_forever || N->n_prefetch > 0) return;
    ls_plan * P = &e->plan;
    int32_t * want = P->scratch, n = 0;
    for (int32_t b = 0; b < N->info.n_blocks; b++)
        if (!N->f.hot_pinned[b]) want[n++] = b;
    const int32_t got = acquire_and_read(e, N, want, n, P->scratch2);
    for (int32_t i = 0; i < got; i++) {
        N->in_prefetch[want[i]] = 1;
        N->prefetch[N->n_prefetch++] = want[i];
    }
    atomic_fetch_add(&N->stats.blocks_prefetched, (uint64_t) got);
}

// Let go of the pins a prefetch took on L's blocks (the op's own pins hold them now).
static void drop_prefetch_pins(ls_engine * e, ls_layer * L) {
    for (int32_t i = 0; i < L->n_prefetch; i++) {
        ls_cache_release(&e->cache, &L->f, L->prefetch[i], false);
        L->in_prefetch[L->prefetch[i]] = 0;
    }
    L->n_prefetch = 0;
}

ls_status ls_sched_plan_dense(ls_engine * e, ls_layer * L) {
    ls_plan * P = &e->plan;
    const int32_t nb = L->info.n_blocks;
    for (int32_t b = 0; b < nb; b++) P->blocks[b] = b;
    P->n = nb;
    P->pin_lo = P->n_pinned = 0;
    P->chunks.stop = false;
    if (L->pinned_forever) {   // nothing to pin
        P->chunks.n = 1;
        P->chunks.end[0] = nb;
        return LS_OK;
    }
    // one chunk if the whole layer fits, else chunks of the free and evictable slots
    int32_t room = ls_cache_available(&e->cache), missing = 0;
    for (int32_t b = 0; b < nb; b++) missing += L->f.slot[b] < 0;
    if (room < 1 && missing > 0) return LS_ERR_BUDGET;
    const int32_t chunk = room >= missing ? nb : room; // resident blocks need no room
    P->chunks.n = 0;
    for (int32_t lo = 0; lo < nb && P->chunks.n < LS_MAX_CHUNKS; lo += chunk) {
        P->chunks.end[P->chunks.n++] = lo + chunk < nb ? lo + chunk : nb;
    }
    if (P->chunks.end[P->chunks.n - 1] != nb) { drop_prefetch_pins(e, L); return LS_ERR_BUDGET; } // > LS_MAX_CHUNKS chunks
    P->n_pinned = acquire_and_read(e, L, P->blocks, P->chunks.end[0], P->scratch2);
    drop_prefetch_pins(e, L);
    if (P->n_pinned != P->chunks.end[0]) return LS_ERR_BUDGET;
    if (!e->policy->sparse && P->chunks.n == 1) prefetch_next_dense(e, L);
    return LS_OK;
}

ls_status ls_sched_next_chunk(ls_engine * e, int32_t c) {
    ls_plan * P = &e->plan;
    const int32_t lo = P->chunks.end[c - 1], hi = P->chunks.end[c];
    release_blocks(e, P->L, P->blocks + P->pin_lo, P->n_pinned - P->pin_lo, true, e->policy->keep_cache);
    P->pin_lo = lo;
    P->n_pinned = lo + acquire_and_read(e, P->L, P->blocks + lo, hi - lo, P->scratch2);
    return P->n_pinned == hi ? LS_OK : LS_ERR_BUDGET;
}

// ---- draft ---------------------------------------------------------------------------------------

void ls_sched_plan_draft(ls_engine * e, ls_layer * L) {
    ls_plan * P = &e->plan;
    const int32_t nb = L->info.n_blocks;
    P->n = P->pin_lo = P->n_pinned = 0;
    // a loaded block cannot be evicted while the op runs: only an op evicts, and this one holds e->op_mu
    uint8_t * mark = L->mark;   // 0xFF between calls
    const bool ranked = L->rank_order && e->draft_fraction < 1.0f;
    if (ranked) {   // each layer's best-ranked fraction, in file order
        const int32_t n = (int32_t) ((double) e->draft_fraction * nb + 0.5);
        for (int32_t i = 0; i < n && i < nb; i++) mark[L->rank_order[i]] = 1;
    }
    for (int32_t b = 0; b < nb; b++) {
        const bool want = !ranked || mark[b] == 1;
        mark[b] = 0xFF;
        if (want && L->f.slot[b] >= 0 && atomic_load_explicit(&L->f.state[b], memory_order_acquire) == LS_BLK_READY)
            P->blocks[P->n++] = b;
    }
}

// ---- predicted -------------------------------------------------------------------------------

ls_status ls_sched_plan_predicted(ls_engine * e, ls_layer * L, const float * x_res) {
    ls_plan * P = &e->plan;
    P->n = P->pin_lo = P->n_pinned = 0;
    // this layer's priorities come from the previous op's prefetch (layer-ahead) or an oracle;
    // layer 0, or a layer whose predecessor did not run, uses its own input
    if (!L->prio_ready) {
        if (!L->pred || !x_res) return LS_ERR_UNSUPPORTED;
        ls_status st = run_predictor(e, L, x_res);
        if (st != LS_OK) return st;
    }
    P->n = n_kept(e, L);
    select_in_file_order(L, L->prio, P->n, P->blocks);
    L->prio_ready = false;
    return pin_sparse_plan(e, L, x_res);
}

// ---- cascade ---------------------------------------------------------------------------------

bool ls_sched_cascade_all(const ls_engine * e, const ls_layer * L) {
    if (!L->pinned_forever) return false;
    const uint64_t gu = (uint64_t) L->info.neurons_per_block * (L->gate_row_bytes + L->up_row_bytes);
    const uint64_t sketch = L->sketch->bytes;
    return (uint64_t) L->info.n_blocks * gu <= sketch + (uint64_t) n_wanted(e, L) * gu;
}

// Candidates: the top n_cand blocks by sketch score (P->cascade.score), in file order; pinned and their
// reads queued like any plan. A resident layer that skips the sketch (ls_sched_cascade_all):
// every block, nothing to pin.
ls_status ls_sched_plan_cascade(ls_engine * e, ls_layer * L, const float * x_res) {
    ls_plan * P = &e->plan;
    const int32_t nb = L->info.n_blocks;
    P->cascade.n_sel = 0;
    for (int32_t i = 0; i < L->n_prefetch; i++) L->spec[L->prefetch[i]] = 1;
    if (ls_sched_cascade_all(e, L)) {
        for (int32_t b = 0; b < nb; b++) P->blocks[b] = b;
        P->n = nb;
    } else {
        // the controller's state is the remaining load of the default candidates; its action may
        // change how many there are (control.c)
        P->n = n_wanted(e, L);
        select_in_file_order(L, P->cascade.score, P->n, P->blocks);
        int32_t missing = 0;   // (only a controller reads it)
        if (e->ctrl.pol.mode != LS_CTRL_OFF)
            for (int32_t i = 0; i < P->n; i++) missing += L->f.slot[P->blocks[i]] < 0;
        const int32_t n = n_wanted_at(e, L, ls_ctrl_choose(e, L, (uint64_t) missing * L->info.block_stride));
        if (n != P->n) {
            P->n = n;
            select_in_file_order(L, P->cascade.score, P->n, P->blocks);
        }
    }
    L->prio_ready = false;
    return pin_sparse_plan(e, L, x_res);
}

// The kept set: the n_kept candidate entries computed (P->cascade.loaded) with the largest exact sum |h|
// (P->cascade.hscore), in plan order, into P->cascade.sel.
void ls_sched_select_final(ls_engine * e) {
    ls_plan * P = &e->plan;
    ls_layer * L = P->L;
    int32_t * idx = P->scratch, n_loaded = 0;
    for (int32_t i = 0; i < P->n; i++)
        if (P->cascade.loaded[i]) idx[n_loaded++] = i;
    int32_t n_final = n_kept(e, L);
    if (n_final > n_loaded) n_final = n_loaded;
    select_top(idx, 0, n_loaded, n_final, P->cascade.hscore);
    uint8_t * mark = L->mark;   // 0xFF between calls; P->n <= n_blocks
    for (int32_t i = 0; i < n_final; i++) mark[idx[i]] = 0;
    int32_t n = 0, hits = 0;
    for (int32_t i = 0; i < P->n; i++) {
        if (mark[i] == 0xFF) continue;
        mark[i] = 0xFF;
        P->cascade.sel[n++] = i;
        hits += L->spec[P->blocks[i]];
    }
    P->cascade.n_sel = n;
    bool any_spec = false;
    for (int32_t b = 0; b < L->info.n_blocks; b++) { any_spec |= L->spec[b] != 0; L->spec[b] = 0; }
    if (any_spec) {
        atomic_fetch_add(&L->stats.spec_hits, (uint64_t) hits);
        atomic_fetch_add(&L->stats.spec_selected, (uint64_t) n);
    }
    atomic_fetch_add(&L->stats.blocks_candidates, (uint64_t) P->n);
    atomic_fetch_add(&L->stats.down_skipped, (uint64_t) (P->n - n));
}

// ---- finish ----------------------------------------------------------------------------------

void ls_sched_finish(ls_engine * e, bool * all_ready) {
    ls_plan * P = &e->plan;
    ls_layer * L = P->L;
    if (P->path == LS_PATH_CASCADE) {   // last_plan: the kept blocks; last_cand: every candidate
        for (int32_t i = 0; i < P->cascade.n_sel; i++) L->last_plan[i] = P->blocks[P->cascade.sel[i]];
        L->n_last_plan = P->cascade.n_sel;
        memcpy(L->last_cand, P->blocks, sizeof(int32_t) * (size_t) P->n);
        L->n_last_cand = P->n;
    } else {
        memcpy(L->last_plan, P->blocks, sizeof(int32_t) * (size_t) P->n);
        L->n_last_plan = P->n;
    }
    *all_ready = true;
    for (int32_t i = 0; i < P->n; i++) {
        if (atomic_load_explicit(&L->f.state[P->blocks[i]], memory_order_acquire) != LS_BLK_READY) *all_ready = false;
    }
    release_blocks(e, L, P->blocks + P->pin_lo, P->n_pinned - P->pin_lo, true, e->policy->keep_cache);
    P->pin_lo = P->n_pinned = 0;
}
