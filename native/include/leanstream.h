// leanstream.h — the whole native interface of libleanstream.
//
// libleanstream computes a llama.cpp model's FFN layers from co-activation-grouped neuron
// block files on disk (written by `leanstream convert`), streaming the blocks it needs with
// O_DIRECT reads on its own I/O threads while ggml's compute threads work on the blocks that
// have already arrived (LeanStream, MobiCom 2026, §3.2).
//
// Use:
//     ls_engine_params p; ls_engine_params_init(&p);
//     p.n_layers = n; p.block_paths = paths; p.memory_budget = 512u << 20;
//     ls_engine * e; if (ls_engine_create(&p, &e) != LS_OK) puts(ls_errmsg());
//     llama_set_ffn_builder(lctx, ls_ffn_build, e);     // patched llama.cpp (patches/)
//     ... llama_decode(...) ...;  if (ls_engine_take_error(e, buf, n) != LS_OK) ...
//     ls_engine_free(e);                                // after the llama context is freed
//
// Conventions: every public symbol starts with ls_/LS_; errors are ls_status codes (never
// exit/abort on bad input) with a message from ls_errmsg() (creation) or the engine; an I/O
// error raised on a worker thread is kept and returned by the next ls_engine_take_error().
// Shapes are written [ne0, ne1] as in ggml (ne0 contiguous).
//
// File formats (block files `ffn/blk.<il>.bin`, sketches, predictors): docs/formats.md. The
// engine checks a block file's meta_crc when it opens it and, unless verify_checksums is 0, every
// block's CRC-32C once after each read, before the block is first computed with; a mismatch is
// an LS_ERR_CORRUPT error naming the file, layer and block (the block is not used, and is read
// again next time).
//
// This header is read as-is by the Python binding (cffi cdef): everything between
// LS_CDEF_BEGIN and LS_CDEF_END must stay plain C declarations (no macros but LS_API and
// integer #defines).

#ifndef LEANSTREAM_H
#define LEANSTREAM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LS_API __attribute__((visibility("default")))

// LS_CDEF_BEGIN

#define LS_ABI_VERSION 17
#define LS_BLOCK_FILE_VERSION 2
#define LS_MAX_ERRMSG 512
#define LS_MAX_IO_THREADS 256
#define LS_SKETCH_LS2 1     // sketch row format: 2-bit codes, one f16 scale per 32 values (src/sketch.c)
// Batches of up to this many token rows (speculative decoding's verify passes) compute every row
// exactly as decoding that token alone would, bit for bit: the FFN op here, and llama.cpp's other
// ops through llama_set_exact_rows(ctx, LS_EXACT_ROWS) (patches/0003), which the binding calls.
#define LS_EXACT_ROWS 64
#define LS_DRAFT_TOP 8      // best tokens per row the draft's output projection keeps (ls_engine_draft_top)

typedef int32_t ls_status;
enum {
    LS_OK          =  0,
    LS_ERR_ARG     = -1,  // bad argument (null pointer, layer out of range, ...)
    LS_ERR_IO      = -2,  // open/read failed or was short
    LS_ERR_FORMAT  = -3,  // a block file is malformed, truncated or of another version
    LS_ERR_NOMEM   = -4,
    LS_ERR_BUDGET  = -5,  // memory budget too small for the working set
    LS_ERR_UNSUPPORTED = -6,
    LS_ERR_CORRUPT = -7,  // stored data does not match its checksum
};

// Activation of the gated FFN: out = down · (act(gate · x) ⊙ (up · x)).
enum { LS_ACT_SILU = 0, LS_ACT_GELU = 1 };
// A MoE expert's gated activation h = glu(g, u) of its gate and up values (build_moe_ffn's type_op):
// SiLU and GELU as above (SwiGLU, GeGLU), ReGLU relu(g) * u, and gpt-oss's SwiGLU-OAI:
// x = min(g, limit), y = clamp(u, -limit, limit), h = x * sigmoid(alpha * x) * (y + 1).
enum { LS_ACT_RELU = 2, LS_ACT_SWIGLU_OAI = 3 };

// Execution modes. Only LS_MODE_DENSE computes every neuron; the others compute the top
// (1 - sparsity) blocks of each layer per decoded token (prefill is dense in every mode). What
// each one does is one row of the mode table in src/mode.c, the only place it is written;
// ls_mode_name() and ls_mode_uses() let callers ask it.
enum {
    LS_MODE_DENSE       = 0,
    LS_MODE_ONESHOT     = 1,
    LS_MODE_DEJAVU_PLUS = 2,
    LS_MODE_POWERINFER2 = 3,
    LS_MODE_LEANSTREAM  = 4,
    LS_N_MODES          = 5,
};

// What a mode reads from the model directory (bits of ls_mode_uses): a sparse mode runs where it
// has at least one of the selectors it uses (sketch or predictors) for every layer, and the
// block ranking where it is required.
enum {
    LS_USES_SKETCH     = 1,   // selects from the layer's own input through the resident sketch
    LS_USES_PREDICTORS = 2,   // selects (without a sketch) or prefetches through the predictors
    LS_USES_RANK       = 4,   // pins a hot set ranked by calibration frequency (block_rank)
    LS_NEEDS_RANK      = 8,   // ... and is meaningless without it
    LS_DECODES_SPARSE  = 16,  // decodes a selection of each layer's blocks (every mode but dense)
};

// ---- engine -------------------------------------------------------------------------------

typedef struct ls_engine ls_engine;
struct ggml_context;
struct ggml_tensor;
struct ls_test_hooks;   // ---- testing, below

