// io.c — I/O workers: O_DIRECT reads of neuron blocks into cache slots, in priority order.
//
// The planner queues reads in the order the blocks will be computed; n_threads workers pop
// them FIFO, so up to n_threads reads are in flight (queue depth) and the earliest-needed
// blocks arrive first. When a read completes, each block's state flips to LS_BLK_READY with a
// release store — the compute threads' acquire load of that flag is the only synchronization
// between the two sides (Algorithm 1's io_wr_flg / gpu_rd_flg).
//
// Read planning (the disk cost model). A read of n bytes costs about c + n / B: c, the time
// one more I/O takes at full queue depth, and B, the bandwidth of large reads, are measured on
// the block files when the engine starts (ls_io_plan_model). Two selected blocks with a gap of
// g bytes between them cost 2c + (2s) / B read apart and c + (2s + g) / B read together, so a
// read goes through every gap shorter than c * B (bridge_bytes; the gap's bytes land in a
// scratch buffer and are dropped), up to max_read_bytes per read (the merge limit) and
// LS_MAX_IOV pieces. On the virtio disk this was written on, c = 12-14 us and B = 1-2.5 GB/s:
// gaps up to 22-30 KiB (6-8 blocks of 3.5 KiB) are read through.

#include "internal.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static uint64_t thread_cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t) ts.tv_sec * 1000000000ull + (uint64_t) ts.tv_nsec;
}

static void finish_read(ls_engine * e, ls_read * r, ls_status st, const char * why, int err) {
    ls_layer * L = r->L;
    if (st != LS_OK) {
        ls_engine_record_error(e, st, "%s: read of %d block(s) at offset %llu failed: %s%s%s",
                               L->path, r->n_blocks, (unsigned long long) r->offset, why,
                               err ? ": " : "", err ? strerror(err) : "");
    } else {
        atomic_fetch_add(&L->stats.blocks_read, (uint64_t) r->n_blocks);
        atomic_fetch_add(&L->stats.bytes_read, (uint64_t) r->n_blocks * L->info.block_stride + r->bridged);
        atomic_fetch_add(&L->stats.bytes_bridged, r->bridged);
        atomic_fetch_add(&L->stats.reads_issued, 1);
    }
    const int32_t v = st == LS_OK ? LS_BLK_READY : LS_BLK_FAILED;
    // fresh bytes: their checksum is checked by the compute thread that first uses them
    for (int32_t i = 0; i < r->n_iov; i++)
        if (r->block[i] >= 0) atomic_store_explicit(&L->verified[r->block[i]], 0, memory_order_relaxed);
    for (int32_t i = 0; i < r->n_iov; i++)
        if (r->block[i] >= 0) atomic_store_explicit(&L->state[r->block[i]], v, memory_order_seq_cst);
    for (int32_t i = 0; i < r->n_iov; i++)   // compute threads asleep on these blocks (no call if none)
        if (r->block[i] >= 0) ls_wake(&L->state[r->block[i]], &e->block_sleepers);
}

// Test hook (e->hooks): the one read that fails, if this is it.
static int32_t injected_fault(ls_engine * e) {
    if (e->io.fault == LS_FAULT_NONE) return LS_FAULT_NONE;
    return atomic_fetch_sub_explicit(&e->io.fault_countdown, 1, memory_order_relaxed) == 1 ? e->io.fault : LS_FAULT_NONE;
}

