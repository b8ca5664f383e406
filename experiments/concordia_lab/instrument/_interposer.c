/* Concordia-FT interposer: observes every module load and kernel launch of an unmodified CUDA process.
 *
 * Loaded by the driver itself: CUDA_INJECTION64_PATH=<this .so> makes cuInit dlopen it and call
 * InitializeInjection(), before any module of the process is loaded. It subscribes to CUPTI callbacks, which
 * run inside the driver, so they see what a public-symbol LD_PRELOAD cannot: kernels cudart loads through its
 * private export table (PyTorch's own), launches through pointers from cuGetProcAddress (cudart, Triton,
 * ATen's LazyNVRTC), cuBLAS's bundled kernels, and cuLibrary* loads (DESIGN.md beside this file).
 *
 * Records, under one mutex: every loader call and what it was handed (cubin, PTX text, fatbin with or
 * without PTX); every loaded module (CUPTI module id, size, the loader call it was created in, or none when
 * the driver loaded it lazily at first use, and its kernels read from the cubin's ELF symbol table); every
 * launch by kernel name. Python reads them with cft_snapshot() (JSON) through
 * ctypes: the same .so the driver loaded is the one ctypes opens.
 *
 * Built with only a C compiler and headers of pip wheels the bootstrap installs: cuda.h (nvidia-cuda-runtime)
 * and the callback-id enum of nvidia-cuda-cupti (cupti_driver_cbid.h). cupti.h and generated_cuda_meta.h
 * need the toolkit's crt/ headers, so the few CUPTI callback types and loader parameter structs used here are
 * declared below (their layout is CUPTI's public ABI). libcupti is dlopen'ed at start
 * (CONCORDIA_CUPTI_LIB, else libcupti.so.13).
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <cupti_driver_cbid.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sched.h>

/* ---- the CUPTI callback API, as declared by cupti_callbacks.h / cupti_result.h (CUDA 12-13) */
typedef int CUptiResult;
#define CUPTI_SUCCESS 0
#define CUPTIAPI
typedef uint32_t CUpti_CallbackId;
typedef enum { CUPTI_CB_DOMAIN_DRIVER_API = 1, CUPTI_CB_DOMAIN_RESOURCE = 3 } CUpti_CallbackDomain;
typedef enum { CUPTI_API_ENTER = 0, CUPTI_API_EXIT = 1 } CUpti_ApiCallbackSite;
#define CUPTI_CBID_RESOURCE_MODULE_LOADED 6
typedef struct {
  CUpti_ApiCallbackSite callbackSite;
  const char *functionName;
  const void *functionParams;
  void *functionReturnValue;
  const char *symbolName;
  CUcontext context;
  uint32_t contextUid;
  uint64_t *correlationData;
  uint32_t correlationId;
} CUpti_CallbackData;
typedef struct {
  CUcontext context;
  union { CUstream stream; } resourceHandle;
  void *resourceDescriptor;
} CUpti_ResourceData;
typedef struct {
  uint32_t moduleId;
  size_t cubinSize;
  const char *pCubin;
} CUpti_ModuleResourceData;
typedef struct CUpti_Subscriber_st *CUpti_SubscriberHandle;
typedef void (*CUpti_CallbackFunc)(void *, CUpti_CallbackDomain, CUpti_CallbackId, const void *);
typedef struct {
  size_t structSize;
  const char *subscriberName;
  char *oldSubscriberName;
  size_t oldSubscriberSize;
  uint8_t allowMultipleSubscribers;
  uint8_t padding[7];
} CUpti_SubscriberParams;

/* loader parameters, as in generated_cuda_meta.h: the leading fields are all that is read */
typedef struct { CUmodule *module; const void *image; } cuModuleLoadData_params;
typedef struct { CUmodule *module; const void *image; } cuModuleLoadDataEx_params;
typedef struct { CUmodule *module; const void *fatCubin; } cuModuleLoadFatBinary_params;
typedef struct { CUlibrary *library; const void *code; } cuLibraryLoadData_params;

typedef CUptiResult (*subscribe_v2_fn)(CUpti_SubscriberHandle *, CUpti_CallbackFunc, void *, CUpti_SubscriberParams *);
typedef CUptiResult (*subscribe_fn)(CUpti_SubscriberHandle *, CUpti_CallbackFunc, void *);
typedef CUptiResult (*enable_cb_fn)(uint32_t, CUpti_SubscriberHandle, CUpti_CallbackDomain, CUpti_CallbackId);
typedef CUptiResult (*enable_domain_fn)(uint32_t, CUpti_SubscriberHandle, CUpti_CallbackDomain);

enum { IMG_UNKNOWN = 0, IMG_CUBIN = 1, IMG_PTX = 2, IMG_FATBIN = 3, IMG_FILE = 4 };
static const char *IMG_NAMES[] = {"unknown", "cubin", "ptx", "fatbin", "file"};

typedef struct {
  uint32_t id;
  uint64_t bytes;
  int api;        /* index into LOAD_APIS; -1: loaded outside any loader call (lazy loading at first use) */
  int image;      /* IMG_* of the image handed to the loader */
  int has_ptx;    /* that image held PTX */
  int has_sass;
  uint32_t first_kernel, nkernels; /* into the kernel-name list */
} module_rec;

typedef struct {
  char *name;
  uint64_t count;
} launch_rec;

