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
    int32_t * slots = malloc(sizeof(int32_t) * (size_t) nb);
    if (!slots) return;
    for (int32_t b = 0; b < nb; b++) slots[b] = L->f.slot[b];
    qsort(slots, (size_t) nb, sizeof(int32_t), cmp_i32);   // by address: the parts stream in order
    // slots in one range (a cache that never evicts hands them out in order): the layer's memory
    // is one run of nb * stride bytes, and the parts are packed back to back across slot bounds;
    // else whole parts per slot, which needs a slot to hold two parts of one kind (not the case
    // for Q4_K rows with Q6_K columns: 1728 + 1260 bytes in 3072-byte slots)
    bool one_range = true;
    for (int32_t b = 1; b < nb && one_range; b++) one_range = slots[b] == slots[b - 1] + 1;
    const int32_t gpp = (int32_t) (stride / gu), dpp = (int32_t) (stride / dn);   // parts per slot
    const int32_t n_gu_slots = gpp > 0 ? (nb + gpp - 1) / gpp : nb + 1, n_dn_slots = dpp > 0 ? (nb + dpp - 1) / dpp : nb + 1;
    if (!one_range && n_gu_slots + n_dn_slots > nb) { free(slots); return; }   // the parts do not fit the layer's slots
    uint8_t * tmp = malloc((size_t) nb * (gu + dn));
    const uint8_t ** gp = malloc(sizeof(*gp) * (size_t) nb);
    const uint8_t ** dp = malloc(sizeof(*dp) * (size_t) nb);
    if (!tmp || !gp || !dp) { free(slots); free(tmp); free(gp); free(dp); return; }   // stays unsplit
    for (int32_t b = 0; b < nb; b++) {
        const uint8_t * blk = ls_cache_slot_ptr(&e->cache, L->f.slot[b]);
        memcpy(tmp + (size_t) b * gu, blk, gu);
        memcpy(tmp + (size_t) nb * gu + (size_t) b * dn, blk + gu, dn);
    }
    uint8_t * base = ls_cache_slot_ptr(&e->cache, slots[0]);
    for (int32_t b = 0; b < nb; b++) {
        uint8_t * g, * d;
        if (one_range) {
            g = base + (size_t) b * gu;
            d = base + (size_t) nb * gu + (size_t) b * dn;
        } else {
            g = ls_cache_slot_ptr(&e->cache, slots[b / gpp]) + (size_t) (b % gpp) * gu;
            d = ls_cache_slot_ptr(&e->cache, slots[n_gu_slots + b / dpp]) + (size_t) (b % dpp) * dn;
        }
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
