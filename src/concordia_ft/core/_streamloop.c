/* The streamed restore's chunk loop in C (core/streamed.py), with the GIL released for the whole stream.
 *
 * ``run`` takes a plan flattened by Python (the chunks, their copies and the buffers they read, the pages
 * scatter chunks go to) and a target, and returns when every chunk has been handed over:
 * - ``threads`` pthreads memcpy each chunk's source ranges (the log's mapped segments) into ring slot
 *   ``k % slots`` of a contiguous host ring; with ``crc_out`` they CRC32C each checked piece as they copy it
 *   (1 MiB at a time, then the copy reads what the checksum left in cache);
 * - the calling thread hands filled slots over in chunk order: for the "host" target a memcpy into place (one
 *   run) or a scatter of pages; for the "cuda" target, through driver entry points dlopen'ed from
 *   libcuda.so.1: one cuMemcpyHtoDAsync (into place, or into the slot's device staging twin), the CRC32C
 *   tile kernel over the pieces the chunk carries (descriptor rows uploaded once by Python), the page scatter
 *   kernel (staging -> pool) and an event record, all on the sink's own stream;
 * - for "cuda", a releaser thread synchronises each slot's event in order (blocking-sync events: it sleeps)
 *   and frees the slot for the next fill; for "host" a slot is free once its put returned.
 * Slot assignment is round robin (chunk k in slot k % slots), so Python precomputes where every checked piece
 * lands on the device. Any failure stops every thread; ``run`` raises RuntimeError with what failed (the
 * Python side turns it into the project's error and the caller synchronises the stream before the ring goes).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "_crc32c.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* ------------------------------------------------------------------------------- copies that skip the cache */
/* A fill's destination (a pinned ring slot) is read next by the DMA engine, not by this core, so writing it
 * through the cache only costs a read of every destination line first (the read-for-ownership) and evicts the
 * source. Streaming (non-temporal) stores write whole lines to memory: per byte, the host's memory sees one
 * read of the log and one write of the slot instead of two reads and a write. Where glibc's memcpy already
 * streams (copies above its non-temporal threshold) this is the same traffic. */
#if defined(__x86_64__)
__attribute__((target("avx2"))) static void stream_copy_avx2(uint8_t *d, const uint8_t *s, size_t n) {
    for (size_t i = 0; i < n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + i + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + i + 96));
        _mm256_stream_si256((__m256i *)(d + i), a);
        _mm256_stream_si256((__m256i *)(d + i + 32), b);
        _mm256_stream_si256((__m256i *)(d + i + 64), c);
        _mm256_stream_si256((__m256i *)(d + i + 96), e);
    }
}

