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
        // the next group's columns are fetched while this one computes (up to 8 of them)
        const ls_block_q8_0 * const * nx = cols + j0 + 8;
        const int n_next = m - j0 - 8 < 8 ? m - j0 - 8 : 8;
        for (int64_t b = 0; b < n / 32; b++) {
            for (int j = 0; j < n_next; j++) _mm_prefetch((const char *) (nx[j] + b), _MM_HINT_T0);
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
        const ls_block_q8_0 * const * nx = cols + j0 + 8;
        const int n_next = m - j0 - 8 < 0 ? 0 : m - j0 - 8 < 8 ? m - j0 - 8 : 8;
        for (int64_t b = 0; b < n / 32; b++) {
            for (int j = 0; j < n_next; j++) _mm_prefetch((const char *) (nx[j] + b), _MM_HINT_T0);
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

// The same unpacking in SIMD, for the AVX2 kernels: a 16-byte load from the 12 scale bytes (the 4
// bytes after them are the block's nibbles, ignored) -> bytes 0..7 scales, 8..15 mins.
static inline __m128i q4_K_scales_simd(const uint8_t * p) {
    const __m128i v = _mm_loadu_si128((const __m128i *) p);               // u0 u1 u2 (junk)
    const __m128i a = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0));      // u0 u2 u1 u2
    const __m128i b = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 0, 0));      // u0 u0 u0 u1
    const __m128i lo = _mm_and_si128(_mm_srlv_epi32(a, _mm_set_epi32(4, 0, 0, 0)),
                                     _mm_set_epi32(0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f));
    const __m128i hi = _mm_and_si128(_mm_srli_epi32(b, 2), _mm_set_epi32(0x30303030, 0, 0x30303030, 0));
    return _mm_or_si128(lo, hi);
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
        // the caller's prefetch stream: pf_lines cache lines per super-block, spread over the work
        for (int l = 0; l < pf_lines; l++) _mm_prefetch((const char *) pf + ((size_t) i * pf_lines + l) * 64, _MM_HINT_T0);
        // the 8 scales as int16 in both lanes (broadcast per sub-block by shuffles); the mins
        // against the sums of x's sub-blocks (pairs of bsums)
        const __m128i ua = q4_K_scales_simd(a[i].scales), ub = q4_K_scales_simd(b[i].scales);
        const __m256i sca = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(ua));
        const __m256i scb = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(ub));
        const __m128i bsp = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *) x[i].bsums),
                                           _mm_loadu_si128((const __m128i *) (x[i].bsums + 8)));
        const __m128i mna = _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_srli_si128(ua, 8)), bsp);
        const __m128i mnb = _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_srli_si128(ub, 8)), bsp);
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

// ---- gate and up of one neuron in one pass: Q4_1 rows x Q8_1 activation -------------------------
//
// Q4_1 block (32 values): f16 d, f16 m, 16 bytes of nibbles (low: values 0..15, high: 16..31);
// value = d*q + m. Q8_1: f16 d, f16 s = d * sum(q), 32 int8.
//   row . x = sum_blocks (d * dx) * sum_i q4_i q8_i + m * s
// as ggml's vec_dot_q4_1_q8_1 computes it (the integer sums exact, f32 sums in another order).

typedef struct { uint16_t d, m; uint8_t qs[16]; } ls_block_q4_1;
typedef struct { uint16_t d, s; int8_t qs[32]; } ls_block_q8_1;

static inline __m256i q4_1_nibbles(const uint8_t * qs, __m256i m4) {
    const __m128i q = _mm_loadu_si128((const __m128i *) qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), m4);
}

