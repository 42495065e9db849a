// kernels_x86.c — the kernels of kernels.c in AVX2 (+ FMA, F16C), with AVX-512 (F + BW) variants of
// the hot ones compiled with target attributes; compiled for x86-64 only, with -mavx2 -mfma -mf16c
// (CMakeLists.txt). dispatch.c runs them where the CPU has these instructions and they reproduce
// the scalar kernels on its start-up inputs. The arithmetic each kernel must keep (which sums are
// exact, which fused adds every variant makes) is written beside the scalar kernel (kernels.c).

#include "kernels.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

static inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }

// acc[0..n) += sum_{j<m} h[j] * dequant(col_j): one load/store of acc per 8 columns. The 8
// columns' scales of a 32-value block are converted together (one f16 -> f32 of 8 lanes).
static void axpy_q8_0_multi_avx2(float * restrict acc, const float * h, const void * const * vcols, int m, int64_t n) {
    const ls_block_q8_0 * const * cols = (const ls_block_q8_0 * const *) vcols;
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
static void axpy_q8_0_multi_avx512(float * restrict acc, const float * h, const void * const * vcols, int m, int64_t n) {
    const ls_block_q8_0 * const * cols = (const ls_block_q8_0 * const *) vcols;
    for (int j0 = 0; j0 < m; j0 += 8) {
        const int mj = ls_group_cols(m, j0);
        const ls_block_q8_0 * c[8];
        float hj[8];
        for (int j = 0; j < mj; j++) { c[j] = cols[j0 + j]; hj[j] = h[j0 + j]; }
        const ls_block_q8_0 * const * nx = cols + j0 + 8;
        const int n_next = ls_group_next(m, j0);
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

// ---- gate and up of one neuron in one pass: Q4_K rows x Q8_K activation (kernels.c) -----------

// The packed 6-bit scales unpacked in SIMD: a 16-byte load from the 12 scale bytes (the 4 bytes
// after them are the block's nibbles, ignored) -> bytes 0..7 scales, 8..15 mins.
static inline __m128i q4_K_scales_simd(const uint8_t * p) {
    const __m128i v = _mm_loadu_si128((const __m128i *) p);               // u0 u1 u2 (junk)
    const __m128i a = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0));      // u0 u2 u1 u2
    const __m128i b = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 0, 0));      // u0 u0 u0 u1
    const __m128i lo = _mm_and_si128(_mm_srlv_epi32(a, _mm_set_epi32(4, 0, 0, 0)),
                                     _mm_set_epi32(0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f));
    const __m128i hi = _mm_and_si128(_mm_srli_epi32(b, 2), _mm_set_epi32(0x30303030, 0, 0x30303030, 0));
    return _mm_or_si128(lo, hi);
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

// Gate and up of one neuron against R token rows of x (row r at x + r * x_stride), R a constant
// 1 .. LS_GU_ROWS at each use: the rows' nibbles and scales are unpacked once per super-block for
// the R rows, and each row gets the integer lanes and the float operations, in their order, of
// R = 1 (the one-token kernel): every row's result is that kernel's on the row alone, bit for bit.
// The prefetch stream (pf_lines per super-block) runs with the pass.
static inline __attribute__((always_inline))
void dot2_q4_K_avx2_body(const int R, int64_t n, const void * va, const void * vb, const void * vx, size_t x_stride,
                         float * ra, float * rb, const uint8_t * pf, int pf_lines) {
    const ls_block_q4_K * a = va, * b = vb;
    const ls_block_q8_K * x[LS_GU_ROWS];
    for (int r = 0; r < R; r++) x[r] = (const ls_block_q8_K *) ((const uint8_t *) vx + (size_t) r * x_stride);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256 acc_a[LS_GU_ROWS], acc_b[LS_GU_ROWS];   // per row: 8 float lanes of d * scaled sums
    __m128 min_a[LS_GU_ROWS], min_b[LS_GU_ROWS];   // per row: 4 float lanes of dmin * min sums
    for (int r = 0; r < R; r++) {
        acc_a[r] = acc_b[r] = _mm256_setzero_ps();
        min_a[r] = min_b[r] = _mm_setzero_ps();
    }
    for (int64_t i = 0; i < n / 256; i++) {
        // the caller's prefetch stream: pf_lines cache lines per super-block, spread over the work
        for (int l = 0; l < pf_lines; l++) _mm_prefetch((const char *) pf + ((size_t) i * pf_lines + l) * 64, _MM_HINT_T0);
        // the 8 scales as int16 in both lanes (broadcast per sub-block by shuffles); the mins
        // against the sums of x's sub-blocks (pairs of bsums)
        const __m128i ua = q4_K_scales_simd(a[i].scales), ub = q4_K_scales_simd(b[i].scales);
        const __m256i sca = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(ua));
        const __m256i scb = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(ub));
        const __m128i mina = _mm_cvtepu8_epi16(_mm_srli_si128(ua, 8)), minb = _mm_cvtepu8_epi16(_mm_srli_si128(ub, 8));
        __m256i ia[LS_GU_ROWS], ib[LS_GU_ROWS];
        for (int r = 0; r < R; r++) ia[r] = ib[r] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i qa = _mm256_loadu_si256((const __m256i *) (a[i].qs + 32 * c));
            const __m256i qb = _mm256_loadu_si256((const __m256i *) (b[i].qs + 32 * c));
            const __m256i la = _mm256_and_si256(qa, m4), ha = _mm256_and_si256(_mm256_srli_epi16(qa, 4), m4);
            const __m256i lb = _mm256_and_si256(qb, m4), hb = _mm256_and_si256(_mm256_srli_epi16(qb, 4), m4);
            const __m256i w0 = _mm256_load_si256((const __m256i *) WORD_BCAST[2 * c]);
            const __m256i w1 = _mm256_load_si256((const __m256i *) WORD_BCAST[2 * c + 1]);
            const __m256i sa0 = _mm256_shuffle_epi8(sca, w0), sa1 = _mm256_shuffle_epi8(sca, w1);
            const __m256i sb0 = _mm256_shuffle_epi8(scb, w0), sb1 = _mm256_shuffle_epi8(scb, w1);
            for (int r = 0; r < R; r++) {
                const __m256i x0 = _mm256_loadu_si256((const __m256i *) (x[r][i].qs + 64 * c));
                const __m256i x1 = _mm256_loadu_si256((const __m256i *) (x[r][i].qs + 64 * c + 32));
                const __m256i pa0 = _mm256_madd_epi16(_mm256_maddubs_epi16(la, x0), sa0);
                const __m256i pa1 = _mm256_madd_epi16(_mm256_maddubs_epi16(ha, x1), sa1);
                const __m256i pb0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lb, x0), sb0);
                const __m256i pb1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hb, x1), sb1);
                ia[r] = _mm256_add_epi32(ia[r], _mm256_add_epi32(pa0, pa1));
                ib[r] = _mm256_add_epi32(ib[r], _mm256_add_epi32(pb0, pb1));
            }
        }
        const float da = f16_to_f32(a[i].d), db = f16_to_f32(b[i].d);
        const float ma = f16_to_f32(a[i].dmin), mb = f16_to_f32(b[i].dmin);
        for (int r = 0; r < R; r++) {
            const __m128i bsp = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *) x[r][i].bsums),
                                               _mm_loadu_si128((const __m128i *) (x[r][i].bsums + 8)));
            const float dx = x[r][i].d;
            acc_a[r] = _mm256_fmadd_ps(_mm256_set1_ps(dx * da), _mm256_cvtepi32_ps(ia[r]), acc_a[r]);
            acc_b[r] = _mm256_fmadd_ps(_mm256_set1_ps(dx * db), _mm256_cvtepi32_ps(ib[r]), acc_b[r]);
            min_a[r] = _mm_fmadd_ps(_mm_set1_ps(dx * ma), _mm_cvtepi32_ps(_mm_madd_epi16(mina, bsp)), min_a[r]);
            min_b[r] = _mm_fmadd_ps(_mm_set1_ps(dx * mb), _mm_cvtepi32_ps(_mm_madd_epi16(minb, bsp)), min_b[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        ra[r] = hsum256(acc_a[r]) - hsum128(min_a[r]);
        rb[r] = hsum256(acc_b[r]) - hsum128(min_b[r]);
    }
}

