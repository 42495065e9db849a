// cache.c — the one cache of blocks, whichever engine and kind of block (a dense layer's neuron
// blocks, a MoE layer's experts): slots of one stride in one pool, keyed by (layer, block).
//
// A budget's bytes become slots here (ls_cache_slots) and nowhere else. A block is resident when
// it owns a slot. Blocks being computed or read are pinned; the hot set's blocks hold a pin of
// their own once loaded (resident for good); unpinned resident blocks sit in an LRU list, and the
// victim when a slot is needed is chosen by one function, pick_victim. All metadata is touched by
// one thread at a time (an engine's planner, under its lock); the reader (io.c) only fills slot
// memory and flips the blocks' states.

#include "internal.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

// the largest alignment any file's O_DIRECT reads need (1: no file)
static uint64_t max_align(ls_blockfile * const * files, int32_t n_files) {
    uint64_t align = 1;
    for (int32_t i = 0; i < n_files; i++) if (files[i]->align > align) align = files[i]->align;
    return align;
}

uint64_t ls_cache_stride(ls_blockfile * const * files, int32_t n_files) {
    uint64_t stride = 0;
    for (int32_t i = 0; i < n_files; i++) if (files[i]->stride > stride) stride = files[i]->stride;
    const uint64_t align = max_align(files, n_files);
    return (stride + align - 1) / align * align;   // every slot aligned for every file's reads
}

int64_t ls_cache_slots(uint64_t bytes, uint64_t reserved, uint64_t stride, int64_t total_blocks) {
    if (bytes == 0) return total_blocks;   // unlimited: read once, kept
    if (bytes <= reserved || stride == 0) return 0;
    const uint64_t n = (bytes - reserved) / stride;
    return n < (uint64_t) total_blocks ? (int64_t) n : total_blocks;
}

ls_status ls_cache_init(ls_cache * c, ls_blockfile * const * files, int32_t n_files, int32_t n_slots) {
    memset(c, 0, sizeof(*c));
    c->stride = ls_cache_stride(files, n_files);
    c->n_slots = n_slots;
    int64_t total = 0;
    for (int32_t i = 0; i < n_files; i++) total += files[i]->n_blocks;
    const size_t align = max_align(files, n_files) > 4096 ? (size_t) max_align(files, n_files) : 4096;
    // anonymous mapping: pages count against RSS only once a block lands in them
    c->pool_map_bytes = (size_t) c->stride * (size_t) n_slots + align;
    void * p = mmap(NULL, c->pool_map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        ls_set_error("cannot reserve %zu bytes for the weight cache", c->pool_map_bytes);
        return LS_ERR_NOMEM;
    }
    c->pool_map = p;
    c->pool = (uint8_t *) (((uintptr_t) p + align - 1) & ~(uintptr_t) (align - 1));
    const size_t n = (size_t) (n_slots > 0 ? n_slots : 1);
    c->files = malloc((size_t) (n_files > 0 ? n_files : 1) * sizeof(*c->files));
    c->slot_layer = malloc(n * sizeof(int32_t));
    c->slot_block = malloc(n * sizeof(int32_t));
    c->slot_pins = calloc(n, sizeof(int32_t));
    c->slot_computed = calloc(n, 1);
    c->lru_prev = malloc(n * sizeof(int32_t));
    c->lru_next = malloc(n * sizeof(int32_t));
    c->free_list = malloc(n * sizeof(int32_t));
    c->heap = malloc(n * sizeof(int32_t));
    c->heap_pos = malloc(n * sizeof(int32_t));
    c->released = calloc(n, sizeof(uint64_t));
    if (!c->files || !c->slot_layer || !c->slot_block || !c->slot_pins || !c->slot_computed || !c->lru_prev ||
        !c->lru_next || !c->free_list || !c->heap || !c->heap_pos || !c->released) {
        ls_set_error("out of memory");
        return LS_ERR_NOMEM;
    }
    memcpy(c->files, files, (size_t) n_files * sizeof(*c->files));
    c->n_files = n_files;
    for (int32_t s = 0; s < n_slots; s++) {
        c->slot_layer[s] = c->slot_block[s] = -1;
        c->lru_prev[s] = c->lru_next[s] = -1;
        c->heap_pos[s] = -1;
        c->free_list[s] = n_slots - 1 - s; // pop order 0, 1, 2, ...: adjacent blocks get adjacent slots
    }
    c->n_free = n_slots;
    c->lru_head = c->lru_tail = -1;
    c->never_evicts = n_slots >= total;
    return LS_OK;
}