static void dot2_q4_1_avx2(int64_t n, const void * va, const void * vb, const void * vx, float * ra, float * rb,
                           const uint8_t * pf, int pf_lines) {
    const ls_block_q4_1 * a = va, * b = vb;
    const ls_block_q8_1 * x = vx;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc_a = _mm256_setzero_ps(), acc_b = _mm256_setzero_ps();
    float min_a = 0.0f, min_b = 0.0f;
    for (int64_t i = 0; i < n / 32; i++) {
        for (int l = 0; l < pf_lines; l++) _mm_prefetch((const char *) pf + ((size_t) i * pf_lines + l) * 64, _MM_HINT_T0);
        const __m256i y = _mm256_loadu_si256((const __m256i *) x[i].qs);
        const float dx = f16_to_f32(x[i].d), sx = f16_to_f32(x[i].s);
        const __m256i pa = _mm256_madd_epi16(_mm256_maddubs_epi16(q4_1_nibbles(a[i].qs, m4), y), ones);
        const __m256i pb = _mm256_madd_epi16(_mm256_maddubs_epi16(q4_1_nibbles(b[i].qs, m4), y), ones);
        acc_a = _mm256_fmadd_ps(_mm256_set1_ps(f16_to_f32(a[i].d) * dx), _mm256_cvtepi32_ps(pa), acc_a);
        acc_b = _mm256_fmadd_ps(_mm256_set1_ps(f16_to_f32(b[i].d) * dx), _mm256_cvtepi32_ps(pb), acc_b);
        min_a += f16_to_f32(a[i].m) * sx;
        min_b += f16_to_f32(b[i].m) * sx;
    }
    *ra = hsum256(acc_a) + min_a;
    *rb = hsum256(acc_b) + min_b;
}

void ls_dot2_q4_1(int64_t n, const void * a, const void * b, const void * x, float * ra, float * rb,
                  const uint8_t * pf, int pf_lines) {
    dot2_q4_1_avx2(n, a, b, x, ra, rb, pf, pf_lines);
}

// The same two rows against 4 token rows of x at once (prefill): the rows' nibbles and scales are
// unpacked once per super-block and used for every token. x[t] starts at x + t * x_stride.
static void dot2x4_q4_K_avx2(int64_t n, const void * va, const void * vb, const void * vx, size_t x_stride,
                             float * ra, float * rb) {
    const ls_block_q4_K * a = va, * b = vb;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const ls_block_q8_K * x0p = vx;
    const ls_block_q8_K * x1p = (const ls_block_q8_K *) ((const uint8_t *) vx + x_stride);
    const ls_block_q8_K * x2p = (const ls_block_q8_K *) ((const uint8_t *) vx + 2 * x_stride);
    const ls_block_q8_K * x3p = (const ls_block_q8_K *) ((const uint8_t *) vx + 3 * x_stride);
    const ls_block_q8_K * xp[4] = { x0p, x1p, x2p, x3p };
    float fa[4] = { 0 }, fb[4] = { 0 };
    __m256i sc[2][8] __attribute__((aligned(32)));   // per-sub-block scale broadcasts, rows a and b
    for (int64_t i = 0; i < n / 256; i++) {
        uint32_t ua[4], ub[4];
        q4_K_scales(a[i].scales, ua);
        q4_K_scales(b[i].scales, ub);
        const __m256i sca = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *) ua)));
        const __m256i scb = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *) ub)));
        for (int w = 0; w < 8; w++) {
            const __m256i m = _mm256_load_si256((const __m256i *) WORD_BCAST[w]);
            sc[0][w] = _mm256_shuffle_epi8(sca, m);
            sc[1][w] = _mm256_shuffle_epi8(scb, m);
        }
        __m256i ia0 = _mm256_setzero_si256(), ia1 = ia0, ia2 = ia0, ia3 = ia0;
        __m256i ib0 = ia0, ib1 = ia0, ib2 = ia0, ib3 = ia0;
        for (int c = 0; c < 4; c++) {
            const __m256i qa = _mm256_loadu_si256((const __m256i *) (a[i].qs + 32 * c));
            const __m256i qb = _mm256_loadu_si256((const __m256i *) (b[i].qs + 32 * c));
            const __m256i la = _mm256_and_si256(qa, m4), ha = _mm256_and_si256(_mm256_srli_epi16(qa, 4), m4);
            const __m256i lb = _mm256_and_si256(qb, m4), hb = _mm256_and_si256(_mm256_srli_epi16(qb, 4), m4);
#define LS_TOKEN(T, IA, IB) do {                                                                          \
                const __m256i y0 = _mm256_loadu_si256((const __m256i *) (xp[T][i].qs + 64 * c));          \
                const __m256i y1 = _mm256_loadu_si256((const __m256i *) (xp[T][i].qs + 64 * c + 32));     \
                IA = _mm256_add_epi32(IA, _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(la, y0), sc[0][2 * c]), \
                                                           _mm256_madd_epi16(_mm256_maddubs_epi16(ha, y1), sc[0][2 * c + 1]))); \
                IB = _mm256_add_epi32(IB, _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lb, y0), sc[1][2 * c]), \
                                                           _mm256_madd_epi16(_mm256_maddubs_epi16(hb, y1), sc[1][2 * c + 1]))); \
            } while (0)
            LS_TOKEN(0, ia0, ib0);
            LS_TOKEN(1, ia1, ib1);
            LS_TOKEN(2, ia2, ib2);
            LS_TOKEN(3, ia3, ib3);
