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

// One op's tensors and shapes, as its threads share them
typedef struct {
    struct ggml_tensor * dst;                  // [n_vocab, T] logits
    const struct ggml_tensor * w, * x;         // [n_embd, n_vocab] weights; [n_embd, T] f32 hidden state
    const struct ggml_type_traits_cpu * tw;    // w's
    enum ggml_type vt;                         // w's vec_dot type: x's rows quantized to it
    int64_t n_embd, n_vocab, T;
    size_t xrow;                               // bytes of one quantized x row
} head_op;

static float * logits_row(const head_op * o, int64_t t) { return (float *) ((char *) o->dst->data + (size_t) t * o->dst->nb[1]); }

// Thread 0, holding op_mu for the op: the scratch for T rows and the draft's settings of this op;
// H->ok false (the error recorded) without them or when the draft vocabulary exceeds the model's.
static void head_begin(ls_engine * e, const head_op * o) {
    ls_head * H = &e->head;
    const int64_t T = o->T;
    pthread_mutex_lock(&e->op_mu);
    H->ok = ls_grow((void **) &H->xq, &H->xq_cap, (size_t) T * o->xrow, 1) &&
            ls_grow((void **) &H->top, &H->top_cap, (size_t) T * LS_DRAFT_TOP * sizeof(int32_t), 1) &&
            ls_grow((void **) &H->prob, &H->prob_cap, (size_t) T * LS_DRAFT_TOP * sizeof(float), 1);
    H->draft = e->draft;
    H->n_rows = 0;
    if (!H->ok) ls_engine_record_error(e, LS_ERR_NOMEM, "output projection: out of memory");
    if (H->ok && H->n_vocab_draft > 0 && H->vocab[H->n_vocab_draft - 1] >= o->n_vocab) {
        ls_engine_record_error(e, LS_ERR_ARG, "draft vocabulary holds token %d, the model has %lld",
                               H->vocab[H->n_vocab_draft - 1], (long long) o->n_vocab);
        H->ok = false;
    }
}

// this thread's share of the op's input: x rows quantized to the weights' vec_dot type, as
// ggml_mul_mat does; of a subset's logits, those it does not compute -inf (a draft reads only the
// top tokens)
static void head_inputs(const ls_head * H, const head_op * o, bool subset, int ith, int nth) {
    for (int64_t t = ith; t < o->T; t += nth) {
        const float * xt = (const float *) ((const char *) o->x->data + (size_t) t * o->x->nb[1]);
        if (o->vt == GGML_TYPE_F32) memcpy(H->xq + (size_t) t * o->xrow, xt, o->xrow);
        else ls_cpu_traits(o->vt)->from_float(xt, H->xq + (size_t) t * o->xrow, o->n_embd);
    }
    if (subset) {
        const int64_t v0 = o->n_vocab * ith / nth, v1 = o->n_vocab * (ith + 1) / nth;
        for (int64_t t = 0; t < o->T; t++) {
            float * y = logits_row(o, t);
            for (int64_t v = v0; v < v1; v++) y[v] = -INFINITY;
        }
    }
}

// the logits of entries [i0, i1) of the vocabulary computed (subset: of the draft vocabulary) for every row
static void head_rows(const ls_head * H, const head_op * o, bool subset, int64_t i0, int64_t i1) {
    const struct ggml_tensor * w = o->w;
    const bool own = w->type == GGML_TYPE_Q6_K && o->vt == GGML_TYPE_Q8_K;   // the library's kernel (module doc)
    const void * xs[LS_EXACT_ROWS];
    for (int64_t t = 0; t < o->T; t++) xs[t] = H->xq + (size_t) t * o->xrow;
    const size_t ystride = o->dst->nb[1] / sizeof(float);
    for (int64_t i = i0; i < i1; i++) {
        const int64_t v = subset ? H->vocab[i] : i;
        const uint8_t * wr = (const uint8_t *) w->data + (size_t) v * w->nb[1];
        // a subset's rows are scattered over the matrix, beyond the hardware prefetchers' reach:
        // the row HEAD_AHEAD ahead is fetched whole while this one computes (measured on Qwen's
        // 32k draft rows, one thread: 9.8 ms -> 6.3 ms)
        if (subset && i + HEAD_AHEAD < i1) {
            const uint8_t * nx = (const uint8_t *) w->data + (size_t) H->vocab[i + HEAD_AHEAD] * w->nb[1];
            for (size_t off = 0; off < w->nb[1]; off += 64) __builtin_prefetch(nx + off, 0, 3);
        }
        if (own) {
            ls_head_q6_K(wr, o->n_embd, xs, o->T, (float *) o->dst->data + v, ystride);
            continue;
        }
        for (int64_t t = 0; t < o->T; t++)
            o->tw->vec_dot((int) o->n_embd, &logits_row(o, t)[v], 0, wr, 0, H->xq + (size_t) t * o->xrow, 0, 1);
    }
}

// Thread 0, every row computed: a draft's best tokens of each row over the n entries of its
// vocabulary (subset: the draft vocabulary; else every token); op_mu released.
static void head_end(ls_engine * e, const head_op * o, bool subset, int64_t n) {
    ls_head * H = &e->head;
    if (H->draft) {
        if (!subset) {   // every token is in the draft vocabulary
            if (!ls_grow((void **) &H->all, &H->all_cap, (size_t) o->n_vocab * sizeof(int32_t), 1)) {
                ls_engine_record_error(e, LS_ERR_NOMEM, "output projection: out of memory");
            } else {
                for (int64_t v = 0; v < o->n_vocab; v++) H->all[v] = (int32_t) v;
            }
        }
        const int32_t * ids = subset ? H->vocab : H->all;
        for (int64_t t = 0; t < o->T && ids; t++)
            row_top(logits_row(o, t), ids, (int32_t) n, H->top + t * LS_DRAFT_TOP, H->prob + t * LS_DRAFT_TOP);
        H->n_rows = (int32_t) o->T;
    }
    pthread_mutex_unlock(&e->op_mu);
}

static void head_compute(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    ls_engine * e = userdata;
    ls_head * H = &e->head;
    head_op o = { .dst = dst, .w = dst->src[0], .x = dst->src[1] };
    o.n_embd = o.w->ne[0];
    o.n_vocab = o.w->ne[1];
    o.T = o.x->ne[1];
    o.tw = ls_cpu_traits(o.w->type);
    o.vt = o.tw->vec_dot_type;
    o.xrow = ggml_row_size(o.vt, o.n_embd);
    if (ith == 0) head_begin(e, &o);
    ls_barrier_wait(&e->barrier, nth);
    if (!H->ok) {   // every logit -inf
        for (int64_t t = ith; t < o.T; t += nth) {
            float * y = logits_row(&o, t);
            for (int64_t v = 0; v < o.n_vocab; v++) y[v] = -INFINITY;
        }
        ls_barrier_wait(&e->barrier, nth);
        if (ith == 0) pthread_mutex_unlock(&e->op_mu);
        return;
    }
    const bool subset = H->draft && H->n_vocab_draft > 0;
    head_inputs(H, &o, subset, ith, nth);
    ls_barrier_wait(&e->barrier, nth);
    const int64_t n = subset ? H->n_vocab_draft : o.n_vocab;
    head_rows(H, &o, subset, n * ith / nth, n * (ith + 1) / nth);
    ls_barrier_wait(&e->barrier, nth);
    if (ith == 0) head_end(e, &o, subset, n);
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
