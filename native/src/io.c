// io.c — I/O workers: O_DIRECT reads of neuron blocks into cache slots, in priority order.
//
// The planner queues reads in the order the blocks will be computed; n_threads workers pop
// them FIFO, so up to n_threads reads are in flight (queue depth) and the earliest-needed
// blocks arrive first. Adjacent blocks (in the file) whose slots are known are merged into
// one preadv of at most max_read_bytes. When a read completes, each block's state flips to
// LS_BLK_READY with a release store — the compute threads' acquire load of that flag is the
// only synchronization between the two sides (Algorithm 1's io_wr_flg / gpu_rd_flg).

#include "internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void finish_read(ls_engine * e, ls_read * r, ls_status st, const char * why, int err) {
    ls_layer * L = r->L;
    if (st != LS_OK) {
        ls_engine_record_error(e, st, "%s: read of %d block(s) at offset %llu failed: %s%s%s",
                               L->path, r->n, (unsigned long long) r->offset, why,
                               err ? ": " : "", err ? strerror(err) : "");
    } else {
        atomic_fetch_add(&L->stats.blocks_read, (uint64_t) r->n);
        atomic_fetch_add(&L->stats.bytes_read, (uint64_t) r->n * L->info.block_stride);
        atomic_fetch_add(&L->stats.reads_issued, 1);
    }
    const int32_t v = st == LS_OK ? LS_BLK_READY : LS_BLK_FAILED;
    // fresh bytes: their checksum is checked by the compute thread that first uses them
    for (int32_t i = 0; i < r->n; i++) atomic_store_explicit(&L->verified[r->first + i], 0, memory_order_relaxed);
    for (int32_t i = 0; i < r->n; i++) {
        atomic_store_explicit(&L->state[r->first + i], v, memory_order_release);
    }
}

static void do_read(ls_engine * e, ls_read * r) {
    ls_layer * L = r->L;
    if (e->io.delay_us) usleep((useconds_t) (rand() % e->io.delay_us)); // test hook: jittered I/O
    size_t want = 0;
    for (int32_t i = 0; i < r->n; i++) want += r->iov[i].iov_len;
    struct iovec iov[LS_MAX_IOV];
    memcpy(iov, r->iov, sizeof(struct iovec) * (size_t) r->n);
    struct iovec * cur = iov;
    int n_iov = r->n;
    size_t done = 0;
    while (done < want) {
        ssize_t got = preadv(L->fd, cur, n_iov, (off_t) (r->offset + done));
        if (got < 0) {
            if (errno == EINTR) continue;
            finish_read(e, r, LS_ERR_IO, "I/O error", errno);
            return;
        }
        if (got == 0) {
            finish_read(e, r, LS_ERR_IO, "short read (file truncated?)", 0);
            return;
        }
        done += (size_t) got;
        // advance the iovec past what arrived (O_DIRECT short reads stay block aligned)
        size_t adv = (size_t) got;
        while (n_iov > 0 && adv >= cur->iov_len) { adv -= cur->iov_len; cur++; n_iov--; }
        if (n_iov > 0 && adv) { cur->iov_base = (uint8_t *) cur->iov_base + adv; cur->iov_len -= adv; }
    }
    finish_read(e, r, LS_OK, NULL, 0);
}

static void * io_worker(void * arg) {
    ls_engine * e = arg;
    ls_io * io = &e->io;
    for (;;) {
        pthread_mutex_lock(&io->mu);
        while (!io->stop && io->count == 0) pthread_cond_wait(&io->cv, &io->mu);
        if (io->stop && io->count == 0) { pthread_mutex_unlock(&io->mu); return NULL; }
        ls_read r = io->queue[io->head];
        io->head = (io->head + 1) % io->cap;
        io->count--;
        pthread_mutex_unlock(&io->mu);
        do_read(e, &r);
    }
}

