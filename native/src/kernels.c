// kernels.c — the arithmetic the FFN op, the LM head and the sketch need that ggml does not
// provide, as plain C: the gate activations (one table entry per LS_ACT_*), gate and up of a
// neuron in one pass (Q4_K, Q4_1 rows), the down projection over transposed columns, acc += h *
// column (Q8_0 and Q6_K columns read in place; f32 tiles for prefill), the head's Q6_K x Q8_K
// rows and the sketch's LS2 row dot product. These scalar kernels are the reference that every
// SIMD variant (kernels_x86.c, kernels_neon.c) is checked against at start-up and in the tests,
// and the kernels of any CPU without one; dispatch.c chooses (docs/design.md §13).
// Leaf file: calls nothing of the library.

#include "kernels.h"

#include <math.h>
#include <string.h>

// ---- f16 ------------------------------------------------------------------------------------------

static inline float f32_of_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t) (h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0x1f) return f32_of_bits(sign | 0x7f800000u | man << 13);            // inf, NaN
    if (exp != 0) return f32_of_bits(sign | (exp + 112) << 23 | man << 13);        // normal
    const float v = (float) man * 0x1p-24f;                                        // subnormal, zero
    return sign ? -v : v;
}

// to the nearest f16, ties to even (what F16C's and ARM's conversions do); overflow to inf
static inline uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t) ((x >> 16) & 0x8000);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return sign | 0x7e00;             // NaN
    if (ax >= 0x47800000u) return sign | 0x7c00;            // 2^16 and above (and inf): inf
    const int e = (int) (ax >> 23) - 127;
    if (e < -25) return sign;                               // below half the smallest subnormal
    // the value in units of the f16 result's last place: the 24-bit significand shifted right
    const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    const int shift = e >= -14 ? 13 : -e - 1;               // normal: drop 13 bits; subnormal: more
    uint32_t h = e >= -14 ? (uint32_t) (e + 15) << 10 | (m & 0x7fffffu) >> 13 : m >> shift;
    const uint32_t rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rest > half || (rest == half && (h & 1))) h++;      // a carry into the exponent is right
    return (uint16_t) (sign | h);
}

// ---- activations ----------------------------------------------------------------------------------

static float act_silu(float x) { return x / (1.0f + expf(-x)); }
static inline float f16_round(float x) { return f16_to_f32(f32_to_f16(x)); }  // to f16 and back
static float act_gelu(float x) {
    // GELU, tanh form, exactly as ggml's CPU geglu computes it (GGML_GELU_FP16): 0 below -10,
    // x above 10, otherwise a lookup table indexed by x rounded to f16 whose entries are
    // gelu(that f16 value) rounded to f16. Evaluating the table's formula here gives its entry;
    // the fused add is the one the compilers make of ggml's 1 + a*x*x (FMA is in every CPU
    // variant ggml builds), written out so that no build of this file can round it otherwise.
    if (x <= -10.0f) return 0.0f;
    if (x >= 10.0f) return x;
    const float c = 0.79788456080286535587989211986876f; // sqrt(2/pi), ggml's SQRT_2_OVER_PI
    const float xr = f16_round(x);
    return f16_round(0.5f * xr * (1.0f + tanhf(c * xr * fmaf(0.044715f * xr, xr, 1.0f))));
}

static float act_relu(float x) { return x > 0.0f ? x : 0.0f; }   // (ggml's reglu: g > 0 ? g * u : 0)

// the activation table: the op computes act(gate . x) * (up . x) for any entry
static float (* const ACTS[])(float) = { [LS_ACT_SILU] = act_silu, [LS_ACT_GELU] = act_gelu, [LS_ACT_RELU] = act_relu };

float ls_act(int32_t activation, float g) { return ACTS[activation](g); }

