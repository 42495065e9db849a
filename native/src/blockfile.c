// blockfile.c — opening one layer's block file: the header checked field by field (format in
// docs/formats.md; every file is treated as hostile), the neuron permutation, the data descriptor
// (O_DIRECT where the file system allows it).

#include "internal.h"

#include "ggml.h"
#include "ggml-cpu.h"

#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define BLOCK_META_CRC 120           // offset of meta_crc in the header

static bool type_ok_for_cols(int32_t t) {
    if (t < 0 || t >= GGML_TYPE_COUNT) return false;
    if (t == GGML_TYPE_F32) return true;
    const struct ggml_type_traits * tt = ggml_get_type_traits((enum ggml_type) t);
    return tt && tt->to_float && tt->blck_size > 0;
}

// The header's fields that are not kept in the layer (docs/formats.md: offsets in bytes)
typedef struct {
    uint32_t il, align, meta_crc;               // the layer index written, data alignment, CRC-32C of the tables
    uint64_t perm_off, crc_off, file_size;      // the permutation, the block checksums; the whole file
} block_header;

// ---- what block files and expert files (moe_io.c) share ---------------------------------------

ls_status ls_model_file_begin(const char * path, const char * kind, const char * magic, uint32_t version,
                              const char * v1_note, char ** copy, int * fd, struct stat * st,
                              uint8_t h[LS_FILE_HEADER]) {
    *copy = strdup(path);
    if (!*copy) { ls_set_error("out of memory"); return LS_ERR_NOMEM; }
    ls_status s = ls_open_regular(path, fd, st);
    if (s != LS_OK) return s;
    s = LS_ERR_FORMAT;
    if (pread(*fd, h, LS_FILE_HEADER, 0) != (ssize_t) LS_FILE_HEADER) {
        ls_set_error("%s: truncated %s file (%lld bytes, header needs %d)", path, kind, (long long) st->st_size, LS_FILE_HEADER);
    } else if (memcmp(h, magic, 8) != 0) {
        ls_set_error("%s: not a leanstream %s file (bad magic)", path, kind);
    } else if (ls_rd_u32(h + 8) != version) {
        ls_set_error("%s: %s file version %u, this build reads version %u%s (re-run `leanstream convert` "
                     "with --force to rewrite the model directory)", path, kind, ls_rd_u32(h + 8), version,
                     ls_rd_u32(h + 8) == 1 && v1_note ? v1_note : "");
    } else {
        s = LS_OK;
    }
    if (s != LS_OK) { close(*fd); *fd = -1; }
    return s;
}

ls_status ls_model_file_tables(int fd, const char * path, const char * kind, int32_t il, uint64_t bytes,
                               size_t crc_at, uint32_t stored, uint8_t ** meta) {
    *meta = malloc((size_t) bytes);
    if (!*meta) { ls_set_error("out of memory"); return LS_ERR_NOMEM; }
    ls_status s = LS_OK;
    if (pread(fd, *meta, (size_t) bytes, 0) != (ssize_t) bytes) {
        ls_set_error("%s: cannot read the %s file's tables (%llu bytes)", path, kind, (unsigned long long) bytes);
        s = LS_ERR_FORMAT;
    } else {
        memset(*meta + crc_at, 0, 4);
        const uint32_t have = ls_crc32c(0, *meta, (size_t) bytes);
        if (have != stored) {
            ls_set_error("%s: layer %d: header or tables corrupt (CRC-32C %08x, stored %08x); `leanstream verify` "
                         "checks the whole model directory, re-run `leanstream convert` to repair it",
                         path, il, have, stored);
            s = LS_ERR_CORRUPT;
        }
    }
    if (s != LS_OK) { free(*meta); *meta = NULL; }
    return s;
}

// ---- block files -----------------------------------------------------------------------------

