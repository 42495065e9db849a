// head.c — the output projection (the LM head) as a ggml custom op, for speculative decoding.
//
// The patched llama.cpp hands its output matrix W [n_embd, n_vocab] and the normalised hidden
// state x [n_embd, n_rows] to ls_output_build (llama_set_output_builder), which puts one node in
// its place: logits[t][v] = W_v . x_t, each with ggml's own vec_dot after x_t is quantized by the
// weight type's from_float (exactly what ggml_mul_mat computes for a batch of up to
// LS_EXACT_ROWS rows under llama_set_exact_rows, so plain decoding and a verify pass agree).
// While the draft is on (ls_engine_set_draft), only the rows of the draft vocabulary
// (ls_engine_set_draft_vocab: the tokens that matter, by frequency and from the context; every
// token if none is set) are computed, the others set to -inf, and each row's LS_DRAFT_TOP best
// tokens with their probabilities (softmax over the draft vocabulary) are kept for
// ls_engine_draft_top: the draft reads a fraction of the 150 MB output matrix of a large
// vocabulary, and its caller reads a few numbers instead of scanning the logits.
//
// A Q6_K output matrix (Qwen2.5's) takes the library's own kernel instead of ggml's vec_dot
// (ls_head_q6_K: kernels.c holds its arithmetic): per super-block of 256 values an exact integer
// sum, then one fused add per super-block in order. Every row of a batch gets exactly this, so the
// weights are unpacked once for all rows of a verify pass (their 6-bit values to bytes) and each
// row only multiplies: the arithmetic does not depend on the rows beside it, the instruction set
// or the thread.

#include "internal.h"

#include "ggml.h"
#include "ggml-cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

// The best LS_DRAFT_TOP tokens of one logits row over the draft vocabulary (ids ascending),
// best first, and their softmax probabilities over that vocabulary.
static void row_top(const float * y, const int32_t * ids, int32_t n, int32_t * top, float * prob) {
    int32_t k = 0;
    float m = -INFINITY;
    for (int32_t i = 0; i < n; i++) {
        const float v = y[ids[i]];
        if (v > m) m = v;
        if (k < LS_DRAFT_TOP || v > y[top[k - 1]]) {   // insertion into the sorted top list
            int32_t j = k < LS_DRAFT_TOP ? k++ : k - 1;
            while (j > 0 && y[top[j - 1]] < v) { top[j] = top[j - 1]; j--; }
            top[j] = ids[i];
        }
    }
    double z = 0.0;
    for (int32_t i = 0; i < n; i++) z += exp((double) (y[ids[i]] - m));
    for (int32_t j = 0; j < LS_DRAFT_TOP; j++) {
        if (j < k) prob[j] = (float) (exp((double) (y[top[j]] - m)) / z);
        else { top[j] = -1; prob[j] = 0.0f; }
    }
}

enum { HEAD_AHEAD = 4 };   // rows of a draft vocabulary fetched ahead of the one computing

