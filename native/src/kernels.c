// kernels.c — the arithmetic of the FFN op that ggml does not provide: the gate activations
// (one table entry per LS_ACT_*) and the down projection over transposed columns,
// acc += h * column (Q8_0 columns, the converter's default, get fused AVX2 kernels reading the
// int8 values in place: block = {f16 d; int8 q[32]}). Leaf file: calls nothing of the library.

#include "internal.h"

#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

static float act_silu(float x) { return x / (1.0f + expf(-x)); }
static inline float f16_round(float x) { return _cvtsh_ss(_cvtss_sh(x, 0)); }  // to f16 and back, ties to even
static float act_gelu(float x) {
    // GELU, tanh form, exactly as ggml's CPU geglu computes it (GGML_GELU_FP16): 0 below -10,
    // x above 10, otherwise a lookup table indexed by x rounded to f16 whose entries are
    // gelu(that f16 value) rounded to f16. Evaluating the table's formula here gives its entry.
    if (x <= -10.0f) return 0.0f;
    if (x >= 10.0f) return x;
    const float c = 0.79788456080286535587989211986876f; // sqrt(2/pi), ggml's SQRT_2_OVER_PI
    const float xr = f16_round(x);
    return f16_round(0.5f * xr * (1.0f + tanhf(c * xr * (1.0f + 0.044715f * xr * xr))));
}

// the activation table: the op computes act(gate . x) * (up . x) for any entry
static float (* const ACTS[])(float) = { [LS_ACT_SILU] = act_silu, [LS_ACT_GELU] = act_gelu };

float ls_act(int32_t activation, float g) { return ACTS[activation](g); }

// ---- run-time ISA choice ------------------------------------------------------------------------
//
// The library is compiled for AVX2 (the baseline the ggml build assumes); the hot loops also have
// AVX-512 (F + BW) variants, compiled with target attributes and chosen once at engine creation
// when the CPU has them. LEANSTREAM_ISA=avx2 forces the AVX2 variants (tests run both).

typedef void (*axpy_q8_0_fn)(float *, const float *, const ls_block_q8_0 * const *, int, int64_t);
typedef void (*dot2_q4_K_fn)(int64_t, const void *, const void *, const void *, float *, float *, const uint8_t *, int);
typedef void (*axpy_tile_fn)(float *, const float *, const float *, int, int64_t, int64_t);

static inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }

// acc[0..n) += sum_{j<m} h[j] * dequant(col_j): one load/store of acc per 8 columns. The 8
// columns' scales of a 32-value block are converted together (one f16 -> f32 of 8 lanes).
static void axpy_q8_0_multi_avx2(float * restrict acc, const float * h, const ls_block_q8_0 * const * cols, int m, int64_t n) {
    int j0 = 0;
    for (; j0 + 8 <= m; j0 += 8) {
        const ls_block_q8_0 * const * c = cols + j0;
        const __m256 h8 = _mm256_loadu_ps(h + j0);
        for (int64_t b = 0; b < n / 32; b++) {
            __m128i d16 = _mm_cvtsi32_si128(c[0][b].d);
            d16 = _mm_insert_epi16(d16, c[1][b].d, 1);
            d16 = _mm_insert_epi16(d16, c[2][b].d, 2);
            d16 = _mm_insert_epi16(d16, c[3][b].d, 3);
            d16 = _mm_insert_epi16(d16, c[4][b].d, 4);
            d16 = _mm_insert_epi16(d16, c[5][b].d, 5);
            d16 = _mm_insert_epi16(d16, c[6][b].d, 6);
            d16 = _mm_insert_epi16(d16, c[7][b].d, 7);
            const __m256 s8 = _mm256_mul_ps(h8, _mm256_cvtph_ps(d16));
            __m256 s[8];
            for (int j = 0; j < 8; j++) s[j] = _mm256_permutevar8x32_ps(s8, _mm256_set1_epi32(j));
            float * a = acc + b * 32;
            for (int i = 0; i < 32; i += 8) {
                __m256 v = _mm256_loadu_ps(a + i);
                for (int j = 0; j < 8; j++) {
                    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) (c[j][b].qs + i))));
                    v = _mm256_fmadd_ps(s[j], q, v);
                }
                _mm256_storeu_ps(a + i, v);
            }
        }
    }
    if (j0 == m) return;
    const int mj = m - j0;   // the last columns, fewer than 8
    for (int64_t b = 0; b < n / 32; b++) {
        __m256 s[8];
        for (int j = 0; j < mj; j++) s[j] = _mm256_set1_ps(h[j0 + j] * f16_to_f32(cols[j0 + j][b].d));
        float * a = acc + b * 32;
        for (int i = 0; i < 32; i += 8) {
            __m256 v = _mm256_loadu_ps(a + i);
            for (int j = 0; j < mj; j++) {
                const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) (cols[j0 + j][b].qs + i))));
                v = _mm256_fmadd_ps(s[j], q, v);
            }
            _mm256_storeu_ps(a + i, v);
        }
    }
}

