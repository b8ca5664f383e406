/* Copies with streaming (non-temporal) stores for the streamed restore's fills (core/streamed.py,
 * ``RecoveryOptions.nontemporal``): a fill writes a pinned ring slot that the DMA engine reads next, so memcpy's
 * cached stores only add a read of every destination line to the host memory traffic the DMA shares. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

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

static PyMethodDef methods[] = {
    {"copy", py_copy, METH_VARARGS,
     "copy(dst, src): dst[:] = src with the GIL released, streaming (non-temporal) stores for the body"},
    {"copy_impl", py_copy_impl, METH_NOARGS, "which copy the streaming fills use"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_ntcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__ntcopy(void) {
    cpu_probe();
    return PyModule_Create(&moddef);
}