void ls_cache_free(ls_cache * c) {
    if (c->pool_map) munmap(c->pool_map, c->pool_map_bytes);
    free(c->files); free(c->slot_layer); free(c->slot_block); free(c->slot_pins); free(c->slot_computed);
    free(c->lru_prev); free(c->lru_next); free(c->free_list); free(c->heap); free(c->heap_pos); free(c->released);
    memset(c, 0, sizeof(*c));
}

// ---- LFU's heap of the list's slots: (uses of the slot's block, released) ascending -----------------

static bool heap_less(const ls_cache * c, int32_t a, int32_t b) {
    const uint32_t ua = c->files[c->slot_layer[a]]->uses[c->slot_block[a]];
    const uint32_t ub = c->files[c->slot_layer[b]]->uses[c->slot_block[b]];
    return ua != ub ? ua < ub : c->released[a] < c->released[b];
}

static void heap_set(ls_cache * c, int32_t i, int32_t s) { c->heap[i] = s; c->heap_pos[s] = i; }

static void heap_up(ls_cache * c, int32_t i) {
    const int32_t s = c->heap[i];
    while (i > 0 && heap_less(c, s, c->heap[(i - 1) / 2])) { heap_set(c, i, c->heap[(i - 1) / 2]); i = (i - 1) / 2; }
    heap_set(c, i, s);
}

static void heap_down(ls_cache * c, int32_t i, int32_t n) {
    const int32_t s = c->heap[i];
    for (;;) {
        int32_t k = 2 * i + 1;
        if (k >= n) break;
        if (k + 1 < n && heap_less(c, c->heap[k + 1], c->heap[k])) k++;
        if (!heap_less(c, c->heap[k], s)) break;
        heap_set(c, i, c->heap[k]);
        i = k;
    }
    heap_set(c, i, s);
}

// (the list's length before the change is the heap's: n_lru)
static void heap_add(ls_cache * c, int32_t s) { heap_set(c, c->n_lru, s); heap_up(c, c->n_lru); }

static void heap_remove(ls_cache * c, int32_t s) {
    const int32_t i = c->heap_pos[s], last = c->n_lru - 1;   // the last item fills s's place
    c->heap_pos[s] = -1;
    if (i == last) return;
    const int32_t x = c->heap[last];
    heap_set(c, i, x);
    if (i > 0 && heap_less(c, x, c->heap[(i - 1) / 2])) heap_up(c, i);
    else heap_down(c, i, last);
}

void ls_cache_reorder(ls_cache * c) {   // every slot's key may have changed: the heap rebuilt
    if (c->evict != LS_EVICT_LFU) return;
    for (int32_t i = c->n_lru / 2 - 1; i >= 0; i--) heap_down(c, i, c->n_lru);
}

static void lru_remove(ls_cache * c, int32_t s) {
    if (c->evict == LS_EVICT_LFU) heap_remove(c, s);
    int32_t p = c->lru_prev[s], n = c->lru_next[s];
    if (p >= 0) c->lru_next[p] = n; else c->lru_head = n;
    if (n >= 0) c->lru_prev[n] = p; else c->lru_tail = p;
    c->lru_prev[s] = c->lru_next[s] = -1;
    c->n_lru--;
}

static void lru_push_mru(ls_cache * c, int32_t s) {
    c->released[s] = ++c->clock;
    if (c->evict == LS_EVICT_LFU) heap_add(c, s);
    c->lru_prev[s] = c->lru_tail;
    c->lru_next[s] = -1;
    if (c->lru_tail >= 0) c->lru_next[c->lru_tail] = s; else c->lru_head = s;
    c->lru_tail = s;
    c->n_lru++;
}

int32_t ls_cache_available(const ls_cache * c) { return c->n_free + c->n_lru; }

// Slot s's block no longer resident (its state ABSENT); the slot is the caller's.
static void evict(ls_cache * c, int32_t s) {
    ls_blockfile * V = c->files[c->slot_layer[s]];
    const int32_t vb = c->slot_block[s];
    if (!c->slot_computed[s]) atomic_fetch_add(&V->stats.bytes_unused, V->stride);
    V->slot[vb] = -1;
    atomic_store_explicit(&V->state[vb], LS_BLK_ABSENT, memory_order_relaxed);
    c->slot_layer[s] = c->slot_block[s] = -1;
    c->n_resident--;
}