static void dot2_q4_K_avx2(int64_t n, const void * va, const void * vb, const void * vx, float * ra, float * rb,
                           const uint8_t * pf, int pf_lines) {
    dot2_q4_K_avx2_body(1, n, va, vb, vx, 0, ra, rb, pf, pf_lines);
}

static void dot2_q4_K_rows_avx2(int64_t n, const void * a, const void * b, const void * x, size_t x_stride, int nr,
                                float * ra, float * rb, const uint8_t * pf, int pf_lines) {
    LS_GU_ROWS_DISPATCH(dot2_q4_K_avx2_body, n, a, b, x, x_stride, nr, ra, rb, pf, pf_lines);
}

// ---- gate and up of one neuron in one pass: Q4_1 rows x Q8_1 activation (kernels.c) ------------

static inline __m256i q4_1_nibbles(const uint8_t * qs, __m256i m4) {
    const __m128i q = _mm_loadu_si128((const __m128i *) qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), m4);
}

// R token rows at once as dot2_q4_K_avx2_body does (the nibbles expanded once per block for the R
// rows; each row's float operations those of R = 1, the min sum's fused add written out so that
// no compiler's contraction choice can tell the two apart)
static inline __attribute__((always_inline))
void dot2_q4_1_avx2_body(const int R, int64_t n, const void * va, const void * vb, const void * vx, size_t x_stride,
                         float * ra, float * rb, const uint8_t * pf, int pf_lines) {
    const ls_block_q4_1 * a = va, * b = vb;
    const ls_block_q8_1 * x[LS_GU_ROWS];
    for (int r = 0; r < R; r++) x[r] = (const ls_block_q8_1 *) ((const uint8_t *) vx + (size_t) r * x_stride);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc_a[LS_GU_ROWS], acc_b[LS_GU_ROWS];   // per row: 8 float lanes of (d * dx) * sums
    float min_a[LS_GU_ROWS], min_b[LS_GU_ROWS];     // per row: sum of m * s
    for (int r = 0; r < R; r++) {
        acc_a[r] = acc_b[r] = _mm256_setzero_ps();
        min_a[r] = min_b[r] = 0.0f;
    }
    for (int64_t i = 0; i < n / 32; i++) {
        for (int l = 0; l < pf_lines; l++) _mm_prefetch((const char *) pf + ((size_t) i * pf_lines + l) * 64, _MM_HINT_T0);
        const __m256i na = q4_1_nibbles(a[i].qs, m4), nb = q4_1_nibbles(b[i].qs, m4);
        const float da = f16_to_f32(a[i].d), db = f16_to_f32(b[i].d);
        const float ma = f16_to_f32(a[i].m), mb = f16_to_f32(b[i].m);
        for (int r = 0; r < R; r++) {
            const __m256i y = _mm256_loadu_si256((const __m256i *) x[r][i].qs);
            const float dx = f16_to_f32(x[r][i].d), sx = f16_to_f32(x[r][i].s);
            const __m256i pa = _mm256_madd_epi16(_mm256_maddubs_epi16(na, y), ones);
            const __m256i pb = _mm256_madd_epi16(_mm256_maddubs_epi16(nb, y), ones);
            acc_a[r] = _mm256_fmadd_ps(_mm256_set1_ps(da * dx), _mm256_cvtepi32_ps(pa), acc_a[r]);
            acc_b[r] = _mm256_fmadd_ps(_mm256_set1_ps(db * dx), _mm256_cvtepi32_ps(pb), acc_b[r]);
            min_a[r] = fmaf(ma, sx, min_a[r]);
            min_b[r] = fmaf(mb, sx, min_b[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        ra[r] = hsum256(acc_a[r]) + min_a[r];
        rb[r] = hsum256(acc_b[r]) + min_b[r];
    }
}

static void dot2_q4_1_avx2(int64_t n, const void * va, const void * vb, const void * vx, float * ra, float * rb,
                           const uint8_t * pf, int pf_lines) {
    dot2_q4_1_avx2_body(1, n, va, vb, vx, 0, ra, rb, pf, pf_lines);
}

static void dot2_q4_1_rows_avx2(int64_t n, const void * a, const void * b, const void * x, size_t x_stride, int nr,
                                float * ra, float * rb, const uint8_t * pf, int pf_lines) {
    LS_GU_ROWS_DISPATCH(dot2_q4_1_avx2_body, n, a, b, x, x_stride, nr, ra, rb, pf, pf_lines);
}

// _mm512_shuffle_epi8 masks for the 512-bit kernel: PAIR_BCAST[c + s] (c = 0, 2; s = 0, 1) broadcasts
// word 2c + s of each 128-bit lane to the low 256 bits and word 2c + 2 + s to the high 256 bits
static const uint8_t PAIR_BCAST[4][64] __attribute__((aligned(64))) = {
#define LS_W8(w) 2*(w), 2*(w)+1, 2*(w), 2*(w)+1, 2*(w), 2*(w)+1, 2*(w), 2*(w)+1, \
                 2*(w), 2*(w)+1, 2*(w), 2*(w)+1, 2*(w), 2*(w)+1, 2*(w), 2*(w)+1
#define LS_P(lo, hi) { LS_W8(lo), LS_W8(lo), LS_W8(hi), LS_W8(hi) }
    LS_P(0, 2), LS_P(1, 3), LS_P(4, 6), LS_P(5, 7)
#undef LS_P
#undef LS_W8
};

#define LS_Q4_K_BODY dot2_q4_K_avx512_body
#define LS_Q4_K_ONE dot2_q4_K_avx512
#define LS_Q4_K_ROWS dot2_q4_K_rows_avx512
#define LS_Q4_K_TARGET "avx512f,avx512bw"
#define LS_Q4_K_VNNI 0
#include "kernels_x86_q4_K.inc"
#undef LS_Q4_K_BODY
#undef LS_Q4_K_ONE
#undef LS_Q4_K_ROWS
#undef LS_Q4_K_TARGET
#undef LS_Q4_K_VNNI
#define LS_Q4_K_BODY dot2_q4_K_vnni_body
#define LS_Q4_K_ONE dot2_q4_K_vnni
#define LS_Q4_K_ROWS dot2_q4_K_rows_vnni
#define LS_Q4_K_TARGET "avx512f,avx512bw,avx512vnni"
#define LS_Q4_K_VNNI 1
#include "kernels_x86_q4_K.inc"
#undef LS_Q4_K_BODY
#undef LS_Q4_K_ONE
#undef LS_Q4_K_ROWS
#undef LS_Q4_K_TARGET
#undef LS_Q4_K_VNNI

// ---- prefill down projection: acc[t] += sum_j h[j][t] * cols[j] over a staged tile ---------------
//
// Register-blocked: 4 token rows x 16 (AVX2) or 32 (AVX-512) output values stay in registers
// while every staged column adds to them; acc is loaded and stored once per tile. What the blocks
// leave (the last T % 4 rows, the last n_embd % width values) goes through ls_axpy_tile_rest.

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
    ls_axpy_tile_rest(acc, h, cols, n_staged, T, n_embd, t_end, c_end);
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
    ls_axpy_tile_rest(acc, h, cols, n_staged, T, n_embd, t_end, c_end);
}

static void dequant_q8_0_avx2(float * restrict out, const void * vcol, int64_t n) {
    const ls_block_q8_0 * col = vcol;
    for (int64_t b = 0; b < n / 32; b++) {
        const __m256 s = _mm256_set1_ps(f16_to_f32(col[b].d));
        for (int i = 0; i < 32; i += 8) {
            const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) (col[b].qs + i))));
            _mm256_storeu_ps(out + b * 32 + i, _mm256_mul_ps(s, q));
        }
    }
}