static const struct { CUpti_CallbackId cbid; const char *name; } LOAD_APIS[] = {
    {CUPTI_DRIVER_TRACE_CBID_cuModuleLoad, "cuModuleLoad"},
    {CUPTI_DRIVER_TRACE_CBID_cuModuleLoadData, "cuModuleLoadData"},
    {CUPTI_DRIVER_TRACE_CBID_cuModuleLoadDataEx, "cuModuleLoadDataEx"},
    {CUPTI_DRIVER_TRACE_CBID_cuModuleLoadFatBinary, "cuModuleLoadFatBinary"},
    {CUPTI_DRIVER_TRACE_CBID_cuLibraryLoadData, "cuLibraryLoadData"},
    {CUPTI_DRIVER_TRACE_CBID_cuLibraryLoadFromFile, "cuLibraryLoadFromFile"},
};
#define N_LOAD_APIS (sizeof(LOAD_APIS) / sizeof(LOAD_APIS[0]))

static const CUpti_CallbackId LAUNCH_APIS[] = {
    CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel,
    CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx,
    CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel,
    CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernelMultiDevice,
    CUPTI_DRIVER_TRACE_CBID_cuLaunch,
    CUPTI_DRIVER_TRACE_CBID_cuLaunchGrid,
    CUPTI_DRIVER_TRACE_CBID_cuLaunchGridAsync,
};
#define N_LAUNCH_APIS (sizeof(LAUNCH_APIS) / sizeof(LAUNCH_APIS[0]))

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int started = 0, multi = 0;
static const char *start_error = "not started";
static char error_buf[256];
static CUpti_SubscriberHandle subscriber;
static module_rec *modules;
static size_t n_modules, cap_modules;
static char **kernel_names;
static size_t n_kernel_names, cap_kernel_names;
static launch_rec *table; /* open addressing, power-of-two capacity */
static size_t table_cap, table_used;
static uint64_t launch_total, graph_launches, load_calls[N_LOAD_APIS];
static uint64_t load_images[N_LOAD_APIS][5], load_with_ptx[N_LOAD_APIS]; /* what each loader was handed */

static __thread int tl_api = -1, tl_image = IMG_UNKNOWN, tl_ptx = 0, tl_sass = 0;

/* _launchcut.c (compiled into the same library): epoch cuts between launches */
void cft_cut_on_launch(uint32_t cbid, const void *params, const char *kernel);
int cft_cut_on_module(const void *image, uint64_t size);

/* ---------------------------------------------------------------- the hazard guard
 * While a resident executor block runs, the driver blocks module loads (lazy loads at a kernel's first launch
 * included), device-wide synchronize and frees behind it. The guard steps every registered executor aside
 * before such a call and lets it run again after, from inside the driver's callbacks, so no list of framework
 * functions is needed. Stepping aside is driver-free: store the ring's stop word (host-mapped memory the block
 * polls) and spin until its state word says the block left (EXITED_*): the block exits at its next task
 * boundary. At the end of the last open hazard the stop words are cleared; the executor relaunches itself on
 * its next submit (it sees state != RUNNING). Nothing here calls CUDA, so it is safe inside a callback. */
#define CFT_MAX_TARGETS 64
#define RING_STATE_NOT_STARTED 0u
#define RING_STATE_RUNNING 1u

typedef struct {
  volatile uint32_t *stop;   /* host addresses of the ring's stop and state words */
  volatile uint32_t *state;
  int used;
  int hold; /* the executor's own stop request (suspend, warm-up): the guard never clears it */
} guard_target;

static pthread_mutex_t gmu = PTHREAD_MUTEX_INITIALIZER;
static guard_target targets[CFT_MAX_TARGETS];
static int guard_depth; /* open hazard calls, all threads */
static uint64_t g_hazards, g_stepped_aside, g_first_launches, g_timeouts, g_unguarded_loads, g_wait_ns_max;
static uint64_t g_wait_ns_total, g_enable_failed;
static uint64_t g_timeout_ns = 10ull * 1000 * 1000 * 1000;
static __thread int tl_hazard = 0;        /* hazard calls open in this thread */
static __thread int tl_launch_hazard = 0; /* this thread's current launch is a first launch */
static __thread const char *tl_api_name = NULL; /* the driver call in progress (trace mode: every call) */
static int trace_all = 0;
/* trace mode: every driver call counted by callback id, with the name CUPTI gave it (a static string), so a
   run says which entry a framework call really reached (cudaDeviceSynchronize under CUDA 13, for one) */
#define CFT_TRACE_IDS 2048
static uint64_t trace_counts[CFT_TRACE_IDS];
static const char *trace_names[CFT_TRACE_IDS];
#define MAX_UNGUARDED 32
static char *unguarded_where[MAX_UNGUARDED]; /* the driver call in which an unguarded module load happened */
static uint32_t unguarded_module[MAX_UNGUARDED];

/* CUPTI_DRIVER_TRACE_CBID_cuCtxSynchronize_v2 (CUDA 13.0 headers), by number so that a wheel whose header
   predates it still builds (the CPU test checks the number against the header it finds) */
#define CFT_CBID_cuCtxSynchronize_v2 ((CUpti_CallbackId)800)

