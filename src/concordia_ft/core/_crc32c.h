/* CRC32C (Castagnoli) for the C extensions of core/: the SSE4.2 crc32 instruction
 * where the CPU has it (three chains combined for large buffers), a slicing-by-8 table otherwise
 * (CONCORDIA_CRC_TABLE forces the table: tests). Each extension calls crc_init() once at import; everything here
 * is static, so each extension has its own copy of the tables. */
#ifndef CFT_CRC32C_H
#define CFT_CRC32C_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_crc32c_gf2.h"

#if defined(__x86_64__)
#include <nmmintrin.h>
#define CFT_X86 1
#endif

/* ------------------------------------------------------------------------------------------------ CRC32C */
static uint32_t crc_tab[8][256];
static int crc_hw = 0;
static uint32_t crc_x2n[64]; /* x^(2^k) mod P, filled by crc_init */

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ CRC_POLY : c >> 1;
        crc_tab[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) crc_tab[t][i] = (crc_tab[t - 1][i] >> 8) ^ crc_tab[0][crc_tab[t - 1][i] & 0xff];
#ifdef CFT_X86
    __builtin_cpu_init();
    crc_hw = __builtin_cpu_supports("sse4.2");
#endif
    crc_x2n[0] = 1u << 30; /* x^1 */
    for (int k = 1; k < 64; k++) crc_x2n[k] = gf2_multmodp(crc_x2n[k - 1], crc_x2n[k - 1]);
    if (getenv("CONCORDIA_CRC_TABLE")) crc_hw = 0; /* tests: the portable path on an SSE4.2 machine */
}

static uint32_t crc_sw(uint32_t crc, const uint8_t *p, size_t n) {
    uint32_t c = ~crc;
    while (n && ((uintptr_t)p & 7)) { c = (c >> 8) ^ crc_tab[0][(c ^ *p++) & 0xff]; n--; }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= c;
        c = crc_tab[7][w & 0xff] ^ crc_tab[6][(w >> 8) & 0xff] ^ crc_tab[5][(w >> 16) & 0xff] ^
            crc_tab[4][(w >> 24) & 0xff] ^ crc_tab[3][(w >> 32) & 0xff] ^ crc_tab[2][(w >> 40) & 0xff] ^
            crc_tab[1][(w >> 48) & 0xff] ^ crc_tab[0][(w >> 56) & 0xff];
        p += 8;
        n -= 8;
    }
    while (n--) c = (c >> 8) ^ crc_tab[0][(c ^ *p++) & 0xff];
    return ~c;
}

#ifdef CFT_X86
__attribute__((target("sse4.2"))) static uint32_t crc_sse42(uint32_t crc, const uint8_t *p, size_t n) {
    uint64_t c = (uint32_t)~crc;
    while (n && ((uintptr_t)p & 7)) { c = _mm_crc32_u8((uint32_t)c, *p++); n--; }
    while (n >= 32) { /* one dependent chain; unrolled so the loads run ahead */
        uint64_t a, b, d, e;
        memcpy(&a, p, 8); memcpy(&b, p + 8, 8); memcpy(&d, p + 16, 8); memcpy(&e, p + 24, 8);
        c = _mm_crc32_u64(c, a); c = _mm_crc32_u64(c, b); c = _mm_crc32_u64(c, d); c = _mm_crc32_u64(c, e);
        p += 32;
        n -= 32;
    }
    while (n >= 8) { uint64_t a; memcpy(&a, p, 8); c = _mm_crc32_u64(c, a); p += 8; n -= 8; }
    while (n--) c = _mm_crc32_u8((uint32_t)c, *p++);
    return ~(uint32_t)c;
}
#endif

static uint32_t crc_shift_op(uint64_t nbytes) { /* x^(8 * nbytes) mod P */
    const uint32_t *x2n = crc_x2n;
    uint32_t p = 1u << 31; /* x^0 */
    uint64_t n = nbytes;
    int k = 3; /* bytes -> bits */
    while (n) {
        if (n & 1) p = gf2_multmodp(x2n[k & 63], p);
        n >>= 1;
        k++;
    }
    return p;
}

#ifdef CFT_X86
/* Three independent crc32 chains over the thirds of a large buffer (the instruction's latency is 3 cycles, its
 * throughput 1 a cycle), combined exactly: about 3x one chain. */
__attribute__((target("sse4.2"))) static uint32_t crc_sse42_3way(uint32_t crc, const uint8_t *p, size_t n) {
    size_t third = (n / 3) & ~(size_t)7;
    const uint8_t *a = p, *b = p + third, *c = p + 2 * third;
    uint64_t ra = (uint32_t)~crc, rb = 0xffffffffu, rc = 0xffffffffu;
    for (size_t i = 0; i < third; i += 8) {
        uint64_t x, y, z;
        memcpy(&x, a + i, 8); memcpy(&y, b + i, 8); memcpy(&z, c + i, 8);
        ra = _mm_crc32_u64(ra, x); rb = _mm_crc32_u64(rb, y); rc = _mm_crc32_u64(rc, z);
    }
    uint32_t cb = ~(uint32_t)rb;
    uint32_t cc = crc_sse42(~(uint32_t)rc, c + third, n - 3 * third); /* the tail continues the third chain */
    size_t len_c = n - 2 * third;
    uint32_t r = gf2_multmodp(crc_shift_op(third), ~(uint32_t)ra) ^ cb;
    return gf2_multmodp(crc_shift_op(len_c), r) ^ cc;
}
#endif

static uint32_t crc32c(uint32_t crc, const void *p, size_t n) {
#ifdef CFT_X86
    if (crc_hw) return n >= (64u << 10) ? crc_sse42_3way(crc, (const uint8_t *)p, n) : crc_sse42(crc, (const uint8_t *)p, n);
#endif
    return crc_sw(crc, (const uint8_t *)p, n);
}

#endif /* CFT_CRC32C_H */