// The 4096-byte header h (magic and version checked) read into L->info, L's row sizes and *hd as
// written (check_header judges it).
static void read_header(const uint8_t * h, ls_layer * L, block_header * hd) {
    ls_layer_info * in = &L->info;
    hd->il              = ls_rd_u32(h + 12);
    in->n_embd          = (int64_t) ls_rd_u64(h + 16);
    in->n_ff            = (int64_t) ls_rd_u64(h + 24);
    in->neurons_per_block = (int32_t) ls_rd_u32(h + 32);
    in->n_blocks        = (int32_t) ls_rd_u32(h + 36);
    in->gate_type       = (int32_t) ls_rd_u32(h + 40);
    in->up_type         = (int32_t) ls_rd_u32(h + 44);
    in->down_type       = (int32_t) ls_rd_u32(h + 48);
    hd->align           = ls_rd_u32(h + 52);
    L->gate_row_bytes   = ls_rd_u64(h + 56);
    L->up_row_bytes     = ls_rd_u64(h + 64);
    L->down_col_bytes   = ls_rd_u64(h + 72);
    in->block_stride    = ls_rd_u64(h + 80);
    hd->perm_off        = ls_rd_u64(h + 88);
    in->data_offset     = ls_rd_u64(h + 96);
    hd->file_size       = ls_rd_u64(h + 104);
    hd->crc_off         = ls_rd_u64(h + 112);
    hd->meta_crc        = ls_rd_u32(h + BLOCK_META_CRC);
}

// what is wrong with the header's geometry (NULL: nothing): dimensions, types, sizes, offsets
static const char * header_flaw(const ls_layer * L, int32_t il, const block_header * hd) {
    const ls_layer_info * in = &L->info;
    const int64_t k = in->neurons_per_block;
    if (hd->il != (uint32_t) il) return "layer index does not match its position";
    if (in->n_embd <= 0 || in->n_ff <= 0 || k <= 0) return "zero dimension";
    if (in->n_embd > (1 << 24) || in->n_ff > (1 << 28)) return "implausibly large dimension";
    if (k > 256) return "more than 256 neurons per block";
    if ((int64_t) in->n_blocks != (in->n_ff + k - 1) / k) return "n_blocks != ceil(n_ff / k)";
    if (!ls_cpu_dots_rows(in->gate_type) || !ls_cpu_dots_rows(in->up_type)) return "unsupported gate/up type";
    if (!type_ok_for_cols(in->down_type)) return "unsupported down column type";
    if (L->gate_row_bytes != ggml_row_size(in->gate_type, in->n_embd) ||
        L->up_row_bytes   != ggml_row_size(in->up_type, in->n_embd) ||
        in->n_embd % ggml_blck_size(in->down_type) != 0 ||
        L->down_col_bytes != ggml_row_size(in->down_type, in->n_embd)) return "row sizes do not match the types";
    if (hd->align < 512 || (hd->align & (hd->align - 1)) != 0) return "alignment is not a power of two >= 512";
    if (in->block_stride % hd->align != 0 || in->block_stride > (1ull << 32) ||
        in->block_stride < (uint64_t) k * (L->gate_row_bytes + L->up_row_bytes + L->down_col_bytes)) return "bad block stride";
    if (hd->perm_off < 128 || hd->perm_off > (1ull << 40) || in->data_offset % 4096 != 0 ||
        hd->crc_off != hd->perm_off + 4ull * (uint64_t) in->n_blocks * (uint64_t) k ||
        hd->crc_off + 4ull * (uint64_t) in->n_blocks > in->data_offset) return "bad offsets";
    if (hd->file_size != in->data_offset + (uint64_t) in->n_blocks * in->block_stride) return "file_size field inconsistent";
    return NULL;
}

// The header's geometry consistent and the file as long as it says; L->info.block_payload set.
static ls_status check_header(ls_layer * L, int32_t il, const char * path, const struct stat * st, const block_header * hd) {
    const char * bad = header_flaw(L, il, hd);
    if (bad) {
        ls_set_error("%s: malformed block file header: %s", path, bad);
        return LS_ERR_FORMAT;
    }
    if ((uint64_t) st->st_size < hd->file_size) {
        ls_set_error("%s: truncated block file: %lld bytes, header says %llu", path,
                     (long long) st->st_size, (unsigned long long) hd->file_size);
        return LS_ERR_FORMAT;
    }
    L->info.block_payload = (uint64_t) L->info.neurons_per_block * (L->gate_row_bytes + L->up_row_bytes + L->down_col_bytes);
    return LS_OK;
}

