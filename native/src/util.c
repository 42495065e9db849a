// util.c — errors, clocks, spinning and the barrier: leaf utilities every other file uses
// (this file calls no other file of the library).

#include "internal.h"

#include <immintrin.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <time.h>

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

// Spin briefly, then yield: on 2 cores the thread we wait for may need this core.
void ls_cpu_relax(unsigned * spins) {
    if (++*spins < 64) {
        _mm_pause();
    } else {
        sched_yield();
    }
}

void ls_barrier_wait(ls_barrier * b, int n) {
    if (n <= 1) return;
    unsigned gen = atomic_load_explicit(&b->gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->count, 1, memory_order_acq_rel) == n - 1) {
        atomic_store_explicit(&b->count, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&b->gen, 1, memory_order_release);
        return;
    }
    unsigned spins = 0;
    while (atomic_load_explicit(&b->gen, memory_order_acquire) == gen) ls_cpu_relax(&spins);
}
