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
// A Q6_K output matrix (Qwen2.5's) takes this file's own dot product instead of ggml's vec_dot:
// per super-block of 256 values the integer sum S = sum_g scale_g * (sum_{i in g} q_i x_i - 32 *
// bsum_g) (exact, however it is computed), then acc = fmaf(d_w * d_x, S, acc), super-blocks in
// order. Every row of a batch gets exactly this, so the weights are unpacked once for all rows of
// a verify pass (their 6-bit values to bytes) and each row only multiplies: the arithmetic does
// not depend on the rows beside it, the instruction set (AVX2 or AVX-512) or the thread.

#include "internal.h"

#include "ggml.h"
#include "ggml-cpu.h"

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static bool grow_bytes(void ** p, size_t * cap, size_t need) {
    if (need <= *cap) return true;
    void * q = NULL;
    if (posix_memalign(&q, 64, (need + 63) & ~(size_t) 63) != 0) return false;
    free(*p);
    *p = q;
    *cap = need;
    return true;
}

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

// ---- the Q6_K x Q8_K head rows kernel ---------------------------------------------------------

typedef struct { uint8_t ql[128], qh[64]; int8_t sc[16]; uint16_t d; } ls_q6_K;      // ggml's block_q6_K
typedef struct { float d; int8_t qs[256]; int16_t bsums[16]; } ls_q8_K;               // ggml's block_q8_K

// The 256 6-bit values of a Q6_K super-block as bytes 0..63, in value order (ggml's layout: of
// each 128 values, ql's low nibbles then high nibbles of 64 bytes, qh's 2-bit pairs on top).
static void q6_K_unpack(const ls_q6_K * b, uint8_t * q) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
    for (int half = 0; half < 2; half++) {
        const uint8_t * ql = b->ql + 64 * half;
        const __m256i hh = _mm256_loadu_si256((const __m256i *) (b->qh + 32 * half));
        for (int seg = 0; seg < 4; seg++) {
            const __m256i l = _mm256_loadu_si256((const __m256i *) (ql + (seg & 1) * 32));
            const __m256i lo = seg < 2 ? _mm256_and_si256(l, m4) : _mm256_and_si256(_mm256_srli_epi16(l, 4), m4);
            const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hh, _mm_cvtsi32_si128(2 * seg)), m2), 4);
            _mm256_storeu_si256((__m256i *) (q + 128 * half + 32 * seg), _mm256_or_si256(lo, hi));
        }
    }
}

static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

// S of one super-block (q unpacked, sc its 16 scales) against one Q8_K block (module doc)
static inline int32_t q6_K_sum_avx2(const uint8_t * q, const __m256i * sc16, const ls_q8_K * x) {
    __m256i acc = _mm256_setzero_si256();
    for (int c = 0; c < 8; c++) {   // 32 values: groups 2c and 2c + 1
        const __m256i p = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *) (q + 32 * c)),
                                               _mm256_loadu_si256((const __m256i *) (x->qs + 32 * c)));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, sc16[c]));
    }
    return hsum_i32(acc);
}

// The same super-block sums in AVX-512BW: the 256 values in four registers (64 each) and the
// scales spread over them once, every row's x then multiplied in four steps.
__attribute__((target("avx512f,avx512bw")))
static void q6_K_head_row_avx512(const ls_q6_K * w, int64_t n, const ls_q8_K * const * x, int64_t T, float * out,
                                 size_t out_stride) {
    float acc[LS_EXACT_ROWS];
    for (int64_t t = 0; t < T; t++) acc[t] = 0.0f;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x03);
    // shift counts of qh per 16-bit lane: the low 256 bits one segment, the high the next
    const __m512i sh_a = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    const __m512i sh_b = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
    __m512i idx[4];   // i16 lane l of chunk c takes the scale of group 4c + l / 8
    for (int c = 0; c < 4; c++) {
        int16_t v[32];
        for (int l = 0; l < 32; l++) v[l] = (int16_t) (4 * c + l / 8);
        idx[c] = _mm512_loadu_si512((const void *) v);
    }
    for (int64_t b = 0; b < n / 256; b++) {
        __m512i q[4], sc[4];
        for (int half = 0; half < 2; half++) {
            const __m512i l = _mm512_loadu_si512((const void *) (w[b].ql + 64 * half));
            const __m256i h256 = _mm256_loadu_si256((const __m256i *) (w[b].qh + 32 * half));
            const __m512i hh = _mm512_inserti64x4(_mm512_castsi256_si512(h256), h256, 1);
            const __m512i ha = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(hh, sh_a), m2), 4);
            const __m512i hb = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(hh, sh_b), m2), 4);
            q[2 * half] = _mm512_or_si512(_mm512_and_si512(l, m4), ha);
            q[2 * half + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4), hb);
        }
        const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *) w[b].sc));
        for (int c = 0; c < 4; c++) sc[c] = _mm512_permutexvar_epi16(idx[c], _mm512_castsi256_si512(s16));
        const float dw = _cvtsh_ss(w[b].d);
        for (int64_t t = 0; t < T; t++) {
            const ls_q8_K * xb = &x[t][b];
            __m512i s = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) {
                const __m512i p = _mm512_maddubs_epi16(q[c], _mm512_loadu_si512((const void *) (xb->qs + 64 * c)));
                s = _mm512_add_epi32(s, _mm512_madd_epi16(p, sc[c]));
            }
            const __m256i bm = _mm256_madd_epi16(s16, _mm256_loadu_si256((const __m256i *) xb->bsums));
            const int32_t S = _mm512_reduce_add_epi32(s) - 32 * hsum_i32(bm);
            const float f = dw * xb->d;
            acc[t] = fmaf(f, (float) S, acc[t]);
        }
    }
    for (int64_t t = 0; t < T; t++) out[(size_t) t * out_stride] = acc[t];
}