static void stream_copy_sse2(uint8_t *d, const uint8_t *s, size_t n) {
    for (size_t i = 0; i < n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
}
static int have_avx2; /* set once by PyInit (cpu_probe), before any copy thread runs */
#endif

static void cpu_probe(void) {
#if defined(__x86_64__)
    have_avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
#endif
}

/* memcpy(d, s, n) with streaming stores for the 128-byte-aligned body of the destination (a plain memcpy for the
 * unaligned head and tail, and for short copies); fenced, so the bytes are in memory when it returns */
static void stream_copy(uint8_t *d, const uint8_t *s, size_t n) {
#if defined(__x86_64__)
    if (n < 8192) {
        memcpy(d, s, n);
        return;
    }
    size_t head = (128 - ((uintptr_t)d & 127)) & 127;
    memcpy(d, s, head);
    size_t body = (n - head) & ~(size_t)127;
    if (have_avx2) stream_copy_avx2(d + head, s + head, body);
    else stream_copy_sse2(d + head, s + head, body);
    _mm_sfence();
    memcpy(d + head + body, s + head + body, n - head - body);
#else
    memcpy(d, s, n);
#endif
}

static const char *stream_copy_impl(void) {
#if defined(__x86_64__)
    return have_avx2 ? "avx2 streaming stores" : "sse2 streaming stores";
#else
    return "memcpy (no streaming stores on this architecture)";
#endif
}

/* ---------------------------------------------------------------------------------------- driver entries */
typedef int CUres;
typedef CUres (*f_htod_t)(uint64_t, const void *, size_t, void *);
typedef CUres (*f_ev_create_t)(void **, unsigned);
typedef CUres (*f_ev_record_t)(void *, void *);
typedef CUres (*f_ev_sync_t)(void *);
typedef CUres (*f_ev_destroy_t)(void *);
typedef CUres (*f_launch_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                            void **, void **);
typedef CUres (*f_ctx_get_t)(void **);
typedef CUres (*f_ctx_set_t)(void *);
typedef CUres (*f_err_name_t)(CUres, const char **);

static struct {
    int loaded;
    f_htod_t htod;
    f_ev_create_t ev_create;
    f_ev_record_t ev_record;
    f_ev_sync_t ev_sync;
    f_ev_destroy_t ev_destroy;
    f_launch_t launch;
    f_ctx_get_t ctx_get;
    f_ctx_set_t ctx_set;
    f_err_name_t err_name;
} cu;

static const char *load_driver(void) {
    if (cu.loaded) return NULL;
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) return "dlopen(libcuda.so.1) failed";
    /* the versioned names: cuda.h maps the plain ones to these (the _v1 ABI has 32-bit device pointers) */
#define SYM(field, name)                                            \
    do {                                                            \
        *(void **)(&cu.field) = dlsym(h, name);                     \
        if (!cu.field) return "libcuda.so.1 lacks " name;           \
    } while (0)
    SYM(htod, "cuMemcpyHtoDAsync_v2");
    SYM(ev_create, "cuEventCreate");
    SYM(ev_record, "cuEventRecord");
    SYM(ev_sync, "cuEventSynchronize");
    SYM(ev_destroy, "cuEventDestroy_v2");
    SYM(launch, "cuLaunchKernel");
    SYM(ctx_get, "cuCtxGetCurrent");
    SYM(ctx_set, "cuCtxSetCurrent");
    SYM(err_name, "cuGetErrorName");
#undef SYM
    cu.loaded = 1;
    return NULL;
}

/* ------------------------------------------------------------------------------------------------- the run */
enum { C_COPY0, C_COPY1, C_NBYTES, C_RUN, C_PAGE0, C_NPAGES, C_META0, C_NMETA, C_BLOCKS, C_COLS };
#define MODE_HOST 1
#define MODE_CUDA 2
#define VERIFY_STEP (1u << 20)
#define META_BYTES 32 /* crc.PIECE_DTYPE: ptr, len, tile0, first_block */
#define MAX_SLOTS 4096

typedef struct {
    Py_ssize_t n_chunks;
    const int64_t *chunks;
    const int64_t *copies; /* [n][2]: offset in the slot, piece id or -1 */
    const uint8_t **src;
    size_t *src_len;
    const int64_t *pages;
    uint32_t *crc_out;
    int stream_stores; /* fills with stream_copy instead of memcpy */
    uint8_t *ring;
    size_t slot_bytes;
    Py_ssize_t slots;
    int mode;
    size_t page_bytes;
    uint8_t *host_dst;
    /* cuda */
    uint64_t dev_dst, dev_staging, dev_pages, dev_meta, tile_crc;
    void *stream, *f_scatter, *f_tiles, *ctx;
    uint32_t x_span;
    void *events[MAX_SLOTS];
    /* state */
    pthread_mutex_t mu;
    pthread_cond_t fill_cv, slot_cv, issue_cv;
    Py_ssize_t next_fill, issued, released;
    int driver_done;
    uint8_t *filled;
    int err;
    char msg[256];
    double fill_wait, slot_wait, put_s;
} Run;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void fail(Run *r, const char *what, CUres code) {
    pthread_mutex_lock(&r->mu);
    if (!r->err) {
        r->err = 1;
        const char *name = NULL;
        if (code && cu.err_name) cu.err_name(code, &name);
        if (code)
            snprintf(r->msg, sizeof r->msg, "%s failed: %s (%d)", what, name ? name : "?", code);
        else
            snprintf(r->msg, sizeof r->msg, "%s", what);
    }
    pthread_cond_broadcast(&r->fill_cv);
    pthread_cond_broadcast(&r->slot_cv);
    pthread_cond_broadcast(&r->issue_cv);
    pthread_mutex_unlock(&r->mu);
}

