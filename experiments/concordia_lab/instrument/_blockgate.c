/* Concordia-FT block gate: a Compute Sanitizer tool that puts a pause check at the entry of every block of
 * every kernel, SASS-only ones included (PyTorch's own, cuBLAS), without the compute-sanitizer front-end.
 *
 * Loaded into an unmodified process either by LD_PRELOAD (the constructor subscribes) or by the driver through
 * CUDA_INJECTION64_PATH (cuInit calls InitializeInjection); both paths are idempotent. When a module is
 * loaded it adds the patch module (CONCORDIA_BLOCKGATE_PATCHES: the fatbin built from _blockgate_patch.cu)
 * to the module's context once, marks SANITIZER_INSTRUCTION_BLOCK_ENTER to call cft_gate_enter and patches
 * the module (CONCORDIA_BLOCKGATE_PATCH=0 loads the tool but patches nothing, for measuring).
 *
 * At every launch of a patched module it sets the launch's callback data: the control block Python armed for
 * kernels whose name contains the armed substring, NULL for all others (the device callback then returns at
 * once). Python drives it through ctypes on the same .so: cfb_arm(), cfb_stats() (JSON).
 *
 * Built with a C compiler, cuda.h (nvidia-cuda-runtime wheel) and the headers and libsanitizer-public.so of
 * the nvidia-cuda-sanitizer-api wheel.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sanitizer.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_CTX 64
#define MAX_NAMES 32

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int started, patch_on = 1;
static Sanitizer_SubscriberHandle subscriber;
static const char *patches_path;
static CUcontext ctx_loaded[MAX_CTX];
static int n_ctx;
static char armed_substr[512];
static uint64_t armed_ctl; /* device address of the control block; 0 = disarmed */
static uint64_t modules_loaded, modules_patched, launches, armed_launches, lazy_loaded, lazy_patched;
static uint64_t set_data_errors;
static double patch_seconds;
static char first_error[256];
static char armed_names[MAX_NAMES][160];
static int n_armed_names;
static uint32_t last_grid[3], last_block[3];
static const char *via = "none";

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void note_error(const char *what, SanitizerResult r) {
  if (first_error[0]) return;
  snprintf(first_error, sizeof first_error, "%s returned SanitizerResult %d", what, (int)r);
}

static int ensure_patches(CUcontext ctx) {
  for (int i = 0; i < n_ctx; i++)
    if (ctx_loaded[i] == ctx) return 1;
  if (!patches_path || !*patches_path) {
    note_error("CONCORDIA_BLOCKGATE_PATCHES unset: sanitizerAddPatchesFromFile", SANITIZER_ERROR_INVALID_PARAMETER);
    return 0;
  }
  SanitizerResult r = sanitizerAddPatchesFromFile(patches_path, ctx);
  if (r != SANITIZER_SUCCESS) {
    note_error("sanitizerAddPatchesFromFile", r);
    return 0;
  }
  if (n_ctx < MAX_CTX) ctx_loaded[n_ctx++] = ctx;
  return 1;
}

static void on_module(const Sanitizer_ResourceModuleData *m) {
  pthread_mutex_lock(&mu);
  modules_loaded++;
  if (patch_on) {
    double t0 = now_s();
    if (ensure_patches(m->context)) {
      SanitizerResult r = sanitizerPatchInstructions(SANITIZER_INSTRUCTION_BLOCK_ENTER, m->module, "cft_gate_enter");
      if (r != SANITIZER_SUCCESS) {
        note_error("sanitizerPatchInstructions(BLOCK_ENTER)", r);
      } else {
        r = sanitizerPatchModule(m->module);
        if (r != SANITIZER_SUCCESS) note_error("sanitizerPatchModule", r);
        else modules_patched++;
      }
    }
    patch_seconds += now_s() - t0;
  }
  pthread_mutex_unlock(&mu);
}

static void on_launch(const Sanitizer_LaunchData *d) {
  uint64_t ctl = 0;
  pthread_mutex_lock(&mu);
  launches++;
  if (armed_ctl && d->functionName && strstr(d->functionName, armed_substr)) {
    ctl = armed_ctl;
    armed_launches++;
    last_grid[0] = d->gridDim_x, last_grid[1] = d->gridDim_y, last_grid[2] = d->gridDim_z;
    last_block[0] = d->blockDim_x, last_block[1] = d->blockDim_y, last_block[2] = d->blockDim_z;
    int seen = 0;
    for (int i = 0; i < n_armed_names; i++) seen |= strncmp(armed_names[i], d->functionName, 159) == 0;
    if (!seen && n_armed_names < MAX_NAMES) {
      strncpy(armed_names[n_armed_names], d->functionName, 159);
      armed_names[n_armed_names++][159] = 0;
    }
  }
  pthread_mutex_unlock(&mu);
  if (!patch_on) return;
  SanitizerResult r = sanitizerSetLaunchCallbackData(d->hLaunch, d->function, d->hStream, (void *)(uintptr_t)ctl);
  if (r != SANITIZER_SUCCESS) {
    pthread_mutex_lock(&mu);
    set_data_errors++;
    note_error("sanitizerSetLaunchCallbackData", r);
    pthread_mutex_unlock(&mu);
  }
}