// the same sum, 16 lanes wide: two zmm of acc per 32-value block, 8 columns per pass
__attribute__((target("avx512f,avx512bw")))
static void axpy_q8_0_multi_avx512(float * restrict acc, const float * h, const ls_block_q8_0 * const * cols, int m, int64_t n) {
    for (int j0 = 0; j0 < m; j0 += 8) {
        const int mj = m - j0 < 8 ? m - j0 : 8;
        const ls_block_q8_0 * c[8];
        float hj[8];
        for (int j = 0; j < mj; j++) { c[j] = cols[j0 + j]; hj[j] = h[j0 + j]; }
        for (int64_t b = 0; b < n / 32; b++) {
            float * a = acc + b * 32;
            __m512 v0 = _mm512_loadu_ps(a), v1 = _mm512_loadu_ps(a + 16);
            for (int j = 0; j < mj; j++) {
                const __m512 s = _mm512_set1_ps(hj[j] * f16_to_f32(c[j][b].d));
                const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) c[j][b].qs));
                const __m512i r = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) (c[j][b].qs + 16)));
                v0 = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(q), v0);
                v1 = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(r), v1);
            }
            _mm512_storeu_ps(a, v0);
            _mm512_storeu_ps(a + 16, v1);
        }
    }
}

// ---- gate and up of one neuron in one pass: Q4_K rows x Q8_K activation ------------------------
//
// Q4_K super-block (256 values): f16 d, f16 dmin, 12 bytes of eight 6-bit scales and eight 6-bit
// mins, 128 bytes of nibbles (32 bytes per 64 values: low nibbles the first 32, high the next 32).
// value = d*scale_s*q - dmin*min_s. Q8_K: f32 d, 256 int8, 16 sums of 16 values (bsums).
//   row . x = sum_blocks dx * (d * sum_s scale_s * sum_{i in s} q4_i q8_i - dmin * sum_s min_s * bsum_s)
// The integer parts are exact; the float sums are those of ggml's vec_dot up to their order.

typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } ls_block_q4_K;
typedef struct { float d; int8_t qs[256]; int16_t bsums[16]; } ls_block_q8_K;

// the packed 6-bit scales -> bytes 0..7 scales, 8..15 mins
static inline void q4_K_scales(const uint8_t * p, uint32_t u[4]) {
    memcpy(u, p, 12);
    const uint32_t lo6 = 0x3f3f3f3f, lo4 = 0x0f0f0f0f, lo2 = 0x03030303;
    u[3] = ((u[2] >> 4) & lo4) | (((u[1] >> 6) & lo2) << 4);
    const uint32_t mins_lo = u[1] & lo6;
    u[1] = (u[2] & lo4) | (((u[0] >> 6) & lo2) << 4);
    u[2] = mins_lo;
    u[0] &= lo6;
}

static inline int32_t q4_K_min_sum(const uint8_t * mins, const int32_t * bs) {
    int32_t s = 0;
    for (int j = 0; j < 8; j++) s += (int32_t) mins[j] * bs[j];
    return s;
}

static inline float hsum128(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// _mm256_shuffle_epi8 masks that broadcast 16-bit word w of each 128-bit lane to the whole lane
static const uint8_t WORD_BCAST[8][32] __attribute__((aligned(32))) = {
#define LS_W(w) { 2*w, 2*w+1, 2*w, 2*w+1, 2*w, 2*w+1, 2*w, 2*w+1, 2*w, 2*w+1, 2*w, 2*w+1, 2*w, 2*w+1, 2*w, 2*w+1, \
                  2*w, 2*w+1, 2*w, 2*w+1, 2*w, 2*w+1, 2*w, 2*w+1, 2*w, 2*w+1, 2*w, 2*w+1, 2*w, 2*w+1, 2*w, 2*w+1 }
    LS_W(0), LS_W(1), LS_W(2), LS_W(3), LS_W(4), LS_W(5), LS_W(6), LS_W(7)
#undef LS_W
};