typedef struct ls_engine_params {
    int32_t        n_layers;        // number of FFN layers (one block file each)
    const char * const * block_paths; // [n_layers] path of each layer's block file
    int32_t        activation;      // LS_ACT_*
    int32_t        mode;            // LS_MODE_*
    uint64_t       memory_budget;   // bytes of FFN weights kept in RAM; 0 = unlimited (keep all)
    int32_t        n_io_threads;    // I/O worker threads (queue depth), 1..LS_MAX_IO_THREADS, default 16
    uint32_t       max_read_bytes;  // largest single read (adjacent blocks are merged), default 256 KiB
    // sparse decode (modes other than LS_MODE_DENSE; prefill always runs dense)
    float          sparsity;        // fraction of each layer's blocks NOT computed per token, [0, 1);
                                    // -1 (default): the mode's (0 dense, LS_DEFAULT_SPARSITY otherwise)
    const char * const * predictor_paths; // [n_layers] predictor file per layer, or NULL
    double         hot_fraction;    // share of the cache's slots pinned for the hot set in the modes
                                    // that pin one, [0, 1]; -1 (default): the mode's (0.5; leanstream
                                    // without predictors 0.9: it prefetches nothing)
    const float *  block_rank;      // [sum of n_blocks over layers] calibration rank of every block,
                                    // layer after layer (higher = more often needed), or NULL; the
                                    // hot set is the top of this ranking (required by powerinfer2)
    int32_t        verify_checksums; // 1 (default): check every block's CRC-32C after each read, before use
    // exact-input selection (mode leanstream, layers with a sketch): per decoded token the sketch
    // scores every block from the layer's own input, the top candidate_ratio x kept blocks get
    // their gate/up rows computed exactly, and only the kept blocks with the largest exact |h|
    // get their down columns computed
    const char * const * sketch_paths; // [n_layers] sketch file per layer (NULL entries: none), or NULL
    float          candidate_ratio; // candidates / kept blocks, >= 1; -1 (default): LS_DEFAULT_CANDIDATE_RATIO
    int64_t        bridge_bytes;    // read planning: a read goes on through a gap of unselected blocks up to
                                    // this many bytes (read and dropped) rather than start another I/O;
                                    // -1 (default): the per-I/O cost x bandwidth measured on the block files
                                    // at start (sparse modes under a budget; else 0); 0: never
    const struct ls_test_hooks * test_hooks; // tests only: this engine's injected delays and faults
                                    // (copied at creation); NULL (default): none
} ls_engine_params;

LS_API void        ls_engine_params_init(ls_engine_params * p);   // the only source of defaults
LS_API ls_status   ls_engine_create(const ls_engine_params * p, ls_engine ** out);
LS_API void        ls_engine_free(ls_engine * e);
LS_API const char * ls_errmsg(void);
// The engine's parameters with the mode's defaults resolved (path arrays and block_rank: NULL).
LS_API ls_status   ls_engine_get_params(const ls_engine * e, ls_engine_params * out);  // message of the last failed call on this thread
// What an engine created from *p would run with, resolved in place without opening anything: the
// mode's defaults filled in (sparsity; the hot set's share, which depends on whether
// predictor_paths is set; the candidate ratio) and every range checked (LS_ERR_ARG naming the bad
// one), as ls_engine_create does. A caller shows the engine's defaults from here (a --help)
// instead of writing them again.
LS_API ls_status   ls_engine_params_resolve(ls_engine_params * p);
LS_API int32_t     ls_abi_version(void);
// The mode table, as callers ask it: the mode's name ("dense", "oneshot", "dejavu+", "powerinfer2",
// "leanstream"; NULL outside [0, LS_N_MODES)), and what it reads and does (LS_USES_*, LS_NEEDS_RANK, LS_DECODES_SPARSE bits; 0 for dense).
LS_API const char * ls_mode_name(int32_t mode);
LS_API int32_t     ls_mode_uses(int32_t mode);
// The instruction set the kernels run with on this CPU (docs/design.md §13): "avx512vnni", "avx512", "avx2",
// "neon+dotprod", "neon" or "scalar" (the plain C, any CPU), then in parentheses whatever did not
// go as asked (LEANSTREAM_ISA naming a set this build or CPU lacks; a kernel that failed its
// start-up check against the scalar one and was replaced by the set below's). Chosen once, when the
// library is loaded, capped by LEANSTREAM_ISA=<name>. ls_kernels_select() chooses again from
// LEANSTREAM_ISA; ls_kernels_force(name) takes that set (NULL: this CPU's best) and returns 1, or
// returns 0 and changes nothing when this build or CPU has no such set. Neither while an engine
// computes.
LS_API const char * ls_kernel_isa(void);
LS_API void        ls_kernels_select(void);
LS_API int32_t     ls_kernels_force(const char * isa);
// ggml's CPU backend module in use: the variant libggml chose for this CPU ("haswell", "zen4",
// ...; "ggml-cpu" for a build without variants; "none" when no CPU backend could be loaded) and
// the module's path ("" when none).
LS_API const char * ls_ggml_cpu_variant(void);
LS_API const char * ls_ggml_cpu_path(void);
// 1 when ggml's CPU backend dots rows of ggml type t (enum ggml_type) against an input it
// quantizes: its type traits have a vec_dot and the vec_dot type a from_float. The op computes
// gate and up rows of every such type (its own kernels where it has them, these traits elsewhere),
// so a new ggml type needs no code here.
LS_API int32_t     ls_ggml_type_dots(int32_t t);

// The last error from an I/O worker or the op (then cleared); LS_OK if none.
LS_API ls_status   ls_engine_take_error(ls_engine * e, char * msg, size_t msg_size);