// ---- Q6_K columns (kernels.c: the layout) --------------------------------------------------------

// The 32 6-bit quants q (0..63) of values 128 half + 32 seg .. + 31 of a Q6_K super-block: the
// low 4 bits from ql (the low nibbles for seg 0-1, the high ones for 2-3), the high 2 from qh;
// q6_K_quants: the signed ones (q - 32).
static inline __m256i q6_K_quants_u(const uint8_t * blk, int half, int seg) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
    const __m256i l = _mm256_loadu_si256((const __m256i *) (blk + half * 64 + (seg & 1) * 32));
    const __m256i hh = _mm256_loadu_si256((const __m256i *) (blk + 128 + half * 32));
    const __m256i lo = seg < 2 ? _mm256_and_si256(l, m4) : _mm256_and_si256(_mm256_srli_epi16(l, 4), m4);
    const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hh, _mm_cvtsi32_si128(2 * seg)), m2), 4);
    return _mm256_or_si256(lo, hi);
}

static inline __m256i q6_K_quants(const uint8_t * blk, int half, int seg) {
    return _mm256_sub_epi8(q6_K_quants_u(blk, half, seg), _mm256_set1_epi8(32));
}

// the same products in the same order as ggml's dequantize_row_q6_K ((d * scale) * q, in f32): the
// same bits, 32 values a step
static void dequant_q6_K_avx2(float * restrict out, const void * vcol, int64_t n) {
    const uint8_t * col = vcol;
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
static void axpy_q6_K_multi_avx2(float * restrict acc, const float * h, const void * const * vcols, int m, int64_t n) {
    const uint8_t * const * cols = (const uint8_t * const *) vcols;
    for (int j0 = 0; j0 < m; j0 += 8) {
        const int mj = ls_group_cols(m, j0);
        const uint8_t * const * nx = cols + j0 + 8;
        const int n_next = ls_group_next(m, j0);
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

// The same sums, 16 lanes wide, 128 values (a half super-block) per step: ql's 64 bytes and qh's
// 32 (read twice, shifted per 256-bit half) give that half's 128 quants in two registers, each
// 16-value group of one scale a 128-bit lane; 8 accumulators of 16 outputs stay in registers while
// the group's columns add to them, each with the factor (h * d) * scale of its group, fused in
// column order: per output value the one-row AVX2 and scalar kernels' operations, the same bits.
__attribute__((target("avx512f,avx512bw"))) static inline __attribute__((always_inline))
void q6_K_half_quants_avx512(const uint8_t * blk, int half, __m512i * q01, __m512i * q23) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m3 = _mm512_set1_epi8(0x03), o32 = _mm512_set1_epi8(32);
    const __m512i ql = _mm512_loadu_si512((const void *) (blk + half * 64));
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) (blk + 128 + half * 32)));
    // quants 0..63 of the half: low nibbles, high bits qh >> 0 (0..31) | qh >> 2 (32..63);
    // quants 64..127: high nibbles, qh >> 4 | qh >> 6 (a 64-bit shift: each byte keeps its own 2 bits)
    const __m512i h01 = _mm512_and_si512(_mm512_srlv_epi64(qh, _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0)), m3);
    const __m512i h23 = _mm512_and_si512(_mm512_srlv_epi64(qh, _mm512_set_epi64(6, 6, 6, 6, 4, 4, 4, 4)), m3);
    *q01 = _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_slli_epi16(h01, 4)), o32);
    *q23 = _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4), _mm512_slli_epi16(h23, 4)), o32);
}

