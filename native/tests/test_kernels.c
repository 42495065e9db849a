// test_kernels.c — every kernel (leanstream.h: ls_dot2_q4_K ...) on every instruction set this
// build and CPU offer (ls_kernels_force), against the scalar C, the reference, on pseudo-random
// inputs of several sizes: the gate/up and sketch dot products within f32 summation tolerance;
// the down projection, the prefill tile, the dequantizations and the head bit for bit (their sums
// are exact or the same fused adds on every instruction set). The rows kernels of a verify pass
// bit for bit against the one-row kernels, row by row; CRC-32C's instruction path against its
// table. Built and run by tests/native/test_c_api.py (x86-64) and, cross-compiled, under
// qemu-user by tests/native/test_cross.py (aarch64, with and without the dot product):
//     cc -I native/include native/tests/test_kernels.c -lleanstream -o test_kernels && ./test_kernels
// Prints one line per check; exit status 0 when all pass.

#include "leanstream.h"

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;

#define CHECK(cond, ...) do {                                              \
        if (cond) { printf("ok   %s\n", #cond); }                          \
        else { printf("FAIL %s: ", #cond); printf(__VA_ARGS__); printf("\n"); failures++; } \
    } while (0)

// ggml's block layouts, as the kernels read them
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } block_q4_K;   // 256 values
typedef struct { float d; int8_t qs[256]; int16_t bsums[16]; } block_q8_K;              // 256 values
typedef struct { uint16_t d, m; uint8_t qs[16]; } block_q4_1;                         // 32 values
typedef struct { uint16_t d, s; int8_t qs[32]; } block_q8_1;                          // 32 values
typedef struct { uint16_t d; int8_t qs[32]; } block_q8_0;                             // 32 values
typedef struct { uint8_t ql[128], qh[64]; int8_t sc[16]; uint16_t d; } block_q6_K;     // 256 values

// every instruction set a build has (this one has some of them)
static const char * const ALL_ISAS[] = { "scalar", "avx2", "avx512", "avx512vnni", "neon", "neon+dotprod" };
static const char * isas[8];   // the ones this build and CPU run, scalar first
static int n_isas = 0;
static const char * isa = "";  // the one in use now

static void use(const char * name) {
    if (!ls_kernels_force(name)) { printf("FAIL ls_kernels_force(%s)\n", name); failures++; }
    isa = name;
}

static uint32_t rng = 12345u;
static uint32_t rnd(void) { rng = rng * 1664525u + 1013904223u; return rng >> 8; }
static int8_t rnd_i8(void) { return (int8_t) (rnd() % 255 - 127); }
static uint16_t rnd_f16(uint16_t lo, uint16_t span) { return (uint16_t) (lo + rnd() % span); }   // positive f16 bits
static float rnd_f(void) { return (float) (rnd() % 20001) / 10000.0f - 1.0f; }

static void * alloc(size_t bytes) {
    void * p = calloc(1, bytes);
    if (!p) { printf("FAIL out of memory\n"); exit(1); }
    return p;
}

static bool same_bits(const float * a, const float * b, size_t n) { return memcmp(a, b, n * sizeof(float)) == 0; }

// max |a - b| <= rtol * max |b| + 1e-6 (f32 sums in another order)
static bool close_to(const float * a, const float * b, size_t n, float rtol) {
    float m = 0.0f, e = 0.0f;
    for (size_t i = 0; i < n; i++) {
        m = fmaxf(m, fabsf(b[i]));
        e = fmaxf(e, fabsf(a[i] - b[i]));
    }
    return e <= rtol * m + 1e-6f;
}

// ---- gate and up of a neuron against T token rows -----------------------------------------------

static void q8_K_rows(block_q8_K * x, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
        x[i].d = 0.001f * (float) (1 + rnd() % 30);
        for (int j = 0; j < 256; j++) x[i].qs[j] = rnd_i8();
        for (int j = 0; j < 16; j++) {
            int s = 0;
            for (int k = 0; k < 16; k++) s += x[i].qs[16 * j + k];
            x[i].bsums[j] = (int16_t) s;
        }
    }
}

// fmt 0: Q4_K rows x Q8_K; 1: Q4_1 rows x Q8_1. Each ISA's one-row kernel against the scalar one;
// its rows kernel, row by row, against its one-row kernel (bits), with a prefetch stream.
static void check_dot2(int fmt, int64_t n, int T) {
    const int64_t per = fmt == 0 ? 256 : 32, nb = n / per;
    const size_t wbytes = (size_t) nb * (fmt == 0 ? sizeof(block_q4_K) : sizeof(block_q4_1));
    const size_t xrow = (size_t) nb * (fmt == 0 ? sizeof(block_q8_K) : sizeof(block_q8_1)) + 24;  // rows apart by more than a row
    uint8_t * a = alloc(wbytes), * b = alloc(wbytes), * x = alloc(xrow * (size_t) T);
    uint8_t * pf = alloc((size_t) nb * 64);
    if (fmt == 0) {
        block_q4_K * w[2] = { (block_q4_K *) a, (block_q4_K *) b };
        for (int r = 0; r < 2; r++)
            for (int64_t i = 0; i < nb; i++) {
                w[r][i].d = rnd_f16(0x1c00, 0x1000);      // ~0.004 .. 0.03
                w[r][i].dmin = rnd_f16(0x1c00, 0x1000);
                for (int j = 0; j < 12; j++) w[r][i].scales[j] = (uint8_t) rnd();
                for (int j = 0; j < 128; j++) w[r][i].qs[j] = (uint8_t) rnd();
            }
        for (int t = 0; t < T; t++) q8_K_rows((block_q8_K *) (x + (size_t) t * xrow), nb);
    } else {
        block_q4_1 * w[2] = { (block_q4_1 *) a, (block_q4_1 *) b };
        for (int r = 0; r < 2; r++)
            for (int64_t i = 0; i < nb; i++) {
                w[r][i].d = rnd_f16(0x1c00, 0x1000);
                w[r][i].m = (uint16_t) (rnd_f16(0x1c00, 0x1000) | (rnd() & 1) << 15);   // either sign
                for (int j = 0; j < 16; j++) w[r][i].qs[j] = (uint8_t) rnd();
            }
        for (int t = 0; t < T; t++) {
            block_q8_1 * xt = (block_q8_1 *) (x + (size_t) t * xrow);
            for (int64_t i = 0; i < nb; i++) {
                xt[i].d = rnd_f16(0x1c00, 0x1000);
                xt[i].s = (uint16_t) (rnd_f16(0x2c00, 0x1000) | (rnd() & 1) << 15);
                for (int j = 0; j < 32; j++) xt[i].qs[j] = rnd_i8();
            }
        }
    }
    float * ref = alloc(sizeof(float) * 2 * (size_t) T), * one = alloc(sizeof(float) * 2 * (size_t) T);
    float * ra = alloc(sizeof(float) * (size_t) T), * rb = alloc(sizeof(float) * (size_t) T);
    for (int k = 0; k < n_isas; k++) {
        use(isas[k]);
        for (int t = 0; t < T; t++)
            (fmt == 0 ? ls_dot2_q4_K : ls_dot2_q4_1)(n, a, b, x + (size_t) t * xrow, &one[2 * t], &one[2 * t + 1], NULL, 0);
        if (k == 0) memcpy(ref, one, sizeof(float) * 2 * (size_t) T);
        (fmt == 0 ? ls_dot2_q4_K_rows : ls_dot2_q4_1_rows)(n, a, b, x, xrow, T, ra, rb, pf, 1);
        int rows_differ = 0;
        for (int t = 0; t < T; t++) rows_differ += !same_bits(&one[2 * t], &ra[t], 1) || !same_bits(&one[2 * t + 1], &rb[t], 1);
        printf("     %s dot2 %s n=%lld T=%d\n", isa, fmt == 0 ? "q4_K" : "q4_1", (long long) n, T);
        CHECK(close_to(one, ref, 2 * (size_t) T, 1e-4f), "%s: %g vs scalar %g", isa, one[0], ref[0]);
        CHECK(rows_differ == 0, "%s: %d of %d rows differ from the one-row kernel", isa, rows_differ, T);
    }
    free(a); free(b); free(x); free(pf); free(ref); free(one); free(ra); free(rb);
}

// ---- the down projection: in place for decode and verify passes, tiles for prefill ---------------

// fmt 0: Q8_0 columns; 1: Q6_K. One row per ISA against the scalar (bits: the same fused adds);
// T rows against one row at a time (bits); the dequantization against the scalar (bits).
static void check_axpy(int fmt, int m, int64_t n, int64_t T) {
    const size_t cbytes = fmt == 0 ? (size_t) (n / 32) * sizeof(block_q8_0) : (size_t) (n / 256) * sizeof(block_q6_K);
    uint8_t * cols = alloc(cbytes * (size_t) m);
    const void ** cp = alloc(sizeof(void *) * (size_t) m);
    for (int j = 0; j < m; j++) {
        cp[j] = cols + cbytes * (size_t) j;
        if (fmt == 0) {
            block_q8_0 * c = (block_q8_0 *) cp[j];
            for (int64_t b = 0; b < n / 32; b++) {
                c[b].d = rnd_f16(0x1c00, 0x1000);
                for (int i = 0; i < 32; i++) c[b].qs[i] = rnd_i8();
            }
        } else {
            uint8_t * c = (uint8_t *) cp[j];
            for (size_t i = 0; i < cbytes; i++) c[i] = (uint8_t) rnd();
            for (int64_t b = 0; b < n / 256; b++) ((block_q6_K *) c)[b].d = rnd_f16(0x1400, 0x0400);
        }
    }
    float * h = alloc(sizeof(float) * (size_t) m * (size_t) T), * acc0 = alloc(sizeof(float) * (size_t) (T * n));
    for (int64_t i = 0; i < m * T; i++) h[i] = rnd_f();
    h[0] = 0.0f;   // (a neuron that is off in one row)
    for (int64_t i = 0; i < T * n; i++) acc0[i] = rnd_f();
    float * ref = alloc(sizeof(float) * (size_t) n), * row = alloc(sizeof(float) * (size_t) n);
    float * rows = alloc(sizeof(float) * (size_t) (T * n)), * ht = alloc(sizeof(float) * (size_t) m);
    float * dq_ref = alloc(sizeof(float) * (size_t) n), * dq = alloc(sizeof(float) * (size_t) n);
    for (int k = 0; k < n_isas; k++) {
        use(isas[k]);
        memcpy(row, acc0, sizeof(float) * (size_t) n);
        for (int j = 0; j < m; j++) ht[j] = h[(size_t) j * (size_t) T];
        (fmt == 0 ? ls_axpy_q8_0_multi : ls_axpy_q6_K_multi)(row, ht, cp, m, n);
        (fmt == 0 ? ls_dequant_q8_0 : ls_dequant_q6_K)(dq, cp[m - 1], n);
        if (k == 0) {
            memcpy(ref, row, sizeof(float) * (size_t) n);
            memcpy(dq_ref, dq, sizeof(float) * (size_t) n);
        }
        memcpy(rows, acc0, sizeof(float) * (size_t) (T * n));
        (fmt == 0 ? ls_axpy_q8_0_rows : ls_axpy_q6_K_rows)(rows, h, cp, m, T, n);
        int rows_differ = 0;
        for (int64_t t = 0; t < T; t++) {
            memcpy(row, acc0 + t * n, sizeof(float) * (size_t) n);
            for (int j = 0; j < m; j++) ht[j] = h[(size_t) j * (size_t) T + (size_t) t];
            (fmt == 0 ? ls_axpy_q8_0_multi : ls_axpy_q6_K_multi)(row, ht, cp, m, n);
            if (t == 0) CHECK(same_bits(row, ref, (size_t) n), "%s: the one-row kernel differs from the scalar one", isa);
            rows_differ += !same_bits(row, rows + t * n, (size_t) n);
        }
        printf("     %s axpy %s m=%d n=%lld T=%lld\n", isa, fmt == 0 ? "q8_0" : "q6_K", m, (long long) n, (long long) T);
        CHECK(rows_differ == 0, "%s: %d of %lld rows differ from the one-row kernel", isa, rows_differ, (long long) T);
        CHECK(same_bits(dq, dq_ref, (size_t) n), "%s: the dequantization differs from the scalar one", isa);
    }
    free(cols); free(cp); free(h); free(acc0); free(ref); free(row); free(rows); free(ht); free(dq_ref); free(dq);
}

static void check_tile(int n_staged, int64_t T, int64_t n_embd) {
    float * h = alloc(sizeof(float) * (size_t) (n_staged * T)), * cols = alloc(sizeof(float) * (size_t) (n_staged * n_embd));
    float * acc0 = alloc(sizeof(float) * (size_t) (T * n_embd)), * acc = alloc(sizeof(float) * (size_t) (T * n_embd));
    float * ref = alloc(sizeof(float) * (size_t) (T * n_embd));
    for (int64_t i = 0; i < n_staged * T; i++) h[i] = rnd_f();
    for (int64_t i = 0; i < n_staged * n_embd; i++) cols[i] = rnd_f();
    for (int64_t i = 0; i < T * n_embd; i++) acc0[i] = rnd_f();
    for (int k = 0; k < n_isas; k++) {
        use(isas[k]);
        memcpy(acc, acc0, sizeof(float) * (size_t) (T * n_embd));
        ls_axpy_tile(acc, h, cols, n_staged, T, n_embd);
        if (k == 0) memcpy(ref, acc, sizeof(float) * (size_t) (T * n_embd));
        printf("     %s tile n_staged=%d T=%lld n_embd=%lld\n", isa, n_staged, (long long) T, (long long) n_embd);
        CHECK(same_bits(acc, ref, (size_t) (T * n_embd)), "%s: the tile differs from the scalar one", isa);
    }
    free(h); free(cols); free(acc0); free(acc); free(ref);
}

// ---- the LM head's Q6_K rows and the sketch's LS2 rows --------------------------------------------

static void check_head(int64_t n, int64_t T) {
    block_q6_K * w = alloc(sizeof(block_q6_K) * (size_t) (n / 256));
    for (size_t i = 0; i < sizeof(block_q6_K) * (size_t) (n / 256); i++) ((uint8_t *) w)[i] = (uint8_t) rnd();
    for (int64_t b = 0; b < n / 256; b++) w[b].d = rnd_f16(0x1400, 0x0400);
    block_q8_K * x = alloc(sizeof(block_q8_K) * (size_t) (T * (n / 256)));
    const void ** xs = alloc(sizeof(void *) * (size_t) T);
    for (int64_t t = 0; t < T; t++) {
        q8_K_rows(x + t * (n / 256), n / 256);
        xs[t] = x + t * (n / 256);
    }
    float * ref = alloc(sizeof(float) * (size_t) T), * out = alloc(sizeof(float) * 2 * (size_t) T);
    float * got = alloc(sizeof(float) * (size_t) T);
    for (int k = 0; k < n_isas; k++) {
        use(isas[k]);
        ls_head_q6_K(w, n, xs, T, out, 2);   // (a row stride of two: every other float)
        float alone = 0.0f;
        int rows_differ = 0;
        for (int64_t t = 0; t < T; t++) {
            got[t] = out[2 * t];
            ls_head_q6_K(w, n, xs + t, 1, &alone, 1);
            rows_differ += !same_bits(&alone, &got[t], 1);
        }
        if (k == 0) memcpy(ref, got, sizeof(float) * (size_t) T);
        printf("     %s head q6_K n=%lld T=%lld\n", isa, (long long) n, (long long) T);
        CHECK(same_bits(got, ref, (size_t) T), "%s: %g vs scalar %g", isa, got[0], ref[0]);
        CHECK(rows_differ == 0, "%s: %d of %lld rows differ from the row alone", isa, rows_differ, (long long) T);
    }
    free(w); free(x); free(xs); free(ref); free(out); free(got);
}

static void check_ls2(int64_t n) {
    enum { ROWS = 16 };
    const size_t row_bytes = (size_t) n * 5 / 16;
    uint8_t * rows = alloc(row_bytes * ROWS);
    int8_t * x8 = alloc((size_t) n);
    float * dx = alloc(sizeof(float) * (size_t) (n / 32)), * xo = alloc(sizeof(float) * (size_t) (n / 32));
    for (size_t i = 0; i < row_bytes * ROWS; i++) rows[i] = (uint8_t) rnd();
    for (int r = 0; r < ROWS; r++)
        for (int64_t g = 0; g < n / 32; g++) {
            const uint16_t d = rnd_f16(0x2000, 0x0800);
            memcpy(rows + row_bytes * (size_t) r + 2 * (size_t) g, &d, 2);
        }
    for (int64_t g = 0; g < n / 32; g++) {   // x as ls_sketch_quantize_x leaves it
        int s = 0;
        for (int i = 0; i < 32; i++) s += x8[g * 32 + i] = rnd_i8();
        dx[g] = 0.001f * (float) (1 + rnd() % 16);
        xo[g] = 1.5f * dx[g] * (float) s;
    }
    float ref[ROWS], got[ROWS];
    for (int k = 0; k < n_isas; k++) {
        use(isas[k]);
        for (int r = 0; r < ROWS; r++) got[r] = ls_ls2_dot(rows + row_bytes * (size_t) r, x8, dx, xo, n);
        if (k == 0) memcpy(ref, got, sizeof(ref));
        printf("     %s sketch ls2 n=%lld\n", isa, (long long) n);
        CHECK(close_to(got, ref, ROWS, 1e-4f), "%s: %g vs scalar %g", isa, got[0], ref[0]);
    }
    free(rows); free(x8); free(dx); free(xo);
}

// ---- CRC-32C: the instruction path (where the CPU has one) against the table ----------------------

static void check_crc32c(void) {
    CHECK(ls_crc32c(0, "123456789", 9) == 0xE3069283u, "check value %08x", ls_crc32c(0, "123456789", 9));
    static unsigned char buf[70000];
    for (size_t i = 0; i < sizeof buf; i++) buf[i] = (unsigned char) rnd();
    int bad = 0;
    for (size_t off = 0; off < 16; off++)
        for (size_t len = 0; len < 800; len += 1 + len / 64)
            bad += ls_crc32c(7, buf + off, len) != ls_crc32c_ref(7, buf + off, len);
    CHECK(bad == 0, "%d (offset, length) pairs differ from the table", bad);
    for (size_t len = 3 * 8192 - 9; len < 3 * 8192 + 3 * 256 + 9; len += 97)   // both stream lengths and their ends
        bad += ls_crc32c(0, buf + 3, len) != ls_crc32c_ref(0, buf + 3, len);
    CHECK(bad == 0, "%d long lengths differ from the table", bad);
    CHECK(ls_crc32c(0, buf, sizeof buf) == ls_crc32c_ref(0, buf, sizeof buf), "a 70000-byte buffer");
}

int main(void) {
    CHECK(ls_abi_version() == LS_ABI_VERSION, "library ABI %d, header %d", ls_abi_version(), LS_ABI_VERSION);
    ls_kernels_select();
    printf("kernels: %s\n", ls_kernel_isa());
    CHECK(strstr(ls_kernel_isa(), "failed") == NULL, "a start-up check failed: %s", ls_kernel_isa());
    for (size_t i = 0; i < sizeof(ALL_ISAS) / sizeof(ALL_ISAS[0]); i++) {
        if (!ls_kernels_force(ALL_ISAS[i])) continue;
        printf("     %s: %s\n", ALL_ISAS[i], ls_kernel_isa());
        CHECK(strcmp(ls_kernel_isa(), ALL_ISAS[i]) == 0, "forced %s, in use: %s", ALL_ISAS[i], ls_kernel_isa());
        isas[n_isas++] = ALL_ISAS[i];
    }
    CHECK(n_isas >= 1 && strcmp(isas[0], "scalar") == 0, "the scalar kernels are always there");
    CHECK(ls_kernels_force("no-such-isa") == 0, "an unknown instruction set is refused");

    const int Ts[] = { 1, 3, 5, 17 };
    for (int i = 0; i < 4; i++) {
        check_dot2(0, i < 2 ? 256 : 1536 + 256 * i, Ts[i]);
        check_dot2(1, i < 2 ? 32 * (i + 1) : 1536, Ts[i]);
    }
    const int ms[] = { 1, 8, 11, 40 };
    const int64_t Trows[] = { 1, 2, 5, 70 };
    for (int i = 0; i < 4; i++) {
        check_axpy(0, ms[i], i == 0 ? 32 : 1536, Trows[i]);
        check_axpy(1, ms[i], i == 0 ? 256 : 1536, Trows[i]);
    }
    check_tile(1, 1, 16);
    check_tile(7, 3, 72);
    check_tile(5, 4, 100);
    check_tile(32, 9, 512);
    check_head(256, 1);
    check_head(1536, 3);
    check_head(1536, 64);
    check_head(512, 70);   // more rows than the kernels take at once
    check_ls2(64);
    check_ls2(512);
    check_ls2(1536);
    check_crc32c();

    ls_kernels_select();   // as the process found them
    printf("%d failure(s)\n", failures);
    return failures ? 1 : 0;
}
