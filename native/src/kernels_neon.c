// kernels_neon.c — the kernels of kernels.c in NEON (aarch64 builds only). Compiled twice
// (CMakeLists.txt): as itself with -march=armv8-a, every kernel below (ls_kernels_neon); and as
// kernels_dotprod_neon.c with -march=armv8.2-a+dotprod and LS_NEON_DOTPROD, the kernels made of
// int8 dot products (gate/up, head, sketch) with those in SDOT (ls_kernels_neon_dotprod), which
// dispatch.c runs where the CPU has the dot product (HWCAP_ASIMDDP). The arithmetic each kernel must keep (which sums
// are exact, which fused adds every variant makes) is written beside the scalar kernel (kernels.c).

#include "kernels.h"

#include <arm_neon.h>
#include <string.h>

#if defined(LS_NEON_DOTPROD) && !defined(__ARM_FEATURE_DOTPROD)
#error "kernels_dotprod_neon.c is compiled with -march=armv8.2-a+dotprod (CMakeLists.txt)"
#endif

static inline float f16_to_f32(uint16_t h) { __fp16 v; memcpy(&v, &h, 2); return (float) v; }

static inline void prefetch_lines(const uint8_t * pf, int64_t step, int pf_lines) {
    for (int l = 0; l < pf_lines; l++) __builtin_prefetch(pf + ((size_t) step * (size_t) pf_lines + (size_t) l) * 64);
}

// acc plus the 16 products a_i * b_i, summed by 4 into its lanes, for a in 0..63 (weights'
// quants: two products fit an int16). Which lanes hold which products differs between SDOT and
// the widening multiplies: each kernel's lanes are its own, the integer total the same.
static inline int32x4_t dot_i8(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(LS_NEON_DOTPROD)
    return vdotq_s32(acc, a, b);
#else
    int16x8_t p = vmull_s8(vget_low_s8(a), vget_low_s8(b));
    p = vmlal_high_s8(p, a, b);
    return vpadalq_s16(acc, p);
#endif
}

// ---- gate and up of one neuron in one pass: Q4_K rows x Q8_K activation (kernels.c) -----------

// the eight 6-bit scales (s[0..7]) and mins (s[8..15]) of a super-block (ggml's get_scale_min_k4,
// four bytes at a time)
static inline void q4_K_scales(const uint8_t * q, uint8_t s[16]) {
    uint32_t u[3], o[4];
    memcpy(u, q, 12);
    o[0] = u[0] & 0x3f3f3f3fu;
    o[1] = (u[2] & 0x0f0f0f0fu) | ((u[0] >> 6) & 0x03030303u) << 4;
    o[2] = u[1] & 0x3f3f3f3fu;
    o[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 6) & 0x03030303u) << 4;
    memcpy(s, o, 16);
}

