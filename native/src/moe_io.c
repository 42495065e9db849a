// moe_io.c — expert files and their reads: a layer's expert file opened with its header checked
// field by field (docs/formats.md "Expert file"; every file is treated as hostile, as blockfile.c
// treats block files), the O_DIRECT read workers that bring experts into cache slots, each
// expert's CRC-32C checked by the worker that read it, and the MoE engine's error slot.
//
// The op (moe.c) queues a batch's missing experts in the order it computes them; the workers pop
// reads FIFO, so the first-needed experts land first. An expert's state and its op's entry flag
// flip with a release store once its bytes are in and checked: the compute threads' acquire load
// of that flag is the only synchronisation between the two sides, as with the dense blocks (io.c).

#include "internal.h"

#include "ggml.h"
#include "ggml-cpu.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

void ls_moe_record_error(ls_moe * m, ls_status st, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    ls_error_slot_record(&m->err, st, fmt, ap);
    va_end(ap);
}

// ---- the header ----------------------------------------------------------------------------------

#define EXPERT_MAGIC "LSEXPRTS"
#define EXPERT_META_CRC 112          // offset of meta_crc in the header
#define EXPERT_MAX 65536             // experts per layer (llama.cpp's LLAMA_MAX_EXPERTS is 512)

static uint64_t round_up(uint64_t x, uint64_t n) { return (x + n - 1) / n * n; }

// a type whose rows ggml's CPU backend dots (vec_dot) against an activation it can quantize
static bool type_ok_for_rows(int32_t t) {
    return ls_cpu_dots_rows(t) && ggml_blck_size((enum ggml_type) t) > 0;
}

// n values make whole blocks of type t and of its vec_dot_type (what ggml_mul_mat requires)
static bool fits_blocks(int32_t t, int64_t n) {
    const enum ggml_type vt = ls_cpu_traits((enum ggml_type) t)->vec_dot_type;
    return n % ggml_blck_size((enum ggml_type) t) == 0 && n % ggml_blck_size(vt) == 0;
}

typedef struct {
    uint32_t il, align, meta_crc;
    uint64_t table_offset, file_size;
} expert_header;

// the header h (magic and version checked) read into L->info, L's sizes and *hd as written
// (header_flaw judges it)
static void read_header(const uint8_t * h, ls_moe_layer * L, expert_header * hd) {
    ls_moe_info * in = &L->info;
    hd->il            = ls_rd_u32(h + 12);
    in->n_embd        = (int64_t) ls_rd_u64(h + 16);
    in->n_ff_exp      = (int64_t) ls_rd_u64(h + 24);
    in->n_expert      = (int32_t) ls_rd_u32(h + 32);
    hd->align         = ls_rd_u32(h + 36);
    in->gate_type     = (int32_t) ls_rd_u32(h + 40);
    in->up_type       = (int32_t) ls_rd_u32(h + 44);
    in->down_type     = (int32_t) ls_rd_u32(h + 48);
    L->gate_bytes     = ls_rd_u64(h + 56);
    L->up_bytes       = ls_rd_u64(h + 64);
    L->down_bytes     = ls_rd_u64(h + 72);
    in->expert_stride = ls_rd_u64(h + 80);
    hd->table_offset  = ls_rd_u64(h + 88);
    L->data_offset    = ls_rd_u64(h + 96);
    hd->file_size     = ls_rd_u64(h + 104);
    hd->meta_crc      = ls_rd_u32(h + EXPERT_META_CRC);
    L->align          = hd->align;
}

