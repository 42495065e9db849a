// schedule.c — which blocks an FFN op computes, in what order, and what it loads ahead.
//
// Runs on ggml's thread 0 only (under e->mu), between the stages of an op:
//
//   plan      dense (prefill, or mode dense): every block, in file order, cut into stages that fit
//             the budget. sparse decode: the top (1 - sparsity) blocks by priority, cut into K
//             stages of descending priority (inside a stage: file order, so reads merge); then
//             prefetch layer il+1: its predictor on x_il (the layer-ahead input) picks its top set,
//             whose missing blocks are queued behind this layer's reads.
//   stage s   (leanstream mode) refinement, paper Eq. 2: x~ = x_il + sum of the partial outputs of
//             stages 1..s re-ranks layer il+1; its reads that no worker started are withdrawn and
//             the new top set is queued in the new order.
//   finish    unpin; blocks stay cached (LRU) except in oneshot mode (no cache).

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

static int32_t n_kept(const ls_engine * e, const ls_layer * L) {
    return ls_kept_blocks(L->info.n_blocks, e->params.sparsity);
}

bool ls_sched_cascade(const ls_engine * e, const ls_layer * L, int64_t n_tokens) {
    return n_tokens == 1 && e->policy->sparse && e->policy->exact_select && L->sketch != NULL;
}

// Blocks a sparse decode op pins: the candidates of a cascade, else the kept blocks.
static int32_t n_wanted(const ls_engine * e, const ls_layer * L) {
    if (e->policy->exact_select && L->sketch)
        return ls_candidate_blocks(L->info.n_blocks, e->params.sparsity, e->params.candidate_ratio);
    return n_kept(e, L);
}

// Top n_sel blocks of L by prio into out[0, n_sel), in n_stages groups of descending priority,
// each group in file order. stage_end[s] receives the end of group s.
static void select_stages(ls_layer * L, const float * prio, int32_t n_sel, int32_t * out,
                          int32_t n_stages, int32_t * stage_end) {
    const int32_t nb = L->info.n_blocks;
    int32_t * idx = L->order;
    for (int32_t b = 0; b < nb; b++) idx[b] = b;
    select_top(idx, 0, nb, n_sel, prio);
    // stage boundaries by quickselect, then file order inside each stage by one scan over the
    // layer's blocks (this runs up to K + 1 times per layer and token: a comparison sort of
    // the stages was most of leanstream's planning time)
    int32_t lo = 0, pos[LS_MAX_STAGES];
    uint8_t * mark = L->stage_mark;
    for (int32_t s = 0; s < n_stages; s++) {
        int32_t hi = (int32_t) ((int64_t) n_sel * (s + 1) / n_stages);
        if (s < n_stages - 1) select_top(idx, lo, n_sel, hi, prio);
        for (int32_t i = lo; i < hi; i++) mark[idx[i]] = (uint8_t) s;
        pos[s] = lo;
        stage_end[s] = hi;
        lo = hi;
    }
    for (int32_t b = 0; b < nb; b++) {
        if (mark[b] != 0xFF) {
            out[pos[mark[b]]++] = b;
            mark[b] = 0xFF;
        }
    }
}

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
        if (ls_cache_acquire(e, L, blocks[i], &slot, &miss) != LS_OK) break;
        if (miss) missing[n_missing++] = blocks[i];
    }
    ls_io_submit(e, L, missing, n_missing);
    return i;
}

// Unpin blocks[0, n). Cache score (PRIORITY eviction): computed blocks by their position in the
// priority order (earlier = more likely needed again: 1 down to 0.5), others 0.
static void release_blocks(ls_engine * e, ls_layer * L, const int32_t * blocks, int32_t n, bool computed,
                           bool keep) {
    for (int32_t i = 0; i < n; i++) {
        const int32_t b = blocks[i];
        const int32_t st = atomic_load_explicit(&L->state[b], memory_order_acquire);
        const float score = computed ? 1.0f - 0.5f * (float) i / (float) n : 0.0f;
        if (st == LS_BLK_READY && keep) {
            ls_cache_release(e, L, b, computed, score);
        } else if (st == LS_BLK_READY || st == LS_BLK_FAILED) {
            // no cache (oneshot), or a failed read: free the slot, the next call re-reads
            if (computed && st == LS_BLK_READY) ls_cache_release(e, L, b, true, score);
            ls_cache_drop(e, L, b, st == LS_BLK_READY);
        } else {
            // still loading (a prefetch no one waited for): keep the pin count honest; the
            // block becomes evictable once its read lands
            ls_cache_release(e, L, b, false, 0.0f);
        }
    }
}

// ---- prefetch of the next layer ----------------------------------------------------------------