static void do_read(ls_engine * e, ls_read * r) {
    ls_layer * L = r->L;
    if (e->io.delay_us) usleep((useconds_t) (rand() % e->io.delay_us)); // test hook (e->hooks): jittered I/O
    const int32_t fault = injected_fault(e);
    if (fault == LS_FAULT_EIO) { finish_read(e, r, LS_ERR_IO, "I/O error (injected)", EIO); return; }
    if (fault == LS_FAULT_SHORT) { finish_read(e, r, LS_ERR_IO, "short read (injected)", 0); return; }
    size_t want = 0;
    for (int32_t i = 0; i < r->n_iov; i++) want += r->iov[i].iov_len;
    const uint64_t t0 = ls_now_ns();
    int err;
    const char * why = ls_preadv_all(L->fd, r->iov, r->n_iov, r->offset, &err);
    if (why) { finish_read(e, r, LS_ERR_IO, why, err); return; }
    atomic_fetch_add(&e->io.read_ns, ls_now_ns() - t0);   // the controller's disk state (control.c)
    atomic_fetch_add(&e->io.read_bytes, (uint64_t) want);
    if (fault == LS_FAULT_CORRUPT) {   // the bytes of the read's first block arrive with one bit flipped
        for (int32_t i = 0; i < r->n_iov; i++)
            if (r->block[i] >= 0) { ((uint8_t *) r->iov[i].iov_base)[r->iov[i].iov_len / 2] ^= 0x10; break; }
    }
    finish_read(e, r, LS_OK, NULL, 0);
}

static void run_read(void * owner, void * item) { do_read(owner, item); }

// A worker going idle: the CPU it spent since it last went idle, accounted
static _Thread_local uint64_t worker_cpu0;
static void worker_idle(void * owner) {
    ls_engine * e = owner;
    const uint64_t cpu = thread_cpu_ns();
    atomic_fetch_add_explicit(&e->io.cpu_ns, cpu - worker_cpu0, memory_order_relaxed);
    worker_cpu0 = cpu;
}

ls_status ls_io_start(ls_engine * e, int n_threads) {
    ls_io * io = &e->io;
    const ls_test_hooks * hooks = &e->hooks;
    memset(io, 0, sizeof(*io));
    io->delay_us = hooks->io_delay_us;
    io->fault = hooks->fault_read > 0 ? hooks->fault : LS_FAULT_NONE;
    atomic_store(&io->fault_countdown, (int64_t) hooks->fault_read);
    const uint32_t queue_cap = hooks->io_queue_cap;
    int32_t max_blocks = 0;
    for (int32_t il = 0; il < e->n_layers; il++) {
        if (e->layers[il].info.n_blocks > max_blocks) max_blocks = e->layers[il].info.n_blocks;
    }
    // room for this op's reads, the next layer's prefetch and let-go prefetches at one block a
    // read; the ring starts small and grows as reads wait (an entry is 1.3 KiB: sized for the worst
    // case at once, Qwen2.5-1.5B's 35 MB of ring became resident as its head went round, memory
    // the plan gives the FFN cache; dense streaming keeps ~120 reads queued). The queue holds one
    // layer's reads, the next layer's prefetch and reads of prefetched blocks that were let go
    // before they landed; should it still be full, the submitting thread does the read itself.
    int32_t max_cap = 3 * max_blocks + 3;
    if (queue_cap > 0 && (int32_t) queue_cap < max_cap) max_cap = (int32_t) queue_cap; // test hook
    const int32_t start = hooks->io_queue_start > 0 ? (int32_t) hooks->io_queue_start : LS_IO_QUEUE_START; // (test hook)
    io->q = (ls_workq) { .run = run_read, .idle = worker_idle, .owner = e, .item_size = sizeof(ls_read) };
    return ls_workq_start(&io->q, n_threads, start, max_cap);
}

void ls_io_stop(ls_engine * e) {
    ls_io * io = &e->io;
    ls_workq_stop(&io->q);
    free(io->bridge);
    memset(io, 0, sizeof(*io));
}

