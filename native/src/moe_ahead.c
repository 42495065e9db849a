// moe_ahead.c — read-ahead for the MoE op: while layer n computes, the experts layer n+1 will be
// routed to are predicted by layer n+1's router applied to layer n's input (the residual stream
// changes little from one layer to the next), and those absent are read behind layer n's own
// misses, so that they land while layer n computes.
//
//   prediction   top n_used of router_{n+1} . x_n per token (+ the router's logit bias; sigmoid and
//                its probability bias where the family selects by them); a batch: the union. Recall
//                is scored on all n_used; only each token's best ahead_top (3) are candidates
//   candidates   the predicted experts absent from the cache (what read-ahead may read)
//   reads        candidates in file order, at low priority (a miss queued later goes first), only
//                once every miss of layer n has its slot, into slots no op holds (pick_victim: the
//                cache's policy; layer n+1's predicted resident experts are held meanwhile, so a
//                read-ahead never evicts them), at most a quarter of the cache; each is let go at
//                once (evictable) and taken again by layer n+1's op, which waits for it if it is
//                still landing
//   auto         per layer, a running share of its candidates the next op used (precision); below
//                ahead_min_precision (0.9) the layer's reads stop (one op in AHEAD_SAMPLE still
//                predicted and scored: the prediction's own time is not free), above it they start
//                again. Reads that miss cost disk time other misses wait for: on the calibrated
//                48-layer shape (next-layer recall 0.80, precision 0.61-0.73 reading all 8 of a
//                token's predictions), reading ahead cost x0.67 of the decode at 4 GB and x0.96 at
//                8 GB; the best 3 (ahead_top) are used 0.92 of the time. read_ahead is off by
//                default: on 2 cores it has not paid (bench/results).
//
// Counters (per layer, of the layer predicted for): ahead_ops, ahead_routed / ahead_predicted
// (recall), ahead_candidates / ahead_useful (precision), ahead_reads / ahead_used (wasted bytes =
// (reads - used) x the slot's bytes).

#include "internal.h"

#include "ggml.h"
#include "ggml-cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define AHEAD_DECAY 0.9f          // the running precision's weight of the past, per scored op
#define AHEAD_SAMPLE 16           // auto, a layer turned off: one op in this many still predicted and scored

// ---- the router ----------------------------------------------------------------------------------

static bool router_type_ok(enum ggml_type t) { return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16; }

ls_status ls_moe_ahead_layer_init(ls_moe_layer * L) {
    const size_t n = (size_t) (L->f.n_blocks > 0 ? L->f.n_blocks : 1);
    L->predicted = calloc(n, 1);
    L->candidate = calloc(n, 1);
    L->ahead = calloc(n, 1);
    L->routed_count = calloc((size_t) (L->info.n_expert > 0 ? L->info.n_expert : 1), sizeof(uint64_t));
    L->ahead_precision = 1.0f;
    if (!L->predicted || !L->candidate || !L->ahead || !L->routed_count) { ls_set_error("out of memory"); return LS_ERR_NOMEM; }
    return LS_OK;
}

void ls_moe_ahead_layer_free(ls_moe_layer * L) {
    free(L->predicted); free(L->candidate); free(L->ahead); free(L->routed_count); free(L->router_own);
}

ls_status ls_moe_set_router(ls_moe * m, int32_t il, const float * router, int32_t n_expert, int64_t n_embd, int32_t n_used) {
    if (!m || il < 0 || il >= m->n_layer || m->layers[il].f.fd < 0 || !router) { ls_set_error("ls_moe_set_router: bad arguments (layer %d)", il); return LS_ERR_ARG; }
    ls_moe_layer * L = &m->layers[il];
    if (n_expert != L->info.n_expert || n_embd != L->info.n_embd || n_used < 1 || n_used > n_expert) {
        ls_set_error("ls_moe_set_router: layer %d: a router [%d][%lld] choosing %d does not fit its %d experts of n_embd %lld",
                     il, n_expert, (long long) n_embd, n_used, L->info.n_expert, (long long) L->info.n_embd);
        return LS_ERR_ARG;
    }
    float * own = malloc(sizeof(float) * (size_t) n_expert * (size_t) n_embd);
    if (!own) { ls_set_error("out of memory"); return LS_ERR_NOMEM; }
    memcpy(own, router, sizeof(float) * (size_t) n_expert * (size_t) n_embd);
    pthread_mutex_lock(&m->op_mu);
    free(L->router_own);
    L->router_own = own;
    L->router = own;
    L->router_type = GGML_TYPE_F32;
    L->router_row = sizeof(float) * (size_t) n_embd;
    L->router_n_used = n_used;
    L->router_logit_bias = L->router_prob_bias = NULL;
    L->router_sigmoid = false;
    pthread_mutex_unlock(&m->op_mu);
    return LS_OK;
}

// a leaf (a weight) of one row of n values, f32
static bool is_bias(const struct ggml_tensor * t, int64_t n) {
    return t && t->op == GGML_OP_NONE && t->type == GGML_TYPE_F32 && t->data && ggml_nelements(t) == n && t->ne[0] == n;
}