static void head_compute(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    ls_engine * e = userdata;
    ls_head * H = &e->head;
    const struct ggml_tensor * w = dst->src[0];
    const struct ggml_tensor * x = dst->src[1];
    const int64_t n_embd = w->ne[0], n_vocab = w->ne[1], T = x->ne[1];
    const struct ggml_type_traits_cpu * tw = ls_cpu_traits(w->type);
    const enum ggml_type vt = tw->vec_dot_type;
    const size_t xrow = ggml_row_size(vt, n_embd);
    if (ith == 0) {
        pthread_mutex_lock(&e->op_mu);
        H->ok = ls_grow((void **) &H->xq, &H->xq_cap, (size_t) T * xrow, 1) &&
                ls_grow((void **) &H->top, &H->top_cap, (size_t) T * LS_DRAFT_TOP * sizeof(int32_t), 1) &&
                ls_grow((void **) &H->prob, &H->prob_cap, (size_t) T * LS_DRAFT_TOP * sizeof(float), 1);
        H->draft = e->draft;
        H->n_rows = 0;
        if (!H->ok) ls_engine_record_error(e, LS_ERR_NOMEM, "output projection: out of memory");
        if (H->ok && H->n_vocab_draft > 0 && H->vocab[H->n_vocab_draft - 1] >= n_vocab) {
            ls_engine_record_error(e, LS_ERR_ARG, "draft vocabulary holds token %d, the model has %lld",
                                   H->vocab[H->n_vocab_draft - 1], (long long) n_vocab);
            H->ok = false;
        }
    }
    ls_barrier_wait(&e->barrier, nth);
    if (!H->ok) {
        for (int64_t t = ith; t < T; t += nth) {
            float * y = (float *) ((char *) dst->data + (size_t) t * dst->nb[1]);
            for (int64_t v = 0; v < n_vocab; v++) y[v] = -INFINITY;
        }
        ls_barrier_wait(&e->barrier, nth);
        if (ith == 0) pthread_mutex_unlock(&e->op_mu);
        return;
    }
    // x rows quantized to the weights' vec_dot type, as ggml_mul_mat does
    for (int64_t t = ith; t < T; t += nth) {
        const float * xt = (const float *) ((const char *) x->data + (size_t) t * x->nb[1]);
        if (vt == GGML_TYPE_F32) memcpy(H->xq + (size_t) t * xrow, xt, xrow);
        else ls_cpu_traits(vt)->from_float(xt, H->xq + (size_t) t * xrow, n_embd);
    }
    const bool subset = H->draft && H->n_vocab_draft > 0;
    if (subset) {   // the rows the draft does not compute are -inf (a draft reads only the top tokens)
        const int64_t v0 = n_vocab * ith / nth, v1 = n_vocab * (ith + 1) / nth;
        for (int64_t t = 0; t < T; t++) {
            float * y = (float *) ((char *) dst->data + (size_t) t * dst->nb[1]);
            for (int64_t v = v0; v < v1; v++) y[v] = -INFINITY;
        }
    }
    ls_barrier_wait(&e->barrier, nth);
    const int64_t n = subset ? H->n_vocab_draft : n_vocab;
    const int64_t i0 = n * ith / nth, i1 = n * (ith + 1) / nth;
    const bool own = w->type == GGML_TYPE_Q6_K && vt == GGML_TYPE_Q8_K;   // the library's kernel (module doc)
    const void * xs[LS_EXACT_ROWS];
    for (int64_t t = 0; t < T; t++) xs[t] = H->xq + (size_t) t * xrow;
    const size_t ystride = dst->nb[1] / sizeof(float);
    for (int64_t i = i0; i < i1; i++) {
        const int64_t v = subset ? H->vocab[i] : i;
        const uint8_t * wr = (const uint8_t *) w->data + (size_t) v * w->nb[1];
        // a subset's rows are scattered over the matrix, beyond the hardware prefetchers' reach:
        // the row HEAD_AHEAD ahead is fetched whole while this one computes (measured on Qwen's
        // 32k draft rows, one thread: 9.8 ms -> 6.3 ms)
        if (subset && i + HEAD_AHEAD < i1) {
            const uint8_t * nx = (const uint8_t *) w->data + (size_t) H->vocab[i + HEAD_AHEAD] * w->nb[1];
            for (size_t o = 0; o < w->nb[1]; o += 64) __builtin_prefetch(nx + o, 0, 3);
        }
        if (own) {
            ls_head_q6_K(wr, n_embd, xs, T, (float *) dst->data + v, ystride);
            continue;
        }
        for (int64_t t = 0; t < T; t++) {
            float * y = (float *) ((char *) dst->data + (size_t) t * dst->nb[1]);
            tw->vec_dot((int) n_embd, &y[v], 0, wr, 0, H->xq + (size_t) t * xrow, 0, 1);
        }
    }
    ls_barrier_wait(&e->barrier, nth);
    if (ith == 0) {
        if (H->draft) {
            if (!subset) {   // every token is in the draft vocabulary
                if (!ls_grow((void **) &H->all, &H->all_cap, (size_t) n_vocab * sizeof(int32_t), 1)) {
                    ls_engine_record_error(e, LS_ERR_NOMEM, "output projection: out of memory");
                } else {
                    for (int64_t v = 0; v < n_vocab; v++) H->all[v] = (int32_t) v;
                }
            }
            const int32_t * ids = subset ? H->vocab : H->all;
            for (int64_t t = 0; t < T && ids; t++)
                row_top((const float *) ((const char *) dst->data + (size_t) t * dst->nb[1]), ids, (int32_t) n,
                        H->top + t * LS_DRAFT_TOP, H->prob + t * LS_DRAFT_TOP);
            H->n_rows = (int32_t) T;
        }
        pthread_mutex_unlock(&e->op_mu);
    }
}

