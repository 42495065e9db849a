// control.c — the streaming controller (LeanStream §3.2.3): at each cascade decode op's layer
// boundary, one state measurement and one table lookup choose the op's knobs.
//
// State: the layer's remaining load R (bytes of its candidates at params.candidate_ratio that are
// not resident, counted by the planner) and the disk's recent speed (an EWMA of the I/O workers'
// preadv time per MiB, updated after every op that read), each binned by the policy's edges.
// Action: the op's candidate ratio and bridge. The table is synthesized offline by `leanstream
// tune` (leanstream_ggml/control.py: Bellman backward recursion over the transitions this file
// records in LS_CTRL_PROFILE mode).
//
// Runs on thread 0 under e->mu (schedule.c and op.c call it); ls_engine_set_controller installs a
// policy between ops (ls_engine_lock_between_ops).

#include "internal.h"

#include <stdlib.h>
#include <string.h>

#define EWMA_ALPHA 0.3
#define MIN_READ_FOR_DISK (128u << 10)   // an op reading less says little about the disk

static int32_t bin_of(double v, const double * edges, int32_t n_bins) {
    int32_t b = 0;
    while (b < n_bins - 1 && v >= edges[b]) b++;
    return b;
}

static uint64_t next_rand(uint64_t * s) {   // xorshift64*
    uint64_t x = *s ? *s : 0x9E3779B97F4A7C15ull;
    x ^= x >> 12; x ^= x << 25; x ^= x >> 27;
    *s = x;
    return x * 0x2545F4914F6CDD1Dull;
}

static ls_status check_policy(const ls_engine * e, const ls_ctrl_policy * p) {
    if (p->mode < LS_CTRL_OFF || p->mode > LS_CTRL_PROFILE) { ls_set_error("controller: unknown mode %d", p->mode); return LS_ERR_ARG; }
    if (p->mode == LS_CTRL_OFF) return LS_OK;
    if (p->n_actions < 1 || p->n_actions > LS_CTRL_MAX_ACTIONS) {
        ls_set_error("controller: n_actions must be in [1, %d], got %d", LS_CTRL_MAX_ACTIONS, p->n_actions);
        return LS_ERR_ARG;
    }
    for (int32_t a = 0; a < p->n_actions; a++) {
        const ls_ctrl_action * x = &p->actions[a];
        if (!(x->candidate_ratio >= 1.0f && x->candidate_ratio <= 1000.0f) || !(x->bridge_scale >= 0.0f && x->bridge_scale <= 64.0f)) {
            ls_set_error("controller: action %d (candidate ratio %g, bridge scale %g) out of range", a,
                         (double) x->candidate_ratio, (double) x->bridge_scale);
            return LS_ERR_ARG;
        }
    }
    if (p->n_load < 1 || p->n_load > LS_CTRL_MAX_LOAD || p->n_disk < 1 || p->n_disk > LS_CTRL_MAX_DISK) {
        ls_set_error("controller: %d load and %d disk states (at most %d and %d)", p->n_load, p->n_disk,
                     LS_CTRL_MAX_LOAD, LS_CTRL_MAX_DISK);
        return LS_ERR_ARG;
    }
    for (int32_t i = 1; i < p->n_load - 1; i++)
        if (!(p->load_edges[i] >= p->load_edges[i - 1])) { ls_set_error("controller: load edges must ascend"); return LS_ERR_ARG; }
    for (int32_t i = 1; i < p->n_disk - 1; i++)
        if (!(p->disk_edges[i] >= p->disk_edges[i - 1])) { ls_set_error("controller: disk edges must ascend"); return LS_ERR_ARG; }
    if (p->mode == LS_CTRL_FIXED && (p->fixed_action < 0 || p->fixed_action >= p->n_actions)) {
        ls_set_error("controller: fixed action %d of %d", p->fixed_action, p->n_actions);
        return LS_ERR_ARG;
    }
    if (p->mode == LS_CTRL_TABLE) {
        if (!p->table) { ls_set_error("controller: table mode without a table"); return LS_ERR_ARG; }
        const size_t n = (size_t) e->n_layers * (size_t) p->n_load * (size_t) p->n_disk;
        for (size_t i = 0; i < n; i++)
            if (p->table[i] >= p->n_actions) { ls_set_error("controller: table entry %zu names action %d of %d", i, p->table[i], p->n_actions); return LS_ERR_ARG; }
    }
    return LS_OK;
}

ls_status ls_engine_set_controller(ls_engine * e, const ls_ctrl_policy * p) {
    if (!e || !p) { ls_set_error("ls_engine_set_controller: bad arguments"); return LS_ERR_ARG; }
    ls_status st = check_policy(e, p);
    if (st != LS_OK) return st;
    uint8_t * table = NULL;
    ls_ctrl_sample * ring = NULL;
    if (p->mode == LS_CTRL_TABLE) {
        const size_t n = (size_t) e->n_layers * (size_t) p->n_load * (size_t) p->n_disk;
        if (!(table = malloc(n))) { ls_set_error("out of memory"); return LS_ERR_NOMEM; }
        memcpy(table, p->table, n);
    }
    if ((p->mode == LS_CTRL_PROFILE || (p->mode != LS_CTRL_OFF && p->record)) && !(ring = malloc(sizeof(ls_ctrl_sample) * LS_CTRL_RING))) {
        free(table);
        ls_set_error("out of memory");
        return LS_ERR_NOMEM;
    }
    ls_engine_lock_between_ops(e);
    ls_ctrl * c = &e->ctrl;
    free(c->table);
    free(c->ring);
    const double ewma = c->disk_ewma;   // the disk's speed carries over
    memset(c, 0, sizeof(*c));
    c->disk_ewma = ewma;
    c->last_read_ns = atomic_load(&e->io.read_ns);
    c->last_read_bytes = atomic_load(&e->io.read_bytes);
    c->pol = *p;
    c->pol.table = NULL;
    c->table = table;
    c->ring = ring;
    c->rng = p->seed;
    ls_engine_unlock_between_ops(e);
    return LS_OK;
}

