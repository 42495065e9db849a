// checksum_x86.c — CRC-32C in SSE4.2's crc32 instruction (x86-64 builds only, compiled with
// -msse4.2; checksum.c uses it where the CPU has it and combines the streams).

#include "internal.h"

#include <nmmintrin.h>
#include <string.h>

static inline uint64_t ld64(const uint8_t * p) { uint64_t v; memcpy(&v, p, 8); return v; }

static uint32_t crc_bytes(uint32_t c, const uint8_t * p, size_t len) {
    uint64_t c0 = c;
    for (; len >= 8; p += 8, len -= 8) c0 = _mm_crc32_u64(c0, ld64(p));
    for (; len; len--) c0 = _mm_crc32_u8((uint32_t) c0, *p++);
    return (uint32_t) c0;
}

static void crc_streams3(uint32_t c[3], const uint8_t * p, size_t n) {
    uint64_t c0 = c[0], c1 = c[1], c2 = c[2];
    for (const uint8_t * end = p + n; p < end; p += 8) {
        c0 = _mm_crc32_u64(c0, ld64(p));
        c1 = _mm_crc32_u64(c1, ld64(p + n));
        c2 = _mm_crc32_u64(c2, ld64(p + 2 * n));
    }
    c[0] = (uint32_t) c0;
    c[1] = (uint32_t) c1;
    c[2] = (uint32_t) c2;
}

const ls_crc_hw ls_crc_sse42 = { crc_bytes, crc_streams3 };
