// util.c — errors (the thread's message, an engine's error slot), clocks, spinning, the barrier,
// opening model files safely and reading them whole, the I/O workers' queue, growing scratch
// buffers: leaf utilities every other file uses (this file calls no other file of the library).

#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static _Thread_local char ls_tls_errmsg[LS_MAX_ERRMSG];

void ls_set_error(const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ls_tls_errmsg, sizeof(ls_tls_errmsg), fmt, ap);
    va_end(ap);
}

const char * ls_errmsg(void) { return ls_tls_errmsg; }
int32_t ls_abi_version(void) { return LS_ABI_VERSION; }

void ls_error_slot_record(ls_error_slot * slot, ls_status st, const char * fmt, va_list ap) {
    pthread_mutex_lock(&slot->mu);
    if (slot->status == LS_OK) { // keep the first error: later ones are usually consequences
        vsnprintf(slot->msg, sizeof(slot->msg), fmt, ap);
        slot->status = st;
    }
    pthread_mutex_unlock(&slot->mu);
}

ls_status ls_error_slot_take(ls_error_slot * slot, char * msg, size_t msg_size) {
    pthread_mutex_lock(&slot->mu);
    const ls_status st = slot->status;
    if (msg && msg_size) snprintf(msg, msg_size, "%s", st == LS_OK ? "" : slot->msg);
    slot->status = LS_OK;
    slot->msg[0] = 0;
    pthread_mutex_unlock(&slot->mu);
    return st;
}

ls_status ls_error_slot_raise(ls_error_slot * slot) {
    char msg[LS_MAX_ERRMSG];
    const ls_status st = ls_error_slot_take(slot, msg, sizeof(msg));
    if (st != LS_OK) ls_set_error("%s", msg);
    return st;
}

void ls_engine_record_error(ls_engine * e, ls_status st, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    ls_error_slot_record(&e->err, st, fmt, ap);
    va_end(ap);
}

void ls_error_record(ls_error_slot * slot, ls_status st, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    ls_error_slot_record(slot, st, fmt, ap);
    va_end(ap);
}

ls_status ls_create_failed(ls_status st, void (* free_obj)(void *), void * obj) {
    char saved[LS_MAX_ERRMSG];
    snprintf(saved, sizeof(saved), "%s", ls_errmsg());
    free_obj(obj);
    ls_set_error("%s", saved);
    return st;
}

uint64_t ls_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000000000ull + (uint64_t) ts.tv_nsec;
}

// Waiting: spin for up to LS_SPIN_NS (the common case on a quiet machine: the other thread is a
// few microseconds away), then sleep on a futex. A thread that spins or yields instead holds a
// core that the thread it waits for may need: with another process busy on every core, each
// wait then cost a scheduler time slice (measured: SmolLM2 decode 0.019x its quiet speed).
// Dekker-style pairing, both sides sequentially consistent: a waiter counts itself in *sleepers
// before it checks *word, a waker changes *word before it checks *sleepers, so one of them sees
// the other; FUTEX_WAIT itself re-checks *word in the kernel.
#define LS_SPIN_NS 50000

// a spinning core's hint that it waits (x86: pause; aarch64: yield; elsewhere nothing)
static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static long futex(_Atomic int32_t * word, int op, int32_t val) {
    return syscall(SYS_futex, (int32_t *) word, op, val, NULL, NULL, 0);
}

void ls_wait_while(_Atomic int32_t * word, int32_t value, _Atomic int32_t * sleepers) {
    if (atomic_load_explicit(word, memory_order_acquire) != value) return;
    const uint64_t t0 = ls_now_ns();
    for (unsigned i = 1;; i++) {
        cpu_relax();
        if (atomic_load_explicit(word, memory_order_acquire) != value) return;
        if ((i & 63) == 0 && ls_now_ns() - t0 > LS_SPIN_NS) break;
    }
    atomic_fetch_add_explicit(sleepers, 1, memory_order_seq_cst);
    while (atomic_load_explicit(word, memory_order_seq_cst) == value) futex(word, FUTEX_WAIT_PRIVATE, value);
    atomic_fetch_sub_explicit(sleepers, 1, memory_order_relaxed);
}

void ls_wake(_Atomic int32_t * word, _Atomic int32_t * sleepers) {
    if (atomic_load_explicit(sleepers, memory_order_seq_cst) > 0) futex(word, FUTEX_WAKE_PRIVATE, INT32_MAX);
}

void ls_barrier_wait(ls_barrier * b, int n) {
    if (n <= 1) return;
    const int32_t gen = atomic_load_explicit(&b->gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->count, 1, memory_order_acq_rel) == n - 1) {
        atomic_store_explicit(&b->count, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&b->gen, 1, memory_order_seq_cst);
        ls_wake(&b->gen, &b->sleepers);
        return;
    }
    ls_wait_while(&b->gen, gen, &b->sleepers);
}

