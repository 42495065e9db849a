// op.c — the streamed FFN op: one ggml_custom_4d node per layer, run by ggml's CPU threads.
//
//   y[t] = sum over computed neurons n of act(gate_n . x[t]) * (up_n . x[t]) * down_n
//
// SwiGLU is a sum over neurons (paper §3.2.2), so blocks can be computed in any order the moment
// they arrive; the plan is cut into shares (contiguous parts), each summed into its own partial
// output in plan order and the partials added in share order, so the floating-point sums — and
// the output — do not depend on I/O timing. Up to LS_EXACT_ROWS tokens the shares are a fixed
// LS_ROW_SHARES whatever the thread count: llama.cpp decodes one token with n_threads and a
// verify pass with n_threads_batch (llama-cpp-python's defaults: half the cores and all of them),
// and both must give a token the same output. Each thread takes a contiguous run of shares.
// gate/up dot products use ggml's own kernels: x is quantized once to the weight type's
// vec_dot_type (from_float) and each row is dotted with vec_dot, exactly the path ggml_mul_mat
// takes, so rounding matches stock llama.cpp.

#include "internal.h"

#include "ggml.h"
#include "ggml-cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

// neurons whose h values and dequantized down columns are staged together (cache tile)
#define LS_TILE 32
#define LS_TOKEN_CHUNK 64    // prefill tokens per pass over a thread's blocks
#define LS_TILE_MAX 256 // k above this is refused at load
// Batches up to LS_EXACT_ROWS tokens (speculative decoding's verify passes) compute every row with
// the one-token kernels, so that each row's output is bit for bit what decoding that token alone
// gives: a draft's verification then agrees with plain decoding even at a near-tie. Larger
// batches (prefill) take the batched kernels.
static inline int64_t tile_of(int64_t k) { return k > LS_TILE ? k : LS_TILE; }
// The shares of a batch of up to LS_EXACT_ROWS tokens: 1, 2, 3, 4, 6 and 12 threads take equal
// numbers of them (more threads than shares leave the rest idle in the sums).
#define LS_ROW_SHARES 12

// Thread 0, before the first barrier: scratch for this op's shape.
static ls_status grow_scratch(ls_engine * e, ls_layer * L, int64_t n_tokens, int nth) {
    ls_plan * P = &e->plan;
    const ls_layer_info * in = &L->info;
    P->L = L;
    P->n_tokens = n_tokens;
    P->nth = nth;
    P->n_shares = n_tokens <= LS_EXACT_ROWS ? LS_ROW_SHARES : nth;
    const struct ggml_type_traits_cpu * tg = ls_cpu_traits(in->gate_type);
    const struct ggml_type_traits_cpu * tu = ls_cpu_traits(in->up_type);
    size_t xq = (size_t) n_tokens * ggml_row_size(tg->vec_dot_type, in->n_embd);
    if (tu->vec_dot_type != tg->vec_dot_type) xq += (size_t) n_tokens * ggml_row_size(tu->vec_dot_type, in->n_embd);
    P->buf.work_per_thread = (size_t) tile_of(in->neurons_per_block) * ((size_t) n_tokens + (size_t) in->n_embd) + 2 * (size_t) n_tokens + 64;
    if (!ls_grow((void **) &P->buf.xq, &P->buf.xq_cap, xq, 1) ||
        !ls_grow((void **) &P->buf.acc, &P->buf.acc_cap, (size_t) P->n_shares * (size_t) n_tokens * (size_t) in->n_embd, sizeof(float)) ||
        !ls_grow((void **) &P->buf.work, &P->buf.work_cap, (size_t) nth * P->buf.work_per_thread, sizeof(float))) {
        return LS_ERR_NOMEM;
    }
    return LS_OK;
}

// Quantize this thread's share of the input rows to the vec_dot types of gate and up.
static void quantize_input(const ls_plan * P, const float * x, size_t x_row_stride, int ith, int nth) {
    const ls_layer_info * in = &P->L->info;
    const enum ggml_type vg = ls_cpu_traits(in->gate_type)->vec_dot_type;
    const enum ggml_type vu = ls_cpu_traits(in->up_type)->vec_dot_type;
    const size_t rg = ggml_row_size(vg, in->n_embd), ru = ggml_row_size(vu, in->n_embd);
    for (int64_t t = ith; t < P->n_tokens; t += nth) {
        const float * xt = (const float *) ((const uint8_t *) x + (size_t) t * x_row_stride);
        ls_cpu_traits(vg)->from_float(xt, P->buf.xq + (size_t) t * rg, in->n_embd);
        if (vu != vg) {
            ls_cpu_traits(vu)->from_float(xt, P->buf.xq + (size_t) P->n_tokens * rg + (size_t) t * ru, in->n_embd);
        }
    }
}

static bool wait_ready(ls_layer * L, int32_t b, uint64_t * stall_ns) {
    int32_t s = atomic_load_explicit(&L->f.state[b], memory_order_acquire);
    if (s == LS_BLK_READY) return true;
    const uint64_t t0 = ls_now_ns();
    ls_wait_while(&L->f.state[b], LS_BLK_LOADING, &L->e->io.sleepers);
    *stall_ns += ls_now_ns() - t0;
    return atomic_load_explicit(&L->f.state[b], memory_order_acquire) == LS_BLK_READY;
}

