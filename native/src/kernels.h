// kernels.h — the kernels' variants, for the files that define them and the one that chooses:
//   kernels.c        the scalar C of every kernel: the reference, and the fallback on any CPU
//   kernels_x86.c    AVX2 and AVX-512 (x86-64 builds only)
//   kernels_neon.c   NEON, and with kernels_dotprod_neon.c the SDOT variants (aarch64 builds only)
//   dispatch.c       which variant runs, per kernel, on this CPU; the start-up checks; the entry
//                    points the library calls (leanstream.h: ls_dot2_q4_K, ...)
// (docs/design.md §13)

#ifndef LS_KERNELS_H
#define LS_KERNELS_H

#include "internal.h"

#include <math.h>

// ggml's block layouts (ggml-common.h) that the kernels read; ls_block_q8_0 is in internal.h
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } ls_block_q4_K;  // 256 values
typedef struct { float d; int8_t qs[256]; int16_t bsums[16]; } ls_block_q8_K;             // 256 values
typedef struct { uint16_t d, m; uint8_t qs[16]; } ls_block_q4_1;                        // 32 values
typedef struct { uint16_t d, s; int8_t qs[32]; } ls_block_q8_1;                         // 32 values
typedef struct { uint8_t ql[128], qh[64]; int8_t sc[16]; uint16_t d; } ls_block_q6_K;    // 256 values (LS_Q6_K_BYTES)

// The kernels, as the entry points of the same names take them (leanstream.h documents each).
typedef void (*ls_dot2_fn)(int64_t n, const void * a, const void * b, const void * x, float * ra, float * rb,
                           const uint8_t * pf, int pf_lines);
typedef void (*ls_dot2_rows_fn)(int64_t n, const void * a, const void * b, const void * x, size_t x_stride, int nr,
                                float * ra, float * rb, const uint8_t * pf, int pf_lines);
typedef void (*ls_axpy_fn)(float * acc, const float * h, const void * const * cols, int m, int64_t n);
typedef void (*ls_axpy_rows_fn)(float * acc, const float * h, const void * const * cols, int m, int64_t T, int64_t n);
typedef void (*ls_tile_fn)(float * acc, const float * h, const float * cols, int n_staged, int64_t T, int64_t n_embd);
typedef void (*ls_dequant_fn)(float * out, const void * col, int64_t n);
typedef void (*ls_head_fn)(const void * w, int64_t n, const void * const * x, int64_t T, float * out, size_t out_stride);
typedef float (*ls_ls2_dot_fn)(const uint8_t * row, const int8_t * x8, const float * dx, const float * xo, int64_t n);

// The kinds of kernels, one line each: what dispatch.c chooses, checks against the scalar kernel
// and replaces together. Everything else of a kind is derived from its line (its members of
// ls_kernel_set, its id and name, its selection, its checks and its entry points in dispatch.c);
// what a new kind adds besides is its bodies (kernels.c, and per instruction set the members of
// its ls_kernel_set) and its entry points' declarations in leanstream.h (the ABI).
//   X(id, name, fn, shape, in)
//   id     K_<id> in dispatch.c
//   name   as ls_kernel_isa() names a kind whose check failed
//   fn     its member of ls_kernel_set (fn_rows too where the shape has rows); the entry points
//          are ls_<fn> (AXPY: ls_<fn>_multi) and ls_<fn>_rows
//   shape  its signature, members, checks and entry points: LS_SHAPE_<shape> below, dispatch.c's
//          agrees_<shape>, ROWS_EXACT_<shape> and ENTRY_<shape> (a new shape writes these four)
//   in     the fixed inputs of its start-up checks (dispatch.c's ck), as the shape's checks take them
#define LS_KERNEL_KINDS(X)                                                                              \
    X(GU_Q4_K,    "gate/up Q4_K",        dot2_q4_K,    DOT2,    (ck.a, ck.b, ck.x, sizeof(ck.x[0])))     \
    X(GU_Q4_1,    "gate/up Q4_1",        dot2_q4_1,    DOT2,    (ck.a1, ck.b1, ck.x1, sizeof(ck.x1[0]))) \
    X(DN_Q8_0,    "down Q8_0",           axpy_q8_0,    AXPY,    (ck.cp))                                 \
    X(DN_Q6_K,    "down Q6_K",           axpy_q6_K,    AXPY,    (ck.cp6))                                \
    X(TILE,       "prefill tile",        axpy_tile,    TILE,    (ck.tile_cols))                          \
    X(DEQ_Q8_0,   "dequantization Q8_0", dequant_q8_0, DEQUANT, (ck.cp))                                 \
    X(DEQ_Q6_K,   "dequantization Q6_K", dequant_q6_K, DEQUANT, (ck.cp6))                                \
    X(HEAD_Q6_K,  "head Q6_K",           head_q6_K,    HEAD,    (ck.cp6, ck.xs))                         \
    X(LS2,        "sketch LS2",          ls2_dot,      LS2,     (ck.ls2[0], ck.x8, ck.dx, ck.xo))