static void SANITIZERAPI callback(void *userdata, Sanitizer_CallbackDomain domain, Sanitizer_CallbackId cbid,
                                  const void *data) {
  (void)userdata;
  if (domain == SANITIZER_CB_DOMAIN_RESOURCE) {
    if (cbid == SANITIZER_CBID_RESOURCE_MODULE_LOADED) on_module((const Sanitizer_ResourceModuleData *)data);
    else if (cbid == SANITIZER_CBID_RESOURCE_FUNCTIONS_LAZY_LOADED) __atomic_add_fetch(&lazy_loaded, 1, __ATOMIC_RELAXED);
    else if (cbid == SANITIZER_CBID_RESOURCE_FUNCTIONS_LAZY_PATCHED) __atomic_add_fetch(&lazy_patched, 1, __ATOMIC_RELAXED);
  } else if (domain == SANITIZER_CB_DOMAIN_LAUNCH && cbid == SANITIZER_CBID_LAUNCH_BEGIN) {
    on_launch((const Sanitizer_LaunchData *)data);
  }
}

static int start(const char *how) {
  pthread_mutex_lock(&mu);
  if (started) {
    pthread_mutex_unlock(&mu);
    return 1;
  }
  const char *p = getenv("CONCORDIA_BLOCKGATE_PATCH");
  patch_on = !(p && strcmp(p, "0") == 0);
  patches_path = getenv("CONCORDIA_BLOCKGATE_PATCHES");
  SanitizerResult r = sanitizerSubscribe(&subscriber, callback, NULL);
  int ok = r == SANITIZER_SUCCESS;
  if (!ok) note_error("sanitizerSubscribe", r);
  Sanitizer_CallbackId res[] = {SANITIZER_CBID_RESOURCE_MODULE_LOADED, SANITIZER_CBID_RESOURCE_FUNCTIONS_LAZY_LOADED,
                                SANITIZER_CBID_RESOURCE_FUNCTIONS_LAZY_PATCHED};
  for (size_t i = 0; ok && i < sizeof res / sizeof res[0]; i++) {
    r = sanitizerEnableCallback(1, subscriber, SANITIZER_CB_DOMAIN_RESOURCE, res[i]);
    if (r != SANITIZER_SUCCESS) note_error("sanitizerEnableCallback(RESOURCE)", r), ok = 0;
  }
  if (ok) {
    r = sanitizerEnableCallback(1, subscriber, SANITIZER_CB_DOMAIN_LAUNCH, SANITIZER_CBID_LAUNCH_BEGIN);
    if (r != SANITIZER_SUCCESS) note_error("sanitizerEnableCallback(LAUNCH_BEGIN)", r), ok = 0;
  }
  started = ok;
  via = how;
  pthread_mutex_unlock(&mu);
  return ok;
}

/* CUDA_INJECTION64_PATH: the driver calls this from cuInit. */
int InitializeInjection(void) { return start("CUDA_INJECTION64_PATH"); }

/* LD_PRELOAD (or any load before cuInit): subscribe at load time. */
__attribute__((constructor)) static void cfb_ctor(void) {
  if (getenv("CONCORDIA_BLOCKGATE_NO_CTOR")) return;
  start("constructor");
}

/* Arm launches of kernels whose name contains substr with the control block at device address ctl;
   ctl == 0 disarms. Returns 1 when the tool is running. */
int cfb_arm(const char *substr, uint64_t ctl) {
  pthread_mutex_lock(&mu);
  snprintf(armed_substr, sizeof armed_substr, "%s", substr ? substr : "");
  armed_ctl = ctl;
  int ok = started;
  pthread_mutex_unlock(&mu);
  return ok;
}

/* The tool's counters as JSON into buf (NUL-terminated when it fits); returns the length needed. */
size_t cfb_stats(char *buf, size_t cap) {
  char names[MAX_NAMES * 170 + 8];
  size_t k = 0;
  pthread_mutex_lock(&mu);
  names[k++] = '[';
  for (int i = 0; i < n_armed_names; i++) {
    k += (size_t)snprintf(names + k, sizeof names - k, "%s\"%s\"", i ? "," : "", armed_names[i]);
    if (k >= sizeof names - 2) break;
  }
  names[k++] = ']';
  names[k] = 0;
  int n = snprintf(buf, cap,
                   "{\"started\":%s,\"via\":\"%s\",\"patch\":%s,\"modules_loaded\":%llu,\"modules_patched\":%llu,"
                   "\"patch_seconds\":%.6f,\"launches\":%llu,\"armed_launches\":%llu,\"lazy_loaded\":%llu,"
                   "\"lazy_patched\":%llu,\"set_data_errors\":%llu,\"contexts\":%d,\"first_error\":\"%s\","
                   "\"last_grid\":[%u,%u,%u],\"last_block\":[%u,%u,%u],\"armed_kernels\":%s}",
                   started ? "true" : "false", via, patch_on ? "true" : "false",
                   (unsigned long long)modules_loaded, (unsigned long long)modules_patched, patch_seconds,
                   (unsigned long long)launches, (unsigned long long)armed_launches,
                   (unsigned long long)lazy_loaded, (unsigned long long)lazy_patched,
                   (unsigned long long)set_data_errors, n_ctx, first_error, last_grid[0], last_grid[1],
                   last_grid[2], last_block[0], last_block[1], last_block[2], names);
  pthread_mutex_unlock(&mu);
  return (size_t)n + 1;
}
