// internal.h — structures shared by the engine's source files (not part of the ABI).
//
// One FFN op on layer il (op.c) takes one of four paths, chosen per op by ls_sched_path:
//   dense      every block in file order, in chunks the budget holds (prefill in every mode, and
//              decode in mode dense): all threads compute their share of a chunk, then thread 0
//              lets it go and pins the next
//   predicted  sparse decode selected by the predictors (the baselines; leanstream on a layer
//              without a sketch): thread 0 pins the top blocks by priority and queues layer il+1's
//              prefetch, all threads compute their share
//   cascade    sparse decode selected from the layer's own input (leanstream with a sketch): score
//              the sketch -> thread 0 pins the candidates -> exact gate/up of the candidates ->
//              thread 0 keeps the largest |h| -> down columns of the kept
//   draft      speculative decoding's draft (ls_engine_set_draft, any mode, any batch): the
//              blocks resident now, exactly; nothing pinned, nothing read
// In every path each thread accumulates its share of the plan (the ith of nth contiguous parts)
// into its own partial output, and the output is their sum in thread order (deterministic,
// independent of I/O timing). Thread 0 runs the op under e->op_mu and plans under e->mu.
//
// Policies (what a mode does, how many blocks sparsity s keeps, defaults, the hot set's size)
// have one owner: mode.c.

#ifndef LS_INTERNAL_H
#define LS_INTERNAL_H

#include "leanstream.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <string.h>
#include <sys/uio.h>

// Block states (the per-block ready flags of Algorithm 1).
enum { LS_BLK_ABSENT = 0, LS_BLK_LOADING = 1, LS_BLK_READY = 2, LS_BLK_FAILED = 3 };

// What a mode does (mode.c holds one row per LS_MODE_*).
typedef struct ls_mode_policy {
    const char * name;     // as users spell it ("dejavu+")
    int32_t uses;          // LS_USES_* bits: the model directory's files it reads
    bool    sparse;        // decode computes the top (1 - sparsity) blocks, not all
    bool    prefetch;      // while layer il computes, queue layer il+1's predicted blocks
    bool    keep_cache;    // blocks stay cached after the op (false: oneshot reads every time)
    float   hot_fraction;  // default share of the slots pinned for the calibration-hot blocks;
                           // 0: the mode pins no hot set (params.hot_fraction is ignored)
    float   hot_alone;     // the same without predictors (nothing is prefetched)
} ls_mode_policy;

// A layer's resident sketch of its gate/up rows (sketch.c; format there).
typedef struct ls_sketch {
    int32_t         type;          // LS_SKETCH_LS2
    int64_t         n_rows;        // n_blocks * k, block file slot order
    uint64_t        row_bytes;
    const uint8_t * gate, * up;    // [n_stored][row_bytes] each
    float *         weight;        // [n_rows] 1 or ||down column||; 0 for padding slots
    int32_t *       row;           // [n_rows] stored row of slot r, -1: dropped (its block is in the
                                   // hot set: scored exactly, an always-candidate); NULL: row r = r
    int64_t         n_stored;      // rows still held
    uint8_t *       mem;           // the file's header and rows (anonymous mapping of map_bytes)
    size_t          map_bytes;
    size_t          bytes;         // held: header + 2 * n_stored * row_bytes + the weights
} ls_sketch;

#define LS_COUNTER_FIELD(name) _Atomic uint64_t name;

// A FIFO of work items (item_size bytes each, at most LS_WORKQ_MAX_ITEM) and the threads that run
// them (util.c): the reader's I/O workers (io.c). The ring starts at cap items and doubles as
// items wait, up to max_cap; an item that still finds it full runs in the thread that submits it
// rather than overwrite a queued one. Workers leave once stop is set and the ring is empty.
#define LS_WORKQ_MAX_ITEM 4096
typedef struct ls_workq {
    void         (* run)(void * owner, void * item);   // one item, on a worker (or the submitter)
    void         (* idle)(void * owner);   // a worker finds the ring empty (mu held; NULL: nothing)
    void *          owner;
    size_t          item_size;
    pthread_t *     threads;
    int             n_threads;
    pthread_mutex_t mu;                    // held by the submitter around ls_workq_push
    pthread_cond_t  cv;
    uint8_t *       ring;                  // [cap][item_size]
    int32_t         cap, max_cap, head, count;
    int32_t         n_low;                 // the last n_low items are low priority: other items go before them
    bool            stop;
} ls_workq;

// The error slot of an engine (ls_engine, ls_moe): the first error an I/O worker or an op
// recorded since the last take (later ones are usually consequences).
typedef struct ls_error_slot {
    pthread_mutex_t mu;
    ls_status       status;
    char            msg[LS_MAX_ERRMSG];
} ls_error_slot;

// ---- blocks: what both engines read, keep and check ----------------------------------------------
// A layer's FFN is a set of blocks, each read whole from the layer's file into a slot of one
// cache: a dense layer's neuron blocks (block files: k neurons' gate rows, up rows and down
// columns) or a MoE layer's experts (expert files: one expert's gate, up and down rows, a "slot"
// of the format). One header reader opens both kinds (blockfile.c: the shared fields once, each
// format's own after), one cache keeps them (cache.c: slots of one stride keyed by (layer, block),
// pins, the hot set, one pick_victim) and one reader brings them in (io.c: the queue, merged
// O_DIRECT preadv, CRC-32C, ready flags, injected faults). What stays an engine's own is how a
// layer chooses its blocks (schedule.c: the dense/sparse plan; moe.c: the router's ids) and how
// it computes them (op.c, moe.c).

// The reads of a layer's file (io.c, cache.c): each a field of the public counters of that name.
#define LS_READ_COUNTERS(X) X(blocks_read) X(bytes_read) X(bytes_bridged) X(reads_issued) X(checksum_ns) X(bytes_unused)
typedef struct ls_read_stats { LS_READ_COUNTERS(LS_COUNTER_FIELD) } ls_read_stats;

enum { LS_FILE_NEURONS = 0, LS_FILE_EXPERTS = 1 };   // the formats (docs/formats.md): block file, expert file