// Layer L's router from the graph that chose `selected`: the matrix product of a weight [n_embd,
// n_expert] (F32/F16/BF16: llama.cpp keeps routers so) and what stands between it and the choice
// (a logit bias, a sigmoid and its probability bias). Not found: the layer is not predicted.
void ls_moe_ahead_find_router(ls_moe_layer * L, struct ggml_tensor * selected, int32_t n_used) {
    if (L->router_own) return;   // given (ls_moe_set_router)
    const int64_t ne = L->info.n_expert;
    struct ggml_tensor * seen[48];
    int n = 0, head = 0;
    seen[n++] = selected;
    const struct ggml_tensor * w = NULL, * logits = NULL, * sig = NULL;
    while (head < n) {
        struct ggml_tensor * t = seen[head++];
        if (t->op == GGML_OP_MUL_MAT && t->src[0] && t->src[0]->op == GGML_OP_NONE && t->src[0]->ne[0] == L->info.n_embd &&
            t->src[0]->ne[1] == ne && ggml_n_dims(t->src[0]) == 2 && router_type_ok(t->src[0]->type) && t->src[0]->data) {
            w = t->src[0];
            logits = t;
            continue;   // (above it: the FFN's input)
        }
        if (t->op == GGML_OP_UNARY && ggml_get_unary_op(t) == GGML_UNARY_OP_SIGMOID) sig = t;
        for (int s = 0; s < GGML_MAX_SRC && t->src[s] && n < (int) (sizeof(seen) / sizeof(seen[0])); s++) seen[n++] = t->src[s];
    }
    L->router = w ? w->data : NULL;
    if (!w) return;
    L->router_type = w->type;
    L->router_row = w->nb[1];
    L->router_n_used = n_used;
    L->router_logit_bias = L->router_prob_bias = NULL;
    L->router_sigmoid = sig != NULL;
    for (int i = 0; i < n; i++) {   // an add of a bias row onto the logits, or onto the sigmoid
        const struct ggml_tensor * t = seen[i];
        if (t->op != GGML_OP_ADD || !is_bias(t->src[1], ne)) continue;
        if (t->src[0] == logits) L->router_logit_bias = t->src[1]->data;
        else if (sig && t->src[0] == sig) L->router_prob_bias = t->src[1]->data;
    }
}

// ---- predicting ---------------------------------------------------------------------------------------

// N's router scores of x (one row): P->logits[n_expert], what N's selection ranks by
static void score(ls_moe_plan * P, const ls_moe_layer * N, const float * x) {
    const struct ggml_type_traits_cpu * tr = ls_cpu_traits((enum ggml_type) N->router_type);
    const enum ggml_type vt = tr->vec_dot_type;
    const void * xin = x;
    if (vt != GGML_TYPE_F32) {
        ls_cpu_traits(vt)->from_float(x, P->rq, N->info.n_embd);
        xin = P->rq;
    }
    for (int32_t e = 0; e < N->info.n_expert; e++) {
        float v;
        tr->vec_dot((int) N->info.n_embd, &v, 0, (const uint8_t *) N->router + (size_t) e * N->router_row, 0, xin, 0, 1);
        if (N->router_logit_bias) v += N->router_logit_bias[e];
        if (N->router_sigmoid) v = 1.0f / (1.0f + expf(-v));
        if (N->router_prob_bias) v += N->router_prob_bias[e];
        P->logits[e] = v;
    }
}

// N->predicted[b] |= 1 for the blocks of the top n_used experts of P->logits, |= 2 for the best
// `top` of them (those read-ahead may read)
static void mark_top(ls_moe_plan * P, ls_moe_layer * N, int32_t top) {
    float * s = P->logits;
    for (int32_t k = 0; k < N->router_n_used; k++) {
        int32_t best = -1;
        for (int32_t e = 0; e < N->info.n_expert; e++)
            if (s[e] != -INFINITY && (best < 0 || s[e] > s[best])) best = e;
        if (best < 0) return;
        N->predicted[N->block_of_expert[best]] |= (uint8_t) (k < top ? 3 : 1);
        s[best] = -INFINITY;
    }
}

static bool grow_scratch(ls_moe_plan * P, const ls_moe_layer * N) {
    const enum ggml_type vt = ls_cpu_traits((enum ggml_type) N->router_type)->vec_dot_type;
    return ls_grow((void **) &P->rq, &P->rq_cap, ggml_row_size(vt, N->info.n_embd), 1) &&
           ls_grow((void **) &P->logits, &P->logits_cap, (size_t) N->info.n_expert, sizeof(float)) &&
           ls_grow((void **) &P->ahead_list, &P->ahead_cap, 2 * (size_t) N->f.n_blocks, sizeof(int32_t));
}

// the next layer after il with experts and a router, or NULL
static ls_moe_layer * next_layer(ls_moe * m, int32_t il) {
    for (int32_t j = il + 1; j < m->n_layer; j++) {
        ls_moe_layer * N = &m->layers[j];
        if (N->f.fd < 0) continue;   // a dense layer between: the one after it
        return N->router && N->router_n_used > 0 ? N : NULL;
    }
    return NULL;
}