// The llama_ffn_builder_t given to llama_set_ffn_builder(ctx, ls_ffn_build, engine): returns a
// ggml_custom_4d node [n_embd, n_tokens] computing layer il's FFN of cur [n_embd, n_tokens].
// ffn_inp [n_embd, n_tokens]: the residual entering the FFN, as the patched llama.cpp hands it
// over (NULL where the architecture's graph names none: dense mode only).
LS_API struct ggml_tensor * ls_ffn_build(struct ggml_context * ctx0, struct ggml_tensor * cur,
                                         struct ggml_tensor * ffn_inp, int32_t il, void * engine);

// The computation outside a ggml graph (tests, benchmarks): y = FFN_il(x) for the layers il0 ..
// il0 + n_layers - 1, one after another on the same n_threads threads (one decode token through
// the FFNs without a thread start per layer), each on the same x, exactly as the graph op would;
// y receives each layer's output in turn (the last one's remains). x and y are [n_embd, n_tokens]
// f32; x_res [n_embd] (may be NULL in dense mode): the residual entering the FFN, which sparse
// modes feed to the predictors (the graph op finds it in llama.cpp's graph).
LS_API ls_status   ls_ffn_eval_layers(ls_engine * e, int32_t il0, int32_t n_layers, const float * x,
                                      const float * x_res, float * y, int64_t n_tokens, int32_t n_threads);

// How many of a layer's n_blocks a sparse op computes at this sparsity (round half up, at least
// one): the one definition, which the converter's training uses through the binding too.
LS_API int32_t     ls_kept_blocks(int32_t n_blocks, float sparsity);
// Candidates of leanstream's exact-input selection: ceil(candidate_ratio x kept), at most n_blocks.
LS_API int32_t     ls_candidate_blocks(int32_t n_blocks, float sparsity, float candidate_ratio);

// Priorities of layer il's blocks for its next decode op ([n_blocks], higher first), replacing
// the predictor's for that op: an oracle for tests and ablations, or an external scheduler.
LS_API ls_status   ls_engine_set_priorities(ls_engine * e, int32_t il, const float * prio, int32_t n_blocks);

// Blocks of layer il kept resident for good once loaded, on top of the hot set the engine chose
// from params.block_rank (tests, external policies); they count against the memory budget.
LS_API ls_status   ls_engine_set_hot_blocks(ls_engine * e, int32_t il, const int32_t * blocks, int32_t n);

// The blocks layer il's last op computed (a cascade: the kept ones), in plan order; returns how many
// (at most cap are written). For tests and traces.
LS_API int32_t     ls_engine_last_plan(const ls_engine * e, int32_t il, int32_t * blocks, int32_t cap);

// The candidates of layer il's last cascade op (gate/up computed), in plan order; returns how many.
LS_API int32_t     ls_engine_last_candidates(const ls_engine * e, int32_t il, int32_t * blocks, int32_t cap);

// score[n_blocks] = the sketch's scores of layer il's blocks for FFN input x [n_embd] (one
// thread; what the cascade op computes first). LS_ERR_UNSUPPORTED if the layer has no sketch.
LS_API ls_status   ls_engine_sketch_scores(ls_engine * e, int32_t il, const float * x, float * score, int32_t n_blocks);

// resident[b] = 1 if block b of layer il is in the weight cache now (loaded or loading).
LS_API ls_status   ls_engine_resident(const ls_engine * e, int32_t il, uint8_t * resident, int32_t n_blocks);

// The converter's activation profile (converters/profile_pass.py). While set, every op of layer il
// on the dense and predicted paths writes act(gate.x)*up.x of each neuron it computes to
// h [rows][n_blocks*k], by slot (block b's neuron j at b*k + j), for the first `rows` token rows of
// the op; padding slots and neurons not computed keep what they held. h NULL turns it off. The
// caller owns h and keeps it alive while set; set and read it between decodes only.
LS_API ls_status   ls_engine_set_capture(ls_engine * e, int32_t il, float * h, int32_t rows);

// Token rows layer il's last op wrote to its capture (0: none since the capture was set).
LS_API int32_t     ls_engine_capture_rows(const ls_engine * e, int32_t il);

// LS2 sketch rows (the format: native/src/sketch.c) of f32 w [n_rows, n_embd], n_embd a multiple of
// 64, into out [n_rows, n_embd * 5 / 16], on n_threads threads: the converter's sketch stage (its
// numpy reference: converters/sketch.py quantize_rows).
LS_API void        ls_sketch_quantize_ls2(const float * w, int64_t n_rows, int64_t n_embd, uint8_t * out,
                                          int32_t n_threads);

// Geometry of one layer, as read from its block file header.
typedef struct ls_layer_info {
    int64_t  n_embd;
    int64_t  n_ff;
    int32_t  neurons_per_block;  // k
    int32_t  n_blocks;
    int32_t  gate_type;          // enum ggml_type
    int32_t  up_type;
    int32_t  down_type;          // type of the transposed down columns
    uint64_t block_stride;       // bytes per block on disk and in RAM (aligned)
    uint64_t block_payload;      // bytes of real data per block (stride - padding)
    uint64_t data_offset;        // file offset of block 0
    int32_t  split_layout;       // 1: resident for good and rewritten with all gate/up rows apart
                                 // from all down columns (a sparse op streams only what it uses)
} ls_layer_info;

LS_API ls_status   ls_engine_layer_info(const ls_engine * e, int32_t il, ls_layer_info * out);

// ---- counters (README: metrics) -----------------------------------------------------------------