// One layer's file of blocks: its geometry and tables (blockfile.c) and each block's place in the
// cache and state (cache.c, io.c). Block b is the b-th block of the file (an expert file's slot b).
typedef struct ls_blockfile {
    int32_t            il;
    int32_t            kind;          // LS_FILE_*
    int                fd;            // the data, O_DIRECT where the file system allows; -1: no file
    char *             path;
    int32_t            n_blocks;
    int32_t            ids_per_block; // k neurons (block file), 1 expert (expert file)
    uint64_t           stride;        // bytes of one block in the file, padding included
    uint64_t           data_offset;   // file offset of block 0
    uint32_t           align;         // the file's O_DIRECT alignment
    int32_t *          ids;           // [n_blocks * ids_per_block] what block b holds: its neurons
                                      // (-1: padding) or its expert (the router's index)
    uint32_t *         crc;           // [n_blocks] CRC-32C of each block's stride bytes
    int32_t *          slot;          // [n_blocks] cache slot, -1: not resident
    _Atomic int32_t *  state;         // [n_blocks] LS_BLK_*
    _Atomic uint8_t *  verified;      // [n_blocks] 1: nothing left to check since it was read
    uint8_t *          hot;           // [n_blocks] 1: in the hot set (resident for good once loaded)
    uint8_t *          hot_pinned;    // [n_blocks] 1: the hot set's pin on its slot is held
    uint32_t *         uses;          // [n_blocks] how often it was used (the cache's LFU eviction: a
                                      // prior from calibration, then one per op that computes it)
    ls_read_stats      stats;
} ls_blockfile;

// The header fields a layer's owner reads, as written (the reader checked them against each other)
typedef struct ls_file_header {
    int64_t  n_embd;
    int64_t  n_ff;                    // the layer's neurons (block file), one expert's (expert file)
    int32_t  type[3];                 // gate, up, down: enum ggml_type
    uint64_t part_bytes[3];           // block file: one gate row, up row, down column; expert file:
                                      // one expert's gate rows, up rows, down rows
    uint32_t flags;                   // expert file: LS_EXPERT_BIASES | LS_EXPERT_SCALES (0: neither)
    uint64_t extra_bytes;             // expert file: the slot's f32 biases and scales before its rows,
                                      // padded to LS_EXPERT_EXTRA_ALIGN (0 without either)
    uint64_t payload;                 // bytes of a block before its padding
} ls_file_header;

// An expert file's flags (the header's u32 at 52): what a slot holds before the gate rows, f32,
// biases first: gate [n_ff], up [n_ff], down [n_embd] (build_moe_ffn's *_exps.bias, added per
// expert), then scales: gate, up, down (its *_exps.scale, one per expert, multiplying each matmul)
enum { LS_EXPERT_BIASES = 1, LS_EXPERT_SCALES = 2 };
#define LS_EXPERT_EXTRA_ALIGN 64

// One cache of blocks for all layers of an engine: n_slots slots of stride bytes. A slot is free
// (slot_layer -1) or holds block slot_block of files[slot_layer]: pinned (slot_pins > 0: an op
// computes it, a read fills it, or the hot set keeps it), or in the LRU list of evictable slots.
// Its metadata is touched by one thread at a time (the engine's planner, under its lock); the
// reader only fills slot memory and flips the blocks' states.
typedef struct ls_cache {
    uint8_t *        pool;            // [n_slots][stride], aligned for every file's O_DIRECT reads
    void *           pool_map;        // the anonymous mapping that holds it (pages count once filled)
    size_t           pool_map_bytes;
    uint64_t         stride;          // slot size: the largest block stride, a multiple of every alignment
    int32_t          n_slots;
    ls_blockfile **  files;           // [n_files] by layer index
    int32_t          n_files;
    int32_t *        slot_layer, * slot_block, * slot_pins;   // [n_slots]
    uint8_t *        slot_computed;   // [n_slots] computed at least once since it was loaded
    int32_t *        lru_prev, * lru_next; // [n_slots] the unpinned resident slots, head = least recently used
    int32_t          lru_head, lru_tail, n_lru;
    int32_t *        free_list;       // [n_slots] stack of free slots (popped 0, 1, 2, ...: adjacent blocks, adjacent slots)
    int32_t          n_free, n_resident;
    bool             never_evicts;    // a slot for every block of every file
    int32_t          evict;           // LS_EVICT_LRU (the dense engine's) or LS_EVICT_LFU (files' uses)
    // LFU: the LRU list's slots also in a min-heap by (uses, released), so a victim is found
    // without a scan (a block's uses change only while it is out of the list: pinned or absent)
    int32_t *        heap;            // [n_slots] slots, heap[0] the least used (least recent of equals)
    int32_t *        heap_pos;        // [n_slots] a slot's index in heap, -1: not in it
    uint64_t *       released;        // [n_slots] when the slot last entered the list
    uint64_t         clock;
} ls_cache;

// Where a block's CRC-32C is checked after each read (io.c)
enum {
    LS_CHECK_NONE = 0,   // not at all (verify_checksums 0)
    LS_CHECK_ON_READ,    // by the I/O worker that read it, before its ready flag flips (MoE: an expert
                         // is checked while the one before it computes)
    LS_CHECK_ON_USE,     // by the compute thread about to use it first (ls_io_check; dense): that thread
                         // would otherwise wait, and the bytes it pulls into its cache are the ones it
                         // reads next; on the workers it measured 1.5-2x slower decode on 2 busy cores
                         // (README: "Checksum cost"), where they need CPU time the compute threads hold
};

// One read of a contiguous range of one layer's file: blocks into their (scattered) cache slots,
// and the unselected blocks between them (a bridged gap: cheaper to read than another I/O, see
// io.c) into the reader's bridge buffer, where they are dropped.
#define LS_MAX_IOV 64
#define LS_IO_QUEUE_START 256   // the read queue's first length (io.c)
typedef struct ls_read {
    ls_blockfile *    F;
    int32_t           n_iov, n_blocks;
    uint64_t          offset;
    uint64_t          bridged;           // bytes of iovecs that go to the bridge buffer
    _Atomic int32_t * flags;             // [n_blocks] set with each block's state as it lands (NULL: none)
    int32_t           block[LS_MAX_IOV]; // the block iov[i] receives; -1: a bridged gap
    struct iovec      iov[LS_MAX_IOV];
} ls_read;
_Static_assert(sizeof(ls_read) <= LS_WORKQ_MAX_ITEM, "a read is a work item");

