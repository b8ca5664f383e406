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
}

static void callback(void *userdata, CUpti_CallbackDomain domain, CUpti_CallbackId cbid,
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
  for (size_t i = 0; i < N_LOAD_APIS; i++) {
    if (LOAD_APIS[i].cbid != cbid) continue;
    if (cb->callbackSite == CUPTI_API_ENTER) {
      const void *image = NULL;
      int ptx = 0, sass = 0, kind = IMG_FILE;
      switch (cbid) {
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
    }
    return;
  }
  if (cb->callbackSite != CUPTI_API_ENTER) return;
  cft_cut_on_launch(cbid, cb->functionParams, cb->symbolName);
  if (cbid == CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch || cbid == CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch_ptsz) {
    pthread_mutex_lock(&mu);
    graph_launches++;
    pthread_mutex_unlock(&mu);
    return;
  }
  pthread_mutex_lock(&mu);
  count_launch(cb->symbolName);
  pthread_mutex_unlock(&mu);
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
    r = sub2(&subscriber, (CUpti_CallbackFunc)callback, NULL, &prm);
    multi = r == CUPTI_SUCCESS;
    if (r != CUPTI_SUCCESS) r = sub(&subscriber, (CUpti_CallbackFunc)callback, NULL);
  } else {
    r = sub(&subscriber, (CUpti_CallbackFunc)callback, NULL);
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
  put(&o, "],\"launches\":{");
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