// Block b's bytes once its read landed and its checksum was checked (first use after a read), or
// NULL: a failed read or a corrupt block, reported with its cause when it happened; every op that
// needs the block reports it again (with an unlimited budget it stays failed).
static const uint8_t * ready_block(ls_engine * e, ls_layer * L, int32_t b, uint64_t * stall_ns) {
    if (!wait_ready(L, b, stall_ns)) {
        ls_engine_record_error(e, LS_ERR_IO, "%s: layer %d block %d could not be loaded (see the first error)",
                               L->f.path, L->il, b);
        return NULL;
    }
    const uint8_t * blk = ls_cache_slot_ptr(&e->cache, L->f.slot[b]);
    if (!atomic_load_explicit(&L->f.verified[b], memory_order_relaxed) && !ls_io_check(&e->io, &L->f, b, blk)) return NULL;
    return blk;
}

// Q8_0 and Q6_K columns are added in place by their own kernels (few tokens); the others are
// staged as f32 first
static inline bool adds_in_place(int32_t down_type) { return down_type == GGML_TYPE_Q8_0 || down_type == GGML_TYPE_Q6_K; }

static inline void axpy_in_place(int32_t down_type, float * acc, const float * h, const uint8_t * const * cols, int m, int64_t n) {
    if (down_type == GGML_TYPE_Q6_K) ls_axpy_q6_K_multi(acc, h, (const void * const *) cols, m, n);
    else ls_axpy_q8_0_multi(acc, h, (const void * const *) cols, m, n);
}

static void flush(float * acc, const float * h, const float * cols, const uint8_t * const * qcols, int32_t down_type,
                  int n_staged, int64_t T, int64_t n_embd, bool direct) {
    if (n_staged == 0) return;
    if (!direct) {
        ls_axpy_tile(acc, h, cols, n_staged, T, n_embd);
        return;
    }
    if (T == 1) axpy_in_place(down_type, acc, h, qcols, n_staged, n_embd);
    // more rows: the columns unpacked once for all of them, each row as that token alone
    else if (down_type == GGML_TYPE_Q6_K) ls_axpy_q6_K_rows(acc, h, (const void * const *) qcols, n_staged, T, n_embd);
    else ls_axpy_q8_0_rows(acc, h, (const void * const *) qcols, n_staged, T, n_embd);
}

// gate . x and up . x of one neuron: Q4_K or Q4_1 gate and up rows (the common GGUF cases) in one
// fused pass over x; any other types through ggml's vec_dot, row by row.
enum { LS_FUSED_NONE = 0, LS_FUSED_Q4_K = 1, LS_FUSED_Q4_1 = 2 };

static inline int fused_gate_up(const ls_layer_info * in) {
    if (in->gate_type != in->up_type) return LS_FUSED_NONE;
    return in->gate_type == GGML_TYPE_Q4_K ? LS_FUSED_Q4_K : in->gate_type == GGML_TYPE_Q4_1 ? LS_FUSED_Q4_1 : LS_FUSED_NONE;
}

// values per step of the fused kernel: it prefetches pf_lines cache lines per step
static inline int64_t fused_unit(int fused) { return fused == LS_FUSED_Q4_K ? 256 : 32; }

static inline void gate_up(const struct ggml_type_traits_cpu * tg, const struct ggml_type_traits_cpu * tu, int fused,
                           int64_t n_embd, const uint8_t * grow, const uint8_t * urow, const uint8_t * xg,
                           const uint8_t * xu, float * g, float * u, const uint8_t * pf, int pf_lines) {
    if (fused == LS_FUSED_Q4_K) {
        ls_dot2_q4_K(n_embd, grow, urow, xg, g, u, pf, pf_lines);
        return;
    }
    if (fused == LS_FUSED_Q4_1) {
        ls_dot2_q4_1(n_embd, grow, urow, xg, g, u, pf, pf_lines);
        return;
    }
    tg->vec_dot(n_embd, g, 0, grow, 0, xg, 0, 1);
    tu->vec_dot(n_embd, u, 0, urow, 0, xu, 0, 1);
}

// Share ith of plan entries [lo, hi): the ith of nth contiguous parts. Shares are dealt to the
// threads in contiguous runs: one sequential stream per thread serves the memory prefetchers best
// (measured: runs of 16 entries dealt out in turn cost 6-8 % of a resident layer's op); on a
// streaming layer the later parts' reads land later, but there the op waits for I/O whichever
// way the work is dealt.
static inline int32_t share_lo(int32_t lo, int32_t hi, int ith, int nth) {
    return lo + (int32_t) ((int64_t) (hi - lo) * ith / nth);
}