ls_status ls_io_start(ls_engine * e, int n_threads, uint32_t delay_us, uint32_t queue_cap) {
    ls_io * io = &e->io;
    memset(io, 0, sizeof(*io));
    pthread_mutex_init(&io->mu, NULL);
    pthread_cond_init(&io->cv, NULL);
    io->delay_us = delay_us;
    int32_t max_blocks = 0;
    for (int32_t il = 0; il < e->n_layers; il++) {
        if (e->layers[il].info.n_blocks > max_blocks) max_blocks = e->layers[il].info.n_blocks;
    }
    io->cap = 3 * max_blocks + 3; // this op's reads, the next layer's prefetch, let-go prefetches
    if (queue_cap > 0 && (int32_t) queue_cap < io->cap) io->cap = (int32_t) queue_cap; // test hook
    io->queue = malloc(sizeof(ls_read) * (size_t) io->cap);
    io->threads = calloc((size_t) n_threads, sizeof(pthread_t));
    if (!io->queue || !io->threads) { ls_set_error("out of memory"); return LS_ERR_NOMEM; }
    for (int i = 0; i < n_threads; i++) {
        if (pthread_create(&io->threads[i], NULL, io_worker, e) != 0) {
            ls_set_error("cannot start I/O thread %d", i);
            return LS_ERR_NOMEM;
        }
        io->n_threads++;
    }
    return LS_OK;
}

void ls_io_stop(ls_engine * e) {
    ls_io * io = &e->io;
    if (!io->threads) return;
    pthread_mutex_lock(&io->mu);
    io->stop = true;
    pthread_cond_broadcast(&io->cv);
    pthread_mutex_unlock(&io->mu);
    for (int i = 0; i < io->n_threads; i++) pthread_join(io->threads[i], NULL);
    free(io->threads);
    free(io->queue);
    pthread_mutex_destroy(&io->mu);
    pthread_cond_destroy(&io->cv);
    memset(io, 0, sizeof(*io));
}

// Called with io->mu held. The queue holds one layer's reads, the next layer's prefetch and
// reads of prefetched blocks that were let go before they landed; should it still be full, the
// submitting thread does the read itself rather than overwrite a queued one.
static void push(ls_engine * e, ls_read * r) {
    ls_io * io = &e->io;
    if (io->count == io->cap) {
        pthread_mutex_unlock(&io->mu);
        do_read(e, r);
        pthread_mutex_lock(&io->mu);
        return;
    }
    io->queue[(io->head + io->count) % io->cap] = *r;
    io->count++;
    pthread_cond_signal(&io->cv);
}

void ls_io_submit(ls_engine * e, ls_layer * L, const int32_t * blocks, int32_t n) {
    ls_io * io = &e->io;
    const uint64_t stride = L->info.block_stride;
    const uint64_t max_blocks_per_read = e->params.max_read_bytes / stride ? e->params.max_read_bytes / stride : 1;
    pthread_mutex_lock(&io->mu);
    ls_read r;
    r.n = 0;
    for (int32_t i = 0; i < n; i++) {
        const int32_t b = blocks[i];
        const bool extends = r.n > 0 && b == r.first + r.n && (uint64_t) r.n < max_blocks_per_read && r.n < LS_MAX_IOV;
        if (!extends) {
            if (r.n > 0) push(e, &r);
            r.L = L;
            r.first = b;
            r.n = 0;
            r.offset = L->info.data_offset + (uint64_t) b * stride;
        }
        r.iov[r.n].iov_base = ls_cache_slot_ptr(&e->cache, L->slot_of_block[b]);
        r.iov[r.n].iov_len = stride;
        r.n++;
    }
    if (r.n > 0) push(e, &r);
    pthread_mutex_unlock(&io->mu);
}

int32_t ls_io_cancel_pending(ls_engine * e, ls_layer * L, int32_t * out, int32_t cap) {
    ls_io * io = &e->io;
    int32_t n_out = 0;
    pthread_mutex_lock(&io->mu);
    int kept = 0;
    for (int i = 0; i < io->count; i++) {
        ls_read * r = &io->queue[(io->head + i) % io->cap];
        if (r->L == L && n_out + r->n <= cap) {
            for (int32_t j = 0; j < r->n; j++) out[n_out++] = r->first + j;
        } else {
            io->queue[(io->head + kept) % io->cap] = *r;
            kept++;
        }
    }
    io->count = kept;
    pthread_mutex_unlock(&io->mu);
    return n_out;
}