static void fill(Run *r, Py_ssize_t k) {
    const int64_t *c = r->chunks + k * C_COLS;
    uint8_t *slot = r->ring + (size_t)(k % r->slots) * r->slot_bytes;
    for (int64_t i = c[C_COPY0]; i < c[C_COPY1]; i++) {
        const uint8_t *s = r->src[i];
        size_t n = r->src_len[i];
        uint8_t *d = slot + r->copies[2 * i];
        int64_t pid = r->copies[2 * i + 1];
        if (pid < 0 || !r->crc_out) {
            if (r->stream_stores) stream_copy(d, s, n);
            else memcpy(d, s, n);
            continue;
        }
        uint32_t crc = 0;
        for (size_t a = 0; a < n; a += VERIFY_STEP) {
            size_t m = n - a < VERIFY_STEP ? n - a : VERIFY_STEP;
            crc = crc32c(crc, s + a, m);
            if (r->stream_stores) stream_copy(d + a, s + a, m);
            else memcpy(d + a, s + a, m);
        }
        r->crc_out[pid] = crc;
    }
}

static void *worker(void *arg) {
    Run *r = (Run *)arg;
    for (;;) {
        pthread_mutex_lock(&r->mu);
        if (r->err || r->next_fill >= r->n_chunks) {
            pthread_mutex_unlock(&r->mu);
            break;
        }
        Py_ssize_t k = r->next_fill++;
        if (k >= r->released + r->slots) {
            double t0 = now_s();
            while (!r->err && k >= r->released + r->slots) pthread_cond_wait(&r->slot_cv, &r->mu);
            r->slot_wait += now_s() - t0;
        }
        int stop = r->err;
        pthread_mutex_unlock(&r->mu);
        if (stop) break;
        fill(r, k);
        pthread_mutex_lock(&r->mu);
        r->filled[k] = 1;
        pthread_cond_signal(&r->fill_cv);
        pthread_mutex_unlock(&r->mu);
    }
    return NULL;
}

static int put_host(Run *r, Py_ssize_t k) {
    const int64_t *c = r->chunks + k * C_COLS;
    const uint8_t *slot = r->ring + (size_t)(k % r->slots) * r->slot_bytes;
    size_t pb = r->page_bytes;
    if (c[C_RUN] >= 0) {
        memcpy(r->host_dst + (size_t)c[C_RUN] * pb, slot, (size_t)c[C_NBYTES]);
    } else {
        const int64_t *pg = r->pages + c[C_PAGE0];
        for (int64_t i = 0; i < c[C_NPAGES]; i++) memcpy(r->host_dst + (size_t)pg[i] * pb, slot + (size_t)i * pb, pb);
    }
    return 0;
}

static int put_cuda(Run *r, Py_ssize_t k) {
    const int64_t *c = r->chunks + k * C_COLS;
    Py_ssize_t s = k % r->slots;
    const uint8_t *slot = r->ring + (size_t)s * r->slot_bytes;
    size_t pb = r->page_bytes, n = (size_t)c[C_NBYTES];
    uint64_t staging = r->dev_staging + (uint64_t)s * r->slot_bytes;
    uint64_t base = c[C_RUN] >= 0 ? r->dev_dst + (uint64_t)c[C_RUN] * pb : staging;
    CUres e = cu.htod(base, slot, n, r->stream);
    if (e) { fail(r, "cuMemcpyHtoDAsync", e); return -1; }
    if (c[C_BLOCKS] > 0) { /* the checked pieces, where they landed (before the scatter reads the staging twin) */
        uint64_t meta = r->dev_meta + (uint64_t)c[C_META0] * META_BYTES, tc = r->tile_crc;
        uint32_t np = (uint32_t)c[C_NMETA], xs = r->x_span;
        void *args[] = {&meta, &np, &xs, &tc};
        e = cu.launch(r->f_tiles, (unsigned)c[C_BLOCKS], 1, 1, 256, 1, 1, 0, r->stream, args, NULL);
        if (e) { fail(r, "cuLaunchKernel(concordia_crc32c_tiles)", e); return -1; }
    }
    if (c[C_RUN] < 0) {
        uint64_t srcp = staging, idx = r->dev_pages + (uint64_t)c[C_PAGE0] * 8, dst = r->dev_dst;
        uint64_t lanes = pb / 8;
        uint32_t np = (uint32_t)c[C_NPAGES];
        void *args[] = {&srcp, &idx, &dst, &lanes, &np};
        e = cu.launch(r->f_scatter, np, 1, 1, 256, 1, 1, 0, r->stream, args, NULL);
        if (e) { fail(r, "cuLaunchKernel(concordia_scatter_pages)", e); return -1; }
    }
    e = cu.ev_record(r->events[s], r->stream);
    if (e) { fail(r, "cuEventRecord", e); return -1; }
    return 0;
}