// Gate and up of one neuron against R token rows of x (row r at x + r * x_stride), R a constant
// 1 .. LS_GU_ROWS at each use: the nibbles and scales unpacked once per super-block for the R
// rows, each row the integer lanes and float operations, in their order, of R = 1 (the one-token
// kernel): every row's result is that kernel's on the row alone, bit for bit.
static inline __attribute__((always_inline))
void dot2_q4_K_body(const int R, int64_t n, const void * va, const void * vb, const void * vx, size_t x_stride,
                    float * ra, float * rb, const uint8_t * pf, int pf_lines) {
    const ls_block_q4_K * a = va, * b = vb;
    const ls_block_q8_K * x[LS_GU_ROWS];
    for (int r = 0; r < R; r++) x[r] = (const ls_block_q8_K *) ((const uint8_t *) vx + (size_t) r * x_stride);
    const uint8x16_t m4 = vdupq_n_u8(0x0f);
    const int32x4_t zero = vdupq_n_s32(0);
    float32x4_t acc_a[LS_GU_ROWS], acc_b[LS_GU_ROWS];   // per row: 4 float lanes of dx * d * scaled sums
    float32x4_t min_a[LS_GU_ROWS], min_b[LS_GU_ROWS];   // per row: 4 float lanes of dx * dmin * min sums
    for (int r = 0; r < R; r++) acc_a[r] = acc_b[r] = min_a[r] = min_b[r] = vdupq_n_f32(0.0f);
    for (int64_t i = 0; i < n / 256; i++) {
        prefetch_lines(pf, i, pf_lines);
        uint8_t sa[16], sb[16];
        q4_K_scales(a[i].scales, sa);
        q4_K_scales(b[i].scales, sb);
        int32x4_t ia[LS_GU_ROWS], ib[LS_GU_ROWS];   // per row: sum_s scale_s * (q4 . q8)_s in 4 lanes
        for (int r = 0; r < R; r++) ia[r] = ib[r] = zero;
        for (int c = 0; c < 4; c++) {   // values 64 c .. + 63: sub-blocks 2c (low nibbles), 2c + 1 (high)
            const uint8x16_t qa0 = vld1q_u8(a[i].qs + 32 * c), qa1 = vld1q_u8(a[i].qs + 32 * c + 16);
            const uint8x16_t qb0 = vld1q_u8(b[i].qs + 32 * c), qb1 = vld1q_u8(b[i].qs + 32 * c + 16);
            const int8x16_t la0 = vreinterpretq_s8_u8(vandq_u8(qa0, m4)), la1 = vreinterpretq_s8_u8(vandq_u8(qa1, m4));
            const int8x16_t ha0 = vreinterpretq_s8_u8(vshrq_n_u8(qa0, 4)), ha1 = vreinterpretq_s8_u8(vshrq_n_u8(qa1, 4));
            const int8x16_t lb0 = vreinterpretq_s8_u8(vandq_u8(qb0, m4)), lb1 = vreinterpretq_s8_u8(vandq_u8(qb1, m4));
            const int8x16_t hb0 = vreinterpretq_s8_u8(vshrq_n_u8(qb0, 4)), hb1 = vreinterpretq_s8_u8(vshrq_n_u8(qb1, 4));
            for (int r = 0; r < R; r++) {
                const int8_t * y = x[r][i].qs + 64 * c;
                const int8x16_t y0 = vld1q_s8(y), y1 = vld1q_s8(y + 16), y2 = vld1q_s8(y + 32), y3 = vld1q_s8(y + 48);
                ia[r] = vmlaq_n_s32(ia[r], dot_i8(dot_i8(zero, la0, y0), la1, y1), sa[2 * c]);
                ia[r] = vmlaq_n_s32(ia[r], dot_i8(dot_i8(zero, ha0, y2), ha1, y3), sa[2 * c + 1]);
                ib[r] = vmlaq_n_s32(ib[r], dot_i8(dot_i8(zero, lb0, y0), lb1, y1), sb[2 * c]);
                ib[r] = vmlaq_n_s32(ib[r], dot_i8(dot_i8(zero, hb0, y2), hb1, y3), sb[2 * c + 1]);
            }
        }
        const float da = f16_to_f32(a[i].d), db = f16_to_f32(b[i].d);
        const float ma = f16_to_f32(a[i].dmin), mb = f16_to_f32(b[i].dmin);
        const int16x8_t mina = vreinterpretq_s16_u16(vmovl_u8(vld1_u8(sa + 8)));
        const int16x8_t minb = vreinterpretq_s16_u16(vmovl_u8(vld1_u8(sb + 8)));
        for (int r = 0; r < R; r++) {
            // x's sub-block sums (pairs of bsums) against the mins: exact, in 4 int32 lanes
            const int16x8_t bs = vpaddq_s16(vld1q_s16(x[r][i].bsums), vld1q_s16(x[r][i].bsums + 8));
            const int32x4_t pa = vmlal_high_s16(vmull_s16(vget_low_s16(mina), vget_low_s16(bs)), mina, bs);
            const int32x4_t pb = vmlal_high_s16(vmull_s16(vget_low_s16(minb), vget_low_s16(bs)), minb, bs);
            const float dx = x[r][i].d;
            acc_a[r] = vfmaq_n_f32(acc_a[r], vcvtq_f32_s32(ia[r]), dx * da);
            acc_b[r] = vfmaq_n_f32(acc_b[r], vcvtq_f32_s32(ib[r]), dx * db);
            min_a[r] = vfmaq_n_f32(min_a[r], vcvtq_f32_s32(pa), dx * ma);
            min_b[r] = vfmaq_n_f32(min_b[r], vcvtq_f32_s32(pb), dx * mb);
        }
    }
    for (int r = 0; r < R; r++) {
        ra[r] = vaddvq_f32(acc_a[r]) - vaddvq_f32(min_a[r]);
        rb[r] = vaddvq_f32(acc_b[r]) - vaddvq_f32(min_b[r]);
    }
}