// rows [t0, t1) of y[t][v] = W_v . x_t for one Q6_K weight row of n values
static void q6_K_head_row(const ls_q6_K * w, int64_t n, const ls_q8_K * const * x, int64_t T, float * out, size_t out_stride) {
    uint8_t q[256] __attribute__((aligned(32)));
    float acc[LS_EXACT_ROWS];
    for (int64_t t = 0; t < T; t++) acc[t] = 0.0f;
    for (int64_t b = 0; b < n / 256; b++) {
        q6_K_unpack(&w[b], q);
        __m256i sc16[8];
        int32_t scs[16];
        for (int g = 0; g < 16; g++) scs[g] = w[b].sc[g];
        for (int c = 0; c < 8; c++) {
            const __m128i lo = _mm_set1_epi16((int16_t) scs[2 * c]), hi = _mm_set1_epi16((int16_t) scs[2 * c + 1]);
            sc16[c] = _mm256_set_m128i(hi, lo);
        }
        const float dw = _cvtsh_ss(w[b].d);
        for (int64_t t = 0; t < T; t++) {
            const ls_q8_K * xb = &x[t][b];
            int32_t bsum = 0;
            for (int g = 0; g < 16; g++) bsum += scs[g] * xb->bsums[g];
            const int32_t S = q6_K_sum_avx2(q, sc16, xb) - 32 * bsum;
            const float f = dw * xb->d;
            acc[t] = fmaf(f, (float) S, acc[t]);
        }
    }
    for (int64_t t = 0; t < T; t++) out[(size_t) t * out_stride] = acc[t];
}

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
        H->ok = grow_bytes((void **) &H->xq, &H->xq_cap, (size_t) T * xrow) &&
                grow_bytes((void **) &H->top, &H->top_cap, (size_t) T * LS_DRAFT_TOP * sizeof(int32_t)) &&
                grow_bytes((void **) &H->prob, &H->prob_cap, (size_t) T * LS_DRAFT_TOP * sizeof(float));
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
    const bool own = w->type == GGML_TYPE_Q6_K && vt == GGML_TYPE_Q8_K;   // this file's kernel (module doc)
    const bool avx512 = strncmp(ls_kernel_isa(), "avx512", 6) == 0;
    const ls_q8_K * xs[LS_EXACT_ROWS];
    for (int64_t t = 0; t < T; t++) xs[t] = (const ls_q8_K *) (H->xq + (size_t) t * xrow);
    const size_t ystride = dst->nb[1] / sizeof(float);
    for (int64_t i = i0; i < i1; i++) {
        const int64_t v = subset ? H->vocab[i] : i;
        const uint8_t * wr = (const uint8_t *) w->data + (size_t) v * w->nb[1];
        if (own) {
            (avx512 ? q6_K_head_row_avx512 : q6_K_head_row)((const ls_q6_K *) wr, n_embd, xs, T, (float *) dst->data + v, ystride);
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
                if (!grow_bytes((void **) &H->all, &H->all_cap, (size_t) n_vocab * sizeof(int32_t))) {
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