__attribute__((target("avx512f,avx512bw")))
static void axpy_q6_K_multi_avx512(float * restrict acc, const float * h, const void * const * vcols, int m, int64_t n) {
    const uint8_t * const * cols = (const uint8_t * const *) vcols;
    for (int j0 = 0; j0 < m; j0 += 8) {
        const int mj = ls_group_cols(m, j0);
        const uint8_t * const * nx = cols + j0 + 8;
        const int n_next = ls_group_next(m, j0);
        for (int64_t b = 0; b < n / 256; b++) {
            float F[8][16] __attribute__((aligned(64)));   // (h * d) * scale g of each column's super-block
            for (int j = 0; j < mj; j++) {
                const uint8_t * blk = cols[j0 + j] + b * LS_Q6_K_BYTES;
                uint16_t dh;
                memcpy(&dh, blk + 208, 2);
                const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) (blk + 192))));
                _mm512_store_ps(F[j], _mm512_mul_ps(_mm512_set1_ps(h[j0 + j] * f16_to_f32(dh)), sc));
            }
            for (int half = 0; half < 2; half++) {
                for (int j = 0; j < n_next; j++)
                    for (int l = 0; l < 3; l++)
                        _mm_prefetch((const char *) (nx[j] + b * LS_Q6_K_BYTES + half * 105 + l * 52), _MM_HINT_T0);
                float * a = acc + b * 256 + half * 128;
                __m512 v[8];
                for (int g = 0; g < 8; g++) v[g] = _mm512_loadu_ps(a + 16 * g);
                for (int j = 0; j < mj; j++) {
                    __m512i q01, q23;
                    q6_K_half_quants_avx512(cols[j0 + j] + b * LS_Q6_K_BYTES, half, &q01, &q23);
                    const float * f = F[j] + 8 * half;
                    v[0] = _mm512_fmadd_ps(_mm512_set1_ps(f[0]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_castsi512_si128(q01))), v[0]);
                    v[1] = _mm512_fmadd_ps(_mm512_set1_ps(f[1]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(q01, 1))), v[1]);
                    v[2] = _mm512_fmadd_ps(_mm512_set1_ps(f[2]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(q01, 2))), v[2]);
                    v[3] = _mm512_fmadd_ps(_mm512_set1_ps(f[3]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(q01, 3))), v[3]);
                    v[4] = _mm512_fmadd_ps(_mm512_set1_ps(f[4]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_castsi512_si128(q23))), v[4]);
                    v[5] = _mm512_fmadd_ps(_mm512_set1_ps(f[5]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(q23, 1))), v[5]);
                    v[6] = _mm512_fmadd_ps(_mm512_set1_ps(f[6]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(q23, 2))), v[6]);
                    v[7] = _mm512_fmadd_ps(_mm512_set1_ps(f[7]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(q23, 3))), v[7]);
                }
                for (int g = 0; g < 8; g++) _mm512_storeu_ps(a + 16 * g, v[g]);
            }
        }
    }
}

// ---- the down projection for T token rows: acc[t] += sum_j h[j][t] * column j ------------------
//
// The one-row kernels (axpy_q8_0_multi_*, axpy_q6_K_multi_avx2) add per output value: acc[o] takes
// fma(f_j, q_j[o], acc[o]) for the columns j in order, with f_j = h_j * d_j (Q8_0) or
// (h_j * d_j) * scale (Q6_K, per 16 values), whatever the ISA or the columns per pass. The rows
// kernels keep exactly that per value and row: a group of 8 columns' 32 values of one step is
// unpacked to f32 once for all rows, each row's factors are the same products, and every row's 32
// outputs take the fused adds in column order: each row equals the one-row kernel on that row
// alone, bit for bit, on either ISA. h is [m][T] (as the op stages it), acc [T][n].
//
// A group short of 8 columns (the end of a list) is filled with columns of zeros whose factors are
// -0: fma(-0, 0, v) is v for every v (-0 included), so they change no bit, and every step adds 8.