#undef LS_TOKEN
        }
        const float da = f16_to_f32(a[i].d), db = f16_to_f32(b[i].d);
        const float ma = f16_to_f32(a[i].dmin), mb = f16_to_f32(b[i].dmin);
        const __m128i mna = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *) (ua + 2)));
        const __m128i mnb = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *) (ub + 2)));
        const __m256i ia[4] = { ia0, ia1, ia2, ia3 }, ib[4] = { ib0, ib1, ib2, ib3 };
        for (int t = 0; t < 4; t++) {
            const ls_block_q8_K * x = xp[t] + i;
            const __m128i bsp = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *) x->bsums),
                                               _mm_loadu_si128((const __m128i *) (x->bsums + 8)));
            const float dx = x->d;
            // per super-block sums in f32, like the single-token kernel's lanes summed at the end
            fa[t] += dx * da * hsum256(_mm256_cvtepi32_ps(ia[t])) - dx * ma * hsum128(_mm_cvtepi32_ps(_mm_madd_epi16(mna, bsp)));
            fb[t] += dx * db * hsum256(_mm256_cvtepi32_ps(ib[t])) - dx * mb * hsum128(_mm_cvtepi32_ps(_mm_madd_epi16(mnb, bsp)));
        }
    }
    for (int t = 0; t < 4; t++) { ra[t] = fa[t]; rb[t] = fb[t]; }
}

