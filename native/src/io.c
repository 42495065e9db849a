// io.c — the one reader: O_DIRECT reads of blocks into cache slots, whichever engine and kind of
// block (a dense layer's neuron blocks, a MoE layer's experts), in the order they are needed.
//
// An engine queues reads in the order its blocks will be computed; n_threads workers pop them
// FIFO, so up to n_threads reads are in flight (queue depth) and the earliest-needed blocks
// arrive first. Adjacent blocks of a file merge into one preadv into their (scattered) slots.
// When a read completes, each block (its CRC-32C checked first where the engine asks for it on
// the worker) flips its state, and the read's flag for it where the engine gave flags, to
// LS_BLK_READY or LS_BLK_FAILED with a release store — the compute threads' acquire load of that
// word is the only synchronization between the two sides (Algorithm 1's io_wr_flg / gpu_rd_flg).
// Injected faults (an engine's test hooks) are taken here, whatever the block.
//
// Read planning (the disk cost model). A read of n bytes costs about c + n / B: c, the time
// one more I/O takes at full queue depth, and B, the bandwidth of large reads, are measured on
// the block files when the engine starts (ls_io_plan_model). Two selected blocks with a gap of
// g bytes between them cost 2c + (2s) / B read apart and c + (2s + g) / B read together, so a
// read goes through every gap shorter than c * B (bridge_bytes; the gap's bytes land in a
// scratch buffer and are dropped), up to max_read_bytes per read (the merge limit) and
// LS_MAX_IOV pieces. On the virtio disk this was written on, c = 12-14 us and B = 1-2.5 GB/s:
// gaps up to 22-30 KiB (6-8 blocks of 3.5 KiB) are read through. A reader whose disk model was
// not planned (the MoE engine's) merges adjacent blocks only.

#include "internal.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static uint64_t thread_cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t) ts.tv_sec * 1000000000ull + (uint64_t) ts.tv_nsec;
}

// "block 5", or "slot 2 (expert 7)": block b of F as messages name it (the format's word)
static const char * block_name(const ls_blockfile * F, int32_t b, char * buf, size_t n) {
    if (F->kind == LS_FILE_EXPERTS) snprintf(buf, n, "slot %d (expert %d)", b, F->ids[b]);
    else snprintf(buf, n, "block %d", b);
    return buf;
}

// Block b's bytes p against its CRC-32C (the time counted); a mismatch is recorded naming the
// file, layer and block.
static bool block_intact(ls_io * io, ls_blockfile * F, int32_t b, const uint8_t * p) {
    const uint64_t t0 = ls_now_ns();
    const uint32_t have = ls_crc32c(0, p, F->stride);
    atomic_fetch_add_explicit(&F->stats.checksum_ns, ls_now_ns() - t0, memory_order_relaxed);
    if (have == F->crc[b]) return true;
    char name[64];
    ls_error_record(io->err, LS_ERR_CORRUPT,
                    "%s: layer %d %s is corrupt (CRC-32C %08x, stored %08x, file offset %llu); "
                    "`leanstream verify` checks the whole model directory, re-run `leanstream convert` to repair it",
                    F->path, F->il, block_name(F, b, name, sizeof(name)), have, F->crc[b],
                    (unsigned long long) (F->data_offset + (uint64_t) b * F->stride));
    return false;
}

bool ls_io_check(ls_io * io, ls_blockfile * F, int32_t b, const uint8_t * blk) {
    if (block_intact(io, F, b, blk)) {
        atomic_store_explicit(&F->verified[b], 1, memory_order_relaxed);
        return true;
    }
    atomic_store_explicit(&F->state[b], LS_BLK_FAILED, memory_order_release); // dropped after the op, read again next time
    return false;
}