static void dot2_q4_K_avx2(int64_t n, const void * va, const void * vb, const void * vx, float * ra, float * rb,
                           const uint8_t * pf, int pf_lines) {
    const ls_block_q4_K * a = va, * b = vb;
    const ls_block_q8_K * x = vx;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256 acc_a = _mm256_setzero_ps(), acc_b = _mm256_setzero_ps();
    __m128 min_a = _mm_setzero_ps(), min_b = _mm_setzero_ps();
    for (int64_t i = 0; i < n / 256; i++) {
        uint32_t ua[4], ub[4];
        q4_K_scales(a[i].scales, ua);
        q4_K_scales(b[i].scales, ub);
        // the 8 scales as int16 in both lanes (broadcast per sub-block by shuffles); the mins
        // against the sums of x's sub-blocks (pairs of bsums)
        // the caller's prefetch stream: pf_lines cache lines per super-block, spread over the work
        for (int l = 0; l < pf_lines; l++) _mm_prefetch((const char *) pf + ((size_t) i * pf_lines + l) * 64, _MM_HINT_T0);
        const __m256i sca = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *) ua)));
        const __m256i scb = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *) ub)));
        const __m128i bsp = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *) x[i].bsums),
                                           _mm_loadu_si128((const __m128i *) (x[i].bsums + 8)));
        const __m128i mna = _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *) (ua + 2))), bsp);
        const __m128i mnb = _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *) (ub + 2))), bsp);
        __m256i ia = _mm256_setzero_si256(), ib = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i x0 = _mm256_loadu_si256((const __m256i *) (x[i].qs + 64 * c));
            const __m256i x1 = _mm256_loadu_si256((const __m256i *) (x[i].qs + 64 * c + 32));
            const __m256i qa = _mm256_loadu_si256((const __m256i *) (a[i].qs + 32 * c));
            const __m256i qb = _mm256_loadu_si256((const __m256i *) (b[i].qs + 32 * c));
            const __m256i w0 = _mm256_load_si256((const __m256i *) WORD_BCAST[2 * c]);
            const __m256i w1 = _mm256_load_si256((const __m256i *) WORD_BCAST[2 * c + 1]);
            const __m256i pa0 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(qa, m4), x0), _mm256_shuffle_epi8(sca, w0));
            const __m256i pa1 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(qa, 4), m4), x1), _mm256_shuffle_epi8(sca, w1));
            const __m256i pb0 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(qb, m4), x0), _mm256_shuffle_epi8(scb, w0));
            const __m256i pb1 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(qb, 4), m4), x1), _mm256_shuffle_epi8(scb, w1));
            ia = _mm256_add_epi32(ia, _mm256_add_epi32(pa0, pa1));
            ib = _mm256_add_epi32(ib, _mm256_add_epi32(pb0, pb1));
        }
        const float dx = x[i].d;
        acc_a = _mm256_fmadd_ps(_mm256_set1_ps(dx * f16_to_f32(a[i].d)), _mm256_cvtepi32_ps(ia), acc_a);
        acc_b = _mm256_fmadd_ps(_mm256_set1_ps(dx * f16_to_f32(b[i].d)), _mm256_cvtepi32_ps(ib), acc_b);
        min_a = _mm_fmadd_ps(_mm_set1_ps(dx * f16_to_f32(a[i].dmin)), _mm_cvtepi32_ps(mna), min_a);
        min_b = _mm_fmadd_ps(_mm_set1_ps(dx * f16_to_f32(b[i].dmin)), _mm_cvtepi32_ps(mnb), min_b);
    }
    *ra = hsum256(acc_a) - hsum128(min_a);
    *rb = hsum256(acc_b) - hsum128(min_b);
}

