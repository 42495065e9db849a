// mode.c — the policies, each written once: what every mode does, how many blocks a sparse op
// keeps, the defaults of the engine's parameters, and how the hot set is sized from the cache's
// own slot count. Everything else asks here (this file calls only util.c).

#include "internal.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// What each mode does per decoded token (prefill is dense in every mode). The baselines live in
// the engine so that ablations compare like with like.
static const ls_mode_policy MODES[] = {
    //                      sparse prefetch refine staged keep   eviction           hot   hot_req exact_select
    [LS_MODE_DENSE]       = { false, false, false, false, true,  LS_CACHE_LRU,      0.0f, false, false },
    [LS_MODE_ONESHOT]     = { true,  true,  false, false, false, LS_CACHE_LRU,      0.0f, false, false }, // DejaVu: no weight cache
    [LS_MODE_DEJAVU_PLUS] = { true,  true,  false, false, true,  LS_CACHE_LRU,      0.0f, false, false }, // DejaVu + LRU cache
    [LS_MODE_POWERINFER2] = { true,  true,  false, false, true,  LS_CACHE_LRU,      0.5f, true,  false }, // hot set pinned + LRU
    // + stages and refinement of the prefetch; where the layer has a sketch, the final selection
    // comes from its own input (speculation only prefetches)
    [LS_MODE_LEANSTREAM]  = { true,  true,  true,  true,  true,  LS_CACHE_PRIORITY, 0.5f, false, true  },
};

const ls_mode_policy * ls_mode_policy_of(int32_t mode) {
    if (mode < LS_MODE_DENSE || mode > LS_MODE_LEANSTREAM) return NULL;
    return &MODES[mode];
}

void ls_engine_params_init(ls_engine_params * p) {
    memset(p, 0, sizeof(*p));
    p->activation     = LS_ACT_SILU;
    p->mode           = LS_MODE_DENSE;
    p->memory_budget  = 0;
    p->n_io_threads   = 16;          // random 4 KiB O_DIRECT reads need 8+ in flight for full IOPS
    p->max_read_bytes = 256u << 10;
    p->use_direct_io  = 1;
    p->sparsity       = -1.0f;       // the mode's: 0 in dense mode, LS_DEFAULT_SPARSITY in the others
    p->n_stages       = 4;           // 8 measured worse with the quick predictors (README)
    p->cache_policy   = -1;          // the mode's eviction
    p->hot_fraction   = -1.0;        // the mode's share of the budget pinned for the hot set
    p->verify_checksums = 1;         // every block checked against its CRC-32C before first use
    p->candidate_ratio  = -1.0f;     // LS_DEFAULT_CANDIDATE_RATIO
    p->cache_bias       = 1.0f;      // off
    p->bridge_bytes     = -1;        // from the disk model measured at start (io.c)
}

ls_status ls_params_resolve(ls_engine_params * p) {
    const ls_mode_policy * m = ls_mode_policy_of(p->mode);
    if (!m) { ls_set_error("unknown mode %d", p->mode); return LS_ERR_ARG; }
    if (p->sparsity < 0.0f && p->sparsity == -1.0f) p->sparsity = m->sparse ? LS_DEFAULT_SPARSITY : 0.0f;
    if (!(p->sparsity >= 0.0f && p->sparsity < 1.0f)) { ls_set_error("sparsity must be in [0, 1), got %g", (double) p->sparsity); return LS_ERR_ARG; }
    if (p->cache_policy == -1) p->cache_policy = m->eviction;
    if (p->cache_policy != LS_CACHE_LRU && p->cache_policy != LS_CACHE_PRIORITY) { ls_set_error("unknown cache policy %d", p->cache_policy); return LS_ERR_ARG; }
    // leanstream selecting through the sketch alone prefetches nothing: a cache slot outside the
    // hot set only helps a block read again by the next token, which a budget below one token's
    // reads cycles out first (Qwen2.5-1.5B, 50 % budget: 1.53-1.57 tok/s with 0.9, 1.23-1.43 with 0.5)
    if (p->hot_fraction == -1.0)
        p->hot_fraction = p->mode == LS_MODE_LEANSTREAM && !p->predictor_paths ? LS_SKETCH_HOT_FRACTION : m->hot_fraction;
    if (!(p->hot_fraction >= 0.0 && p->hot_fraction <= 1.0)) { ls_set_error("hot_fraction must be in [0, 1], got %g", (double) p->hot_fraction); return LS_ERR_ARG; }
    if (p->n_stages < 1 || p->n_stages > LS_MAX_STAGES) { ls_set_error("n_stages must be in [1, %d], got %d", LS_MAX_STAGES, p->n_stages); return LS_ERR_ARG; }
    if (p->n_io_threads < 1 || p->n_io_threads > LS_MAX_IO_THREADS) { ls_set_error("n_io_threads must be in [1, %d], got %d", LS_MAX_IO_THREADS, p->n_io_threads); return LS_ERR_ARG; }
    if (p->candidate_ratio == -1.0f) p->candidate_ratio = LS_DEFAULT_CANDIDATE_RATIO;
    if (!(p->candidate_ratio >= 1.0f && p->candidate_ratio <= 1000.0f)) { ls_set_error("candidate_ratio must be >= 1, got %g", (double) p->candidate_ratio); return LS_ERR_ARG; }
    if (!(p->cache_bias > 0.0f && p->cache_bias <= 1.0f)) { ls_set_error("cache_bias must be in (0, 1], got %g", (double) p->cache_bias); return LS_ERR_ARG; }
    if (p->max_read_bytes < 4096) { ls_set_error("max_read_bytes must be >= 4096, got %u", p->max_read_bytes); return LS_ERR_ARG; }
    if (p->bridge_bytes < -1) { ls_set_error("bridge_bytes must be >= 0, or -1 (measured), got %lld", (long long) p->bridge_bytes); return LS_ERR_ARG; }
    return LS_OK;
}