typedef struct team_arg {
    void           (* fn)(void * ctx, int ith, int nth);
    void *            ctx;
    int               ith, nth;
    _Atomic int32_t * go;          // 0: wait, 1: run, -1: abandon (not every thread could be started)
    _Atomic int32_t * sleepers;    // threads asleep on go
} team_arg;

static void * team_thread(void * p) {
    const team_arg * t = p;
    ls_wait_while(t->go, 0, t->sleepers);
    if (atomic_load_explicit(t->go, memory_order_acquire) > 0) t->fn(t->ctx, t->ith, t->nth);
    return NULL;
}

bool ls_run_team(void (* fn)(void * ctx, int ith, int nth), void * ctx, int n_threads) {
    team_arg args[LS_MAX_TEAM];
    pthread_t th[LS_MAX_TEAM];
    _Atomic int32_t go = 0, sleepers = 0;
    for (int i = 0; i < n_threads; i++) args[i] = (team_arg) { fn, ctx, i, n_threads, &go, &sleepers };
    int started = 1;
    for (int i = 1; i < n_threads; i++, started++)
        if (pthread_create(&th[i], NULL, team_thread, &args[i]) != 0) break;
    atomic_store_explicit(&go, started == n_threads ? 1 : -1, memory_order_seq_cst);
    ls_wake(&go, &sleepers);
    if (started == n_threads) team_thread(&args[0]);
    for (int i = 1; i < started; i++) pthread_join(th[i], NULL);
    return started == n_threads;
}

// Open a file of the model directory for reading: the last path component must not be a
// symlink (the Python side resolves the path inside the model directory first), and it must be
// a regular file — a FIFO or device would block or stream forever. O_NONBLOCK keeps open() of a
// FIFO from waiting for a writer; it has no effect on regular files.
ls_status ls_open_regular(const char * path, int * fd_out, struct stat * st) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) {
        if (errno == ELOOP) ls_set_error("%s: is a symbolic link; model files must be regular files", path);
        else ls_set_error("%s: cannot open: %s", path, strerror(errno));
        return LS_ERR_IO;
    }
    if (fstat(fd, st) != 0) { ls_set_error("%s: stat: %s", path, strerror(errno)); close(fd); return LS_ERR_IO; }
    if (!S_ISREG(st->st_mode)) {
        ls_set_error("%s: not a regular file (a FIFO, device or directory); model files must be regular files", path);
        close(fd);
        return LS_ERR_IO;
    }
    *fd_out = fd;
    return LS_OK;
}

ls_status ls_open_data(const char * path, const struct stat * st, bool use_direct_io, bool * direct_io, int * fd) {
    // the data is read with O_DIRECT: the page cache would hide the I/O the budget is about
    if (use_direct_io) {
        *fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_DIRECT);
        if (*fd < 0 && errno == EINVAL) {
            *direct_io = false; // filesystem without O_DIRECT (tmpfs): fall back, reported in stats
        } else if (*fd < 0) {
            ls_set_error("%s: cannot open with O_DIRECT: %s", path, strerror(errno));
            return LS_ERR_IO;
        }
    }
    if (*fd < 0) {
        *fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
        if (*fd < 0) { ls_set_error("%s: cannot open: %s", path, strerror(errno)); return LS_ERR_IO; }
        if (!use_direct_io) *direct_io = false;
    }
    // the file read before must be the one kept open (not replaced in between)
    struct stat st2;
    if (fstat(*fd, &st2) != 0 || st2.st_dev != st->st_dev || st2.st_ino != st->st_ino) {
        ls_set_error("%s: the file changed while it was being opened", path);
        return LS_ERR_IO;
    }
    return LS_OK;
}

const char * ls_preadv_all(int fd, const struct iovec * iov, int n_iov, uint64_t offset, int * err) {
    struct iovec left[LS_MAX_IOV];
    memcpy(left, iov, sizeof(struct iovec) * (size_t) n_iov);
    struct iovec * cur = left;
    size_t want = 0, done = 0;
    for (int i = 0; i < n_iov; i++) want += iov[i].iov_len;
    *err = 0;
    while (done < want) {
        const ssize_t got = preadv(fd, cur, n_iov, (off_t) (offset + done));
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) { *err = errno; return "I/O error"; }
        if (got == 0) return "short read (file truncated?)";
        done += (size_t) got;
        // advance the iovecs past what arrived (O_DIRECT short reads stay block aligned)
        size_t adv = (size_t) got;
        while (n_iov > 0 && adv >= cur->iov_len) { adv -= cur->iov_len; cur++; n_iov--; }
        if (n_iov > 0 && adv) { cur->iov_base = (uint8_t *) cur->iov_base + adv; cur->iov_len -= adv; }
    }
    return NULL;
}

