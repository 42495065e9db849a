// sketch.c — the exact-input scorer: a resident 2-bit copy ("sketch") of every gate and up row
// of a layer, scored against the layer's own FFN input (docs/design.md §12).
//
//   score(block b) = sum over its neurons j of |act(g~_j) * u~_j| * weight_j
//   g~_j = sketch gate row . x,  u~_j = sketch up row . x
//
// Row format LS2 (2.5 bits per value; n_embd a multiple of 64), row_bytes = n_embd * 5 / 16:
//   f16 d[n_embd / 32]            one scale per group of 32 values
//   u8  codes[n_embd / 4]         per chunk of 64 values (16 bytes), byte j holds the codes of
//                                 values j, j+16, j+32, j+48 of the chunk in bits 0-1, 2-3, 4-5, 6-7
//   value = (code - 1.5) * d      (4 symmetric levels; the converter picks d per group by least squares)
// x is quantized per group of 32 to int8 with a float scale (like ggml's Q8_0), so a dot product
// is d * dx * (sum code * x8 - 1.5 * sum x8): unsigned x signed byte products (ls_ls2_dot, kernels.c).
//
// File format (`sketch/blk.<il>.lssk`, version 1): docs/formats.md.
// Padding slots (perm = -1) hold zero rows and weight 0. The whole file is read into RAM and
// checked once, when the engine is created.

#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define SKETCH_MAGIC "LSSKETCH"
#define SKETCH_HEADER 4096

static uint64_t rd64(const uint8_t * p) { uint64_t v; memcpy(&v, p, 8); return v; }
static uint32_t rd32(const uint8_t * p) { uint32_t v; memcpy(&v, p, 4); return v; }