void ls_dot2xn_q4_K(int64_t n, const void * a, const void * b, const void * x, size_t x_stride, int nt, float * ra, float * rb) {
    int t0 = 0;
    for (; t0 + 4 <= nt; t0 += 4) dot2x4_q4_K_avx2(n, a, b, (const uint8_t *) x + (size_t) t0 * x_stride, x_stride, ra + t0, rb + t0);
    for (; t0 < nt; t0++) dot2_q4_K_avx2(n, a, b, (const uint8_t *) x + (size_t) t0 * x_stride, ra + t0, rb + t0, NULL, 0);
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
// while every staged column adds to them; acc is loaded and stored once per tile. What the blocks
// leave (the last T % 4 rows, the last n_embd % width values) goes through tile_rest.

// acc[t][c] += sum_j h[j][t] * cols[j][c] for t in [t0, T) over every c, and for t < t0 over c >= c0
static void tile_rest(float * restrict acc, const float * restrict h, const float * restrict cols,
                      int n_staged, int64_t T, int64_t n_embd, int64_t t0, int64_t c0) {
    for (int64_t t = 0; t < T; t++) {
        const int64_t from = t < t0 ? c0 : 0;
        float * restrict at = acc + (size_t) t * n_embd;
        for (int j = 0; j < n_staged; j++) {
            const float hv = h[(size_t) j * T + t];
            const float * restrict cj = cols + (size_t) j * n_embd;
            for (int64_t c = from; c < n_embd; c++) at[c] += hv * cj[c];
        }
    }
}

static void axpy_tile_avx2(float * restrict acc, const float * restrict h, const float * restrict cols,
                           int n_staged, int64_t T, int64_t n_embd) {
    const int64_t t_end = T - T % 4, c_end = n_embd - n_embd % 16;
    for (int64_t t = 0; t < t_end; t += 4) {
        for (int64_t c = 0; c < c_end; c += 16) {
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
    tile_rest(acc, h, cols, n_staged, T, n_embd, t_end, c_end);
}

__attribute__((target("avx512f")))
static void axpy_tile_avx512(float * restrict acc, const float * restrict h, const float * restrict cols,
                             int n_staged, int64_t T, int64_t n_embd) {
    const int64_t t_end = T - T % 4, c_end = n_embd - n_embd % 32;
    for (int64_t t = 0; t < t_end; t += 4) {
        for (int64_t c = 0; c < c_end; c += 32) {
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
    tile_rest(acc, h, cols, n_staged, T, n_embd, t_end, c_end);
}

static axpy_q8_0_fn axpy_q8_0_impl = axpy_q8_0_multi_avx2;
static dot2_q4_K_fn dot2_q4_K_impl = dot2_q4_K_avx2;
static axpy_tile_fn axpy_tile_impl = axpy_tile_avx2;
static const char * isa_name = "avx2";

void ls_kernels_init(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, ls_kernels_select);
}

// ---- start-up self-check of the AVX-512 variants --------------------------------------------------
//
// Before the AVX-512 variants are used they must give the AVX2 variants' results (up to f32
// summation order) on fixed pseudo-random inputs; on a mismatch the AVX2 ones stay, and
// ls_kernel_isa() says why. Cheap (microseconds) and done once per process.

static uint32_t lcg(uint32_t * s) { *s = *s * 1664525u + 1013904223u; return *s >> 8; }

static bool close_enough(const float * a, const float * b, int n) {
    float m = 0.0f, e = 0.0f;
    for (int i = 0; i < n; i++) {
        m = fmaxf(m, fabsf(a[i]));
        e = fmaxf(e, fabsf(a[i] - b[i]));
    }
    return e <= 1e-4f * m + 1e-6f;
}

static bool avx512_agrees(void) {
    enum { N = 512, M = 11, T = 5 };
    static ls_block_q4_K a[N / 256], b[N / 256];
    static ls_block_q8_K x[N / 256];
    static ls_block_q8_0 cols[M][N / 32];
    static float h[M * T], tile_cols[M * N], acc1[T * N], acc2[T * N];
    uint32_t s = 12345u;
    for (int i = 0; i < N / 256; i++) {
        a[i].d = b[i].d = 0x2e66;      // f16 ~0.1
        a[i].dmin = b[i].dmin = 0x2a66;
        for (int j = 0; j < 12; j++) { a[i].scales[j] = (uint8_t) lcg(&s); b[i].scales[j] = (uint8_t) lcg(&s); }
        for (int j = 0; j < 128; j++) { a[i].qs[j] = (uint8_t) lcg(&s); b[i].qs[j] = (uint8_t) lcg(&s); }
        x[i].d = 0.01f;
        for (int j = 0; j < 256; j++) x[i].qs[j] = (int8_t) (lcg(&s) % 255 - 127);
        for (int j = 0; j < 16; j++) {
            int sum = 0;
            for (int q = 0; q < 16; q++) sum += x[i].qs[16 * j + q];
            x[i].bsums[j] = (int16_t) sum;
        }
    }
    float r1[2], r2[2];
    dot2_q4_K_avx2(N, a, b, x, &r1[0], &r1[1], NULL, 0);
    dot2_q4_K_avx512(N, a, b, x, &r2[0], &r2[1], NULL, 0);
    if (!close_enough(r1, r2, 2)) return false;
    const ls_block_q8_0 * cp[M];
    for (int j = 0; j < M; j++) {
        cp[j] = cols[j];
        for (int q = 0; q < N / 32; q++) {
            cols[j][q].d = 0x2e66;
            for (int v = 0; v < 32; v++) cols[j][q].qs[v] = (int8_t) (lcg(&s) % 255 - 127);
        }
    }
    for (int i = 0; i < M * T; i++) h[i] = (float) (lcg(&s) % 2001) / 1000.0f - 1.0f;
    for (int i = 0; i < M * N; i++) tile_cols[i] = (float) (lcg(&s) % 2001) / 1000.0f - 1.0f;
    memset(acc1, 0, sizeof(acc1));
    memset(acc2, 0, sizeof(acc2));
    axpy_q8_0_multi_avx2(acc1, h, cp, M, N);
    axpy_q8_0_multi_avx512(acc2, h, cp, M, N);
    if (!close_enough(acc1, acc2, N)) return false;
    memset(acc1, 0, sizeof(acc1));
    memset(acc2, 0, sizeof(acc2));
    axpy_tile_avx2(acc1, h, tile_cols, M, T, N);
    axpy_tile_avx512(acc2, h, tile_cols, M, T, N);
    return close_enough(acc1, acc2, T * N);
}

void ls_kernels_select(void) {
    const char * want = getenv("LEANSTREAM_ISA");
    __builtin_cpu_init();
    bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  !(want && strcmp(want, "avx2") == 0);
    isa_name = "avx2";
    if (avx512 && !avx512_agrees()) {
        avx512 = false;
        isa_name = "avx2 (the AVX-512 kernels failed their start-up check)";
    }
    axpy_q8_0_impl = avx512 ? axpy_q8_0_multi_avx512 : axpy_q8_0_multi_avx2;
    dot2_q4_K_impl = avx512 ? dot2_q4_K_avx512 : dot2_q4_K_avx2;
    axpy_tile_impl = avx512 ? axpy_tile_avx512 : axpy_tile_avx2;
    if (avx512) isa_name = "avx512";
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

// ggml's block_q6_K: 256 values as 4 low bits (ql), 2 high bits (qh), 16 int8 scales and an f16
// super-block scale; value = d * scale[group of 16] * (q - 32). The same products in the same
// order as ggml's dequantize_row_q6_K ((d * scale) * q, in f32): the same bits, 32 values a step.
// The 32 signed quants (q - 32) of values 128 half + 32 seg .. + 31 of a Q6_K super-block: the
// low 4 bits from ql (the low nibbles for seg 0-1, the high ones for 2-3), the high 2 from qh.
static inline __m256i q6_K_quants(const uint8_t * blk, int half, int seg) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03), m32 = _mm256_set1_epi8(32);
    const __m256i l = _mm256_loadu_si256((const __m256i *) (blk + half * 64 + (seg & 1) * 32));
    const __m256i hh = _mm256_loadu_si256((const __m256i *) (blk + 128 + half * 32));
    const __m256i lo = seg < 2 ? _mm256_and_si256(l, m4) : _mm256_and_si256(_mm256_srli_epi16(l, 4), m4);
    const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hh, _mm_cvtsi32_si128(2 * seg)), m2), 4);
    return _mm256_sub_epi8(_mm256_or_si256(lo, hi), m32);
}

