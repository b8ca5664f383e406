/* The executor ring's host fast paths in C: publish (try_publish / submit) and wait.
 *
 * Same protocol, same words, same order as the pure-Python producer in ring.py (its module docstring is the
 * specification; this file only implements its producer side). What C buys: a submit is one vectorcall, a few
 * integer checks and eight 8-byte stores (~0.1 us), where the Python closure spends ~0.9 us in bytecode,
 * boxing and struct.pack_into; a wait polls with a CPU pause hint and gives the GIL away between bursts of
 * polls instead of holding it until the interpreter's switch interval.
 *
 * ``_ProducerBase`` is the base class of ring.RingProducer when this module is built (ring.py falls back to an
 * identical pure-Python base otherwise). It owns ``head`` and ``_tail_seen`` as plain members, so Python code
 * and these methods share one copy. Atomicity: with the GIL, a C method that neither calls into Python nor
 * releases the GIL runs as one step for every other Python thread, so concurrent submits from several
 * threads cannot interleave inside a publish (no lock is taken on the fast path). A free-threaded build takes
 * a PyMutex around the publish instead.
 *
 * Memory order: the descriptor words are stored after a release fence (x86-64 needs none: stores are not
 * reordered with older stores; on AArch64, e.g. a Grace host, the fence orders the task's inputs before its
 * descriptor), each word with one relaxed 8-byte atomic store (never torn). ``tail`` and the results are read
 * with acquire loads, so a value is read after the result seq that announced it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CCR_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define CCR_PAUSE() __asm__ __volatile__("yield")
#else
#define CCR_PAUSE() ((void)0)
#endif

/* Rendered from ring.py's constants and checked at bind time (ring.py passes its values in). */
#define SLOT_BYTES 64
#define RESULT_BYTES 16
#define OFF_TAIL 192
#define OFF_STATE 320
#define STATE_RUNNING 1u
#define PAYLOAD_BITS 48
#define NARGS 6

/* Polls before a wait first gives the GIL away, and per burst after that (each poll is one load + pause). */
#define HOT_POLLS 4096
#define BURST_POLLS 1024

typedef struct {
    PyObject_HEAD
    unsigned long long head;      /* tasks published (the seq of the last one) */
    unsigned long long tail_seen; /* the consumer's tail as last read */
    Py_buffer view;               /* the ring's memory, held while bound */
    int bound;
    uint8_t *base;
    uint32_t capacity, mask, slots_off, results_off;
    size_t nbytes;
    PyObject *slow;        /* slow(seq, opcode, a0..a5, aux) -> seq: ring full or consumer not RUNNING */
    PyObject *check;       /* check(opcode, (a0..a5), flags, aux): raises, naming the bad field */
    PyObject *on_spin;     /* on_spin(): between bursts of polls (relaunch an exited consumer) */
    PyObject *on_timeout;  /* on_timeout(ticket, timeout_s): raises */
    PyObject *on_failed;   /* on_failed(ticket, result_seq, value_status): raises */
#ifdef Py_GIL_DISABLED
    PyMutex mu;
#endif
} Producer;

static inline uint64_t load_acq(const uint8_t *p) { return __atomic_load_n((const uint64_t *)p, __ATOMIC_ACQUIRE); }

static inline uint32_t load32_relaxed(const uint8_t *p) {
    return __atomic_load_n((const uint32_t *)p, __ATOMIC_RELAXED);
}

static double monotonic_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int P_traverse(Producer *self, visitproc visit, void *arg) {
    Py_VISIT(self->slow);
    Py_VISIT(self->check);
    Py_VISIT(self->on_spin);
    Py_VISIT(self->on_timeout);
    Py_VISIT(self->on_failed);
    /* view.obj (the ring's memoryview) is not visited: it cannot refer back to us, and a collector that thought
     * it part of a cycle could clear it before our dealloc releases the buffer. */
    return 0;
}

static int P_clear(Producer *self) {
    Py_CLEAR(self->slow);
    Py_CLEAR(self->check);
    Py_CLEAR(self->on_spin);
    Py_CLEAR(self->on_timeout);
    Py_CLEAR(self->on_failed);
    return 0;
}

