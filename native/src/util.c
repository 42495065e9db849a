// util.c — errors, clocks, spinning, the barrier, opening model files safely, growing scratch
// buffers: leaf utilities every other file uses (this file calls no other file of the library).

#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <stdarg.h>
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

void ls_engine_record_error(ls_engine * e, ls_status st, const char * fmt, ...) {
    pthread_mutex_lock(&e->err_mu);
    if (e->err_status == LS_OK) { // keep the first error: later ones are usually consequences
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(e->err_msg, sizeof(e->err_msg), fmt, ap);
        va_end(ap);
        e->err_status = st;
    }
    pthread_mutex_unlock(&e->err_mu);
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