float ls_glu(int32_t activation, float g, float u, float alpha, float limit) {
    if (activation == LS_ACT_SWIGLU_OAI) {   // as ggml's swiglu_oai, operation for operation
        const float x = fminf(g, limit), y = fminf(fmaxf(u, -limit), limit);
        return x / (1.0f + expf(alpha * (-x))) * (y + 1.0f);
    }
    if (activation == LS_ACT_RELU) return g > 0.0f ? g * u : 0.0f;
    return ACTS[activation](g) * u;
}

static inline void prefetch_lines(const uint8_t * pf, int64_t step, int pf_lines) {
    for (int l = 0; l < pf_lines; l++) __builtin_prefetch(pf + ((size_t) step * (size_t) pf_lines + (size_t) l) * 64);
}

// ---- gate and up of one neuron in one pass: Q4_K rows x Q8_K activation ------------------------
//
// Q4_K super-block (256 values): f16 d, f16 dmin, 12 bytes of eight 6-bit scales and eight 6-bit
// mins, 128 bytes of nibbles (32 bytes per 64 values: low nibbles the first 32, high the next 32).
// value = d*scale_s*q - dmin*min_s. Q8_K: f32 d, 256 int8, 16 sums of 16 values (bsums).
//   row . x = sum_blocks dx * (d * sum_s scale_s * sum_{i in s} q4_i q8_i - dmin * sum_s min_s * bsum_s)
// The integer parts are exact in every variant; the float sums are those of ggml's vec_dot up to
// their order.

// scale and min of sub-block s (ggml's get_scale_min_k4)
static inline void q4_K_scale_min(int s, const uint8_t * q, int32_t * sc, int32_t * mn) {
    if (s < 4) {
        *sc = q[s] & 63;
        *mn = q[s + 4] & 63;
    } else {
        *sc = (q[s + 4] & 0x0f) | (q[s - 4] >> 6) << 4;
        *mn = (q[s + 4] >> 4) | (q[s] >> 6) << 4;
    }
}

static void dot2_q4_K_scalar(int64_t n, const void * va, const void * vb, const void * vx, float * ra, float * rb,
                             const uint8_t * pf, int pf_lines) {
    const ls_block_q4_K * w[2] = { va, vb };
    const ls_block_q8_K * x = vx;
    float sum[2] = { 0.0f, 0.0f };
    for (int64_t i = 0; i < n / 256; i++) {
        prefetch_lines(pf, i, pf_lines);
        for (int r = 0; r < 2; r++) {
            const ls_block_q4_K * blk = &w[r][i];
            int32_t sumi = 0, summ = 0;   // sum_s scale_s * (q4 . q8)_s, sum_s min_s * bsum_s
            for (int s = 0; s < 8; s++) {
                int32_t sc, mn;
                q4_K_scale_min(s, blk->scales, &sc, &mn);
                const uint8_t * q = blk->qs + 32 * (s / 2);
                const int8_t * y = x[i].qs + 32 * s;
                const int shift = 4 * (s % 2);
                int32_t dot = 0;
                for (int l = 0; l < 32; l++) dot += ((q[l] >> shift) & 0x0f) * y[l];
                sumi += sc * dot;
                summ += mn * (x[i].bsums[2 * s] + x[i].bsums[2 * s + 1]);
            }
            sum[r] += x[i].d * f16_to_f32(blk->d) * (float) sumi - x[i].d * f16_to_f32(blk->dmin) * (float) summ;
        }
    }
    *ra = sum[0];
    *rb = sum[1];
}

// ---- gate and up of one neuron in one pass: Q4_1 rows x Q8_1 activation -------------------------
//
// Q4_1 block (32 values): f16 d, f16 m, 16 bytes of nibbles (low: values 0..15, high: 16..31);
// value = d*q + m. Q8_1: f16 d, f16 s = d * sum(q), 32 int8.
//   row . x = sum_blocks (d * dx) * sum_i q4_i q8_i + m * s
// as ggml's vec_dot_q4_1_q8_1 computes it (the integer sums exact, f32 sums in another order).

