// checksum_neon.c — CRC-32C in the ARMv8 CRC extension's crc32c instructions (aarch64 builds
// only, compiled with -march=armv8-a+crc; checksum.c uses it where the CPU has it, HWCAP_CRC32,
// and combines the streams). The _neon name marks the files built for aarch64.

#include "internal.h"

#include <arm_acle.h>
#include <string.h>

static inline uint64_t ld64(const uint8_t * p) { uint64_t v; memcpy(&v, p, 8); return v; }

static uint32_t crc_bytes(uint32_t c, const uint8_t * p, size_t len) {
    for (; len >= 8; p += 8, len -= 8) c = __crc32cd(c, ld64(p));
    for (; len; len--) c = __crc32cb(c, *p++);
    return c;
}

static void crc_streams3(uint32_t c[3], const uint8_t * p, size_t n) {
    uint32_t c0 = c[0], c1 = c[1], c2 = c[2];
    for (const uint8_t * end = p + n; p < end; p += 8) {
        c0 = __crc32cd(c0, ld64(p));
        c1 = __crc32cd(c1, ld64(p + n));
        c2 = __crc32cd(c2, ld64(p + 2 * n));
    }
    c[0] = c0;
    c[1] = c1;
    c[2] = c2;
}

const ls_crc_hw ls_crc_armv8 = { crc_bytes, crc_streams3 };