// Block b's gate/up rows (its whole payload unless the layer is split) if its read has landed,
// else NULL (for prefetching: never waits).
static inline const uint8_t * landed(ls_engine * e, const ls_layer * L, int32_t b) {
    const int32_t slot = L->f.slot[b];
    if (slot < 0 || atomic_load_explicit(&L->f.state[b], memory_order_relaxed) != LS_BLK_READY) return NULL;
    return ls_block_gu(L, ls_cache_slot_ptr(&e->cache, slot), b);
}

static inline void prefetch_bytes(const uint8_t * p, uint64_t n) {
    for (uint64_t off = 0; off < n; off += 64) __builtin_prefetch(p + off, 0, 3);
}

// The next block's first `bytes` (nxt; NULL: nothing to fetch) are fetched while this block
// computes: spread over the fused kernel's steps (returns the lines per step; neuron j of the
// block fetches from nxt_for(nxt, j, ...)), or at once when the kernel is ggml's (returns 0).
static inline int prefetch_next(const uint8_t * nxt, uint64_t bytes, int fused, int64_t k, int64_t n_embd) {
    if (!nxt) return 0;
    if (!fused) { prefetch_bytes(nxt, bytes); return 0; }
    const int64_t steps = k * (n_embd / fused_unit(fused));
    return (int) (((int64_t) (bytes + 63) / 64 + steps - 1) / steps);
}

static inline const uint8_t * nxt_for(const uint8_t * nxt, int pf_lines, int64_t j, int fused, int64_t n_embd) {
    return pf_lines ? nxt + (size_t) (j * (n_embd / fused_unit(fused)) * pf_lines * 64) : NULL;
}

// Entry i of this thread's share [.., s1) of the plan: its block's bytes once ready (NULL: not
// loaded, the error recorded), with the first next_bytes of entry i + 1's block fetched into cache
// while it computes (pf: where from, and how many lines per kernel step; see prefetch_next).
typedef struct { const uint8_t * nxt; int lines; } next_fetch;

static const uint8_t * fetch_entry(ls_engine * e, ls_layer * L, int32_t i, int32_t s1, uint64_t next_bytes,
                                   next_fetch * pf, uint64_t * stall_ns) {
    const int32_t * blocks = e->plan.blocks;
    const uint8_t * blk = ready_block(e, L, blocks[i], stall_ns);
    if (!blk) return NULL;
    pf->nxt = i + 1 < s1 ? landed(e, L, blocks[i + 1]) : NULL;
    pf->lines = prefetch_next(pf->nxt, next_bytes, fused_gate_up(&L->info), L->info.neurons_per_block, L->info.n_embd);
    return blk;
}

// A down column as f32 into a staging tile (the decode path reads Q8_0 columns in place instead;
// Q8_0 and Q6_K columns have their own dequantization, the other types ggml's to_float).
static inline void stage_column(const ls_layer_info * in, const uint8_t * col, float * out) {
    if (in->down_type == GGML_TYPE_Q8_0) ls_dequant_q8_0(out, col, in->n_embd);
    else if (in->down_type == GGML_TYPE_F32) memcpy(out, col, sizeof(float) * (size_t) in->n_embd);
    else if (in->down_type == GGML_TYPE_Q6_K) ls_dequant_q6_K(out, col, in->n_embd);
    else ggml_get_type_traits(in->down_type)->to_float(col, out, in->n_embd);
}

// Share s's partial output [n_tokens, n_embd].
static float * share_acc(const ls_plan * P, int s) {
    return P->buf.acc + (size_t) s * (size_t) P->n_tokens * (size_t) P->L->info.n_embd;
}

// Thread ith's shares [*s0, *s1): a contiguous run of the op's n_shares, their partials zeroed.
static void thread_shares(const ls_plan * P, int ith, int nth, int * s0, int * s1) {
    *s0 = P->n_shares * ith / nth;
    *s1 = P->n_shares * (ith + 1) / nth;
    for (int s = *s0; s < *s1; s++) memset(share_acc(P, s), 0, sizeof(float) * (size_t) P->n_tokens * (size_t) P->L->info.n_embd);
}

static float * thread_work(const ls_plan * P, int ith) { return P->buf.work + (size_t) ith * P->buf.work_per_thread; }

// y = the sum of the shares' partial outputs, in share order (deterministic); each thread sums
// its slice of the output.
static void reduce_partials(const ls_plan * P, float * y, int ith, int nth) {
    const size_t per = (size_t) P->n_tokens * (size_t) P->L->info.n_embd;
    const size_t lo = per * (size_t) ith / (size_t) nth, hi = per * (size_t) (ith + 1) / (size_t) nth;
    for (size_t i = lo; i < hi; i++) {
        float v = 0.0f;
        for (int j = 0; j < P->n_shares; j++) v += P->buf.acc[(size_t) j * per + i];
        y[i] = v;
    }
}

// How compute_share computes a layer's neurons' gate and up: the types, and x quantized for each
typedef struct {
    const struct ggml_type_traits_cpu * tg, * tu;   // gate's and up's
    int fused;                                      // LS_FUSED_*
    int32_t act;                                    // LS_ACT_*
    int64_t n_embd;
    size_t rg, ru;                                  // bytes of one quantized x row for gate, for up
} neuron_math;