static void dot2_q4_1_scalar(int64_t n, const void * va, const void * vb, const void * vx, float * ra, float * rb,
                             const uint8_t * pf, int pf_lines) {
    const ls_block_q4_1 * w[2] = { va, vb };
    const ls_block_q8_1 * x = vx;
    float sum[2] = { 0.0f, 0.0f };
    for (int64_t i = 0; i < n / 32; i++) {
        prefetch_lines(pf, i, pf_lines);
        const float dx = f16_to_f32(x[i].d), sx = f16_to_f32(x[i].s);
        for (int r = 0; r < 2; r++) {
            const ls_block_q4_1 * blk = &w[r][i];
            int32_t dot = 0;
            for (int l = 0; l < 16; l++) dot += (blk->qs[l] & 0x0f) * x[i].qs[l] + (blk->qs[l] >> 4) * x[i].qs[l + 16];
            sum[r] += f16_to_f32(blk->d) * dx * (float) dot + f16_to_f32(blk->m) * sx;
        }
    }
    *ra = sum[0];
    *rb = sum[1];
}

// ---- the down projection: acc[0..n) += sum_j h[j] * column j ------------------------------------
//
// Every variant adds per output value o, for the columns j in order, acc[o] = fma(f_j, q_j[o],
// acc[o]) with f_j = h_j * d_j (Q8_0) or (h_j * d_j) * scale (Q6_K, per 16 values): the same
// bits on every instruction set, however many columns a pass takes; the rows kernels keep it.

static void axpy_q8_0_scalar(float * restrict acc, const float * h, const void * const * vcols, int m, int64_t n) {
    const ls_block_q8_0 * const * cols = (const ls_block_q8_0 * const *) vcols;
    for (int j = 0; j < m; j++) {
        for (int64_t b = 0; b < n / 32; b++) {
            const float f = h[j] * f16_to_f32(cols[j][b].d);
            float * a = acc + b * 32;
            for (int i = 0; i < 32; i++) a[i] = fmaf(f, (float) cols[j][b].qs[i], a[i]);
        }
    }
}

// ggml's block_q6_K: 256 values as 4 low bits (ql), 2 high bits (qh), 16 int8 scales and an f16
// super-block scale; value = d * scale[group of 16] * (q - 32). Of each 128 values, ql's low
// nibbles of 64 bytes then their high nibbles, qh's 2-bit pairs on top.
// The 256 6-bit q of a super-block, in value order (0..63)
static void q6_K_unpack(const ls_block_q6_K * b, uint8_t * q) {
    for (int half = 0; half < 2; half++) {
        const uint8_t * ql = b->ql + 64 * half, * qh = b->qh + 32 * half;
        uint8_t * y = q + 128 * half;
        for (int l = 0; l < 32; l++) {
            y[l]      = (uint8_t) ((ql[l] & 0x0f)      | ((qh[l] >> 0) & 3) << 4);
            y[l + 32] = (uint8_t) ((ql[l + 32] & 0x0f) | ((qh[l] >> 2) & 3) << 4);
            y[l + 64] = (uint8_t) ((ql[l] >> 4)        | ((qh[l] >> 4) & 3) << 4);
            y[l + 96] = (uint8_t) ((ql[l + 32] >> 4)   | ((qh[l] >> 6) & 3) << 4);
        }
    }
}

static void axpy_q6_K_scalar(float * restrict acc, const float * h, const void * const * cols, int m, int64_t n) {
    uint8_t q[256];
    for (int j = 0; j < m; j++) {
        const ls_block_q6_K * c = cols[j];
        for (int64_t b = 0; b < n / 256; b++) {
            q6_K_unpack(&c[b], q);
            const float hd = h[j] * f16_to_f32(c[b].d);
            float * a = acc + b * 256;
            for (int g = 0; g < 16; g++) {
                const float f = hd * (float) c[b].sc[g];
                for (int l = 16 * g; l < 16 * g + 16; l++) a[l] = fmaf(f, (float) (q[l] - 32), a[l]);
            }
        }
    }
}