static void *releaser(void *arg) {
    Run *r = (Run *)arg;
    CUres e = cu.ctx_set(r->ctx);
    if (e) { fail(r, "cuCtxSetCurrent (releaser)", e); return NULL; }
    for (Py_ssize_t j = 0; j < r->n_chunks; j++) {
        pthread_mutex_lock(&r->mu);
        while (!r->err && !r->driver_done && j >= r->issued) pthread_cond_wait(&r->issue_cv, &r->mu);
        int go = j < r->issued && !r->err;
        pthread_mutex_unlock(&r->mu);
        if (!go) break;
        e = cu.ev_sync(r->events[j % r->slots]);
        if (e) { fail(r, "cuEventSynchronize", e); break; }
        pthread_mutex_lock(&r->mu);
        r->released = j + 1;
        pthread_cond_broadcast(&r->slot_cv);
        pthread_mutex_unlock(&r->mu);
    }
    return NULL;
}

static void drive(Run *r) {
    for (Py_ssize_t k = 0; k < r->n_chunks; k++) {
        pthread_mutex_lock(&r->mu);
        if (!r->filled[k] && !r->err) {
            double t0 = now_s();
            while (!r->filled[k] && !r->err) pthread_cond_wait(&r->fill_cv, &r->mu);
            r->fill_wait += now_s() - t0;
        }
        int stop = r->err;
        pthread_mutex_unlock(&r->mu);
        if (stop) break;
        double t0 = now_s();
        if ((r->mode == MODE_HOST ? put_host(r, k) : put_cuda(r, k)) != 0) break;
        r->put_s += now_s() - t0;
        pthread_mutex_lock(&r->mu);
        r->issued = k + 1;
        if (r->mode == MODE_HOST) {
            r->released = k + 1;
            pthread_cond_broadcast(&r->slot_cv);
        } else {
            pthread_cond_signal(&r->issue_cv);
        }
        pthread_mutex_unlock(&r->mu);
    }
    pthread_mutex_lock(&r->mu);
    r->driver_done = 1;
    pthread_cond_broadcast(&r->issue_cv);
    pthread_mutex_unlock(&r->mu);
}