// Every block of the read (checked on the worker where the engine asks for it) gets its state,
// and its flag, then the threads asleep on them are woken.
static void finish_read(ls_io * io, ls_read * r, ls_status st, const char * why, int err) {
    ls_blockfile * F = r->F;
    if (st != LS_OK) {
        char name[64];
        ls_error_record(io->err, st, "%s: layer %d: read of %d %s(s) from %s at offset %llu failed: %s%s%s",
                        F->path, F->il, r->n_blocks, F->kind == LS_FILE_EXPERTS ? "expert" : "block",
                        block_name(F, r->block[0], name, sizeof(name)), (unsigned long long) r->offset, why,
                        err ? ": " : "", err ? strerror(err) : "");
    } else {
        atomic_fetch_add(&F->stats.blocks_read, (uint64_t) r->n_blocks);
        atomic_fetch_add(&F->stats.bytes_read, (uint64_t) r->n_blocks * F->stride + r->bridged);
        atomic_fetch_add(&F->stats.bytes_bridged, r->bridged);
        atomic_fetch_add(&F->stats.reads_issued, 1);
    }
    for (int32_t i = 0, j = 0; i < r->n_iov; i++) {
        const int32_t b = r->block[i];
        if (b < 0) continue;   // a bridged gap
        const bool ok = st == LS_OK && (io->check != LS_CHECK_ON_READ || block_intact(io, F, b, r->iov[i].iov_base));
        // fresh bytes: checked now (or not at all), or by the compute thread that first uses them
        atomic_store_explicit(&F->verified[b], io->check != LS_CHECK_ON_USE, memory_order_relaxed);
        const int32_t v = ok ? LS_BLK_READY : LS_BLK_FAILED;
        atomic_store_explicit(&F->state[b], v, memory_order_seq_cst);
        if (r->flags) atomic_store_explicit(&r->flags[j], v, memory_order_seq_cst);
        ls_wake(&F->state[b], &io->sleepers);   // (no call when nobody sleeps)
        if (r->flags) ls_wake(&r->flags[j], &io->sleepers);
        j++;
    }
}

// Test hook: the one read that fails, if this is it.
static int32_t injected_fault(ls_io * io) {
    if (io->fault == LS_FAULT_NONE) return LS_FAULT_NONE;
    return atomic_fetch_sub_explicit(&io->fault_countdown, 1, memory_order_relaxed) == 1 ? io->fault : LS_FAULT_NONE;
}

static void do_read(ls_io * io, ls_read * r) {
    if (io->delay_us) usleep((useconds_t) (rand() % io->delay_us)); // test hook: jittered I/O
    const int32_t fault = injected_fault(io);
    if (fault == LS_FAULT_EIO) { finish_read(io, r, LS_ERR_IO, "I/O error (injected)", EIO); return; }
    if (fault == LS_FAULT_SHORT) { finish_read(io, r, LS_ERR_IO, "short read (injected)", 0); return; }
    size_t want = 0;
    for (int32_t i = 0; i < r->n_iov; i++) want += r->iov[i].iov_len;
    const uint64_t t0 = ls_now_ns();
    int err;
    const char * why = ls_preadv_all(r->F->fd, r->iov, r->n_iov, r->offset, &err);
    if (why) { finish_read(io, r, LS_ERR_IO, why, err); return; }
    atomic_fetch_add(&io->read_ns, ls_now_ns() - t0);   // the controller's disk state (control.c)
    atomic_fetch_add(&io->read_bytes, (uint64_t) want);
    if (fault == LS_FAULT_CORRUPT) {   // the bytes of the read's first block arrive with one bit flipped
        for (int32_t i = 0; i < r->n_iov; i++)
            if (r->block[i] >= 0) { ((uint8_t *) r->iov[i].iov_base)[r->iov[i].iov_len / 2] ^= 0x10; break; }
    }
    finish_read(io, r, LS_OK, NULL, 0);
}

static void run_read(void * owner, void * item) { do_read(owner, item); }

