// sketch_quant.c — LS2 sketch rows from f32 weights: the converter's sketch stage
// (converters/sketch.py; the row format is in sketch.c's opening comment).
//
// Each group of 32 values takes, among 27 trial scales d = f16(f * max|w| / 1.5) for f in
// linspace(0.35, 1, 27), the one with the least squared error of (code - 1.5) * d, codes
// clip(floor(w / d + 2), 0, 3). The numpy reference is converters/sketch.py's quantize_rows; this
// file computes the same float32 operations in the same order (numpy's pairwise sum of 32 values
// included) and is compiled without FMA contraction (CMakeLists.txt), so the rows are equal to the
// reference's but for a tie between two trial scales broken by a last-bit difference.

#include "internal.h"

#include "ggml.h"

#include <math.h>
#include <string.h>

#define LS2_GROUP 32
#define LS2_TRIALS 27

// numpy's pairwise sum of n = 32 float32 values (pairwise_sum: 8 accumulators, then a tree)
static inline float sum32(const float * a) {
    float r[8];
    for (int j = 0; j < 8; j++) r[j] = a[j];
    for (int i = 8; i < LS2_GROUP; i += 8)
        for (int j = 0; j < 8; j++) r[j] += a[i + j];
    return ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
}

static inline void codes_of(const float * g, float d, uint8_t * c) {
    const float inv = d > 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < LS2_GROUP; j++) {
        float t = floorf(g[j] * inv + 2.0f);
        c[j] = (uint8_t) (t < 0.0f ? 0.0f : t > 3.0f ? 3.0f : t);
    }
}

static void quantize_rows(const float * w, int64_t n_rows, int64_t n_embd, uint8_t * out) {
    float trial[LS2_TRIALS];   // as numpy.linspace(0.35, 1, 27, dtype=float32) computes them
    const double step = (1.0 - 0.35) / (LS2_TRIALS - 1);
    for (int i = 0; i < LS2_TRIALS; i++) trial[i] = (float) (i * step + 0.35);
    trial[LS2_TRIALS - 1] = 1.0f;
    const int64_t n_groups = n_embd / LS2_GROUP, row_bytes = n_embd * 5 / 16;
    for (int64_t r = 0; r < n_rows; r++) {
        const float * row = w + r * n_embd;
        uint8_t * o = out + r * row_bytes;
        uint8_t * packed = o + n_embd / 16;
        memset(packed, 0, (size_t) (n_embd / 4));
        for (int64_t gi = 0; gi < n_groups; gi++) {
            const float * g = row + gi * LS2_GROUP;
            float amax = 0.0f;
            for (int j = 0; j < LS2_GROUP; j++) amax = fmaxf(amax, fabsf(g[j]));
            amax = amax / 1.5f;
            float best_err = INFINITY, best_d = 0.0f;
            for (int t = 0; t < LS2_TRIALS; t++) {
                const float d = ggml_fp16_to_fp32(ggml_fp32_to_fp16(amax * trial[t]));
                const float inv = d > 0.0f ? 1.0f / d : 0.0f;
                float e[LS2_GROUP];
                for (int j = 0; j < LS2_GROUP; j++) {   // (float codes: one vector loop)
                    float c = floorf(g[j] * inv + 2.0f);
                    c = c < 0.0f ? 0.0f : c > 3.0f ? 3.0f : c;
                    const float diff = g[j] - (c - 1.5f) * d;
                    e[j] = diff * diff;
                }
                const float err = sum32(e);
                if (err < best_err) { best_err = err; best_d = d; }
            }
            const ggml_fp16_t h = ggml_fp32_to_fp16(best_d);
            memcpy(o + 2 * gi, &h, 2);
            uint8_t c[LS2_GROUP];
            codes_of(g, best_d, c);
            // value v of its 64-value chunk: byte (v % 16), bits 2 * (v / 16)
            for (int j = 0; j < LS2_GROUP; j++) {
                const int64_t v = gi * LS2_GROUP + j, chunk = v / 64, k = v % 64;
                packed[chunk * 16 + k % 16] |= (uint8_t) (c[j] << (2 * (k / 16)));
            }
        }
    }
}

typedef struct quant_arg { const float * w; int64_t n_rows, n_embd; uint8_t * out; } quant_arg;

static void * quant_thread(void * p) {
    const quant_arg * a = p;
    quantize_rows(a->w, a->n_rows, a->n_embd, a->out);
    return NULL;
}

// rows split into n_threads contiguous parts (the calling thread takes the first); a thread that
// cannot be started leaves its part to the caller
void ls_sketch_quantize_ls2(const float * w, int64_t n_rows, int64_t n_embd, uint8_t * out, int32_t n_threads) {
    enum { MAX_THREADS = 64 };
    if (n_threads < 1) n_threads = 1;
    if (n_threads > MAX_THREADS) n_threads = MAX_THREADS;
    const int64_t row_bytes = n_embd * 5 / 16;
    pthread_t th[MAX_THREADS];
    quant_arg arg[MAX_THREADS];
    bool started[MAX_THREADS] = {false};
    for (int i = 0; i < n_threads; i++) {
        const int64_t r0 = n_rows * i / n_threads, r1 = n_rows * (i + 1) / n_threads;
        arg[i] = (quant_arg) {w + r0 * n_embd, r1 - r0, n_embd, out + r0 * row_bytes};
        if (i > 0) started[i] = pthread_create(&th[i], NULL, quant_thread, &arg[i]) == 0;
    }
    quant_thread(&arg[0]);
    for (int i = 1; i < n_threads; i++) {
        if (started[i]) pthread_join(th[i], NULL);
        else quant_thread(&arg[i]);
    }
}
