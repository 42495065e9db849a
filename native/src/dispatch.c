// dispatch.c — which variant of each kernel (kernels.h) runs on this CPU, chosen once per process;
// the start-up checks that let a variant run; the entry points the library calls.
//
// The build has a list of instruction sets (ISAS below), from the scalar C up: x86-64 builds
// avx2, avx512 and avx512vnni, aarch64 builds neon and neon+dotprod, any other target the scalar C alone.
// Each set brings its own kernels or none of a kind (then the set below it serves). For each kind
// of kernel the best set that this CPU runs (and LEANSTREAM_ISA allows) is tried first: its
// kernel must give the scalar kernel's results on fixed pseudo-random inputs (up to f32
// summation order), else the next set down is tried, down to the scalar one, and
// ls_kernel_isa() says what failed. The rows kernel of the kind must then give, for every row,
// the one-row kernel's bits on that row: else rows are computed one at a time by the one-row
// kernel (a verify pass must equal decoding whatever the compiler made of either), and
// ls_kernel_isa() says so. Cheap (well under a millisecond) and done once per process, when the
// library is loaded (a constructor). CPU features are read here and nowhere else; the CRC-32C instruction is
// chosen by checksum.c from ls_kernels_crc32c().

#include "kernels.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(LS_ARCH_AARCH64)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

// ---- the instruction sets of this build -----------------------------------------------------------