#define LS_ROWS_CHUNK 64   // rows whose factors one pass over a column group keeps (f below)

typedef float rows_factors[2][8];   // a row's factors: [values 0..15 | 16..31 of the step][column]

// hT[t][j] = h[j0 + j][t] for t in [t0, t0 + Tc), j < 8 (-0 past the list's mj columns)
static inline void rows_h(float (*hT)[8], const float * h, int j0, int mj, int64_t t0, int64_t Tc, int64_t T) {
    for (int64_t t = 0; t < Tc; t++)
        for (int j = 0; j < 8; j++) hT[t][j] = j < mj ? h[(size_t) (j0 + j) * (size_t) T + (size_t) (t0 + t)] : -0.0f;
}

// f[t][0][j] = hd[t][j] * s0[j], f[t][1][j] = hd[t][j] * s1[j] for t < Tc (Q8_0: s0 = s1 = d, hd = h)
static inline void rows_factors_of(rows_factors * f, const float (*hd)[8], const float * s0, const float * s1, int64_t Tc) {
    const __m256 a = _mm256_loadu_ps(s0), b = _mm256_loadu_ps(s1);
    for (int64_t t = 0; t < Tc; t++) {
        const __m256 v = _mm256_loadu_ps(hd[t]);
        _mm256_store_ps(f[t][0], _mm256_mul_ps(v, a));
        _mm256_store_ps(f[t][1], _mm256_mul_ps(v, b));
    }
}

// acc[t][0, 32) += sum_j f[t][.][j] * qf[j] for t < T (acc rows n apart), the 8 columns in order:
// two rows per pass, so each staged value is loaded once for both
static void rows_step_avx2(float * restrict acc, int64_t n, int64_t T, const float (*qf)[32], const rows_factors * f) {
    int64_t t = 0;
    for (; t + 2 <= T; t += 2) {
        float * a = acc + (size_t) t * (size_t) n, * b = a + n;
        __m256 v0 = _mm256_loadu_ps(a), v1 = _mm256_loadu_ps(a + 8), v2 = _mm256_loadu_ps(a + 16), v3 = _mm256_loadu_ps(a + 24);
        __m256 w0 = _mm256_loadu_ps(b), w1 = _mm256_loadu_ps(b + 8), w2 = _mm256_loadu_ps(b + 16), w3 = _mm256_loadu_ps(b + 24);
        for (int j = 0; j < 8; j++) {
            const __m256 fa0 = _mm256_broadcast_ss(&f[t][0][j]), fa1 = _mm256_broadcast_ss(&f[t][1][j]);
            const __m256 fb0 = _mm256_broadcast_ss(&f[t + 1][0][j]), fb1 = _mm256_broadcast_ss(&f[t + 1][1][j]);
            __m256 q = _mm256_load_ps(qf[j]);
            v0 = _mm256_fmadd_ps(fa0, q, v0); w0 = _mm256_fmadd_ps(fb0, q, w0);
            q = _mm256_load_ps(qf[j] + 8);
            v1 = _mm256_fmadd_ps(fa0, q, v1); w1 = _mm256_fmadd_ps(fb0, q, w1);
            q = _mm256_load_ps(qf[j] + 16);
            v2 = _mm256_fmadd_ps(fa1, q, v2); w2 = _mm256_fmadd_ps(fb1, q, w2);
            q = _mm256_load_ps(qf[j] + 24);
            v3 = _mm256_fmadd_ps(fa1, q, v3); w3 = _mm256_fmadd_ps(fb1, q, w3);
        }
        _mm256_storeu_ps(a, v0); _mm256_storeu_ps(a + 8, v1); _mm256_storeu_ps(a + 16, v2); _mm256_storeu_ps(a + 24, v3);
        _mm256_storeu_ps(b, w0); _mm256_storeu_ps(b + 8, w1); _mm256_storeu_ps(b + 16, w2); _mm256_storeu_ps(b + 24, w3);
    }
    if (t == T) return;
    float * a = acc + (size_t) t * (size_t) n;
    __m256 v0 = _mm256_loadu_ps(a), v1 = _mm256_loadu_ps(a + 8), v2 = _mm256_loadu_ps(a + 16), v3 = _mm256_loadu_ps(a + 24);
    for (int j = 0; j < 8; j++) {
        const __m256 f0 = _mm256_broadcast_ss(&f[t][0][j]), f1 = _mm256_broadcast_ss(&f[t][1][j]);
        v0 = _mm256_fmadd_ps(f0, _mm256_load_ps(qf[j]), v0);
        v1 = _mm256_fmadd_ps(f0, _mm256_load_ps(qf[j] + 8), v1);
        v2 = _mm256_fmadd_ps(f1, _mm256_load_ps(qf[j] + 16), v2);
        v3 = _mm256_fmadd_ps(f1, _mm256_load_ps(qf[j] + 24), v3);
    }
    _mm256_storeu_ps(a, v0); _mm256_storeu_ps(a + 8, v1); _mm256_storeu_ps(a + 16, v2); _mm256_storeu_ps(a + 24, v3);
}

// the same, 16 lanes wide, with the group's 8 x 32 values in 16 registers for every row (the
// factors broadcast from memory into the fused adds)
__attribute__((target("avx512f"))) static inline __attribute__((always_inline))
void rows_step_avx512(float * restrict acc, int64_t n, int64_t T, const __m512 q[8][2], const rows_factors * f) {
    for (int64_t t = 0; t < T; t++) {
        float * a = acc + (size_t) t * (size_t) n;
        __m512 v0 = _mm512_loadu_ps(a), v1 = _mm512_loadu_ps(a + 16);
        for (int j = 0; j < 8; j++) {
            v0 = _mm512_fmadd_ps(_mm512_set1_ps(f[t][0][j]), q[j][0], v0);
            v1 = _mm512_fmadd_ps(_mm512_set1_ps(f[t][1][j]), q[j][1], v1);
        }
        _mm512_storeu_ps(a, v0); _mm512_storeu_ps(a + 16, v1);
    }
}