// what is wrong with the header's geometry (NULL: nothing). The bounds come first, so that the
// sizes computed from them cannot overflow.
static const char * header_flaw(const ls_moe_layer * L, int32_t il, const expert_header * hd) {
    const ls_moe_info * in = &L->info;
    if (hd->il != (uint32_t) il) return "layer index does not match its position";
    if (in->n_embd <= 0 || in->n_ff_exp <= 0 || in->n_expert <= 0) return "zero dimension";
    if (in->n_embd > (1 << 20) || in->n_ff_exp > (1 << 20) || in->n_expert > EXPERT_MAX) return "implausibly large dimension";
    if (!type_ok_for_rows(in->gate_type) || !type_ok_for_rows(in->up_type) || !type_ok_for_rows(in->down_type))
        return "a type ggml's CPU backend has no vec_dot for";
    if (!fits_blocks(in->gate_type, in->n_embd) || !fits_blocks(in->up_type, in->n_embd) ||
        !fits_blocks(in->down_type, in->n_ff_exp)) return "dimensions are not whole blocks of the types";
    if (L->gate_bytes != (uint64_t) in->n_ff_exp * ggml_row_size(in->gate_type, in->n_embd) ||
        L->up_bytes   != (uint64_t) in->n_ff_exp * ggml_row_size(in->up_type, in->n_embd) ||
        L->down_bytes != (uint64_t) in->n_embd * ggml_row_size(in->down_type, in->n_ff_exp)) return "sizes do not match the types";
    if (hd->align < 512 || hd->align > (1u << 20) || (hd->align & (hd->align - 1)) != 0)
        return "alignment is not a power of two in [512, 1 MiB]";
    if (in->expert_stride != round_up(L->gate_bytes + L->up_bytes + L->down_bytes, hd->align)) return "bad expert stride";
    if (hd->table_offset != LS_FILE_HEADER ||
        L->data_offset != round_up(hd->table_offset + 8ull * (uint64_t) in->n_expert, hd->align > 4096 ? hd->align : 4096))
        return "bad offsets";
    if (hd->file_size != L->data_offset + (uint64_t) in->n_expert * in->expert_stride) return "file_size field inconsistent";
    return NULL;
}

// the tables (expert_of_slot, slot_crc) read with the header and checked against meta_crc, and
// expert_of_slot a permutation; L's per-expert arrays allocated
static ls_status read_tables(int fd, const char * path, ls_moe_layer * L, const expert_header * hd) {
    const int32_t n = L->info.n_expert;
    L->expert_of_slot = malloc((size_t) n * sizeof(int32_t));
    L->slot_of_expert = malloc((size_t) n * sizeof(int32_t));
    L->slot_crc = malloc((size_t) n * sizeof(uint32_t));
    L->cslot = malloc((size_t) n * sizeof(int32_t));
    L->state = calloc((size_t) n, sizeof(*L->state));
    L->hot = calloc((size_t) n, 1);
    if (!L->expert_of_slot || !L->slot_of_expert || !L->slot_crc || !L->cslot || !L->state || !L->hot) {
        ls_set_error("out of memory");
        return LS_ERR_NOMEM;
    }
    uint8_t * meta;
    const ls_status s = ls_model_file_tables(fd, path, "expert", L->il, L->data_offset, EXPERT_META_CRC, hd->meta_crc, &meta);
    if (s != LS_OK) return s;
    memcpy(L->expert_of_slot, meta + hd->table_offset, (size_t) n * 4);
    memcpy(L->slot_crc, meta + hd->table_offset + 4ull * (uint64_t) n, (size_t) n * 4);
    free(meta);
    for (int32_t e = 0; e < n; e++) { L->slot_of_expert[e] = -1; L->cslot[e] = -1; }
    for (int32_t s = 0; s < n; s++) {
        const int32_t e = L->expert_of_slot[s];
        if (e < 0 || e >= n || L->slot_of_expert[e] >= 0) {
            ls_set_error("%s: layer %d: expert_of_slot is not a permutation of the %d experts (slot %d: %d)",
                         path, L->il, n, s, e);
            return LS_ERR_FORMAT;
        }
        L->slot_of_expert[e] = s;
    }
    return LS_OK;
}