void ls_io_submit(ls_engine * e, ls_layer * L, const int32_t * blocks, int32_t n) {
    ls_io * io = &e->io;
    const uint64_t stride = L->info.block_stride;
    const uint64_t max_bytes = e->params.max_read_bytes > stride ? e->params.max_read_bytes : stride;
    const int64_t max_gap = (int64_t) (io->op_bridge / stride);   // whole blocks bridged
    pthread_mutex_lock(&io->q.mu);
    ls_read r;
    r.n_iov = 0;
    int32_t end = -1;     // the block after the current read's last one
    uint64_t bytes = 0;
    for (int32_t i = 0; i < n; i++) {
        const int32_t b = blocks[i];
        const int64_t gap = (int64_t) b - end;   // blocks between the read and b
        const bool extends = r.n_iov > 0 && gap >= 0 && gap <= max_gap &&
                             bytes + (uint64_t) (gap + 1) * stride <= max_bytes &&
                             r.n_iov + (gap > 0) + 1 <= LS_MAX_IOV;
        if (!extends) {
            if (r.n_iov > 0) ls_workq_push(&io->q, &r);
            r.L = L;
            r.n_iov = r.n_blocks = 0;
            r.bridged = 0;
            r.offset = L->info.data_offset + (uint64_t) b * stride;
            bytes = 0;
        } else if (gap > 0) {
            r.block[r.n_iov] = -1;
            r.iov[r.n_iov].iov_base = io->bridge;
            r.iov[r.n_iov].iov_len = (size_t) gap * stride;
            r.n_iov++;
            r.bridged += (uint64_t) gap * stride;
            bytes += (uint64_t) gap * stride;
        }
        r.block[r.n_iov] = b;
        r.iov[r.n_iov].iov_base = ls_cache_slot_ptr(&e->cache, L->slot_of_block[b]);
        r.iov[r.n_iov].iov_len = stride;
        r.n_iov++;
        r.n_blocks++;
        bytes += stride;
        end = b + 1;
    }
    if (r.n_iov > 0) ls_workq_push(&io->q, &r);
    pthread_mutex_unlock(&io->q.mu);
}

// ---- the disk model ----------------------------------------------------------------------------

typedef struct probe_job {
    ls_engine * e;
    uint64_t    seed, len;       // len: 0 = one block per read, else bytes per read
    int32_t     n_reads;
    uint8_t *   buf;
    int         err;
} probe_job;

static void * probe_worker(void * arg) {
    probe_job * j = arg;
    ls_engine * e = j->e;
    uint64_t x = j->seed;
    for (int32_t i = 0; i < j->n_reads; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;   // LCG: fixed, reproducible offsets
        const ls_layer * L = &e->layers[(x >> 33) % (uint64_t) e->n_layers];
        const uint64_t stride = L->info.block_stride, nb = (uint64_t) L->info.n_blocks;
        const uint64_t b = (x >> 13) % nb;
        uint64_t len = j->len ? j->len : stride;
        if (len > (nb - b) * stride) len = (nb - b) * stride;
        if (pread(L->fd, j->buf, len, (off_t) (L->info.data_offset + b * stride)) < 0 && errno != EINTR) {
            j->err = errno;
            return NULL;
        }
    }
    return NULL;
}

// Wall time of n_reads reads (len bytes each, 0: one block) spread over the I/O thread count.
static ls_status probe_run(ls_engine * e, uint64_t len, int32_t n_reads, uint64_t seed, uint64_t * ns) {
    const int nt = e->io.q.n_threads;
    probe_job jobs[LS_MAX_IO_THREADS];
    pthread_t th[LS_MAX_IO_THREADS];
    const size_t buf_bytes = e->params.max_read_bytes;
    int started = 0;
    ls_status st = LS_OK;
    const uint64_t t0 = ls_now_ns();
    for (int i = 0; i < nt; i++) {
        jobs[i] = (probe_job) {.e = e, .seed = seed + (uint64_t) i * 7919u, .len = len,
                               .n_reads = n_reads / nt + (i < n_reads % nt)};
        jobs[i].buf = aligned_alloc(4096, (buf_bytes + 4095) & ~(size_t) 4095);
        if (!jobs[i].buf || pthread_create(&th[i], NULL, probe_worker, &jobs[i]) != 0) {
            free(jobs[i].buf);
            st = LS_ERR_NOMEM;
            break;
        }
        started++;
    }
    for (int i = 0; i < started; i++) {
        pthread_join(th[i], NULL);
        free(jobs[i].buf);
        if (jobs[i].err && st == LS_OK) {
            ls_set_error("disk probe: read failed: %s", strerror(jobs[i].err));
            st = LS_ERR_IO;
        }
    }
    *ns = ls_now_ns() - t0;
    if (st == LS_ERR_NOMEM) ls_set_error("disk probe: out of memory or threads");
    return st;
}

