/* Concordia-FT launch cut: an epoch boundary between two kernel launches, placed by the interposer's launch
 * callback, for kernels that have no safe points of their own (SASS-only: PyTorch eager, cuBLAS, graphs).
 *
 * Python arms a cut with a list of copies (device address -> pinned host address, bytes). The next launch
 * that the cut's filter accepts enqueues, from inside its cuLaunch* API-enter callback and so *before* that
 * kernel on the same stream: the copies (cuMemcpyDtoHAsync) and a host function (cuLaunchHostFunc) that marks
 * the cut landed. The host copies then hold the device state after every launch enqueued before the cut on
 * that stream and before the launch that crossed it: a boundary in stream order, without stopping the program
 * or the GPU. Filter 1 lets only launches of kernels without safe points cross (the rewriter's kernels carry a
 * `cft_ctl_<kernel>` global: they can be paused inside, DESIGN.md section 1).
 *
 * Compiled into the interposer's library (interposer.build()); _interposer.c calls cft_cut_on_launch() at the
 * enter site of every launch and cft_cut_on_module() for every loaded module. The two driver calls are looked
 * up at arm time (cft_cut_set_driver replaces them in the CPU tests, where there is no driver).
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <cupti_driver_cbid.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef CUresult (*memcpy_dtoh_async_fn)(void *, CUdeviceptr, size_t, CUstream);
typedef CUresult (*launch_host_func_fn)(CUstream, CUhostFn, void *);

typedef struct {
  uint64_t src;   /* device address */
  uint64_t dst;   /* pinned host address */
  uint64_t bytes;
} cft_cut_copy;

/* ARMED: waiting for a launch; TAKEN: a launch is enqueueing the copies; ENQUEUED: they are in its stream;
   LANDED: they completed (the host function ran); FAILED: a driver call refused (cut_error) */
enum { CUT_IDLE = 0, CUT_ARMED = 1, CUT_TAKEN = 2, CUT_ENQUEUED = 3, CUT_LANDED = 4, CUT_FAILED = 5 };

static pthread_mutex_t cmu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t ccv = PTHREAD_COND_INITIALIZER;
static int cut_state = CUT_IDLE, cut_filter = 0, cut_error = 0;
static cft_cut_copy *cut_copies;
static size_t cut_n;
static uint64_t cut_generation; /* bumped by every arm: a host function of an older cut changes nothing */
static uint64_t landed_generation;
static uint64_t launch_seq, cut_seq;
static uint64_t cut_at; /* the cut may only be taken by a launch numbered >= cut_at (0: the next one) */
static char kernel_last[256], kernel_before[256], kernel_after[256], cut_api[64];
static uintptr_t cut_stream;
static memcpy_dtoh_async_fn p_memcpy;
static launch_host_func_fn p_hostfn;
static __thread int tl_in_cut;

/* ---------------------------------------------------------------- kernels with safe points (by name) */
static char **sp_names;
static size_t sp_cap, sp_used;
static const char SP_PREFIX[] = "cft_ctl_";

static uint64_t hash_str(const char *s) {
  uint64_t h = 1469598103934665603ull;
  while (*s) h = (h ^ (unsigned char)*s++) * 1099511628211ull;
  return h;
}

static int sp_has(const char *name) { /* under cmu */
  if (!sp_cap || !name) return 0;
  size_t j = hash_str(name) & (sp_cap - 1);
  while (sp_names[j]) {
    if (strcmp(sp_names[j], name) == 0) return 1;
    j = (j + 1) & (sp_cap - 1);
  }
  return 0;
}

static void sp_add(const char *name) { /* under cmu */
  if (sp_has(name)) return;
  if ((sp_used + 1) * 2 > sp_cap) {
    size_t ncap = sp_cap ? sp_cap * 2 : 256;
    char **nt = calloc(ncap, sizeof(char *));
    if (!nt) return;
    for (size_t i = 0; i < sp_cap; i++) {
      if (!sp_names[i]) continue;
      size_t j = hash_str(sp_names[i]) & (ncap - 1);
      while (nt[j]) j = (j + 1) & (ncap - 1);
      nt[j] = sp_names[i];
    }
    free(sp_names);
    sp_names = nt;
    sp_cap = ncap;
  }
  size_t j = hash_str(name) & (sp_cap - 1);
  while (sp_names[j]) j = (j + 1) & (sp_cap - 1);
  sp_names[j] = strdup(name);
  sp_used++;
}