ls_status ls_sketch_load(const char * path, const ls_layer * L, ls_sketch ** out) {
    *out = NULL;
    int fd;
    struct stat st;
    ls_status s = ls_open_regular(path, &fd, &st);
    if (s != LS_OK) return s;
    uint8_t * mem = NULL;
    ls_sketch * k = NULL;
    const ls_layer_info * in = &L->info;
    if ((uint64_t) st.st_size < SKETCH_HEADER) { ls_set_error("%s: too short for a sketch file", path); s = LS_ERR_FORMAT; goto fail; }
    // an anonymous mapping, not malloc: dropping the hot set's rows (ls_sketch_drop_blocks) gives
    // the tail back to the kernel, which free() of a heap chunk would not
    size_t map_bytes = (size_t) st.st_size;
    mem = mmap(NULL, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) mem = NULL;
    if (!mem) { ls_set_error("%s: out of memory (%lld bytes)", path, (long long) st.st_size); s = LS_ERR_NOMEM; goto fail; }
    for (size_t got = 0; got < (size_t) st.st_size;) {
        ssize_t r = pread(fd, mem + got, (size_t) st.st_size - got, (off_t) got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) { ls_set_error("%s: read failed: %s", path, r < 0 ? strerror(errno) : "short file"); s = LS_ERR_IO; goto fail; }
        got += (size_t) r;
    }
    ls_drop_cached(fd);   // resident in mem now: the page cache would hold the file a second time
    if (memcmp(mem, SKETCH_MAGIC, 8) != 0) { ls_set_error("%s: bad magic (not a LeanStream sketch file)", path); s = LS_ERR_FORMAT; goto fail; }
    if (rd32(mem + 8) != 1) { ls_set_error("%s: sketch file version %u, expected 1 (re-run `leanstream convert`)", path, rd32(mem + 8)); s = LS_ERR_FORMAT; goto fail; }
    {
        uint8_t hdr[SKETCH_HEADER];
        memcpy(hdr, mem, SKETCH_HEADER);
        memset(hdr + 84, 0, 4);
        if (ls_crc32c(0, hdr, SKETCH_HEADER) != rd32(mem + 84)) { ls_set_error("%s: header checksum mismatch (corrupt file)", path); s = LS_ERR_CORRUPT; goto fail; }
    }
    const uint32_t il = rd32(mem + 12);
    const uint64_t n_embd = rd64(mem + 16), n_rows = rd64(mem + 24), row_bytes = rd64(mem + 40);
    const int32_t type = (int32_t) rd32(mem + 32);
    const uint32_t kk = rd32(mem + 36);
    const uint64_t go = rd64(mem + 48), uo = rd64(mem + 56), no = rd64(mem + 64), fs = rd64(mem + 72);
    if ((int32_t) il != L->il || n_embd != (uint64_t) in->n_embd || kk != (uint32_t) in->neurons_per_block ||
        n_rows != (uint64_t) in->n_blocks * kk) {
        ls_set_error("%s: sketch of layer %u (n_embd %llu, %llu rows, k %u) does not match layer %d's block file "
                     "(n_embd %lld, %d blocks of k %d)", path, il, (unsigned long long) n_embd, (unsigned long long) n_rows,
                     kk, L->il, (long long) in->n_embd, in->n_blocks, in->neurons_per_block);
        s = LS_ERR_FORMAT;
        goto fail;
    }
    if (type != LS_SKETCH_LS2 || n_embd % 64 != 0 || row_bytes != n_embd * 5 / 16) {
        ls_set_error("%s: unsupported sketch row type %d or row size %llu", path, type, (unsigned long long) row_bytes);
        s = LS_ERR_FORMAT;
        goto fail;
    }
    if (go != SKETCH_HEADER || uo != go + n_rows * row_bytes || no != uo + n_rows * row_bytes || fs != no + 4 * n_rows ||
        fs != (uint64_t) st.st_size) {
        ls_set_error("%s: inconsistent sizes (file %lld bytes, header says %llu): truncated or corrupt", path,
                     (long long) st.st_size, (unsigned long long) fs);
        s = LS_ERR_FORMAT;
        goto fail;
    }
    if (ls_crc32c(0, mem + go, fs - go) != rd32(mem + 80)) { ls_set_error("%s: data checksum mismatch (corrupt file)", path); s = LS_ERR_CORRUPT; goto fail; }
    k = calloc(1, sizeof(*k));
    if (k) k->weight = malloc(sizeof(float) * (size_t) (n_rows > 0 ? n_rows : 1));
    if (!k || !k->weight) { free(k); k = NULL; ls_set_error("out of memory"); s = LS_ERR_NOMEM; goto fail; }
    memcpy(k->weight, mem + no, sizeof(float) * (size_t) n_rows);   // (the weights outlive dropped rows)
    k->type = type;
    k->n_rows = k->n_stored = (int64_t) n_rows;
    k->row_bytes = row_bytes;
    k->mem = mem;
    k->map_bytes = map_bytes;
    k->bytes = (size_t) st.st_size;
    k->gate = mem + go;
    k->up = mem + uo;
    close(fd);
    *out = k;
    return LS_OK;
fail:
    if (mem) munmap(mem, map_bytes);
    close(fd);
    return s;
}

void ls_sketch_free(ls_sketch * k) {
    if (!k) return;
    if (k->mem) munmap(k->mem, k->map_bytes);
    free(k->weight);
    free(k->row);
    free(k);
}