// prefill: acc[t] += sum_j h[j][t] * cols[j] over a staged tile of f32 columns (h [n_staged][T])
static void axpy_tile_scalar(float * acc, const float * h, const float * cols, int n_staged, int64_t T, int64_t n_embd) {
    ls_axpy_tile_rest(acc, h, cols, n_staged, T, n_embd, 0, 0);
}

static void dequant_q8_0_scalar(float * restrict out, const void * vcol, int64_t n) {
    const ls_block_q8_0 * col = vcol;
    for (int64_t b = 0; b < n / 32; b++) {
        const float d = f16_to_f32(col[b].d);
        for (int i = 0; i < 32; i++) out[b * 32 + i] = d * (float) col[b].qs[i];
    }
}

// the same products in the same order as ggml's dequantize_row_q6_K ((d * scale) * q, in f32): the same bits
static void dequant_q6_K_scalar(float * restrict out, const void * vcol, int64_t n) {
    const ls_block_q6_K * col = vcol;
    uint8_t q[256];
    for (int64_t b = 0; b < n / 256; b++) {
        q6_K_unpack(&col[b], q);
        const float d = f16_to_f32(col[b].d);
        for (int l = 0; l < 256; l++) out[b * 256 + l] = (d * (float) col[b].sc[l / 16]) * (float) (q[l] - 32);
    }
}

// ---- the down projection for T token rows, one row at a time ------------------------------------

// row t of h [m][T] gathered in chunks of 256 columns for the one-row kernel
void ls_axpy_rows_by_row(ls_axpy_fn one, float * acc, const float * h, const void * const * cols, int m, int64_t T, int64_t n) {
    float ht[256];
    for (int64_t t = 0; t < T; t++) {
        for (int j0 = 0; j0 < m; j0 += 256) {
            const int mj = m - j0 < 256 ? m - j0 : 256;
            for (int j = 0; j < mj; j++) ht[j] = h[(size_t) (j0 + j) * (size_t) T + (size_t) t];
            one(acc + (size_t) t * (size_t) n, ht, cols + j0, mj, n);
        }
    }
}

void ls_dot2_rows_by_row(ls_dot2_fn one, int64_t n, const void * a, const void * b, const void * x, size_t x_stride, int nr,
                         float * ra, float * rb, const uint8_t * pf, int pf_lines) {
    for (int t = 0; t < nr; t++)
        one(n, a, b, (const uint8_t *) x + (size_t) t * x_stride, ra + t, rb + t, t ? NULL : pf, t ? 0 : pf_lines);
}

static void dot2_q4_K_rows_scalar(int64_t n, const void * a, const void * b, const void * x, size_t x_stride, int nr,
                                  float * ra, float * rb, const uint8_t * pf, int pf_lines) {
    ls_dot2_rows_by_row(dot2_q4_K_scalar, n, a, b, x, x_stride, nr, ra, rb, pf, pf_lines);
}

static void dot2_q4_1_rows_scalar(int64_t n, const void * a, const void * b, const void * x, size_t x_stride, int nr,
                                  float * ra, float * rb, const uint8_t * pf, int pf_lines) {
    ls_dot2_rows_by_row(dot2_q4_1_scalar, n, a, b, x, x_stride, nr, ra, rb, pf, pf_lines);
}

static void axpy_q8_0_rows_scalar(float * acc, const float * h, const void * const * cols, int m, int64_t T, int64_t n) {
    ls_axpy_rows_by_row(axpy_q8_0_scalar, acc, h, cols, m, T, n);
}

static void axpy_q6_K_rows_scalar(float * acc, const float * h, const void * const * cols, int m, int64_t T, int64_t n) {
    ls_axpy_rows_by_row(axpy_q6_K_scalar, acc, h, cols, m, T, n);
}