// One step of a rows kernel, per ISA: the group's 32 values of step b (Q8_0: block b; Q6_K: values
// 32 b .. + 31 of the columns' super-blocks, b = 8 super-block + 4 half + seg) unpacked for the
// mj columns of cols (the others zeros), then added to every row with its factors f.
typedef void (*rows_step_fn)(float *, int64_t, int64_t, const void * const *, int, int64_t, const rows_factors *);

static void q8_0_step_avx2(float * acc, int64_t n, int64_t T, const void * const * cols, int mj, int64_t b, const rows_factors * f) {
    float qf[8][32] __attribute__((aligned(64)));
    for (int j = 0; j < 8; j++) {
        const int8_t * qs = j < mj ? ((const ls_block_q8_0 *) cols[j])[b].qs : NULL;
        for (int i = 0; i < 32; i += 8)
            _mm256_store_ps(qf[j] + i, qs ? _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) (qs + i))))
                                          : _mm256_setzero_ps());
    }
    rows_step_avx2(acc, n, T, (const float (*)[32]) qf, f);
}

__attribute__((target("avx512f,avx512bw")))
static void q8_0_step_avx512(float * acc, int64_t n, int64_t T, const void * const * cols, int mj, int64_t b, const rows_factors * f) {
    __m512 q[8][2];
    for (int j = 0; j < 8; j++) {
        const int8_t * qs = j < mj ? ((const ls_block_q8_0 *) cols[j])[b].qs : NULL;
        q[j][0] = qs ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) qs))) : _mm512_setzero_ps();
        q[j][1] = qs ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) (qs + 16)))) : _mm512_setzero_ps();
    }
    rows_step_avx512(acc, n, T, (const __m512 (*)[2]) q, f);
}

static void q6_K_step_avx2(float * acc, int64_t n, int64_t T, const void * const * cols, int mj, int64_t b, const rows_factors * f) {
    float qf[8][32] __attribute__((aligned(64)));
    for (int j = 0; j < 8; j++) {
        if (j >= mj) { memset(qf[j], 0, sizeof(qf[j])); continue; }
        const __m256i q = q6_K_quants((const uint8_t *) cols[j] + b / 8 * LS_Q6_K_BYTES, b % 8 / 4, b % 4);
        const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
        _mm256_store_ps(qf[j],      _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0)));
        _mm256_store_ps(qf[j] + 8,  _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8))));
        _mm256_store_ps(qf[j] + 16, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1)));
        _mm256_store_ps(qf[j] + 24, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8))));
    }
    rows_step_avx2(acc, n, T, (const float (*)[32]) qf, f);
}

__attribute__((target("avx512f,avx512bw")))
static void q6_K_step_avx512(float * acc, int64_t n, int64_t T, const void * const * cols, int mj, int64_t b, const rows_factors * f) {
    __m512 q[8][2];
    for (int j = 0; j < 8; j++) {
        const __m256i v = j < mj ? q6_K_quants((const uint8_t *) cols[j] + b / 8 * LS_Q6_K_BYTES, b % 8 / 4, b % 4)
                                 : _mm256_setzero_si256();
        q[j][0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
        q[j][1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
    }
    rows_step_avx512(acc, n, T, (const __m512 (*)[2]) q, f);
}

// S[k][j] = (float) scale k (of 16) of column j's super-block sb, for the 8 columns of a group
// (1 past the list's mj): the bytes transposed by unpacks, 8 columns' scales of a step in one load
static inline void q6_K_scales8(float S[16][8], const uint8_t * const * c, int mj, int64_t sb) {
    __m128i r[8];
    for (int j = 0; j < 8; j++)
        r[j] = j < mj ? _mm_loadu_si128((const __m128i *) (c[j] + sb * LS_Q6_K_BYTES + 192)) : _mm_set1_epi8(1);
    __m128i t[8], u[8];
    for (int j = 0; j < 4; j++) {   // byte pairs of columns 2j, 2j+1: scales 0..7 | 8..15
        t[2 * j] = _mm_unpacklo_epi8(r[2 * j], r[2 * j + 1]);
        t[2 * j + 1] = _mm_unpackhi_epi8(r[2 * j], r[2 * j + 1]);
    }
    for (int j = 0; j < 2; j++) {   // 4 columns' bytes per scale: scales 0..3, 4..7, 8..11, 12..15
        u[4 * j]     = _mm_unpacklo_epi16(t[4 * j], t[4 * j + 2]);
        u[4 * j + 1] = _mm_unpackhi_epi16(t[4 * j], t[4 * j + 2]);
        u[4 * j + 2] = _mm_unpacklo_epi16(t[4 * j + 1], t[4 * j + 3]);
        u[4 * j + 3] = _mm_unpackhi_epi16(t[4 * j + 1], t[4 * j + 3]);
    }
    for (int q = 0; q < 4; q++) {   // 8 columns' bytes per scale, two scales per register
        const __m128i lo = _mm_unpacklo_epi32(u[q], u[q + 4]), hi = _mm_unpackhi_epi32(u[q], u[q + 4]);
        _mm256_store_ps(S[4 * q],     _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)));
        _mm256_store_ps(S[4 * q + 1], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))));
        _mm256_store_ps(S[4 * q + 2], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)));
        _mm256_store_ps(S[4 * q + 3], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))));
    }
}