// h[t] = act(gate . x[t]) * (up . x[t]) of one neuron (rows gr, ur) for Tc token rows of x
// (gate's from xg, up's from xu); gu_tmp [2][Tc] scratch; the prefetch stream (nx, pf_lines) with
// the first row.
static inline void neuron_h(const neuron_math * nm, const uint8_t * gr, const uint8_t * ur, const uint8_t * xg,
                            const uint8_t * xu, int64_t Tc, const uint8_t * nx, int pf_lines, float * gu_tmp, float * h) {
    if (nm->fused && Tc > 1) {   // the rows kernels: each row's gate/up as that token's alone, the weights unpacked once per few rows
        float * g = gu_tmp, * u = gu_tmp + Tc;
        if (nm->fused == LS_FUSED_Q4_K) ls_dot2_q4_K_rows(nm->n_embd, gr, ur, xg, nm->rg, (int) Tc, g, u, nx, pf_lines);
        else ls_dot2_q4_1_rows(nm->n_embd, gr, ur, xg, nm->rg, (int) Tc, g, u, nx, pf_lines);
        for (int64_t t = 0; t < Tc; t++) h[t] = ls_act(nm->act, g[t]) * u[t];
        return;
    }
    for (int64_t t = 0; t < Tc; t++) {
        float g, u;
        gate_up(nm->tg, nm->tu, nm->fused, nm->n_embd, gr, ur, xg + (size_t) t * nm->rg, xu + (size_t) t * nm->ru, &g, &u,
                t == 0 ? nx : NULL, t == 0 ? pf_lines : 0);
        h[t] = ls_act(nm->act, g) * u;
    }
}

// Share s of n_shares of plan entries [lo, hi) (share_lo), every neuron of each block, accumulated
// into acc [n_tokens, n_embd]; counted in the layer's compute counters unless it is the draft's.
static void compute_share(ls_engine * e, int s, int n_shares, int32_t lo, int32_t hi, float * acc, float * work) {
    const ls_plan * P = &e->plan;
    ls_layer * L = P->L;
    const ls_layer_info * in = &L->info;
    const int64_t n_embd = in->n_embd, T = P->n_tokens, k = in->neurons_per_block;
    neuron_math nm = { .tg = ls_cpu_traits(in->gate_type), .tu = ls_cpu_traits(in->up_type), .fused = fused_gate_up(in),
                       .act = e->params.activation, .n_embd = n_embd };
    nm.rg = ggml_row_size(nm.tg->vec_dot_type, n_embd);
    nm.ru = ggml_row_size(nm.tu->vec_dot_type, n_embd);
    const uint8_t * xg0 = P->buf.xq;
    const uint8_t * xu0 = nm.tu->vec_dot_type == nm.tg->vec_dot_type ? P->buf.xq : P->buf.xq + (size_t) T * nm.rg;
    // few tokens: read int8 columns directly; many: dequantize once per tile, reuse for every token
    const bool rowwise = T <= LS_EXACT_ROWS;
    const bool direct = adds_in_place(in->down_type) && rowwise;
    // the next block's bytes fetched while one computes (a split layer: its gate/up rows; the
    // down columns are fetched when staged)
    const uint64_t next_bytes = L->gu_ptr ? (uint64_t) k * (L->gate_row_bytes + L->up_row_bytes) : in->block_payload;

    const int64_t tile = tile_of(k);
    float * h    = work;                          // [tile][Tc]     act(g)*u per staged neuron
    float * cols = work + (size_t) tile * T;      // [tile][n_embd] dequantized down columns
    float * gu_tmp = cols + (size_t) tile * n_embd; // [2][Tc] gate and up values of one neuron
    const uint8_t * qcols[LS_TILE_MAX];   // direct mode: the staged columns themselves
    int n_staged = 0;
    uint64_t stall_ns = 0, n_computed = 0, bytes_computed = 0;
    const int32_t s0 = share_lo(lo, hi, s, n_shares), s1 = share_lo(lo, hi, s + 1, n_shares);

    // prefill: the tokens in chunks of LS_TOKEN_CHUNK, each through all of this thread's blocks, so
    // that the chunk's output rows stay in cache while every staged tile adds to them (a tile
    // touching all T rows moved the whole [T][n_embd] output through memory per 32 neurons)
    for (int64_t t0 = 0; t0 < T; t0 += LS_TOKEN_CHUNK) {
        const int64_t Tc = T - t0 < LS_TOKEN_CHUNK ? T - t0 : LS_TOKEN_CHUNK;
        const uint8_t * xg = xg0 + (size_t) t0 * nm.rg, * xu = xu0 + (size_t) t0 * nm.ru;
        float * acc_c = acc + (size_t) t0 * n_embd;
        for (int32_t i = s0; i < s1; i++) {
            if (n_staged + k > tile) {
                flush(acc_c, h, cols, qcols, in->down_type, n_staged, Tc, n_embd, direct);
                n_staged = 0;
            }
            const int32_t b = P->blocks[i];
            next_fetch pf;
            const uint8_t * blk = fetch_entry(e, L, i, s1, next_bytes, &pf, &stall_ns);
            if (!blk) continue;
            const uint8_t * gate = ls_block_gu(L, blk, b);
            const uint8_t * up   = gate + (size_t) k * L->gate_row_bytes;
            const uint8_t * down = ls_block_dn(L, blk, b);
            if (L->dn_ptr && direct) prefetch_bytes(down, (uint64_t) k * L->down_col_bytes);   // staged, read at the flush
            for (int64_t j = 0; j < k; j++) {
                if (L->f.ids[(size_t) b * k + j] < 0) continue; // padding slot
                float * hj = h + (size_t) n_staged * Tc;
                neuron_h(&nm, gate + j * L->gate_row_bytes, up + j * L->up_row_bytes, xg, xu, Tc,
                         nxt_for(pf.nxt, pf.lines, j, nm.fused, n_embd), pf.lines, gu_tmp, hj);
                const uint8_t * col = down + j * L->down_col_bytes;
                if (L->capture && P->path != LS_PATH_DRAFT) {   // the converter's profile: blocks are this thread's alone
                    const size_t slot = (size_t) b * k + (size_t) j, n_slots = (size_t) in->n_blocks * (size_t) k;
                    for (int64_t t = 0; t < Tc && t0 + t < L->capture_rows; t++) L->capture[(size_t) (t0 + t) * n_slots + slot] = hj[t];
                }
                if (direct) qcols[n_staged++] = col;   // decode: the quantized column itself
                else stage_column(in, col, cols + (size_t) n_staged++ * n_embd);
            }
            if (t0 == 0) {
                n_computed++;
                bytes_computed += in->block_payload;
            }
        }
        flush(acc_c, h, cols, qcols, in->down_type, n_staged, Tc, n_embd, direct);
        n_staged = 0;
    }
    if (P->path == LS_PATH_DRAFT) return;   // (op_end counts the draft's blocks)
    atomic_fetch_add(&L->stats.io_stall_ns, stall_ns);
    atomic_fetch_add(&L->stats.blocks_computed, n_computed);
    atomic_fetch_add(&L->stats.bytes_computed, bytes_computed);
}