// A worker going idle: the CPU it spent since it last went idle, accounted
static _Thread_local uint64_t worker_cpu0;
static void worker_idle(void * owner) {
    ls_io * io = owner;
    const uint64_t cpu = thread_cpu_ns();
    atomic_fetch_add_explicit(&io->cpu_ns, cpu - worker_cpu0, memory_order_relaxed);
    worker_cpu0 = cpu;
}

ls_status ls_io_start(ls_io * io, const ls_io_config * cfg) {
    const ls_test_hooks * hooks = cfg->hooks;
    memset(io, 0, sizeof(*io));
    io->cache = cfg->cache;
    io->err = cfg->err;
    io->check = cfg->check;
    io->max_read_bytes = cfg->max_read_bytes;
    io->delay_us = hooks->io_delay_us;
    io->fault = hooks->fault_read > 0 ? hooks->fault : LS_FAULT_NONE;
    atomic_store(&io->fault_countdown, (int64_t) hooks->fault_read);
    // the ring starts small and grows as reads wait (an entry is 1.3 KiB: sized for the worst case
    // at once, Qwen2.5-1.5B's 35 MB of ring became resident as its head went round, memory the plan
    // gives the FFN cache; dense streaming keeps ~120 reads queued); should it still be full, the
    // submitting thread does the read itself
    int32_t max_cap = cfg->max_queue;
    if (hooks->io_queue_cap > 0 && (int32_t) hooks->io_queue_cap < max_cap) max_cap = (int32_t) hooks->io_queue_cap;
    const int32_t start = hooks->io_queue_start > 0 ? (int32_t) hooks->io_queue_start : LS_IO_QUEUE_START;
    io->q = (ls_workq) { .run = run_read, .idle = worker_idle, .owner = io, .item_size = sizeof(ls_read) };
    return ls_workq_start(&io->q, cfg->n_threads, start, max_cap);
}

void ls_io_stop(ls_io * io) {
    ls_workq_stop(&io->q);
    free(io->bridge);
    memset(io, 0, sizeof(*io));
}

static void submit(ls_io * io, ls_blockfile * F, const int32_t * blocks, int32_t n, _Atomic int32_t * flags, bool low);

void ls_io_submit(ls_io * io, ls_blockfile * F, const int32_t * blocks, int32_t n, _Atomic int32_t * flags) {
    submit(io, F, blocks, n, flags, false);
}

void ls_io_submit_low(ls_io * io, ls_blockfile * F, const int32_t * blocks, int32_t n) {
    submit(io, F, blocks, n, NULL, true);
}

static void submit(ls_io * io, ls_blockfile * F, const int32_t * blocks, int32_t n, _Atomic int32_t * flags, bool low) {
    const uint64_t stride = F->stride;
    const uint64_t max_bytes = io->max_read_bytes > stride ? io->max_read_bytes : stride;
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
            if (r.n_iov > 0) ls_workq_push_at(&io->q, &r, low);
            r.F = F;
            r.n_iov = r.n_blocks = 0;
            r.bridged = 0;
            r.flags = flags ? flags + i : NULL;
            r.offset = F->data_offset + (uint64_t) b * stride;
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
        r.iov[r.n_iov].iov_base = ls_cache_slot_ptr(io->cache, F->slot[b]);
        r.iov[r.n_iov].iov_len = stride;
        r.n_iov++;
        r.n_blocks++;
        bytes += stride;
        end = b + 1;
    }
    if (r.n_iov > 0) ls_workq_push_at(&io->q, &r, low);
    pthread_mutex_unlock(&io->q.mu);
}

// ---- the disk model ----------------------------------------------------------------------------

typedef struct probe_job {
    const ls_io * io;
    uint64_t    seed, len;       // len: 0 = one block per read, else bytes per read
    int32_t     n_reads;
    uint8_t *   buf;
    int         err;
} probe_job;

