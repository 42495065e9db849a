// blockfile.c — the header reader of every file of blocks: a dense layer's block file and a MoE
// layer's expert file (docs/formats.md). The two formats share their layout: a 4096-byte header
// whose common fields sit at the same offsets, a table of what each block holds (its neurons, or
// its expert) followed by each block's CRC-32C, zeros up to the data, then the blocks of stride
// bytes each. The reader reads the shared fields once and each format's own after, judges the
// format's dimensions and types, then the layout both share, reads the tables once against
// meta_crc and checks that they hold every neuron or expert exactly once. Every file is treated
// as hostile: each field is checked before it is used, and a flaw is an error naming the file.

#include "internal.h"

#include "ggml.h"
#include "ggml-cpu.h"

#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define FILE_HEADER 4096
#define EXPERT_MAX 65536             // experts per layer (llama.cpp's LLAMA_MAX_EXPERTS is 512)

// fields as written (host byte order, as the converter writes them)
static uint32_t rd_u32(const uint8_t * p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t rd_u64(const uint8_t * p) { uint64_t v; memcpy(&v, p, 8); return v; }
static uint64_t round_up(uint64_t x, uint64_t n) { return (x + n - 1) / n * n; }

// A header as written: the fields its owner reads, and the ones the reader judges alone.
typedef struct header {
    ls_file_header pub;
    uint32_t il, align, meta_crc;
    int32_t  n_blocks, k;            // blocks; ids per block (k neurons, or 1 expert)
    int64_t  n_items;                // what the ids number: the layer's neurons, or its experts
    uint64_t stride, table_offset, crc_offset, data_offset, file_size;
} header;

// What differs between the formats: their names, where their own fields are, what their
// dimensions and types must be.
typedef struct file_format {
    const char * kind, * magic, * item, * table, * v1_note;   // v1_note: added when a file is version 1
    uint32_t version;
    uint32_t k_at, n_blocks_at, align_at, crc_offset_at, meta_crc_at;   // header offsets; k_at 0: one id per
                                                                        // block, crc_offset_at 0: the CRCs follow the ids
    const char * (* flaw)(const header * h);   // what is wrong with the dimensions, types, sizes (NULL: nothing)
} file_format;

// ---- each format's own checks --------------------------------------------------------------------

// a type whose down columns the op can read: f32, or converted to float by ggml
static bool type_ok_for_cols(int32_t t) {
    if (t < 0 || t >= GGML_TYPE_COUNT) return false;
    if (t == GGML_TYPE_F32) return true;
    const struct ggml_type_traits * tt = ggml_get_type_traits((enum ggml_type) t);
    return tt && tt->to_float && tt->blck_size > 0;
}

// n values make whole blocks of type t and of its vec_dot_type (what ggml_mul_mat requires)
static bool fits_blocks(int32_t t, int64_t n) {
    const enum ggml_type vt = ls_cpu_traits((enum ggml_type) t)->vec_dot_type;
    return n % ggml_blck_size((enum ggml_type) t) == 0 && n % ggml_blck_size(vt) == 0;
}

// block file: k neurons per block, each a gate row, an up row (n_embd values) and a down column
static const char * neuron_flaw(const header * h) {
    const ls_file_header * p = &h->pub;
    if (p->n_embd <= 0 || p->n_ff <= 0 || h->k <= 0) return "zero dimension";
    if (p->n_embd > (1 << 24) || p->n_ff > (1 << 28)) return "implausibly large dimension";
    if (h->k > 256) return "more than 256 neurons per block";
    if ((int64_t) h->n_blocks != (p->n_ff + h->k - 1) / h->k) return "n_blocks != ceil(n_ff / k)";
    if (!ls_cpu_dots_rows(p->type[0]) || !ls_cpu_dots_rows(p->type[1])) return "unsupported gate/up type";
    if (!type_ok_for_cols(p->type[2])) return "unsupported down column type";
    if (p->part_bytes[0] != ggml_row_size(p->type[0], p->n_embd) || p->part_bytes[1] != ggml_row_size(p->type[1], p->n_embd) ||
        p->n_embd % ggml_blck_size(p->type[2]) != 0 || p->part_bytes[2] != ggml_row_size(p->type[2], p->n_embd))
        return "row sizes do not match the types";
    return NULL;
}

// expert file: one expert per block, its n_ff gate and up rows (n_embd values) and n_embd down
// rows (n_ff values) in the GGUF's types. The bounds come first, so that the sizes computed from
// them cannot overflow.
static const char * expert_flaw(const header * h) {
    const ls_file_header * p = &h->pub;
    if (p->n_embd <= 0 || p->n_ff <= 0 || h->n_blocks <= 0) return "zero dimension";
    if (p->n_embd > (1 << 20) || p->n_ff > (1 << 20) || h->n_blocks > EXPERT_MAX) return "implausibly large dimension";
    for (int i = 0; i < 3; i++)
        if (!ls_cpu_dots_rows(p->type[i]) || ggml_blck_size((enum ggml_type) p->type[i]) <= 0)
            return "a type ggml's CPU backend has no vec_dot for";
    if (!fits_blocks(p->type[0], p->n_embd) || !fits_blocks(p->type[1], p->n_embd) || !fits_blocks(p->type[2], p->n_ff))
        return "dimensions are not whole blocks of the types";
    if (p->part_bytes[0] != (uint64_t) p->n_ff * ggml_row_size(p->type[0], p->n_embd) ||
        p->part_bytes[1] != (uint64_t) p->n_ff * ggml_row_size(p->type[1], p->n_embd) ||
        p->part_bytes[2] != (uint64_t) p->n_embd * ggml_row_size(p->type[2], p->n_ff)) return "sizes do not match the types";
    if (p->flags & ~(uint32_t) (LS_EXPERT_BIASES | LS_EXPERT_SCALES)) return "unknown flags";
    return NULL;
}

uint64_t ls_expert_extra_bytes(uint32_t flags, int64_t n_embd, int64_t n_ff) {
    const uint64_t n = (flags & LS_EXPERT_BIASES ? 2 * (uint64_t) n_ff + (uint64_t) n_embd : 0) + (flags & LS_EXPERT_SCALES ? 3 : 0);
    return round_up(4 * n, LS_EXPERT_EXTRA_ALIGN);
}

static const file_format FORMATS[] = {
    [LS_FILE_NEURONS] = { "block", "LSBLOCKS", "neuron", "perm", ", which adds a checksum to every block",
                          LS_BLOCK_FILE_VERSION, 32, 36, 52, 112, 120, neuron_flaw },
    [LS_FILE_EXPERTS] = { "expert", "LSEXPRTS", "expert", "expert_of_slot", NULL,
                          LS_EXPERT_FILE_VERSION, 0, 32, 36, 0, 112, expert_flaw },
};

// ---- what both formats share -----------------------------------------------------------------------

// The header r (magic and version checked) read into *h: the shared fields, then the format's own.
static void read_fields(const file_format * f, const uint8_t * r, header * h) {
    ls_file_header * p = &h->pub;
    memset(h, 0, sizeof(*h));
    h->il = rd_u32(r + 12);
    p->n_embd = (int64_t) rd_u64(r + 16);
    p->n_ff = (int64_t) rd_u64(r + 24);
    for (int i = 0; i < 3; i++) {
        p->type[i] = (int32_t) rd_u32(r + 40 + 4 * i);
        p->part_bytes[i] = rd_u64(r + 56 + 8 * i);
    }
    h->stride = rd_u64(r + 80);
    h->table_offset = rd_u64(r + 88);
    h->data_offset = rd_u64(r + 96);
    h->file_size = rd_u64(r + 104);
    h->k = f->k_at ? (int32_t) rd_u32(r + f->k_at) : 1;
    h->n_blocks = (int32_t) rd_u32(r + f->n_blocks_at);
    h->align = rd_u32(r + f->align_at);
    h->meta_crc = rd_u32(r + f->meta_crc_at);
    h->crc_offset = f->crc_offset_at ? rd_u64(r + f->crc_offset_at) : h->table_offset + 4ull * (uint64_t) h->n_blocks;
    h->n_items = f->k_at ? p->n_ff : h->n_blocks;   // a block file's ids are neurons, an expert file's experts
    if (!f->k_at) {   // an expert file's flags (a block file's field there is reserved)
        p->flags = rd_u32(r + 52);
        if (p->n_embd > 0 && p->n_ff > 0 && p->n_embd <= (1 << 20) && p->n_ff <= (1 << 20))
            p->extra_bytes = ls_expert_extra_bytes(p->flags, p->n_embd, p->n_ff);
    }
}

// What is wrong with the header (NULL: nothing): the layer it names, the format's dimensions, then
// the layout both formats share (alignment, stride, offsets, size), all of it as the converter
// writes it (leanstream_convert/blockfile.py, experts.py). Sets h->pub.payload.
static const char * header_flaw(const file_format * f, header * h, int32_t il) {
    if (h->il != (uint32_t) il) return "layer index does not match its position";
    const char * bad = f->flaw(h);
    if (bad) return bad;
    h->pub.payload = (uint64_t) h->k * (h->pub.part_bytes[0] + h->pub.part_bytes[1] + h->pub.part_bytes[2]) + h->pub.extra_bytes;
    if (h->align < 512 || h->align > (1u << 20) || (h->align & (h->align - 1)) != 0)
        return "alignment is not a power of two in [512, 1 MiB]";
    if (h->stride != round_up(h->pub.payload, h->align) || h->stride > (1ull << 32)) return "bad block stride";
    const uint64_t n_ids = (uint64_t) h->n_blocks * (uint64_t) h->k;
    if (h->table_offset != FILE_HEADER || h->crc_offset != h->table_offset + 4 * n_ids ||
        h->data_offset != round_up(h->crc_offset + 4ull * (uint64_t) h->n_blocks, h->align > FILE_HEADER ? h->align : FILE_HEADER))
        return "bad offsets";
    if (h->file_size != h->data_offset + (uint64_t) h->n_blocks * h->stride) return "file_size field inconsistent";
    return NULL;
}

// path copied into F->path, the file opened (*fd, *st), its header read into r and its magic and
// version checked. On failure nothing stays open.
static ls_status begin(ls_blockfile * F, const file_format * f, const char * path, int * fd, struct stat * st,
                       uint8_t r[FILE_HEADER]) {
    F->path = strdup(path);
    if (!F->path) { ls_set_error("out of memory"); return LS_ERR_NOMEM; }
    ls_status s = ls_open_regular(path, fd, st);
    if (s != LS_OK) return s;
    s = LS_ERR_FORMAT;
    if (pread(*fd, r, FILE_HEADER, 0) != (ssize_t) FILE_HEADER) {
        ls_set_error("%s: truncated %s file (%lld bytes, header needs %d)", path, f->kind, (long long) st->st_size, FILE_HEADER);
    } else if (memcmp(r, f->magic, 8) != 0) {
        ls_set_error("%s: not a leanstream %s file (bad magic)", path, f->kind);
    } else if (rd_u32(r + 8) != f->version) {
        ls_set_error("%s: %s file version %u, this build reads version %u%s (re-run `leanstream convert` "
                     "with --force to rewrite the model directory)", path, f->kind, rd_u32(r + 8), f->version,
                     rd_u32(r + 8) == 1 && f->v1_note ? f->v1_note : "");
    } else {
        s = LS_OK;
    }
    if (s != LS_OK) { close(*fd); *fd = -1; }
    return s;
}

// F's per-block arrays: its tables' (ids, crc) and the cache's (every block absent)
static ls_status alloc_blocks(ls_blockfile * F) {
    const size_t nb = (size_t) F->n_blocks;
    F->ids = malloc(nb * (size_t) F->ids_per_block * sizeof(int32_t));
    F->crc = malloc(nb * sizeof(uint32_t));
    F->slot = malloc(nb * sizeof(int32_t));
    F->state = calloc(nb, sizeof(*F->state));
    F->verified = calloc(nb, sizeof(*F->verified));
    F->hot = calloc(nb, 1);
    F->hot_pinned = calloc(nb, 1);
    F->uses = calloc(nb, sizeof(uint32_t));
    if (!F->ids || !F->crc || !F->slot || !F->state || !F->verified || !F->hot || !F->hot_pinned || !F->uses) {
        ls_set_error("out of memory");
        return LS_ERR_NOMEM;
    }
    for (size_t b = 0; b < nb; b++) F->slot[b] = -1;
    return LS_OK;
}

// The header and tables, [0, data_offset), read in one piece and checked against meta_crc before
// any use; the ids and the blocks' CRCs copied out of them.
static ls_status read_tables(int fd, ls_blockfile * F, const file_format * f, const header * h) {
    uint8_t * meta = malloc((size_t) h->data_offset);
    if (!meta) { ls_set_error("out of memory"); return LS_ERR_NOMEM; }
    ls_status s = LS_OK;
    if (pread(fd, meta, (size_t) h->data_offset, 0) != (ssize_t) h->data_offset) {
        ls_set_error("%s: cannot read the %s file's tables (%llu bytes)", F->path, f->kind, (unsigned long long) h->data_offset);
        s = LS_ERR_FORMAT;
    } else {
        memset(meta + f->meta_crc_at, 0, 4);
        const uint32_t have = ls_crc32c(0, meta, (size_t) h->data_offset);
        if (have != h->meta_crc) {
            ls_set_error("%s: layer %d: header or tables corrupt (CRC-32C %08x, stored %08x); `leanstream verify` "
                         "checks the whole model directory, re-run `leanstream convert` to repair it",
                         F->path, F->il, have, h->meta_crc);
            s = LS_ERR_CORRUPT;
        }
    }
    if (s == LS_OK) {
        memcpy(F->ids, meta + h->table_offset, (size_t) F->n_blocks * (size_t) F->ids_per_block * 4);
        memcpy(F->crc, meta + h->crc_offset, (size_t) F->n_blocks * 4);
    }
    free(meta);
    return s;
}

// every item (neuron, expert) exactly once in F->ids, -1 only as padding
static ls_status check_ids(const ls_blockfile * F, const file_format * f, int64_t n_items) {
    const int64_t n = (int64_t) F->n_blocks * F->ids_per_block;
    uint8_t * seen = calloc((size_t) n_items, 1);
    if (!seen) { ls_set_error("out of memory"); return LS_ERR_NOMEM; }
    int64_t n_real = 0, bad = -1;
    for (int64_t i = 0; i < n && bad < 0; i++) {
        const int32_t id = F->ids[i];
        if (id == -1) continue;
        if (id < 0 || id >= n_items || seen[id]) bad = i;
        else { seen[id] = 1; n_real++; }
    }
    free(seen);
    if (bad >= 0) {
        ls_set_error("%s: layer %d: %s is not a permutation of the layer's %lld %ss (entry %lld: %d)", F->path, F->il,
                     f->table, (long long) n_items, f->item, (long long) bad, F->ids[bad]);
    } else if (n_real != n_items) {
        ls_set_error("%s: layer %d: %s misses %lld of the layer's %lld %ss", F->path, F->il, f->table,
                     (long long) (n_items - n_real), (long long) n_items, f->item);
    }
    return bad >= 0 || n_real != n_items ? LS_ERR_FORMAT : LS_OK;
}

// The header judged (its flaw, or a file shorter than it says), F's geometry from it.
static ls_status take_header(ls_blockfile * F, const file_format * f, header * h, const struct stat * st) {
    const char * bad = header_flaw(f, h, F->il);
    if (bad) {
        ls_set_error("%s: layer %d: malformed %s file header: %s", F->path, F->il, f->kind, bad);
        return LS_ERR_FORMAT;
    }
    if ((uint64_t) st->st_size < h->file_size) {
        ls_set_error("%s: layer %d: truncated %s file: %lld bytes, header says %llu", F->path, F->il, f->kind,
                     (long long) st->st_size, (unsigned long long) h->file_size);
        return LS_ERR_FORMAT;
    }
    F->n_blocks = h->n_blocks;
    F->ids_per_block = h->k;
    F->stride = h->stride;
    F->data_offset = h->data_offset;
    F->align = h->align;
    return LS_OK;
}

// Header and tables read and checked through one descriptor, closed after; the data then opened
// again as the reader reads it.
ls_status ls_blockfile_open(ls_blockfile * F, int32_t kind, int32_t il, const char * path, bool use_direct_io,
                            bool * direct_io, ls_file_header * out) {
    const file_format * f = &FORMATS[kind];
    memset(F, 0, sizeof(*F));
    F->il = il;
    F->kind = kind;
    F->fd = -1;
    if (!ls_cpu_ready()) { ls_set_error("%s: ggml's CPU backend is not loaded (its type traits check the file's types)", path); return LS_ERR_UNSUPPORTED; }
    int fd = -1;
    struct stat st;
    uint8_t r[FILE_HEADER];
    ls_status s = begin(F, f, path, &fd, &st, r);
    if (s != LS_OK) return s;
    header h;
    read_fields(f, r, &h);
    s = take_header(F, f, &h, &st);
    if (s == LS_OK) s = alloc_blocks(F);
    if (s == LS_OK) s = read_tables(fd, F, f, &h);
    if (s == LS_OK) s = check_ids(F, f, h.n_items);
    close(fd);
    if (s != LS_OK) return s;
    *out = h.pub;
    return ls_open_data(path, &st, use_direct_io, direct_io, &F->fd);
}

void ls_blockfile_close(ls_blockfile * F) {
    if (F->path && F->fd >= 0) close(F->fd);   // (a zeroed F holds no descriptor)
    free(F->path); free(F->ids); free(F->crc); free(F->slot); free((void *) F->state); free((void *) F->verified);
    free(F->hot); free(F->hot_pinned); free(F->uses);
    memset(F, 0, sizeof(*F));
    F->fd = -1;
}