// ---- path 1: dense --------------------------------------------------------------------------------
// Every block of the layer in file order (prefill in every mode; decode in mode dense), in the
// chunks the budget holds: between two chunks thread 0 lets the computed one go and pins the next.

static void op_dense(ls_engine * e, const float * x, size_t x_row_stride, float * y, int ith, int nth) {
    ls_plan * P = &e->plan;
    int s0, s1;
    thread_shares(P, ith, nth, &s0, &s1);
    quantize_input(P, x, x_row_stride, ith, nth);
    ls_barrier_wait(&e->barrier, nth);
    for (int32_t c = 0; c < P->chunks.n; c++) {
        for (int s = s0; s < s1; s++)
            compute_share(e, s, P->n_shares, c == 0 ? 0 : P->chunks.end[c - 1], P->chunks.end[c], share_acc(P, s), thread_work(P, ith));
        if (c + 1 == P->chunks.n) break;
        ls_barrier_wait(&e->barrier, nth);
        if (ith == 0) {
            pthread_mutex_lock(&e->mu);
            const ls_status st = ls_sched_next_chunk(e, c + 1);
            pthread_mutex_unlock(&e->mu);
            if (st != LS_OK) {
                ls_engine_record_error(e, LS_ERR_BUDGET, "layer %d: memory budget too small for the next chunk", P->L->il);
                P->chunks.stop = true;   // the output is partial; the error is raised
            }
        }
        ls_barrier_wait(&e->barrier, nth);
        if (P->chunks.stop) break;
    }
    ls_barrier_wait(&e->barrier, nth);
    reduce_partials(P, y, ith, nth);
}

// ---- path 2: predicted (and the draft) ------------------------------------------------------------
// Sparse decode selected by the predictors (oneshot, dejavu+, powerinfer2; leanstream on a layer
// without a sketch): thread 0 planned and pinned the kept blocks before the op began. The draft
// FFN of speculative decoding takes the same path over the blocks resident now (no pins: only an
// op evicts, and this one holds e->op_mu).

static void op_predicted(ls_engine * e, const float * x, size_t x_row_stride, float * y, int ith, int nth) {
    ls_plan * P = &e->plan;
    int s0, s1;
    thread_shares(P, ith, nth, &s0, &s1);
    quantize_input(P, x, x_row_stride, ith, nth);
    ls_barrier_wait(&e->barrier, nth);
    for (int s = s0; s < s1; s++) compute_share(e, s, P->n_shares, 0, P->n, share_acc(P, s), thread_work(P, ith));
    ls_barrier_wait(&e->barrier, nth);
    reduce_partials(P, y, ith, nth);
}

