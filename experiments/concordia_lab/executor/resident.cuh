// Concordia-FT executor: the resident ring consumer and the full-width dispatcher, one module.
//
// resident.py renders the CCR_* constants from concordia_lab/executor/ring.py in front of this file (layout,
// opcodes, states), plus CCR_IMAGE_ID and CCR_THREADS. Nothing here calls into another module: a hot-swap
// hands the ring (host-mapped memory) to a newly built image of this file.
//
// Shared words follow ring.py (protocol version 2): the host writes stop/slots, this kernel writes tail/results/
// heartbeat/state. System-scope acquire loads and release fences only (no atomics across PCIe). Every descriptor
// word carries its task's tag in bits 63..48, so the polling warp loads a whole slot (and stop) in ONE PCIe round
// trip and runs the task only when all 8 words carry the tag it expects (ring.py explains why that is safe).

typedef unsigned long long u64;
typedef unsigned int u32;

__device__ __forceinline__ u64 ccr_ld_acquire(const u64* p) {
  u64 v; asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ u32 ccr_ld_acquire32(const u32* p) {
  u32 v; asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ u64 ccr_ld_relaxed(const u64* p) {
  u64 v; asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ u32 ccr_ld_relaxed32(const u32* p) {
  u32 v; asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ void ccr_st_release(u64* p, u64 v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory"); }
__device__ __forceinline__ void ccr_st_relaxed(u64* p, u64 v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory"); }
__device__ __forceinline__ void ccr_fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ void ccr_st_release32(u32* p, u32 v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory"); }
__device__ __forceinline__ void ccr_st_relaxed32(u32* p, u32 v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory"); }
__device__ __forceinline__ u64 ccr_now_ns() {
  u64 t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }

#define CCR_W(base, off) ((u64*)((unsigned char*)(base) + (off)))
#define CCR_W32(base, off) ((u32*)((unsigned char*)(base) + (off)))
#define CCR_PAYLOAD(w) ((w) & ((1ull << CCR_TAG_SHIFT) - 1))

// The tag every word of task ``seq`` carries in bits 63..48 (never zero: the marker bit is set).
__device__ __forceinline__ u32 ccr_tag(u64 seq) { return (u32)(seq & CCR_TAG_SEQ_MASK) | CCR_TAG_MARK; }

// ---------------------------------------------------------------- built-in operations
template <int OP> __device__ __forceinline__ float ccr_f(float x, float y, float alpha) {
  if (OP == CCR_OP_ADD) return x + y;
  if (OP == CCR_OP_MUL) return x * y;
  if (OP == CCR_OP_SUB) return x - y;
  if (OP == CCR_OP_RELU) return fmaxf(x, 0.0f);
  if (OP == CCR_OP_SILU) return x / (1.0f + expf(-x));
  if (OP == CCR_OP_SCALE) return alpha * x;
  return fmaxf(x + y, 0.0f);  // CCR_OP_ADD_RELU
}
template <int OP> __device__ __forceinline__ float4 ccr_f4(float4 x, float4 y, float alpha) {
  return make_float4(ccr_f<OP>(x.x, y.x, alpha), ccr_f<OP>(x.y, y.y, alpha), ccr_f<OP>(x.z, y.z, alpha),
                     ccr_f<OP>(x.w, y.w, alpha));
}
template <int OP> __device__ __forceinline__ constexpr bool ccr_binary() {
  return OP == CCR_OP_ADD || OP == CCR_OP_MUL || OP == CCR_OP_SUB || OP == CCR_OP_ADD_RELU;
}

// out[i] = f(a[i], b[i]) for i = i0, i0 + stride, ... (float4 when every pointer is 16-byte aligned)
template <int OP>
__device__ void ccr_elementwise(const float* a, const float* b, float* out, u64 n, float alpha, u64 i0, u64 stride) {
  const bool vec = ((((u64)a) | ((u64)b) | ((u64)out)) & 15) == 0;
  u64 n4 = vec ? n / 4 : 0;
  const float4* a4 = (const float4*)a; const float4* b4 = (const float4*)b; float4* o4 = (float4*)out;
  u64 i = i0;
  for (; i + 3 * stride < n4; i += 4 * stride) {  // four independent 16-byte loads in flight per thread
    float4 x[4], y[4];
#pragma unroll
    for (int j = 0; j < 4; j++) { x[j] = a4[i + j * stride]; y[j] = ccr_binary<OP>() ? b4[i + j * stride] : x[j]; }
#pragma unroll
    for (int j = 0; j < 4; j++) o4[i + j * stride] = ccr_f4<OP>(x[j], y[j], alpha);
  }
  for (; i < n4; i += stride) o4[i] = ccr_f4<OP>(a4[i], ccr_binary<OP>() ? b4[i] : a4[i], alpha);
  for (u64 k = n4 * 4 + i0; k < n; k += stride) out[k] = ccr_f<OP>(a[k], ccr_binary<OP>() ? b[k] : 0.0f, alpha);
}

// Page diff, a warp per page (page bytes a multiple of 512): flags[p] = page p of cur differs from shadow.
// Returns this thread's count of dirty pages (lane 0 of each warp counts).
__device__ u32 ccr_page_diff(const uint4* cur, const uint4* shadow, u32* flags, u64 npages, u32 page_bytes,
                             u64 warp0, u64 nwarps) {
  const u32 lane = threadIdx.x & 31; const u64 per = page_bytes / 16; u32 count = 0;
  for (u64 p = warp0; p < npages; p += nwarps) {
    const uint4* x = cur + p * per; const uint4* y = shadow + p * per; u32 d = 0;
    for (u64 k = lane; k < per; k += 32) { uint4 u = x[k], v = y[k]; d |= (u.x ^ v.x) | (u.y ^ v.y) | (u.z ^ v.z) | (u.w ^ v.w); }
    d = __any_sync(0xffffffffu, d != 0);
    if (lane == 0) { if (flags) flags[p] = d; count += d; }
  }
  return count;
}

// Restore: page i of src (packed) goes to page idx[i] of dst (idx == 0: page i).
__device__ void ccr_restore(const uint4* src, const u32* idx, uint4* dst, u64 npages, u32 page_bytes, u64 warp0, u64 nwarps) {
  const u32 lane = threadIdx.x & 31; const u64 per = page_bytes / 16;
  for (u64 p = warp0; p < npages; p += nwarps) {
    const u64 to = idx ? (u64)idx[p] : p;
    for (u64 k = lane; k < per; k += 32) dst[to * per + k] = src[p * per + k];
  }
}

// One descriptor, run by every thread of the calling grid (resident: one block; wide: the whole grid).
// d: the 8 tagged words (opcode|flags, a0..a5, aux; tags are ignored here). Returns (status << 32 | value) for
// thread 0 of block 0 in the resident case; wide callers add page counts into a4 when it is non-zero.
__device__ u64 ccr_run(const u64* d, bool resident, u32* s_count) {
  const u32 op = (u32)(d[0] & 0xffff); const u32 aux = (u32)d[7];
  const u64 a = CCR_PAYLOAD(d[1]), b = CCR_PAYLOAD(d[2]), out = CCR_PAYLOAD(d[3]), n = CCR_PAYLOAD(d[4]);
  const u64 a4 = CCR_PAYLOAD(d[5]);
  const u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x, nthreads = (u64)gridDim.x * blockDim.x;
  const float alpha = __uint_as_float(aux);
  switch (op) {
    case CCR_OP_NOP: return 0;
    case CCR_OP_ADD: ccr_elementwise<CCR_OP_ADD>((const float*)a, (const float*)b, (float*)out, n, alpha, tid, nthreads); return 0;
    case CCR_OP_MUL: ccr_elementwise<CCR_OP_MUL>((const float*)a, (const float*)b, (float*)out, n, alpha, tid, nthreads); return 0;
    case CCR_OP_SUB: ccr_elementwise<CCR_OP_SUB>((const float*)a, (const float*)b, (float*)out, n, alpha, tid, nthreads); return 0;
    case CCR_OP_RELU: ccr_elementwise<CCR_OP_RELU>((const float*)a, (const float*)b, (float*)out, n, alpha, tid, nthreads); return 0;
    case CCR_OP_SILU: ccr_elementwise<CCR_OP_SILU>((const float*)a, (const float*)b, (float*)out, n, alpha, tid, nthreads); return 0;
    case CCR_OP_SCALE: ccr_elementwise<CCR_OP_SCALE>((const float*)a, (const float*)b, (float*)out, n, alpha, tid, nthreads); return 0;
    case CCR_OP_ADD_RELU: ccr_elementwise<CCR_OP_ADD_RELU>((const float*)a, (const float*)b, (float*)out, n, alpha, tid, nthreads); return 0;
    case CCR_OP_MARK:
      if (tid == 0) { u32* p = (u32*)a + b; u32 v = *p + 1; *p = v; return v; }
      return 0;
    case CCR_OP_TRIGGER:
      if (tid == 0) { __threadfence_system(); ccr_st_release32((u32*)a, aux); }
      return 0;
    case CCR_OP_PAGE_DIFF: {
      if (aux == 0 || aux % 512) return (u64)CCR_STATUS_BAD_ARGS << 32;
      u32 c = ccr_page_diff((const uint4*)a, (const uint4*)b, (u32*)out, n, aux, tid >> 5, nthreads >> 5);
      if (resident) { if (c) atomicAdd(s_count, c); }
      else if (c && a4) atomicAdd((u32*)a4, c);
      return 0;  // the resident caller reads *s_count after a barrier
    }
    case CCR_OP_RESTORE:
      if (aux == 0 || aux % 16) return (u64)CCR_STATUS_BAD_ARGS << 32;
      ccr_restore((const uint4*)a, (const u32*)b, (uint4*)out, n, aux, tid >> 5, nthreads >> 5);
      return 0;
    case CCR_OP_SLEEP:
      if (tid == 0) { u64 t0 = ccr_now_ns(); while (ccr_now_ns() - t0 < a) __nanosleep(1000); }
      return 0;
    default:
      return (u64)CCR_STATUS_BAD_OPCODE << 32;
  }
}

// ---------------------------------------------------------------- the resident executor (one block)
__device__ void ccr_exit(unsigned char* ring, u32 state) {
  const u32 nrel = *(volatile u32*)CCR_W32(ring, CCR_OFF_RELEASE_COUNT);
  __threadfence_system();
  for (u32 i = 0; i < nrel && i < CCR_MAX_RELEASES; i++) {  // release armed waits this executor could fire
    u64 addr = *(volatile u64*)CCR_W(ring, CCR_OFF_RELEASES + 16 * i);
    u32 value = *(volatile u32*)CCR_W32(ring, CCR_OFF_RELEASES + 16 * i + 8);
    if (addr) ccr_st_release32((u32*)addr, value);
  }
  ccr_st_release32(CCR_W32(ring, CCR_OFF_STATE), state);
}

// CCR_MAX_REGS > 0 caps registers (__maxnreg__) instead of __launch_bounds__. Measured on the H200 (T9): a
// one-warp, 32-register block cost MORE bf16-matmul throughput (11%) than the default 256-thread block (7-8%)
// and ran ops far slower, so the default is 256 threads, uncapped.
#if CCR_MAX_REGS > 0
#define CCR_EXECUTOR_BOUNDS __maxnreg__(CCR_MAX_REGS)
#else
#define CCR_EXECUTOR_BOUNDS __launch_bounds__(CCR_THREADS)
#endif
extern "C" __global__ void CCR_EXECUTOR_BOUNDS
concordia_executor(unsigned char* ring, u32 capacity, u64 idle_timeout_ns, u64 lease_ns, u32 poll_sleep_ns) {
  __shared__ u64 s_desc[CCR_BATCH][8];
  __shared__ u64 s_tail, s_error_seq;
  __shared__ u32 s_n, s_cmd, s_count;
  const u32 tid = threadIdx.x, lane = tid & 31;
  const u64 mask = capacity - 1;
  const u64* slots = (const u64*)(ring + CCR_SLOTS_OFF);
  const u32 nslots = capacity < CCR_BATCH ? capacity : CCR_BATCH;  // a poll never reads a slot twice
  u64 t_start = 0, t_last = 0, t_beat = 0, beats = 0;  // lane 0 of warp 0 only
  if (tid == 0) {
    s_cmd = 0;
    const u32 magic = *(volatile u32*)CCR_W32(ring, CCR_OFF_MAGIC);
    const u32 version = *(volatile u32*)CCR_W32(ring, CCR_OFF_VERSION);
    const u32 cap = *(volatile u32*)CCR_W32(ring, CCR_OFF_CAPACITY);
    if (magic != CCR_MAGIC || version != CCR_VERSION || cap != capacity) {
      // not a ring this image speaks: report and stop (its release table is not trusted, so not stored)
      *(volatile u64*)CCR_W(ring, CCR_OFF_ERROR_SEQ) = 0;
      *(volatile u32*)CCR_W32(ring, CCR_OFF_ERROR) = CCR_ERR_BAD_HEADER;
      ccr_st_release32(CCR_W32(ring, CCR_OFF_STATE), CCR_STATE_EXITED_ERROR);
      s_cmd = CCR_STATE_EXITED_ERROR;
    } else {
      s_tail = *(volatile u64*)CCR_W(ring, CCR_OFF_TAIL);
      beats = *(volatile u64*)CCR_W(ring, CCR_OFF_HEARTBEAT);
      ccr_st_relaxed32(CCR_W32(ring, CCR_OFF_IMAGE), CCR_IMAGE_ID);
      *(volatile u64*)CCR_W(ring, CCR_OFF_STARTS) = *(volatile u64*)CCR_W(ring, CCR_OFF_STARTS) + 1;
      ccr_st_release32(CCR_W32(ring, CCR_OFF_STATE), CCR_STATE_RUNNING);
      t_start = t_last = t_beat = ccr_now_ns();
    }
  }
  __syncthreads();
  if (s_cmd) return;
  while (true) {
    if (tid < 32) {  // warp 0 polls: lane l loads word l % 8 of the slot of task tail + 1 + l / 8
      const u64 tail = s_tail;
      const u32 s = lane >> 3, w = lane & 7;
      const bool mine = s < nslots;
      const u64 seq = tail + 1 + s;
      const u64* word = slots + ((seq - 1) & mask) * 8 + w;
      const u32 want = ccr_tag(seq), prev = ccr_tag(seq - capacity);  // this task's tag, the previous occupant's
      u32 n = 0, cmd = 0, bad = 0;
      u64 v = 0;
      while (true) {
        // ONE PCIe round trip per poll: lane 0 issues the relaxed load of stop first, then every lane the acquire
        // load of its word. An acquire waits for its own load before the lane goes on, so a lane never issues
        // two acquires (the second would start only after the first returned: two round trips).
        u32 stop = 0;
        if (lane == 0) stop = ccr_ld_relaxed32(CCR_W32(ring, CCR_OFF_STOP));
        if (mine) v = ccr_ld_acquire(word);
        const u32 tag = (u32)(v >> CCR_TAG_SHIFT);
        // a word is this task's (tag == want), not written yet (the previous occupant's, or zero), or corrupt
        const u32 ok = __ballot_sync(0xffffffffu, mine && tag == want);
        const u32 badm = __ballot_sync(0xffffffffu, mine && tag != want && tag != prev && v != 0);
        if (lane == 0) {
          const u64 now = ccr_now_ns();
          u32 k = 0;  // slots whose 8 words all match, from the first one on
          while (k < nslots && ((ok >> (8 * k)) & 0xffu) == 0xffu) k++;
          if (stop) cmd = CCR_STATE_EXITED_STOP;
          else if (badm) { cmd = CCR_STATE_EXITED_ERROR; bad = (u32)(__ffs(badm) - 1) >> 3; }
          else if (k) n = k;
          else if (now - t_last > idle_timeout_ns) cmd = CCR_STATE_EXITED_IDLE;
          if (!cmd && now - t_start > lease_ns) cmd = CCR_STATE_EXITED_LEASE;
          // relaxed: the heartbeat orders nothing (a release here would put a ~1 us fence into a poll)
          if (now - t_beat > CCR_HEARTBEAT_NS) { t_beat = now; ccr_st_relaxed(CCR_W(ring, CCR_OFF_HEARTBEAT), ++beats); }
        }
        n = __shfl_sync(0xffffffffu, n, 0); cmd = __shfl_sync(0xffffffffu, cmd, 0);
        if (n || cmd) break;
        if (poll_sleep_ns) __nanosleep(poll_sleep_ns);
      }
      if (!cmd && s < n) s_desc[s][w] = v;  // the whole descriptors, as loaded (acquired) by this poll
      if (lane == 0) { s_n = n; s_cmd = cmd; s_error_seq = tail + 1 + bad; }
    }
    __syncthreads();  // carries warp 0's acquires to the block: the tasks' loads come after their descriptors
    const u32 n = s_n, cmd = s_cmd;
    if (cmd) {
      if (tid == 0) {
        if (cmd == CCR_STATE_EXITED_ERROR) {
          *(volatile u64*)CCR_W(ring, CCR_OFF_ERROR_SEQ) = s_error_seq;
          *(volatile u32*)CCR_W32(ring, CCR_OFF_ERROR) = CCR_ERR_BAD_SLOT;
        }
        ccr_exit(ring, cmd);
      }
      return;
    }
    for (u32 s = 0; s < n; s++) {
      const u64 seq = s_tail + 1;
      if (tid == 0) s_count = 0;
      __syncthreads();
      u64 r = ccr_run(s_desc[s], true, &s_count);
      __syncthreads();  // every thread's writes happen before thread 0's fence below
      if (tid == 0) {
        const u32 op = (u32)(s_desc[s][0] & 0xffff);
        if (op == CCR_OP_PAGE_DIFF && (r >> 32) == 0) r = s_count;
        u64* res = (u64*)(ring + CCR_SLOTS_OFF + (u64)capacity * CCR_SLOT_BYTES + ((seq - 1) & mask) * CCR_RESULT_BYTES);
        // value|status, ONE system-scope fence per task (each costs about a microsecond over PCIe), then the
        // result's seq and tail: the fence orders the task's writes and the value before both, so the host may
        // spin on either; tail also follows this task's slot loads (the producer may then reuse the slot)
        *(volatile u64*)res = r;
        ccr_fence_acq_rel_sys();
        ccr_st_relaxed(res + 1, seq);
        ccr_st_relaxed(CCR_W(ring, CCR_OFF_TAIL), seq);
        s_tail = seq;
      }
      __syncthreads();
    }
    if (tid == 0) t_last = ccr_now_ns();
  }
}

// ---------------------------------------------------------------- full-width dispatch
// Plain launch: the descriptor by value. Armed launch: the descriptor in (host-mapped) memory, written by
// whoever fires the launch just before it does; a pending armed launch holds a NOP there (cancel = release).
extern "C" __global__ void concordia_exec_wide(u64 w0, u64 w1, u64 w2, u64 w3, u64 w4, u64 w5, u64 w6, u64 w7) {
  __shared__ u32 s_count;
  u64 d[8] = {w0, w1, w2, w3, w4, w5, w6, w7};
  ccr_run(d, false, &s_count);
}

// ``ran`` (device-written, one word per slot) records word 0 (tag | flags | opcode) of what this instance ran,
// so the host can tell a task it fired from an instance an executor exit released early. A pending instance's
// slot holds word 0 = tag | NOP and zero words 1..7; the instance runs its descriptor only when words 1..7 carry
// word 0's tag. An instance released while the host was still writing (its stream-ordered copy caught half of
// the words) therefore runs a NOP and records opcode NOP, and the host fires the task again: never half of it.
extern "C" __global__ void concordia_exec_wide_at(const u64* desc, u64* ran) {
  __shared__ u64 s_d[8];
  __shared__ u32 s_count;
  if (threadIdx.x < 8) s_d[threadIdx.x] = ccr_ld_relaxed(desc + threadIdx.x);
  __syncthreads();
  const u64 tag = s_d[0] >> CCR_TAG_SHIFT;
  bool whole = true;
#pragma unroll
  for (int i = 1; i < 8; i++) whole = whole && (s_d[i] >> CCR_TAG_SHIFT) == tag;
  const u64 w0 = whole ? s_d[0] : (s_d[0] & ~0xffffull);  // incomplete: NOP, same tag
  if (blockIdx.x == 0 && threadIdx.x == 0 && ran) *(volatile u64*)ran = w0;
  if (whole) ccr_run(s_d, false, &s_count);
}