void ls_ctrl_free(ls_engine * e) {
    free(e->ctrl.table);
    free(e->ctrl.ring);
    e->ctrl.table = NULL;
    e->ctrl.ring = NULL;
}

float ls_ctrl_choose(ls_engine * e, ls_layer * L, uint64_t remaining) {
    ls_ctrl * c = &e->ctrl;
    e->io.op_bridge = e->io.bridge_bytes;
    c->active = false;
    if (c->pol.mode == LS_CTRL_OFF) return e->params.candidate_ratio;
    const uint64_t t0 = ls_now_ns();
    const ls_ctrl_policy * p = &c->pol;
    const int32_t load = bin_of((double) remaining, p->load_edges, p->n_load);
    const int32_t disk = bin_of(c->disk_ewma, p->disk_edges, p->n_disk);
    int32_t a = 0;
    switch (p->mode) {
    case LS_CTRL_FIXED:   a = p->fixed_action; break;
    case LS_CTRL_TABLE:   a = c->table[((size_t) L->il * (size_t) p->n_load + (size_t) load) * (size_t) p->n_disk + (size_t) disk]; break;
    case LS_CTRL_PROFILE: a = (int32_t) (next_rand(&c->rng) % (uint64_t) p->n_actions); break;
    }
    const ls_ctrl_action * x = &p->actions[a];
    uint64_t bridge = (uint64_t) ((double) x->bridge_scale * (double) e->io.bridge_bytes);
    if (bridge > e->io.bridge_cap) bridge = e->io.bridge_cap;
    e->io.op_bridge = bridge;
    c->decisions[a]++;
    c->active = true;
    c->cur = (ls_ctrl_sample) { .seq = c->seq, .layer = L->il, .load_state = load, .disk_state = disk, .action = a,
                                .remaining_bytes = remaining, .disk_ns_per_mib = c->disk_ewma };
    c->bytes0 = atomic_load(&L->f.stats.bytes_read);
    atomic_fetch_add(&L->stats.ctrl_decisions, 1);
    atomic_fetch_add(&L->stats.ctrl_ns, ls_now_ns() - t0);
    return x->candidate_ratio;
}

// After the op (its reads have landed): the disk's EWMA from the workers' preadv time since the
// last op, and the op's sample when profiling.
void ls_ctrl_end(ls_engine * e, ls_layer * L, uint64_t op_ns) {
    ls_ctrl * c = &e->ctrl;
    e->io.op_bridge = e->io.bridge_bytes;
    const uint64_t rn = atomic_load(&e->io.read_ns), rb = atomic_load(&e->io.read_bytes);
    if (rb - c->last_read_bytes >= MIN_READ_FOR_DISK) {
        const double v = (double) (rn - c->last_read_ns) * (double) (1u << 20) / (double) (rb - c->last_read_bytes);
        c->disk_ewma = c->disk_ewma > 0 ? (1 - EWMA_ALPHA) * c->disk_ewma + EWMA_ALPHA * v : v;
        c->last_read_ns = rn;
        c->last_read_bytes = rb;
    }
    if (!c->active) return;
    c->active = false;
    c->seq++;
    if (!c->ring) return;
    c->cur.op_ns = op_ns;
    c->cur.bytes_read = atomic_load(&L->f.stats.bytes_read) - c->bytes0;
    if (c->ring_count == LS_CTRL_RING) { c->ring_head = (c->ring_head + 1) % LS_CTRL_RING; c->ring_count--; c->dropped++; }
    c->ring[(c->ring_head + c->ring_count) % LS_CTRL_RING] = c->cur;
    c->ring_count++;
}

int32_t ls_engine_ctrl_samples(ls_engine * e, ls_ctrl_sample * out, int32_t cap, uint64_t * dropped) {
    if (!e || cap < 0 || (cap > 0 && !out)) return 0;
    pthread_mutex_lock(&e->mu);
    ls_ctrl * c = &e->ctrl;
    int32_t n = 0;
    while (n < cap && c->ring_count > 0) {
        out[n++] = c->ring[c->ring_head];
        c->ring_head = (c->ring_head + 1) % LS_CTRL_RING;
        c->ring_count--;
    }
    if (dropped) *dropped = c->dropped;
    pthread_mutex_unlock(&e->mu);
    return n;
}

ls_status ls_engine_ctrl_decisions(const ls_engine * e, uint64_t * decisions, int32_t n) {
    if (!e || !decisions || n < 0 || n > LS_CTRL_MAX_ACTIONS) { ls_set_error("ls_engine_ctrl_decisions: bad arguments"); return LS_ERR_ARG; }
    pthread_mutex_lock((pthread_mutex_t *) &e->mu);
    memcpy(decisions, e->ctrl.decisions, sizeof(uint64_t) * (size_t) n);
    pthread_mutex_unlock((pthread_mutex_t *) &e->mu);
    return LS_OK;
}