// ---- path 3: cascade (exact-input selection) --------------------------------------------------------
//
//   score      every thread scores its slice of the layer's blocks on the resident sketch
//   plan       thread 0: the top candidate_ratio x kept blocks by score are pinned / read
//   gate/up    every thread computes h exactly for its share of the candidates (ggml vec_dot)
//   select     thread 0: the kept blocks are the candidates with the largest sum |h|
//   down       every thread accumulates h * down column for its share of the kept blocks

static void cascade_gate_up(ls_engine * e, int ith, int nth) {
    ls_plan * P = &e->plan;
    ls_layer * L = P->L;
    const ls_layer_info * in = &L->info;
    const int64_t n_embd = in->n_embd, k = in->neurons_per_block;
    const struct ggml_type_traits_cpu * tg = ls_cpu_traits(in->gate_type);
    const struct ggml_type_traits_cpu * tu = ls_cpu_traits(in->up_type);
    const size_t rg = ggml_row_size(tg->vec_dot_type, n_embd);
    const uint8_t * xg = P->buf.xq;
    const uint8_t * xu = tu->vec_dot_type == tg->vec_dot_type ? P->buf.xq : P->buf.xq + rg;
    const int32_t act = e->params.activation;
    const int fused = fused_gate_up(in);
    const float * w = L->sketch->weight;
    const uint64_t next_bytes = (uint64_t) k * (L->gate_row_bytes + L->up_row_bytes);   // the next candidate's gate/up rows
    uint64_t stall_ns = 0;
    const int32_t s0 = share_lo(0, P->n, ith, nth), s1 = share_lo(0, P->n, ith + 1, nth);
    for (int32_t i = s0; i < s1; i++) {
        const int32_t b = P->blocks[i];
        float * hb = P->cascade.hval + (size_t) i * k;
        P->cascade.loaded[i] = 0;   // never kept if it cannot be computed
        for (int64_t j = 0; j < k; j++) hb[j] = 0.0f;
        next_fetch pf;
        const uint8_t * blk = fetch_entry(e, L, i, s1, next_bytes, &pf, &stall_ns);
        if (!blk) continue;
        const uint8_t * gate = ls_block_gu(L, blk, b);
        const uint8_t * up   = gate + (size_t) k * L->gate_row_bytes;
        float sc = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            if (L->f.ids[(size_t) b * k + j] < 0) continue;
            float g, u;
            gate_up(tg, tu, fused, n_embd, gate + j * L->gate_row_bytes, up + j * L->up_row_bytes, xg, xu, &g, &u,
                    nxt_for(pf.nxt, pf.lines, j, fused, n_embd), pf.lines);
            hb[j] = ls_act(act, g) * u;
            sc += fabsf(hb[j]) * w[(size_t) b * k + j];
        }
        P->cascade.hscore[i] = sc;
        P->cascade.loaded[i] = 1;
    }
    atomic_fetch_add(&L->stats.io_stall_ns, stall_ns);
}

static void cascade_down(ls_engine * e, int s, int n_shares, float * acc, float * work) {
    const ls_plan * P = &e->plan;
    ls_layer * L = P->L;
    const ls_layer_info * in = &L->info;
    const int64_t n_embd = in->n_embd, k = in->neurons_per_block, tile = tile_of(k);
    const int32_t q0 = share_lo(0, P->cascade.n_sel, s, n_shares), q1 = share_lo(0, P->cascade.n_sel, s + 1, n_shares);
    if (adds_in_place(in->down_type)) {
        // Q8_0 / Q6_K columns: this thread's share of the kept entries (a contiguous range, in
        // plan order) as one list, accumulated in one call that fetches each group of 8 columns
        // while it computes the one before
        float * dh = P->cascade.dh + (size_t) q0 * k;
        const uint8_t ** dc = (const uint8_t **) (P->cascade.dcols + (size_t) q0 * k);
        int m = 0;
        for (int32_t q = q0; q < q1; q++) {
            const int32_t i = P->cascade.sel[q], b = P->blocks[i];
            const uint8_t * down = ls_block_dn(L, ls_cache_slot_ptr(&e->cache, L->f.slot[b]), b);
            for (int64_t j = 0; j < k; j++) {
                if (L->f.ids[(size_t) b * k + j] < 0) continue;
                dh[m] = P->cascade.hval[(size_t) i * k + j];
                dc[m++] = down + j * L->down_col_bytes;
            }
        }
        for (int j = 0; j < m && j < 8; j++) prefetch_bytes(dc[j], L->down_col_bytes);
        if (m) axpy_in_place(in->down_type, acc, dh, dc, m, n_embd);
        return;
    }
    float * h = work, * cols = work + tile;   // other column types: staged as f32 in tiles
    int n_staged = 0;
    for (int32_t q = q0; q < q1; q++) {
        const int32_t i = P->cascade.sel[q], b = P->blocks[i];
        if (n_staged + k > tile) {
            ls_axpy_tile(acc, h, cols, n_staged, 1, n_embd);
            n_staged = 0;
        }
        const uint8_t * down = ls_block_dn(L, ls_cache_slot_ptr(&e->cache, L->f.slot[b]), b);
        for (int64_t j = 0; j < k; j++) {
            if (L->f.ids[(size_t) b * k + j] < 0) continue;
            h[n_staged] = P->cascade.hval[(size_t) i * k + j];
            stage_column(in, down + j * L->down_col_bytes, cols + (size_t) n_staged++ * n_embd);
        }
    }
    if (n_staged) ls_axpy_tile(acc, h, cols, n_staged, 1, n_embd);
}