ls_status ls_moe_file_open(ls_moe_layer * L, int32_t il, const char * path, bool use_direct_io, bool * direct_io) {
    L->il = il;
    L->fd = -1;
    if (!ls_cpu_ready()) { ls_set_error("%s: ggml's CPU backend is not loaded (its type traits compute the experts)", path); return LS_ERR_UNSUPPORTED; }
    int fd = -1;
    struct stat st;
    uint8_t h[LS_FILE_HEADER];
    ls_status s = ls_model_file_begin(path, "expert", EXPERT_MAGIC, LS_EXPERT_FILE_VERSION, NULL, &L->path, &fd, &st, h);
    if (s != LS_OK) return s;
    expert_header hd;
    read_header(h, L, &hd);
    const char * bad = header_flaw(L, il, &hd);
    if (bad) { ls_set_error("%s: layer %d: malformed expert file header: %s", path, il, bad); s = LS_ERR_FORMAT; }
    if (s == LS_OK && (uint64_t) st.st_size < hd.file_size) {
        ls_set_error("%s: layer %d: truncated expert file: %lld bytes, header says %llu", path, il,
                     (long long) st.st_size, (unsigned long long) hd.file_size);
        s = LS_ERR_FORMAT;
    }
    if (s == LS_OK) s = read_tables(fd, path, L, &hd);
    close(fd);
    if (s != LS_OK) return s;
    return ls_open_data(path, &st, use_direct_io, direct_io, &L->fd);
}

void ls_moe_file_close(ls_moe_layer * L) {
    if (L->fd >= 0) close(L->fd);
    L->fd = -1;
    free(L->path); free(L->expert_of_slot); free(L->slot_of_expert); free(L->slot_crc);
    free(L->cslot); free((void *) L->state); free(L->hot);
    L->path = NULL; L->expert_of_slot = L->slot_of_expert = L->cslot = NULL; L->slot_crc = NULL;
    L->state = NULL; L->hot = NULL;
}

// ---- the read workers ----------------------------------------------------------------------------

// the expert's bytes against its slot's CRC-32C (the file slot it came from)
static bool expert_intact(ls_moe * m, ls_moe_layer * L, int32_t e, const uint8_t * p) {
    if (!m->params.verify_checksums) return true;
    const uint64_t t0 = ls_now_ns();
    const int32_t s = L->slot_of_expert[e];
    const uint32_t have = ls_crc32c(0, p, L->info.expert_stride);
    atomic_fetch_add_explicit(&L->stats.checksum_ns, ls_now_ns() - t0, memory_order_relaxed);
    if (have == L->slot_crc[s]) return true;
    ls_moe_record_error(m, LS_ERR_CORRUPT,
                        "%s: layer %d slot %d (expert %d) is corrupt (CRC-32C %08x, stored %08x, file offset %llu); "
                        "`leanstream verify` checks the whole model directory, re-run `leanstream convert` to repair it",
                        L->path, L->il, s, e, have, L->slot_crc[s],
                        (unsigned long long) (L->data_offset + (uint64_t) s * L->info.expert_stride));
    return false;
}

// every expert of the read checked (or all failed), its state and flag set, the sleepers woken
static void finish_read(ls_moe * m, ls_moe_read * r, ls_status st, const char * why, int err) {
    ls_moe_layer * L = r->L;
    if (st != LS_OK) {
        ls_moe_record_error(m, st, "%s: layer %d: read of %d expert(s) at offset %llu (slot %d, expert %d first) failed: %s%s%s",
                            L->path, L->il, r->n, (unsigned long long) r->offset, L->slot_of_expert[r->expert[0]],
                            r->expert[0], why, err ? ": " : "", err ? strerror(err) : "");
    } else {
        atomic_fetch_add(&L->stats.bytes_read, (uint64_t) r->n * L->info.expert_stride);
        atomic_fetch_add(&L->stats.reads, 1);
    }
    for (int32_t i = 0; i < r->n; i++) {
        const bool ok = st == LS_OK && expert_intact(m, L, r->expert[i], r->iov[i].iov_base);
        const int32_t v = ok ? LS_BLK_READY : LS_BLK_FAILED;
        atomic_store_explicit(&L->state[r->expert[i]], v, memory_order_release);
        atomic_store_explicit(r->flag[i], v, memory_order_seq_cst);
        ls_wake(r->flag[i], &m->sleepers);
    }
}