// 512-bit: two 64-value chunks per step (chunk c in the low half, c + 1 in the high half)
__attribute__((target("avx512f,avx512bw")))
static void dot2_q4_K_avx512(int64_t n, const void * va, const void * vb, const void * vx, float * ra, float * rb,
                             const uint8_t * pf, int pf_lines) {
    const ls_block_q4_K * a = va, * b = vb;
    const ls_block_q8_K * x = vx;
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512 acc_a = _mm512_setzero_ps(), acc_b = _mm512_setzero_ps();
    float min_a = 0.0f, min_b = 0.0f;
    for (int64_t i = 0; i < n / 256; i++) {
        uint32_t ua[4], ub[4];
        for (int l = 0; l < pf_lines; l++) _mm_prefetch((const char *) pf + ((size_t) i * pf_lines + l) * 64, _MM_HINT_T0);
        q4_K_scales(a[i].scales, ua);
        q4_K_scales(b[i].scales, ub);
        const uint8_t * sa = (const uint8_t *) ua, * sb = (const uint8_t *) ub;
        int32_t bs[8];
        for (int j = 0; j < 8; j++) bs[j] = (int32_t) x[i].bsums[2 * j] + x[i].bsums[2 * j + 1];
        __m512i ia = _mm512_setzero_si512(), ib = _mm512_setzero_si512();
        for (int c = 0; c < 4; c += 2) {
            // low nibbles: values 64c..64c+31 | 64(c+1)..+31; high nibbles: the next 32 of each
            const __m512i x0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *) (x[i].qs + 64 * c))),
                                                  _mm256_loadu_si256((const __m256i *) (x[i].qs + 64 * c + 64)), 1);
            const __m512i x1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *) (x[i].qs + 64 * c + 32))),
                                                  _mm256_loadu_si256((const __m256i *) (x[i].qs + 64 * c + 96)), 1);
            const __m512i qa = _mm512_loadu_si512((const void *) (a[i].qs + 32 * c));
            const __m512i qb = _mm512_loadu_si512((const void *) (b[i].qs + 32 * c));
            const __m512i sa0 = _mm512_inserti64x4(_mm512_set1_epi16(sa[2 * c]), _mm256_set1_epi16(sa[2 * c + 2]), 1);
            const __m512i sa1 = _mm512_inserti64x4(_mm512_set1_epi16(sa[2 * c + 1]), _mm256_set1_epi16(sa[2 * c + 3]), 1);
            const __m512i sb0 = _mm512_inserti64x4(_mm512_set1_epi16(sb[2 * c]), _mm256_set1_epi16(sb[2 * c + 2]), 1);
            const __m512i sb1 = _mm512_inserti64x4(_mm512_set1_epi16(sb[2 * c + 1]), _mm256_set1_epi16(sb[2 * c + 3]), 1);
            const __m512i pa0 = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_and_si512(qa, m4), x0), sa0);
            const __m512i pa1 = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_and_si512(_mm512_srli_epi16(qa, 4), m4), x1), sa1);
            const __m512i pb0 = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_and_si512(qb, m4), x0), sb0);
            const __m512i pb1 = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_and_si512(_mm512_srli_epi16(qb, 4), m4), x1), sb1);
            ia = _mm512_add_epi32(ia, _mm512_add_epi32(pa0, pa1));
            ib = _mm512_add_epi32(ib, _mm512_add_epi32(pb0, pb1));
        }
        const float dx = x[i].d;
        acc_a = _mm512_fmadd_ps(_mm512_set1_ps(dx * f16_to_f32(a[i].d)), _mm512_cvtepi32_ps(ia), acc_a);
        acc_b = _mm512_fmadd_ps(_mm512_set1_ps(dx * f16_to_f32(b[i].d)), _mm512_cvtepi32_ps(ib), acc_b);
        min_a += dx * f16_to_f32(a[i].dmin) * (float) q4_K_min_sum(sa + 8, bs);
        min_b += dx * f16_to_f32(b[i].dmin) * (float) q4_K_min_sum(sb + 8, bs);
    }
    *ra = _mm512_reduce_add_ps(acc_a) - min_a;
    *rb = _mm512_reduce_add_ps(acc_b) - min_b;
}

// ---- prefill down projection: acc[t] += sum_j h[j][t] * cols[j] over a staged tile ---------------
//
// Register-blocked: 4 token rows x 16 (AVX2) or 32 (AVX-512) output values stay in registers
// while every staged column adds to them; acc is loaded and stored once per tile.

static void axpy_tile_avx2(float * restrict acc, const float * restrict h, const float * restrict cols,
                           int n_staged, int64_t T, int64_t n_embd) {
    int64_t t = 0;
    for (; t + 4 <= T; t += 4) {
        for (int64_t c = 0; c + 16 <= n_embd; c += 16) {
            __m256 v[4][2];
            for (int r = 0; r < 4; r++) {
                v[r][0] = _mm256_loadu_ps(acc + (size_t) (t + r) * n_embd + c);
                v[r][1] = _mm256_loadu_ps(acc + (size_t) (t + r) * n_embd + c + 8);
            }
            for (int j = 0; j < n_staged; j++) {
                const float * cj = cols + (size_t) j * n_embd + c;
                const __m256 c0 = _mm256_loadu_ps(cj), c1 = _mm256_loadu_ps(cj + 8);
                const float * hj = h + (size_t) j * T + t;
                for (int r = 0; r < 4; r++) {
                    const __m256 hv = _mm256_broadcast_ss(hj + r);
                    v[r][0] = _mm256_fmadd_ps(hv, c0, v[r][0]);
                    v[r][1] = _mm256_fmadd_ps(hv, c1, v[r][1]);
                }
            }
            for (int r = 0; r < 4; r++) {
                _mm256_storeu_ps(acc + (size_t) (t + r) * n_embd + c, v[r][0]);
                _mm256_storeu_ps(acc + (size_t) (t + r) * n_embd + c + 8, v[r][1]);
            }
        }
    }
    for (; t < T; t++) { // the last rows, one at a time
        float * restrict at = acc + (size_t) t * n_embd;
        for (int j = 0; j < n_staged; j++) {
            const float hv = h[(size_t) j * T + t];
            const float * restrict cj = cols + (size_t) j * n_embd;
            for (int64_t c = 0; c < n_embd; c++) at[c] += hv * cj[c];
        }
    }
}

