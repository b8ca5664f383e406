// Dirty-page handlers for ONE region geometry. handlers.py prepends the constants below; nothing else is
// generated. No headers are needed (NVRTC built-ins only), so this compiles wherever NVRTC exists.
//
//   CFT_PAGE_BYTES   page size (power of two >= 512)
//   CFT_N_PAGES      pages in the region (the last one may be partial)
//   CFT_TAIL_BYTES   real bytes in the last page (== CFT_PAGE_BYTES when the region is a whole number of pages)
//   CFT_PAGES_PER_BLOCK, CFT_N_BLOCKS   paged regions: pages per KV block, number of blocks (0 otherwise)
//   CFT_THREADS      threads per block of the full-grid kernels
//
// Contract shared by every detector: it ORs bit p of `bitmap` for each dirty page p (a warp per page,
// grid-stride, the whole GPU), then the LAST block to finish compacts the bitmap into the ascending page list
// `list` (int64, usually host-mapped pinned memory), stores the count in meta[1] (device) and *count_host,
// clears the bitmap and resets the block counter meta[0]. Ascending order comes from the bitmap, never from
// atomics, so the list is deterministic. Detectors never touch shadows or hashes: advance kernels
// (scatter into the shadow, hash_store) run only after the epoch commits.

typedef unsigned long long u64;
typedef long long i64;

#define CFT_U4_PER_PAGE (CFT_PAGE_BYTES / 16)
#define CFT_U4_PER_LANE (CFT_U4_PER_PAGE / 32)
#define CFT_BITMAP_WORDS ((CFT_N_PAGES + 31) / 32)
#define CFT_PARTIAL_TAIL (CFT_TAIL_BYTES != CFT_PAGE_BYTES)

// 16 bytes of page `page` at uint4 index `idx`; bytes past the region's end read as zero.
__device__ __forceinline__ uint4 cft_load(const unsigned char* __restrict__ base, u64 page, unsigned idx) {
    const unsigned char* p = base + page * (u64)CFT_PAGE_BYTES + (u64)idx * 16u;
    if (CFT_PARTIAL_TAIL && page == CFT_N_PAGES - 1) {
        unsigned w[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            unsigned v = 0;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                unsigned off = idx * 16u + j * 4 + k;
                unsigned b = off < CFT_TAIL_BYTES ? (unsigned)p[j * 4 + k] : 0u;
                v |= b << (8 * k);
            }
            w[j] = v;
        }
        return make_uint4(w[0], w[1], w[2], w[3]);
    }
    return *reinterpret_cast<const uint4*>(p);
}

// 16 bytes into page `page` of a region: bytes past the region's end are not written.
__device__ __forceinline__ void cft_store(unsigned char* __restrict__ base, u64 page, unsigned idx, uint4 v) {
    unsigned char* p = base + page * (u64)CFT_PAGE_BYTES + (u64)idx * 16u;
    if (CFT_PARTIAL_TAIL && page == CFT_N_PAGES - 1) {
        unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 16; j++)
            if (idx * 16u + j < CFT_TAIL_BYTES) p[j] = (unsigned char)(w[j / 4] >> (8 * (j % 4)));
        return;
    }
    *reinterpret_cast<uint4*>(p) = v;
}

// ---- the page hash (handlers.py: reference_page_hash reproduces it in numpy) ----
#define CFT_K1 0x9E3779B97F4A7C15ull
#define CFT_K2 0xC2B2AE3D27D4EB4Full
#define CFT_K3 0xFF51AFD7ED558CCDull
#define CFT_K4 0xC4CEB9FE1A85EC53ull