// Test hook (m->hooks): the one read that fails, if this is it.
static int32_t injected_fault(ls_moe * m) {
    if (m->hooks.fault == LS_FAULT_NONE || m->hooks.fault_read == 0) return LS_FAULT_NONE;
    return atomic_fetch_sub_explicit(&m->io.fault_countdown, 1, memory_order_relaxed) == 1 ? m->hooks.fault : LS_FAULT_NONE;
}

static void do_read(ls_moe * m, ls_moe_read * r) {
    ls_moe_layer * L = r->L;
    if (m->hooks.io_delay_us) usleep((useconds_t) (rand() % m->hooks.io_delay_us));   // test hook: jittered I/O
    const int32_t fault = injected_fault(m);
    if (fault == LS_FAULT_EIO) { finish_read(m, r, LS_ERR_IO, "I/O error (injected)", EIO); return; }
    if (fault == LS_FAULT_SHORT) { finish_read(m, r, LS_ERR_IO, "short read (injected)", 0); return; }
    int err;
    const char * why = ls_preadv_all(L->fd, r->iov, r->n, r->offset, &err);
    if (why) { finish_read(m, r, LS_ERR_IO, why, err); return; }
    if (fault == LS_FAULT_CORRUPT) ((uint8_t *) r->iov[0].iov_base)[r->iov[0].iov_len / 2] ^= 0x10;   // one bit flipped
    finish_read(m, r, LS_OK, NULL, 0);
}

static void run_read(void * owner, void * item) { do_read(owner, item); }

ls_status ls_moe_io_start(ls_moe * m, int n_threads) {
    ls_moe_io * io = &m->io;
    atomic_store(&io->fault_countdown, (int64_t) m->hooks.fault_read);
    // at most one read per cache slot is ever queued (a slot is read into once, then computed):
    // the ring starts small and grows towards that as reads wait
    io->q = (ls_workq) { .run = run_read, .owner = m, .item_size = sizeof(ls_moe_read) };
    return ls_workq_start(&io->q, n_threads, 64, m->n_slots + 1);
}

void ls_moe_io_stop(ls_moe * m) {
    ls_workq_stop(&m->io.q);
    memset(&m->io, 0, sizeof(m->io));
}

void ls_moe_io_submit(ls_moe * m, ls_moe_layer * L, const int32_t * experts, _Atomic int32_t * const * flags, int32_t n) {
    ls_workq * q = &m->io.q;
    const uint64_t stride = L->info.expert_stride;
    pthread_mutex_lock(&q->mu);
    ls_moe_read r = { .L = L, .n = 0 };
    int32_t next_slot = -1;   // the file slot after the read's last one
    for (int32_t i = 0; i < n; i++) {
        const int32_t e = experts[i], s = L->slot_of_expert[e];
        const bool extends = r.n > 0 && s == next_slot && r.n < LS_MOE_MAX_IOV &&
                             (uint64_t) (r.n + 1) * stride <= m->params.max_read_bytes;
        if (!extends) {
            if (r.n > 0) ls_workq_push(q, &r);
            r.n = 0;
            r.offset = L->data_offset + (uint64_t) s * stride;
        }
        r.expert[r.n] = e;
        r.flag[r.n] = flags[i];
        r.iov[r.n].iov_base = m->pool + (size_t) L->cslot[e] * m->stride;
        r.iov[r.n].iov_len = stride;
        r.n++;
        next_slot = s + 1;
    }
    if (r.n > 0) ls_workq_push(q, &r);
    pthread_mutex_unlock(&q->mu);
}