static void P_dealloc(Producer *self) {
    PyObject_GC_UnTrack(self);
    P_clear(self);
    if (self->bound) {
        PyBuffer_Release(&self->view);
        self->bound = 0;
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int require_bound(Producer *self) {
    if (!self->bound) {
        PyErr_SetString(PyExc_RuntimeError, "ring producer not bound to a ring (RingProducer.__init__ binds it)");
        return -1;
    }
    return 0;
}

/* _bind(buf, capacity, slots_off, results_off): take a writable, contiguous view of the ring's memory. */
static PyObject *P_bind(Producer *self, PyObject *args) {
    PyObject *buf;
    unsigned int cap, so, ro;
    if (!PyArg_ParseTuple(args, "OIII:_bind", &buf, &cap, &so, &ro))
        return NULL;
    if (cap < 2 || (cap & (cap - 1))) {
        PyErr_Format(PyExc_ValueError, "ring capacity must be a power of two >= 2, got %u", cap);
        return NULL;
    }
    Py_buffer v;
    if (PyObject_GetBuffer(buf, &v, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    size_t need = (size_t)ro + (size_t)cap * RESULT_BYTES;
    if ((size_t)v.len < need || (size_t)so + (size_t)cap * SLOT_BYTES > (size_t)ro || ((uintptr_t)v.buf & 7)) {
        PyErr_Format(PyExc_ValueError,
                     "ring buffer of %zd bytes at %p does not hold %u slots at %u and results at %u, 8-byte "
                     "aligned", v.len, v.buf, cap, so, ro);
        PyBuffer_Release(&v);
        return NULL;
    }
    if (self->bound)
        PyBuffer_Release(&self->view);
    self->view = v;
    self->bound = 1;
    self->base = (uint8_t *)v.buf;
    self->nbytes = (size_t)v.len;
    self->capacity = cap;
    self->mask = cap - 1;
    self->slots_off = so;
    self->results_off = ro;
    Py_RETURN_NONE;
}

/* _hooks(slow, check, on_spin, on_timeout, on_failed); None leaves one unset. */
static PyObject *P_hooks(Producer *self, PyObject *args) {
    PyObject *h[5];
    if (!PyArg_ParseTuple(args, "OOOOO:_hooks", &h[0], &h[1], &h[2], &h[3], &h[4]))
        return NULL;
    PyObject **dst[5] = {&self->slow, &self->check, &self->on_spin, &self->on_timeout, &self->on_failed};
    for (int i = 0; i < 5; i++) {
        if (h[i] == Py_None)
            continue;
        Py_INCREF(h[i]);
        Py_XSETREF(*dst[i], h[i]);
    }
    Py_RETURN_NONE;
}

static PyObject *P_tail(Producer *self, PyObject *Py_UNUSED(ignored)) {
    if (require_bound(self) < 0)
        return NULL;
    self->tail_seen = load_acq(self->base + OFF_TAIL);
    return PyLong_FromUnsignedLongLong(self->tail_seen);
}

/* Arguments: opcode, a0..a5, aux[, flags]; positional or by keyword. Unconverted slots stay NULL (zero). */
static const char *const ARG_NAMES[9] = {"opcode", "a0", "a1", "a2", "a3", "a4", "a5", "aux", "flags"};

static int parse_task(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, int nmax, const char *fname,
                      PyObject **obj) {
    for (int i = 0; i < nmax; i++)
        obj[i] = NULL;
    if (nargs > nmax) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d arguments (%zd given)", fname, nmax, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++)
        obj[i] = args[i];
    if (kwnames) {
        Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t k = 0; k < nk; k++) {
            PyObject *name = PyTuple_GET_ITEM(kwnames, k);
            int j = 0;
            for (; j < nmax; j++)
                if (PyUnicode_CompareWithASCIIString(name, ARG_NAMES[j]) == 0)
                    break;
            if (j == nmax) {
                PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", fname, name);
                return -1;
            }
            if (obj[j]) {
                PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fname, ARG_NAMES[j]);
                return -1;
            }
            obj[j] = args[nargs + k];
        }
    }
    if (!obj[0]) {
        PyErr_Format(PyExc_TypeError, "%s() missing required argument 'opcode'", fname);
        return -1;
    }
    return 0;
}

/* Raise the field error through ring.check_fields (one wording for both implementations). */
static int raise_bad_fields(Producer *self, PyObject **obj) {
    PyObject *zero = PyLong_FromLong(0);
    if (!zero)
        return -1;
    PyObject *a = PyTuple_New(NARGS);
    if (!a) {
        Py_DECREF(zero);
        return -1;
    }
    for (int i = 0; i < NARGS; i++) {
        PyObject *o = obj[1 + i] ? obj[1 + i] : zero;
        Py_INCREF(o);
        PyTuple_SET_ITEM(a, i, o);
    }
    PyObject *r = NULL;
    if (self->check) {
        r = PyObject_CallFunctionObjArgs(self->check, obj[0], a, obj[8] ? obj[8] : zero, obj[7] ? obj[7] : zero,
                                         NULL);
    }
    Py_DECREF(a);
    Py_DECREF(zero);
    if (r) {  /* the checker found nothing wrong, yet a field did not convert: say so */
        Py_DECREF(r);
        PyErr_SetString(PyExc_ValueError, "a descriptor field is not an integer in range");
    } else if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_ValueError, "a descriptor field is not an integer in range");
    }
    return -1;
}