// The shapes: a kind's members of ls_kernel_set, M(role, type, member) each. Role one: the kernel;
// rows: the same for several token rows, each row bit for bit the one-row kernel's (dispatch.c
// drops it, rows then one at a time, where its check finds otherwise).
#define LS_SHAPE_DOT2(M, fn)    M(one, ls_dot2_fn, fn) M(rows, ls_dot2_rows_fn, fn##_rows)   // gate and up of a neuron
#define LS_SHAPE_AXPY(M, fn)    M(one, ls_axpy_fn, fn) M(rows, ls_axpy_rows_fn, fn##_rows)   // down columns added in place
#define LS_SHAPE_TILE(M, fn)    M(one, ls_tile_fn, fn)       // f32 columns of a prefill tile
#define LS_SHAPE_DEQUANT(M, fn) M(one, ls_dequant_fn, fn)    // a down column to f32
#define LS_SHAPE_HEAD(M, fn)    M(one, ls_head_fn, fn)       // the LM head's rows (head.c)
#define LS_SHAPE_LS2(M, fn)     M(one, ls_ls2_dot_fn, fn)    // a sketch row . x (sketch.c)

// One instruction set's kernels. NULL: none of its own (the set below it serves: AVX-512 takes
// AVX2's Q4_1 kernels, NEON with the dot product takes NEON's down kernels).
#define LS_SET_MEMBER(role, type, member) type member;
#define LS_SET_MEMBERS(id, name, fn, shape, in) LS_SHAPE_##shape(LS_SET_MEMBER, fn)
typedef struct ls_kernel_set {
    LS_KERNEL_KINDS(LS_SET_MEMBERS)
} ls_kernel_set;
#undef LS_SET_MEMBERS
#undef LS_SET_MEMBER

extern const ls_kernel_set ls_kernels_scalar;                     // kernels.c
extern const ls_kernel_set ls_kernels_avx2, ls_kernels_avx512, ls_kernels_avx512_vnni; // kernels_x86.c
extern const ls_kernel_set ls_kernels_neon, ls_kernels_neon_dotprod; // kernels_neon.c, kernels_dotprod_neon.c

// acc[t][c] += sum_j h[j][t] * cols[j][c] for t in [t0, T) over every c, and for t < t0 over c >= c0:
// the scalar tile kernel (t0 = c0 = 0), and what a register-blocked one leaves. Inline, so that each
// file compiles it for its instruction set (vectorized there); the fused adds are those of the
// SIMD blocks, so a row's bits do not depend on whether a block or this loop computed it.
static inline void ls_axpy_tile_rest(float * restrict acc, const float * restrict h, const float * restrict cols,
                                     int n_staged, int64_t T, int64_t n_embd, int64_t t0, int64_t c0) {
    for (int64_t t = 0; t < T; t++) {
        const int64_t from = t < t0 ? c0 : 0;
        float * restrict at = acc + (size_t) t * n_embd;
        for (int j = 0; j < n_staged; j++) {
            const float hv = h[(size_t) j * T + t];
            const float * restrict cj = cols + (size_t) j * n_embd;
            for (int64_t c = from; c < n_embd; c++) at[c] = fmaf(hv, cj[c], at[c]);
        }
    }
}

// The down kernels take their m columns 8 at a time: group j0's columns, and how many of the next
// group's to prefetch while it computes
static inline int ls_group_cols(int m, int j0) { return m - j0 < 8 ? m - j0 : 8; }
static inline int ls_group_next(int m, int j0) { return m - j0 - 8 < 0 ? 0 : m - j0 - 8 < 8 ? m - j0 - 8 : 8; }

// kernels.c, for the SIMD variants and the dispatch: a rows kernel made of a one-row kernel, row
// by row (each row its bits, trivially)
void ls_axpy_rows_by_row(ls_axpy_fn one, float * acc, const float * h, const void * const * cols, int m, int64_t T, int64_t n);
void ls_dot2_rows_by_row(ls_dot2_fn one, int64_t n, const void * a, const void * b, const void * x, size_t x_stride, int nr,
                         float * ra, float * rb, const uint8_t * pf, int pf_lines);

// Gate/up rows kernels take R token rows (a constant 1 .. LS_GU_ROWS at each use) per pass over
// the weights: nr rows in as few passes as groups of LS_GU_ROWS allow, the groups as even as they
// can be (5 rows: 3 + 2, not 4 + 1: a pass of one row is slower per row); the prefetch stream
// with the first. body(R, n, a, b, x, x_stride, ra, rb, pf, pf_lines) is an ISA's kernel.
#define LS_GU_ROWS 4
#define LS_GU_ROWS_DISPATCH(body, n, a, b, x, x_stride, nr, ra, rb, pf, pf_lines) do {                     \
        for (int t_ = 0; t_ < (nr); ) {                                                                     \
            const int left_ = (nr) - t_, passes_ = (left_ + LS_GU_ROWS - 1) / LS_GU_ROWS;                  \
            const int g_ = (left_ + passes_ - 1) / passes_;                                                 \
            const uint8_t * xt_ = (const uint8_t *) (x) + (size_t) t_ * (x_stride);                         \
            const uint8_t * pt_ = t_ == 0 ? (pf) : NULL;                                                    \
            const int lt_ = t_ == 0 ? (pf_lines) : 0;                                                      \
            switch (g_) {                                                                                   \
            case 4: body(4, n, a, b, xt_, x_stride, (ra) + t_, (rb) + t_, pt_, lt_); break;                 \
            case 3: body(3, n, a, b, xt_, x_stride, (ra) + t_, (rb) + t_, pt_, lt_); break;                 \
            case 2: body(2, n, a, b, xt_, x_stride, (ra) + t_, (rb) + t_, pt_, lt_); break;                 \
            default: body(1, n, a, b, xt_, x_stride, (ra) + t_, (rb) + t_, pt_, lt_); break;                \
            }                                                                                               \
            t_ += g_;                                                                                       \
        }                                                                                                   \
    } while (0)

#endif // LS_KERNELS_H
