// mode.c — the policies, each written once: what every mode does, how many blocks a sparse op
// keeps, the defaults of the engine's parameters, and how the hot set is sized from the cache's
// own slot count. Everything else asks here (this file calls only util.c).

#include "internal.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// What each mode does per decoded token (prefill is dense in every mode). The baselines live in
// the engine so that ablations compare like with like. A sparse op selects through the layer's
// sketch where the mode uses one and the layer has it (the cascade), else through the predictors.
static const ls_mode_policy MODES[LS_N_MODES] = {
    // hot: the hot set's default share of the slots; alone: the same without predictors
    //                      name           uses                                    sparse prefetch keep  hot   alone
    [LS_MODE_DENSE]       = { "dense",       0,                                      false, false, true,  0.0f, 0.0f },
    // DejaVu: one layer-ahead prediction per layer, no weight cache
    [LS_MODE_ONESHOT]     = { "oneshot",     LS_USES_PREDICTORS,                     true,  true,  false, 0.0f, 0.0f },
    // DejaVu + LRU weight cache
    [LS_MODE_DEJAVU_PLUS] = { "dejavu+",     LS_USES_PREDICTORS,                     true,  true,  true,  0.0f, 0.0f },
    // PowerInfer-2: calibration-hot blocks pinned (hot_fraction of the slots) + LRU for the rest
    [LS_MODE_POWERINFER2] = { "powerinfer2", LS_USES_PREDICTORS | LS_USES_RANK | LS_NEEDS_RANK,
                                                                                     true,  true,  true,  0.5f, 0.5f },
    // final selection from the layer's own input (sketch -> candidates -> exact re-rank); the
    // predictors, where trained, prefetch the next layer's likely candidates (speculation).
    // Selecting through the sketch alone it prefetches nothing: a cache slot outside the hot set
    // only helps a block read again by the next token, which a budget below one token's reads
    // cycles out first (Qwen2.5-1.5B, 50 % budget: 1.53-1.57 tok/s with 0.9, 1.23-1.43 with 0.5)
    [LS_MODE_LEANSTREAM]  = { "leanstream",  LS_USES_SKETCH | LS_USES_PREDICTORS | LS_USES_RANK,
                                                                                     true,  true,  true,  0.5f, 0.9f },
};

const ls_mode_policy * ls_mode_policy_of(int32_t mode) {
    if (mode < 0 || mode >= LS_N_MODES) return NULL;
    return &MODES[mode];
}

const char * ls_mode_name(int32_t mode) {
    const ls_mode_policy * m = ls_mode_policy_of(mode);
    return m ? m->name : NULL;
}

int32_t ls_mode_uses(int32_t mode) {
    const ls_mode_policy * m = ls_mode_policy_of(mode);
    return m ? m->uses | (m->sparse ? LS_DECODES_SPARSE : 0) : 0;
}

void ls_engine_params_init(ls_engine_params * p) {
    memset(p, 0, sizeof(*p));
    p->activation     = LS_ACT_SILU;
    p->mode           = LS_MODE_DENSE;
    p->memory_budget  = 0;
    p->n_io_threads   = 16;          // random 4 KiB O_DIRECT reads need 8+ in flight for full IOPS
    p->max_read_bytes = 256u << 10;
    p->sparsity       = -1.0f;       // the mode's: 0 in dense mode, LS_DEFAULT_SPARSITY in the others
    p->hot_fraction   = -1.0;        // the mode's share of the budget pinned for the hot set
    p->verify_checksums = 1;         // every block checked against its CRC-32C before first use
    p->candidate_ratio  = -1.0f;     // LS_DEFAULT_CANDIDATE_RATIO
    p->bridge_bytes     = -1;        // from the disk model measured at start (io.c)
}

ls_status ls_params_resolve(ls_engine_params * p) {
    const ls_mode_policy * m = ls_mode_policy_of(p->mode);
    if (!m) { ls_set_error("unknown mode %d", p->mode); return LS_ERR_ARG; }
    if (p->sparsity < 0.0f && p->sparsity == -1.0f) p->sparsity = m->sparse ? LS_DEFAULT_SPARSITY : 0.0f;
    if (!(p->sparsity >= 0.0f && p->sparsity < 1.0f)) { ls_set_error("sparsity must be in [0, 1), got %g", (double) p->sparsity); return LS_ERR_ARG; }
    if (p->hot_fraction == -1.0) p->hot_fraction = p->predictor_paths ? m->hot_fraction : m->hot_alone;
    if (!(p->hot_fraction >= 0.0 && p->hot_fraction <= 1.0)) { ls_set_error("hot_fraction must be in [0, 1], got %g", (double) p->hot_fraction); return LS_ERR_ARG; }
    if (p->n_io_threads < 1 || p->n_io_threads > LS_MAX_IO_THREADS) { ls_set_error("n_io_threads must be in [1, %d], got %d", LS_MAX_IO_THREADS, p->n_io_threads); return LS_ERR_ARG; }
    if (p->candidate_ratio == -1.0f) p->candidate_ratio = LS_DEFAULT_CANDIDATE_RATIO;
    if (!(p->candidate_ratio >= 1.0f && p->candidate_ratio <= 1000.0f)) { ls_set_error("candidate_ratio must be >= 1, got %g", (double) p->candidate_ratio); return LS_ERR_ARG; }
    if (p->max_read_bytes < 4096) { ls_set_error("max_read_bytes must be >= 4096, got %u", p->max_read_bytes); return LS_ERR_ARG; }
    if (p->bridge_bytes < -1) { ls_set_error("bridge_bytes must be >= 0, or -1 (measured), got %lld", (long long) p->bridge_bytes); return LS_ERR_ARG; }
    return LS_OK;
}

