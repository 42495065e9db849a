// predictor.c — stacked learnable hashing predictor (paper §3.3), bitwise inference.
//
// Evaluates one `predictor/blk.<il>.lspred` file (format: docs/formats.md)
// exactly as the torch inference path (HashingPredictor.infer) does:
//
//   x [n_embd] f32 -> u = (x - mean) * scale -> q_u int8 (per-vector symmetric)
//   z [n_pca]  = (q_u . pca_q[r]) * s_u * pca_scale[r]                  int32 dot, then f32
//   layer 1:   a [M*tau] = (q_z . hp1_q[t]) * s_z * hp1_scale[t] + hp1_bias[t]
//              code_m = sum_j (a[m*tau+j] >= 0) << j;  y = sign(sum_m T1[m][code_m])
//   layer k:   bit t = popdot(y, hp_k[t]) >= thr_k[t];  y = sign(sum_m Tk[m][code_m] + y)
//   head:      prio[b] = popdot(y, head_w[b]) * head_a[b] + head_c[b]
//
// popdot(a, b) = n_bits - 2 * popcount(a XOR b) is the ±1 dot product of two bit vectors.
// Integer dot products are exact in any order; every float step is one IEEE operation in the
// order written (no FMA contraction: see the pragma), so the result equals torch bit for bit.

#pragma GCC optimize("fp-contract=off")

#include "internal.h"

#include <sys/stat.h>
#include <unistd.h>

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PRED_MAGIC "LSPREDv\0"
#define PRED_HEADER_SIZE 256
#define PRED_ALIGN 64

struct ls_predictor {
    ls_predictor_info info;
    uint8_t *  data;         // the whole file (64-byte aligned copy); sections point into it
    int32_t    n_words;      // n_bits / 64
    int32_t    n_hyper;      // M * tau
    const float *    in_mean, * in_scale;   // [n_embd]
    const int8_t *   pca_q;                 // [n_pca, n_embd]
    const float *    pca_scale;             // [n_pca]
    const int8_t *   hp1_q;                 // [n_hyper, n_pca]
    const float *    hp1_scale, * hp1_bias; // [n_hyper]
    const uint64_t ** table;                // [L] -> [M * 2^tau, n_words]
    const uint64_t ** hp;                   // [L] (index 0 unused) -> [n_hyper, n_words]
    const int32_t **  thr;                  // [L] (index 0 unused) -> [n_hyper]
    const uint64_t * head_w;                // [n_blocks, n_words]
    const float *    head_a, * head_c;      // [n_blocks]
    // scratch (one evaluation at a time per handle)
    float *    u;            // [n_embd]
    int8_t *   qu;           // [n_embd]
    float *    z;            // [n_pca]
    int8_t *   qz;           // [n_pca]
    float *    a;            // [n_hyper]
    int32_t *  code;         // [M]
    int32_t *  acc;          // [n_bits]
    uint64_t * y;            // [n_words]
};

// CRC-32 (zlib's polynomial, reflected), so native/ needs no zlib.
static uint32_t pred_crc32(const uint8_t * d, size_t n) {
    static uint32_t tab[256];
    static _Atomic int ready = 0;
    if (!atomic_load_explicit(&ready, memory_order_acquire)) {
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = i;
            for (int k = 0; k < 8; k++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
            tab[i] = c;   // every thread writes the same values: a benign race
        }
        atomic_store_explicit(&ready, 1, memory_order_release);
    }
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) c = tab[(c ^ d[i]) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

static uint32_t rd_u32(const uint8_t * p) { uint32_t v; memcpy(&v, p, 4); return v; }
static int32_t  rd_i32(const uint8_t * p) { int32_t v;  memcpy(&v, p, 4); return v; }
static uint64_t rd_u64(const uint8_t * p) { uint64_t v; memcpy(&v, p, 8); return v; }

void ls_predictor_free(ls_predictor * p) {
    if (!p) return;
    free(p->data);
    free(p->table); free(p->hp); free(p->thr);
    free(p->u); free(p->qu); free(p->z); free(p->qz); free(p->a); free(p->code); free(p->acc); free(p->y);
    free(p);
}

// Walks the section layout; with p == NULL only computes the total size.
static uint64_t pred_layout(ls_predictor * p, const ls_predictor_info * h) {
    const uint64_t w = (uint64_t) h->n_bits / 64, mt = (uint64_t) h->n_tables * h->tau;
    const uint64_t rows = (uint64_t) h->n_tables << h->tau;
    uint64_t off = PRED_HEADER_SIZE;
#define SEC(field, type, count) do { \
        if (p) p->field = (type) (p->data + off); \
        uint64_t nb_ = (uint64_t) (count); off += nb_ + ((PRED_ALIGN - nb_ % PRED_ALIGN) % PRED_ALIGN); \
    } while (0)
    SEC(in_mean, const float *, 4 * (uint64_t) h->n_embd);
    SEC(in_scale, const float *, 4 * (uint64_t) h->n_embd);
    SEC(pca_q, const int8_t *, (uint64_t) h->n_pca * h->n_embd);
    SEC(pca_scale, const float *, 4 * (uint64_t) h->n_pca);
    SEC(hp1_q, const int8_t *, mt * h->n_pca);
    SEC(hp1_scale, const float *, 4 * mt);
    SEC(hp1_bias, const float *, 4 * mt);
    SEC(table[0], const uint64_t *, 8 * rows * w);
    for (int k = 1; k < h->n_hash_layers; k++) {
        SEC(hp[k], const uint64_t *, 8 * mt * w);
        SEC(thr[k], const int32_t *, 4 * mt);
        SEC(table[k], const uint64_t *, 8 * rows * w);
    }
    SEC(head_w, const uint64_t *, 8 * (uint64_t) h->n_blocks * w);
    SEC(head_a, const float *, 4 * (uint64_t) h->n_blocks);
    SEC(head_c, const float *, 4 * (uint64_t) h->n_blocks);
#undef SEC
    return off;
}