ls_status ls_io_plan_model(ls_engine * e, bool probe) {
    ls_io * io = &e->io;
    uint64_t stride = 0, data = 0;
    for (int32_t il = 0; il < e->n_layers; il++) {
        const ls_layer * L = &e->layers[il];
        if (L->info.block_stride > stride) stride = L->info.block_stride;
        data += (uint64_t) L->info.n_blocks * L->info.block_stride;
    }
    if (probe && e->n_layers > 0) {
        // small reads at full depth (after a warm-up), then large ones: ~1 K reads and up to 32 MiB
        const int32_t n_small = 64 * io->q.n_threads > 1024 ? 64 * io->q.n_threads : 1024;
        const uint64_t big = e->params.max_read_bytes;
        uint64_t big_total = data < (32u << 20) ? data : (32u << 20);
        int32_t n_big = (int32_t) (big_total / big) > io->q.n_threads ? (int32_t) (big_total / big) : io->q.n_threads;
        // each phase twice, the faster kept: a one-off stall (the first reads after a file was
        // written measured 20x slower here) must not set the plan for the whole session
        uint64_t t_warm, t_small = UINT64_MAX, t_big = UINT64_MAX, t;
        ls_status st = probe_run(e, 0, io->q.n_threads, 1, &t_warm);
        for (int rep = 0; rep < 2 && st == LS_OK; rep++) {
            st = probe_run(e, 0, n_small, 2 + 2 * (uint64_t) rep, &t);
            if (st == LS_OK && t < t_small) t_small = t;
            if (st == LS_OK) st = probe_run(e, big, n_big, 3 + 2 * (uint64_t) rep, &t);
            if (st == LS_OK && t < t_big) t_big = t;
        }
        if (st != LS_OK) return st;
        io->bandwidth = (uint64_t) ((double) n_big * (double) big * 1e9 / (double) (t_big ? t_big : 1));
        const double per_small = (double) t_small / n_small;            // ns per small read at depth
        const double transfer = (double) stride * 1e9 / (double) (io->bandwidth ? io->bandwidth : 1);
        io->per_io_ns = per_small > transfer ? (uint64_t) (per_small - transfer) : 0;
    }
    if (e->params.bridge_bytes >= 0) {
        io->bridge_bytes = (uint64_t) e->params.bridge_bytes;
    } else {
        // a gap is worth reading through while its bytes take less time than one more I/O
        io->bridge_bytes = (uint64_t) ((double) io->per_io_ns * 1e-9 * (double) io->bandwidth);
    }
    const uint64_t cap = e->params.max_read_bytes / 2;
    if (io->bridge_bytes > cap) io->bridge_bytes = cap;
    if (stride && io->bridge_bytes < stride) io->bridge_bytes = 0;   // not even one block
    io->op_bridge = io->bridge_bytes;
    // the buffer holds the largest bridge an op may use (the controller scales bridge_bytes up to cap)
    io->bridge_cap = io->bridge_bytes ? cap : 0;
    free(io->bridge);
    io->bridge = NULL;
    if (io->bridge_cap) {
        io->bridge = aligned_alloc(4096, (io->bridge_cap + 4095) & ~(uint64_t) 4095);
        if (!io->bridge) { ls_set_error("out of memory"); return LS_ERR_NOMEM; }
    }
    return LS_OK;
}