// Pin + queue the top set of layer N from its current priorities, skipping blocks already
// prefetched. Budget permitting.
static void prefetch_top(ls_engine * e, ls_layer * N) {
    ls_plan * P = &e->plan;
    int32_t n_sel = n_wanted(e, N);
    int32_t * want = P->scratch;
    int32_t ends[LS_MAX_STAGES];
    int32_t groups = e->params.n_stages < n_sel ? e->params.n_stages : n_sel;
    select_stages(N, N->prio, n_sel, want, groups, ends);
    int32_t n_new = 0;
    for (int32_t i = 0; i < n_sel; i++) {
        const int32_t b = want[i];
        if (!N->in_prefetch[b]) want[n_new++] = b;
    }
    int32_t got = acquire_and_read(e, N, want, n_new, P->scratch2);
    for (int32_t i = 0; i < got; i++) {
        N->in_prefetch[want[i]] = 1;
        N->prefetch[N->n_prefetch++] = want[i];
    }
    atomic_fetch_add(&N->stats.blocks_prefetched, (uint64_t) got);
}

// Refinement: withdraw N's unstarted reads, re-rank from the new priorities, queue again.
static void reprefetch(ls_engine * e, ls_layer * N) {
    ls_plan * P = &e->plan;
    int32_t n_cancel = ls_io_cancel_pending(e, N, P->scratch, N->info.n_blocks);
    for (int32_t i = 0; i < n_cancel; i++) {
        ls_cache_drop(e, N, P->scratch[i], false);
        N->in_prefetch[P->scratch[i]] = 0;
    }
    int32_t kept = 0;
    for (int32_t i = 0; i < N->n_prefetch; i++) {
        if (N->in_prefetch[N->prefetch[i]]) N->prefetch[kept++] = N->prefetch[i];
    }
    N->n_prefetch = kept;
    prefetch_top(e, N);
}

static ls_status pin_plan(ls_engine * e, ls_layer * L, const float * x_res);

// ---- the plan --------------------------------------------------------------------------------

ls_status ls_sched_plan(ls_engine * e, ls_layer * L, int64_t n_tokens, const float * x_res) {
    ls_plan * P = &e->plan;
    const int32_t nb = L->info.n_blocks;
    P->n = 0;
    P->n_acquired = 0;
    P->x_res = x_res;
    P->cascade = false;
    P->sparse = n_tokens == 1 && e->policy->sparse;
    P->refine = P->sparse && e->policy->refine && x_res && L->il + 1 < e->n_layers &&
                e->layers[L->il + 1].pred;

    if (!P->sparse) {
        // dense: every block in file order; one stage if the whole layer fits, else chunks
        for (int32_t b = 0; b < nb; b++) P->blocks[b] = b;
        P->n = nb;
        if (L->pinned_forever) {
            P->n_stages = 1;
            P->stage_end[0] = nb;
            P->n_acquired = 0; // nothing to unpin
            return LS_OK;
        }
        int32_t room = ls_cache_available(&e->cache), missing = 0;
        for (int32_t b = 0; b < nb; b++) missing += L->slot_of_block[b] < 0;
        if (room < 1 && missing > 0) return LS_ERR_BUDGET;
        int32_t chunk = room >= missing ? nb : room; // resident blocks need no room
        P->n_stages = 0;
        for (int32_t lo = 0; lo < nb && P->n_stages < LS_MAX_STAGES; lo += chunk) {
            P->stage_end[P->n_stages++] = lo + chunk < nb ? lo + chunk : nb;
        }
        if (P->stage_end[P->n_stages - 1] != nb) return LS_ERR_BUDGET; // > LS_MAX_STAGES chunks
        P->n_acquired = acquire_and_read(e, L, P->blocks, P->stage_end[0], P->scratch2);
        return P->n_acquired == P->stage_end[0] ? LS_OK : LS_ERR_BUDGET;
    }

    // sparse decode: this layer's priorities come from the previous op's prefetch (layer-ahead,
    // refined) or an oracle; layer 0, or a layer whose predecessor did not run, uses its own input
    if (!L->prio_ready) {
        if (!L->pred || !x_res) return LS_ERR_UNSUPPORTED;
        ls_status st = run_predictor(e, L, x_res);
        if (st != LS_OK) return st;
    }
    int32_t n_stages = e->policy->staged ? e->params.n_stages : 1;
    const int32_t n_sel = n_kept(e, L);
    if (n_stages > n_sel) n_stages = n_sel;
    P->n_stages = n_stages;
    select_stages(L, L->prio, n_sel, P->blocks, n_stages, P->stage_end);
    P->n = n_sel;
    L->prio_ready = false;
    return pin_plan(e, L, x_res);
}