ls_status ls_sketch_drop_blocks(ls_sketch * k, const uint8_t * drop, int32_t kk) {
    int32_t * old = malloc(sizeof(int32_t) * (size_t) (k->n_rows > 0 ? k->n_rows : 1));   // row held before this call
    if (!old) { ls_set_error("out of memory"); return LS_ERR_NOMEM; }
    if (!k->row) {
        k->row = malloc(sizeof(int32_t) * (size_t) (k->n_rows > 0 ? k->n_rows : 1));
        if (!k->row) { free(old); ls_set_error("out of memory"); return LS_ERR_NOMEM; }
        for (int64_t r = 0; r < k->n_rows; r++) k->row[r] = (int32_t) r;
    }
    int64_t n = 0;
    for (int64_t r = 0; r < k->n_rows; r++) {
        old[r] = k->row[r];
        if (old[r] >= 0 && drop[r / kk]) k->row[r] = -1;
        else if (old[r] >= 0) k->row[r] = (int32_t) n++;
    }
    // compact in place: gate rows to the front, then the up rows after them. Every row moves to
    // a lower address than it had and the slots go in order, so no row is overwritten before it
    // has moved; the gate pass writes below the old up rows.
    const size_t rb = k->row_bytes;
    uint8_t * gate = k->mem + SKETCH_HEADER, * up = gate + (size_t) n * rb;
    const uint8_t * up_old = k->up;
    for (int64_t r = 0; r < k->n_rows; r++)
        if (k->row[r] >= 0 && k->row[r] != old[r]) memmove(gate + (size_t) k->row[r] * rb, gate + (size_t) old[r] * rb, rb);
    for (int64_t r = 0; r < k->n_rows; r++)
        if (k->row[r] >= 0) memmove(up + (size_t) k->row[r] * rb, up_old + (size_t) old[r] * rb, rb);
    free(old);
    k->gate = gate;
    k->up = up;
    k->n_stored = n;
    // give the pages past the rows back
    const size_t page = (size_t) sysconf(_SC_PAGESIZE), used = SKETCH_HEADER + 2 * (size_t) n * rb;
    const size_t keep = (used + page - 1) / page * page;
    if (keep < k->map_bytes) {
        munmap(k->mem + keep, k->map_bytes - keep);
        k->map_bytes = keep;
    }
    k->bytes = used + sizeof(float) * (size_t) k->n_rows;
    return LS_OK;
}

// x quantized for LS2 dot products: int8 x8[n], then per group of 32: float dx, float 1.5*dx*sum(x8)
size_t ls_sketch_xq_bytes(const ls_sketch * k, int64_t n_embd) {
    (void) k;
    return (size_t) n_embd + (size_t) n_embd / 32 * 2 * sizeof(float) + 64;
}

void ls_sketch_quantize_x(const ls_sketch * k, const float * x, void * xq, int64_t n_embd) {
    (void) k;
    int8_t * x8 = xq;
    float * dx = (float *) ((uint8_t *) xq + n_embd), * xo = dx + n_embd / 32;
    for (int64_t g = 0; g < n_embd / 32; g++) {
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[g * 32 + i]));
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int i = 0; i < 32; i++) {
            const int v = (int) lrintf(x[g * 32 + i] * id);
            x8[g * 32 + i] = (int8_t) v;
            sum += v;
        }
        dx[g] = d;
        xo[g] = 1.5f * d * (float) sum;
    }
}

void ls_sketch_score(const ls_sketch * k, const void * xq, int64_t n_embd, int32_t act, int32_t kk,
                     int32_t b0, int32_t b1, float * score) {
    const int8_t * x8 = xq;
    const float * dx = (const float *) ((const uint8_t *) xq + n_embd), * xo = dx + n_embd / 32;
    for (int32_t b = b0; b < b1; b++) {
        float s = 0.0f;
        for (int32_t j = 0; j < kk; j++) {
            const int64_t r = (int64_t) b * kk + j;
            const int64_t q = k->row ? k->row[r] : r;
            if (q < 0) { s = INFINITY; break; }   // dropped: the block is hot, always a candidate
            const float w = k->weight[r];
            if (w == 0.0f) continue;   // padding slot
            if (q + 4 < k->n_stored) {
                __builtin_prefetch(k->gate + (size_t) (q + 4) * k->row_bytes);
                __builtin_prefetch(k->up + (size_t) (q + 4) * k->row_bytes);
            }
            const float g = ls_ls2_dot(k->gate + (size_t) q * k->row_bytes, x8, dx, xo, n_embd);
            const float u = ls_ls2_dot(k->up + (size_t) q * k->row_bytes, x8, dx, xo, n_embd);
            s += fabsf(ls_act(act, g) * u) * w;
        }
        score[b] = s;
    }
}