ls_status ls_predictor_load_mem(const void * data, size_t size, ls_predictor ** out) {
    if (!data || !out) { ls_set_error("ls_predictor_load_mem: null argument"); return LS_ERR_ARG; }
    *out = NULL;
    const uint8_t * b = (const uint8_t *) data;
    if (size < PRED_HEADER_SIZE) {
        ls_set_error("predictor file truncated: %zu bytes, header needs %d", size, PRED_HEADER_SIZE);
        return LS_ERR_FORMAT;
    }
    if (memcmp(b, PRED_MAGIC, 8) != 0) { ls_set_error("not a leanstream predictor file (bad magic)"); return LS_ERR_FORMAT; }
    uint32_t version = rd_u32(b + 8);
    if (version != 1 && version != LS_PREDICTOR_FILE_VERSION) {
        ls_set_error("predictor file version %u, this build reads versions 1, %d: retrain (leanstream train-predictor)",
                     version, LS_PREDICTOR_FILE_VERSION);
        return LS_ERR_FORMAT;
    }
    const uint32_t skip = version == 1 ? 1 : rd_u32(b + 60);
    if (skip < 1 || skip > 1024) { ls_set_error("predictor header has out-of-range skip weight %u", skip); return LS_ERR_FORMAT; }
    if (rd_u32(b + 12) != PRED_HEADER_SIZE) { ls_set_error("predictor file: bad header size %u", rd_u32(b + 12)); return LS_ERR_FORMAT; }
    ls_predictor_info h;
    memset(&h, 0, sizeof(h));
    uint32_t n_embd = rd_u32(b + 16), n_blocks = rd_u32(b + 20), n_pca = rd_u32(b + 24), L = rd_u32(b + 28);
    uint32_t tau = rd_u32(b + 32), n_bits = rd_u32(b + 36), M = rd_u32(b + 40);
    if (!(n_embd > 0 && n_embd <= (1u << 16) && n_blocks > 0 && n_blocks <= (1u << 24) && n_pca > 0 &&
          n_pca <= n_embd && L >= 1 && L <= 64 && tau >= 1 && tau <= 12 && n_bits % 64 == 0 && n_bits > 0 &&
          n_bits <= 8192 && M >= 1 && M <= 256)) {
        ls_set_error("predictor file: header has out-of-range dimensions");
        return LS_ERR_FORMAT;
    }
    h.n_embd = (int32_t) n_embd; h.n_blocks = (int32_t) n_blocks; h.n_pca = (int32_t) n_pca;
    h.n_hash_layers = (int32_t) L; h.tau = (int32_t) tau; h.n_bits = (int32_t) n_bits; h.n_tables = (int32_t) M;
    h.layer = rd_i32(b + 44);
    h.skip_weight = (int32_t) skip;
    h.size_bytes = rd_u64(b + 48);
    if (h.size_bytes != size) {
        ls_set_error("predictor file truncated or padded: header says %llu bytes, got %zu",
                     (unsigned long long) h.size_bytes, size);
        return LS_ERR_FORMAT;
    }
    uint64_t need = pred_layout(NULL, &h);
    if (need != size) {
        ls_set_error("predictor file size %zu does not match its layout (%llu bytes)", size, (unsigned long long) need);
        return LS_ERR_FORMAT;
    }
    uint32_t crc = pred_crc32(b + PRED_HEADER_SIZE, size - PRED_HEADER_SIZE);
    if (crc != rd_u32(b + 56)) { ls_set_error("predictor file payload checksum mismatch (corrupted)"); return LS_ERR_FORMAT; }

    ls_predictor * p = calloc(1, sizeof(*p));
    if (!p) goto nomem;
    p->info = h;
    p->n_words = (int32_t) (n_bits / 64);
    p->n_hyper = (int32_t) (M * tau);
    if (posix_memalign((void **) &p->data, 64, size) != 0) { p->data = NULL; goto nomem; }
    memcpy(p->data, b, size);
    p->table = calloc(L, sizeof(*p->table));
    p->hp = calloc(L, sizeof(*p->hp));
    p->thr = calloc(L, sizeof(*p->thr));
    p->u = malloc(4 * (size_t) n_embd); p->qu = malloc(n_embd);
    p->z = malloc(4 * (size_t) n_pca);  p->qz = malloc(n_pca);
    p->a = malloc(4 * (size_t) p->n_hyper); p->code = malloc(4 * (size_t) M);
    p->acc = malloc(4 * (size_t) n_bits); p->y = malloc(8 * (size_t) p->n_words);
    if (!p->table || !p->hp || !p->thr || !p->u || !p->qu || !p->z || !p->qz || !p->a || !p->code || !p->acc || !p->y) goto nomem;
    pred_layout(p, &h);
    *out = p;
    return LS_OK;
nomem:
    ls_predictor_free(p);
    ls_set_error("ls_predictor_load: out of memory");
    return LS_ERR_NOMEM;
}