__device__ __forceinline__ u64 cft_fmix(u64 h) {
    h ^= h >> 33; h *= CFT_K3; h ^= h >> 33; h *= CFT_K4; h ^= h >> 33;
    return h;
}
__device__ __forceinline__ u64 cft_rotl(u64 x, int r) { return (x << r) | (x >> (64 - r)); }
// One 16-byte step; a bijection of h for fixed input, so a lane's hash always changes when one of its words does.
__device__ __forceinline__ u64 cft_step(u64 h, uint4 v) {
    u64 lo = ((u64)v.y << 32) | v.x, hi = ((u64)v.w << 32) | v.z;
    h = cft_rotl((h ^ lo) * CFT_K1, 31);
    h = cft_rotl((h ^ hi) * CFT_K2, 27);
    return h;
}
// Whole-warp hash of one page; lane `l` hashes uint4 l, l+32, l+64, ... (coalesced 512-byte rows).
// The lanes are combined by a commutative sum of fmix(lane hash): every lane ends with the same value.
__device__ __forceinline__ u64 cft_page_hash(const unsigned char* __restrict__ base, u64 page, unsigned lane) {
    u64 h = CFT_K2 ^ ((u64)(lane + 1) * CFT_K1);
#if CFT_U4_PER_LANE <= 16
    uint4 v[CFT_U4_PER_LANE];
#pragma unroll
    for (int i = 0; i < CFT_U4_PER_LANE; i++) v[i] = cft_load(base, page, lane + 32u * i);
#pragma unroll
    for (int i = 0; i < CFT_U4_PER_LANE; i++) h = cft_step(h, v[i]);
#else
    for (int i0 = 0; i0 < CFT_U4_PER_LANE; i0 += 8) {
        uint4 v[8];
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = cft_load(base, page, lane + 32u * (i0 + i));
#pragma unroll
        for (int i = 0; i < 8; i++) h = cft_step(h, v[i]);
    }
#endif
    u64 s = cft_fmix(h);
#pragma unroll
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return cft_fmix(s ^ (u64)CFT_PAGE_BYTES);
}

// ---- compaction (one block) ----
// Exclusive prefix sum over the block (blockDim.x a multiple of 32, <= 1024); *total gets the sum.
__device__ __forceinline__ unsigned cft_block_scan(unsigned x, unsigned* total) {
    __shared__ unsigned warp_excl[32];
    __shared__ unsigned block_total;
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    unsigned incl = x;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        unsigned y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= (unsigned)o) incl += y;
    }
    if (lane == 31) warp_excl[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        unsigned w = lane < nwarps ? warp_excl[lane] : 0u, wi = w;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            unsigned y = __shfl_up_sync(0xffffffffu, wi, o);
            if (lane >= (unsigned)o) wi += y;
        }
        warp_excl[lane] = wi - w;
        if (lane == 31) block_total = wi;
    }
    __syncthreads();
    const unsigned out = warp_excl[warp] + incl - x;
    *total = block_total;
    __syncthreads();
    return out;
}

// Bitmap -> ascending list. Called by one whole block; clears the words it reads.
__device__ void cft_compact(unsigned* __restrict__ bitmap, unsigned* __restrict__ meta, i64* __restrict__ list,
                            unsigned* __restrict__ count_host) {
    const unsigned per = (CFT_BITMAP_WORDS + blockDim.x - 1) / blockDim.x;
    const unsigned w0 = threadIdx.x * per;
    unsigned n = 0;
    for (unsigned w = w0; w < w0 + per && w < CFT_BITMAP_WORDS; w++)
        n += __popc(((volatile unsigned*)bitmap)[w]);
    unsigned total;
    unsigned off = cft_block_scan(n, &total);
    for (unsigned w = w0; w < w0 + per && w < CFT_BITMAP_WORDS; w++) {
        unsigned bits = ((volatile unsigned*)bitmap)[w];
        if (bits) {
            bitmap[w] = 0u;
            while (bits) {
                unsigned b = __ffs(bits) - 1;
                list[off++] = (i64)w * 32 + b;
                bits &= bits - 1;
            }
        }
    }
    if (threadIdx.x == 0) {
        meta[1] = total;
        meta[0] = 0u;
        if (count_host) *(volatile unsigned*)count_host = total;
    }
    __threadfence_system();
}