// ---- the work queue (ls_workq) -------------------------------------------------------------------

static void * workq_worker(void * arg) {
    ls_workq * q = arg;
    _Alignas(max_align_t) uint8_t item[LS_WORKQ_MAX_ITEM];
    for (;;) {
        pthread_mutex_lock(&q->mu);
        if (q->count == 0 && q->idle) q->idle(q->owner);
        while (!q->stop && q->count == 0) pthread_cond_wait(&q->cv, &q->mu);
        if (q->stop && q->count == 0) { pthread_mutex_unlock(&q->mu); return NULL; }
        memcpy(item, q->ring + (size_t) q->head * q->item_size, q->item_size);
        q->head = (q->head + 1) % q->cap;
        if (q->n_low == q->count) q->n_low--;   // (only low-priority items were left)
        q->count--;
        pthread_mutex_unlock(&q->mu);
        q->run(q->owner, item);
    }
}

ls_status ls_workq_start(ls_workq * q, int n_threads, int32_t cap, int32_t max_cap) {
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cv, NULL);
    q->max_cap = max_cap;
    q->cap = max_cap < cap ? max_cap : cap;
    q->ring = malloc(q->item_size * (size_t) q->cap);
    q->threads = calloc((size_t) n_threads, sizeof(pthread_t));
    if (!q->ring || !q->threads) { ls_set_error("out of memory"); return LS_ERR_NOMEM; }
    for (int i = 0; i < n_threads; i++) {
        if (pthread_create(&q->threads[i], NULL, workq_worker, q) != 0) {
            ls_set_error("cannot start I/O thread %d", i);
            return LS_ERR_NOMEM;
        }
        q->n_threads++;
    }
    return LS_OK;
}

void ls_workq_stop(ls_workq * q) {
    if (!q->ring && !q->threads) return;
    pthread_mutex_lock(&q->mu);
    q->stop = true;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
    for (int i = 0; i < q->n_threads; i++) pthread_join(q->threads[i], NULL);
    free(q->threads);
    free(q->ring);
    pthread_mutex_destroy(&q->mu);
    pthread_cond_destroy(&q->cv);
    q->threads = NULL;
    q->ring = NULL;
    q->n_threads = 0;
    q->cap = q->max_cap = q->head = q->count = q->n_low = 0;
    q->stop = false;
}

// Called with q->mu held: the ring twice as long (up to max_cap), its items in order from 0. A
// failed allocation leaves it as it was (push then runs the item in the submitting thread).
static void workq_grow(ls_workq * q) {
    const int32_t cap = q->cap * 2 < q->max_cap ? q->cap * 2 : q->max_cap;
    uint8_t * ring = malloc(q->item_size * (size_t) cap);
    if (!ring) return;
    for (int32_t i = 0; i < q->count; i++)
        memcpy(ring + (size_t) i * q->item_size, q->ring + (size_t) ((q->head + i) % q->cap) * q->item_size, q->item_size);
    free(q->ring);
    q->ring = ring;
    q->head = 0;
    q->cap = cap;
}

// item's slot in the ring: at the tail (low: behind everything), or before the low-priority items
static uint8_t * workq_slot(ls_workq * q, bool low) {
    const size_t sz = q->item_size;
    if (low) { q->n_low++; return q->ring + (size_t) ((q->head + q->count) % q->cap) * sz; }
    for (int32_t i = q->count; i > q->count - q->n_low; i--)   // the low ones move back by one
        memcpy(q->ring + (size_t) ((q->head + i) % q->cap) * sz, q->ring + (size_t) ((q->head + i - 1) % q->cap) * sz, sz);
    return q->ring + (size_t) ((q->head + q->count - q->n_low) % q->cap) * sz;
}

void ls_workq_push(ls_workq * q, const void * item) { ls_workq_push_at(q, item, false); }

void ls_workq_push_at(ls_workq * q, const void * item, bool low) {
    if (q->count == q->cap && q->cap < q->max_cap) workq_grow(q);
    if (q->count == q->cap) {
        _Alignas(max_align_t) uint8_t copy[LS_WORKQ_MAX_ITEM];
        memcpy(copy, item, q->item_size);
        pthread_mutex_unlock(&q->mu);
        q->run(q->owner, copy);
        pthread_mutex_lock(&q->mu);
        return;
    }
    memcpy(workq_slot(q, low), item, q->item_size);
    q->count++;
    pthread_cond_signal(&q->cv);
}

void ls_drop_cached(int fd) {
    (void) posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
}

bool ls_grow(void ** p, size_t * cap, size_t need, size_t elem) {
    if (need <= *cap) return true;
    void * q = NULL;
    const size_t bytes = (need * elem + 63) & ~(size_t) 63;
    if (posix_memalign(&q, 64, bytes) != 0) return false;
    free(*p);
    *p = q;
    *cap = need;
    return true;
}