__attribute__((target("avx512f")))
static void axpy_tile_avx512(float * restrict acc, const float * restrict h, const float * restrict cols,
                             int n_staged, int64_t T, int64_t n_embd) {
    int64_t t = 0;
    for (; t + 4 <= T; t += 4) {
        for (int64_t c = 0; c + 32 <= n_embd; c += 32) {
            __m512 v[4][2];
            for (int r = 0; r < 4; r++) {
                v[r][0] = _mm512_loadu_ps(acc + (size_t) (t + r) * n_embd + c);
                v[r][1] = _mm512_loadu_ps(acc + (size_t) (t + r) * n_embd + c + 16);
            }
            for (int j = 0; j < n_staged; j++) {
                const float * cj = cols + (size_t) j * n_embd + c;
                const __m512 c0 = _mm512_loadu_ps(cj), c1 = _mm512_loadu_ps(cj + 16);
                const float * hj = h + (size_t) j * T + t;
                for (int r = 0; r < 4; r++) {
                    const __m512 hv = _mm512_set1_ps(hj[r]);
                    v[r][0] = _mm512_fmadd_ps(hv, c0, v[r][0]);
                    v[r][1] = _mm512_fmadd_ps(hv, c1, v[r][1]);
                }
            }
            for (int r = 0; r < 4; r++) {
                _mm512_storeu_ps(acc + (size_t) (t + r) * n_embd + c, v[r][0]);
                _mm512_storeu_ps(acc + (size_t) (t + r) * n_embd + c + 16, v[r][1]);
            }
        }
    }
    for (; t < T; t++) {
        float * restrict at = acc + (size_t) t * n_embd;
        for (int j = 0; j < n_staged; j++) {
            const float hv = h[(size_t) j * T + t];
            const float * restrict cj = cols + (size_t) j * n_embd;
            for (int64_t c = 0; c < n_embd; c++) at[c] += hv * cj[c];
        }
    }
}

static axpy_q8_0_fn axpy_q8_0_impl = axpy_q8_0_multi_avx2;
static dot2_q4_K_fn dot2_q4_K_impl = dot2_q4_K_avx2;
static axpy_tile_fn axpy_tile_impl = axpy_tile_avx2;
static const char * isa_name = "avx2";

void ls_kernels_init(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, ls_kernels_select);
}

void ls_kernels_select(void) {
    const char * want = getenv("LEANSTREAM_ISA");
    __builtin_cpu_init();
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        !(want && strcmp(want, "avx2") == 0);
    axpy_q8_0_impl = avx512 ? axpy_q8_0_multi_avx512 : axpy_q8_0_multi_avx2;
    dot2_q4_K_impl = avx512 ? dot2_q4_K_avx512 : dot2_q4_K_avx2;
    axpy_tile_impl = avx512 ? axpy_tile_avx512 : axpy_tile_avx2;
    isa_name = avx512 ? "avx512" : "avx2";
}

const char * ls_kernel_isa(void) { return isa_name; }

void ls_axpy_q8_0_multi(float * acc, const float * h, const ls_block_q8_0 * const * cols, int m, int64_t n) {
    axpy_q8_0_impl(acc, h, cols, m, n);
}

void ls_dot2_q4_K(int64_t n, const void * a, const void * b, const void * x, float * ra, float * rb,
                  const uint8_t * pf, int pf_lines) {
    dot2_q4_K_impl(n, a, b, x, ra, rb, pf, pf_lines);
}

void ls_dequant_q8_0(float * restrict out, const ls_block_q8_0 * restrict col, int64_t n) {
    for (int64_t b = 0; b < n / 32; b++) {
        const __m256 s = _mm256_set1_ps(f16_to_f32(col[b].d));
        for (int i = 0; i < 32; i += 8) {
            const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) (col[b].qs + i))));
            _mm256_storeu_ps(out + b * 32 + i, _mm256_mul_ps(s, q));
        }
    }
}

void ls_axpy_tile(float * acc, const float * h, const float * cols, int n_staged, int64_t T, int64_t n_embd) {
    axpy_tile_impl(acc, h, cols, n_staged, T, n_embd);
}