// Pin the plan's blocks P->blocks[0, P->n) (prefetched ones change hands), then queue layer il+1's
// prefetch from the layer-ahead input.
static ls_status pin_plan(ls_engine * e, ls_layer * L, const float * x_res) {
    ls_plan * P = &e->plan;
    const int32_t n_sel = P->n;
    if (L->pinned_forever) {
        // every block resident for good (a budget that holds the whole FFN, after the first
        // prefill): nothing to pin, read or prefetch
        P->n_acquired = 0;
        return LS_OK;
    }
    // prefetched blocks that were not selected are let go first, so their slots can be reused
    for (int32_t i = 0; i < n_sel; i++) L->in_prefetch[P->blocks[i]] |= 2;
    int32_t n_unsel = 0;
    for (int32_t i = 0; i < L->n_prefetch; i++) {
        if (!(L->in_prefetch[L->prefetch[i]] & 2)) P->scratch[n_unsel++] = L->prefetch[i];
    }
    release_blocks(e, L, P->scratch, n_unsel, false, true);
    P->n_acquired = acquire_and_read(e, L, P->blocks, n_sel, P->scratch2);
    // the selected prefetched blocks now hold two pins: drop the prefetch's
    int32_t n_sel_pref = 0;
    for (int32_t i = 0; i < L->n_prefetch; i++) {
        if (L->in_prefetch[L->prefetch[i]] & 2) P->scratch[n_sel_pref++] = L->prefetch[i];
    }
    for (int32_t i = 0; i < n_sel_pref; i++) ls_cache_release(e, L, P->scratch[i], false, 1.0f);
    for (int32_t i = 0; i < L->n_prefetch; i++) L->in_prefetch[L->prefetch[i]] = 0;
    for (int32_t i = 0; i < n_sel; i++) L->in_prefetch[P->blocks[i]] = 0;
    L->n_prefetch = 0;
    if (P->n_acquired < n_sel) return LS_ERR_BUDGET;

    // load ahead: layer il+1's top set from the layer-ahead input x_il
    if (e->policy->prefetch && x_res && L->il + 1 < e->n_layers) {
        ls_layer * N = &e->layers[L->il + 1];
        if (N->pred && !N->pinned_forever && run_predictor(e, N, x_res) == LS_OK) prefetch_top(e, N);
    }
    return LS_OK;
}

// ---- exact-input selection (cascade) -----------------------------------------------------------

bool ls_sched_cascade_all(const ls_engine * e, const ls_layer * L) {
    if (!L->pinned_forever) return false;
    const uint64_t gu = (uint64_t) L->info.neurons_per_block * (L->gate_row_bytes + L->up_row_bytes);
    const uint64_t sketch = L->sketch->bytes;
    return (uint64_t) L->info.n_blocks * gu <= sketch + (uint64_t) n_wanted(e, L) * gu;
}

// Candidates: the top n_cand blocks by sketch score (P->score, non-resident ones scaled by
// cache_bias), in file order; pinned and their reads queued like any plan. A resident layer that
// skips the sketch (ls_sched_cascade_all): every block, nothing to pin.
ls_status ls_sched_plan_cascade(ls_engine * e, ls_layer * L, const float * x_res) {
    ls_plan * P = &e->plan;
    const int32_t nb = L->info.n_blocks;
    P->n = 0;
    P->n_acquired = 0;
    P->n_sel = 0;
    P->x_res = x_res;
    P->sparse = true;
    P->refine = false;
    P->cascade = true;
    if (e->params.cache_bias < 1.0f) {
        for (int32_t b = 0; b < nb; b++)
            if (L->slot_of_block[b] < 0) P->score[b] *= e->params.cache_bias;
    }
    for (int32_t i = 0; i < L->n_prefetch; i++) L->spec[L->prefetch[i]] = 1;
    if (ls_sched_cascade_all(e, L)) {
        // the whole layer is resident for good and its gate/up rows cost less than the sketch
        // plus the candidates' rows: every block is a candidate (no scores were computed)
        for (int32_t b = 0; b < nb; b++) P->blocks[b] = b;
        P->n = nb;
        P->stage_end[0] = nb;
        P->n_stages = 1;
        L->prio_ready = false;
        return pin_plan(e, L, x_res);
    }
    const int32_t n_cand = n_wanted(e, L);
    select_stages(L, P->score, n_cand, P->blocks, 1, P->stage_end);
    P->n = n_cand;
    P->n_stages = 1;
    L->prio_ready = false;
    return pin_plan(e, L, x_res);
}