struct ls_test_hooks;
// What an engine gives its reader (ls_io_start).
typedef struct ls_io_config {
    const ls_cache *      cache;          // reads land in its slots
    ls_error_slot *       err;            // failed reads and corrupt blocks are recorded there
    const struct ls_test_hooks * hooks;   // injected delays and faults (all zero: none)
    int                   n_threads;      // I/O workers: the reads in flight
    int32_t               max_queue;      // reads the queue may hold (it starts shorter, and grows)
    uint32_t              max_read_bytes; // adjacent blocks merge into one read up to this
    int32_t               check;          // LS_CHECK_*
} ls_io_config;

typedef struct ls_io {
    ls_workq        q;          // of ls_read (grows to max_cap as reads wait)
    const ls_cache * cache;
    ls_error_slot * err;
    int32_t         check;      // LS_CHECK_*
    uint32_t        max_read_bytes;
    _Atomic int32_t sleepers;   // threads asleep on a block's state or a read's flag (woken as reads land)
    uint32_t        delay_us;   // test hooks: jitter, and one read that fails
    int32_t         fault;
    _Atomic int64_t fault_countdown;
    uint8_t *       bridge;     // bridged gaps land here (every read shares it: nobody reads it)
    uint64_t        bridge_bytes; // largest gap a read goes through (0: none)
    uint64_t        per_io_ns;  // the disk model (io_probe): time of one small read at full depth
    uint64_t        bandwidth;  // bytes/s of large reads
    _Atomic uint64_t cpu_ns;    // CPU time of the I/O workers (summed)
    uint64_t        op_bridge;  // the bridge of the reads being submitted (the controller's; else bridge_bytes)
    uint64_t        bridge_cap; // bytes the bridge buffer holds (the largest bridge any op may use)
    _Atomic uint64_t read_ns, read_bytes; // time inside preadv and bytes it brought (the controller's disk state)
} ls_io;

// ---- the dense engine's layers -------------------------------------------------------------------

// Per-layer counters: each is a field of the public ls_stats of the same name (ls_engine_stats
// sums them and the file's LS_READ_COUNTERS over layers); the list is written once, here.
#define LS_LAYER_COUNTERS(X) \
    X(op_calls) X(tokens) X(blocks_computed) X(bytes_computed) \
    X(io_stall_ns) X(op_ns) X(predictor_ns) X(blocks_prefetched) \
    X(blocks_candidates) X(down_skipped) X(spec_hits) X(spec_selected) X(scorer_ns) \
    X(ctrl_decisions) X(ctrl_ns) X(draft_ops) X(draft_tokens) X(draft_blocks) X(draft_ns)
typedef struct ls_layer_stats { LS_LAYER_COUNTERS(LS_COUNTER_FIELD) } ls_layer_stats;

struct ls_predictor;

typedef struct ls_layer {
    struct ls_engine * e;
    int32_t            il;
    ls_blockfile       f;               // the block file: perm = f.ids [n_blocks * k], its blocks' slots and states
    ls_layer_info      info;
    uint64_t           gate_row_bytes, up_row_bytes, down_col_bytes;
    bool               pinned_forever;  // every block resident in a cache that never evicts
    // split layout (resident.c): once pinned for good, the layer's slots are rewritten so that the
    // gate/up rows of all its blocks sit together and the down columns together; NULL: not split
    const uint8_t **   gu_ptr;          // [n_blocks] gate rows then up rows of block b
    const uint8_t **   dn_ptr;          // [n_blocks] down columns of block b
    // sparse decode
    struct ls_predictor * pred;         // priorities of this layer's blocks (NULL: none)
    float *            prio;            // [n_blocks] priorities for the next op, valid if prio_ready
    bool               prio_ready;
    int32_t *          prefetch;        // [n_blocks] blocks pinned ahead of this layer's op
    int32_t            n_prefetch;
    int32_t *          rank_order;      // [n_blocks] dense mode given a block_rank: blocks best first (NULL: none)
    int32_t *          order;           // [n_blocks] scratch: blocks sorted by priority
    uint8_t *          mark;            // [n_blocks] planner scratch, 0xFF between calls
    uint8_t *          in_prefetch;     // [n_blocks] 1: in prefetch[] (holds a prefetch pin)
    int32_t *          last_plan;       // [n_blocks] blocks computed by the last op, in order
    int32_t            n_last_plan;
    // exact-input selection (sketch.c, schedule.c)
    ls_sketch *        sketch;          // NULL: none (the layer selects by its predictor)
    int32_t            n_always;        // hot blocks whose sketch rows were dropped: always candidates
    uint8_t *          spec;            // [n_blocks] 1: prefetched for this op (speculation recall)
    int32_t *          last_cand;       // [n_blocks] candidates of the last cascade op (gate/up computed)
    int32_t            n_last_cand;
    // the converter's profile (ls_engine_set_capture): act(gate)*up of each computed neuron,
    // f32 [capture_rows][n_blocks*k] by slot; NULL: off
    float *            capture;
    int32_t            capture_rows;
    int32_t            capture_n;       // token rows the last op wrote
    ls_layer_stats     stats;
} ls_layer;

typedef struct ls_barrier {
    _Atomic int      count;
    _Atomic int32_t  gen;        // (wraps; only compared for change)
    _Atomic int32_t  sleepers;   // threads asleep on gen
} ls_barrier;

// The path an op takes (op.c: one function each), chosen by thread 0 before the first barrier.
typedef enum { LS_PATH_FAILED = 0, LS_PATH_DENSE, LS_PATH_PREDICTED, LS_PATH_CASCADE, LS_PATH_DRAFT } ls_path;

// The op's state, by path. Thread 0 writes it, every compute thread reads it between barriers;
// one op of an engine runs at a time (e->op_mu).
#define LS_MAX_CHUNKS 64

// dense: the plan cut into chunks the budget holds, [end[c-1], end[c])
typedef struct ls_chunks {
    int32_t    n;
    int32_t    end[LS_MAX_CHUNKS];
    bool       stop;            // the next chunk could not be pinned: the op ends (error recorded)
} ls_chunks;