static void dot2_q4_K(int64_t n, const void * a, const void * b, const void * x, float * ra, float * rb,
                      const uint8_t * pf, int pf_lines) {
    dot2_q4_K_body(1, n, a, b, x, 0, ra, rb, pf, pf_lines);
}

static void dot2_q4_K_rows(int64_t n, const void * a, const void * b, const void * x, size_t x_stride, int nr,
                           float * ra, float * rb, const uint8_t * pf, int pf_lines) {
    LS_GU_ROWS_DISPATCH(dot2_q4_K_body, n, a, b, x, x_stride, nr, ra, rb, pf, pf_lines);
}

// ---- gate and up of one neuron in one pass: Q4_1 rows x Q8_1 activation (kernels.c) ------------

// R token rows at once as dot2_q4_K_body does; the min sum's fused add written out
static inline __attribute__((always_inline))
void dot2_q4_1_body(const int R, int64_t n, const void * va, const void * vb, const void * vx, size_t x_stride,
                    float * ra, float * rb, const uint8_t * pf, int pf_lines) {
    const ls_block_q4_1 * a = va, * b = vb;
    const ls_block_q8_1 * x[LS_GU_ROWS];
    for (int r = 0; r < R; r++) x[r] = (const ls_block_q8_1 *) ((const uint8_t *) vx + (size_t) r * x_stride);
    const uint8x16_t m4 = vdupq_n_u8(0x0f);
    const int32x4_t zero = vdupq_n_s32(0);
    float32x4_t acc_a[LS_GU_ROWS], acc_b[LS_GU_ROWS];   // per row: 4 float lanes of (d * dx) * sums
    float min_a[LS_GU_ROWS], min_b[LS_GU_ROWS];         // per row: sum of m * s
    for (int r = 0; r < R; r++) {
        acc_a[r] = acc_b[r] = vdupq_n_f32(0.0f);
        min_a[r] = min_b[r] = 0.0f;
    }
    for (int64_t i = 0; i < n / 32; i++) {
        prefetch_lines(pf, i, pf_lines);
        const uint8x16_t qa = vld1q_u8(a[i].qs), qb = vld1q_u8(b[i].qs);
        const int8x16_t la = vreinterpretq_s8_u8(vandq_u8(qa, m4)), ha = vreinterpretq_s8_u8(vshrq_n_u8(qa, 4));
        const int8x16_t lb = vreinterpretq_s8_u8(vandq_u8(qb, m4)), hb = vreinterpretq_s8_u8(vshrq_n_u8(qb, 4));
        const float da = f16_to_f32(a[i].d), db = f16_to_f32(b[i].d);
        const float ma = f16_to_f32(a[i].m), mb = f16_to_f32(b[i].m);
        for (int r = 0; r < R; r++) {
            const int8x16_t y0 = vld1q_s8(x[r][i].qs), y1 = vld1q_s8(x[r][i].qs + 16);
            const float dx = f16_to_f32(x[r][i].d), sx = f16_to_f32(x[r][i].s);
            acc_a[r] = vfmaq_n_f32(acc_a[r], vcvtq_f32_s32(dot_i8(dot_i8(zero, la, y0), ha, y1)), da * dx);
            acc_b[r] = vfmaq_n_f32(acc_b[r], vcvtq_f32_s32(dot_i8(dot_i8(zero, lb, y0), hb, y1)), db * dx);
            min_a[r] = fmaf(ma, sx, min_a[r]);
            min_b[r] = fmaf(mb, sx, min_b[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        ra[r] = vaddvq_f32(acc_a[r]) + min_a[r];
        rb[r] = vaddvq_f32(acc_b[r]) + min_b[r];
    }
}

static void dot2_q4_1(int64_t n, const void * a, const void * b, const void * x, float * ra, float * rb,
                      const uint8_t * pf, int pf_lines) {
    dot2_q4_1_body(1, n, a, b, x, 0, ra, rb, pf, pf_lines);
}

static void dot2_q4_1_rows(int64_t n, const void * a, const void * b, const void * x, size_t x_stride, int nr,
                           float * ra, float * rb, const uint8_t * pf, int pf_lines) {
    LS_GU_ROWS_DISPATCH(dot2_q4_1_body, n, a, b, x, x_stride, nr, ra, rb, pf, pf_lines);
}

// ---- Q6_K columns (kernels.c: the layout) --------------------------------------------------------

// The 32 quants q (0..63) of values 128 half + 32 seg .. + 31 of a Q6_K super-block (kernels.c:
// the layout), two registers of 16
static inline void q6_K_quants_u(const uint8_t * blk, int half, int seg, uint8x16_t q[2]) {
    const uint8_t * ql = blk + half * 64 + (seg & 1) * 32, * qh = blk + 128 + half * 32;
    const int8x16_t down = vdupq_n_s8((int8_t) (-2 * seg));
    for (int k = 0; k < 2; k++) {
        const uint8x16_t l = vld1q_u8(ql + 16 * k), hh = vld1q_u8(qh + 16 * k);
        const uint8x16_t lo = seg < 2 ? vandq_u8(l, vdupq_n_u8(0x0f)) : vshrq_n_u8(l, 4);
        q[k] = vorrq_u8(lo, vshlq_n_u8(vandq_u8(vshlq_u8(hh, down), vdupq_n_u8(3)), 4));
    }
}

#if !defined(LS_NEON_DOTPROD)   // (the kernels without int8 dot products: once)

// ---- the down projection: acc[0..n) += sum_j h[j] * column j (kernels.c) --------------------------

// acc[0..8) += f * q[0..8) with one fused add per value, q int8 widened to f32
static inline void fma8(float32x4_t * v, int8x8_t q, float f) {
    const int16x8_t w = vmovl_s8(q);
    v[0] = vfmaq_n_f32(v[0], vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))), f);
    v[1] = vfmaq_n_f32(v[1], vcvtq_f32_s32(vmovl_high_s16(w)), f);
}

