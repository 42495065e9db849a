// resident.c — the split layout of a layer resident for good.
//
// A block is stored as [gate rows | up rows | down columns]. A sparse op computes the gate/up rows
// of every candidate but the down columns of the kept blocks only; when those parts alternate in
// memory, the hardware prefetchers (which follow a sequential stream) fetch the skipped down
// columns too and the op moves nearly all the layer's bytes. Once a layer is pinned for good (a
// budget that holds the whole FFN, after the first prefill), its own slots are rewritten: the
// gate/up parts of blocks 0, 1, 2, ... packed into the first slots (by address), the down parts
// into the rest, and gu_ptr / dn_ptr say where each block's parts are. The blocks were checked
// against their checksums when they were read, and are never read again (the cache never evicts).

#include "internal.h"

#include <stdlib.h>
#include <string.h>

static int cmp_i32(const void * a, const void * b) {
    const int32_t x = *(const int32_t *) a, y = *(const int32_t *) b;
    return (x > y) - (x < y);
}

void ls_layer_split(ls_engine * e, ls_layer * L) {
    // only the cascade (gate/up of every candidate, down of the kept) gains: other modes read both parts
    if (L->gu_ptr || !L->pinned_forever || !(e->policy->uses & LS_USES_SKETCH) || !L->sketch) return;
    const int32_t nb = L->info.n_blocks;
    const uint64_t stride = e->cache.stride;
    const size_t gu = (size_t) L->info.neurons_per_block * (L->gate_row_bytes + L->up_row_bytes);
    const size_t dn = (size_t) L->info.neurons_per_block * L->down_col_bytes;
    const int32_t gpp = (int32_t) (stride / gu), dpp = (int32_t) (stride / dn);   // parts per slot
    if (gpp < 1 || dpp < 1) return;
    const int32_t n_gu_slots = (nb + gpp - 1) / gpp, n_dn_slots = (nb + dpp - 1) / dpp;
    if (n_gu_slots + n_dn_slots > nb) return;   // the parts do not fit the layer's slots
    int32_t * slots = malloc(sizeof(int32_t) * (size_t) nb);
    uint8_t * tmp = malloc((size_t) nb * (gu + dn));
    const uint8_t ** gp = malloc(sizeof(*gp) * (size_t) nb);
    const uint8_t ** dp = malloc(sizeof(*dp) * (size_t) nb);
    if (!slots || !tmp || !gp || !dp) { free(slots); free(tmp); free(gp); free(dp); return; }   // stays unsplit
    for (int32_t b = 0; b < nb; b++) {
        slots[b] = L->slot_of_block[b];
        const uint8_t * blk = ls_cache_slot_ptr(&e->cache, slots[b]);
        memcpy(tmp + (size_t) b * gu, blk, gu);
        memcpy(tmp + (size_t) nb * gu + (size_t) b * dn, blk + gu, dn);
    }
    qsort(slots, (size_t) nb, sizeof(int32_t), cmp_i32);   // by address: the parts stream in order
    for (int32_t b = 0; b < nb; b++) {
        uint8_t * g = ls_cache_slot_ptr(&e->cache, slots[b / gpp]) + (size_t) (b % gpp) * gu;
        uint8_t * d = ls_cache_slot_ptr(&e->cache, slots[n_gu_slots + b / dpp]) + (size_t) (b % dpp) * dn;
        memcpy(g, tmp + (size_t) b * gu, gu);
        memcpy(d, tmp + (size_t) nb * gu + (size_t) b * dn, dn);
        gp[b] = g;
        dp[b] = d;
    }
    free(tmp);
    free(slots);
    L->gu_ptr = gp;
    L->dn_ptr = dp;
}