static void * probe_worker(void * arg) {
    probe_job * j = arg;
    const ls_cache * c = j->io->cache;
    uint64_t x = j->seed;
    for (int32_t i = 0; i < j->n_reads; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;   // LCG: fixed, reproducible offsets
        const ls_blockfile * F = c->files[(x >> 33) % (uint64_t) c->n_files];
        const uint64_t stride = F->stride, nb = (uint64_t) F->n_blocks;
        if (nb == 0) continue;
        const uint64_t b = (x >> 13) % nb;
        uint64_t len = j->len ? j->len : stride;
        if (len > (nb - b) * stride) len = (nb - b) * stride;
        if (pread(F->fd, j->buf, len, (off_t) (F->data_offset + b * stride)) < 0 && errno != EINTR) {
            j->err = errno;
            return NULL;
        }
    }
    return NULL;
}

// Wall time of n_reads reads (len bytes each, 0: one block) spread over the I/O thread count.
static ls_status probe_run(const ls_io * io, uint64_t len, int32_t n_reads, uint64_t seed, uint64_t * ns) {
    const int nt = io->q.n_threads;
    probe_job jobs[LS_MAX_IO_THREADS];
    pthread_t th[LS_MAX_IO_THREADS];
    const size_t buf_bytes = io->max_read_bytes;
    int started = 0;
    ls_status st = LS_OK;
    const uint64_t t0 = ls_now_ns();
    for (int i = 0; i < nt; i++) {
        jobs[i] = (probe_job) {.io = io, .seed = seed + (uint64_t) i * 7919u, .len = len,
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

ls_status ls_io_plan_model(ls_io * io, bool probe, int64_t bridge_bytes) {
    const ls_cache * c = io->cache;
    uint64_t stride = 0, data = 0;
    for (int32_t il = 0; il < c->n_files; il++) {
        const ls_blockfile * F = c->files[il];
        if (F->stride > stride) stride = F->stride;
        data += (uint64_t) F->n_blocks * F->stride;
    }
    if (probe && c->n_files > 0) {
        // small reads at full depth (after a warm-up), then large ones: ~1 K reads and up to 32 MiB
        const int32_t n_small = 64 * io->q.n_threads > 1024 ? 64 * io->q.n_threads : 1024;
        const uint64_t big = io->max_read_bytes;
        uint64_t big_total = data < (32u << 20) ? data : (32u << 20);
        int32_t n_big = (int32_t) (big_total / big) > io->q.n_threads ? (int32_t) (big_total / big) : io->q.n_threads;
        // each phase twice, the faster kept: a one-off stall (the first reads after a file was
        // written measured 20x slower here) must not set the plan for the whole session
        uint64_t t_warm, t_small = UINT64_MAX, t_big = UINT64_MAX, t;
        ls_status st = probe_run(io, 0, io->q.n_threads, 1, &t_warm);
        for (int rep = 0; rep < 2 && st == LS_OK; rep++) {
            st = probe_run(io, 0, n_small, 2 + 2 * (uint64_t) rep, &t);
            if (st == LS_OK && t < t_small) t_small = t;
            if (st == LS_OK) st = probe_run(io, big, n_big, 3 + 2 * (uint64_t) rep, &t);
            if (st == LS_OK && t < t_big) t_big = t;
        }
        if (st != LS_OK) return st;
        io->bandwidth = (uint64_t) ((double) n_big * (double) big * 1e9 / (double) (t_big ? t_big : 1));
        const double per_small = (double) t_small / n_small;            // ns per small read at depth
        const double transfer = (double) stride * 1e9 / (double) (io->bandwidth ? io->bandwidth : 1);
        io->per_io_ns = per_small > transfer ? (uint64_t) (per_small - transfer) : 0;
    }
    if (bridge_bytes >= 0) {
        io->bridge_bytes = (uint64_t) bridge_bytes;
    } else {
        // a gap is worth reading through while its bytes take less time than one more I/O
        io->bridge_bytes = (uint64_t) ((double) io->per_io_ns * 1e-9 * (double) io->bandwidth);
    }
    const uint64_t cap = io->max_read_bytes / 2;
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