/* hazard callbacks: entering one steps every executor aside until it returns */
static const struct { CUpti_CallbackId cbid; const char *name; } HAZARD_APIS[] = {
    {CUPTI_DRIVER_TRACE_CBID_cuCtxSynchronize, "cuCtxSynchronize"},
    /* CUDA 13: cudart asks cuGetProcAddress for "cuCtxSynchronize" at version 13000 and gets this entry
       (PFN_cuCtxSynchronize_v13000 takes the context): cudaDeviceSynchronize / torch.cuda.synchronize */
    {CFT_CBID_cuCtxSynchronize_v2, "cuCtxSynchronize_v2"},
    {CUPTI_DRIVER_TRACE_CBID_cuMemFree_v2, "cuMemFree"},
    {CUPTI_DRIVER_TRACE_CBID_cuMemFreeHost, "cuMemFreeHost"},
    {CUPTI_DRIVER_TRACE_CBID_cuMemHostUnregister, "cuMemHostUnregister"},
    {CUPTI_DRIVER_TRACE_CBID_cuModuleUnload, "cuModuleUnload"},
    {CUPTI_DRIVER_TRACE_CBID_cuLibraryUnload, "cuLibraryUnload"},
    {CUPTI_DRIVER_TRACE_CBID_cuModuleGetFunction, "cuModuleGetFunction"},
    {CUPTI_DRIVER_TRACE_CBID_cuModuleGetGlobal_v2, "cuModuleGetGlobal"},
    {CUPTI_DRIVER_TRACE_CBID_cuLibraryGetKernel, "cuLibraryGetKernel"},
    {CUPTI_DRIVER_TRACE_CBID_cuLibraryGetModule, "cuLibraryGetModule"},
    {CUPTI_DRIVER_TRACE_CBID_cuLibraryGetGlobal, "cuLibraryGetGlobal"},
    {CUPTI_DRIVER_TRACE_CBID_cuKernelGetFunction, "cuKernelGetFunction"},
    {CUPTI_DRIVER_TRACE_CBID_cuKernelGetAttribute, "cuKernelGetAttribute"},
    {CUPTI_DRIVER_TRACE_CBID_cuKernelSetAttribute, "cuKernelSetAttribute"},
    {CUPTI_DRIVER_TRACE_CBID_cuFuncGetAttribute, "cuFuncGetAttribute"},
    {CUPTI_DRIVER_TRACE_CBID_cuFuncSetAttribute, "cuFuncSetAttribute"},
    {CUPTI_DRIVER_TRACE_CBID_cuFuncLoad, "cuFuncLoad"},
    {CUPTI_DRIVER_TRACE_CBID_cuGraphInstantiate, "cuGraphInstantiate"},
    {CUPTI_DRIVER_TRACE_CBID_cuGraphInstantiate_v2, "cuGraphInstantiate_v2"},
    {CUPTI_DRIVER_TRACE_CBID_cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags"},
    {CUPTI_DRIVER_TRACE_CBID_cuGraphInstantiateWithParams, "cuGraphInstantiateWithParams"},
    {CUPTI_DRIVER_TRACE_CBID_cuGraphInstantiateWithParams_ptsz, "cuGraphInstantiateWithParams_ptsz"},
    {CUPTI_DRIVER_TRACE_CBID_cuGraphUpload, "cuGraphUpload"},
};
#define N_HAZARD_APIS (sizeof(HAZARD_APIS) / sizeof(HAZARD_APIS[0]))
static uint64_t hazard_calls[N_HAZARD_APIS];

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int block_may_run(const guard_target *t) {
  uint32_t s = __atomic_load_n(t->state, __ATOMIC_ACQUIRE);
  return s == RING_STATE_NOT_STARTED || s == RING_STATE_RUNNING;
}

/* Register a ring (host addresses of its stop and state words); returns a handle >= 0, or -1 when full. A ring
   registered inside an open hazard is told to stop at once, like the others. */
int cft_guard_add(uint64_t stop_addr, uint64_t state_addr) {
  pthread_mutex_lock(&gmu);
  int id = -1;
  for (int i = 0; i < CFT_MAX_TARGETS; i++) {
    if (!targets[i].used) {
      targets[i].stop = (volatile uint32_t *)(uintptr_t)stop_addr;
      targets[i].state = (volatile uint32_t *)(uintptr_t)state_addr;
      targets[i].used = 1;
      targets[i].hold = __atomic_load_n(targets[i].stop, __ATOMIC_ACQUIRE) != 0;
      if (guard_depth) __atomic_store_n(targets[i].stop, 1u, __ATOMIC_RELEASE);
      id = i;
      break;
    }
  }
  pthread_mutex_unlock(&gmu);
  return id;
}

void cft_guard_remove(int id) {
  if (id < 0 || id >= CFT_MAX_TARGETS) return;
  pthread_mutex_lock(&gmu);
  targets[id].used = 0;
  pthread_mutex_unlock(&gmu);
}

/* The executor's own stop request for a registered ring: the stop word is (hold or a hazard is open). */
void cft_guard_hold(int id, int on) {
  if (id < 0 || id >= CFT_MAX_TARGETS) return;
  pthread_mutex_lock(&gmu);
  if (targets[id].used) {
    targets[id].hold = on != 0;
    __atomic_store_n(targets[id].stop, (on || guard_depth) ? 1u : 0u, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&gmu);
}

int cft_guard_depth(void) { return __atomic_load_n(&guard_depth, __ATOMIC_ACQUIRE); }

void cft_guard_set_timeout_ns(uint64_t ns) { g_timeout_ns = ns; }

/* Step every registered executor aside: tell it to stop, wait until its block has left (or the timeout). */
void cft_guard_enter(void) {
  guard_target snap[CFT_MAX_TARGETS];
  int n = 0;
  tl_hazard++;
  pthread_mutex_lock(&gmu);
  guard_depth++;
  g_hazards++;
  for (int i = 0; i < CFT_MAX_TARGETS; i++) {
    if (!targets[i].used) continue;
    __atomic_store_n(targets[i].stop, 1u, __ATOMIC_RELEASE);
    snap[n++] = targets[i];
  }
  pthread_mutex_unlock(&gmu);
  uint64_t t0 = 0, waited = 0;
  int stepped = 0;
  for (int i = 0; i < n; i++) {
    if (!block_may_run(&snap[i])) continue;
    if (!t0) t0 = now_ns();
    stepped = 1;
    unsigned spins = 0;
    while (block_may_run(&snap[i])) {
      if (++spins % 64 == 0) {
        if (now_ns() - t0 > g_timeout_ns) {
          pthread_mutex_lock(&gmu);
          g_timeouts++;
          pthread_mutex_unlock(&gmu);
          break;
        }
        sched_yield();
      }
    }
  }
  if (t0) waited = now_ns() - t0;
  pthread_mutex_lock(&gmu);
  g_stepped_aside += (uint64_t)stepped;
  g_wait_ns_total += waited;
  if (waited > g_wait_ns_max) g_wait_ns_max = waited;
  pthread_mutex_unlock(&gmu);
}

/* The hazard call returned: when it was the last one open, the executors may run again (they relaunch on
   their next submit). */
void cft_guard_leave(void) {
  if (tl_hazard > 0) tl_hazard--;
  pthread_mutex_lock(&gmu);
  if (guard_depth > 0 && --guard_depth == 0) {
    for (int i = 0; i < CFT_MAX_TARGETS; i++)
      if (targets[i].used) __atomic_store_n(targets[i].stop, targets[i].hold ? 1u : 0u, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&gmu);
}

/* Kernel handles launched before: a launch of any other handle may load code (lazy loading). Open addressing
   over the CUfunction value; cleared when a module or library is unloaded (a handle value can be reused). */
static uintptr_t *seen_fn;
static size_t seen_cap, seen_used;

static int first_launch(uintptr_t f) { /* under mu */
  if (!f) return 1;
  if (seen_used * 2 >= seen_cap) {
    size_t ncap = seen_cap ? seen_cap * 2 : 1024;
    uintptr_t *nt = calloc(ncap, sizeof(uintptr_t));
    if (!nt) return 1;
    for (size_t i = 0; i < seen_cap; i++) {
      if (!seen_fn[i]) continue;
      size_t j = (seen_fn[i] * 0x9E3779B97F4A7C15ull >> 17) & (ncap - 1);
      while (nt[j]) j = (j + 1) & (ncap - 1);
      nt[j] = seen_fn[i];
    }
    free(seen_fn);
    seen_fn = nt;
    seen_cap = ncap;
  }
  size_t j = (f * 0x9E3779B97F4A7C15ull >> 17) & (seen_cap - 1);
  while (seen_fn[j] && seen_fn[j] != f) j = (j + 1) & (seen_cap - 1);
  if (seen_fn[j]) return 0;
  seen_fn[j] = f;
  seen_used++;
  return 1;
}

static void forget_launched(void) { /* under mu */
  if (seen_fn) memset(seen_fn, 0, seen_cap * sizeof(uintptr_t));
  seen_used = 0;
}

/* the kernel handle a launch call was given (its parameter structs, as in generated_cuda_meta.h) */
typedef struct { CUfunction f; } cuLaunchKernel_params_head;
typedef struct { const CUlaunchConfig *config; CUfunction f; } cuLaunchKernelEx_params_head;
typedef struct { CUDA_LAUNCH_PARAMS *launchParamsList; } cuLaunchCooperativeKernelMultiDevice_params_head;

/* ---------------------------------------------------------------- image classification (no driver calls) */
#define FATBIN_MAGIC 0xBA55ED50u
#define FATBIN_WRAPPER_MAGIC 0x466243B1u

static void classify_fatbin(const unsigned char *p, int *ptx, int *sass) {
  /* header: u32 magic, u16 version, u16 header size, u64 payload size; then entries:
     u16 kind (1 PTX, 2 ELF), u16 ?, u32 entry header size, u64 entry payload size, ... */
  uint16_t hsize;
  uint64_t total, off;
  memcpy(&hsize, p + 6, 2);
  memcpy(&total, p + 8, 8);
  if (total > ((uint64_t)1 << 34)) return;
  off = hsize;
  while (off + 16 <= hsize + total) {
    uint16_t kind;
    uint32_t ehsize;
    uint64_t esize;
    memcpy(&kind, p + off, 2);
    memcpy(&ehsize, p + off + 4, 4);
    memcpy(&esize, p + off + 8, 8);
    if (kind == 1) *ptx = 1;
    if (kind == 2) *sass = 1;
    if (ehsize == 0) break;
    off += ehsize + esize;
  }
}

int cft_classify_image(const void *image, int *ptx, int *sass) {
  const unsigned char *p = (const unsigned char *)image;
  uint32_t magic;
  *ptx = *sass = 0;
  if (!p) return IMG_UNKNOWN;
  memcpy(&magic, p, 4);
  if (magic == FATBIN_WRAPPER_MAGIC) { /* __fatBinC_Wrapper_t: {int magic; int version; const void* data; ...} */
    const void *inner;
    memcpy(&inner, p + 8, sizeof inner);
    p = (const unsigned char *)inner;
    if (!p) return IMG_UNKNOWN;
    memcpy(&magic, p, 4);
  }
  if (magic == FATBIN_MAGIC) {
    classify_fatbin(p, ptx, sass);
    return IMG_FATBIN;
  }
  if (p[0] == 0x7f && p[1] == 'E' && p[2] == 'L' && p[3] == 'F') {
    *sass = 1;
    return IMG_CUBIN;
  }
  /* PTX is text: skip blanks and comments, expect a directive */
  for (size_t i = 0; i < 4096 && p[i]; i++) {
    if (p[i] == ' ' || p[i] == '\t' || p[i] == '\n' || p[i] == '\r') continue;
    if (p[i] == '/' && p[i + 1] == '/') {
      while (p[i] && p[i] != '\n') i++;
      continue;
    }
    if (p[i] == '.') {
      *ptx = 1;
      return IMG_PTX;
    }
    break;
  }
  return IMG_UNKNOWN;
}

/* ---------------------------------------------------------------- ELF64: the kernels of a cubin */
typedef struct { unsigned char e_ident[16]; uint16_t e_type, e_machine; uint32_t e_version; uint64_t e_entry,
  e_phoff, e_shoff; uint32_t e_flags; uint16_t e_ehsize, e_phentsize, e_phnum, e_shentsize, e_shnum,
  e_shstrndx; } elf64_ehdr;
typedef struct { uint32_t sh_name, sh_type; uint64_t sh_flags, sh_addr, sh_offset, sh_size; uint32_t sh_link,
  sh_info; uint64_t sh_addralign, sh_entsize; } elf64_shdr;
typedef struct { uint32_t st_name; unsigned char st_info, st_other; uint16_t st_shndx; uint64_t st_value,
  st_size; } elf64_sym;
#define SHT_SYMTAB 2
#define STT_FUNC 2
#define STB_GLOBAL 1

/* Calls emit(name, ctx) for every global function symbol defined in a .text.* section; returns the count,
   or -1 if the bytes are not a well-formed ELF64 image. */
int cft_elf_kernels(const void *image, uint64_t size, void (*emit)(const char *, void *), void *ctx) {
  const unsigned char *p = (const unsigned char *)image;
  const elf64_ehdr *eh = (const elf64_ehdr *)p;
  int n = 0;
  if (size < sizeof(elf64_ehdr) || memcmp(p, "\x7f" "ELF", 4) != 0 || p[4] != 2) return -1;
  if (eh->e_shoff == 0 || eh->e_shentsize != sizeof(elf64_shdr) ||
      eh->e_shoff + (uint64_t)eh->e_shnum * sizeof(elf64_shdr) > size || eh->e_shstrndx >= eh->e_shnum)
    return -1;
  const elf64_shdr *sh = (const elf64_shdr *)(p + eh->e_shoff);
  const char *shstr = (const char *)p + sh[eh->e_shstrndx].sh_offset;
  for (uint16_t i = 0; i < eh->e_shnum; i++) {
    if (sh[i].sh_type != SHT_SYMTAB || sh[i].sh_entsize != sizeof(elf64_sym) || sh[i].sh_link >= eh->e_shnum)
      continue;
    if (sh[i].sh_offset + sh[i].sh_size > size) return -1;
    const elf64_sym *sym = (const elf64_sym *)(p + sh[i].sh_offset);
    const char *str = (const char *)p + sh[sh[i].sh_link].sh_offset;
    uint64_t count = sh[i].sh_size / sizeof(elf64_sym);
    for (uint64_t k = 0; k < count; k++) {
      unsigned type = sym[k].st_info & 0xf, bind = sym[k].st_info >> 4;
      if (type != STT_FUNC || bind != STB_GLOBAL || sym[k].st_shndx == 0 || sym[k].st_shndx >= eh->e_shnum)
        continue;
      if (strncmp(shstr + sh[sym[k].st_shndx].sh_name, ".text.", 6) != 0) continue;
      if (emit) emit(str + sym[k].st_name, ctx);
      n++;
    }
  }
  return n;
}

/* ---------------------------------------------------------------- records */
static void *grow(void *p, size_t *cap, size_t need, size_t elem) {
  if (need <= *cap) return p;
  size_t c = *cap ? *cap * 2 : 64;
  while (c < need) c *= 2;
  void *q = realloc(p, c * elem);
  if (!q) return NULL;
  *cap = c;
  return q;
}

static void add_kernel_name(const char *name, void *ctx) {
  (void)ctx;
  char **k = grow(kernel_names, &cap_kernel_names, n_kernel_names + 1, sizeof(char *));
  if (!k) return;
  kernel_names = k;
  kernel_names[n_kernel_names++] = strdup(name);
}

static uint64_t hash_name(const char *s) {
  uint64_t h = 1469598103934665603ull;
  while (*s) h = (h ^ (unsigned char)*s++) * 1099511628211ull;
  return h;
}

static void count_launch(const char *name) {
  if (!name) name = "<unnamed>";
  if (table_used * 2 >= table_cap) {
    size_t ncap = table_cap ? table_cap * 2 : 1024;
    launch_rec *nt = calloc(ncap, sizeof(launch_rec));
    if (!nt) return;
    for (size_t i = 0; i < table_cap; i++) {
      if (!table[i].name) continue;
      size_t j = hash_name(table[i].name) & (ncap - 1);
      while (nt[j].name) j = (j + 1) & (ncap - 1);
      nt[j] = table[i];
    }
    free(table);
    table = nt;
    table_cap = ncap;
  }
  size_t j = hash_name(name) & (table_cap - 1);
  while (table[j].name && strcmp(table[j].name, name) != 0) j = (j + 1) & (table_cap - 1);
  if (!table[j].name) {
    table[j].name = strdup(name);
    table_used++;
  }
  table[j].count++;
  launch_total++;
}

static void on_module_loaded(const CUpti_ModuleResourceData *m) {
  module_rec *mods = grow(modules, &cap_modules, n_modules + 1, sizeof(module_rec));
  if (!mods) return;
  modules = mods;
  module_rec *r = &modules[n_modules++];
  r->id = m->moduleId;
  r->bytes = m->cubinSize;
  r->api = tl_api;
  r->image = tl_api >= 0 ? tl_image : IMG_UNKNOWN;
  r->has_ptx = tl_api >= 0 ? tl_ptx : 0;
  r->has_sass = 1;
  r->first_kernel = (uint32_t)n_kernel_names;
  int n = m->pCubin ? cft_elf_kernels(m->pCubin, m->cubinSize, add_kernel_name, NULL) : -1;
  r->nkernels = n > 0 ? (uint32_t)n : 0;
  if (m->pCubin) cft_cut_on_module(m->pCubin, m->cubinSize);
  if (!tl_hazard && tl_api < 0) { /* loaded outside every call the guard steps aside for */
    pthread_mutex_lock(&gmu);
    int armed = 0;
    for (int i = 0; i < CFT_MAX_TARGETS; i++) armed |= targets[i].used;
    if (!armed) { /* no executor registered: nothing could have been resident */
      pthread_mutex_unlock(&gmu);
      return;
    }
    if (g_unguarded_loads < MAX_UNGUARDED) {
      unguarded_where[g_unguarded_loads] = strdup(tl_api_name ? tl_api_name : "?");
      unguarded_module[g_unguarded_loads] = m->moduleId;
    }
    g_unguarded_loads++;
    pthread_mutex_unlock(&gmu);
  }
}

void cft_callback(void *userdata, CUpti_CallbackDomain domain, CUpti_CallbackId cbid,
                              const void *data) {
  (void)userdata;
  if (domain == CUPTI_CB_DOMAIN_RESOURCE) {
    const CUpti_ResourceData *rd = (const CUpti_ResourceData *)data;
    if (cbid == CUPTI_CBID_RESOURCE_MODULE_LOADED) {
      pthread_mutex_lock(&mu);
      on_module_loaded((const CUpti_ModuleResourceData *)rd->resourceDescriptor);
      pthread_mutex_unlock(&mu);
    }
    return;
  }
  if (domain != CUPTI_CB_DOMAIN_DRIVER_API) return;
  const CUpti_CallbackData *cb = (const CUpti_CallbackData *)data;
  if (trace_all) {
    tl_api_name = cb->callbackSite == CUPTI_API_ENTER ? cb->functionName : NULL;
    if (cb->callbackSite == CUPTI_API_ENTER && cbid < CFT_TRACE_IDS) {
      if (!__atomic_load_n(&trace_names[cbid], __ATOMIC_RELAXED))
        __atomic_store_n(&trace_names[cbid], cb->functionName ? cb->functionName : "?", __ATOMIC_RELAXED);
      __atomic_fetch_add(&trace_counts[cbid], 1, __ATOMIC_RELAXED);
    }
  }
  for (size_t i = 0; i < N_HAZARD_APIS; i++) {
    if (HAZARD_APIS[i].cbid != cbid) continue;
    if (cb->callbackSite == CUPTI_API_ENTER) {
      pthread_mutex_lock(&gmu);
      hazard_calls[i]++;
      pthread_mutex_unlock(&gmu);
      cft_guard_enter();
    } else {
      cft_guard_leave();
      if (cbid == CUPTI_DRIVER_TRACE_CBID_cuModuleUnload || cbid == CUPTI_DRIVER_TRACE_CBID_cuLibraryUnload) {
        pthread_mutex_lock(&mu);
        forget_launched();
        pthread_mutex_unlock(&mu);
      }
    }
    return;
  }
  for (size_t i = 0; i < N_LOAD_APIS; i++) {
    if (LOAD_APIS[i].cbid != cbid) continue;
    if (cb->callbackSite == CUPTI_API_ENTER) {
      cft_guard_enter(); /* a load blocks behind a resident block: step aside first */
      const void *image = NULL;
      int ptx = 0, sass = 0, kind = IMG_FILE;
      switch (cb->functionParams ? cbid : 0) {
        case CUPTI_DRIVER_TRACE_CBID_cuModuleLoadData:
          image = ((const cuModuleLoadData_params *)cb->functionParams)->image; break;
        case CUPTI_DRIVER_TRACE_CBID_cuModuleLoadDataEx:
          image = ((const cuModuleLoadDataEx_params *)cb->functionParams)->image; break;
        case CUPTI_DRIVER_TRACE_CBID_cuModuleLoadFatBinary:
          image = ((const cuModuleLoadFatBinary_params *)cb->functionParams)->fatCubin; break;
        case CUPTI_DRIVER_TRACE_CBID_cuLibraryLoadData:
          image = ((const cuLibraryLoadData_params *)cb->functionParams)->code; break;
        default: break;
      }
      if (image) kind = cft_classify_image(image, &ptx, &sass);
      tl_api = (int)i;
      tl_image = kind;
      tl_ptx = ptx;
      tl_sass = sass;
      pthread_mutex_lock(&mu);
      load_calls[i]++;
      load_images[i][kind]++;
      load_with_ptx[i] += (uint64_t)ptx;
      pthread_mutex_unlock(&mu);
    } else {
      tl_api = -1;
      cft_guard_leave();
    }
    return;
  }
  int is_launch = 0;
  for (size_t i = 0; i < N_LAUNCH_APIS; i++) is_launch |= LAUNCH_APIS[i] == cbid;
  if (!is_launch && cbid != CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch && cbid != CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch_ptsz)
    return; /* trace mode: every other driver call only names itself (above) */
  if (cb->callbackSite != CUPTI_API_ENTER) {
    if (tl_launch_hazard) {
      tl_launch_hazard = 0;
      cft_guard_leave();
    }
    return;
  }
  cft_cut_on_launch(cbid, cb->functionParams, cb->symbolName);
  if (cbid == CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch || cbid == CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch_ptsz) {
    pthread_mutex_lock(&mu);
    graph_launches++;
    pthread_mutex_unlock(&mu);
    return;
  }
  uintptr_t f = 0;
  const void *prm = cb->functionParams;
  if (prm) {
    if (cbid == CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx || cbid == CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx_ptsz)
      f = (uintptr_t)((const cuLaunchKernelEx_params_head *)prm)->f;
    else if (cbid == CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernelMultiDevice)
      f = 0; /* a list of launches: treat as a first launch */
    else
      f = (uintptr_t)((const cuLaunchKernel_params_head *)prm)->f;
  }
  pthread_mutex_lock(&mu);
  count_launch(cb->symbolName);
  int first = first_launch(f);
  pthread_mutex_unlock(&mu);
  if (first) { /* lazy loading loads the kernel's code inside this call */
    pthread_mutex_lock(&gmu);
    g_first_launches++;
    pthread_mutex_unlock(&gmu);
    tl_launch_hazard = 1;
    cft_guard_enter();
  }
}

/* Subscribe (idempotent). Returns 1 on success, 0 with cft_error() set otherwise. */
int cft_start(void) {
  pthread_mutex_lock(&mu);
  if (started) {
    pthread_mutex_unlock(&mu);
    return 1;
  }
  const char *lib = getenv("CONCORDIA_CUPTI_LIB");
  void *h = dlopen(lib && *lib ? lib : "libcupti.so.13", RTLD_NOW | RTLD_GLOBAL);
  if (!h) h = dlopen("libcupti.so", RTLD_NOW | RTLD_GLOBAL);
  subscribe_fn sub = h ? (subscribe_fn)dlsym(h, "cuptiSubscribe") : NULL;
  enable_cb_fn en = h ? (enable_cb_fn)dlsym(h, "cuptiEnableCallback") : NULL;
  enable_domain_fn endom = h ? (enable_domain_fn)dlsym(h, "cuptiEnableDomain") : NULL;
  if (!sub || !en || !endom) {
    start_error = "libcupti not found: set CONCORDIA_CUPTI_LIB to libcupti.so.13 (nvidia-cuda-cupti wheel)";
    pthread_mutex_unlock(&mu);
    return 0;
  }
  /* CUPTI 13 lets callback subscribers share the process (a profiler beside us): ask for that when offered */
  subscribe_v2_fn sub2 = (subscribe_v2_fn)dlsym(h, "cuptiSubscribe_v2");
  CUptiResult r;
  if (sub2) {
    CUpti_SubscriberParams prm;
    memset(&prm, 0, sizeof prm);
    prm.structSize = sizeof prm;
    prm.subscriberName = "concordia-ft";
    prm.allowMultipleSubscribers = 1;
    r = sub2(&subscriber, (CUpti_CallbackFunc)cft_callback, NULL, &prm);
    multi = r == CUPTI_SUCCESS;
    if (r != CUPTI_SUCCESS) r = sub(&subscriber, (CUpti_CallbackFunc)cft_callback, NULL);
  } else {
    r = sub(&subscriber, (CUpti_CallbackFunc)cft_callback, NULL);
  }
  if (r != CUPTI_SUCCESS) {
    snprintf(error_buf, sizeof error_buf, "cuptiSubscribe returned CUPTI error %d (no CUDA driver here, or "
             "another CUPTI subscriber such as a profiler holds the callback API)", (int)r);
    start_error = error_buf;
    pthread_mutex_unlock(&mu);
    return 0;
  }
  int ok = en(1, subscriber, CUPTI_CB_DOMAIN_RESOURCE, CUPTI_CBID_RESOURCE_MODULE_LOADED) == CUPTI_SUCCESS;
  for (size_t i = 0; i < N_LOAD_APIS; i++) ok &= en(1, subscriber, CUPTI_CB_DOMAIN_DRIVER_API, LOAD_APIS[i].cbid) == CUPTI_SUCCESS;
  for (size_t i = 0; i < N_LAUNCH_APIS; i++) ok &= en(1, subscriber, CUPTI_CB_DOMAIN_DRIVER_API, LAUNCH_APIS[i]) == CUPTI_SUCCESS;
  ok &= en(1, subscriber, CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch) == CUPTI_SUCCESS;
  ok &= en(1, subscriber, CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch_ptsz) == CUPTI_SUCCESS;
  /* a hazard callback this CUPTI does not offer costs coverage, not the observer: counted, never fatal */
  for (size_t i = 0; i < N_HAZARD_APIS; i++)
    g_enable_failed += en(1, subscriber, CUPTI_CB_DOMAIN_DRIVER_API, HAZARD_APIS[i].cbid) != CUPTI_SUCCESS;
  /* CONCORDIA_GUARD_TRACE=1: every driver call names itself, so an unguarded module load says where it was */
  const char *tr = getenv("CONCORDIA_GUARD_TRACE");
  if (tr && *tr == '1') {
    trace_all = 1;
    ok &= endom(1, subscriber, CUPTI_CB_DOMAIN_DRIVER_API) == CUPTI_SUCCESS;
  }
  const char *to = getenv("CONCORDIA_GUARD_TIMEOUT_MS");
  if (to && *to) g_timeout_ns = (uint64_t)strtoull(to, NULL, 10) * 1000000ull;
  started = ok;
  start_error = ok ? "" : "cuptiEnableCallback failed";
  pthread_mutex_unlock(&mu);
  return ok;
}

/* The driver calls this at cuInit when CUDA_INJECTION64_PATH names this library. */
int InitializeInjection(void) { return cft_start(); }

const char *cft_error(void) { return start_error; }

/* ---------------------------------------------------------------- snapshot as JSON */
typedef struct { char *buf; size_t cap, len; } out_t;

static void put(out_t *o, const char *s) {
  size_t n = strlen(s);
  if (o->len + n < o->cap) memcpy(o->buf + o->len, s, n);
  o->len += n;
}

static void put_str(out_t *o, const char *s) {
  char c[2] = {0, 0};
  put(o, "\"");
  for (; *s; s++) {
    if (*s == '"' || *s == '\\') put(o, "\\");
    if ((unsigned char)*s < 0x20) continue;
    c[0] = *s;
    put(o, c);
  }
  put(o, "\"");
}

static void put_u64(out_t *o, uint64_t v) {
  char b[32];
  snprintf(b, sizeof b, "%llu", (unsigned long long)v);
  put(o, b);
}

/* Writes the records as JSON into buf (NUL-terminated when it fits); returns the length needed. */
size_t cft_snapshot(char *buf, size_t cap) {
  out_t o = {buf, cap, 0};
  pthread_mutex_lock(&mu);
  put(&o, "{\"started\":");
  put(&o, started ? "true" : "false");
  put(&o, ",\"shared_subscriber\":");
  put(&o, multi ? "true" : "false");
  put(&o, ",\"launch_total\":");
  put_u64(&o, launch_total);
  put(&o, ",\"graph_launches\":");
  put_u64(&o, graph_launches);
  put(&o, ",\"load_calls\":{");
  for (size_t i = 0; i < N_LOAD_APIS; i++) {
    if (i) put(&o, ",");
    put_str(&o, LOAD_APIS[i].name);
    put(&o, ":");
    put_u64(&o, load_calls[i]);
  }
  put(&o, "},\"load_images\":{");
  for (size_t i = 0; i < N_LOAD_APIS; i++) {
    if (i) put(&o, ",");
    put_str(&o, LOAD_APIS[i].name);
    put(&o, ":{");
    for (int k = 0; k < 5; k++) {
      put_str(&o, IMG_NAMES[k]);
      put(&o, ":");
      put_u64(&o, load_images[i][k]);
      put(&o, ",");
    }
    put(&o, "\"with_ptx\":");
    put_u64(&o, load_with_ptx[i]);
    put(&o, "}");
  }
  put(&o, "},\"modules\":[");
  for (size_t i = 0; i < n_modules; i++) {
    module_rec *m = &modules[i];
    if (i) put(&o, ",");
    put(&o, "{\"id\":");
    put_u64(&o, m->id);
    put(&o, ",\"bytes\":");
    put_u64(&o, m->bytes);
    put(&o, ",\"api\":");
    if (m->api >= 0) put_str(&o, LOAD_APIS[m->api].name); else put(&o, "null");
    put(&o, ",\"image\":");
    put_str(&o, IMG_NAMES[m->image]);
    put(&o, ",\"ptx\":");
    put(&o, m->has_ptx ? "true" : "false");
    put(&o, ",\"kernels\":[");
    for (uint32_t k = 0; k < m->nkernels; k++) {
      if (k) put(&o, ",");
      put_str(&o, kernel_names[m->first_kernel + k]);
    }
    put(&o, "]}");
  }
  put(&o, "],\"guard\":{\"depth\":");
  pthread_mutex_lock(&gmu);
  put_u64(&o, (uint64_t)guard_depth);
  put(&o, ",\"targets\":");
  uint64_t nt = 0;
  for (int i = 0; i < CFT_MAX_TARGETS; i++) nt += (uint64_t)targets[i].used;
  put_u64(&o, nt);
  put(&o, ",\"hazards\":");
  put_u64(&o, g_hazards);
  put(&o, ",\"stepped_aside\":");
  put_u64(&o, g_stepped_aside);
  put(&o, ",\"first_launches\":");
  put_u64(&o, g_first_launches);
  put(&o, ",\"timeouts\":");
  put_u64(&o, g_timeouts);
  put(&o, ",\"wait_ns_total\":");
  put_u64(&o, g_wait_ns_total);
  put(&o, ",\"wait_ns_max\":");
  put_u64(&o, g_wait_ns_max);
  put(&o, ",\"enable_failed\":");
  put_u64(&o, g_enable_failed);
  put(&o, ",\"trace\":");
  put(&o, trace_all ? "true" : "false");
  put(&o, ",\"calls\":{");
  for (size_t i = 0; i < N_HAZARD_APIS; i++) {
    if (i) put(&o, ",");
    put_str(&o, HAZARD_APIS[i].name);
    put(&o, ":");
    put_u64(&o, hazard_calls[i]);
  }
  put(&o, "},\"trace_calls\":{");
  int tfirst = 1;
  for (size_t i = 0; i < CFT_TRACE_IDS; i++) {
    uint64_t c = __atomic_load_n(&trace_counts[i], __ATOMIC_RELAXED);
    const char *nm = __atomic_load_n(&trace_names[i], __ATOMIC_RELAXED);
    if (!c || !nm) continue;
    if (!tfirst) put(&o, ",");
    tfirst = 0;
    put_str(&o, nm);
    put(&o, ":");
    put_u64(&o, c);
  }
  put(&o, "},\"unguarded_loads\":");
  put_u64(&o, g_unguarded_loads);
  put(&o, ",\"unguarded\":[");
  for (uint64_t i = 0; i < g_unguarded_loads && i < MAX_UNGUARDED; i++) {
    if (i) put(&o, ",");
    put(&o, "{\"module\":");
    put_u64(&o, unguarded_module[i]);
    put(&o, ",\"in\":");
    put_str(&o, unguarded_where[i] ? unguarded_where[i] : "?");
    put(&o, "}");
  }
  put(&o, "]}");
  pthread_mutex_unlock(&gmu);
  put(&o, ",\"launches\":{");
  int first = 1;
  for (size_t i = 0; i < table_cap; i++) {
    if (!table[i].name) continue;
    if (!first) put(&o, ",");
    first = 0;
    put_str(&o, table[i].name);
    put(&o, ":");
    put_u64(&o, table[i].count);
  }
  put(&o, "}}");
  pthread_mutex_unlock(&mu);
  if (o.len < cap) buf[o.len] = 0;
  return o.len + 1;
}