/* Convert and validate the fields; on failure raise (through check_fields) and return -1. */
static int convert_task(Producer *self, PyObject **obj, uint64_t *w /* opcode, a0..a5, aux, flags */) {
    int bad = 0;
    for (int i = 0; i < 9; i++) {
        if (!obj[i]) {
            w[i] = 0;
            continue;
        }
        unsigned long long v = PyLong_AsUnsignedLongLong(obj[i]);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            bad = 1;
            break;
        }
        w[i] = v;
    }
    if (!bad) {
        uint64_t any = w[1] | w[2] | w[3] | w[4] | w[5] | w[6];
        bad = (any >> PAYLOAD_BITS) || (w[7] >> 32) || (w[0] >> 16) || (w[8] >> 16);
    }
    return bad ? raise_bad_fields(self, obj) : 0;
}

/* Publish one task: the seq, or 0 when the ring is full by the cached and by the real tail. */
static inline uint64_t publish(Producer *self, const uint64_t *w) {
    uint64_t seq = self->head + 1;
    if (seq - self->tail_seen > self->capacity) {
        self->tail_seen = load_acq(self->base + OFF_TAIL);
        if (seq - self->tail_seen > self->capacity)
            return 0;
    }
    const uint64_t t = ((seq & 0x7FFFu) | 0x8000u) << 48;
    uint64_t *slot = (uint64_t *)(self->base + self->slots_off + ((seq - 1) & self->mask) * SLOT_BYTES);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    __atomic_store_n(&slot[0], w[0] | (w[8] << 16) | t, __ATOMIC_RELAXED);
    for (int i = 1; i <= NARGS; i++)
        __atomic_store_n(&slot[i], w[i] | t, __ATOMIC_RELAXED);
    __atomic_store_n(&slot[7], w[7] | t, __ATOMIC_RELAXED);
    self->head = seq;
    return seq;
}

#ifdef Py_GIL_DISABLED
#define LOCK(self) PyMutex_Lock(&(self)->mu)
#define UNLOCK(self) PyMutex_Unlock(&(self)->mu)
#else
#define LOCK(self) ((void)0)
#define UNLOCK(self) ((void)0)
#endif

/* try_publish(opcode, a0=0, .., a5=0, aux=0, flags=0) -> seq, or 0 when full (nothing written). */
static PyObject *P_try_publish(Producer *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *obj[9];
    uint64_t w[9];
    if (require_bound(self) < 0 || parse_task(args, nargs, kwnames, 9, "try_publish", obj) < 0 ||
        convert_task(self, obj, w) < 0)
        return NULL;
    LOCK(self);
    uint64_t seq = publish(self, w);
    UNLOCK(self);
    return PyLong_FromUnsignedLongLong(seq);
}