static void op_cascade(ls_engine * e, const float * x, size_t x_row_stride, const float * x_res, float * y,
                       int ith, int nth) {
    ls_plan * P = &e->plan;
    ls_layer * L = P->L;
    const int32_t nb = L->info.n_blocks;
    int s0, s1;
    thread_shares(P, ith, nth, &s0, &s1);
    quantize_input(P, x, x_row_stride, ith, nth);
    if (ith == 0) ls_sketch_quantize_x(L->sketch, x, P->cascade.xs, L->info.n_embd);
    ls_barrier_wait(&e->barrier, nth);
    const uint64_t t0 = ith == 0 ? ls_now_ns() : 0;
    const bool scored = !ls_sched_cascade_all(e, L);   // (pinned_forever changes only at an op's end)
    if (scored) {
        ls_sketch_score(L->sketch, P->cascade.xs, L->info.n_embd, e->params.activation, L->info.neurons_per_block,
                        (int32_t) ((int64_t) nb * ith / nth), (int32_t) ((int64_t) nb * (ith + 1) / nth), P->cascade.score);
    }
    ls_barrier_wait(&e->barrier, nth);
    if (ith == 0) {
        if (scored) atomic_fetch_add(&L->stats.scorer_ns, ls_now_ns() - t0);
        pthread_mutex_lock(&e->mu);
        ls_status st = ls_sched_plan_cascade(e, L, x_res);
        pthread_mutex_unlock(&e->mu);
        if (st != LS_OK) {
            ls_engine_record_error(e, st, "layer %d: %s", L->il, st == LS_ERR_BUDGET ?
                                   "memory budget too small for this layer's candidates" : "cannot plan the FFN op");
            P->n = P->n_pinned;   // compute only what is pinned; the error is raised
        }
    }
    ls_barrier_wait(&e->barrier, nth);
    cascade_gate_up(e, ith, nth);
    ls_barrier_wait(&e->barrier, nth);
    if (ith == 0) ls_sched_select_final(e);
    ls_barrier_wait(&e->barrier, nth);
    for (int s = s0; s < s1; s++) cascade_down(e, s, P->n_shares, share_acc(P, s), thread_work(P, ith));
    ls_barrier_wait(&e->barrier, nth);
    reduce_partials(P, y, ith, nth);
    if (ith == 0) {
        const uint64_t gu = (uint64_t) L->info.neurons_per_block * (L->gate_row_bytes + L->up_row_bytes);
        const uint64_t dn = (uint64_t) L->info.neurons_per_block * L->down_col_bytes;
        atomic_fetch_add(&L->stats.blocks_computed, (uint64_t) P->n);
        atomic_fetch_add(&L->stats.bytes_computed, (uint64_t) P->n * gu + (uint64_t) P->cascade.n_sel * dn);
    }
}

// ---- the op ---------------------------------------------------------------------------------------

// Thread 0, before the first barrier: the path and, except for the cascade (which plans once the
// sketch has scored), its plan (pins taken under e->mu; the draft takes none). A failure takes the
// failed path: the output is zero, the error raised.
static void op_begin(ls_engine * e, ls_layer * L, int64_t n_tokens, int nth, const float * x_res) {
    ls_plan * P = &e->plan;
    P->path = ls_sched_path(e, L, n_tokens);
    P->n = P->pin_lo = P->n_pinned = 0;
    ls_status st = grow_scratch(e, L, n_tokens, nth);
    if (st == LS_OK && P->path == LS_PATH_DRAFT) ls_sched_plan_draft(e, L);
    if (st == LS_OK && (P->path == LS_PATH_DENSE || P->path == LS_PATH_PREDICTED)) {
        pthread_mutex_lock(&e->mu);
        st = P->path == LS_PATH_DENSE ? ls_sched_plan_dense(e, L) : ls_sched_plan_predicted(e, L, x_res);
        pthread_mutex_unlock(&e->mu);
    }
    if (st == LS_OK) return;
    ls_engine_record_error(e, st, "layer %d: %s", L->il,
                           st == LS_ERR_BUDGET ? "memory budget too small for this layer's working set" :
                           st == LS_ERR_UNSUPPORTED ? "sparse mode needs a predictor (or oracle priorities) for this layer" :
                           "cannot plan the FFN op");
    P->path = LS_PATH_FAILED;
}