// cascade: scratch of the exact-input selection, sized at creation for the widest layer
// (candidate entry i = plan entry i; sel[0, n_sel): the entries whose down columns are computed)
typedef struct ls_cascade {
    float *    score;           // [max n_blocks] sketch score of every block of the layer
    float *    hval;            // [max n_blocks * k] h of candidate entry i, neuron j at i*k + j
    float *    hscore;          // [max n_blocks] sum |h| (* weight) of candidate entry i
    uint8_t *  loaded;          // [max n_blocks] 1: candidate entry i was computed (its block arrived intact)
    float *    dh;              // [max n_blocks * k] h of the kept neurons, by kept entry (down pass)
    const void ** dcols;        // [max n_blocks * k] their down columns
    int32_t *  sel;             // [max n_blocks] selected candidate entries, ascending
    int32_t    n_sel;
    uint8_t *  xs;              // x quantized for the sketch rows' vec_dot
} ls_cascade;

// every path: the quantized input and each thread's buffers, grown by thread 0 for the op's shape
typedef struct ls_op_buffers {
    uint8_t *  xq;              // quantized input: gate type's vec_dot rows, then up's if different
    size_t     xq_cap;
    float *    acc;             // [nth][n_tokens * n_embd] per-thread partial outputs
    size_t     acc_cap;         // floats
    float *    work;            // [nth][work_per_thread] h values and dequantized down columns
    size_t     work_cap, work_per_thread;
} ls_op_buffers;

// every path: which blocks the op computes and which of them it holds pins on
typedef struct ls_plan {
    ls_layer * L;
    ls_path    path;
    int32_t *  blocks;          // [n] block ids in compute order (cascade: the candidates)
    int32_t    n;
    int32_t    pin_lo, n_pinned; // plan entries [pin_lo, n_pinned) hold a pin of this op
    int64_t    n_tokens;
    int        nth;
    int        n_shares;    // partial outputs the op sums (op.c: LS_ROW_SHARES, or nth for prefill)
    int32_t *  scratch, * scratch2; // [max n_blocks] each (thread 0's planner)
    ls_chunks     chunks;       // LS_PATH_DENSE
    ls_cascade    cascade;      // LS_PATH_CASCADE
    ls_op_buffers buf;
} ls_plan;

// The streaming controller (control.c): the policy in force and what it measured.
#define LS_CTRL_RING 65536
typedef struct ls_ctrl {
    ls_ctrl_policy   pol;            // table pointer replaced by the owned copy below
    uint8_t *        table;          // [n_layers * n_load * n_disk]
    uint64_t         rng;
    double           disk_ewma;      // ns per MiB read (0: nothing measured yet)
    uint64_t         last_read_ns, last_read_bytes;
    uint64_t         decisions[LS_CTRL_MAX_ACTIONS];
    // the op being controlled (thread 0)
    bool             active;
    ls_ctrl_sample   cur;
    uint64_t         bytes0;         // the layer's bytes_read when the op was planned
    ls_ctrl_sample * ring;           // LS_CTRL_PROFILE
    uint64_t         ring_head, ring_count, dropped, seq;
} ls_ctrl;

// The output projection's state (head.c): the draft vocabulary and the last draft op's top tokens.
typedef struct ls_head {
    int32_t *  vocab;            // [n_vocab_draft] token ids, ascending (NULL: every token)
    int32_t    n_vocab_draft;
    bool       ok, draft;        // this op: scratch ready; computed as the draft
    int32_t    n_rows;           // rows of the last draft op (0: none)
    int32_t *  top;              // [n_rows][LS_DRAFT_TOP] best tokens of each row, best first (-1: none)
    float *    prob;             // [n_rows][LS_DRAFT_TOP] their softmax over the draft vocabulary
    uint8_t *  xq;               // [n_rows] x rows quantized to the weights' vec_dot type
    int32_t *  all;              // [n_vocab] 0, 1, ... (the draft vocabulary when none is set)
    size_t     xq_cap, top_cap, prob_cap, all_cap;   // bytes
} ls_head;

struct ls_engine {
    ls_engine_params params;         // defaults resolved (ls_params_resolve)
    const ls_mode_policy * policy;   // params.mode's row of the mode table
    int32_t          n_layers;
    ls_layer *       layers;
    ls_cache         cache;
    ls_io            io;
    ls_barrier       barrier;
    ls_plan          plan;
    // one op at a time: thread 0 holds op_mu for the whole op (the plan and the barrier are the
    // engine's), and so do the setters that change what an op reads (draft, priorities, hot
    // blocks, controller), so that they apply between ops
    pthread_mutex_t  op_mu;
    // the state other threads read while an op runs (cache metadata, the layers' last plans, the
    // controller's record): thread 0 takes mu where it changes it (planning, the next chunk, the end)
    pthread_mutex_t  mu;
    ls_error_slot    err;
    bool             direct_io;      // O_DIRECT active on the block files
    int32_t          n_hot;          // blocks marked hot (kept resident once loaded)
    uint64_t         resident_bytes; // sketches + predictors (taken from the memory budget)
    ls_ctrl          ctrl;           // the streaming controller (control.c)
    bool             draft;          // ops compute the resident blocks only (ls_engine_set_draft)
    float            draft_fraction; // of each layer's blocks by rank (1: every resident block)
    ls_test_hooks    hooks;          // params.test_hooks (copied; zero: none)
    ls_head          head;           // the output projection's (head.c)
};

