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

// ---- kinds of kernels: what is chosen, checked and replaced together (kernels.h LS_KERNEL_KINDS) --

#define KIND_ID(id, name, fn, shape, in) K_##id,
#define KIND_NAME_OF(id, name, fn, shape, in) [K_##id] = name,
enum { LS_KERNEL_KINDS(KIND_ID) N_KINDS };
static const char * const KIND_NAME[N_KINDS] = { LS_KERNEL_KINDS(KIND_NAME_OF) };
#undef KIND_NAME_OF
#undef KIND_ID

// kind k's kernels of src into dst
static void take(int k, ls_kernel_set * dst, const ls_kernel_set * src) {
#define TAKE(role, type, m) dst->m = src->m;
#define TAKE_KIND(id, name, fn, shape, in) case K_##id: LS_SHAPE_##shape(TAKE, fn) break;
    switch (k) { LS_KERNEL_KINDS(TAKE_KIND) }
#undef TAKE_KIND
#undef TAKE
}

// kind k's rows kernel in s dropped: its rows one at a time by the one-row kernel (the entry points)
static void drop_rows(int k, ls_kernel_set * s) {
#define DROP_one(m)
#define DROP_rows(m) s->m = NULL;
#define DROP(role, type, m) DROP_##role(m)
#define DROP_KIND(id, name, fn, shape, in) case K_##id: LS_SHAPE_##shape(DROP, fn) break;
    switch (k) { LS_KERNEL_KINDS(DROP_KIND) }
#undef DROP_KIND
#undef DROP
#undef DROP_rows
#undef DROP_one
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
#define OVER(role, type, m) if (o->m) s.m = o->m;
#define OVER_KIND(id, name, fn, shape, in) LS_SHAPE_##shape(OVER, fn)
        LS_KERNEL_KINDS(OVER_KIND)
#undef OVER_KIND
#undef OVER
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
// columns (the Q6_K ones also the head's weight rows); LS2 sketch rows and their x. The kinds'
// lines (kernels.h LS_KERNEL_KINDS) name theirs.
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

// ---- the checks, per shape: kind k of set v against the scalar kernel, on k's inputs ---------------------

static float want[CK_T * CK_N], got[CK_T * CK_N];   // (the checks run under the once or a caller's select)

// gate and up of CK_T rows of x (x_stride bytes apart), one at a time
static bool agrees_DOT2(ls_dot2_fn r, ls_dot2_fn v, const void * a, const void * b, const void * x, size_t x_stride) {
    for (int t = 0; t < CK_T; t++) {
        const uint8_t * xt = (const uint8_t *) x + (size_t) t * x_stride;
        r(CK_N, a, b, xt, &want[2 * t], &want[2 * t + 1], NULL, 0);
        v(CK_N, a, b, xt, &got[2 * t], &got[2 * t + 1], NULL, 0);
    }
    return close_enough(want, got, 2 * CK_T);
}

static bool agrees_AXPY(ls_axpy_fn r, ls_axpy_fn v, const void * const * cols) {
    memcpy(want, ck.tile_cols, sizeof(float) * CK_N);   // a non-zero start
    memcpy(got, ck.tile_cols, sizeof(float) * CK_N);
    r(want, ck.h, cols, CK_M, CK_N);
    v(got, ck.h, cols, CK_M, CK_N);
    return close_enough(want, got, CK_N);
}

static bool agrees_TILE(ls_tile_fn r, ls_tile_fn v, const float * cols) {
    memset(want, 0, sizeof(want));
    memset(got, 0, sizeof(got));
    r(want, ck.h, cols, CK_M, CK_T, CK_N);
    v(got, ck.h, cols, CK_M, CK_T, CK_N);
    return close_enough(want, got, CK_T * CK_N);
}

static bool agrees_DEQUANT(ls_dequant_fn r, ls_dequant_fn v, const void * const * cols) {
    for (int j = 0; j < CK_M; j++) {
        r(want, cols[j], CK_N);
        v(got, cols[j], CK_N);
        if (!close_enough(want, got, CK_N)) return false;
    }
    return true;
}

// (each row on its own too: a verify pass's rows are decoding's)
static bool agrees_HEAD(ls_head_fn r, ls_head_fn v, const void * const * w, const void * const * xs) {
    for (int j = 0; j < CK_M; j++) {
        r(w[j], CK_N, xs, CK_T, want + j, CK_M);
        v(w[j], CK_N, xs, CK_T, got + j, CK_M);
        for (int t = 0; t < CK_T; t++) v(w[j], CK_N, xs + t, 1, got + CK_T * CK_M + t * CK_M + j, 1);
    }
    return close_enough(want, got, CK_T * CK_M) && same_bits(got, got + CK_T * CK_M, CK_T * CK_M);
}

// rows [CK_M][CK_LS2]
static bool agrees_LS2(ls_ls2_dot_fn r, ls_ls2_dot_fn v, const uint8_t * rows, const int8_t * x8, const float * dx,
                       const float * xo) {
    for (int j = 0; j < CK_M; j++) {
        want[j] = r(rows + j * CK_LS2, x8, dx, xo, CK_N);
        got[j] = v(rows + j * CK_LS2, x8, dx, xo, CK_N);
    }
    return close_enough(want, got, CK_M);
}

// the rows kernel gives each of CK_T rows the one-row kernel's bits
static bool rows_exact_DOT2(ls_dot2_fn one, ls_dot2_rows_fn rows, const void * a, const void * b, const void * x,
                            size_t x_stride) {
    float ra[CK_T], rb[CK_T], o[2];
    rows(CK_N, a, b, x, x_stride, CK_T, ra, rb, NULL, 0);
    for (int t = 0; t < CK_T; t++) {
        one(CK_N, a, b, (const uint8_t *) x + (size_t) t * x_stride, &o[0], &o[1], NULL, 0);
        if (!same_bits(o, (float[2]) { ra[t], rb[t] }, 2)) return false;
    }
    return true;
}

static bool rows_exact_AXPY(ls_axpy_fn one, ls_axpy_rows_fn rows, const void * const * cols) {
    memcpy(got, ck.tile_cols, sizeof(got));   // a non-zero start
    rows(got, ck.h, cols, CK_M, CK_T, CK_N);
    for (int t = 0; t < CK_T; t++) {
        float ht[CK_M];
        for (int j = 0; j < CK_M; j++) ht[j] = ck.h[j * CK_T + t];
        memcpy(want, ck.tile_cols + t * CK_N, sizeof(float) * CK_N);
        one(want, ht, cols, CK_M, CK_N);
        if (!same_bits(want, got + t * CK_N, CK_N)) return false;
    }
    return true;
}

// a shape's rows check as a kind's line calls it (shapes without a rows kernel: true)
#define ARGS(...) __VA_ARGS__   // a kind's inputs (its line's `in`) as arguments
#define ROWS_EXACT_DOT2(v, fn, in)    rows_exact_DOT2(v->fn, v->fn##_rows, ARGS in)
#define ROWS_EXACT_AXPY(v, fn, in)    rows_exact_AXPY(v->fn, v->fn##_rows, ARGS in)
#define ROWS_EXACT_TILE(v, fn, in)    true
#define ROWS_EXACT_DEQUANT(v, fn, in) true
#define ROWS_EXACT_HEAD(v, fn, in)    true
#define ROWS_EXACT_LS2(v, fn, in)     true

// kind k of set v gives the scalar kernels' results on the fixed inputs
static bool agrees(int k, const ls_kernel_set * v) {
    const ls_kernel_set * r = &ls_kernels_scalar;
#define AGREES_KIND(id, name, fn, shape, in) case K_##id: return agrees_##shape(r->fn, v->fn, ARGS in);
    switch (k) { LS_KERNEL_KINDS(AGREES_KIND) }
#undef AGREES_KIND
    return false;
}

// kind k's rows kernel of set v gives each row the one-row kernel's bits (kinds without one: true)
static bool rows_exact(int k, const ls_kernel_set * v) {
#define ROWS_EXACT_KIND(id, name, fn, shape, in) case K_##id: return ROWS_EXACT_##shape(v, fn, in);
    switch (k) { LS_KERNEL_KINDS(ROWS_EXACT_KIND) }
#undef ROWS_EXACT_KIND
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
            drop_rows(k, &use);
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
// Per kind, those of its shape (leanstream.h declares each): ls_<fn> (AXPY: ls_<fn>_multi) and, for
// a shape with rows, ls_<fn>_rows: the rows kernel, or (its start-up check failed) the one-row
// kernel row by row.

#define ENTRY_DOT2(fn)                                                                                        \
    void ls_##fn(int64_t n, const void * a, const void * b, const void * x, float * ra, float * rb,            \
                 const uint8_t * pf, int32_t pf_lines) {                                                       \
        active.fn(n, a, b, x, ra, rb, pf, pf_lines);                                                          \
    }                                                                                                         \
    void ls_##fn##_rows(int64_t n, const void * a, const void * b, const void * x, size_t x_stride, int32_t nr, \
                        float * ra, float * rb, const uint8_t * pf, int32_t pf_lines) {                         \
        if (active.fn##_rows) active.fn##_rows(n, a, b, x, x_stride, nr, ra, rb, pf, pf_lines);                \
        else ls_dot2_rows_by_row(active.fn, n, a, b, x, x_stride, nr, ra, rb, pf, pf_lines);                   \
    }

#define ENTRY_AXPY(fn)                                                                                        \
    void ls_##fn##_multi(float * acc, const float * h, const void * const * cols, int32_t m, int64_t n) {     \
        active.fn(acc, h, cols, m, n);                                                                        \
    }                                                                                                         \
    void ls_##fn##_rows(float * acc, const float * h, const void * const * cols, int32_t m, int64_t T, int64_t n) { \
        if (active.fn##_rows) active.fn##_rows(acc, h, cols, m, T, n);                                        \
        else ls_axpy_rows_by_row(active.fn, acc, h, cols, m, T, n);                                           \
    }