typedef struct ls_stats {
    uint64_t op_calls;         // FFN op executions
    uint64_t tokens;           // token rows processed
    uint64_t blocks_computed;  // blocks computed with (cascade: the candidates)
    uint64_t blocks_read;      // blocks read from disk (cache misses)
    uint64_t bytes_read;
    uint64_t bytes_computed;   // weight bytes computed with: whole blocks, or (cascade) the gate/up
                               // rows of every candidate + the down columns of the kept ones
    uint64_t bytes_unused;     // bytes read but evicted before ever being computed
    uint64_t reads_issued;     // read syscalls (after merging adjacent blocks)
    uint64_t io_stall_ns;      // compute threads waiting for blocks (summed over threads)
    uint64_t op_ns;            // wall time inside the op (thread 0)
    uint64_t predictor_ns;
    uint64_t cache_bytes;      // bytes of FFN weights resident now
    uint64_t cache_capacity;   // budget in bytes (after rounding to blocks)
    uint64_t blocks_prefetched; // blocks queued for layer il+1 while layer il computed
    uint64_t direct_io;        // 1 if block reads bypass the page cache (O_DIRECT)
    uint64_t hot_blocks;       // blocks kept resident for good: the hot set (dense: the pinned prefix)
    uint64_t checksum_ns;      // time verifying block checksums (summed over compute threads)
    // exact-input selection (bytes_computed counts gate/up of every candidate + down of the kept)
    uint64_t blocks_candidates; // blocks whose gate/up rows were computed as candidates
    uint64_t down_skipped;     // candidates whose down columns were not computed
    uint64_t spec_hits;        // kept blocks that the layer-ahead prediction had prefetched
    uint64_t spec_selected;    // kept blocks of ops that had a prefetch (recall = hits / selected)
    uint64_t scorer_ns;        // wall time scoring the sketch (thread 0's view)
    uint64_t resident_bytes;   // sketches + predictors held in RAM (part of memory_budget)
    // read planning (engine-wide except bytes_bridged)
    uint64_t bytes_bridged;    // bytes read through gaps between selected blocks and dropped (in bytes_read)
    uint64_t io_cpu_ns;        // CPU time of the I/O workers (summed over threads)
    uint64_t io_per_io_ns;     // disk model: time of one more small read at full queue depth (0: not probed)
    uint64_t io_bandwidth;     // disk model: bytes/s of large reads (0: not probed)
    uint64_t bridge_bytes;     // the largest gap a read goes through, in use
    // streaming controller (ls_engine_set_controller)
    uint64_t ctrl_decisions;   // ops whose knobs the controller set (cascade decode ops)
    uint64_t ctrl_ns;          // thread 0's time measuring the state and choosing (summed)
    // the draft FFN of speculative decoding (ls_engine_set_draft); not in the counters above
    uint64_t draft_ops;        // FFN ops run as the draft
    uint64_t draft_tokens;     // token rows they processed
    uint64_t draft_blocks;     // blocks they computed (resident ones only: they read nothing)
    uint64_t draft_ns;         // wall time inside them (thread 0)
} ls_stats;

// il = -1: totals over all layers.
LS_API ls_status   ls_engine_stats(const ls_engine * e, int32_t il, ls_stats * out);
LS_API void        ls_engine_reset_stats(ls_engine * e);

// ---- streaming controller (docs/design.md §20) --------------------------------------------------
// Per cascade decode op, at the layer boundary, the engine measures a state and picks an action:
//   load state  R = bytes of the layer's candidates (at params.candidate_ratio) that are not
//               resident, binned by load_edges (ascending, n_load - 1 of them)
//   disk state  an EWMA of the I/O workers' read time per MiB read (each op's reads), binned by
//               disk_edges (n_disk - 1); the measurement that moves when another process shares
//               the disk
//   action      actions[a]: the op's candidate ratio and its bridge (bridge_scale x the bridge in
//               use; 0: every gap is skipped)
// LS_CTRL_OFF: params as given (today's fixed default); LS_CTRL_FIXED: actions[fixed_action] on
// every layer; LS_CTRL_TABLE: table[(il * n_load + load) * n_disk + disk]; LS_CTRL_PROFILE: a
// uniformly random action per op (seeded), every op recorded as an ls_ctrl_sample (what
// `leanstream tune` estimates its transitions from). The other paths (prefill, dense, predicted)
// are not steered.
enum { LS_CTRL_OFF = 0, LS_CTRL_FIXED = 1, LS_CTRL_TABLE = 2, LS_CTRL_PROFILE = 3 };
#define LS_CTRL_MAX_ACTIONS 16
#define LS_CTRL_MAX_LOAD 16
#define LS_CTRL_MAX_DISK 4

typedef struct ls_ctrl_action {
    float candidate_ratio;   // >= 1
    float bridge_scale;      // >= 0
} ls_ctrl_action;

typedef struct ls_ctrl_policy {
    int32_t        mode;                       // LS_CTRL_*
    int32_t        n_actions;                  // 1..LS_CTRL_MAX_ACTIONS (OFF: may be 0)
    ls_ctrl_action actions[16];                // LS_CTRL_MAX_ACTIONS
    int32_t        fixed_action;               // LS_CTRL_FIXED
    int32_t        n_load;                     // 1..LS_CTRL_MAX_LOAD
    double         load_edges[16];             // LS_CTRL_MAX_LOAD; bytes, n_load - 1 used
    int32_t        n_disk;                     // 1..LS_CTRL_MAX_DISK
    double         disk_edges[4];              // LS_CTRL_MAX_DISK; ns per MiB read, n_disk - 1 used
    const uint8_t * table;                     // [n_layers * n_load * n_disk] action indices (copied)
    uint64_t       seed;                       // LS_CTRL_PROFILE
    int32_t        record;                     // 1: record every op as a sample in any mode (PROFILE: always)
} ls_ctrl_policy;