struct ggml_tensor * ls_output_build(struct ggml_context * ctx0, struct ggml_tensor * w, struct ggml_tensor * cur,
                                     void * engine) {
    ls_engine * e = engine;
    // what llama.cpp's own kernels do instead: a batch beyond the exact rows (logits of a whole
    // prompt), weights in a repacked layout, or a type without a CPU vec_dot
    if (!e || cur->ne[1] > LS_EXACT_ROWS || cur->type != GGML_TYPE_F32 || w->extra != NULL || !ggml_is_contiguous_rows(cur) ||
        cur->ne[2] * cur->ne[3] != 1 || w->ne[2] * w->ne[3] != 1 || w->ne[0] != cur->ne[0] || !ls_cpu_ready() ||
        !ls_cpu_traits(w->type) || !ls_cpu_traits(w->type)->vec_dot) {
        return NULL;
    }
    struct ggml_tensor * args[2] = { w, cur };
    return ggml_custom_4d(ctx0, GGML_TYPE_F32, w->ne[1], cur->ne[1], 1, 1, args, 2, head_compute, GGML_N_TASKS_MAX, e);
}

static int cmp_i32(const void * a, const void * b) {
    const int32_t x = *(const int32_t *) a, y = *(const int32_t *) b;
    return (x > y) - (x < y);
}

ls_status ls_engine_set_draft_vocab(ls_engine * e, const int32_t * ids, int32_t n) {
    if (!e || n < 0 || (n > 0 && !ids)) { ls_set_error("ls_engine_set_draft_vocab: bad arguments"); return LS_ERR_ARG; }
    int32_t * v = NULL;
    if (n > 0) {
        v = malloc(sizeof(int32_t) * (size_t) n);
        if (!v) { ls_set_error("out of memory"); return LS_ERR_NOMEM; }
        memcpy(v, ids, sizeof(int32_t) * (size_t) n);
        qsort(v, (size_t) n, sizeof(int32_t), cmp_i32);
        int32_t m = 0;
        for (int32_t i = 0; i < n; i++) {
            if (v[i] < 0) { free(v); ls_set_error("ls_engine_set_draft_vocab: token %d", v[i]); return LS_ERR_ARG; }
            if (m == 0 || v[i] != v[m - 1]) v[m++] = v[i];
        }
        n = m;
    }
    ls_engine_lock_between_ops(e);
    free(e->head.vocab);
    e->head.vocab = v;
    e->head.n_vocab_draft = n;
    ls_engine_unlock_between_ops(e);
    return LS_OK;
}

int32_t ls_engine_draft_top(ls_engine * e, int32_t row, int32_t * ids, float * probs, int32_t cap) {
    if (!e || !ids || !probs || cap <= 0) return 0;
    pthread_mutex_lock(&e->op_mu);
    int32_t n = 0;
    if (row >= 0 && row < e->head.n_rows) {
        for (; n < cap && n < LS_DRAFT_TOP && e->head.top[row * LS_DRAFT_TOP + n] >= 0; n++) {
            ids[n] = e->head.top[row * LS_DRAFT_TOP + n];
            probs[n] = e->head.prob[row * LS_DRAFT_TOP + n];
        }
    }
    pthread_mutex_unlock(&e->op_mu);
    return n;
}

void ls_head_free(ls_head * H) {
    free(H->vocab); free(H->xq); free(H->top); free(H->prob); free(H->all);
    memset(H, 0, sizeof(*H));
}
