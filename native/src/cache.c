// cache.c — the budgeted FFN weight cache.
//
// memory_budget bytes are cut into fixed-size slots (one block each, stride = the largest block
// stride). A block is resident when it owns a slot. Blocks being computed are pinned; unpinned
// resident blocks sit in an LRU list and the least recently used one is evicted when a slot is
// needed. All metadata is touched by one thread at a time (the op's planner, under e->mu);
// I/O workers only fill slot memory and flip the per-block state flags.

#include "internal.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

ls_status ls_cache_init(ls_cache * c, uint64_t stride, int32_t n_slots, int32_t total_blocks) {
    memset(c, 0, sizeof(*c));
    c->stride = stride;
    c->n_slots = n_slots;
    c->pool_bytes = (size_t) stride * (size_t) n_slots;
    // anonymous mapping: pages count against RSS only once a block lands in them
    void * p = mmap(NULL, c->pool_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        ls_set_error("cannot reserve %zu bytes for the weight cache", c->pool_bytes);
        c->pool = NULL;
        return LS_ERR_NOMEM;
    }
    c->pool = p;
    c->slot_layer    = malloc((size_t) n_slots * sizeof(int32_t));
    c->slot_block    = malloc((size_t) n_slots * sizeof(int32_t));
    c->slot_pins     = calloc((size_t) n_slots, sizeof(int32_t));
    c->slot_computed = calloc((size_t) n_slots, 1);
    c->lru_prev      = malloc((size_t) n_slots * sizeof(int32_t));
    c->lru_next      = malloc((size_t) n_slots * sizeof(int32_t));
    c->free_list     = malloc((size_t) n_slots * sizeof(int32_t));
    if (!c->slot_layer || !c->slot_block || !c->slot_pins || !c->slot_computed || !c->lru_prev ||
        !c->lru_next || !c->free_list) {
        ls_set_error("out of memory");
        return LS_ERR_NOMEM;
    }
    for (int32_t s = 0; s < n_slots; s++) {
        c->slot_layer[s] = -1;
        c->slot_block[s] = -1;
        c->lru_prev[s] = c->lru_next[s] = -1;
        c->free_list[s] = n_slots - 1 - s; // pop order 0, 1, 2, ...: adjacent blocks get adjacent slots
    }
    c->n_free = n_slots;
    c->lru_head = c->lru_tail = -1;
    c->never_evicts = n_slots >= total_blocks;
    return LS_OK;
}

void ls_cache_free(ls_cache * c) {
    if (c->pool) munmap(c->pool, c->pool_bytes);
    free(c->slot_layer); free(c->slot_block); free(c->slot_pins); free(c->slot_computed);
    free(c->lru_prev); free(c->lru_next); free(c->free_list);
    memset(c, 0, sizeof(*c));
}

uint8_t * ls_cache_slot_ptr(const ls_cache * c, int32_t slot) {
    return c->pool + (size_t) slot * c->stride;
}

static void lru_remove(ls_cache * c, int32_t s) {
    int32_t p = c->lru_prev[s], n = c->lru_next[s];
    if (p >= 0) c->lru_next[p] = n; else c->lru_head = n;
    if (n >= 0) c->lru_prev[n] = p; else c->lru_tail = p;
    c->lru_prev[s] = c->lru_next[s] = -1;
    c->n_lru--;
}

static void lru_push_mru(ls_cache * c, int32_t s) {
    c->lru_prev[s] = c->lru_tail;
    c->lru_next[s] = -1;
    if (c->lru_tail >= 0) c->lru_next[c->lru_tail] = s; else c->lru_head = s;
    c->lru_tail = s;
    c->n_lru++;
}

int32_t ls_cache_available(const ls_cache * c) { return c->n_free + c->n_lru; }

static void evict(ls_engine * e, int32_t s) {
    ls_cache * c = &e->cache;
    ls_layer * V = &e->layers[c->slot_layer[s]];
    const int32_t vb = c->slot_block[s];
    if (!c->slot_computed[s]) atomic_fetch_add(&V->stats.bytes_unused, V->info.block_stride);
    V->slot_of_block[vb] = -1;
    atomic_store_explicit(&V->state[vb], LS_BLK_ABSENT, memory_order_relaxed);
    c->slot_layer[s] = c->slot_block[s] = -1;
    c->n_resident--;
}

// The slot to evict: the least recently used one whose read is not still in flight (its slot is
// being written).
static int32_t pick_victim(ls_engine * e) {
    ls_cache * c = &e->cache;
    for (int32_t s = c->lru_head; s >= 0; s = c->lru_next[s]) {
        if (atomic_load_explicit(&e->layers[c->slot_layer[s]].state[c->slot_block[s]], memory_order_acquire) !=
            LS_BLK_LOADING) return s;
    }
    return -1;
}

ls_status ls_cache_acquire(ls_engine * e, ls_layer * L, int32_t b, int32_t * slot, bool * miss) {
    ls_cache * c = &e->cache;
    int32_t s = L->slot_of_block[b];
    if (s >= 0) {
        if (c->slot_pins[s]++ == 0) lru_remove(c, s);
        if (L->hot && L->hot[b] && !L->hot_pinned[b]) { c->slot_pins[s]++; L->hot_pinned[b] = 1; }
        *slot = s;
        *miss = false;
        return LS_OK;
    }
    if (c->n_free > 0) {
        s = c->free_list[--c->n_free];
    } else {
        // least recently used, skipping blocks whose read is still in flight (a prefetch that
        // was let go): their slot is being written
        s = pick_victim(e);
        if (s < 0) return LS_ERR_BUDGET; // every slot is pinned (or loading)
        lru_remove(c, s);
        evict(e, s);
    }
    c->slot_layer[s] = L->il;
    c->slot_block[s] = b;
    c->slot_pins[s] = 1;
    c->slot_computed[s] = 0;
    c->n_resident++;
    L->slot_of_block[b] = s;
    if (L->hot && L->hot[b]) { c->slot_pins[s]++; L->hot_pinned[b] = 1; } // powerinfer2: resident for good
    atomic_store_explicit(&L->state[b], LS_BLK_LOADING, memory_order_relaxed);
    *slot = s;
    *miss = true;
    return LS_OK;
}

void ls_cache_release(ls_engine * e, ls_layer * L, int32_t b, bool computed) {
    ls_cache * c = &e->cache;
    int32_t s = L->slot_of_block[b];
    if (s < 0) return;
    if (computed) c->slot_computed[s] = 1;
    if (--c->slot_pins[s] == 0) lru_push_mru(c, s);
}

void ls_cache_drop(ls_engine * e, ls_layer * L, int32_t b, bool loaded) {
    ls_cache * c = &e->cache;
    int32_t s = L->slot_of_block[b];
    if (s < 0) return;
    if (c->slot_pins[s] > 0) c->slot_pins[s] = 0; else lru_remove(c, s);
    if (!loaded) c->slot_computed[s] = 1; // nothing arrived: not "unused" bytes
    if (L->hot_pinned) L->hot_pinned[b] = 0;
    evict(e, s);
    c->free_list[c->n_free++] = s;
}