// 8 columns per pass over the output: 32 outputs in registers while each column's block adds to
// them; the next 8 columns are fetched while these compute
static void axpy_q8_0(float * restrict acc, const float * h, const void * const * vcols, int m, int64_t n) {
    const ls_block_q8_0 * const * cols = (const ls_block_q8_0 * const *) vcols;
    for (int j0 = 0; j0 < m; j0 += 8) {
        const int mj = ls_group_cols(m, j0);
        const ls_block_q8_0 * const * nx = cols + j0 + 8;
        const int n_next = ls_group_next(m, j0);
        for (int64_t b = 0; b < n / 32; b++) {
            for (int j = 0; j < n_next; j++) __builtin_prefetch(nx[j] + b);
            float * a = acc + b * 32;
            float32x4_t v[8];
            for (int k = 0; k < 8; k++) v[k] = vld1q_f32(a + 4 * k);
            for (int j = 0; j < mj; j++) {
                const ls_block_q8_0 * c = &cols[j0 + j][b];
                const float f = h[j0 + j] * f16_to_f32(c->d);
                const int8x16_t q0 = vld1q_s8(c->qs), q1 = vld1q_s8(c->qs + 16);
                fma8(v, vget_low_s8(q0), f);
                fma8(v + 2, vget_high_s8(q0), f);
                fma8(v + 4, vget_low_s8(q1), f);
                fma8(v + 6, vget_high_s8(q1), f);
            }
            for (int k = 0; k < 8; k++) vst1q_f32(a + 4 * k, v[k]);
        }
    }
}