/* ---------------------------------------------------------------------------------------------- Python API */
static int get_i64(PyObject *obj, Py_buffer *b, const char *what, Py_ssize_t cols) {
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (b->itemsize != 8 || (b->format && strcmp(b->format, "q") && strcmp(b->format, "l") && strcmp(b->format, "<q") &&
                             strcmp(b->format, "<l"))) {
        PyErr_Format(PyExc_TypeError, "%s: want a C-contiguous int64 array", what);
        PyBuffer_Release(b);
        return -1;
    }
    if (cols > 0 && (b->len / 8) % cols) {
        PyErr_Format(PyExc_ValueError, "%s: want %zd columns", what, cols);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

static PyObject *py_run(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"srcs", "copies", "chunks", "pages", "ring", "slot_bytes", "slots", "threads",
                             "page_bytes", "crc_out", "host_dst", "cuda", "stream_stores", NULL};
    PyObject *srcs, *o_copies, *o_chunks, *o_pages, *o_ring, *o_crc = Py_None, *o_dst = Py_None, *o_cuda = Py_None;
    Py_ssize_t slot_bytes, slots, page_bytes;
    int threads, stream_stores = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOnnin|OOOp", kwlist, &srcs, &o_copies, &o_chunks, &o_pages,
                                     &o_ring, &slot_bytes, &slots, &threads, &page_bytes, &o_crc, &o_dst, &o_cuda,
                                     &stream_stores))
        return NULL;
    if (!PyList_Check(srcs)) return PyErr_Format(PyExc_TypeError, "srcs: want a list of buffers");
    if (slots < 1 || slots > MAX_SLOTS || slot_bytes < 1 || page_bytes < 8 || page_bytes % 8 || threads < 1)
        return PyErr_Format(PyExc_ValueError, "bad ring geometry: %zd slots of %zd bytes, pages of %zd, %d threads",
                            slots, slot_bytes, page_bytes, threads);
    if ((o_dst == Py_None) == (o_cuda == Py_None))
        return PyErr_Format(PyExc_ValueError, "give exactly one target: host_dst or cuda");
    Run *r = calloc(1, sizeof(Run));
    if (!r) return PyErr_NoMemory();
    Py_buffer b_copies = {0}, b_chunks = {0}, b_pages = {0}, b_ring = {0}, b_crc = {0}, b_dst = {0};
    Py_buffer *b_src = NULL;
    Py_ssize_t n_src = PyList_GET_SIZE(srcs), got_src = 0;
    PyObject *result = NULL;
    pthread_t *tids = NULL;
    int n_started = 0, rel_started = 0;
    pthread_t rel;
    if (get_i64(o_copies, &b_copies, "copies", 2) < 0) goto out;
    if (get_i64(o_chunks, &b_chunks, "chunks", C_COLS) < 0) goto out;
    if (get_i64(o_pages, &b_pages, "pages", 0) < 0) goto out;
    if (PyObject_GetBuffer(o_ring, &b_ring, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto out;
    if (b_copies.len / 16 != n_src) { PyErr_Format(PyExc_ValueError, "copies: %zd rows for %zd srcs", b_copies.len / 16, n_src); goto out; }
    if (b_ring.len < slots * slot_bytes) { PyErr_Format(PyExc_ValueError, "ring: %zd bytes < %zd slots x %zd", b_ring.len, slots, slot_bytes); goto out; }
    Py_ssize_t n_crc = 0;
    if (o_crc != Py_None) {
        if (PyObject_GetBuffer(o_crc, &b_crc, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto out;
        n_crc = b_crc.len / 4;
        r->crc_out = (uint32_t *)b_crc.buf;
    }
    r->n_chunks = b_chunks.len / (8 * C_COLS);
    r->chunks = (const int64_t *)b_chunks.buf;
    r->copies = (const int64_t *)b_copies.buf;
    r->pages = (const int64_t *)b_pages.buf;
    r->ring = (uint8_t *)b_ring.buf;
    r->stream_stores = stream_stores;
    r->slot_bytes = (size_t)slot_bytes;
    r->slots = slots;
    r->page_bytes = (size_t)page_bytes;
    b_src = calloc((size_t)(n_src ? n_src : 1), sizeof(Py_buffer));
    r->src = calloc((size_t)(n_src ? n_src : 1), sizeof(uint8_t *));
    r->src_len = calloc((size_t)(n_src ? n_src : 1), sizeof(size_t));
    r->filled = calloc((size_t)(r->n_chunks ? r->n_chunks : 1), 1);
    if (!b_src || !r->src || !r->src_len || !r->filled) { PyErr_NoMemory(); goto out; }
    for (; got_src < n_src; got_src++) {
        if (PyObject_GetBuffer(PyList_GET_ITEM(srcs, got_src), &b_src[got_src], PyBUF_SIMPLE) < 0) goto out;
        r->src[got_src] = (const uint8_t *)b_src[got_src].buf;
        r->src_len[got_src] = (size_t)b_src[got_src].len;
    }
    /* every index the threads follow is checked here, before the GIL is released */
    Py_ssize_t n_pages_idx = b_pages.len / 8, dst_pages = -1;
    if (o_dst != Py_None) {
        if (PyObject_GetBuffer(o_dst, &b_dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto out;
        r->mode = MODE_HOST;
        r->host_dst = (uint8_t *)b_dst.buf;
        dst_pages = b_dst.len / page_bytes;
    }
    for (Py_ssize_t k = 0; k < r->n_chunks; k++) {
        const int64_t *c = r->chunks + k * C_COLS;
        if (c[C_COPY0] < 0 || c[C_COPY1] < c[C_COPY0] || c[C_COPY1] > n_src || c[C_NBYTES] < 0 ||
            c[C_NBYTES] > slot_bytes || c[C_NBYTES] % page_bytes || c[C_NPAGES] != c[C_NBYTES] / page_bytes) {
            PyErr_Format(PyExc_ValueError, "chunk %zd: bad copies or size", k);
            goto out;
        }
        for (int64_t i = c[C_COPY0]; i < c[C_COPY1]; i++) {
            int64_t off = r->copies[2 * i], pid = r->copies[2 * i + 1];
            if (off < 0 || (size_t)off + r->src_len[i] > (size_t)c[C_NBYTES] || (r->crc_out && pid >= n_crc)) {
                PyErr_Format(PyExc_ValueError, "chunk %zd copy %lld: outside the chunk or a bad piece", k, (long long)i);
                goto out;
            }
        }
        if (c[C_RUN] < 0) {
            if (c[C_PAGE0] < 0 || c[C_PAGE0] + c[C_NPAGES] > n_pages_idx) {
                PyErr_Format(PyExc_ValueError, "chunk %zd: pages outside the index array", k);
                goto out;
            }
            if (dst_pages >= 0)
                for (int64_t i = 0; i < c[C_NPAGES]; i++) {
                    int64_t p = r->pages[c[C_PAGE0] + i];
                    if (p < 0 || p >= dst_pages) { PyErr_Format(PyExc_ValueError, "chunk %zd: page %lld outside the target", k, (long long)p); goto out; }
                }
        } else if (dst_pages >= 0 && c[C_RUN] + c[C_NPAGES] > dst_pages) {
            PyErr_Format(PyExc_ValueError, "chunk %zd: run outside the target", k);
            goto out;
        }
    }
    if (o_cuda != Py_None) {
        unsigned long long v[10];
        if (!PyArg_ParseTuple(o_cuda, "KKKKKKKKKK", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &v[7], &v[8], &v[9]))
            goto out;
        const char *why = load_driver();
        if (why) { PyErr_SetString(PyExc_RuntimeError, why); goto out; }
        r->mode = MODE_CUDA;
        r->dev_dst = v[0]; r->dev_staging = v[1]; r->dev_pages = v[2]; r->dev_meta = v[3]; r->tile_crc = v[4];
        r->stream = (void *)(uintptr_t)v[5]; r->f_scatter = (void *)(uintptr_t)v[6];
        r->f_tiles = (void *)(uintptr_t)v[7]; r->x_span = (uint32_t)v[8];
        (void)v[9];
        CUres e = cu.ctx_get(&r->ctx);
        if (e || !r->ctx) { PyErr_Format(PyExc_RuntimeError, "cuCtxGetCurrent: no current context (%d)", e); goto out; }
        for (Py_ssize_t s = 0; s < slots; s++) {
            e = cu.ev_create(&r->events[s], 0x1 | 0x2); /* BLOCKING_SYNC | DISABLE_TIMING */
            if (e) { PyErr_Format(PyExc_RuntimeError, "cuEventCreate failed (%d)", e); goto out; }
        }
    }
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->fill_cv, NULL);
    pthread_cond_init(&r->slot_cv, NULL);
    pthread_cond_init(&r->issue_cv, NULL);
    tids = calloc((size_t)threads, sizeof(pthread_t));
    if (!tids) { PyErr_NoMemory(); goto out_sync; }
    double t0 = now_s();
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < threads; i++) {
        if (pthread_create(&tids[i], NULL, worker, r) != 0) { fail(r, "pthread_create (copy thread)", 0); break; }
        n_started++;
    }
    if (r->mode == MODE_CUDA && !r->err) {
        if (pthread_create(&rel, NULL, releaser, r) != 0) fail(r, "pthread_create (releaser)", 0);
        else rel_started = 1;
    }
    drive(r);
    for (int i = 0; i < n_started; i++) pthread_join(tids[i], NULL);
    if (rel_started) pthread_join(rel, NULL);
    Py_END_ALLOW_THREADS
    double secs = now_s() - t0;
    if (r->err) {
        PyErr_SetString(PyExc_RuntimeError, r->msg);
    } else {
        result = Py_BuildValue("{s:d,s:d,s:d,s:d,s:n}", "seconds", secs, "fill_wait_s", r->fill_wait,
                               "slot_wait_s", threads ? r->slot_wait / threads : 0.0, "put_s", r->put_s,
                               "chunks", r->n_chunks);
    }
out_sync:
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->fill_cv);
    pthread_cond_destroy(&r->slot_cv);
    pthread_cond_destroy(&r->issue_cv);
out:
    if (r->mode == MODE_CUDA)
        for (Py_ssize_t s = 0; s < slots && s < MAX_SLOTS; s++)
            if (r->events[s]) cu.ev_destroy(r->events[s]); /* released once the event completed */
    for (Py_ssize_t i = 0; i < got_src; i++) PyBuffer_Release(&b_src[i]);
    free(b_src);
    free((void *)r->src);
    free(r->src_len);
    free(r->filled);
    free(tids);
    if (b_copies.obj) PyBuffer_Release(&b_copies);
    if (b_chunks.obj) PyBuffer_Release(&b_chunks);
    if (b_pages.obj) PyBuffer_Release(&b_pages);
    if (b_ring.obj) PyBuffer_Release(&b_ring);
    if (b_crc.obj) PyBuffer_Release(&b_crc);
    if (b_dst.obj) PyBuffer_Release(&b_dst);
    free(r);
    return result;
}

static PyObject *py_crc32c(PyObject *self, PyObject *args) {
    Py_buffer b;
    unsigned int crc = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &b, &crc)) return NULL;
    uint32_t c = crc32c(crc, (const uint8_t *)b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(c);
}

static PyObject *py_copy(PyObject *self, PyObject *args) {
    Py_buffer d, s;
    if (!PyArg_ParseTuple(args, "w*y*", &d, &s)) return NULL;
    if (d.len != s.len) {
        PyErr_Format(PyExc_ValueError, "copy: destination of %zd bytes, source of %zd", d.len, s.len);
        PyBuffer_Release(&d);
        PyBuffer_Release(&s);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    stream_copy((uint8_t *)d.buf, (const uint8_t *)s.buf, (size_t)s.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&d);
    PyBuffer_Release(&s);
    Py_RETURN_NONE;
}

static PyObject *py_copy_impl(PyObject *self, PyObject *noargs) {
    return PyUnicode_FromString(stream_copy_impl());
}

static PyObject *py_crc_impl(PyObject *self, PyObject *noargs) {
    return PyUnicode_FromString(crc_hw ? "sse4.2" : "table");
}

static PyMethodDef methods[] = {
    {"run", (PyCFunction)(void (*)(void))py_run, METH_VARARGS | METH_KEYWORDS,
     "run(srcs, copies, chunks, pages, ring, slot_bytes, slots, threads, page_bytes, crc_out=None, host_dst=None, "
     "cuda=None, stream_stores=False) -> stats: stream a flattened plan through the ring (GIL released)"},
    {"copy", py_copy, METH_VARARGS,
     "copy(dst, src): dst[:] = src with the GIL released, streaming (non-temporal) stores for the body"},
    {"copy_impl", py_copy_impl, METH_NOARGS, "which copy the streaming fills use"},
    {"crc32c", py_crc32c, METH_VARARGS, "crc32c(data, crc=0): the C loop's CRC32C (tests)"},
    {"crc_impl", py_crc_impl, METH_NOARGS, "which CRC32C the fills use"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_streamloop", NULL, -1, methods};

PyMODINIT_FUNC PyInit__streamloop(void) {
    crc_init();
    cpu_probe();
    return PyModule_Create(&moddef);
}