// ---- reading ----------------------------------------------------------------------------------------

static bool reads_on(const ls_moe * m, const ls_moe_layer * N) {
    return m->params.read_ahead == LS_AHEAD_ON || (m->params.read_ahead == LS_AHEAD_AUTO && !N->ahead_off);
}

// N's candidates read (file order), at most `cap`, into slots no op holds; each let go at once. The
// predicted experts already resident are held meanwhile (no candidate evicts them), then let go.
static void read_candidates(ls_moe * m, ls_moe_plan * P, ls_moe_layer * N, int32_t cap) {
    ls_blockfile * F = &N->f;
    int32_t slot, n = 0, n_held = 0;
    int32_t * held = P->ahead_list + F->n_blocks;
    bool miss;
    for (int32_t b = 0; b < F->n_blocks; b++)
        if (N->predicted[b] && F->slot[b] >= 0 && ls_cache_acquire(&m->cache, F, b, &slot, &miss) == LS_OK) held[n_held++] = b;
    for (int32_t b = 0; b < F->n_blocks && n < cap; b++) {
        if (!N->candidate[b] || F->slot[b] >= 0) continue;
        if (ls_cache_acquire(&m->cache, F, b, &slot, &miss) != LS_OK) break;   // every slot held
        P->ahead_list[n++] = b;
        N->ahead[b] = 1;
    }
    for (int32_t i = 0; i < n_held; i++) ls_cache_release(&m->cache, F, held[i], false);
    if (n == 0) return;
    ls_io_submit_low(&m->io, F, P->ahead_list, n);   // the ops' own misses go first
    for (int32_t i = 0; i < n; i++) ls_cache_release(&m->cache, F, P->ahead_list[i], false);
    atomic_fetch_add(&N->stats.ahead_reads, (uint64_t) n);
}

void ls_moe_ahead_plan(ls_moe * m, ls_moe_plan * P) {
    if (m->params.read_ahead == LS_AHEAD_OFF || P->n_tokens > m->params.ahead_max_tokens || P->n_tokens <= 0) return;
    ls_moe_layer * N = next_layer(m, P->L->f.il);
    if (!N || !grow_scratch(P, N)) return;
    if (m->params.read_ahead == LS_AHEAD_AUTO && N->ahead_off && ++N->ahead_skipped % AHEAD_SAMPLE != 0) return;
    ls_blockfile * F = &N->f;
    memset(N->predicted, 0, (size_t) F->n_blocks);
    memset(N->candidate, 0, (size_t) F->n_blocks);
    const int32_t top = m->params.ahead_top > 0 ? m->params.ahead_top : N->router_n_used;
    for (int64_t t = 0; t < P->n_tokens; t++) {
        score(P, N, (const float *) ((const uint8_t *) P->x + (size_t) t * P->x_stride));
        mark_top(P, N, top);
    }
    for (int32_t b = 0; b < F->n_blocks; b++) N->candidate[b] = (N->predicted[b] & 2) && F->slot[b] < 0;
    N->has_prediction = true;
    // only once every miss of this layer has its slot (then nothing this op needs can be evicted)
    if (!reads_on(m, N) || P->starved || P->next_read < P->n_entries) return;
    const int32_t cap = m->cache.n_slots / 4;
    read_candidates(m, P, N, cap);
}

// ---- scoring (the predicted layer's own op, thread 0, before its blocks are taken) --------------------

void ls_moe_ahead_score(ls_moe * m, ls_moe_plan * P) {
    if (m->params.read_ahead == LS_AHEAD_OFF) return;   // (nothing predicted, nothing read early)
    ls_moe_layer * L = P->L;
    const ls_blockfile * F = &L->f;
    uint64_t used_ahead = 0, predicted = 0, useful = 0, candidates = 0;
    for (int32_t b = 0; b < F->n_blocks; b++) {
        const bool used = P->entry_of[b] == 0;   // (group_pairs: 0 marks a block this batch uses)
        used_ahead += used && L->ahead[b];
        predicted += used && L->predicted[b];
        useful += used && L->candidate[b];
        candidates += L->candidate[b];
    }
    if (F->n_blocks > 0) memset(L->ahead, 0, (size_t) F->n_blocks);
    if (used_ahead) atomic_fetch_add(&L->stats.ahead_used, used_ahead);
    if (!L->has_prediction) return;
    L->has_prediction = false;
    int32_t routed = 0;
    for (int32_t b = 0; b < F->n_blocks; b++) routed += P->entry_of[b] == 0;
    atomic_fetch_add(&L->stats.ahead_ops, 1);
    atomic_fetch_add(&L->stats.ahead_routed, (uint64_t) routed);
    atomic_fetch_add(&L->stats.ahead_predicted, predicted);
    atomic_fetch_add(&L->stats.ahead_candidates, candidates);
    atomic_fetch_add(&L->stats.ahead_useful, useful);
    if (candidates > 0) {
        L->ahead_precision = AHEAD_DECAY * L->ahead_precision + (1.0f - AHEAD_DECAY) * (float) useful / (float) candidates;
        L->ahead_off = L->ahead_precision < m->params.ahead_min_precision;
    }
}