// 8 columns per pass, per step of 32 values the factors (h * d) * scale of its two groups of 16
static void axpy_q6_K(float * restrict acc, const float * h, const void * const * vcols, int m, int64_t n) {
    const uint8_t * const * cols = (const uint8_t * const *) vcols;
    for (int j0 = 0; j0 < m; j0 += 8) {
        const int mj = ls_group_cols(m, j0);
        const uint8_t * const * nx = cols + j0 + 8;
        const int n_next = ls_group_next(m, j0);
        for (int64_t b = 0; b < n / 256; b++) {
            float hd[8];   // h * d of each column's super-block
            for (int j = 0; j < mj; j++) hd[j] = h[j0 + j] * f16_to_f32(((const ls_block_q6_K *) cols[j0 + j])[b].d);
            for (int hs = 0; hs < 8; hs++) {   // values 32 hs .. + 31: half hs / 4, seg hs % 4, scales 2 hs, 2 hs + 1
                for (int j = 0; j < n_next; j++) __builtin_prefetch(nx[j] + b * LS_Q6_K_BYTES + hs * 26);
                float * a = acc + b * 256 + hs * 32;
                float32x4_t v[8];
                for (int k = 0; k < 8; k++) v[k] = vld1q_f32(a + 4 * k);
                for (int j = 0; j < mj; j++) {
                    const uint8_t * blk = cols[j0 + j] + b * LS_Q6_K_BYTES;
                    const int8_t * sc = (const int8_t *) (blk + 192) + 2 * hs;
                    uint8x16_t q[2];
                    q6_K_quants_u(blk, hs / 4, hs % 4, q);
                    const int8x16_t s0 = vsubq_s8(vreinterpretq_s8_u8(q[0]), vdupq_n_s8(32));
                    const int8x16_t s1 = vsubq_s8(vreinterpretq_s8_u8(q[1]), vdupq_n_s8(32));
                    const float f0 = hd[j] * (float) sc[0], f1 = hd[j] * (float) sc[1];
                    fma8(v, vget_low_s8(s0), f0);
                    fma8(v + 2, vget_high_s8(s0), f0);
                    fma8(v + 4, vget_low_s8(s1), f1);
                    fma8(v + 6, vget_high_s8(s1), f1);
                }
                for (int k = 0; k < 8; k++) vst1q_f32(a + 4 * k, v[k]);
            }
        }
    }
}

// the rows kernels: the one-row kernels row by row (each row its bits, trivially)
static void axpy_q8_0_rows(float * acc, const float * h, const void * const * cols, int m, int64_t T, int64_t n) {
    ls_axpy_rows_by_row(axpy_q8_0, acc, h, cols, m, T, n);
}

static void axpy_q6_K_rows(float * acc, const float * h, const void * const * cols, int m, int64_t T, int64_t n) {
    ls_axpy_rows_by_row(axpy_q6_K, acc, h, cols, m, T, n);
}

// prefill over a staged tile: 4 token rows x 16 outputs in registers while every staged column
// adds to them; the rest through ls_axpy_tile_rest (the same fused adds)
static void axpy_tile(float * restrict acc, const float * restrict h, const float * restrict cols,
                      int n_staged, int64_t T, int64_t n_embd) {
    const int64_t t_end = T - T % 4, c_end = n_embd - n_embd % 16;
    for (int64_t t = 0; t < t_end; t += 4) {
        for (int64_t c = 0; c < c_end; c += 16) {
            float32x4_t v[4][4];
            for (int r = 0; r < 4; r++)
                for (int k = 0; k < 4; k++) v[r][k] = vld1q_f32(acc + (size_t) (t + r) * n_embd + c + 4 * k);
            for (int j = 0; j < n_staged; j++) {
                const float * cj = cols + (size_t) j * n_embd + c;
                const float32x4_t c0 = vld1q_f32(cj), c1 = vld1q_f32(cj + 4), c2 = vld1q_f32(cj + 8), c3 = vld1q_f32(cj + 12);
                const float * hj = h + (size_t) j * T + t;
                for (int r = 0; r < 4; r++) {
                    v[r][0] = vfmaq_n_f32(v[r][0], c0, hj[r]);
                    v[r][1] = vfmaq_n_f32(v[r][1], c1, hj[r]);
                    v[r][2] = vfmaq_n_f32(v[r][2], c2, hj[r]);
                    v[r][3] = vfmaq_n_f32(v[r][3], c3, hj[r]);
                }
            }
            for (int r = 0; r < 4; r++)
                for (int k = 0; k < 4; k++) vst1q_f32(acc + (size_t) (t + r) * n_embd + c + 4 * k, v[r][k]);
        }
    }
    ls_axpy_tile_rest(acc, h, cols, n_staged, T, n_embd, t_end, c_end);
}