ls_status ls_engine_params_resolve(ls_engine_params * p) {
    if (!p) { ls_set_error("ls_engine_params_resolve: NULL params"); return LS_ERR_ARG; }
    return ls_params_resolve(p);
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

ls_status ls_mode_rank_order(int32_t n_layers, const int32_t * n_blocks, const float * rank, int32_t ** order, int64_t * total) {
    int64_t n = 0;
    for (int32_t il = 0; il < n_layers; il++) n += n_blocks[il];
    *order = NULL;
    *total = n;
    ranked * r = malloc(sizeof(ranked) * (size_t) (n > 0 ? n : 1));
    int32_t * o = malloc(sizeof(int32_t) * (size_t) (n > 0 ? n : 1));
    if (!r || !o) { free(r); free(o); ls_set_error("out of memory"); return LS_ERR_NOMEM; }
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(rank[i])) { free(r); free(o); ls_set_error("block rank %lld is not finite", (long long) i); return LS_ERR_ARG; }
        r[i] = (ranked) { rank[i], (int32_t) i };
    }
    qsort(r, (size_t) n, sizeof(ranked), by_rank);
    for (int64_t i = 0; i < n; i++) o[i] = r[i].flat;
    free(r);
    *order = o;
    return LS_OK;
}

ls_status ls_mode_pick_hot(int32_t n_layers, const int32_t * n_blocks, const float * rank, int32_t n_hot, uint8_t ** hot) {
    int32_t * order;
    int64_t total;
    ls_status st = ls_mode_rank_order(n_layers, n_blocks, rank, &order, &total);
    if (st != LS_OK) return st;
    // flat index -> (layer, block): mark the winners in a flat array, then walk it layer by layer
    uint8_t * flat = calloc((size_t) (total > 0 ? total : 1), 1);
    if (!flat) { free(order); ls_set_error("out of memory"); return LS_ERR_NOMEM; }
    for (int64_t i = 0; i < n_hot && i < total; i++) flat[order[i]] = 1;
    int64_t pos = 0;
    for (int32_t il = 0; il < n_layers; il++)
        for (int32_t b = 0; b < n_blocks[il]; b++, pos++) hot[il][b] = flat[pos];
    free(flat);
    free(order);
    return LS_OK;
}

ls_status ls_mode_pick_hot_per_layer(int32_t n_layers, const int32_t * n_blocks, const float * rank, int32_t n_hot,
                                     uint8_t ** hot) {
    int64_t total = 0;
    int32_t max_nb = 0;
    for (int32_t il = 0; il < n_layers; il++) {
        total += n_blocks[il];
        if (n_blocks[il] > max_nb) max_nb = n_blocks[il];
    }
    if (total <= 0) return LS_OK;
    if (n_hot > total) n_hot = (int32_t) total;
    ranked * r = malloc(sizeof(ranked) * (size_t) max_nb);
    int32_t * share = malloc(sizeof(int32_t) * (size_t) n_layers);
    if (!r || !share) { free(r); free(share); ls_set_error("out of memory"); return LS_ERR_NOMEM; }
    int64_t given = 0;
    for (int32_t il = 0; il < n_layers; il++) {
        share[il] = (int32_t) ((int64_t) n_hot * n_blocks[il] / total);
        given += share[il];
    }
    for (int32_t il = 0; il < n_layers && given < n_hot; il++)
        if (share[il] < n_blocks[il]) { share[il]++; given++; }
    ls_status st = LS_OK;
    const float * lr = rank;   // layer il's ranks
    for (int32_t il = 0; il < n_layers && st == LS_OK; lr += n_blocks[il], il++) {
        for (int32_t b = 0; b < n_blocks[il] && st == LS_OK; b++) {
            if (!isfinite(lr[b])) { ls_set_error("block rank %lld is not finite", (long long) (lr - rank + b)); st = LS_ERR_ARG; }
            r[b] = (ranked) { lr[b], b };
        }
        if (st != LS_OK) break;
        qsort(r, (size_t) n_blocks[il], sizeof(ranked), by_rank);
        memset(hot[il], 0, (size_t) n_blocks[il]);
        for (int32_t i = 0; i < share[il]; i++) hot[il][r[i].flat] = 1;
    }
    free(r);
    free(share);
    return st;
}

ls_status ls_mode_rank_layer(int32_t n_blocks, const float * rank, int32_t ** order) {
    int64_t total;
    return ls_mode_rank_order(1, &n_blocks, rank, order, &total);
}

void ls_mode_run_rank(int32_t n_blocks, const float * rank, int32_t run, float * out) {
    for (int32_t lo = 0; lo < n_blocks; lo += run) {
        const int32_t hi = lo + run < n_blocks ? lo + run : n_blocks;
        double sum = 0.0;
        for (int32_t b = lo; b < hi; b++) sum += isfinite(rank[b]) ? rank[b] : 0.0;
        for (int32_t b = lo; b < hi; b++) out[b] = isfinite(rank[b]) ? (float) (sum / (hi - lo)) : rank[b];
    }
}