// One controlled op (LS_CTRL_PROFILE records them; read with ls_engine_ctrl_samples).
typedef struct ls_ctrl_sample {
    uint64_t seq;              // ops recorded before this one (a token's layers are consecutive)
    int32_t  layer;
    int32_t  load_state, disk_state, action;
    uint64_t remaining_bytes;  // R at the boundary
    double   disk_ns_per_mib;  // the disk measurement the state was binned from (0: none yet)
    uint64_t op_ns;            // the op, boundary to boundary
    uint64_t bytes_read;       // what the op's reads brought in (bridged gaps included)
} ls_ctrl_sample;

// Installs a policy (copied; LS_CTRL_OFF restores the parameters as given). Between ops only.
LS_API ls_status   ls_engine_set_controller(ls_engine * e, const ls_ctrl_policy * p);
// Moves up to cap recorded samples (oldest first) into out and returns how many; the recorder
// holds 65536 and drops the oldest beyond that (counted in *dropped, may be NULL).
LS_API int32_t     ls_engine_ctrl_samples(ls_engine * e, ls_ctrl_sample * out, int32_t cap, uint64_t * dropped);
// decisions[a] = how many ops took action a since the policy was installed (n <= LS_CTRL_MAX_ACTIONS).
LS_API ls_status   ls_engine_ctrl_decisions(const ls_engine * e, uint64_t * decisions, int32_t n);

// ---- the draft FFN of speculative decoding (docs/design.md §21) ------------------------------
// While the draft is on, every FFN op computes the blocks that are resident at that moment (the
// pinned set and whatever the cache holds, loaded and checked) exactly, skips the others, and
// reads nothing: the same model with an FFN made of what RAM holds, whose next-token guesses a
// normal (exact) pass then verifies several at a time. Dense mode under a budget given a
// block_rank pins, in every layer, its best-ranked blocks (an equal share of each layer), so that
// this FFN is each layer's most important part; fraction (0, 1] then keeps the draft to each
// layer's best-ranked fraction of its blocks (those resident; 1: every resident block), a
// cheaper draft. Between ops only; counted in the draft_* counters.
LS_API ls_status   ls_engine_set_draft(ls_engine * e, int32_t on, float fraction);

// The output projection (the LM head), for llama_set_output_builder(ctx, ls_output_build, engine)
// (patches/0004): a ggml custom node [n_vocab, n_rows] computing w . cur with ggml's vec_dot for
// batches of up to LS_EXACT_ROWS rows (NULL otherwise: llama.cpp's own matmul). While the draft
// is on it computes only the draft vocabulary's rows (the others -inf) and keeps each row's
// LS_DRAFT_TOP best tokens and their probabilities over that vocabulary.
LS_API struct ggml_tensor * ls_output_build(struct ggml_context * ctx0, struct ggml_tensor * w,
                                            struct ggml_tensor * cur, void * engine);
// The draft's vocabulary: the token ids its output projection computes (copied, duplicates
// dropped; n = 0: every token). Between ops only.
LS_API ls_status   ls_engine_set_draft_vocab(ls_engine * e, const int32_t * ids, int32_t n);
// Row `row` of the last draft op's output: its best tokens (at most cap, best first) and their
// probabilities over the draft vocabulary; returns how many (0: no such row).
LS_API int32_t     ls_engine_draft_top(ls_engine * e, int32_t row, int32_t * ids, float * probs, int32_t cap);

// ---- checksums ---------------------------------------------------------------------------
// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of data[len], continuing from crc
// (0 to start): ls_crc32c(0, "123456789", 9) == 0xE3069283. ls_crc32c uses the CPU's CRC-32C
// instruction (SSE4.2 on x86-64, the CRC extension on aarch64) on three streams where it has one
// (not under LEANSTREAM_ISA=scalar); ls_crc32c_ref is the byte-at-a-time table reference.
LS_API uint32_t    ls_crc32c(uint32_t crc, const void * data, size_t len);
LS_API uint32_t    ls_crc32c_ref(uint32_t crc, const void * data, size_t len);

// ---- kernels (the op's, the head's and the sketch's; exported for tests and benchmarks) --------
// On ggml's block layouts, run with the instruction set ls_kernel_isa() names; the scalar C
// versions (ls_kernels_force("scalar")) are the reference (native/src/kernels.c).
//
// Gate and up of one neuron in one pass: *ra = a . x, *rb = b . x for Q4_K rows a, b (n values,
// n % 256 == 0) and the Q8_K activation x (ggml's vec_dot_q4_K_q8_K math, both rows sharing x's
// loads). While it computes, it prefetches pf_lines cache lines per 256 values from pf on
// (pf_lines 0: none).
LS_API void        ls_dot2_q4_K(int64_t n, const void * a, const void * b, const void * x, float * ra, float * rb,
                                const uint8_t * pf, int32_t pf_lines);
// the same for Q4_1 rows and the Q8_1 activation (ggml's vec_dot_q4_1_q8_1 math); pf_lines per 32 values
LS_API void        ls_dot2_q4_1(int64_t n, const void * a, const void * b, const void * x, float * ra, float * rb,
                                const uint8_t * pf, int32_t pf_lines);
// the same for nr token rows of x (x_stride bytes apart): ra[t], rb[t], each bit for bit what
// ls_dot2_q4_K / ls_dot2_q4_1 gives on row t alone (a verify pass); the rows' nibbles and scales
// unpacked once per few rows, the prefetch stream with the first of them
LS_API void        ls_dot2_q4_K_rows(int64_t n, const void * a, const void * b, const void * x, size_t x_stride,
                                     int32_t nr, float * ra, float * rb, const uint8_t * pf, int32_t pf_lines);