// Files and who calls whom (no loops: a file calls only files below it in this list):
//   graph.c      ls_ffn_build: the ggml node                 -> op.c util.c
//   head.c       ls_output_build: the LM head's node, the draft vocabulary -> dispatch.c cpu.c util.c
//   moe.c        the MoE engine: lifetime, the router's blocks, its op and node, counters -> moe_ahead.c io.c cache.c blockfile.c kernels.c cpu.c util.c
//   moe_ahead.c  read-ahead: the next layer's router on this layer's input, its early reads, their scores -> io.c cache.c cpu.c util.c
//   op.c         the op's three paths, ls_ffn_eval_layers     -> schedule.c control.c engine.c sketch.c dispatch.c kernels.c io.c cache.c util.c
//   schedule.c   selection, chunks, pins, prefetch            -> control.c cache.c io.c predictor.c mode.c util.c
//   control.c    the streaming controller: state, lookup       -> util.c
//   engine.c     lifetime, budget -> slots, counters          -> control.c blockfile.c sketch.c cache.c io.c predictor.c mode.c dispatch.c util.c
//   sketch.c     resident gate/up sketch, exact-input scores   -> dispatch.c kernels.c checksum.c util.c
//   io.c         the reader: queue, merged O_DIRECT reads, CRC-32C checks, ready flags, faults, disk model -> cache.c checksum.c util.c
//   cache.c      the cache: slots by (layer, block), pins, hot set, eviction -> util.c
//   blockfile.c  the header reader of block and expert files, their tables, descriptor -> checksum.c cpu.c util.c
//   checksum.c   CRC-32C                                      -> dispatch.c util.c
//   predictor.c  hashing predictor files and evaluation        -> util.c
//   dispatch.c   the kernels' variant per CPU, start-up checks, entry points -> kernels_x86.c kernels_neon.c checksum_x86.c checksum_neon.c kernels.c
//   kernels_x86.c, kernels_neon.c  the kernels' SIMD variants   -> kernels.c
//   checksum_x86.c, checksum_neon.c  the CRC-32C instructions   (leaves)
//   kernels.c    the kernels in scalar C: activations, gate/up, down projection, head, sketch dot (leaf)
//   mode.c       mode table, kept-blocks count, defaults, hot set -> util.c
//   util.c       errors, clock, spin, barrier, thread team, safe open and read, work queue (leaf)

#define LS_DEFAULT_SPARSITY 0.5f
#define LS_DEFAULT_CANDIDATE_RATIO 1.5f

// The setters that change what an op reads run between ops (e->op_mu) and are seen whole by the
// readers (e->mu).
static inline void ls_engine_lock_between_ops(ls_engine * e) { pthread_mutex_lock(&e->op_mu); pthread_mutex_lock(&e->mu); }
static inline void ls_engine_unlock_between_ops(ls_engine * e) { pthread_mutex_unlock(&e->mu); pthread_mutex_unlock(&e->op_mu); }

// util.c
void        ls_set_error(const char * fmt, ...) __attribute__((format(printf, 1, 2)));
// *p holds at least need elements of elem bytes (64-byte aligned; *cap counts elements): grown
// when smaller, the old contents dropped; false when out of memory
bool        ls_grow(void ** p, size_t * cap, size_t need, size_t elem);
void        ls_engine_record_error(ls_engine * e, ls_status st, const char * fmt, ...)
                __attribute__((format(printf, 3, 4)));
void        ls_error_record(ls_error_slot * slot, ls_status st, const char * fmt, ...)
                __attribute__((format(printf, 3, 4)));
// the error slot: *slot keeps (st, the message) unless it holds an error already; take: the kept
// status (LS_OK: none) and message into msg, the slot emptied
void        ls_error_slot_record(ls_error_slot * slot, ls_status st, const char * fmt, va_list ap)
                __attribute__((format(printf, 3, 0)));
ls_status   ls_error_slot_take(ls_error_slot * slot, char * msg, size_t msg_size);
// what an eval call returns: the slot's error (taken) as the thread's message (ls_errmsg), or LS_OK
ls_status   ls_error_slot_raise(ls_error_slot * slot);
// A create's failure: obj freed by free_obj (whose cleanup may set messages of its own) and the
// first failure's message kept; returns st.
ls_status   ls_create_failed(ls_status st, void (* free_obj)(void *), void * obj);
uint64_t    ls_now_ns(void);
struct stat;
ls_status   ls_open_regular(const char * path, int * fd, struct stat * st);
// *fd: the data's descriptor of path, the file st describes (the one whose header was read),
// O_DIRECT unless use_direct_io is false or the file system refuses it (then *direct_io cleared)
ls_status   ls_open_data(const char * path, const struct stat * st, bool use_direct_io, bool * direct_io, int * fd);
// iov's n_iov (<= LS_MAX_IOV) pieces read from fd at offset, resumed after short reads and EINTR:
// NULL when they all arrived, else why not ("I/O error", "short read ..."), *err its errno (0: none)
const char * ls_preadv_all(int fd, const struct iovec * iov, int n_iov, uint64_t offset, int * err);
// the queue's mu, cv, ring (cap items, up to max_cap) and n_threads workers; run, idle, owner and
// item_size set before. stop: every queued item run, the workers joined, all freed (idempotent).
ls_status   ls_workq_start(ls_workq * q, int n_threads, int32_t cap, int32_t max_cap);
void        ls_workq_stop(ls_workq * q);
// called with q->mu held: the item (item_size bytes, copied) queued, or run now if the ring is full
void        ls_workq_push(ls_workq * q, const void * item);
// the same, low: behind every item (others pushed later still go before it), else before the low ones
void        ls_workq_push_at(ls_workq * q, const void * item, bool low);
void        ls_barrier_wait(ls_barrier * b, int n);
// fn(ctx, ith, n_threads) on n_threads (<= LS_MAX_TEAM) threads at once, ith 0 on the calling
// thread: all of them or none (false: not every thread could be started; fn did not run)
#define LS_MAX_TEAM 64
bool        ls_run_team(void (* fn)(void * ctx, int ith, int nth), void * ctx, int n_threads);
// wait while *word == value: spin briefly, then sleep (counted in *sleepers); ls_wake after a change
void        ls_wait_while(_Atomic int32_t * word, int32_t value, _Atomic int32_t * sleepers);
void        ls_wake(_Atomic int32_t * word, _Atomic int32_t * sleepers);

// head.c
void        ls_head_free(ls_head * H);

// mode.c
const ls_mode_policy * ls_mode_policy_of(int32_t mode);      // NULL for an unknown mode
ls_status   ls_params_resolve(ls_engine_params * p);        // the mode's defaults filled in, ranges checked
int32_t     ls_hot_set_size(int32_t n_slots, int32_t working_set, double hot_fraction);
// hot[il][b] = 1 for the n_hot best-ranked blocks of all layers (rank: layer after layer)
// The flat indices (layer after layer) of all blocks, best-ranked first (ties: lower index first)
ls_status   ls_mode_rank_order(int32_t n_layers, const int32_t * n_blocks, const float * rank, int32_t ** order, int64_t * total);
ls_status   ls_mode_pick_hot(int32_t n_layers, const int32_t * n_blocks, const float * rank, int32_t n_hot,
                             uint8_t ** hot);