/* submit(opcode, a0=0, .., a5=0, aux=0) -> seq. Full ring or a consumer not RUNNING: ``slow`` decides. */
static PyObject *P_submit(Producer *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *obj[9];
    uint64_t w[9];
    if (require_bound(self) < 0 || parse_task(args, nargs, kwnames, 8, "submit", obj) < 0)
        return NULL;
    obj[8] = NULL;
    if (convert_task(self, obj, w) < 0)
        return NULL;
    LOCK(self);
    uint64_t seq = publish(self, w);
    UNLOCK(self);
    if (seq && load32_relaxed(self->base + OFF_STATE) == STATE_RUNNING)
        return PyLong_FromUnsignedLongLong(seq);
    if (!self->slow) {
        if (seq)
            return PyLong_FromUnsignedLongLong(seq);
        PyErr_SetString(PyExc_RuntimeError, "ring full and no slow path set (RingProducer hooks)");
        return NULL;
    }
    PyObject *call[9];
    PyObject *zero = PyLong_FromLong(0), *pseq = PyLong_FromUnsignedLongLong(seq);
    if (!zero || !pseq) {
        Py_XDECREF(zero);
        Py_XDECREF(pseq);
        return NULL;
    }
    call[0] = pseq;
    for (int i = 0; i < 8; i++)
        call[1 + i] = obj[i] ? obj[i] : zero;
    PyObject *r = PyObject_Vectorcall(self->slow, call, 9, NULL);
    Py_DECREF(zero);
    Py_DECREF(pseq);
    return r;
}

/* wait(ticket, timeout_s=10.0) -> the task's 32-bit value; raises on a failed task, an overwritten result or
 * a timeout (through on_failed / on_timeout). */
static PyObject *P_wait(Producer *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[2] = {"ticket", "timeout_s"};
    PyObject *obj[2] = {NULL, NULL};
    if (require_bound(self) < 0)
        return NULL;
    if (nargs > 2) {
        PyErr_Format(PyExc_TypeError, "wait() takes at most 2 arguments (%zd given)", nargs);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++)
        obj[i] = args[i];
    if (kwnames) {
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(kwnames); k++) {
            PyObject *name = PyTuple_GET_ITEM(kwnames, k);
            int j = PyUnicode_CompareWithASCIIString(name, names[0]) == 0   ? 0
                    : PyUnicode_CompareWithASCIIString(name, names[1]) == 0 ? 1
                                                                            : -1;
            if (j < 0 || obj[j]) {
                PyErr_Format(PyExc_TypeError, "wait() got an unexpected or repeated keyword argument '%U'", name);
                return NULL;
            }
            obj[j] = args[nargs + k];
        }
    }
    if (!obj[0]) {
        PyErr_SetString(PyExc_TypeError, "wait() missing required argument 'ticket'");
        return NULL;
    }
    unsigned long long ticket = PyLong_AsUnsignedLongLong(obj[0]);
    if (ticket == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    double timeout_s = 10.0;
    if (obj[1]) {
        timeout_s = PyFloat_AsDouble(obj[1]);
        if (timeout_s == -1.0 && PyErr_Occurred())
            return NULL;
    }
    const uint8_t *res = self->base + self->results_off + ((ticket - 1) & self->mask) * RESULT_BYTES;
    uint64_t r = load_acq(res + 8);
    if (r < ticket) {
        for (int i = 0; i < HOT_POLLS && r < ticket; i++) {
            CCR_PAUSE();
            r = load_acq(res + 8);
        }
        double deadline = 0.0;
        while (r < ticket) {
            if (self->on_spin) {
                PyObject *x = PyObject_CallNoArgs(self->on_spin);
                if (!x)
                    return NULL;
                Py_DECREF(x);
            }
            if (PyErr_CheckSignals() < 0)
                return NULL;
            double now = monotonic_s();
            if (deadline == 0.0) {
                deadline = now + timeout_s;
            } else if (now > deadline) {
                PyObject *x = self->on_timeout ? PyObject_CallFunction(self->on_timeout, "Kd", ticket, timeout_s)
                                               : NULL;
                if (x) {
                    Py_DECREF(x);
                    PyErr_Format(PyExc_TimeoutError, "task %llu not done after %g s", ticket, timeout_s);
                } else if (!PyErr_Occurred()) {
                    PyErr_Format(PyExc_TimeoutError, "task %llu not done after %g s", ticket, timeout_s);
                }
                return NULL;
            }
            r = load_acq(res + 8);
            if (r >= ticket)
                break;
            Py_BEGIN_ALLOW_THREADS
            for (int i = 0; i < BURST_POLLS && r < ticket; i++) {
                CCR_PAUSE();
                r = load_acq(res + 8);
            }
            Py_END_ALLOW_THREADS
        }
    }
    uint64_t vs = load_acq(res);
    if (r != ticket || (vs >> 32)) {
        if (self->on_failed) {
            PyObject *x = PyObject_CallFunction(self->on_failed, "KKK", ticket, (unsigned long long)r,
                                                (unsigned long long)vs);
            if (!x)
                return NULL;
            Py_DECREF(x);
        }
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_RuntimeError, "task %llu: result seq %llu, value|status %#llx", ticket,
                         (unsigned long long)r, (unsigned long long)vs);
        return NULL;
    }
    return PyLong_FromUnsignedLong((unsigned long)(vs & 0xFFFFFFFFu));
}

