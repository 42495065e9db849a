// engine.c — engine lifetime, block file headers, errors, counters.

#include "internal.h"

#include "ggml.h"
#include "ggml-cpu.h"

#include <errno.h>
#include <fcntl.h>
#include <immintrin.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static _Thread_local char tls_errmsg[LS_MAX_ERRMSG];

void ls_set_error(const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tls_errmsg, sizeof(tls_errmsg), fmt, ap);
    va_end(ap);
}

const char * ls_errmsg(void) { return tls_errmsg; }
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

ls_status ls_engine_take_error(ls_engine * e, char * msg, size_t msg_size) {
    if (!e) return LS_ERR_ARG;
    pthread_mutex_lock(&e->err_mu);
    ls_status st = e->err_status;
    if (msg && msg_size) snprintf(msg, msg_size, "%s", st == LS_OK ? "" : e->err_msg);
    e->err_status = LS_OK;
    e->err_msg[0] = 0;
    pthread_mutex_unlock(&e->err_mu);
    return st;
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

void ls_engine_params_init(ls_engine_params * p) {
    memset(p, 0, sizeof(*p));
    p->activation     = LS_ACT_SILU;
    p->mode           = LS_MODE_DENSE;
    p->memory_budget  = 0;
    p->n_io_threads   = 16; // random 4 KiB O_DIRECT reads need 8+ in flight for full IOPS
    p->max_read_bytes = 256u << 10;
    p->use_direct_io  = 1;
    p->sparsity       = 0.0f;
    p->n_stages       = 8;
    p->verify_checksums = 1;
}

// ---- block file header (format in leanstream.h) --------------------------------------------

static uint32_t rd_u32(const uint8_t * p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t rd_u64(const uint8_t * p) { uint64_t v; memcpy(&v, p, 8); return v; }

static bool type_ok_for_rows(int32_t t) {
    if (t < 0 || t >= GGML_TYPE_COUNT) return false;
    const struct ggml_type_traits_cpu * tc = ggml_get_type_traits_cpu((enum ggml_type) t);
    const struct ggml_type_traits_cpu * vt = tc && tc->vec_dot ? ggml_get_type_traits_cpu(tc->vec_dot_type) : NULL;
    return tc && tc->vec_dot && vt && vt->from_float;
}

static bool type_ok_for_cols(int32_t t) {
    if (t < 0 || t >= GGML_TYPE_COUNT) return false;
    if (t == GGML_TYPE_F32) return true;
    const struct ggml_type_traits * tt = ggml_get_type_traits((enum ggml_type) t);
    return tt && tt->to_float && tt->blck_size > 0;
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

static ls_status open_layer(ls_engine * e, ls_layer * L, int32_t il, const char * path) {
    L->e = e;
    L->il = il;
    L->fd = -1;
    L->path = strdup(path);
    if (!L->path) { ls_set_error("out of memory"); return LS_ERR_NOMEM; }

    int fd = -1;
    struct stat st;
    ls_status ost = ls_open_regular(path, &fd, &st);
    if (ost != LS_OK) return ost;
    uint8_t h[4096];
    ssize_t got = pread(fd, h, sizeof(h), 0);
    if (got != (ssize_t) sizeof(h)) {
        ls_set_error("%s: truncated block file (%lld bytes, header needs 4096)", path, (long long) st.st_size);
        close(fd);
        return LS_ERR_FORMAT;
    }
    if (memcmp(h, "LSBLOCKS", 8) != 0) {
        ls_set_error("%s: not a leanstream block file (bad magic)", path);
        close(fd);
        return LS_ERR_FORMAT;
    }
    uint32_t version = rd_u32(h + 8);
    if (version != LS_BLOCK_FILE_VERSION) {
        ls_set_error("%s: block file version %u, this build reads version %d%s (re-run `leanstream convert` "
                     "with --force to rewrite the model directory)", path, version, LS_BLOCK_FILE_VERSION,
                     version == 1 ? ", which adds a checksum to every block" : "");
        close(fd);
        return LS_ERR_FORMAT;
    }
    ls_layer_info * in = &L->info;
    uint32_t file_il   = rd_u32(h + 12);
    in->n_embd          = (int64_t) rd_u64(h + 16);
    in->n_ff            = (int64_t) rd_u64(h + 24);
    in->neurons_per_block = (int32_t) rd_u32(h + 32);
    in->n_blocks        = (int32_t) rd_u32(h + 36);
    in->gate_type       = (int32_t) rd_u32(h + 40);
    in->up_type         = (int32_t) rd_u32(h + 44);
    in->down_type       = (int32_t) rd_u32(h + 48);
    uint32_t align      = rd_u32(h + 52);
    L->gate_row_bytes   = rd_u64(h + 56);
    L->up_row_bytes     = rd_u64(h + 64);
    L->down_col_bytes   = rd_u64(h + 72);
    in->block_stride    = rd_u64(h + 80);
    uint64_t perm_off   = rd_u64(h + 88);
    in->data_offset     = rd_u64(h + 96);
    uint64_t file_size  = rd_u64(h + 104);
    uint64_t crc_off    = rd_u64(h + 112);
    uint32_t meta_crc   = rd_u32(h + 120);

    const int64_t k = in->neurons_per_block;
    const char * bad = NULL;
    if (file_il != (uint32_t) il) bad = "layer index does not match its position";
    else if (in->n_embd <= 0 || in->n_ff <= 0 || k <= 0) bad = "zero dimension";
    else if (in->n_embd > (1 << 24) || in->n_ff > (1 << 28)) bad = "implausibly large dimension";
    else if (k > 256) bad = "more than 256 neurons per block";
    else if ((int64_t) in->n_blocks != (in->n_ff + k - 1) / k) bad = "n_blocks != ceil(n_ff / k)";
    else if (!type_ok_for_rows(in->gate_type) || !type_ok_for_rows(in->up_type)) bad = "unsupported gate/up type";
    else if (!type_ok_for_cols(in->down_type)) bad = "unsupported down column type";
    else if (L->gate_row_bytes != ggml_row_size(in->gate_type, in->n_embd) ||
             L->up_row_bytes   != ggml_row_size(in->up_type, in->n_embd) ||
             in->n_embd % ggml_blck_size(in->down_type) != 0 ||
             L->down_col_bytes != ggml_row_size(in->down_type, in->n_embd)) bad = "row sizes do not match the types";
    else if (align < 512 || (align & (align - 1)) != 0) bad = "alignment is not a power of two >= 512";
    else if (in->block_stride % align != 0 || in->block_stride > (1ull << 32) ||
             in->block_stride < (uint64_t) k * (L->gate_row_bytes + L->up_row_bytes + L->down_col_bytes)) bad = "bad block stride";
    else if (perm_off < 128 || perm_off > (1ull << 40) || in->data_offset % 4096 != 0 ||
             crc_off != perm_off + 4ull * (uint64_t) in->n_blocks * (uint64_t) k ||
             crc_off + 4ull * (uint64_t) in->n_blocks > in->data_offset) bad = "bad offsets";
    else if (file_size != in->data_offset + (uint64_t) in->n_blocks * in->block_stride) bad = "file_size field inconsistent";
    if (bad) {
        ls_set_error("%s: malformed block file header: %s", path, bad);
        close(fd);
        return LS_ERR_FORMAT;
    }
    if ((uint64_t) st.st_size < file_size) {
        ls_set_error("%s: truncated block file: %lld bytes, header says %llu", path,
                     (long long) st.st_size, (unsigned long long) file_size);
        close(fd);
        return LS_ERR_FORMAT;
    }
    in->block_payload = (uint64_t) k * (L->gate_row_bytes + L->up_row_bytes + L->down_col_bytes);

    const size_t n_slots = (size_t) in->n_blocks * (size_t) k;
    L->perm = malloc(n_slots * sizeof(int32_t));
    L->block_crc = malloc((size_t) in->n_blocks * sizeof(uint32_t));
    L->verified = calloc((size_t) in->n_blocks, sizeof(*L->verified));
    L->slot_of_block = malloc((size_t) in->n_blocks * sizeof(int32_t));
    L->state = calloc((size_t) in->n_blocks, sizeof(*L->state));
    uint8_t * meta = malloc((size_t) in->data_offset);
    if (!L->perm || !L->block_crc || !L->verified || !L->slot_of_block || !L->state || !meta) {
        free(meta); close(fd); ls_set_error("out of memory"); return LS_ERR_NOMEM;
    }
    // header, perm and checksum tables: one read, checked against meta_crc before any use
    if (pread(fd, meta, (size_t) in->data_offset, 0) != (ssize_t) in->data_offset) {
        ls_set_error("%s: cannot read the block file's tables (%llu bytes)", path, (unsigned long long) in->data_offset);
        free(meta); close(fd);
        return LS_ERR_FORMAT;
    }
    memset(meta + 120, 0, 4);
    const uint32_t have_crc = ls_crc32c(0, meta, (size_t) in->data_offset);
    if (have_crc != meta_crc) {
        ls_set_error("%s: layer %d: header or tables corrupt (CRC-32C %08x, stored %08x); "
                     "`leanstream verify` checks the whole model directory, re-run `leanstream convert` to repair it",
                     path, il, have_crc, meta_crc);
        free(meta); close(fd);
        return LS_ERR_CORRUPT;
    }
    memcpy(L->perm, meta + perm_off, n_slots * 4);
    memcpy(L->block_crc, meta + crc_off, (size_t) in->n_blocks * 4);
    free(meta);
    // every neuron exactly once, padding only as -1
    uint8_t * seen = calloc((size_t) in->n_ff, 1);
    if (!seen) { close(fd); ls_set_error("out of memory"); return LS_ERR_NOMEM; }
    int64_t n_real = 0;
    for (size_t i = 0; i < n_slots && !bad; i++) {
        int32_t nid = L->perm[i];
        if (nid == -1) continue;
        if (nid < 0 || nid >= in->n_ff || seen[nid]) bad = "permutation is not a permutation of the neurons";
        else { seen[nid] = 1; n_real++; }
    }
    free(seen);
    if (!bad && n_real != in->n_ff) bad = "permutation misses neurons";
    if (bad) { ls_set_error("%s: %s", path, bad); close(fd); return LS_ERR_FORMAT; }
    for (int32_t b = 0; b < in->n_blocks; b++) L->slot_of_block[b] = -1;
    close(fd);
    L->prio        = calloc((size_t) in->n_blocks, sizeof(float));
    L->prefetch    = malloc((size_t) in->n_blocks * sizeof(int32_t));
    L->order       = malloc((size_t) in->n_blocks * sizeof(int32_t));
    L->stage_mark  = malloc((size_t) in->n_blocks);
    if (L->stage_mark) memset(L->stage_mark, 0xFF, (size_t) in->n_blocks);
    L->in_prefetch = calloc((size_t) in->n_blocks, 1);
    L->last_plan   = malloc((size_t) in->n_blocks * sizeof(int32_t));
    if (!L->prio || !L->prefetch || !L->order || !L->stage_mark || !L->in_prefetch || !L->last_plan) { ls_set_error("out of memory"); return LS_ERR_NOMEM; }

    // the data is read with O_DIRECT: the page cache would hide the I/O the budget is about
    if (e->params.use_direct_io) {
        L->fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_DIRECT);
        if (L->fd < 0 && errno == EINVAL) {
            e->direct_io = false; // filesystem without O_DIRECT (tmpfs): fall back, reported in stats
        } else if (L->fd < 0) {
            ls_set_error("%s: cannot open with O_DIRECT: %s", path, strerror(errno));
            return LS_ERR_IO;
        }
    }
    if (L->fd < 0) {
        L->fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
        if (L->fd < 0) { ls_set_error("%s: cannot open: %s", path, strerror(errno)); return LS_ERR_IO; }
        if (!e->params.use_direct_io) e->direct_io = false;
    }
    // the file read above must be the one kept open (not replaced in between)
    struct stat st2;
    if (fstat(L->fd, &st2) != 0 || st2.st_dev != st.st_dev || st2.st_ino != st.st_ino) {
        ls_set_error("%s: the file changed while it was being opened", path);
        return LS_ERR_IO;
    }
    return LS_OK;
}

ls_status ls_engine_create(const ls_engine_params * p, ls_engine ** out) {
    if (!p || !out || p->n_layers <= 0 || !p->block_paths) { ls_set_error("ls_engine_create: bad arguments"); return LS_ERR_ARG; }
    if (p->activation != LS_ACT_SILU && p->activation != LS_ACT_GELU) { ls_set_error("unknown activation %d", p->activation); return LS_ERR_ARG; }
    if (p->mode < LS_MODE_DENSE || p->mode > LS_MODE_LEANSTREAM) { ls_set_error("unknown mode %d", p->mode); return LS_ERR_ARG; }
    if (!(p->sparsity >= 0.0f && p->sparsity < 1.0f)) { ls_set_error("sparsity must be in [0, 1), got %g", (double) p->sparsity); return LS_ERR_ARG; }
    if (p->cache_policy != LS_CACHE_LRU && p->cache_policy != LS_CACHE_PRIORITY) { ls_set_error("unknown cache policy %d", p->cache_policy); return LS_ERR_ARG; }
    if (p->n_io_threads < 1 || p->n_io_threads > 256) { ls_set_error("n_io_threads must be in [1, 256], got %d", p->n_io_threads); return LS_ERR_ARG; }
    if (p->n_stages < 1 || p->n_stages > LS_MAX_STAGES) { ls_set_error("n_stages must be in [1, %d], got %d", LS_MAX_STAGES, p->n_stages); return LS_ERR_ARG; }
    *out = NULL;
    ggml_cpu_init(); // fp16 tables for the CPU type traits (idempotent)

    ls_engine * e = calloc(1, sizeof(*e));
    if (!e) { ls_set_error("out of memory"); return LS_ERR_NOMEM; }
    e->params = *p;
    if (e->params.max_read_bytes < 4096) e->params.max_read_bytes = 256u << 10;
    e->params.block_paths = NULL; // not owned
    e->direct_io = true;
    pthread_mutex_init(&e->mu, NULL);
    pthread_mutex_init(&e->err_mu, NULL);
    e->n_layers = p->n_layers;
    e->layers = calloc((size_t) p->n_layers, sizeof(ls_layer));
    if (!e->layers) { free(e); ls_set_error("out of memory"); return LS_ERR_NOMEM; }
    for (int32_t il = 0; il < p->n_layers; il++) e->layers[il].fd = -1;

    ls_status st = LS_OK;
    uint64_t stride = 0, total_bytes = 0;
    int32_t total_blocks = 0, max_layer_blocks = 0, max_working_set = 0;
    for (int32_t il = 0; il < p->n_layers && st == LS_OK; il++) {
        if (!p->block_paths[il]) { ls_set_error("block path of layer %d is NULL", il); st = LS_ERR_ARG; break; }
        st = open_layer(e, &e->layers[il], il, p->block_paths[il]);
        if (st != LS_OK) break;
        const ls_layer_info * in = &e->layers[il].info;
        if (in->n_embd != e->layers[0].info.n_embd) {
            ls_set_error("%s: n_embd %lld differs from layer 0", p->block_paths[il], (long long) in->n_embd);
            st = LS_ERR_FORMAT;
            break;
        }
        if (p->predictor_paths && p->predictor_paths[il]) {
            ls_layer * L = &e->layers[il];
            ls_predictor_info pi;
            st = ls_predictor_load(p->predictor_paths[il], &L->pred);
            if (st == LS_OK) st = ls_predictor_get_info(L->pred, &pi);
            if (st == LS_OK && pi.layer >= 0 && pi.layer != il) {  // -1: written without a layer
                ls_set_error("%s: predictor trained for layer %d, given for layer %d", p->predictor_paths[il], pi.layer, il);
                st = LS_ERR_FORMAT;
            }
            if (st == LS_OK && (pi.n_blocks != in->n_blocks || pi.n_embd != in->n_embd)) {
                ls_set_error("%s: predictor for %d blocks of n_embd %d, layer %d has %d blocks of n_embd %lld",
                             p->predictor_paths[il], pi.n_blocks, pi.n_embd, il, in->n_blocks, (long long) in->n_embd);
                st = LS_ERR_FORMAT;
            }
            if (st != LS_OK) break;
        }
        if (in->block_stride > stride) stride = in->block_stride;
        total_blocks += in->n_blocks;
        total_bytes += (uint64_t) in->n_blocks * in->block_stride;
        const int32_t ws = p->mode == LS_MODE_DENSE ? in->n_blocks : ls_sched_n_selected(e, &e->layers[il]);
        if (ws > max_working_set) max_working_set = ws;
        if (in->n_blocks > max_layer_blocks) max_layer_blocks = in->n_blocks;
    }
    if (st == LS_OK) {
        // budget -> slots. Unlimited (0) or a budget covering everything: one slot per block,
        // read once and kept. Dense mode pins a whole layer while it computes.
        int64_t n_slots = total_blocks;
        if (p->memory_budget > 0 && p->memory_budget < (uint64_t) total_blocks * stride) {
            n_slots = (int64_t) (p->memory_budget / stride);
        }
        if (n_slots < max_working_set) {
            ls_set_error("memory budget %llu bytes is too small: one layer's working set is %d blocks "
                         "x %llu bytes = %llu bytes (%s); the whole FFN is %llu bytes",
                         (unsigned long long) p->memory_budget, max_working_set,
                         (unsigned long long) stride, (unsigned long long) max_working_set * stride,
                         p->mode == LS_MODE_DENSE ? "dense: every block of a layer" : "the blocks computed per token",
                         (unsigned long long) total_bytes);
            st = LS_ERR_BUDGET;
        } else {
            st = ls_cache_init(&e->cache, stride, (int32_t) n_slots, total_blocks);
            e->cache.policy = p->cache_policy;
        }
        ls_plan * P = &e->plan;
        if (st == LS_OK) {
            P->blocks   = malloc(sizeof(int32_t) * (size_t) max_layer_blocks);
            P->scratch  = malloc(sizeof(int32_t) * (size_t) max_layer_blocks);
            P->scratch2 = malloc(sizeof(int32_t) * (size_t) max_layer_blocks);
            P->x_ref    = malloc(sizeof(float) * (size_t) e->layers[0].info.n_embd);
            if (!P->blocks || !P->scratch || !P->scratch2 || !P->x_ref) { ls_set_error("out of memory"); st = LS_ERR_NOMEM; }
        }
    }
    if (st == LS_OK && p->mode == LS_MODE_DENSE && !e->cache.never_evicts) {
        // Dense decode scans every block of every layer in the same order each token: LRU
        // evicts each block just before it is needed again and reads the whole FFN per token.
        // Keep a fixed prefix of the scan resident instead (the optimal policy for a cyclic
        // scan) and stream the rest through the slots one layer needs.
        int32_t n_pin = e->cache.n_slots - max_layer_blocks;
        for (int32_t il = 0; il < p->n_layers && n_pin > 0 && st == LS_OK; il++) {
            ls_layer * L = &e->layers[il];
            L->hot = calloc((size_t) L->info.n_blocks, 1);
            L->hot_pinned = calloc((size_t) L->info.n_blocks, 1);
            if (!L->hot || !L->hot_pinned) { ls_set_error("out of memory"); st = LS_ERR_NOMEM; break; }
            for (int32_t b = 0; b < L->info.n_blocks && n_pin > 0; b++, n_pin--) L->hot[b] = 1;
        }
    }
    if (st == LS_OK) st = ls_io_start(e, e->params.n_io_threads, p->test_io_delay_us, p->test_io_queue_cap);
    if (st != LS_OK) {
        char saved[LS_MAX_ERRMSG];
        snprintf(saved, sizeof(saved), "%s", tls_errmsg);
        ls_engine_free(e);
        snprintf(tls_errmsg, sizeof(tls_errmsg), "%s", saved);
        return st;
    }
    *out = e;
    return LS_OK;
}

void ls_engine_free(ls_engine * e) {
    if (!e) return;
    ls_io_stop(e);
    for (int32_t il = 0; il < e->n_layers; il++) {
        ls_layer * L = &e->layers[il];
        if (L->fd >= 0) close(L->fd);
        free(L->path);
        free(L->perm);
        free(L->block_crc);
        free((void *) L->verified);
        free(L->slot_of_block);
        free((void *) L->state);
        free(L->prio); free(L->prefetch); free(L->order); free(L->stage_mark); free(L->in_prefetch); free(L->last_plan);
        free(L->hot); free(L->hot_pinned);
        if (L->pred) ls_predictor_free(L->pred);
    }
    free(e->layers);
    ls_cache_free(&e->cache);
    free(e->plan.blocks);
    free(e->plan.scratch);
    free(e->plan.scratch2);
    free(e->plan.x_ref);
    free(e->plan.xq);
    free(e->plan.acc);
    free(e->plan.work);
    pthread_mutex_destroy(&e->mu);
    pthread_mutex_destroy(&e->err_mu);
    free(e);
}

ls_status ls_engine_layer_info(const ls_engine * e, int32_t il, ls_layer_info * out) {
    if (!e || !out || il < 0 || il >= e->n_layers) { ls_set_error("layer %d out of range", il); return LS_ERR_ARG; }
    *out = e->layers[il].info;
    return LS_OK;
}

static void add_layer_stats(ls_stats * s, const ls_layer_stats * l) {
    s->op_calls        += atomic_load(&l->op_calls);
    s->tokens          += atomic_load(&l->tokens);
    s->blocks_computed += atomic_load(&l->blocks_computed);
    s->blocks_read     += atomic_load(&l->blocks_read);
    s->bytes_read      += atomic_load(&l->bytes_read);
    s->bytes_computed  += atomic_load(&l->bytes_computed);
    s->bytes_unused    += atomic_load(&l->bytes_unused);
    s->reads_issued    += atomic_load(&l->reads_issued);
    s->io_stall_ns     += atomic_load(&l->io_stall_ns);
    s->op_ns           += atomic_load(&l->op_ns);
    s->predictor_ns    += atomic_load(&l->predictor_ns);
    s->blocks_prefetched += atomic_load(&l->blocks_prefetched);
    s->refinements     += atomic_load(&l->refinements);
    s->checksum_ns     += atomic_load(&l->checksum_ns);
}

ls_status ls_engine_stats(const ls_engine * e, int32_t il, ls_stats * out) {
    if (!e || !out || il < -1 || il >= e->n_layers) { ls_set_error("layer %d out of range", il); return LS_ERR_ARG; }
    memset(out, 0, sizeof(*out));
    if (il >= 0) {
        add_layer_stats(out, &e->layers[il].stats);
    } else {
        // totals: every counter summed over layers except tokens, which every layer sees once
        // (the model's token rows, so that bytes_read / tokens is bytes per token)
        uint64_t tokens = 0;
        for (int32_t i = 0; i < e->n_layers; i++) {
            add_layer_stats(out, &e->layers[i].stats);
            uint64_t t = atomic_load(&e->layers[i].stats.tokens);
            if (t > tokens) tokens = t;
        }
        out->tokens = tokens;
    }
    pthread_mutex_lock((pthread_mutex_t *) &e->mu);
    if (il >= 0) {
        int32_t n = 0;
        for (int32_t b = 0; b < e->layers[il].info.n_blocks; b++) n += e->layers[il].slot_of_block[b] >= 0;
        out->cache_bytes = (uint64_t) n * e->cache.stride;
    } else {
        out->cache_bytes = (uint64_t) e->cache.n_resident * e->cache.stride;
    }
    pthread_mutex_unlock((pthread_mutex_t *) &e->mu);
    out->cache_capacity = (uint64_t) e->cache.n_slots * e->cache.stride;
    out->direct_io = e->direct_io ? 1 : 0;
    return LS_OK;
}

void ls_engine_reset_stats(ls_engine * e) {
    if (!e) return;
    for (int32_t i = 0; i < e->n_layers; i++) {
        ls_layer_stats * l = &e->layers[i].stats;
        atomic_store(&l->op_calls, 0); atomic_store(&l->tokens, 0);
        atomic_store(&l->blocks_computed, 0); atomic_store(&l->blocks_read, 0);
        atomic_store(&l->bytes_read, 0); atomic_store(&l->bytes_computed, 0);
        atomic_store(&l->bytes_unused, 0); atomic_store(&l->reads_issued, 0);
        atomic_store(&l->io_stall_ns, 0); atomic_store(&l->op_ns, 0);
        atomic_store(&l->predictor_ns, 0);
        atomic_store(&l->blocks_prefetched, 0); atomic_store(&l->refinements, 0);
        atomic_store(&l->checksum_ns, 0);
    }
}

ls_status ls_engine_set_priorities(ls_engine * e, int32_t il, const float * prio, int32_t n_blocks) {
    if (!e || !prio || il < 0 || il >= e->n_layers || n_blocks != e->layers[il].info.n_blocks) {
        ls_set_error("ls_engine_set_priorities: bad arguments (layer %d, %d blocks)", il, n_blocks);
        return LS_ERR_ARG;
    }
    pthread_mutex_lock(&e->mu);
    memcpy(e->layers[il].prio, prio, sizeof(float) * (size_t) n_blocks);
    e->layers[il].prio_ready = true;
    pthread_mutex_unlock(&e->mu);
    return LS_OK;
}

ls_status ls_engine_set_hot_blocks(ls_engine * e, int32_t il, const int32_t * blocks, int32_t n) {
    if (!e || il < 0 || il >= e->n_layers || n < 0 || (n > 0 && !blocks)) {
        ls_set_error("ls_engine_set_hot_blocks: bad arguments");
        return LS_ERR_ARG;
    }
    ls_layer * L = &e->layers[il];
    pthread_mutex_lock(&e->mu);
    if (!L->hot) {
        L->hot = calloc((size_t) L->info.n_blocks, 1);
        L->hot_pinned = calloc((size_t) L->info.n_blocks, 1);
    }
    ls_status st = LS_OK;
    if (!L->hot || !L->hot_pinned) {
        ls_set_error("out of memory");
        st = LS_ERR_NOMEM;
    }
    for (int32_t i = 0; i < n && st == LS_OK; i++) {
        if (blocks[i] < 0 || blocks[i] >= L->info.n_blocks) { ls_set_error("hot block %d out of range", blocks[i]); st = LS_ERR_ARG; }
        else L->hot[blocks[i]] = 1;
    }
    pthread_mutex_unlock(&e->mu);
    return st;
}

int32_t ls_engine_last_plan(const ls_engine * e, int32_t il, int32_t * blocks, int32_t cap) {
    if (!e || il < 0 || il >= e->n_layers) return 0;
    const ls_layer * L = &e->layers[il];
    pthread_mutex_lock((pthread_mutex_t *) &e->mu);
    int32_t n = L->n_last_plan;
    if (blocks) memcpy(blocks, L->last_plan, sizeof(int32_t) * (size_t) (n < cap ? n : cap));
    pthread_mutex_unlock((pthread_mutex_t *) &e->mu);
    return n;
}

ls_status ls_engine_resident(const ls_engine * e, int32_t il, uint8_t * resident, int32_t n_blocks) {
    if (!e || !resident || il < 0 || il >= e->n_layers || n_blocks != e->layers[il].info.n_blocks) {
        ls_set_error("ls_engine_resident: bad arguments");
        return LS_ERR_ARG;
    }
    pthread_mutex_lock((pthread_mutex_t *) &e->mu);
    for (int32_t b = 0; b < n_blocks; b++) resident[b] = e->layers[il].slot_of_block[b] >= 0;
    pthread_mutex_unlock((pthread_mutex_t *) &e->mu);
    return LS_OK;
}
