// checksum.c — CRC-32C (Castagnoli), the checksum of every block (neuron blocks and experts) and
// of each model file's metadata (format: docs/formats.md).
//
// Every block read from disk is checked once after each read, before it is first computed with
// (io.c: by the I/O worker or by the compute thread about to use it, as its engine asks). The
// checksum is then on the decode path, so where the CPU has a CRC-32C instruction (x86-64:
// SSE4.2's crc32, checksum_x86.c; aarch64: the CRC extension's crc32cx, checksum_neon.c) it runs
// on three independent streams at once (latency 3 cycles, throughput 1 per cycle), combined here
// with precomputed "append n zero bytes" operators — Mark Adler's crc32c.c scheme. A plain
// table-driven loop is the reference, and the path of a CPU without the instruction
// (leanstream_ggml/checksum.py holds the Python one the tests compare against); the instruction
// path is checked against it once, before its first use.

#include "internal.h"

#include <pthread.h>
#include <string.h>

#define CRC32C_POLY 0x82f63b78u  // reflected Castagnoli polynomial
#define CRC_LONG  8192
#define CRC_SHORT 256

static uint32_t crc_long[4][256], crc_short[4][256], crc_table[256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;
static const ls_crc_hw * crc_hw;   // the CRC instructions in use (NULL: the table)

static uint32_t crc_hw_run(uint32_t crc, const uint8_t * next, size_t len);

// GF(2) matrix (32 columns as words) times vector
static uint32_t gf2_times(const uint32_t * mat, uint32_t vec) {
    uint32_t sum = 0;
    while (vec) {
        if (vec & 1) sum ^= *mat;
        vec >>= 1;
        mat++;
    }
    return sum;
}

static void gf2_square(uint32_t * square, const uint32_t * mat) {
    for (int n = 0; n < 32; n++) square[n] = gf2_times(mat, mat[n]);
}

// op = the operator appending len zero bytes to a CRC (len a power of two)
static void zeros_op(uint32_t * even, size_t len) {
    uint32_t odd[32];
    odd[0] = CRC32C_POLY;              // one zero bit
    uint32_t row = 1;
    for (int n = 1; n < 32; n++) { odd[n] = row; row <<= 1; }
    gf2_square(even, odd);             // two zero bits
    gf2_square(odd, even);             // four zero bits
    do {                               // one zero byte, two, four, ... until len is consumed
        gf2_square(even, odd);
        len >>= 1;
        if (len == 0) return;
        gf2_square(odd, even);
        len >>= 1;
    } while (len);
    memcpy(even, odd, sizeof(odd));
}

static void zeros_table(uint32_t zeros[4][256], size_t len) {
    uint32_t op[32];
    zeros_op(op, len);
    for (uint32_t n = 0; n < 256; n++) {
        zeros[0][n] = gf2_times(op, n);
        zeros[1][n] = gf2_times(op, n << 8);
        zeros[2][n] = gf2_times(op, n << 16);
        zeros[3][n] = gf2_times(op, n << 24);
    }
}

static void crc_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ CRC32C_POLY : c >> 1;
        crc_table[n] = c;
    }
    zeros_table(crc_long, CRC_LONG);
    zeros_table(crc_short, CRC_SHORT);
    // the instructions must give the table's result on every path (unaligned start, both stream
    // lengths, the tail) before they are used
    static uint8_t probe[3 * CRC_LONG + 3 * CRC_SHORT + 21];
    uint32_t s = 12345u, want = 0xffffffffu;
    for (size_t i = 0; i < sizeof(probe); i++) {
        s = s * 1664525u + 1013904223u;
        probe[i] = (uint8_t) (s >> 24);
        if (i >= 3) want = crc_table[(want ^ probe[i]) & 0xff] ^ (want >> 8);
    }
    crc_hw = ls_kernels_crc32c();
    if (crc_hw && crc_hw_run(0xffffffffu, probe + 3, sizeof(probe) - 3) != want) crc_hw = NULL;
}

static inline uint32_t crc_shift(uint32_t zeros[4][256], uint32_t crc) {
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^ zeros[3][crc >> 24];
}

// While at least 3n bytes remain: three independent streams of n bytes each (the instruction's
// latency hidden), combined with the "append n zero bytes" operator `zeros`.
static inline uint32_t crc_3streams(uint32_t c0, const uint8_t ** pnext, size_t * plen, size_t n,
                                    uint32_t zeros[4][256]) {
    while (*plen >= 3 * n) {
        uint32_t c[3] = { c0, 0, 0 };
        crc_hw->streams3(c, *pnext, n);
        c0 = crc_shift(zeros, c[0]) ^ c[1];
        c0 = crc_shift(zeros, c0) ^ c[2];
        *pnext += 3 * n;
        *plen -= 3 * n;
    }
    return c0;
}

// the register value (not inverted) continued over next[0, len) by the instructions
static uint32_t crc_hw_run(uint32_t c0, const uint8_t * next, size_t len) {
    const size_t head = ((8 - ((uintptr_t) next & 7)) & 7) < len ? (8 - ((uintptr_t) next & 7)) & 7 : len;
    c0 = crc_hw->bytes(c0, next, head);   // to an 8-byte boundary
    next += head;
    len -= head;
    c0 = crc_3streams(c0, &next, &len, CRC_LONG, crc_long);
    c0 = crc_3streams(c0, &next, &len, CRC_SHORT, crc_short);
    return crc_hw->bytes(c0, next, len);
}

uint32_t ls_crc32c(uint32_t crc, const void * data, size_t len) {
    if (!data || !len) return crc;
    pthread_once(&crc_once, crc_init);
    if (!crc_hw) return ls_crc32c_ref(crc, data, len);
    return crc_hw_run(crc ^ 0xffffffffu, data, len) ^ 0xffffffffu;
}

// The reference: one byte at a time through a 256-entry table.
uint32_t ls_crc32c_ref(uint32_t crc, const void * data, size_t len) {
    pthread_once(&crc_once, crc_init);
    const uint8_t * p = data;
    crc ^= 0xffffffffu;
    for (size_t i = 0; i < len; i++) crc = crc_table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
    return crc ^ 0xffffffffu;
}