// hot[il][b] = 1 for n_hot blocks shared out over the layers in proportion to their blocks (the
// remainder to the first layers), each layer's best-ranked ones (dense mode's pinned set: every
// layer keeps its most used part for the draft FFN)
// out[b] = the mean rank of the run of `run` consecutive blocks b is in (a run ranks as one;
// within it, file order)
void        ls_mode_run_rank(int32_t n_blocks, const float * rank, int32_t run, float * out);
// *order: one layer's blocks best-ranked first (ties: lower index first), malloc'd
ls_status   ls_mode_rank_layer(int32_t n_blocks, const float * rank, int32_t ** order);
ls_status   ls_mode_pick_hot_per_layer(int32_t n_layers, const int32_t * n_blocks, const float * rank, int32_t n_hot,
                                       uint8_t ** hot);

// blockfile.c: the one header reader. Layer il's file of the given kind (LS_FILE_*) opened into
// F: its header checked field by field (the fields both formats share once, then the format's own;
// every file is treated as hostile), its tables read and checked against meta_crc, what each
// block holds checked to be a permutation, every block absent; *h: the fields its owner reads.
// The data descriptor is O_DIRECT unless use_direct_io is false or the file system refuses it
// (then *direct_io is cleared).
uint64_t    ls_expert_extra_bytes(uint32_t flags, int64_t n_embd, int64_t n_ff);   // f32 extras, padded
ls_status   ls_blockfile_open(ls_blockfile * F, int32_t kind, int32_t il, const char * path, bool use_direct_io,
                              bool * direct_io, ls_file_header * h);
void        ls_blockfile_close(ls_blockfile * F);   // (a zeroed F too)

// cache.c: the one cache. The slot size for these files (the largest block stride, a multiple of
// every file's alignment), and how many slots `bytes` hold beside `reserved` (0 bytes: a slot for
// every block): the one place a budget's bytes become slots.
uint64_t    ls_cache_stride(ls_blockfile * const * files, int32_t n_files);
int64_t     ls_cache_slots(uint64_t bytes, uint64_t reserved, uint64_t stride, int64_t total_blocks);
ls_status   ls_cache_init(ls_cache * c, ls_blockfile * const * files, int32_t n_files, int32_t n_slots);
void        ls_cache_free(ls_cache * c);
static inline uint8_t * ls_cache_slot_ptr(const ls_cache * c, int32_t slot) { return c->pool + (size_t) slot * c->stride; }
// Pin block b of F (an op computes it, or a read fills it): its slot, and whether it must be read
// (*miss: a slot taken, free or the victim's, the block LOADING). LS_ERR_BUDGET: every slot pinned.
ls_status   ls_cache_acquire(ls_cache * c, ls_blockfile * F, int32_t b, int32_t * slot, bool * miss);
// One pin let go (computed: the block was computed with). With none left the block becomes the
// most recently used evictable one, or, when its read failed, its slot is freed (read again next time).
void        ls_cache_release(ls_cache * c, ls_blockfile * F, int32_t b, bool computed);
// Free block b's slot now (pinned or not). loaded: its bytes arrived (counted as unused if
// never computed); false for a failed or withdrawn read.
void        ls_cache_drop(ls_cache * c, ls_blockfile * F, int32_t b, bool loaded);
// Block b in the hot set (kept resident for good once loaded: a pin of its own) or out of it.
void        ls_cache_set_hot(ls_cache * c, ls_blockfile * F, int32_t b, bool hot);
int32_t     ls_cache_available(const ls_cache * c); // slots free or evictable

// io.c: the one reader. Workers started (the queue's size and the injected delay and fault from
// the config); stop: every queued read done, the workers joined.
ls_status   ls_io_start(ls_io * io, const ls_io_config * cfg);
void        ls_io_stop(ls_io * io);
// The disk model: per-I/O time and bandwidth measured on the cache's files (probe = true), and
// from them the largest gap a read bridges (bridge_bytes < 0), or the bridge given.
ls_status   ls_io_plan_model(ls_io * io, bool probe, int64_t bridge_bytes);
// Queue the reads of blocks[0, n) of F (slots acquired, states LOADING; in file order within
// runs), merging blocks whose gap costs less than another I/O (io->op_bridge; 0: adjacent blocks
// only), up to max_read_bytes per read, in the order given. flags: NULL, or [n] words each set
// to block i's state (LS_BLK_READY / LS_BLK_FAILED) when it lands, as its state is.
void        ls_io_submit(ls_io * io, ls_blockfile * F, const int32_t * blocks, int32_t n, _Atomic int32_t * flags);
// the same at low priority (read-ahead): reads submitted later without it go first
void        ls_cache_reorder(ls_cache * c);   // LFU: the blocks' uses were set (ls_moe_set_uses)
void        ls_io_submit_low(ls_io * io, ls_blockfile * F, const int32_t * blocks, int32_t n);
// LS_CHECK_ON_USE: block b (its bytes at blk, landed) checked against its CRC-32C by the compute
// thread about to use it first; false (the block FAILED, the error recorded) on a mismatch.
bool        ls_io_check(ls_io * io, ls_blockfile * F, int32_t b, const uint8_t * blk);

// control.c (thread 0, under e->mu): choose the cascade op's candidate count and bridge from the
// measured state (scores in e->plan.cascade.score); the op's sample is closed by ls_ctrl_end
// remaining: bytes of the default candidates not resident; returns the op's candidate ratio (and
// sets e->io.op_bridge), or params.candidate_ratio when no policy is in force
float       ls_ctrl_choose(ls_engine * e, ls_layer * L, uint64_t remaining);
void        ls_ctrl_end(ls_engine * e, ls_layer * L, uint64_t op_ns);
void        ls_ctrl_free(ls_engine * e);