// The eviction policy, all of it: which evictable slot gives way (-1: none), of those whose read
// is not still in flight (a prefetch let go before it landed: its slot is being written). LRU: the
// least recently used. LFU: the least used (the file's `uses`: a calibration prior and one per op
// since), the least recent of equals (replayed on routing traces of MoE models, LFU with the
// calibration's counts kept 10-15 points more experts than LRU at a cache of a seventh of them:
// bench/replay_experts.py).
static int32_t pick_victim(const ls_cache * c) {
    if (c->evict == LS_EVICT_LFU && c->n_lru > 0) {   // the heap's least, unless its read is in flight
        const int32_t s = c->heap[0];
        if (atomic_load_explicit(&c->files[c->slot_layer[s]]->state[c->slot_block[s]], memory_order_acquire) != LS_BLK_LOADING)
            return s;
    }
    int32_t best = -1;   // (LRU; or LFU's rare case of a read-ahead still landing: the scan)
    uint32_t best_uses = UINT32_MAX;
    for (int32_t s = c->lru_head; s >= 0; s = c->lru_next[s]) {
        const ls_blockfile * F = c->files[c->slot_layer[s]];
        const int32_t b = c->slot_block[s];
        if (atomic_load_explicit(&F->state[b], memory_order_acquire) == LS_BLK_LOADING) continue;
        if (c->evict != LS_EVICT_LFU) return s;
        if (F->uses[b] < best_uses) { best = s; best_uses = F->uses[b]; }
    }
    return best;
}

// the hot set's pin on block b (in slot s) taken, once
static void pin_hot(ls_cache * c, ls_blockfile * F, int32_t b, int32_t s) {
    if (!F->hot[b] || F->hot_pinned[b]) return;
    if (c->slot_pins[s]++ == 0) lru_remove(c, s);
    F->hot_pinned[b] = 1;
}

ls_status ls_cache_acquire(ls_cache * c, ls_blockfile * F, int32_t b, int32_t * slot, bool * miss) {
    int32_t s = F->slot[b];
    if (s >= 0) {
        if (c->slot_pins[s]++ == 0) lru_remove(c, s);
        pin_hot(c, F, b, s);
        *slot = s;
        *miss = false;
        return LS_OK;
    }
    if (c->n_free > 0) {
        s = c->free_list[--c->n_free];
    } else {
        s = pick_victim(c);
        if (s < 0) return LS_ERR_BUDGET; // every slot is pinned (or loading)
        lru_remove(c, s);
        evict(c, s);
    }
    c->slot_layer[s] = F->il;
    c->slot_block[s] = b;
    c->slot_pins[s] = 1;
    c->slot_computed[s] = 0;
    c->n_resident++;
    F->slot[b] = s;
    pin_hot(c, F, b, s);
    atomic_store_explicit(&F->state[b], LS_BLK_LOADING, memory_order_relaxed);
    *slot = s;
    *miss = true;
    return LS_OK;
}

void ls_cache_drop(ls_cache * c, ls_blockfile * F, int32_t b, bool loaded) {
    int32_t s = F->slot[b];
    if (s < 0) return;
    if (c->slot_pins[s] > 0) c->slot_pins[s] = 0; else lru_remove(c, s);
    if (!loaded) c->slot_computed[s] = 1; // nothing arrived: not "unused" bytes
    F->hot_pinned[b] = 0;
    evict(c, s);
    c->free_list[c->n_free++] = s;
}

void ls_cache_release(ls_cache * c, ls_blockfile * F, int32_t b, bool computed) {
    int32_t s = F->slot[b];
    if (s < 0) return;
    if (computed) c->slot_computed[s] = 1;
    if (--c->slot_pins[s] > 0) return;
    if (atomic_load_explicit(&F->state[b], memory_order_acquire) == LS_BLK_FAILED) {
        c->slot_pins[s] = 1;   // (drop takes a pinned slot out of no list)
        ls_cache_drop(c, F, b, false);
        return;
    }
    lru_push_mru(c, s);
}

void ls_cache_set_hot(ls_cache * c, ls_blockfile * F, int32_t b, bool hot) {
    if (hot) {
        F->hot[b] = 1;
        if (F->slot[b] >= 0) pin_hot(c, F, b, F->slot[b]);
        return;
    }
    F->hot[b] = 0;
    if (!F->hot_pinned[b]) return;
    F->hot_pinned[b] = 0;
    ls_cache_release(c, F, b, false);
}