LS_API void        ls_dot2_q4_1_rows(int64_t n, const void * a, const void * b, const void * x, size_t x_stride,
                                     int32_t nr, float * ra, float * rb, const uint8_t * pf, int32_t pf_lines);
// The down projection: acc[0..n) += sum_{j<m} h[j] * column j, m Q8_0 columns (n % 32 == 0) read in
// place (cols[j]: column j's blocks)
LS_API void        ls_axpy_q8_0_multi(float * acc, const float * h, const void * const * cols, int32_t m, int64_t n);
// the same for T rows (h [m][T], acc [T][n]); each row bit for bit as ls_axpy_q8_0_multi on it alone
LS_API void        ls_axpy_q8_0_rows(float * acc, const float * h, const void * const * cols, int32_t m, int64_t T,
                                     int64_t n);
// the same for Q6_K columns (n % 256 == 0)
LS_API void        ls_axpy_q6_K_multi(float * acc, const float * h, const void * const * cols, int32_t m, int64_t n);
LS_API void        ls_axpy_q6_K_rows(float * acc, const float * h, const void * const * cols, int32_t m, int64_t T,
                                     int64_t n);
// acc[t] += sum_j h[j][t] * cols[j] for T token rows (h [n_staged][T]; f32 columns staged in a
// tile, cols [n_staged][n_embd]; acc [T][n_embd])
LS_API void        ls_axpy_tile(float * acc, const float * h, const float * cols, int32_t n_staged, int64_t T,
                                int64_t n_embd);
// a Q8_0 or Q6_K column to f32 (n values), bit for bit ggml's to_float
LS_API void        ls_dequant_q8_0(float * out, const void * col, int64_t n);
LS_API void        ls_dequant_q6_K(float * out, const void * col, int64_t n);
// The LM head's kernel: out[t * out_stride] = w . x[t] for t < T, w one Q6_K weight row of n values,
// x[t] Q8_K rows; each row's bits whatever the rows beside it (native/src/kernels.c: the sum)
LS_API void        ls_head_q6_K(const void * w, int64_t n, const void * const * x, int64_t T, float * out,
                                size_t out_stride);
// One sketch row . x (LS_SKETCH_LS2, n values, n % 64 == 0; x8, dx, xo: x as the sketch quantizes
// it, native/src/sketch.c)
LS_API float       ls_ls2_dot(const uint8_t * row, const int8_t * x8, const float * dx, const float * xo, int64_t n);

// ---- predictor (stacked learnable hashing, paper §3.3) ------------------------------------
// One predictor per FFN layer, loaded from `predictor/blk.<il>.lspred` (format: docs/formats.md).
// It maps a residual-stream vector x [n_embd] f32 -- the layer-ahead input x_{il-1} -- to a
// priority per neuron block [n_blocks] f32 (higher = load/compute first). Evaluation is integer/bitwise (int8 dot products, XNOR + popcount, table lookups)
// and equals the torch inference path bit for bit. A handle holds scratch space: use one
// handle from one thread at a time.

#define LS_PREDICTOR_FILE_VERSION 2   // version 1 files are read too (skip_weight 1)

typedef struct ls_predictor ls_predictor;

typedef struct ls_predictor_info {
    int32_t  n_embd;         // input dimension
    int32_t  n_blocks;       // outputs (neuron blocks of the layer)
    int32_t  n_pca;          // PCA dimensions kept
    int32_t  n_hash_layers;  // L
    int32_t  tau;            // bits per hash code
    int32_t  n_bits;         // d, width of the binary codes
    int32_t  n_tables;       // M hash functions per hashing layer
    int32_t  layer;          // FFN layer the file was trained for
    uint64_t size_bytes;     // file size
    int32_t  skip_weight;    // votes of the previous code in hashing layers >= 2
} ls_predictor_info;

// Load from a file / from memory (copied). Malformed, truncated or other-version input
// returns LS_ERR_FORMAT (LS_ERR_IO if the file cannot be read) with a message in ls_errmsg().
LS_API ls_status   ls_predictor_load(const char * path, ls_predictor ** out);
LS_API ls_status   ls_predictor_load_mem(const void * data, size_t size, ls_predictor ** out);
LS_API void        ls_predictor_free(ls_predictor * p);
LS_API ls_status   ls_predictor_get_info(const ls_predictor * p, ls_predictor_info * out);

// prio[n_blocks] = priorities of the layer's blocks for input x[n_embd]; n_blocks must equal
// the predictor's. One call per layer per refinement step.
LS_API ls_status   ls_predictor_eval(ls_predictor * p, const float * x, float * prio, int32_t n_blocks);

// Same for n rows: x [n_embd, n] (rows contiguous), prio [n_blocks, n].
LS_API ls_status   ls_predictor_eval_batch(ls_predictor * p, const float * x, float * prio,
                                           int32_t n_blocks, int64_t n);