// acc[t] += sum_j h[j][t] * column j, Q8_0 columns, through step (the ISA's): per group of 8
// columns and block, the factors h * d of every row, then the step; the next group's columns are
// fetched while this one computes (as the one-row kernels do)
static void axpy_q8_0_rows_with(rows_step_fn step, float * restrict acc, const float * h, const ls_block_q8_0 * const * cols,
                                int m, int64_t T, int64_t n) {
    rows_factors f[LS_ROWS_CHUNK] __attribute__((aligned(64)));
    float hT[LS_ROWS_CHUNK][8] __attribute__((aligned(32)));
    for (int64_t t0 = 0; t0 < T; t0 += LS_ROWS_CHUNK) {
        const int64_t Tc = T - t0 < LS_ROWS_CHUNK ? T - t0 : LS_ROWS_CHUNK;
        for (int j0 = 0; j0 < m; j0 += 8) {
            const int mj = ls_group_cols(m, j0);
            const ls_block_q8_0 * const * c = cols + j0, * const * nx = cols + j0 + 8;
            const int n_next = ls_group_next(m, j0);
            rows_h(hT, h, j0, mj, t0, Tc, T);
            for (int64_t b = 0; b < n / 32; b++) {
                for (int j = 0; j < n_next; j++) _mm_prefetch((const char *) (nx[j] + b), _MM_HINT_T0);
                float d[8];
                for (int j = 0; j < 8; j++) d[j] = j < mj ? f16_to_f32(c[j][b].d) : 1.0f;
                rows_factors_of(f, (const float (*)[8]) hT, d, d, Tc);
                step(acc + (size_t) t0 * (size_t) n + b * 32, n, Tc, (const void * const *) c, mj, b, f);
            }
        }
    }
}

// the same for Q6_K columns: per super-block h * d of every row, per step of 32 values the factors
// (h * d) * scale of its two groups of 16
static void axpy_q6_K_rows_with(rows_step_fn step, float * restrict acc, const float * h, const uint8_t * const * cols,
                                int m, int64_t T, int64_t n) {
    rows_factors f[LS_ROWS_CHUNK] __attribute__((aligned(64)));
    float hT[LS_ROWS_CHUNK][8] __attribute__((aligned(32))), hd[LS_ROWS_CHUNK][8] __attribute__((aligned(32)));
    for (int64_t t0 = 0; t0 < T; t0 += LS_ROWS_CHUNK) {
        const int64_t Tc = T - t0 < LS_ROWS_CHUNK ? T - t0 : LS_ROWS_CHUNK;
        for (int j0 = 0; j0 < m; j0 += 8) {
            const int mj = ls_group_cols(m, j0);
            const uint8_t * const * c = cols + j0, * const * nx = cols + j0 + 8;
            const int n_next = ls_group_next(m, j0);
            rows_h(hT, h, j0, mj, t0, Tc, T);
            for (int64_t sb = 0; sb < n / 256; sb++) {
                float d[8];
                for (int j = 0; j < 8; j++) {
                    uint16_t dh = 0x3c00;   // 1: a padding column's h * d stays -0
                    if (j < mj) memcpy(&dh, c[j] + sb * LS_Q6_K_BYTES + 208, 2);
                    d[j] = f16_to_f32(dh);
                }
                const __m256 d8 = _mm256_loadu_ps(d);
                for (int64_t t = 0; t < Tc; t++) _mm256_store_ps(hd[t], _mm256_mul_ps(_mm256_load_ps(hT[t]), d8));
                float S[16][8] __attribute__((aligned(32)));
                q6_K_scales8(S, c, mj, sb);
                for (int hs = 0; hs < 8; hs++) {   // values 32 hs .. + 31 (half hs / 4, seg hs % 4): scales 2 hs, 2 hs + 1
                    for (int j = 0; j < n_next; j++)
                        _mm_prefetch((const char *) (nx[j] + sb * LS_Q6_K_BYTES + hs * 26), _MM_HINT_T0);
                    rows_factors_of(f, (const float (*)[8]) hd, S[2 * hs], S[2 * hs + 1], Tc);
                    step(acc + (size_t) t0 * (size_t) n + sb * 256 + hs * 32, n, Tc, (const void * const *) c, mj, sb * 8 + hs, f);
                }
            }
        }
    }
}


// ---- the LM head's rows: Q6_K weights x Q8_K activations (kernels.c: the arithmetic) -------------

static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

