/* The GF(2) arithmetic of CRC32C (Castagnoli, bit-reflected) that combines CRCs: crc(A || B) from crc(A),
 * crc(B) and |B| is x^(8|B|) * crc(A) + crc(B) mod P (the method of zlib's crc32_combine). One copy for the
 * C extension (_crc32c.h includes it) and for the GPU kernel of cuda/crc.py (compiled by NVRTC, which gets
 * this text in front of its source); core/checksums.py's multmodp is the same in Python. No includes: it
 * must compile in both. */
#ifndef CFT_CRC32C_GF2_H
#define CFT_CRC32C_GF2_H

#define CRC_POLY 0x82F63B78u
#if defined(__CUDACC__)
#define CFT_GF2_FN static __device__ __forceinline__
#else
#define CFT_GF2_FN static inline
#endif

/* a(x) * b(x) mod P (a = 0 gives 0) */
CFT_GF2_FN unsigned int gf2_multmodp(unsigned int a, unsigned int b) {
    unsigned int m = 1u << 31, p = 0;
    while (m) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = (b & 1) ? (b >> 1) ^ CRC_POLY : b >> 1;
    }
    return p;
}

#endif /* CFT_CRC32C_GF2_H */