// The kept set: the n_kept candidate entries with the largest exact sum |h| (P->hscore), in
// plan order, into P->sel.
void ls_sched_select_final(ls_engine * e) {
    ls_plan * P = &e->plan;
    ls_layer * L = P->L;
    int32_t n_final = n_kept(e, L);
    if (n_final > P->n) n_final = P->n;
    int32_t * idx = P->scratch;
    for (int32_t i = 0; i < P->n; i++) idx[i] = i;
    select_top(idx, 0, P->n, n_final, P->hscore);
    uint8_t * mark = L->stage_mark;   // 0xFF between calls; P->n <= n_blocks
    for (int32_t i = 0; i < n_final; i++) mark[idx[i]] = 0;
    int32_t n = 0, hits = 0;
    for (int32_t i = 0; i < P->n; i++) {
        if (mark[i] == 0xFF) continue;
        mark[i] = 0xFF;
        P->sel[n++] = i;
        hits += L->spec[P->blocks[i]];
    }
    P->n_sel = n;
    bool any_spec = false;
    for (int32_t b = 0; b < L->info.n_blocks; b++) { any_spec |= L->spec[b] != 0; L->spec[b] = 0; }
    if (any_spec) {
        atomic_fetch_add(&L->stats.spec_hits, (uint64_t) hits);
        atomic_fetch_add(&L->stats.spec_selected, (uint64_t) n);
    }
    atomic_fetch_add(&L->stats.blocks_candidates, (uint64_t) P->n);
    atomic_fetch_add(&L->stats.down_skipped, (uint64_t) (P->n - n));
}

ls_status ls_sched_stage_begin(ls_engine * e, int32_t s) {
    ls_plan * P = &e->plan;
    if (P->sparse || s == 0) return LS_OK;
    // chunked dense: pin the next chunk (the previous one was released)
    const int32_t lo = P->stage_end[s - 1], hi = P->stage_end[s];
    int32_t got = acquire_and_read(e, P->L, P->blocks + lo, hi - lo, P->scratch2);
    P->n_acquired = lo + got;
    return got == hi - lo ? LS_OK : LS_ERR_BUDGET;
}

void ls_sched_stage_done(ls_engine * e, int32_t s, const float * partial) {
    ls_plan * P = &e->plan;
    ls_layer * L = P->L;
    if (!P->sparse) {
        if (P->n_stages > 1 && s < P->n_stages - 1) { // chunked: let this chunk go before the next
            const int32_t lo = s == 0 ? 0 : P->stage_end[s - 1];
            release_blocks(e, L, P->blocks + lo, P->stage_end[s] - lo, true, e->policy->keep_cache);
        }
        return;
    }
    if (P->refine && s < P->n_stages - 1) {
        ls_layer * N = &e->layers[L->il + 1];
        const int64_t n_embd = L->info.n_embd;
        for (int64_t c = 0; c < n_embd; c++) P->x_ref[c] = P->x_res[c] + partial[c];
        if (run_predictor(e, N, P->x_ref) == LS_OK) {
            atomic_fetch_add(&N->stats.refinements, 1);
            reprefetch(e, N);
        }
    }
}

void ls_sched_finish(ls_engine * e, bool * all_ready) {
    ls_plan * P = &e->plan;
    ls_layer * L = P->L;
    if (P->cascade) {   // last_plan: the kept blocks; last_cand: every candidate
        for (int32_t i = 0; i < P->n_sel; i++) L->last_plan[i] = P->blocks[P->sel[i]];
        L->n_last_plan = P->n_sel;
        if (P->n > 0) memcpy(L->last_cand, P->blocks, sizeof(int32_t) * (size_t) P->n);
        L->n_last_cand = P->n > 0 ? P->n : 0;
    } else {
        if (P->n > 0) memcpy(L->last_plan, P->blocks, sizeof(int32_t) * (size_t) P->n);
        L->n_last_plan = P->n > 0 ? P->n : 0;
    }
    *all_ready = true;
    for (int32_t i = 0; i < P->n; i++) {
        if (atomic_load_explicit(&L->state[P->blocks[i]], memory_order_acquire) != LS_BLK_READY) *all_ready = false;
    }
    if (L->pinned_forever) return;
    const bool keep = e->policy->keep_cache; // oneshot (DejaVu): no weight cache
    if (!P->sparse && P->n_stages > 1) {
        // chunked dense: all but the last chunk were released after their stage
        const int32_t lo = P->stage_end[P->n_stages - 2];
        release_blocks(e, L, P->blocks + lo, P->n_acquired - lo, true, keep);
    } else {
        release_blocks(e, L, P->blocks, P->n_acquired, true, keep);
    }
    P->n_acquired = 0;
}