void ls_dequant_q6_K(float * restrict out, const uint8_t * restrict col, int64_t n) {
    for (int64_t b = 0; b < n / 256; b++) {
        const uint8_t * blk = col + b * LS_Q6_K_BYTES;
        const int8_t * sc = (const int8_t *) (blk + 192);
        uint16_t dh;
        memcpy(&dh, blk + 208, 2);
        const float d = f16_to_f32(dh);
        float * y = out + b * 256;
        for (int half = 0; half < 2; half++) {           // 128 values: ql[64], qh[32], sc[8]
            for (int j = 0; j < 4; j++) {                 // values 32 j .. 32 j + 31 of the half
                int8_t v[32];
                _mm256_storeu_si256((__m256i *) v, q6_K_quants(blk, half, j));
                for (int g = 0; g < 4; g++) {             // 8 values; groups of 16 share a scale
                    const __m256 f = _mm256_set1_ps(d * (float) sc[2 * j + g / 2]);
                    const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) (v + 8 * g))));
                    _mm256_storeu_ps(y + 32 * j + 8 * g, _mm256_mul_ps(f, x));
                }
            }
            y += 128; sc += 8;
        }
    }
}

// acc[0, n) += sum_j h[j] * column j, m Q6_K columns added in place (no f32 staging): 8 columns
// per pass over the output, 32 outputs in registers while each column's 32 values are unpacked
// (as ls_dequant_q6_K does) and added with the factor h * d * scale of their group of 16; the
// next 8 columns are prefetched a line per column and step.
void ls_axpy_q6_K_multi(float * restrict acc, const float * h, const uint8_t * const * cols, int m, int64_t n) {
    for (int j0 = 0; j0 < m; j0 += 8) {
        const int mj = m - j0 < 8 ? m - j0 : 8;
        const uint8_t * const * nx = cols + j0 + 8;
        const int n_next = m - j0 - 8 < 0 ? 0 : m - j0 - 8 < 8 ? m - j0 - 8 : 8;
        for (int64_t b = 0; b < n / 256; b++) {
            float hd[8];   // h * d of each column's super-block
            for (int j = 0; j < mj; j++) {
                uint16_t dh;
                memcpy(&dh, cols[j0 + j] + b * LS_Q6_K_BYTES + 208, 2);
                hd[j] = h[j0 + j] * f16_to_f32(dh);
            }
            for (int half = 0; half < 2; half++) {
                for (int seg = 0; seg < 4; seg++) {   // values 128 half + 32 seg .. + 31
                    for (int j = 0; j < n_next; j++)
                        _mm_prefetch((const char *) (nx[j] + b * LS_Q6_K_BYTES + (half * 4 + seg) * 26), _MM_HINT_T0);
                    float * a = acc + b * 256 + half * 128 + seg * 32;
                    __m256 v0 = _mm256_loadu_ps(a), v1 = _mm256_loadu_ps(a + 8);
                    __m256 v2 = _mm256_loadu_ps(a + 16), v3 = _mm256_loadu_ps(a + 24);
                    for (int j = 0; j < mj; j++) {
                        const uint8_t * blk = cols[j0 + j] + b * LS_Q6_K_BYTES;
                        const int8_t * sc = (const int8_t *) (blk + 192) + half * 8 + 2 * seg;
                        const __m256i q = q6_K_quants(blk, half, seg);
                        const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
                        const __m256 f0 = _mm256_set1_ps(hd[j] * (float) sc[0]), f1 = _mm256_set1_ps(hd[j] * (float) sc[1]);
                        v0 = _mm256_fmadd_ps(f0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0)), v0);
                        v1 = _mm256_fmadd_ps(f0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8))), v1);
                        v2 = _mm256_fmadd_ps(f1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1)), v2);
                        v3 = _mm256_fmadd_ps(f1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8))), v3);
                    }
                    _mm256_storeu_ps(a, v0); _mm256_storeu_ps(a + 8, v1);
                    _mm256_storeu_ps(a + 16, v2); _mm256_storeu_ps(a + 24, v3);
                }
            }
        }
    }
}