/* ELF64 symbol table walk: every symbol named cft_ctl_<kernel> marks <kernel> as having safe points. Returns
   how many it found, -1 if the bytes are not a well-formed ELF64 image. */
typedef struct { unsigned char e_ident[16]; uint16_t e_type, e_machine; uint32_t e_version; uint64_t e_entry,
  e_phoff, e_shoff; uint32_t e_flags; uint16_t e_ehsize, e_phentsize, e_phnum, e_shentsize, e_shnum,
  e_shstrndx; } cut_ehdr;
typedef struct { uint32_t sh_name, sh_type; uint64_t sh_flags, sh_addr, sh_offset, sh_size; uint32_t sh_link,
  sh_info; uint64_t sh_addralign, sh_entsize; } cut_shdr;
typedef struct { uint32_t st_name; unsigned char st_info, st_other; uint16_t st_shndx; uint64_t st_value,
  st_size; } cut_sym;

int cft_cut_on_module(const void *image, uint64_t size) {
  const unsigned char *p = (const unsigned char *)image;
  if (!p || size < sizeof(cut_ehdr) || memcmp(p, "\x7f" "ELF", 4) != 0 || p[4] != 2) return -1;
  const cut_ehdr *eh = (const cut_ehdr *)p;
  if (eh->e_shoff == 0 || eh->e_shentsize != sizeof(cut_shdr) ||
      eh->e_shoff + (uint64_t)eh->e_shnum * sizeof(cut_shdr) > size)
    return -1;
  const cut_shdr *sh = (const cut_shdr *)(p + eh->e_shoff);
  int n = 0;
  pthread_mutex_lock(&cmu);
  for (uint16_t i = 0; i < eh->e_shnum; i++) {
    if (sh[i].sh_type != 2 /* SHT_SYMTAB */ || sh[i].sh_entsize != sizeof(cut_sym) || sh[i].sh_link >= eh->e_shnum)
      continue;
    const cut_shdr *strs = &sh[sh[i].sh_link];
    if (sh[i].sh_offset + sh[i].sh_size > size || strs->sh_offset + strs->sh_size > size) {
      n = -1;
      break;
    }
    const cut_sym *sym = (const cut_sym *)(p + sh[i].sh_offset);
    const char *str = (const char *)p + strs->sh_offset;
    for (uint64_t k = 0; k < sh[i].sh_size / sizeof(cut_sym); k++) {
      if (sym[k].st_name >= strs->sh_size) continue;
      const char *nm = str + sym[k].st_name;
      if (strncmp(nm, SP_PREFIX, sizeof SP_PREFIX - 1) != 0 || !nm[sizeof SP_PREFIX - 1]) continue;
      if (!memchr(nm, 0, strs->sh_size - sym[k].st_name)) continue;
      sp_add(nm + sizeof SP_PREFIX - 1);
      n++;
    }
  }
  pthread_mutex_unlock(&cmu);
  return n;
}

int cft_cut_has_safepoints(const char *kernel) {
  pthread_mutex_lock(&cmu);
  int r = sp_has(kernel);
  pthread_mutex_unlock(&cmu);
  return r;
}

/* ---------------------------------------------------------------- the launch parameters (generated_cuda_meta.h) */
typedef struct {
  CUfunction f;
  unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
  CUstream hStream;
} cut_launch_params; /* cuLaunchKernel{,_ptsz}, cuLaunchCooperativeKernel{,_ptsz} */
typedef struct { const CUlaunchConfig *config; } cut_launch_ex_params;
typedef struct { CUgraphExec hGraphExec; CUstream hStream; } cut_graph_params;