// ---- the LM head's rows: Q6_K weights x Q8_K activations (head.c) ------------------------------
//
// Per super-block of 256 values the integer sum S = sum_g scale_g * (sum_{i in g} q_i x_i - 32 *
// bsum_g) (exact, however it is computed), then acc = fmaf(d_w * d_x, S, acc), super-blocks in
// order: every variant gives these bits, for each row whatever the rows beside it.
// out[t * out_stride] = w . x[t] for t < T <= LS_EXACT_ROWS, w one weight row of n values.
static void head_q6_K_scalar(const void * vw, int64_t n, const void * const * vx, int64_t T, float * out, size_t out_stride) {
    const ls_block_q6_K * w = vw;
    const ls_block_q8_K * const * x = (const ls_block_q8_K * const *) vx;
    float acc[LS_EXACT_ROWS];
    uint8_t q[256];
    for (int64_t t = 0; t < T; t++) acc[t] = 0.0f;
    for (int64_t b = 0; b < n / 256; b++) {
        q6_K_unpack(&w[b], q);
        const float dw = f16_to_f32(w[b].d);
        for (int64_t t = 0; t < T; t++) {
            const ls_block_q8_K * xb = &x[t][b];
            int32_t S = 0;
            for (int g = 0; g < 16; g++) {
                int32_t s = 0;
                for (int l = 16 * g; l < 16 * g + 16; l++) s += q[l] * xb->qs[l];
                S += w[b].sc[g] * (s - 32 * xb->bsums[g]);
            }
            acc[t] = fmaf(dw * xb->d, (float) S, acc[t]);
        }
    }
    for (int64_t t = 0; t < T; t++) out[(size_t) t * out_stride] = acc[t];
}

// ---- a sketch row . x (sketch.c: the LS2 row format and x's quantization) -----------------------
//
// Group g of 32 values: f16 d_g; its codes in chunk g / 2 (16 bytes per 64 values, byte j holding
// the codes of values j, j+16, j+32, j+48 in bits 0-1, 2-3, 4-5, 6-7), values 32 (g % 2) .. + 31.
//   row . x = sum_g d_g * dx_g * (sum_i code_i * x8_i) - sum_g d_g * xo_g,  xo_g = 1.5 * dx_g * sum x8
static float ls2_dot_scalar(const uint8_t * row, const int8_t * x8, const float * dx, const float * xo, int64_t n) {
    const uint8_t * codes = row + n / 32 * 2;
    float dot = 0.0f, off = 0.0f;
    for (int64_t g = 0; g < n / 32; g++) {
        uint16_t dh;
        memcpy(&dh, row + 2 * g, 2);
        const float d = f16_to_f32(dh);
        const uint8_t * c = codes + g / 2 * 16;
        int32_t s = 0;
        for (int i = 0; i < 32; i++) {
            const int v = 32 * (int) (g % 2) + i;   // the value's place in its chunk of 64
            s += ((c[v % 16] >> (2 * (v / 16))) & 3) * x8[g * 32 + i];
        }
        dot += d * dx[g] * (float) s;
        off += d * xo[g];
    }
    return dot - off;
}

const ls_kernel_set ls_kernels_scalar = {
    .dot2_q4_K = dot2_q4_K_scalar, .dot2_q4_1 = dot2_q4_1_scalar,
    .dot2_q4_K_rows = dot2_q4_K_rows_scalar, .dot2_q4_1_rows = dot2_q4_1_rows_scalar,
    .axpy_q8_0 = axpy_q8_0_scalar, .axpy_q6_K = axpy_q6_K_scalar,
    .axpy_q8_0_rows = axpy_q8_0_rows_scalar, .axpy_q6_K_rows = axpy_q6_K_rows_scalar,
    .axpy_tile = axpy_tile_scalar,
    .dequant_q8_0 = dequant_q8_0_scalar, .dequant_q6_K = dequant_q6_K_scalar,
    .head_q6_K = head_q6_K_scalar,
    .ls2_dot = ls2_dot_scalar,
};