ls_status ls_predictor_load(const char * path, ls_predictor ** out) {
    if (!path || !out) { ls_set_error("ls_predictor_load: null argument"); return LS_ERR_ARG; }
    *out = NULL;
    int fd = -1;
    struct stat sb;
    ls_status ost = ls_open_regular(path, &fd, &sb);   // no FIFO/device/symlink: never blocks
    if (ost != LS_OK) return ost;
    FILE * f = fdopen(fd, "rb");
    if (!f) { ls_set_error("%s: cannot open: %s", path, strerror(errno)); close(fd); return LS_ERR_IO; }
    if (fseek(f, 0, SEEK_END) != 0) { ls_set_error("%s: cannot seek", path); fclose(f); return LS_ERR_IO; }
    long n = ftell(f);
    if (n < 0 || fseek(f, 0, SEEK_SET) != 0) { ls_set_error("%s: cannot size", path); fclose(f); return LS_ERR_IO; }
    uint8_t * buf = malloc(n > 0 ? (size_t) n : 1);
    if (!buf) { fclose(f); ls_set_error("ls_predictor_load: out of memory"); return LS_ERR_NOMEM; }
    size_t got = fread(buf, 1, (size_t) n, f);
    ls_drop_cached(fileno(f));   // the bytes are in buf now
    fclose(f);
    if (got != (size_t) n) { free(buf); ls_set_error("%s: short read", path); return LS_ERR_IO; }
    ls_status st = ls_predictor_load_mem(buf, (size_t) n, out);
    free(buf);
    if (st != LS_OK) {
        char msg[LS_MAX_ERRMSG];
        snprintf(msg, sizeof(msg), "%s", ls_errmsg());
        ls_set_error("%s: %s", path, msg);
    }
    return st;
}

ls_status ls_predictor_get_info(const ls_predictor * p, ls_predictor_info * out) {
    if (!p || !out) { ls_set_error("ls_predictor_get_info: null argument"); return LS_ERR_ARG; }
    *out = p->info;
    return LS_OK;
}

// Symmetric per-vector int8: s = max|v| / 127 (1 for a zero vector), q = rint(v / s) clamped.
// rintf rounds half to even in the default rounding mode, like torch.round.
static float quantize_vec(const float * v, int n, int8_t * q) {
    float m = 0.0f;
    for (int i = 0; i < n; i++) { float a = fabsf(v[i]); if (a > m) m = a; }
    float s = m > 0.0f ? m / 127.0f : 1.0f;
    for (int i = 0; i < n; i++) {
        float r = rintf(v[i] / s);
        if (r > 127.0f) r = 127.0f;
        if (r < -127.0f) r = -127.0f;
        q[i] = (int8_t) r;
    }
    return s;
}