// L's per-block arrays allocated, the permutation and the block checksums read into them
// (L->perm [n_blocks * k] neuron ids, L->block_crc [n_blocks])
static ls_status read_tables(int fd, const char * path, ls_layer * L, int32_t il, const block_header * hd) {
    const ls_layer_info * in = &L->info;
    const size_t n_slots = (size_t) in->n_blocks * (size_t) in->neurons_per_block;
    L->perm = malloc(n_slots * sizeof(int32_t));
    L->block_crc = malloc((size_t) in->n_blocks * sizeof(uint32_t));
    L->verified = calloc((size_t) in->n_blocks, sizeof(*L->verified));
    L->slot_of_block = malloc((size_t) in->n_blocks * sizeof(int32_t));
    L->state = calloc((size_t) in->n_blocks, sizeof(*L->state));
    if (!L->perm || !L->block_crc || !L->verified || !L->slot_of_block || !L->state) {
        ls_set_error("out of memory");
        return LS_ERR_NOMEM;
    }
    // header, perm and checksum tables: one read, checked against meta_crc before any use
    uint8_t * meta;
    const ls_status s = ls_model_file_tables(fd, path, "block", il, in->data_offset, BLOCK_META_CRC, hd->meta_crc, &meta);
    if (s != LS_OK) return s;
    memcpy(L->perm, meta + hd->perm_off, n_slots * 4);
    memcpy(L->block_crc, meta + hd->crc_off, (size_t) in->n_blocks * 4);
    free(meta);
    return LS_OK;
}

// every neuron exactly once in L->perm, padding only as -1
static ls_status check_permutation(const ls_layer * L, const char * path) {
    const ls_layer_info * in = &L->info;
    const size_t n_slots = (size_t) in->n_blocks * (size_t) in->neurons_per_block;
    uint8_t * seen = calloc((size_t) in->n_ff, 1);
    if (!seen) { ls_set_error("out of memory"); return LS_ERR_NOMEM; }
    const char * bad = NULL;
    int64_t n_real = 0;
    for (size_t i = 0; i < n_slots && !bad; i++) {
        int32_t nid = L->perm[i];
        if (nid == -1) continue;
        if (nid < 0 || nid >= in->n_ff || seen[nid]) bad = "permutation is not a permutation of the neurons";
        else { seen[nid] = 1; n_real++; }
    }
    free(seen);
    if (!bad && n_real != in->n_ff) bad = "permutation misses neurons";
    if (bad) { ls_set_error("%s: %s", path, bad); return LS_ERR_FORMAT; }
    return LS_OK;
}

// Header, tables and permutation read and checked through one descriptor, closed after; the data
// then opened again as the I/O reads it.
ls_status ls_blockfile_open(ls_layer * L, int32_t il, const char * path, bool use_direct_io, bool * direct_io) {
    L->il = il;
    L->fd = -1;
    int fd = -1;
    struct stat st;
    uint8_t h[LS_FILE_HEADER];
    ls_status ost = ls_model_file_begin(path, "block", "LSBLOCKS", LS_BLOCK_FILE_VERSION,
                                        ", which adds a checksum to every block", &L->path, &fd, &st, h);
    if (ost != LS_OK) return ost;
    block_header hd;
    read_header(h, L, &hd);
    ost = check_header(L, il, path, &st, &hd);
    if (ost == LS_OK) ost = read_tables(fd, path, L, il, &hd);
    if (ost == LS_OK) ost = check_permutation(L, path);
    close(fd);
    if (ost != LS_OK) return ost;
    for (int32_t b = 0; b < L->info.n_blocks; b++) L->slot_of_block[b] = -1;
    return ls_open_data(path, &st, use_direct_io, direct_io, &L->fd);
}