static PyMethodDef P_methods[] = {
    {"_bind", (PyCFunction)P_bind, METH_VARARGS, "_bind(buf, capacity, slots_off, results_off)"},
    {"_hooks", (PyCFunction)P_hooks, METH_VARARGS, "_hooks(slow, check, on_spin, on_timeout, on_failed)"},
    {"tail", (PyCFunction)P_tail, METH_NOARGS, "Read the consumer's tail (and cache it)."},
    {"try_publish", (PyCFunction)(void (*)(void))P_try_publish, METH_FASTCALL | METH_KEYWORDS,
     "try_publish(opcode, a0=0, .., a5=0, aux=0, flags=0) -> seq, or 0 when the ring is full"},
    {"submit", (PyCFunction)(void (*)(void))P_submit, METH_FASTCALL | METH_KEYWORDS,
     "submit(opcode, a0=0, .., a5=0, aux=0) -> seq (the executor's fast path)"},
    {"wait", (PyCFunction)(void (*)(void))P_wait, METH_FASTCALL | METH_KEYWORDS,
     "wait(ticket, timeout_s=10.0) -> value (the executor's fast path)"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef P_members[] = {
    {"head", T_ULONGLONG, offsetof(Producer, head), 0, "tasks published (seq of the last)"},
    {"_tail_seen", T_ULONGLONG, offsetof(Producer, tail_seen), 0, "the consumer's tail as last read"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject ProducerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "concordia_lab.executor._ringfast._ProducerBase",
    .tp_basicsize = sizeof(Producer),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The ring producer's state and fast paths in C (see ring.RingProducer).",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)P_dealloc,
    .tp_traverse = (traverseproc)P_traverse,
    .tp_clear = (inquiry)P_clear,
    .tp_methods = P_methods,
    .tp_members = P_members,
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_ringfast", "The executor ring's host fast paths in C.", -1, NULL,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ringfast(void) {
    if (PyType_Ready(&ProducerType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m)
        return NULL;
    Py_INCREF(&ProducerType);
    if (PyModule_AddObject(m, "_ProducerBase", (PyObject *)&ProducerType) < 0) {
        Py_DECREF(&ProducerType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "SLOT_BYTES", SLOT_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "RESULT_BYTES", RESULT_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "OFF_TAIL", OFF_TAIL) < 0 || PyModule_AddIntConstant(m, "OFF_STATE", OFF_STATE) < 0 ||
        PyModule_AddIntConstant(m, "STATE_RUNNING", STATE_RUNNING) < 0 ||
        PyModule_AddIntConstant(m, "PAYLOAD_BITS", PAYLOAD_BITS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#ifdef Py_GIL_DISABLED
    PyUnstable_Module_SetGIL(m, Py_MOD_GIL_NOT_USED);
#endif
    return m;
}