// Thread 0, after the last barrier, under e->mu: unpin, and a dense layer whose every block is now
// resident in a cache that never evicts stays so for good (and is split for the sparse paths).
static void op_end(ls_engine * e, ls_layer * L, int64_t n_tokens, uint64_t t0) {
    ls_plan * P = &e->plan;
    if (P->path == LS_PATH_DRAFT) {   // nothing pinned; the target's counters and last plan untouched
        atomic_fetch_add(&L->stats.draft_ops, 1);
        atomic_fetch_add(&L->stats.draft_tokens, (uint64_t) n_tokens);
        atomic_fetch_add(&L->stats.draft_blocks, (uint64_t) P->n);
        atomic_fetch_add(&L->stats.draft_ns, ls_now_ns() - t0);
        return;
    }
    bool all_ready;
    ls_sched_finish(e, &all_ready);
    if (P->path == LS_PATH_FAILED) return;
    if (L->capture) L->capture_n = (int32_t) (n_tokens < L->capture_rows ? n_tokens : L->capture_rows);
    if (P->path == LS_PATH_DENSE && e->cache.never_evicts && all_ready && !P->chunks.stop && !L->pinned_forever) {
        L->pinned_forever = true;
        ls_layer_split(e, L);
    }
    const uint64_t op_ns = ls_now_ns() - t0;
    atomic_fetch_add(&L->stats.op_calls, 1);
    atomic_fetch_add(&L->stats.tokens, (uint64_t) n_tokens);
    atomic_fetch_add(&L->stats.op_ns, op_ns);
    ls_ctrl_end(e, L, op_ns);
}

// The whole op for one of nth threads; the same code serves the ggml graph and ls_ffn_eval_layers.
// x: FFN input rows [n_tokens, n_embd] (row stride in bytes); x_res: the residual entering the
// FFN (the sparse paths' predictors use it; may be NULL); y: output [n_tokens, n_embd].
// Thread 0 holds e->op_mu for the whole op (one op of an engine at a time) and e->mu only where
// the op changes what other threads read (pins, the layer's last plan, the controller's record).
void ls_op_run(ls_engine * e, ls_layer * L, const float * x, size_t x_row_stride, const float * x_res,
               float * y, int64_t n_tokens, int ith, int nth) {
    ls_plan * P = &e->plan;
    uint64_t t0 = 0;
    if (ith == 0) {
        t0 = ls_now_ns();
        pthread_mutex_lock(&e->op_mu);
        op_begin(e, L, n_tokens, nth, x_res);
    }
    ls_barrier_wait(&e->barrier, nth);
    switch (P->path) {
    case LS_PATH_DENSE:     op_dense(e, x, x_row_stride, y, ith, nth); break;
    case LS_PATH_PREDICTED:
    case LS_PATH_DRAFT:     op_predicted(e, x, x_row_stride, y, ith, nth); break;
    case LS_PATH_CASCADE:   op_cascade(e, x, x_row_stride, x_res, y, ith, nth); break;
    case LS_PATH_FAILED:
        for (int64_t t = ith; t < n_tokens; t += nth) memset(y + (size_t) t * L->info.n_embd, 0, sizeof(float) * (size_t) L->info.n_embd);
        break;
    }
    ls_barrier_wait(&e->barrier, nth);
    if (ith == 0) {
        pthread_mutex_lock(&e->mu);
        op_end(e, L, n_tokens, t0);
        pthread_mutex_unlock(&e->mu);
        pthread_mutex_unlock(&e->op_mu);
    }
}

// ---- ls_ffn_eval_layers: the op outside a graph ------------------------------------------------

typedef struct eval_arg {
    ls_engine * e;
    int32_t il0, n_layers;
    const float * x;
    const float * x_res;
    float * y;
    int64_t n_tokens;
} eval_arg;

static void eval_thread(void * p, int ith, int nth) {
    const eval_arg * a = p;
    for (int32_t il = a->il0; il < a->il0 + a->n_layers; il++) {   // one op after another, as in a graph
        ls_layer * L = &a->e->layers[il];
        ls_op_run(a->e, L, a->x, sizeof(float) * (size_t) L->info.n_embd, a->x_res, a->y, a->n_tokens, ith, nth);
    }
}

ls_status ls_ffn_eval_layers(ls_engine * e, int32_t il0, int32_t n_layers, const float * x, const float * x_res,
                             float * y, int64_t n_tokens, int32_t n_threads) {
    if (!e || !x || !y || n_tokens <= 0 || n_layers <= 0 || il0 < 0 || il0 + n_layers > e->n_layers) {
        ls_set_error("ls_ffn_eval_layers: bad arguments");
        return LS_ERR_ARG;
    }
    for (int32_t il = il0 + 1; il < il0 + n_layers; il++) {
        if (e->layers[il].info.n_embd != e->layers[il0].info.n_embd) { ls_set_error("ls_ffn_eval_layers: layers of different widths"); return LS_ERR_ARG; }
    }
    if (n_threads <= 0) n_threads = 1;
    if (n_threads > LS_MAX_TEAM) n_threads = LS_MAX_TEAM;
    eval_arg a = { e, il0, n_layers, x, x_res, y, n_tokens };
    if (!ls_run_team(eval_thread, &a, n_threads)) { ls_set_error("ls_ffn_eval_layers: cannot start %d threads", n_threads); return LS_ERR_NOMEM; }
    return ls_error_slot_raise(&e->err);
}