// |sum| <= 127^2 * n <= 127^2 * 2^16 < 2^31 (the loader caps n_embd at 2^16).
static int32_t dot_i8(const int8_t * a, const int8_t * b, int n) {
    int32_t s = 0;
    for (int i = 0; i < n; i++) s += (int32_t) a[i] * (int32_t) b[i];
    return s;
}

static int32_t popdot(const uint64_t * a, const uint64_t * b, int n_words) {
    int32_t c = 0;
    for (int i = 0; i < n_words; i++) c += __builtin_popcountll(a[i] ^ b[i]);
    return n_words * 64 - 2 * c;
}

// y = sign(sum_m T[m][code_m] (+ skip_weight * y_prev)), sign(0) = +1.
static void lookup_vote(ls_predictor * p, const uint64_t * table, int with_skip) {
    const int nb = p->info.n_bits, w = p->n_words, M = p->info.n_tables, kk = 1 << p->info.tau;
    int32_t * acc = p->acc;
    for (int i = 0; i < nb; i++) acc[i] = 0;
    for (int m = 0; m < M; m++) {
        const uint64_t * row = table + ((size_t) m * kk + (size_t) p->code[m]) * w;
        for (int i = 0; i < nb; i++) acc[i] += (int32_t) ((row[i >> 6] >> (i & 63)) & 1) * 2 - 1;
    }
    if (with_skip) {
        const int32_t sw = p->info.skip_weight;
        for (int i = 0; i < nb; i++) acc[i] += ((int32_t) ((p->y[i >> 6] >> (i & 63)) & 1) * 2 - 1) * sw;
    }
    for (int j = 0; j < w; j++) {
        uint64_t word = 0;
        for (int i = 0; i < 64; i++) word |= (uint64_t) (acc[j * 64 + i] >= 0) << i;
        p->y[j] = word;
    }
}

static void eval_one(ls_predictor * p, const float * x, float * prio) {
    const ls_predictor_info * h = &p->info;
    const int tau = h->tau, M = h->n_tables, w = p->n_words;
    for (int i = 0; i < h->n_embd; i++) p->u[i] = (x[i] - p->in_mean[i]) * p->in_scale[i];
    const float su = quantize_vec(p->u, h->n_embd, p->qu);
    for (int r = 0; r < h->n_pca; r++) {
        float d = (float) dot_i8(p->qu, p->pca_q + (size_t) r * h->n_embd, h->n_embd);
        p->z[r] = d * su * p->pca_scale[r];
    }
    const float sz = quantize_vec(p->z, h->n_pca, p->qz);
    for (int t = 0; t < p->n_hyper; t++) {
        float d = (float) dot_i8(p->qz, p->hp1_q + (size_t) t * h->n_pca, h->n_pca);
        p->a[t] = d * sz * p->hp1_scale[t] + p->hp1_bias[t];
    }
    for (int m = 0; m < M; m++) {
        int32_t c = 0;
        for (int j = 0; j < tau; j++) c |= (int32_t) (p->a[m * tau + j] >= 0.0f) << j;
        p->code[m] = c;
    }
    lookup_vote(p, p->table[0], 0);
    for (int k = 1; k < h->n_hash_layers; k++) {
        for (int m = 0; m < M; m++) {
            int32_t c = 0;
            for (int j = 0; j < tau; j++) {
                const int t = m * tau + j;
                c |= (int32_t) (popdot(p->y, p->hp[k] + (size_t) t * w, w) >= p->thr[k][t]) << j;
            }
            p->code[m] = c;
        }
        lookup_vote(p, p->table[k], 1);
    }
    for (int b = 0; b < h->n_blocks; b++) {
        float d = (float) popdot(p->y, p->head_w + (size_t) b * w, w);
        prio[b] = d * p->head_a[b] + p->head_c[b];
    }
}

ls_status ls_predictor_eval(ls_predictor * p, const float * x, float * prio, int32_t n_blocks) {
    return ls_predictor_eval_batch(p, x, prio, n_blocks, 1);
}

ls_status ls_predictor_eval_batch(ls_predictor * p, const float * x, float * prio, int32_t n_blocks, int64_t n) {
    if (!p || !x || !prio || n < 0) { ls_set_error("ls_predictor_eval: null argument"); return LS_ERR_ARG; }
    if (n_blocks != p->info.n_blocks) {
        ls_set_error("ls_predictor_eval: n_blocks %d, predictor has %d", n_blocks, p->info.n_blocks);
        return LS_ERR_ARG;
    }
    for (int64_t i = 0; i < n; i++)
        eval_one(p, x + i * p->info.n_embd, prio + i * p->info.n_blocks);
    return LS_OK;
}