static void dequant_q8_0(float * restrict out, const void * vcol, int64_t n) {
    const ls_block_q8_0 * col = vcol;
    for (int64_t b = 0; b < n / 32; b++) {
        const float d = f16_to_f32(col[b].d);
        for (int k = 0; k < 4; k++) {
            const int16x8_t w = vmovl_s8(vld1_s8(col[b].qs + 8 * k));
            vst1q_f32(out + b * 32 + 8 * k, vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))), d));
            vst1q_f32(out + b * 32 + 8 * k + 4, vmulq_n_f32(vcvtq_f32_s32(vmovl_high_s16(w)), d));
        }
    }
}

// (d * scale) * (q - 32), the products of ggml's dequantize_row_q6_K
static void dequant_q6_K(float * restrict out, const void * vcol, int64_t n) {
    const uint8_t * col = vcol;
    for (int64_t b = 0; b < n / 256; b++) {
        const uint8_t * blk = col + b * LS_Q6_K_BYTES;
        const float d = f16_to_f32(((const ls_block_q6_K *) blk)->d);
        for (int hs = 0; hs < 8; hs++) {
            uint8x16_t q[2];
            q6_K_quants_u(blk, hs / 4, hs % 4, q);
            for (int k = 0; k < 2; k++) {   // a group of 16 values: one scale
                const float f = d * (float) ((const int8_t *) (blk + 192))[2 * hs + k];
                const int8x16_t s = vsubq_s8(vreinterpretq_s8_u8(q[k]), vdupq_n_s8(32));
                const int16x8_t lo = vmovl_s8(vget_low_s8(s)), hi = vmovl_high_s8(s);
                float * y = out + b * 256 + hs * 32 + 16 * k;
                vst1q_f32(y,      vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), f));
                vst1q_f32(y + 4,  vmulq_n_f32(vcvtq_f32_s32(vmovl_high_s16(lo)), f));
                vst1q_f32(y + 8,  vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), f));
                vst1q_f32(y + 12, vmulq_n_f32(vcvtq_f32_s32(vmovl_high_s16(hi)), f));
            }
        }
    }
}

#endif

// ---- the LM head's rows: Q6_K weights x Q8_K activations (kernels.c: the arithmetic) -------------

// the super-block's quants unpacked once; per row the exact S, group sums scaled in int32 lanes
static void head_q6_K(const void * vw, int64_t n, const void * const * vx, int64_t T, float * out, size_t out_stride) {
    const ls_block_q6_K * w = vw;
    const ls_block_q8_K * const * x = (const ls_block_q8_K * const *) vx;
    const int32x4_t zero = vdupq_n_s32(0);
    float acc[LS_EXACT_ROWS];
    for (int64_t t = 0; t < T; t++) acc[t] = 0.0f;
    for (int64_t b = 0; b < n / 256; b++) {
        int8x16_t q[16];   // group g: values 16 g .. + 15
        for (int hs = 0; hs < 8; hs++) {
            uint8x16_t u[2];
            q6_K_quants_u((const uint8_t *) &w[b], hs / 4, hs % 4, u);
            q[2 * hs] = vreinterpretq_s8_u8(u[0]);
            q[2 * hs + 1] = vreinterpretq_s8_u8(u[1]);
        }
        const int16x8_t sc0 = vmovl_s8(vld1_s8(w[b].sc)), sc1 = vmovl_s8(vld1_s8(w[b].sc + 8));
        const float dw = f16_to_f32(w[b].d);
        for (int64_t t = 0; t < T; t++) {
            const ls_block_q8_K * xb = &x[t][b];
            int32x4_t s = zero;
            for (int g = 0; g < 16; g++) s = vmlaq_n_s32(s, dot_i8(zero, q[g], vld1q_s8(xb->qs + 16 * g)), w[b].sc[g]);
            const int16x8_t bs0 = vld1q_s16(xb->bsums), bs1 = vld1q_s16(xb->bsums + 8);
            int32x4_t m = vmull_s16(vget_low_s16(sc0), vget_low_s16(bs0));
            m = vmlal_high_s16(m, sc0, bs0);
            m = vmlal_s16(m, vget_low_s16(sc1), vget_low_s16(bs1));
            m = vmlal_high_s16(m, sc1, bs1);
            const int32_t S = vaddvq_s32(s) - 32 * vaddvq_s32(m);
            acc[t] = fmaf(dw * xb->d, (float) S, acc[t]);
        }
    }
    for (int64_t t = 0; t < T; t++) out[(size_t) t * out_stride] = acc[t];
}