#if defined(LS_ARCH_X86)
static bool cpu_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
static bool cpu_avx512(void) { return cpu_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"); }
static bool cpu_avx512_vnni(void) { return cpu_avx512() && __builtin_cpu_supports("avx512vnni"); }
#elif defined(LS_ARCH_AARCH64)
static bool cpu_neon(void) { return (getauxval(AT_HWCAP) & HWCAP_ASIMD) != 0; }
static bool cpu_dotprod(void) { return cpu_neon() && (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0; }
#endif

typedef struct ls_isa {
    const char *          name;      // as LEANSTREAM_ISA, ls_kernels_force and ls_kernel_isa() spell it
    bool               (* cpu_has)(void);
    const ls_kernel_set * kernels;   // its own (NULL members: the set below serves)
} ls_isa;

static const ls_isa ISAS[] = {   // each set above the one before it: a CPU that runs it runs those below
    { "scalar", NULL, &ls_kernels_scalar },
#if defined(LS_ARCH_X86)
    { "avx2", cpu_avx2, &ls_kernels_avx2 },
    { "avx512", cpu_avx512, &ls_kernels_avx512 },
    { "avx512vnni", cpu_avx512_vnni, &ls_kernels_avx512_vnni },
#elif defined(LS_ARCH_AARCH64)
    { "neon", cpu_neon, &ls_kernels_neon },
    { "neon+dotprod", cpu_dotprod, &ls_kernels_neon_dotprod },
#endif
};
enum { N_ISAS = (int) (sizeof(ISAS) / sizeof(ISAS[0])) };

static int best_isa(void) {
    int l = N_ISAS - 1;
    while (l > 0 && !ISAS[l].cpu_has()) l--;
    return l;
}

const ls_crc_hw * ls_kernels_crc32c(void) {
    const char * want = getenv("LEANSTREAM_ISA");
    if (want && strcmp(want, "scalar") == 0) return NULL;
#if defined(LS_ARCH_X86)
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2") ? &ls_crc_sse42 : NULL;
#elif defined(LS_ARCH_AARCH64)
    return (getauxval(AT_HWCAP) & HWCAP_CRC32) ? &ls_crc_armv8 : NULL;
#else
    return NULL;
#endif
}

// ---- kinds of kernels: what is chosen, checked and replaced together ------------------------------

enum { K_GU_Q4_K, K_GU_Q4_1, K_DN_Q8_0, K_DN_Q6_K, K_TILE, K_DEQUANT, K_HEAD, K_LS2, N_KINDS };
static const char * const KIND_NAME[N_KINDS] = {
    "gate/up Q4_K", "gate/up Q4_1", "down Q8_0", "down Q6_K", "prefill tile", "dequantization", "head Q6_K", "sketch LS2",
};

// kind k's kernels of src into dst
static void take(int k, ls_kernel_set * dst, const ls_kernel_set * src) {
    switch (k) {
    case K_GU_Q4_K: dst->dot2_q4_K = src->dot2_q4_K; dst->dot2_q4_K_rows = src->dot2_q4_K_rows; break;
    case K_GU_Q4_1: dst->dot2_q4_1 = src->dot2_q4_1; dst->dot2_q4_1_rows = src->dot2_q4_1_rows; break;
    case K_DN_Q8_0: dst->axpy_q8_0 = src->axpy_q8_0; dst->axpy_q8_0_rows = src->axpy_q8_0_rows; break;
    case K_DN_Q6_K: dst->axpy_q6_K = src->axpy_q6_K; dst->axpy_q6_K_rows = src->axpy_q6_K_rows; break;
    case K_TILE:    dst->axpy_tile = src->axpy_tile; break;
    case K_DEQUANT: dst->dequant_q8_0 = src->dequant_q8_0; dst->dequant_q6_K = src->dequant_q6_K; break;
    case K_HEAD:    dst->head_q6_K = src->head_q6_K; break;
    case K_LS2:     dst->ls2_dot = src->ls2_dot; break;
    }
}

static bool same_kind(int k, const ls_kernel_set * a, const ls_kernel_set * b) {
    ls_kernel_set x, y;
    memset(&x, 0, sizeof(x));
    memset(&y, 0, sizeof(y));
    take(k, &x, a);
    take(k, &y, b);
    return memcmp(&x, &y, sizeof(x)) == 0;
}

// the kernels set l runs: its own over those of the sets below it
static ls_kernel_set kernels_of(int l) {
    ls_kernel_set s = ls_kernels_scalar;
    for (int i = 1; i <= l; i++) {
        const ls_kernel_set * o = ISAS[i].kernels;
#define LS_OVER(m) if (o->m) s.m = o->m;
        LS_OVER(dot2_q4_K) LS_OVER(dot2_q4_1) LS_OVER(dot2_q4_K_rows) LS_OVER(dot2_q4_1_rows)
        LS_OVER(axpy_q8_0) LS_OVER(axpy_q6_K) LS_OVER(axpy_q8_0_rows) LS_OVER(axpy_q6_K_rows)
        LS_OVER(axpy_tile) LS_OVER(dequant_q8_0) LS_OVER(dequant_q6_K) LS_OVER(head_q6_K) LS_OVER(ls2_dot)
#undef LS_OVER
    }
    return s;
}

// ---- the fixed inputs of the start-up checks --------------------------------------------------------

static uint32_t lcg(uint32_t * s) { *s = *s * 1664525u + 1013904223u; return *s >> 8; }

static bool close_enough(const float * a, const float * b, int n) {
    float m = 0.0f, e = 0.0f;
    for (int i = 0; i < n; i++) {
        m = fmaxf(m, fabsf(a[i]));
        e = fmaxf(e, fabsf(a[i] - b[i]));
    }
    return e <= 1e-4f * m + 1e-6f;
}

static bool same_bits(const float * a, const float * b, size_t n) { return memcmp(a, b, n * sizeof(float)) == 0; }

// Q4_K rows a, b and Q8_K activations of T rows; Q4_1 rows and Q8_1 activations; Q8_0 and Q6_K
// columns (the Q6_K ones also the head's weight rows); LS2 sketch rows and their x
enum { CK_N = 512, CK_M = 11, CK_T = 5, CK_LS2 = CK_N * 5 / 16 };
static struct {
    ls_block_q4_K a[CK_N / 256], b[CK_N / 256];
    ls_block_q8_K x[CK_T][CK_N / 256];
    ls_block_q4_1 a1[CK_N / 32], b1[CK_N / 32];
    ls_block_q8_1 x1[CK_T][CK_N / 32];
    ls_block_q8_0 cols[CK_M][CK_N / 32];
    ls_block_q6_K cols6[CK_M][CK_N / 256];
    uint8_t ls2[CK_M][CK_LS2];
    int8_t x8[CK_N];
    float dx[CK_N / 32], xo[CK_N / 32];
    float h[CK_M * CK_T], tile_cols[CK_M * CK_N];
    const void * cp[CK_M], * cp6[CK_M], * xs[CK_T];
} ck;

static void check_inputs(void) {
    uint32_t s = 12345u;
    for (int i = 0; i < CK_N / 256; i++) {
        ck.a[i].d = ck.b[i].d = 0x2e66;      // f16 ~0.1
        ck.a[i].dmin = ck.b[i].dmin = 0x2a66;
        for (int j = 0; j < 12; j++) { ck.a[i].scales[j] = (uint8_t) lcg(&s); ck.b[i].scales[j] = (uint8_t) lcg(&s); }
        for (int j = 0; j < 128; j++) { ck.a[i].qs[j] = (uint8_t) lcg(&s); ck.b[i].qs[j] = (uint8_t) lcg(&s); }
        for (int t = 0; t < CK_T; t++) {
            ls_block_q8_K * x = &ck.x[t][i];
            x->d = 0.01f * (float) (t + 1);
            for (int j = 0; j < 256; j++) x->qs[j] = (int8_t) (lcg(&s) % 255 - 127);
            for (int j = 0; j < 16; j++) {
                int sum = 0;
                for (int q = 0; q < 16; q++) sum += x->qs[16 * j + q];
                x->bsums[j] = (int16_t) sum;
            }
        }
    }
    for (int i = 0; i < CK_N / 32; i++) {
        ck.a1[i] = (ls_block_q4_1) { 0x2e66, 0xae66, { 0 } };   // d ~0.1, m ~-0.1
        ck.b1[i] = (ls_block_q4_1) { 0x2a66, 0x2e66, { 0 } };
        for (int j = 0; j < 16; j++) { ck.a1[i].qs[j] = (uint8_t) lcg(&s); ck.b1[i].qs[j] = (uint8_t) lcg(&s); }
        for (int t = 0; t < CK_T; t++) {
            ck.x1[t][i].d = 0x2066;   // ~0.008
            ck.x1[t][i].s = (uint16_t) (0x3c00 + lcg(&s) % 0x800);
            for (int j = 0; j < 32; j++) ck.x1[t][i].qs[j] = (int8_t) (lcg(&s) % 255 - 127);
        }
    }
    for (int j = 0; j < CK_M; j++) {
        for (int q = 0; q < CK_N / 32; q++) {
            ck.cols[j][q].d = 0x2e66;
            for (int v = 0; v < 32; v++) ck.cols[j][q].qs[v] = (int8_t) (lcg(&s) % 255 - 127);
        }
        for (int q = 0; q < CK_N / 256; q++) {
            uint8_t * raw = (uint8_t *) &ck.cols6[j][q];
            for (int v = 0; v < LS_Q6_K_BYTES; v++) raw[v] = (uint8_t) lcg(&s);
            ck.cols6[j][q].d = (uint16_t) (0x1400 + lcg(&s) % 0x400);   // an f16 super-block scale ~0.001..0.002
        }
        for (int v = 0; v < CK_LS2; v++) ck.ls2[j][v] = (uint8_t) lcg(&s);
        for (int g = 0; g < CK_N / 32; g++) {   // the f16 group scales ~0.01..0.02
            const uint16_t d = (uint16_t) (0x2100 + lcg(&s) % 0x400);
            memcpy(ck.ls2[j] + 2 * g, &d, 2);
        }
        ck.cp[j] = ck.cols[j];
        ck.cp6[j] = ck.cols6[j];
    }
    for (int g = 0; g < CK_N / 32; g++) {   // x quantized as ls_sketch_quantize_x leaves it
        int sum = 0;
        for (int i = 0; i < 32; i++) sum += ck.x8[g * 32 + i] = (int8_t) (lcg(&s) % 255 - 127);
        ck.dx[g] = 0.001f * (float) (1 + lcg(&s) % 16);
        ck.xo[g] = 1.5f * ck.dx[g] * (float) sum;
    }
    for (int t = 0; t < CK_T; t++) ck.xs[t] = ck.x[t];
    for (int i = 0; i < CK_M * CK_T; i++) ck.h[i] = (float) (lcg(&s) % 2001) / 1000.0f - 1.0f;
    for (int i = 0; i < CK_M * CK_N; i++) ck.tile_cols[i] = (float) (lcg(&s) % 2001) / 1000.0f - 1.0f;
}

// ---- the checks --------------------------------------------------------------------------------------

static float want[CK_T * CK_N], got[CK_T * CK_N];   // (the checks run under the once or a caller's select)

// kind k of set v gives the scalar kernels' results on the fixed inputs
static bool agrees(int k, const ls_kernel_set * v) {
    const ls_kernel_set * r = &ls_kernels_scalar;
    switch (k) {
    case K_GU_Q4_K:
    case K_GU_Q4_1:
        for (int t = 0; t < CK_T; t++) {
            if (k == K_GU_Q4_K) {
                r->dot2_q4_K(CK_N, ck.a, ck.b, ck.x[t], &want[2 * t], &want[2 * t + 1], NULL, 0);
                v->dot2_q4_K(CK_N, ck.a, ck.b, ck.x[t], &got[2 * t], &got[2 * t + 1], NULL, 0);
            } else {
                r->dot2_q4_1(CK_N, ck.a1, ck.b1, ck.x1[t], &want[2 * t], &want[2 * t + 1], NULL, 0);
                v->dot2_q4_1(CK_N, ck.a1, ck.b1, ck.x1[t], &got[2 * t], &got[2 * t + 1], NULL, 0);
            }
        }
        return close_enough(want, got, 2 * CK_T);
    case K_DN_Q8_0:
    case K_DN_Q6_K: {
        const ls_axpy_fn a = k == K_DN_Q8_0 ? r->axpy_q8_0 : r->axpy_q6_K, b = k == K_DN_Q8_0 ? v->axpy_q8_0 : v->axpy_q6_K;
        const void * const * c = k == K_DN_Q8_0 ? ck.cp : ck.cp6;
        memcpy(want, ck.tile_cols, sizeof(float) * CK_N);   // a non-zero start
        memcpy(got, ck.tile_cols, sizeof(float) * CK_N);
        a(want, ck.h, c, CK_M, CK_N);
        b(got, ck.h, c, CK_M, CK_N);
        return close_enough(want, got, CK_N);
    }
    case K_TILE:
        memset(want, 0, sizeof(want));
        memset(got, 0, sizeof(got));
        r->axpy_tile(want, ck.h, ck.tile_cols, CK_M, CK_T, CK_N);
        v->axpy_tile(got, ck.h, ck.tile_cols, CK_M, CK_T, CK_N);
        return close_enough(want, got, CK_T * CK_N);
    case K_DEQUANT:
        for (int j = 0; j < CK_M; j++) {
            r->dequant_q8_0(want, ck.cols[j], CK_N);
            r->dequant_q6_K(want + CK_N, ck.cols6[j], CK_N);
            v->dequant_q8_0(got, ck.cols[j], CK_N);
            v->dequant_q6_K(got + CK_N, ck.cols6[j], CK_N);
            if (!close_enough(want, got, 2 * CK_N)) return false;
        }
        return true;
    case K_HEAD:   // (each row on its own too: a verify pass's rows are decoding's)
        for (int j = 0; j < CK_M; j++) {
            r->head_q6_K(ck.cols6[j], CK_N, ck.xs, CK_T, want + j, CK_M);
            v->head_q6_K(ck.cols6[j], CK_N, ck.xs, CK_T, got + j, CK_M);
            for (int t = 0; t < CK_T; t++) v->head_q6_K(ck.cols6[j], CK_N, ck.xs + t, 1, got + CK_T * CK_M + t * CK_M + j, 1);
        }
        return close_enough(want, got, CK_T * CK_M) && same_bits(got, got + CK_T * CK_M, CK_T * CK_M);
    case K_LS2:
        for (int j = 0; j < CK_M; j++) {
            want[j] = r->ls2_dot(ck.ls2[j], ck.x8, ck.dx, ck.xo, CK_N);
            got[j] = v->ls2_dot(ck.ls2[j], ck.x8, ck.dx, ck.xo, CK_N);
        }
        return close_enough(want, got, CK_M);
    }
    return false;
}

// kind k's rows kernel of set v gives each of CK_T rows the one-row kernel's bits (kinds without one: true)
static bool rows_exact(int k, const ls_kernel_set * v) {
    float ra[CK_T], rb[CK_T], one[2];
    switch (k) {
    case K_GU_Q4_K:
    case K_GU_Q4_1:
        if (k == K_GU_Q4_K) v->dot2_q4_K_rows(CK_N, ck.a, ck.b, ck.x, sizeof(ck.x[0]), CK_T, ra, rb, NULL, 0);
        else v->dot2_q4_1_rows(CK_N, ck.a1, ck.b1, ck.x1, sizeof(ck.x1[0]), CK_T, ra, rb, NULL, 0);
        for (int t = 0; t < CK_T; t++) {
            if (k == K_GU_Q4_K) v->dot2_q4_K(CK_N, ck.a, ck.b, ck.x[t], &one[0], &one[1], NULL, 0);
            else v->dot2_q4_1(CK_N, ck.a1, ck.b1, ck.x1[t], &one[0], &one[1], NULL, 0);
            if (!same_bits(one, (float[2]) { ra[t], rb[t] }, 2)) return false;
        }
        return true;
    case K_DN_Q8_0:
    case K_DN_Q6_K: {
        const void * const * c = k == K_DN_Q8_0 ? ck.cp : ck.cp6;
        memcpy(got, ck.tile_cols, sizeof(got));   // a non-zero start
        (k == K_DN_Q8_0 ? v->axpy_q8_0_rows : v->axpy_q6_K_rows)(got, ck.h, c, CK_M, CK_T, CK_N);
        for (int t = 0; t < CK_T; t++) {
            float ht[CK_M];
            for (int j = 0; j < CK_M; j++) ht[j] = ck.h[j * CK_T + t];
            memcpy(want, ck.tile_cols + t * CK_N, sizeof(float) * CK_N);
            (k == K_DN_Q8_0 ? v->axpy_q8_0 : v->axpy_q6_K)(want, ht, c, CK_M, CK_N);
            if (!same_bits(want, got + t * CK_N, CK_N)) return false;
        }
        return true;
    }
    }
    return true;
}

// ---- the choice ----------------------------------------------------------------------------------------

// the kernels in use: chosen when the library is loaded (the scalar ones until then), so that every
// entry point (the sketch and the head kernels too, with no engine created) runs the CPU's best
static ls_kernel_set active;
__attribute__((constructor)) static void kernels_at_load(void) { active = ls_kernels_scalar; ls_kernels_select(); }

static char isa_desc[512] = "scalar";

static void append(char * buf, size_t cap, const char * fmt, ...) __attribute__((format(printf, 3, 4)));
static void append(char * buf, size_t cap, const char * fmt, ...) {
    const size_t len = strlen(buf);
    if (len + 1 >= cap) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + len, cap - len, fmt, ap);
    va_end(ap);
}

// Set isa (and those below it) in use, kind by kind as the module doc says; note: why it is not
// the set asked for ("" if it is).
static void choose(int isa, const char * note) {
    static bool inputs_ready = false;
    if (!inputs_ready) { check_inputs(); inputs_ready = true; }
    ls_kernel_set sets[N_ISAS], use = ls_kernels_scalar;
    for (int l = 0; l < N_ISAS; l++) sets[l] = kernels_of(l);
    char notes[400] = "";
    if (note[0]) append(notes, sizeof(notes), "; %s", note);
    for (int k = 0; k < N_KINDS; k++) {
        for (int l = isa; l > 0; l--) {
            if (same_kind(k, &sets[l], &sets[l - 1])) continue;   // none of its own: the set below's
            if (agrees(k, &sets[l])) { take(k, &use, &sets[l]); break; }
            append(notes, sizeof(notes), "; %s: the %s kernel failed its start-up check", KIND_NAME[k], ISAS[l].name);
        }
        if (!rows_exact(k, &use)) {
            if (k == K_GU_Q4_K) use.dot2_q4_K_rows = NULL;
            if (k == K_GU_Q4_1) use.dot2_q4_1_rows = NULL;
            if (k == K_DN_Q8_0) use.axpy_q8_0_rows = NULL;
            if (k == K_DN_Q6_K) use.axpy_q6_K_rows = NULL;
            append(notes, sizeof(notes), "; %s: the rows kernel failed its start-up check: rows one at a time", KIND_NAME[k]);
        }
    }
    active = use;
    if (notes[0]) snprintf(isa_desc, sizeof(isa_desc), "%s (%s)", ISAS[isa].name, notes + 2);
    else snprintf(isa_desc, sizeof(isa_desc), "%s", ISAS[isa].name);
}

static int isa_named(const char * name) {
    for (int l = 0; l < N_ISAS; l++)
        if (strcmp(ISAS[l].name, name) == 0) return l;
    return -1;
}

void ls_kernels_select(void) {
    const char * want = getenv("LEANSTREAM_ISA");
    const int best = best_isa();
    if (!want || !want[0]) { choose(best, ""); return; }
    const int l = isa_named(want);
    char note[200] = "";
    if (l < 0) {
        append(note, sizeof(note), "LEANSTREAM_ISA=%.40s is none of this build's:", want);
        for (int i = 0; i < N_ISAS; i++) append(note, sizeof(note), " %s", ISAS[i].name);
    } else if (l > best) {
        append(note, sizeof(note), "LEANSTREAM_ISA=%s: this CPU lacks it", want);
    }
    choose(l < 0 || l > best ? best : l, note);
}

int32_t ls_kernels_force(const char * isa) {
    const int best = best_isa();
    const int l = isa ? isa_named(isa) : best;
    if (l < 0 || l > best) return 0;
    choose(l, "");
    return 1;
}

const char * ls_kernel_isa(void) { return isa_desc; }

// ---- the entry points ------------------------------------------------------------------------------

void ls_dot2_q4_K(int64_t n, const void * a, const void * b, const void * x, float * ra, float * rb,
                  const uint8_t * pf, int32_t pf_lines) {
    active.dot2_q4_K(n, a, b, x, ra, rb, pf, pf_lines);
}

void ls_dot2_q4_1(int64_t n, const void * a, const void * b, const void * x, float * ra, float * rb,
                  const uint8_t * pf, int32_t pf_lines) {
    active.dot2_q4_1(n, a, b, x, ra, rb, pf, pf_lines);
}

// the rows kernels, or (their start-up check failed) the one-row kernels row by row
void ls_dot2_q4_K_rows(int64_t n, const void * a, const void * b, const void * x, size_t x_stride, int32_t nr,
                       float * ra, float * rb, const uint8_t * pf, int32_t pf_lines) {
    if (active.dot2_q4_K_rows) active.dot2_q4_K_rows(n, a, b, x, x_stride, nr, ra, rb, pf, pf_lines);
    else ls_dot2_rows_by_row(active.dot2_q4_K, n, a, b, x, x_stride, nr, ra, rb, pf, pf_lines);
}

void ls_dot2_q4_1_rows(int64_t n, const void * a, const void * b, const void * x, size_t x_stride, int32_t nr,
                       float * ra, float * rb, const uint8_t * pf, int32_t pf_lines) {
    if (active.dot2_q4_1_rows) active.dot2_q4_1_rows(n, a, b, x, x_stride, nr, ra, rb, pf, pf_lines);
    else ls_dot2_rows_by_row(active.dot2_q4_1, n, a, b, x, x_stride, nr, ra, rb, pf, pf_lines);
}

void ls_axpy_q8_0_multi(float * acc, const float * h, const void * const * cols, int32_t m, int64_t n) {
    active.axpy_q8_0(acc, h, cols, m, n);
}

void ls_axpy_q8_0_rows(float * acc, const float * h, const void * const * cols, int32_t m, int64_t T, int64_t n) {
    if (active.axpy_q8_0_rows) active.axpy_q8_0_rows(acc, h, cols, m, T, n);
    else ls_axpy_rows_by_row(active.axpy_q8_0, acc, h, cols, m, T, n);
}

void ls_axpy_q6_K_multi(float * acc, const float * h, const void * const * cols, int32_t m, int64_t n) {
    active.axpy_q6_K(acc, h, cols, m, n);
}

void ls_axpy_q6_K_rows(float * acc, const float * h, const void * const * cols, int32_t m, int64_t T, int64_t n) {
    if (active.axpy_q6_K_rows) active.axpy_q6_K_rows(acc, h, cols, m, T, n);
    else ls_axpy_rows_by_row(active.axpy_q6_K, acc, h, cols, m, T, n);
}

void ls_axpy_tile(float * acc, const float * h, const float * cols, int32_t n_staged, int64_t T, int64_t n_embd) {
    active.axpy_tile(acc, h, cols, n_staged, T, n_embd);
}

void ls_dequant_q8_0(float * out, const void * col, int64_t n) { active.dequant_q8_0(out, col, n); }
void ls_dequant_q6_K(float * out, const void * col, int64_t n) { active.dequant_q6_K(out, col, n); }

// rows in groups of LS_EXACT_ROWS (the kernels' bound): each row's result does not depend on the others
void ls_head_q6_K(const void * w, int64_t n, const void * const * x, int64_t T, float * out, size_t out_stride) {
    for (int64_t t0 = 0; t0 < T; t0 += LS_EXACT_ROWS) {
        const int64_t rows = T - t0 < LS_EXACT_ROWS ? T - t0 : LS_EXACT_ROWS;
        active.head_q6_K(w, n, x + t0, rows, out + (size_t) t0 * out_stride, out_stride);
    }
}

float ls_ls2_dot(const uint8_t * row, const int8_t * x8, const float * dx, const float * xo, int64_t n) {
    return active.ls2_dot(row, x8, dx, xo, n);
}