// S of one super-block (q unpacked, sc its 16 scales) against one Q8_K block, less the -32 term
static inline int32_t q6_K_sum_avx2(const uint8_t * q, const __m256i * sc16, const ls_block_q8_K * x) {
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
static void head_q6_K_avx512(const void * vw, int64_t n, const void * const * vx, int64_t T, float * out, size_t out_stride) {
    const ls_block_q6_K * w = vw;
    const ls_block_q8_K * const * x = (const ls_block_q8_K * const *) vx;
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
        const float dw = f16_to_f32(w[b].d);
        for (int64_t t = 0; t < T; t++) {
            const ls_block_q8_K * xb = &x[t][b];
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

// the super-block's values unpacked to bytes once, then per row 8 steps of 32 (two groups of 16)
static void head_q6_K_avx2(const void * vw, int64_t n, const void * const * vx, int64_t T, float * out, size_t out_stride) {
    const ls_block_q6_K * w = vw;
    const ls_block_q8_K * const * x = (const ls_block_q8_K * const *) vx;
    uint8_t q[256] __attribute__((aligned(32)));
    float acc[LS_EXACT_ROWS];
    for (int64_t t = 0; t < T; t++) acc[t] = 0.0f;
    for (int64_t b = 0; b < n / 256; b++) {
        for (int hs = 0; hs < 8; hs++)   // values 32 hs .. + 31: half hs / 4, seg hs % 4
            _mm256_store_si256((__m256i *) (q + 32 * hs), q6_K_quants_u((const uint8_t *) &w[b], hs / 4, hs % 4));
        __m256i sc16[8];
        int32_t scs[16];
        for (int g = 0; g < 16; g++) scs[g] = w[b].sc[g];
        for (int c = 0; c < 8; c++) {
            const __m128i lo = _mm_set1_epi16((int16_t) scs[2 * c]), hi = _mm_set1_epi16((int16_t) scs[2 * c + 1]);
            sc16[c] = _mm256_set_m128i(hi, lo);
        }
        const float dw = f16_to_f32(w[b].d);
        for (int64_t t = 0; t < T; t++) {
            const ls_block_q8_K * xb = &x[t][b];
            int32_t bsum = 0;
            for (int g = 0; g < 16; g++) bsum += scs[g] * xb->bsums[g];
            const int32_t S = q6_K_sum_avx2(q, sc16, xb) - 32 * bsum;
            const float f = dw * xb->d;
            acc[t] = fmaf(f, (float) S, acc[t]);
        }
    }
    for (int64_t t = 0; t < T; t++) out[(size_t) t * out_stride] = acc[t];
}

// ---- a sketch row . x (kernels.c: the LS2 row format) -------------------------------------------

// row . x for one LS2 row (n a multiple of 64)
static float ls2_dot_avx2(const uint8_t * row, const int8_t * x8, const float * dx, const float * xo, int64_t n) {
    const uint16_t * d = (const uint16_t *) row;
    const uint8_t * q = row + n / 32 * 2;
    const __m256i m3 = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
    const __m256i sh01 = _mm256_setr_epi64x(0, 0, 2, 2), sh23 = _mm256_setr_epi64x(4, 4, 6, 6);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t g = 0; g < n / 32; g += 2) {
        const __m256i c = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) (q + g * 8)));
        const __m256i u0 = _mm256_and_si256(_mm256_srlv_epi64(c, sh01), m3);
        const __m256i u1 = _mm256_and_si256(_mm256_srlv_epi64(c, sh23), m3);
        const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(u0, _mm256_loadu_si256((const __m256i *) (x8 + g * 32))), ones);
        const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(u1, _mm256_loadu_si256((const __m256i *) (x8 + g * 32 + 32))), ones);
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(_cvtsh_ss(d[g]) * dx[g]), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(_cvtsh_ss(d[g + 1]) * dx[g + 1]), acc1);
    }
    float off = 0.0f;
    int64_t g = 0;
    __m256 o = _mm256_setzero_ps();
    for (; g + 8 <= n / 32; g += 8) {
        o = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (d + g))), _mm256_loadu_ps(xo + g), o);
    }
    for (; g < n / 32; g++) off += _cvtsh_ss(d[g]) * xo[g];
    return hsum256(_mm256_add_ps(acc0, acc1)) - (off + hsum256(o));
}

// ---- the rows kernels and the sets ------------------------------------------------------------------

static void axpy_q8_0_rows_avx2(float * acc, const float * h, const void * const * cols, int m, int64_t T, int64_t n) {
    axpy_q8_0_rows_with(q8_0_step_avx2, acc, h, (const ls_block_q8_0 * const *) cols, m, T, n);
}

static void axpy_q8_0_rows_avx512(float * acc, const float * h, const void * const * cols, int m, int64_t T, int64_t n) {
    axpy_q8_0_rows_with(q8_0_step_avx512, acc, h, (const ls_block_q8_0 * const *) cols, m, T, n);
}

static void axpy_q6_K_rows_avx2(float * acc, const float * h, const void * const * cols, int m, int64_t T, int64_t n) {
    axpy_q6_K_rows_with(q6_K_step_avx2, acc, h, (const uint8_t * const *) cols, m, T, n);
}

static void axpy_q6_K_rows_avx512(float * acc, const float * h, const void * const * cols, int m, int64_t T, int64_t n) {
    axpy_q6_K_rows_with(q6_K_step_avx512, acc, h, (const uint8_t * const *) cols, m, T, n);
}

const ls_kernel_set ls_kernels_avx2 = {
    .dot2_q4_K = dot2_q4_K_avx2, .dot2_q4_1 = dot2_q4_1_avx2,
    .dot2_q4_K_rows = dot2_q4_K_rows_avx2, .dot2_q4_1_rows = dot2_q4_1_rows_avx2,
    .axpy_q8_0 = axpy_q8_0_multi_avx2, .axpy_q6_K = axpy_q6_K_multi_avx2,
    .axpy_q8_0_rows = axpy_q8_0_rows_avx2, .axpy_q6_K_rows = axpy_q6_K_rows_avx2,
    .axpy_tile = axpy_tile_avx2,
    .dequant_q8_0 = dequant_q8_0_avx2, .dequant_q6_K = dequant_q6_K_avx2,
    .head_q6_K = head_q6_K_avx2,
    .ls2_dot = ls2_dot_avx2,
};

// AVX-512 where it pays; the Q4_1 gate/up, the dequantizations and the
// sketch dot are AVX2's
const ls_kernel_set ls_kernels_avx512 = {
    .dot2_q4_K = dot2_q4_K_avx512, .dot2_q4_K_rows = dot2_q4_K_rows_avx512,
    .axpy_q8_0 = axpy_q8_0_multi_avx512, .axpy_q8_0_rows = axpy_q8_0_rows_avx512,
    .axpy_q6_K = axpy_q6_K_multi_avx512, .axpy_q6_K_rows = axpy_q6_K_rows_avx512,
    .axpy_tile = axpy_tile_avx512,
    .head_q6_K = head_q6_K_avx512,
};

// AVX-512 VNNI: the Q4_K gate/up (each sub-block's scale and add fused); the rest is AVX-512's
const ls_kernel_set ls_kernels_avx512_vnni = {
    .dot2_q4_K = dot2_q4_K_vnni, .dot2_q4_K_rows = dot2_q4_K_rows_vnni,
};