// ---- mixture of experts: routed experts streamed from expert files ------------------------------
// One engine object of its own (ls_moe), beside the dense ls_engine: a layer's routed experts
// (ffn_{gate,up,down}_exps) live in `experts/blk.<il>.bin` (docs/formats.md, "Expert file"); the
// router, a shared expert and the norms stay in llama.cpp's graph. The op computes, exactly as
// llama.cpp's build_moe_ffn with separate gate and up experts does,
//     y[t] = ((p_0 + p_1) + p_2) + ...,   p_k = w[k,t] * down_e . act_q(gate_e . x~_t, up_e . x~_t),
//     e = selected[k,t]
// with ggml's CPU type traits (x~: x quantized once per token to the weight type's vec_dot_type
// by from_float, every row dotted by vec_dot; act's output quantized likewise for down), so any
// type ggml's CPU backend has a vec_dot for works, and the output does not depend on the thread
// count or on I/O timing. Experts are read whole (one expert = one slot of the file) into a cache
// of slots shared by all layers: a pinned hot set, the rest least recently used. A batch's missing
// experts are read with O_DIRECT by the I/O workers in the order they are computed (adjacent file
// slots in one read), once per batch however many tokens route to them; when the cache cannot hold
// them all they stream through it in waves (2 slots free of the hot set suffice).
#define LS_EXPERT_FILE_VERSION 1

typedef struct ls_moe ls_moe;

typedef struct ls_moe_params {
    int32_t  n_layer;          // layers of the model ([n_layer] paths; a NULL path: no experts there)
    uint64_t memory_budget;    // bytes of expert slots kept in RAM, all layers together; 0 (default): every expert
    int32_t  n_io_threads;     // I/O workers, 1..LS_MAX_IO_THREADS, default 8
    uint32_t max_read_bytes;   // adjacent missing experts merge into one read up to this, default 1 MiB
                               // (an expert larger than this is one read of its own)
    int32_t  verify_checksums; // 1 (default): every expert's CRC-32C after each read, before use
    int32_t  activation;       // LS_ACT_SILU (default), LS_ACT_GELU, LS_ACT_RELU or LS_ACT_SWIGLU_OAI
    float    act_alpha, act_limit;  // LS_ACT_SWIGLU_OAI's alpha and limit (llama.cpp: 1.702, 7)
    int32_t  weight_before;    // 1: the router's weight scales each expert's input, not its output
                               // (llama4: out = sum_k expert_k(w_k * x)); 0 (default): sum_k w_k * expert_k(x)
    int32_t  read_ahead;       // LS_AHEAD_OFF (default: on 2 cores it never paid, bench/results) or
                               // LS_AHEAD_AUTO: while layer n computes, the experts layer n+1's
                               // router picks from layer n's input are read (when its router is known:
                               // ls_moe_build finds it in the graph, ls_moe_set_router gives it), a layer
                               // at a time turned off while too few of them are then used (ahead_min_precision),
                               // and on again when they are; LS_AHEAD_ON: always; LS_AHEAD_OFF: never
    float    ahead_min_precision;   // auto: the share of early-read candidates the next op must use, default 0.9:
                               // on 2 cores and a disk the decode waits on, reads that precision 0.6-0.7 wastes
                               // cost more than the early ones save (bench/results: moe-calibrated-*)
    int32_t  ahead_top;        // read ahead only each token's this many best-scored predictions, default 3
                               // (0: all n_used). On the calibrated 48-layer shape the best 3 of 8 were used
                               // 0.92 of the time, all 8 0.61-0.73 (bench/results)
    int32_t  ahead_max_tokens; // batches of at most this many tokens read ahead (the union of their
                               // predictions), default 8; larger ones (prefill) read each expert in waves
    int32_t  evict;            // which cached expert gives way: LS_EVICT_LFU (default: the one used least,
                               // counted per op, from the prior ls_moe_set_uses gives) or LS_EVICT_LRU
    const struct ls_test_hooks * test_hooks; // tests only: io_delay_us, buffered_io, fault, fault_read
                               // (counted over this engine's reads); NULL (default): none
} ls_moe_params;

enum { LS_AHEAD_OFF = 0, LS_AHEAD_AUTO = 1, LS_AHEAD_ON = 2 };
enum { LS_EVICT_LRU = 0, LS_EVICT_LFU = 1 };

typedef struct ls_moe_info {
    int64_t  n_embd;
    int64_t  n_ff_exp;         // neurons of one expert
    int32_t  n_expert;
    int32_t  gate_type, up_type, down_type;   // enum ggml_type, as in the GGUF
    uint64_t expert_stride;    // bytes of one expert on disk and in a cache slot (aligned)
    uint32_t flags;            // 1: per-expert f32 biases of gate, up, down; 2: per-expert scales (formats.md)
} ls_moe_info;

// Counters of one layer (ls_moe_stats; il = -1: summed over layers).
typedef struct ls_moe_counters {
    uint64_t op_calls;         // MoE op executions
    uint64_t tokens;           // token rows processed
    uint64_t routed;           // token-expert pairs computed (tokens x n_used)
    uint64_t experts;          // distinct experts computed (each once per op)
    uint64_t hits;             // ... of them resident when the op began
    uint64_t misses;           // ... read from disk by the op
    uint64_t pin_loads;        // experts read by ls_moe_pin
    uint64_t bytes_read;       // (misses + pin_loads) x expert_stride
    uint64_t reads;            // read calls (adjacent experts merged)
    uint64_t stall_ns;         // thread 0 waiting for experts to arrive
    uint64_t compute_ns;       // thread 0 in the op, not waiting
    uint64_t checksum_ns;      // I/O workers checking experts' CRC-32C
    uint64_t resident;         // experts in the cache now
    uint64_t pinned;           // ... of them pinned (the hot set)
    uint64_t cache_slots;      // slots of the whole cache (the same in every layer's counters)
    uint64_t slot_bytes;       // bytes of one slot (the largest expert, aligned for every file's reads)
    uint64_t direct_io;        // 1: reads bypass the page cache (O_DIRECT)
    // read-ahead (read_ahead): the predictions made for this layer from the layer before it
    uint64_t ahead_ops;        // ops of this layer that had a prediction
    uint64_t ahead_routed;     // distinct experts those ops computed
    uint64_t ahead_predicted;  // ... of them predicted (recall: ahead_predicted / ahead_routed)
    uint64_t ahead_candidates; // predicted experts absent when predicted (what read-ahead may read)
    uint64_t ahead_useful;     // ... of them the op then used (precision: ahead_useful / ahead_candidates)
    uint64_t ahead_reads;      // experts read early
    uint64_t ahead_used;       // ... of them used by the op they were read for (the rest: wasted bytes)
    uint64_t ahead_on;         // layers whose read-ahead is on now (auto turns a layer off and on)
    uint64_t router_known;     // layers whose router the engine has (read-ahead predicts only those)
} ls_moe_counters;