// The same for T token rows: acc[t][0, n) += sum_j h[j][t] * column j (h [m][T]). Each column
// group's 32 values are unpacked once for all rows; every row then takes exactly the single-row
// kernel's products and fused adds in its order (columns in order, the same factors), so each row
// equals ls_axpy_q6_K_multi on that row alone, bit for bit (a verify pass agrees with decoding).
void ls_axpy_q6_K_rows(float * restrict acc, const float * h, const uint8_t * const * cols, int m, int64_t T, int64_t n) {
    float qf[8][32] __attribute__((aligned(32)));
    for (int j0 = 0; j0 < m; j0 += 8) {
        const int mj = m - j0 < 8 ? m - j0 : 8;
        for (int64_t b = 0; b < n / 256; b++) {
            float d[8];
            for (int j = 0; j < mj; j++) {
                uint16_t dh;
                memcpy(&dh, cols[j0 + j] + b * LS_Q6_K_BYTES + 208, 2);
                d[j] = f16_to_f32(dh);
            }
            for (int half = 0; half < 2; half++) {
                for (int seg = 0; seg < 4; seg++) {
                    float s0[8], s1[8];
                    for (int j = 0; j < mj; j++) {
                        const uint8_t * blk = cols[j0 + j] + b * LS_Q6_K_BYTES;
                        const int8_t * sc = (const int8_t *) (blk + 192) + half * 8 + 2 * seg;
                        const __m256i q = q6_K_quants(blk, half, seg);
                        const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
                        _mm256_store_ps(qf[j],      _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0)));
                        _mm256_store_ps(qf[j] + 8,  _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8))));
                        _mm256_store_ps(qf[j] + 16, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1)));
                        _mm256_store_ps(qf[j] + 24, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8))));
                        s0[j] = (float) sc[0];
                        s1[j] = (float) sc[1];
                    }
                    for (int64_t t = 0; t < T; t++) {
                        float * a = acc + (size_t) t * (size_t) n + b * 256 + half * 128 + seg * 32;
                        __m256 v0 = _mm256_loadu_ps(a), v1 = _mm256_loadu_ps(a + 8);
                        __m256 v2 = _mm256_loadu_ps(a + 16), v3 = _mm256_loadu_ps(a + 24);
                        for (int j = 0; j < mj; j++) {
                            const float hd = h[(size_t) (j0 + j) * (size_t) T + (size_t) t] * d[j];
                            const __m256 f0 = _mm256_set1_ps(hd * s0[j]), f1 = _mm256_set1_ps(hd * s1[j]);
                            v0 = _mm256_fmadd_ps(f0, _mm256_load_ps(qf[j]), v0);
                            v1 = _mm256_fmadd_ps(f0, _mm256_load_ps(qf[j] + 8), v1);
                            v2 = _mm256_fmadd_ps(f1, _mm256_load_ps(qf[j] + 16), v2);
                            v3 = _mm256_fmadd_ps(f1, _mm256_load_ps(qf[j] + 24), v3);
                        }
                        _mm256_storeu_ps(a, v0); _mm256_storeu_ps(a + 8, v1);
                        _mm256_storeu_ps(a + 16, v2); _mm256_storeu_ps(a + 24, v3);
                    }
                }
            }
        }
    }
}

void ls_axpy_tile(float * acc, const float * h, const float * cols, int n_staged, int64_t T, int64_t n_embd) {
    axpy_tile_impl(acc, h, cols, n_staged, T, n_embd);
}