// schedule.c (thread 0, inside the op; under e->mu where it pins, unpins or records)
ls_path     ls_sched_path(const ls_engine * e, const ls_layer * L, int64_t n_tokens);
// dense: every block in file order, cut into chunks; the first chunk pinned and its reads queued
ls_status   ls_sched_plan_dense(ls_engine * e, ls_layer * L);
// let chunk c - 1 go, pin chunk c
ls_status   ls_sched_next_chunk(ls_engine * e, int32_t c);
// predicted: the top (1 - sparsity) blocks by priority, in file order, pinned; layer il+1 prefetched
ls_status   ls_sched_plan_predicted(ls_engine * e, ls_layer * L, const float * x_res);
// draft: the layer's blocks that are resident and loaded now, in file order; nothing pinned
void        ls_sched_plan_draft(ls_engine * e, ls_layer * L);
// cascade: the candidates from P->cascade.score pinned (layer il+1 prefetched); the kept set from P->cascade.hscore
ls_status   ls_sched_plan_cascade(ls_engine * e, ls_layer * L, const float * x_res);
// A resident layer (pinned for good) whose gate/up rows cost no more bytes than its sketch plus
// the candidates' rows: the cascade computes h for every block and skips the sketch.
bool        ls_sched_cascade_all(const ls_engine * e, const ls_layer * L);
void        ls_sched_select_final(ls_engine * e);
// unpin what the op still holds, record its plan; *all_ready: every planned block arrived
void        ls_sched_finish(ls_engine * e, bool * all_ready);

// sketch.c
ls_status   ls_sketch_load(const char * path, const ls_layer * L, ls_sketch ** out);
void        ls_sketch_free(ls_sketch * k);
size_t      ls_sketch_xq_bytes(const ls_sketch * k, int64_t n_embd);
void        ls_sketch_quantize_x(const ls_sketch * k, const float * x, void * xq, int64_t n_embd);
// Drop the rows of the blocks with drop[b] != 0 (the hot set: their exact gate/up rows stay
// resident, so the sketch need not score them) and give their memory back; idempotent.
ls_status   ls_sketch_drop_blocks(ls_sketch * k, const uint8_t * drop, int32_t kk);
// score[b] for blocks [b0, b1) of input xq (quantized by ls_sketch_quantize_x); a block whose
// rows were dropped scores +inf (always a candidate)
void        ls_sketch_score(const ls_sketch * k, const void * xq, int64_t n_embd, int32_t act, int32_t kk,
                            int32_t b0, int32_t b1, float * score);

// kernels.c, dispatch.c (the kernels themselves: leanstream.h, ls_dot2_q4_K ...; their variants: kernels.h)
typedef struct { uint16_t d; int8_t qs[32]; } ls_block_q8_0;   // ggml's block_q8_0
#define LS_Q6_K_BYTES 210                                       // ggml's block_q6_K (256 values)
float       ls_act(int32_t activation, float g);                // LS_ACT_* of a gate value
float       ls_glu(int32_t activation, float g, float u, float alpha, float limit);   // a MoE expert's h

// CRC-32C in a CPU's instructions (checksum_x86.c: SSE4.2; checksum_neon.c: the ARMv8 CRC
// extension), chosen by checksum.c: the register value (not inverted) continued over p[0, len);
// three independent streams at once, c[i] continued over p + i * n for n bytes (n % 8 == 0)
typedef struct ls_crc_hw {
    uint32_t (* bytes)(uint32_t c, const uint8_t * p, size_t len);
    void     (* streams3)(uint32_t c[3], const uint8_t * p, size_t n);
} ls_crc_hw;
extern const ls_crc_hw ls_crc_sse42, ls_crc_armv8;
// the CRC-32C instructions to use: this CPU's, unless LEANSTREAM_ISA=scalar (NULL: the table)
const ls_crc_hw * ls_kernels_crc32c(void);

// util.c: drop an open file's pages from the page cache (after reading it whole into memory:
// the cache would be charged to the process's memory cgroup a second time). Best effort.
void        ls_drop_cached(int fd);

// cpu.c: ggml's CPU backend module that libggml loaded for this CPU (loading it if nothing is
// loaded yet). ls_cpu_ready: its type traits were found (and its fp16 tables initialised);
// ls_cpu_traits: ggml_get_type_traits_cpu of that module (NULL when not ready).
struct ggml_type_traits_cpu;
enum ggml_type;
bool        ls_cpu_ready(void);
const struct ggml_type_traits_cpu * ls_cpu_traits(enum ggml_type t);
// type t (a ggml_type) has rows the CPU backend dots (vec_dot) against an activation it can
// quantize (from_float of its vec_dot_type)
bool        ls_cpu_dots_rows(int32_t t);

// op.c: the whole op for one of nth threads (the graph node and ls_ffn_eval_layers both run it).
// x: FFN input rows [n_tokens, n_embd] (row stride in bytes); x_res: the residual entering the
// FFN, [n_embd] (sparse decode; may be NULL); y: output [n_tokens, n_embd].
void        ls_op_run(ls_engine * e, ls_layer * L, const float * x, size_t x_row_stride, const float * x_res,
                      float * y, int64_t n_tokens, int ith, int nth);

// resident.c: rewrite a layer that just became pinned for good into the split layout (gate/up
// parts together, down parts together, in its own slots), so that a sparse op streams only the
// parts it computes. Leaves the layer as it was when its slots cannot hold the split.
void        ls_layer_split(ls_engine * e, ls_layer * L);
static inline const uint8_t * ls_block_gu(const ls_layer * L, const uint8_t * blk, int32_t b) {
    return L->gu_ptr ? L->gu_ptr[b] : blk;
}
static inline const uint8_t * ls_block_dn(const ls_layer * L, const uint8_t * blk, int32_t b) {
    return L->dn_ptr ? L->dn_ptr[b] : blk + (size_t) L->info.neurons_per_block * (L->gate_row_bytes + L->up_row_bytes);
}

// ---- mixture of experts (moe.c; the ABI: ls_moe_* in leanstream.h) --------------------------------
// An engine object of its own beside ls_engine (its op, router-chosen blocks, its counters), whose
// expert files, cache and reader are the blocks' own (blockfile.c, cache.c, io.c): a layer's
// experts are the blocks of its expert file, block b = file slot b, holding expert f.ids[b].

// Per-layer counters of the MoE op: each a field of ls_moe_counters of the same name (the reads'
// bytes_read, reads and checksum_ns come from the file's LS_READ_COUNTERS).
#define LS_MOE_COUNTERS(X) \
    X(op_calls) X(tokens) X(routed) X(experts) X(hits) X(misses) X(pin_loads) X(stall_ns) X(compute_ns) \
    X(ahead_ops) X(ahead_routed) X(ahead_predicted) X(ahead_candidates) X(ahead_useful) X(ahead_reads) X(ahead_used)
typedef struct ls_moe_layer_counters { LS_MOE_COUNTERS(LS_COUNTER_FIELD) } ls_moe_layer_counters;