LS_API void        ls_moe_params_init(ls_moe_params * p);   // the only source of defaults
// Opens and checks every layer's expert file (LS_ERR_FORMAT / LS_ERR_CORRUPT / LS_ERR_IO naming
// the file and layer), sizes the cache (LS_ERR_BUDGET when it holds fewer than 2 experts of the
// largest layer) and starts the I/O workers. paths [n_layer].
LS_API ls_status   ls_moe_create(const ls_moe_params * p, const char * const * paths, ls_moe ** out);
LS_API void        ls_moe_free(ls_moe * m);   // after the llama context whose graph uses it
// LS_ERR_ARG when layer il has no expert file.
LS_API ls_status   ls_moe_layer_info(const ls_moe * m, int32_t il, ls_moe_info * out);
// The hot set of layer il: experts [n] (router indices) read now if absent and kept resident for
// good, replacing the layer's previous hot set (n = 0: none). LS_ERR_BUDGET when the hot sets of
// all layers would leave fewer than 2 slots to stream through. Between ops.
LS_API ls_status   ls_moe_pin(ls_moe * m, int32_t il, const int32_t * experts, int32_t n);
// The last error of an op or an I/O worker (then cleared); LS_OK if none.
LS_API ls_status   ls_moe_take_error(ls_moe * m, char * msg, size_t msg_size);

// A ggml_custom_4d node, f32 [n_embd, n_tokens]: layer il's routed experts of cur (f32 [n_embd,
// n_tokens], rows may be strided). selected: i32 [n_used, n_tokens] router indices (a view is fine:
// strides are used); weights: f32 [1, n_used, n_tokens] or [n_used, n_tokens] (strides used). NULL
// (the error kept for ls_moe_take_error) when the shapes do not fit the expert file. The node
// keeps a pointer to moe: free the context's graph before the ls_moe.
LS_API struct ggml_tensor * ls_moe_build(struct ggml_context * ctx0, struct ggml_tensor * cur,
                                         struct ggml_tensor * selected, struct ggml_tensor * weights,
                                         int32_t il, void * moe);
// The same op outside a graph, on n_threads threads of its own: x [n_tokens, n_embd], ids and
// weights [n_tokens, n_used], y [n_tokens, n_embd] (all contiguous). Returns the op's error, if any.
LS_API ls_status   ls_moe_eval(ls_moe * m, int32_t il, const float * x, int64_t n_tokens, const int32_t * ids,
                               const float * weights, int32_t n_used, float * y, int32_t n_threads);

// Layer il's router for read-ahead, as ls_moe_build finds it in the graph: router [n_expert][n_embd]
// f32 (copied), selection = top n_used of router . x (softmax keeps the order). Between ops.
LS_API ls_status   ls_moe_set_router(ls_moe * m, int32_t il, const float * router, int32_t n_expert, int64_t n_embd,
                                     int32_t n_used);
// How many token-expert pairs of layer il were routed to each expert since the engine was made (or
// ls_moe_reset_stats): counts [n_expert] by router index (a hot set's frequencies).
LS_API ls_status   ls_moe_routing_counts(const ls_moe * m, int32_t il, uint64_t * counts, int32_t n_expert);
// LFU's prior of layer il: uses [n_expert] by router index (e.g. the conversion's routing counts),
// replacing what the layer's experts counted so far. Between ops.
LS_API ls_status   ls_moe_set_uses(ls_moe * m, int32_t il, const uint32_t * uses, int32_t n_expert);
LS_API ls_status   ls_moe_stats(const ls_moe * m, int32_t il, ls_moe_counters * out);
LS_API void        ls_moe_reset_stats(ls_moe * m);

// ---- testing -----------------------------------------------------------------------------
// Test hooks of one engine (ls_engine_params.test_hooks; the library holds no test state of its
// own): each read sleeps rand() % io_delay_us µs first (0: off); the read queue holds io_queue_cap
// reads (0: three layers' blocks; when full, the submitting thread reads synchronously) and starts
// io_queue_start long (0: the library's; it doubles as reads wait);
// buffered_io 1: reads go through the page cache instead of O_DIRECT; fault: the fault_read-th
// block read of the engine (1 = its first) fails once, as an EIO, a short read, or bytes that
// arrive corrupt (their checksum then fails).
enum { LS_FAULT_NONE = 0, LS_FAULT_EIO = 1, LS_FAULT_SHORT = 2, LS_FAULT_CORRUPT = 3 };
typedef struct ls_test_hooks {
    uint32_t io_delay_us;
    uint32_t io_queue_cap;
    int32_t  buffered_io;
    int32_t  fault;           // LS_FAULT_*
    uint32_t fault_read;
    uint32_t io_queue_start;
} ls_test_hooks;

// LS_CDEF_END

#ifdef __cplusplus
}
#endif

#endif // LEANSTREAM_H