#define ENTRY_TILE(fn)                                                                                        \
    void ls_##fn(float * acc, const float * h, const float * cols, int32_t n_staged, int64_t T, int64_t n_embd) { \
        active.fn(acc, h, cols, n_staged, T, n_embd);                                                         \
    }

#define ENTRY_DEQUANT(fn) void ls_##fn(float * out, const void * col, int64_t n) { active.fn(out, col, n); }

// rows in groups of LS_EXACT_ROWS (the kernels' bound): each row's result does not depend on the others
#define ENTRY_HEAD(fn)                                                                                        \
    void ls_##fn(const void * w, int64_t n, const void * const * x, int64_t T, float * out, size_t out_stride) { \
        for (int64_t t0 = 0; t0 < T; t0 += LS_EXACT_ROWS) {                                                   \
            const int64_t rows = T - t0 < LS_EXACT_ROWS ? T - t0 : LS_EXACT_ROWS;                             \
            active.fn(w, n, x + t0, rows, out + (size_t) t0 * out_stride, out_stride);                        \
        }                                                                                                     \
    }

#define ENTRY_LS2(fn)                                                                                         \
    float ls_##fn(const uint8_t * row, const int8_t * x8, const float * dx, const float * xo, int64_t n) {    \
        return active.fn(row, x8, dx, xo, n);                                                                 \
    }

#define ENTRY_KIND(id, name, fn, shape, in) ENTRY_##shape(fn)
LS_KERNEL_KINDS(ENTRY_KIND)
#undef ENTRY_KIND