// ---- a sketch row . x (kernels.c: the LS2 row format) -------------------------------------------

// two groups (one chunk of 16 code bytes) per step, in two float accumulators
static float ls2_dot(const uint8_t * row, const int8_t * x8, const float * dx, const float * xo, int64_t n) {
    const uint8_t * codes = row + n / 32 * 2;
    const uint8x16_t m3 = vdupq_n_u8(3);
    const int32x4_t zero = vdupq_n_s32(0);
    float32x4_t acc0 = vdupq_n_f32(0.0f), acc1 = acc0, off = acc0;
    for (int64_t g = 0; g < n / 32; g += 2) {
        const uint8x16_t c = vld1q_u8(codes + g * 8);
        const int8x16_t u0 = vreinterpretq_s8_u8(vandq_u8(c, m3)), u1 = vreinterpretq_s8_u8(vandq_u8(vshrq_n_u8(c, 2), m3));
        const int8x16_t u2 = vreinterpretq_s8_u8(vandq_u8(vshrq_n_u8(c, 4), m3)), u3 = vreinterpretq_s8_u8(vshrq_n_u8(c, 6));
        const int8_t * y = x8 + g * 32;
        const int32x4_t p0 = dot_i8(dot_i8(zero, u0, vld1q_s8(y)), u1, vld1q_s8(y + 16));
        const int32x4_t p1 = dot_i8(dot_i8(zero, u2, vld1q_s8(y + 32)), u3, vld1q_s8(y + 48));
        uint16_t d[2];
        memcpy(d, row + 2 * g, 4);
        acc0 = vfmaq_n_f32(acc0, vcvtq_f32_s32(p0), f16_to_f32(d[0]) * dx[g]);
        acc1 = vfmaq_n_f32(acc1, vcvtq_f32_s32(p1), f16_to_f32(d[1]) * dx[g + 1]);
    }
    int64_t g = 0;
    for (; g + 4 <= n / 32; g += 4) {
        uint16_t d[4];
        memcpy(d, row + 2 * g, 8);
        const float32x4_t df = { f16_to_f32(d[0]), f16_to_f32(d[1]), f16_to_f32(d[2]), f16_to_f32(d[3]) };
        off = vfmaq_f32(off, df, vld1q_f32(xo + g));
    }
    float rest = 0.0f;
    for (; g < n / 32; g++) {
        uint16_t d;
        memcpy(&d, row + 2 * g, 2);
        rest += f16_to_f32(d) * xo[g];
    }
    return vaddvq_f32(vaddq_f32(acc0, acc1)) - (rest + vaddvq_f32(off));
}

#if defined(LS_NEON_DOTPROD)

const ls_kernel_set ls_kernels_neon_dotprod = {
    .dot2_q4_K = dot2_q4_K, .dot2_q4_K_rows = dot2_q4_K_rows,
    .dot2_q4_1 = dot2_q4_1, .dot2_q4_1_rows = dot2_q4_1_rows,
    .head_q6_K = head_q6_K,
    .ls2_dot = ls2_dot,
};

#else

const ls_kernel_set ls_kernels_neon = {
    .dot2_q4_K = dot2_q4_K, .dot2_q4_1 = dot2_q4_1,
    .dot2_q4_K_rows = dot2_q4_K_rows, .dot2_q4_1_rows = dot2_q4_1_rows,
    .axpy_q8_0 = axpy_q8_0, .axpy_q6_K = axpy_q6_K,
    .axpy_q8_0_rows = axpy_q8_0_rows, .axpy_q6_K_rows = axpy_q6_K_rows,
    .axpy_tile = axpy_tile,
    .dequant_q8_0 = dequant_q8_0, .dequant_q6_K = dequant_q6_K,
    .head_q6_K = head_q6_K,
    .ls2_dot = ls2_dot,
};

#endif
