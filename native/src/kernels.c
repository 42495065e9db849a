// kernels.c — the arithmetic of the FFN op that ggml does not provide: the gate activations
// (one table entry per LS_ACT_*) and the down projection over transposed columns,
// acc += h * column (Q8_0 columns, the converter's default, get fused AVX2 kernels reading the
// int8 values in place: block = {f16 d; int8 q[32]}). Leaf file: calls nothing of the library.

#include "internal.h"

#include <immintrin.h>
#include <math.h>

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

// Q8_0 columns (the converter's default) get fused AVX2 kernels: block = {f16 d; int8 q[32]}.

static inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }

// acc[0..n) += sum_{j<m} h[j] * dequant(col_j): one load/store of acc per 8 columns
void ls_axpy_q8_0_multi(float * restrict acc, const float * h, const ls_block_q8_0 * const * cols, int m, int64_t n) {
    for (int j0 = 0; j0 < m; j0 += 8) {
        const int mj = m - j0 < 8 ? m - j0 : 8;
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

// acc[t] += sum_j h[j][t] * col_j over the staged neurons; t outermost keeps acc[t] in L1.
void ls_axpy_tile(float * restrict acc, const float * restrict h, const float * restrict cols,
                       int n_staged, int64_t T, int64_t n_embd) {
    for (int64_t t = 0; t < T; t++) {
        float * restrict at = acc + (size_t) t * n_embd;
        for (int j = 0; j < n_staged; j++) {
            const float hv = h[(size_t) j * T + t];
            if (hv == 0.0f) continue;
            const float * restrict cj = cols + (size_t) j * n_embd;
            for (int64_t c = 0; c < n_embd; c++) at[c] += hv * cj[c];
        }
    }
}