// Last block to arrive runs the compaction. Every thread of every block must call this.
__device__ __forceinline__ void cft_finish(unsigned* bitmap, unsigned* meta, i64* list, unsigned* count_host) {
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(&meta[0], 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    cft_compact(bitmap, meta, list, count_host);
}

// ---- detectors ----
extern "C" __global__ void __launch_bounds__(CFT_THREADS)
concordia_scan_shadow(const unsigned char* __restrict__ cur, const unsigned char* __restrict__ shadow,
                      unsigned* bitmap, unsigned* meta, i64* list, unsigned* count_host) {
    const unsigned lane = threadIdx.x & 31;
    const u64 nwarps = ((u64)gridDim.x * blockDim.x) >> 5;
    for (u64 p = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; p < CFT_N_PAGES; p += nwarps) {
        unsigned d = 0;
#if CFT_U4_PER_LANE <= 16
        uint4 a[CFT_U4_PER_LANE], b[CFT_U4_PER_LANE];
#pragma unroll
        for (int i = 0; i < CFT_U4_PER_LANE; i++) { a[i] = cft_load(cur, p, lane + 32u * i);
                                                    b[i] = cft_load(shadow, p, lane + 32u * i); }
#pragma unroll
        for (int i = 0; i < CFT_U4_PER_LANE; i++)
            d |= (a[i].x ^ b[i].x) | (a[i].y ^ b[i].y) | (a[i].z ^ b[i].z) | (a[i].w ^ b[i].w);
#else
        for (int i = 0; i < CFT_U4_PER_LANE; i++) {
            uint4 a = cft_load(cur, p, lane + 32u * i), b = cft_load(shadow, p, lane + 32u * i);
            d |= (a.x ^ b.x) | (a.y ^ b.y) | (a.z ^ b.z) | (a.w ^ b.w);
        }
#endif
        if (__any_sync(0xffffffffu, d != 0) && lane == 0) atomicOr(&bitmap[p >> 5], 1u << (p & 31));
    }
    cft_finish(bitmap, meta, list, count_host);
}

extern "C" __global__ void __launch_bounds__(CFT_THREADS)
concordia_scan_hash(const unsigned char* __restrict__ cur, const u64* __restrict__ hashes,
                    unsigned* bitmap, unsigned* meta, i64* list, unsigned* count_host) {
    const unsigned lane = threadIdx.x & 31;
    const u64 nwarps = ((u64)gridDim.x * blockDim.x) >> 5;
    for (u64 p = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; p < CFT_N_PAGES; p += nwarps) {
        u64 h = cft_page_hash(cur, p, lane);
        if (lane == 0 && h != hashes[p]) atomicOr(&bitmap[p >> 5], 1u << (p & 31));
    }
    cft_finish(bitmap, meta, list, count_host);
}

// Paged regions: the owner's per-block dirty flags (uint8/bool, nonzero = dirty) -> ascending page list.
// One block; reads only the flags.
extern "C" __global__ void __launch_bounds__(1024)
concordia_paged_scan(const unsigned char* __restrict__ dirty_blocks, unsigned* meta, i64* list,
                     unsigned* count_host) {
#if CFT_N_BLOCKS > 0
    const unsigned per = (CFT_N_BLOCKS + blockDim.x - 1) / blockDim.x;
    const unsigned b0 = threadIdx.x * per;
    unsigned n = 0;
    for (unsigned b = b0; b < b0 + per && b < CFT_N_BLOCKS; b++) n += dirty_blocks[b] != 0;
    unsigned total;
    unsigned off = cft_block_scan(n, &total) * CFT_PAGES_PER_BLOCK;
    for (unsigned b = b0; b < b0 + per && b < CFT_N_BLOCKS; b++)
        if (dirty_blocks[b])
            for (unsigned j = 0; j < CFT_PAGES_PER_BLOCK; j++) list[off++] = (i64)b * CFT_PAGES_PER_BLOCK + j;
    if (threadIdx.x == 0) {
        meta[1] = total * CFT_PAGES_PER_BLOCK;
        if (count_host) *(volatile unsigned*)count_host = total * CFT_PAGES_PER_BLOCK;
    }
    __threadfence_system();
#endif
}

// Paged advance: clear the flags of the blocks whose pages were committed (`list`, `count` pages).
extern "C" __global__ void concordia_paged_clear(unsigned char* dirty_blocks, const i64* list, unsigned count) {
#if CFT_N_BLOCKS > 0
    for (unsigned k = blockIdx.x * blockDim.x + threadIdx.x; k < count; k += gridDim.x * blockDim.x)
        if (list[k] % CFT_PAGES_PER_BLOCK == 0) dirty_blocks[list[k] / CFT_PAGES_PER_BLOCK] = 0;
#endif
}

// ---- movers ----
// payload page k <- region page list[k] (identity when list is null), tail zero-padded. A warp per page.
// count: *count_dev when given (set by a detector on the device), else count_value.
extern "C" __global__ void __launch_bounds__(CFT_THREADS)
concordia_gather(const unsigned char* __restrict__ src, const i64* list, const unsigned* count_dev,
                 unsigned count_value, uint4* __restrict__ payload) {
    const unsigned lane = threadIdx.x & 31;
    const u64 nwarps = ((u64)gridDim.x * blockDim.x) >> 5;
    const u64 count = count_dev ? *count_dev : count_value;
    for (u64 k = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; k < count; k += nwarps) {
        u64 p = k;
        if (list) { i64 q = lane == 0 ? list[k] : 0; p = (u64)__shfl_sync(0xffffffffu, q, 0); }
        uint4* out = payload + k * CFT_U4_PER_PAGE;
#if CFT_U4_PER_LANE <= 16
        uint4 v[CFT_U4_PER_LANE];
#pragma unroll
        for (int i = 0; i < CFT_U4_PER_LANE; i++) v[i] = cft_load(src, p, lane + 32u * i);
#pragma unroll
        for (int i = 0; i < CFT_U4_PER_LANE; i++) out[lane + 32u * i] = v[i];
#else
        for (int i = 0; i < CFT_U4_PER_LANE; i++) out[lane + 32u * i] = cft_load(src, p, lane + 32u * i);
#endif
    }
}

// region page list[k] <- payload page k (identity when list is null); only the region's real bytes are
// written. Restore (payload on the device after one H2D) and shadow advance (payload = the committed pages).
extern "C" __global__ void __launch_bounds__(CFT_THREADS)
concordia_scatter(unsigned char* __restrict__ dst, const i64* list, unsigned count,
                  const uint4* __restrict__ payload) {
    const unsigned lane = threadIdx.x & 31;
    const u64 nwarps = ((u64)gridDim.x * blockDim.x) >> 5;
    for (u64 k = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; k < count; k += nwarps) {
        u64 p = k;
        if (list) { i64 q = lane == 0 ? list[k] : 0; p = (u64)__shfl_sync(0xffffffffu, q, 0); }
        const uint4* in = payload + k * CFT_U4_PER_PAGE;
        for (int i = 0; i < CFT_U4_PER_LANE; i++) cft_store(dst, p, lane + 32u * i, in[lane + 32u * i]);
    }
}

// Hash advance: hashes[list[k]] <- hash(payload page k), i.e. the hash of exactly the committed bytes (the
// payload's tail page is zero-padded like cft_load pads the region's).
extern "C" __global__ void __launch_bounds__(CFT_THREADS)
concordia_hash_store(const unsigned char* __restrict__ payload, const i64* list, unsigned count,
                     u64* __restrict__ hashes) {
    const unsigned lane = threadIdx.x & 31;
    const u64 nwarps = ((u64)gridDim.x * blockDim.x) >> 5;
    for (u64 k = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; k < count; k += nwarps) {
        u64 p = k;
        if (list) { i64 q = lane == 0 ? list[k] : 0; p = (u64)__shfl_sync(0xffffffffu, q, 0); }
        // hash the payload page as a full page (it is already padded): index it as page 0 of a copy
        const unsigned char* page = payload + k * (u64)CFT_PAGE_BYTES;
        u64 h = CFT_K2 ^ ((u64)(lane + 1) * CFT_K1);
        for (int i = 0; i < CFT_U4_PER_LANE; i++)
            h = cft_step(h, reinterpret_cast<const uint4*>(page)[lane + 32u * i]);
        u64 s = cft_fmix(h);
#pragma unroll
        for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) hashes[p] = cft_fmix(s ^ (u64)CFT_PAGE_BYTES);
    }
}