struct ls_moe;

typedef struct ls_moe_layer {
    struct ls_moe *    m;
    ls_blockfile       f;                // the expert file (f.fd -1: this layer has none); f.ids: expert_of_slot
    ls_moe_info        info;
    uint64_t           gate_bytes, up_bytes, down_bytes;   // of one expert's rows
    uint64_t           gate_off;         // the gate rows' offset in a slot (past the f32 extras)
    int64_t            bias_at, scale_at;   // f32 index in a slot of the biases, the scales (-1: none)
    int32_t *          block_of_expert;  // [n_expert] the block (file slot) holding expert e: f.ids inverted
    ls_moe_layer_counters stats;
    uint64_t *         routed_count;     // [n_expert] token-expert pairs routed to each expert (thread 0)
    // the router (read-ahead's predictions for this layer): rows [n_expert] of router_row bytes of
    // router_type (F32, F16 or BF16), llama.cpp's tensor (ls_moe_build) or router_own (ls_moe_set_router);
    // logits (+ router_logit_bias), then sigmoid (router_sigmoid) + router_prob_bias, top router_n_used
    const void *       router;
    int32_t            router_type, router_n_used;
    size_t             router_row;
    const float *      router_logit_bias, * router_prob_bias;
    bool               router_sigmoid;
    float *            router_own;
    // read-ahead into this layer, by the op of the layer before it (thread 0s, under op_mu)
    uint8_t *          predicted;        // [n_blocks] predicted for this layer's next op
    uint8_t *          candidate;        // [n_blocks] ... and absent when predicted
    uint8_t *          ahead;            // [n_blocks] read early for the next op
    bool               has_prediction;
    bool               ahead_off;        // auto: turned off (too few candidates used)
    uint32_t           ahead_skipped;    // auto, off: ops not predicted since the last one that was
    float              ahead_precision;  // auto: running share of candidates the next op used
} ls_moe_layer;

// The op's state (moe.c): thread 0 writes it before the barriers, every thread reads it.
// Entry i = the i-th distinct block (expert) of the batch in compute order (resident ones first,
// then the missing ones in file order: the order their reads are queued in).
typedef struct ls_moe_plan {
    ls_moe_layer *    L;
    int64_t           n_tokens;
    int32_t           n_used;
    int               nth;
    const float *     x;                 // [n_tokens] rows of x_stride bytes
    size_t            x_stride;
    int32_t           n_entries, n_hits; // entries [0, n_hits) were resident
    int32_t           n_landing;         // entries [n_hits, n_hits + n_landing) were being read (read-ahead):
                                         // they follow their block's state, not a read of the op's own
    int32_t *         entry_block;       // [n_expert]
    int32_t *         entry_pair0;       // [n_expert + 1] entry i's pairs: pairs[entry_pair0[i], entry_pair0[i + 1])
    int32_t *         pairs;             // [n_tokens * n_used] pair index t * n_used + k, by entry, t ascending
    int32_t *         pair_entry;        // [n_tokens * n_used] entry of pair (t, k), -1: no valid expert
    float *           pair_w;            // [n_tokens * n_used] the router weight of pair (t, k)
    _Atomic int32_t * entry_state;       // [n_expert] 0 while pending, then LS_BLK_READY / LS_BLK_FAILED
                                         // (the reader's flags: entry i's block may be evicted after it)
    int32_t *         entry_of;          // [n_expert] scratch (planning): block -> entry
    int32_t           next_read;         // thread 0: entries [0, next_read) have a slot
    bool              starved;           // no slot could be had: the entries after next_read failed
    int32_t           max_pairs;         // the most pairs of one entry
    uint8_t *         xq;                // [x_rows] x rows in gate's vec_dot_type, then [x_rows] in up's
    size_t            xq_gate_row, xq_up_row;   // bytes of one quantized x row (xq_up_row 0: up shares gate's)
    int64_t           x_rows;            // n_tokens, or with weight_before one per pair (w_k x_t)
    float *           xw;                // weight_before: [nth][n_embd] each thread's w_k x_t
    size_t            xw_cap;
    float *           h;                 // [max_pairs][n_ff_exp] act(gate . x) * (up . x)
    uint8_t *         hq[2];             // [max_pairs][hq_row] h in down's vec_dot_type, by entry parity
    size_t            hq_row;
    float *           out;               // [n_tokens * n_used][n_embd] p_k of pair (t, k)
    int64_t           ff_blk;            // threads split an expert's n_ff_exp rows in multiples of this
    size_t            xq_cap, h_cap, hq_cap[2], out_cap;   // elements grown (ls_grow)
    size_t            pair_cap, entry_cap;
    uint64_t          stall_ns;          // thread 0's wait this op
    uint8_t *         rq;                // the router's input in its vec_dot_type (read-ahead), rq_cap bytes
    float *           logits;            // [n_expert] (read-ahead)
    int32_t *         ahead_list;        // [2 n_expert] blocks read early, then the predicted resident ones held
    size_t            rq_cap, logits_cap, ahead_cap;
} ls_moe_plan;

// read-ahead (moe_ahead.c), called by moe.c
ls_status ls_moe_ahead_layer_init(ls_moe_layer * L);
void ls_moe_ahead_layer_free(ls_moe_layer * L);
void ls_moe_ahead_find_router(ls_moe_layer * L, struct ggml_tensor * selected, int32_t n_used);
void ls_moe_ahead_plan(struct ls_moe * m, ls_moe_plan * P);   // thread 0, after the op's own reads
void ls_moe_ahead_score(struct ls_moe * m, ls_moe_plan * P);  // thread 0, once the batch's blocks are marked

struct ls_moe {
    ls_moe_params    params;             // defaults resolved; test_hooks copied into hooks
    ls_test_hooks    hooks;
    int32_t          n_layer;
    ls_moe_layer *   layers;
    bool             direct_io;
    int32_t          n_hot;              // blocks in the layers' hot sets (ls_moe_pin)
    ls_cache         cache;              // of all layers' experts
    ls_io            io;
    ls_moe_plan      plan;
    ls_barrier       barrier;
    pthread_mutex_t  op_mu;              // one op (or pin, or stats reset) at a time
    ls_error_slot    err;
};

#endif // LS_INTERNAL_H