/* The stream a launch call goes to; returns 0 for calls a cut does not land on (legacy and multi-device). */
static int launch_stream(uint32_t cbid, const void *params, CUstream *stream, const char **api) {
  if (!params) return 0;
  switch (cbid) {
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel:
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel_ptsz:
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel:
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel_ptsz:
      *stream = ((const cut_launch_params *)params)->hStream;
      *api = "cuLaunchKernel";
      return 1;
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx:
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx_ptsz: {
      const CUlaunchConfig *c = ((const cut_launch_ex_params *)params)->config;
      if (!c) return 0;
      *stream = c->hStream;
      *api = "cuLaunchKernelEx";
      return 1;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch:
    case CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch_ptsz:
      *stream = ((const cut_graph_params *)params)->hStream;
      *api = "cuGraphLaunch";
      return 1;
    default:
      return 0;
  }
}

static void CUDA_CB landed(void *arg) {
  pthread_mutex_lock(&cmu);
  landed_generation = (uint64_t)(uintptr_t)arg;
  if (landed_generation == cut_generation && cut_state == CUT_ENQUEUED) {
    cut_state = CUT_LANDED;
    pthread_cond_broadcast(&ccv);
  }
  pthread_mutex_unlock(&cmu);
}

/* Called by the interposer at the API-enter site of every launch call (and graph launch). */
void cft_cut_on_launch(uint32_t cbid, const void *params, const char *kernel) {
  if (tl_in_cut) return;
  CUstream stream = NULL;
  const char *api = NULL;
  int cuttable = launch_stream(cbid, params, &stream, &api);
  const char *name = kernel ? kernel : (api && strcmp(api, "cuGraphLaunch") == 0 ? "<graph>" : "<unnamed>");
  pthread_mutex_lock(&cmu);
  launch_seq++;
  int take = cut_state == CUT_ARMED && cuttable && launch_seq >= cut_at && !(cut_filter == 1 && sp_has(kernel));
  if (!take) {
    snprintf(kernel_last, sizeof kernel_last, "%s", name);
    pthread_mutex_unlock(&cmu);
    return;
  }
  cut_state = CUT_TAKEN; /* no other launch takes it; the driver calls run without the lock */
  cut_seq = launch_seq;
  cut_stream = (uintptr_t)stream;
  snprintf(kernel_before, sizeof kernel_before, "%s", kernel_last);
  snprintf(kernel_after, sizeof kernel_after, "%s", name);
  snprintf(kernel_last, sizeof kernel_last, "%s", name);
  snprintf(cut_api, sizeof cut_api, "%s", api);
  const cft_cut_copy *copies = cut_copies;
  size_t n = cut_n;
  uint64_t gen = cut_generation;
  memcpy_dtoh_async_fn cp = p_memcpy;
  launch_host_func_fn hf = p_hostfn;
  pthread_mutex_unlock(&cmu);
  tl_in_cut = 1; /* a callback for the calls below (trace mode) must not take a cut */
  CUresult r = CUDA_SUCCESS;
  for (size_t i = 0; i < n && r == CUDA_SUCCESS; i++)
    r = cp((void *)(uintptr_t)copies[i].dst, (CUdeviceptr)copies[i].src, (size_t)copies[i].bytes, stream);
  if (r == CUDA_SUCCESS) r = hf(stream, landed, (void *)(uintptr_t)gen);
  tl_in_cut = 0;
  pthread_mutex_lock(&cmu);
  cut_error = (int)r;
  cut_state = r != CUDA_SUCCESS ? CUT_FAILED : landed_generation == gen ? CUT_LANDED : CUT_ENQUEUED;
  pthread_cond_broadcast(&ccv);
  pthread_mutex_unlock(&cmu);
}

/* Use these two functions instead of the driver's (the CPU tests); NULL restores the driver lookup. */
void cft_cut_set_driver(void *memcpy_dtoh_async, void *launch_host_func) {
  pthread_mutex_lock(&cmu);
  p_memcpy = (memcpy_dtoh_async_fn)memcpy_dtoh_async;
  p_hostfn = (launch_host_func_fn)launch_host_func;
  pthread_mutex_unlock(&cmu);
}

static int resolve_driver(void) { /* under cmu */
  if (p_memcpy && p_hostfn) return 1;
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (!h) h = dlopen("libcuda.so.1", RTLD_NOW);
  if (!h) return 0;
  p_memcpy = (memcpy_dtoh_async_fn)dlsym(h, "cuMemcpyDtoHAsync_v2");
  p_hostfn = (launch_host_func_fn)dlsym(h, "cuLaunchHostFunc");
  return p_memcpy && p_hostfn;
}

/* Arm a cut: n copies; filter 0 = the next launch of any kernel (or graph), 1 = the next launch of a kernel
   without safe points; at_seq > 0: not before the launch numbered at_seq (launch numbers count every launch
   call the interposer saw, 1-based: cft_cut_info's launch_seq is the last one), so a cut requested ahead lands
   at a definite launch whatever the requesting thread's timing. Returns 1, 0 if a cut is already armed or in
   flight, -1 if the driver's functions are not there, -2 out of memory, -3 if launch at_seq was issued
   already (the cut cannot land there). */
int cft_cut_arm_at(const cft_cut_copy *copies, uint64_t n, int filter, uint64_t at_seq) {
  pthread_mutex_lock(&cmu);
  if (cut_state == CUT_ARMED || cut_state == CUT_TAKEN || cut_state == CUT_ENQUEUED) {
    pthread_mutex_unlock(&cmu);
    return 0;
  }
  if (at_seq && at_seq <= launch_seq) {
    pthread_mutex_unlock(&cmu);
    return -3;
  }
  if (!resolve_driver()) {
    pthread_mutex_unlock(&cmu);
    return -1;
  }
  cft_cut_copy *c = n ? malloc(n * sizeof *c) : NULL;
  if (n && !c) {
    pthread_mutex_unlock(&cmu);
    return -2;
  }
  if (n) memcpy(c, copies, n * sizeof *c);
  free(cut_copies);
  cut_copies = c;
  cut_n = n;
  cut_filter = filter;
  cut_at = at_seq;
  cut_generation++;
  cut_error = 0;
  cut_seq = 0;
  kernel_after[0] = cut_api[0] = 0;
  cut_state = CUT_ARMED;
  pthread_mutex_unlock(&cmu);
  return 1;
}

int cft_cut_arm(const cft_cut_copy *copies, uint64_t n, int filter) { return cft_cut_arm_at(copies, n, filter, 0); }

/* Withdraw an armed cut that no launch took yet; returns 1 if withdrawn, 0 if it was not armed. */
int cft_cut_cancel(void) {
  pthread_mutex_lock(&cmu);
  int was = cut_state == CUT_ARMED;
  if (was) cut_state = CUT_IDLE;
  pthread_mutex_unlock(&cmu);
  return was;
}

/* Wait up to timeout_ms for the armed cut to land; returns its state (CUT_*). */
int cft_cut_wait(int64_t timeout_ms) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_sec += timeout_ms / 1000;
  ts.tv_nsec += (timeout_ms % 1000) * 1000000;
  if (ts.tv_nsec >= 1000000000) ts.tv_sec++, ts.tv_nsec -= 1000000000;
  pthread_mutex_lock(&cmu);
  while (cut_state == CUT_ARMED || cut_state == CUT_TAKEN || cut_state == CUT_ENQUEUED) {
    if (pthread_cond_timedwait(&ccv, &cmu, &ts) == ETIMEDOUT) break;
  }
  int s = cut_state;
  pthread_mutex_unlock(&cmu);
  return s;
}

/* The last cut as JSON: state, the launch number it landed at, the kernels on either side. */
size_t cft_cut_info(char *buf, size_t cap) {
  pthread_mutex_lock(&cmu);
  int n = snprintf(buf, cap,
                   "{\"state\":%d,\"error\":%d,\"launch_seq\":%llu,\"cut_seq\":%llu,\"api\":\"%s\","
                   "\"stream\":%llu,\"kernels_with_safepoints\":%llu}",
                   cut_state, cut_error, (unsigned long long)launch_seq, (unsigned long long)cut_seq, cut_api,
                   (unsigned long long)cut_stream, (unsigned long long)sp_used);
  pthread_mutex_unlock(&cmu);
  return (size_t)n + 1;
}

/* The kernels on either side of the last cut: side 0 the last launch before it, 1 the launch that crossed it;
   copied into buf (NUL-terminated). */
void cft_cut_kernel(int side, char *buf, size_t cap) {
  pthread_mutex_lock(&cmu);
  snprintf(buf, cap, "%s", side ? kernel_after : kernel_before);
  pthread_mutex_unlock(&cmu);
}
