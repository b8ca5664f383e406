// Concordia-FT block gate: the device side of a Compute Sanitizer tool (built with nvcc --fatbin
// --compile-as-tools-patch; loaded by _blockgate.c with sanitizerAddPatchesFromFile).
//
// The driver calls cft_gate_enter at SANITIZER_INSTRUCTION_BLOCK_ENTER of every patched kernel, in every thread,
// before any of the kernel's own code. userdata is the launch's control block (sanitizerSetLaunchCallbackData),
// NULL for launches nobody armed: those pay one compare and return.
//
// Armed, one lane per warp decides for its block, and every warp of a block reaches the same decision: the
// first warp to arrive writes the block's state word with a compare-and-swap and the later ones read it
// (a warp does not wait for the others, so no barrier is needed and a warp-specialised kernel is not held).
// A block is skipped when it already ran in an earlier launch of the sequence (its done bit) or when the pause
// word is set; a skipped block returns SANITIZER_PATCH_ERROR from every thread, which exits each warp.
//
// state word of block b: (epoch << 2) | (done << 1) | skip, where epoch is the launch's number in its sequence
// (the host bumps it before every launch and zeroes the words when a sequence starts).
#include <sanitizer_patching.h>
#include <stdint.h>

struct cft_gate_ctl {
  uint32_t epoch;          // this launch's number in the sequence, >= 1
  uint32_t flags;          // bit 0: count warps (entered / skipped)
  uint64_t pause_ptr;      // address of the u32 pause word (device memory, set by a stream write; read volatile)
  uint64_t state_ptr;      // u32 per block
  uint32_t nstate;         // blocks the state array covers; blocks beyond it always run
  uint32_t warps_entered;  // counted when flags bit 0 is set
  uint32_t warps_skipped;
  uint32_t blocks_overflow;
};

extern "C" __device__ __noinline__ SanitizerPatchResult cft_gate_enter(void* userdata, uint64_t pc) {
  (void)pc;
  cft_gate_ctl* c = (cft_gate_ctl*)userdata;
  if (c == nullptr) return SANITIZER_PATCH_SUCCESS;
  unsigned mask;
  asm volatile("activemask.b32 %0;" : "=r"(mask));  // __activemask() needs an extern the patch cannot link
  const int leader = __ffs(mask) - 1;
  unsigned lane;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
  unsigned skip = 0;
  if ((int)lane == leader) {
    const unsigned bid = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const unsigned epoch = c->epoch;
    if (bid >= c->nstate) {
      atomicAdd(&c->blocks_overflow, 1u);
    } else {
      unsigned* st = (unsigned*)(uintptr_t)c->state_ptr + bid;
      unsigned old = *(volatile unsigned*)st;
      for (;;) {
        if ((old >> 2) == epoch) {  // another warp of this block decided already
          skip = old & 1u;
          break;
        }
        const unsigned done = (old >> 1) & 1u;
        const unsigned paused = *(volatile unsigned*)(uintptr_t)c->pause_ptr != 0u;
        const unsigned s = done | paused;
        const unsigned nw = (epoch << 2) | ((done | (s ^ 1u)) << 1) | s;
        const unsigned prev = atomicCAS(st, old, nw);
        if (prev == old) {
          skip = s;
          break;
        }
        old = prev;
      }
    }
    if (c->flags & 1u) atomicAdd(skip ? &c->warps_skipped : &c->warps_entered, 1u);
  }
  skip = __shfl_sync(mask, skip, leader);
  return skip ? SANITIZER_PATCH_ERROR : SANITIZER_PATCH_SUCCESS;
}