int32_t ls_kept_blocks(int32_t n_blocks, float sparsity) {
    if (n_blocks <= 0) return 0;
    int32_t n = (int32_t) ((1.0 - (double) sparsity) * n_blocks + 0.5);   // round half up
    return n < 1 ? 1 : n > n_blocks ? n_blocks : n;
}

int32_t ls_candidate_blocks(int32_t n_blocks, float sparsity, float candidate_ratio) {
    const int32_t kept = ls_kept_blocks(n_blocks, sparsity);
    const double n = ceil((double) candidate_ratio * kept - 1e-9);
    return n >= n_blocks ? n_blocks : n < kept ? kept : (int32_t) n;
}

// Blocks of all layers by descending calibration rank, ties by (layer, block) order.
typedef struct { float rank; int32_t flat; } ranked;
static int by_rank(const void * a, const void * b) {
    const ranked * x = a, * y = b;
    if (x->rank != y->rank) return x->rank > y->rank ? -1 : 1;
    return (x->flat > y->flat) - (x->flat < y->flat);
}

int32_t ls_hot_set_size(int32_t n_slots, int32_t working_set, double hot_fraction) {
    // never the slots two layers' working sets need (the op's and the next layer's prefetch)
    int64_t n = (int64_t) floor(hot_fraction * n_slots);
    const int64_t room = (int64_t) n_slots - 2 * (int64_t) working_set;
    if (n > room) n = room;
    return n < 0 ? 0 : (int32_t) n;
}

ls_status ls_mode_pick_hot(int32_t n_layers, const int32_t * n_blocks, const float * rank, int32_t n_hot, uint8_t ** hot) {
    int64_t total = 0;
    for (int32_t il = 0; il < n_layers; il++) total += n_blocks[il];
    ranked * r = malloc(sizeof(ranked) * (size_t) (total > 0 ? total : 1));
    if (!r) { ls_set_error("out of memory"); return LS_ERR_NOMEM; }
    for (int64_t i = 0; i < total; i++) {
        if (!isfinite(rank[i])) { free(r); ls_set_error("block rank %lld is not finite", (long long) i); return LS_ERR_ARG; }
        r[i] = (ranked) { rank[i], (int32_t) i };
    }
    qsort(r, (size_t) total, sizeof(ranked), by_rank);
    // flat index -> (layer, block): mark the winners in a flat array, then walk it layer by layer
    uint8_t * flat = calloc((size_t) (total > 0 ? total : 1), 1);
    if (!flat) { free(r); ls_set_error("out of memory"); return LS_ERR_NOMEM; }
    for (int64_t i = 0; i < n_hot && i < total; i++) flat[r[i].flat] = 1;
    int64_t pos = 0;
    for (int32_t il = 0; il < n_layers; il++)
        for (int32_t b = 0; b < n_blocks[il]; b++, pos++) hot[il][b] = flat[pos];
    free(flat);
    free(r);
    return LS_OK;
}
