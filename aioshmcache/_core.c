/* aioshmcache._core: the compiled core of the write path (the module definition).
 *
 * The Python reference of every function here is ``aioshmcache/_core_py.py``: same names, same
 * results, same errors; ``aioshmcache._core_api`` picks one at import (``AIOSHM_PURE=1`` forces
 * the Python one) and the differential tests run both. Layout constants: ``_core.h``.
 */
#include "_core.h"

/* --- the reference tag (``_types.tag_base`` / ``finish_tag``) -------------------------------
 * Python computes on unbounded ints; every input is a 64-bit word, so the low 64 bits of each
 * product are the C product, and ``x * M >> k`` needs the product's bits k..k+63 (128 bits). */
uint64_t
aioshm_tag_base(uint64_t secret, uint64_t epoch, uint64_t address, uint64_t cid, uint64_t length,
             uint64_t position)
{
    uint64_t h = secret ^ (cid * TAG_M1) ^ (address * TAG_M2) ^ (length * TAG_M3) ^ (epoch * TAG_M4);
    return h ^ (uint64_t)(((unsigned __int128)position * TAG_M2) >> 7);
}

uint64_t
aioshm_finish_tag(uint64_t base, uint64_t seq)
{
    uint64_t h = base ^ (uint64_t)(((unsigned __int128)seq * TAG_M3) >> 11);
    h ^= h >> 29;
    return h * TAG_M1;
}

static int
as_u64(PyObject *o, uint64_t *out)
{
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "expected an int, not %.100s", Py_TYPE(o)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_SetString(PyExc_OverflowError, "a 64-bit word must be an int in [0, 2**64)");
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

static PyObject *
core_tag_base(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t v[6];
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "tag_base takes 6 arguments");
        return NULL;
    }
    for (int i = 0; i < 6; i++)
        if (as_u64(args[i], &v[i]) < 0)
            return NULL;
    return PyLong_FromUnsignedLongLong(aioshm_tag_base(v[0], v[1], v[2], v[3], v[4], v[5]));
}

static PyObject *
core_finish_tag(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t base, seq;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "finish_tag takes 2 arguments");
        return NULL;
    }
    if (as_u64(args[0], &base) < 0 || as_u64(args[1], &seq) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(aioshm_finish_tag(base, seq));
}

/* --- the copy into the ring -------------------------------------------------------------------
 * The ring's destination is cold: a normal store first reads each cache line for ownership, so
 * a big copy into it costs about twice a copy into warm memory. Non-temporal (streaming) stores
 * skip that read. They are used for copies of at least ``stream_min`` bytes, with an ``sfence``
 * after; below that, and on other CPUs, plain ``memcpy``. The kind is chosen once at import:
 * AVX2 where the CPU has it, else SSE2 (every x86-64 has it). AVX-512 streaming stores are kept
 * for ``set_stream_kind`` but not chosen: on the AMD EPYC this was measured on, 512-bit
 * streaming stores copied 2-24 % slower than 256-bit ones from 512 KiB up (1 MiB: ~52 against
 * ~45 us; ``bench/bench_core_copy.py``), and no faster below. The GIL is released around
 * copies of ``NOGIL_MIN`` bytes or more. */
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define NOGIL_MIN (64 * 1024)
static Py_ssize_t stream_min = 64 * 1024; /* tuned by bench/bench_core_copy.py */
static const char *stream_kind = "memcpy";
typedef void (*stream_fn)(char *dst, const char *src, size_t n);
static stream_fn stream_copy = NULL;
static uint64_t streamed = 0; /* copies that took the streaming stores (``streamed_copies``) */

#if defined(__x86_64__)
/* Each copies the unaligned head with memcpy, streams the 64-byte aligned body from unaligned
 * loads, then copies the tail; the caller fences. */
#define STREAM_BODY(VEC, LOAD, STORE, W)                                                       \
    size_t head = (size_t)(-(uintptr_t)dst & 63);                                              \
    if (head > n)                                                                              \
        head = n;                                                                              \
    memcpy(dst, src, head);                                                                    \
    dst += head, src += head, n -= head;                                                       \
    for (; n >= 4 * (W); dst += 4 * (W), src += 4 * (W), n -= 4 * (W)) {                       \
        VEC a = LOAD((const VEC *)(src)), b = LOAD((const VEC *)(src + (W)));                  \
        VEC c = LOAD((const VEC *)(src + 2 * (W))), d = LOAD((const VEC *)(src + 3 * (W)));    \
        STORE((VEC *)(dst), a);                                                                \
        STORE((VEC *)(dst + (W)), b);                                                          \
        STORE((VEC *)(dst + 2 * (W)), c);                                                      \
        STORE((VEC *)(dst + 3 * (W)), d);                                                      \
    }                                                                                          \
    memcpy(dst, src, n);

__attribute__((target("avx512f"))) static void
stream_avx512(char *dst, const char *src, size_t n)
{
    STREAM_BODY(__m512i, _mm512_loadu_si512, _mm512_stream_si512, 64)
}

__attribute__((target("avx2"))) static void
stream_avx2(char *dst, const char *src, size_t n)
{
    STREAM_BODY(__m256i, _mm256_loadu_si256, _mm256_stream_si256, 32)
}

static void
stream_sse2(char *dst, const char *src, size_t n)
{
    STREAM_BODY(__m128i, _mm_loadu_si128, _mm_stream_si128, 16)
}
#endif

/* The streaming kinds, widest first; ``ok`` is set at import from the CPU's flags. */
static struct {
    const char *name;
    stream_fn fn;
    int ok;
} stream_kinds[] = {
#if defined(__x86_64__)
    {"avx512", stream_avx512, 0},
    {"avx2", stream_avx2, 0},
    {"sse2", stream_sse2, 0},
#endif
    {NULL, NULL, 0},
};

static void
detect_stream(void)
{
#if defined(__x86_64__)
    __builtin_cpu_init();
    stream_kinds[0].ok = __builtin_cpu_supports("avx512f");
    stream_kinds[1].ok = __builtin_cpu_supports("avx2");
    stream_kinds[2].ok = 1;
    int pick = stream_kinds[1].ok ? 1 : 2; /* AVX2, else SSE2: see the section's comment */
    stream_copy = stream_kinds[pick].fn, stream_kind = stream_kinds[pick].name;
#endif
}

void
aioshm_copy_bytes(char *dst, const char *src, size_t n)
{
    if (dst < src + n && src < dst + n) { /* overlapping (a source viewing the destination's */
        memmove(dst, src, n);             /* mapping): what numpy's copy gives, never streamed */
        return;
    }
    if (stream_copy != NULL && n >= (size_t)stream_min) {
        stream_copy(dst, src, n);
        __atomic_fetch_add(&streamed, 1, __ATOMIC_RELAXED); /* may run without the GIL */
#if defined(__x86_64__)
        _mm_sfence(); /* the streamed stores are ordered before any later store (the commit) */
#endif
    }
    else {
        memcpy(dst, src, n);
    }
}

/* A C-contiguous buffer of ``obj`` (writable if asked), or -1 with the reference's error. */
static int
get_contiguous(PyObject *obj, Py_buffer *view, int writable, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_FULL_RO) < 0) {
        if (PyErr_ExceptionMatches(PyExc_TypeError))
            return -1;
        PyErr_Clear(); /* e.g. numpy refusing to export a datetime dtype */
        PyErr_Format(PyExc_TypeError, "%s does not export its bytes", what);
        return -1;
    }
    if (writable && view->readonly) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError, "%s must be writable", what);
        return -1;
    }
    if (!PyBuffer_IsContiguous(view, 'C')) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError, "%s must be C-contiguous", what);
        return -1;
    }
    return 0;
}

static PyObject *
core_copy_into(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer d, s;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "copy_into takes 3 arguments (dst, offset, src)");
        return NULL;
    }
    if (!PyLong_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "offset must be an int");
        return NULL;
    }
    Py_ssize_t offset = PyLong_AsSsize_t(args[1]);
    if (offset == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "offset out of range");
        return NULL;
    }
    if (get_contiguous(args[0], &d, 1, "dst") < 0)
        return NULL;
    if (get_contiguous(args[2], &s, 0, "src") < 0) {
        PyBuffer_Release(&d);
        return NULL;
    }
    Py_ssize_t n = s.len;
    if (offset < 0 || offset > d.len || n > d.len - offset) {
        PyBuffer_Release(&s);
        PyBuffer_Release(&d);
        PyErr_SetString(PyExc_ValueError, "offset out of range");
        return NULL;
    }
    char *dst = (char *)d.buf + offset;
    if (n >= NOGIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        aioshm_copy_bytes(dst, s.buf, (size_t)n);
        Py_END_ALLOW_THREADS
    }
    else {
        aioshm_copy_bytes(dst, s.buf, (size_t)n);
    }
    PyBuffer_Release(&s);
    PyBuffer_Release(&d);
    Py_RETURN_NONE;
}

/* A new bytes of ``src``'s bytes (a C-contiguous buffer). A big one is copied with the GIL
 * released, as arrays are: a reader's big ``bytes`` value (copied in a worker thread by the
 * async face) otherwise stopped every other thread, its event loop included, for the whole
 * copy. Nobody else holds the new object until it is returned. */
static PyObject *
core_bytes_of(PyObject *self, PyObject *src)
{
    Py_buffer s;
    if (get_contiguous(src, &s, 0, "src") < 0)
        return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, s.len);
    if (out != NULL) {
        char *dst = PyBytes_AS_STRING(out);
        if (s.len >= NOGIL_MIN) {
            Py_BEGIN_ALLOW_THREADS
            memcpy(dst, s.buf, (size_t)s.len);
            Py_END_ALLOW_THREADS
        }
        else if (s.len > 0) {
            memcpy(dst, s.buf, (size_t)s.len);
        }
    }
    PyBuffer_Release(&s);
    return out;
}

static PyObject *
core_copy_info(PyObject *self, PyObject *unused)
{
    return Py_BuildValue("(sn)", stream_kind, stream_min);
}

static PyObject *
core_streamed_copies(PyObject *self, PyObject *unused)
{
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&streamed, __ATOMIC_RELAXED));
}

static PyObject *
core_set_stream_min(PyObject *self, PyObject *arg)
{
    Py_ssize_t v = PyLong_AsSsize_t(arg);
    if (v == -1 && PyErr_Occurred())
        return NULL;
    if (v < 0) {
        PyErr_SetString(PyExc_ValueError, "stream_min must be >= 0");
        return NULL;
    }
    stream_min = v;
    Py_RETURN_NONE;
}

static PyObject *
core_set_stream_kind(PyObject *self, PyObject *arg)
{
    const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
    if (name == NULL) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, "the streaming kind must be a str");
        return NULL;
    }
    if (strcmp(name, "memcpy") == 0) {
        stream_copy = NULL, stream_kind = "memcpy";
        Py_RETURN_NONE;
    }
    for (int i = 0; stream_kinds[i].name != NULL; i++) {
        if (strcmp(name, stream_kinds[i].name) == 0 && stream_kinds[i].ok) {
            stream_copy = stream_kinds[i].fn, stream_kind = stream_kinds[i].name;
            Py_RETURN_NONE;
        }
    }
    PyErr_Format(PyExc_ValueError, "streaming kind %R is not available on this CPU", arg);
    return NULL;
}

static PyObject *
core_stream_kinds(PyObject *self, PyObject *unused)
{
    const char *names[8];
    int n = 0;
    for (int i = 0; stream_kinds[i].name != NULL; i++)
        if (stream_kinds[i].ok)
            names[n++] = stream_kinds[i].name;
    names[n++] = "memcpy";
    PyObject *out = PyTuple_New(n);
    for (int i = 0; out != NULL && i < n; i++) {
        PyObject *v = PyUnicode_FromString(names[i]);
        if (v == NULL)
            Py_CLEAR(out);
        else
            PyTuple_SET_ITEM(out, i, v);
    }
    return out;
}

/* --- loop turns (``_loop_turns``) ----------------------------------------------------------------
 * A count per thread of the loop turns the package's I/O callbacks witnessed: one C call to add
 * a turn, one to read the count (a ``threading.local`` attribute cost ~1.2k instructions more
 * per access, as measured with callgrind on Python 3.11). */
static _Thread_local unsigned long long loop_turns;

static PyObject *
core_loop_turned(PyObject *self, PyObject *unused)
{
    loop_turns++;
    Py_RETURN_NONE;
}

static PyObject *
core_loop_turns(PyObject *self, PyObject *unused)
{
    return PyLong_FromUnsignedLongLong(loop_turns);
}

/* --- layout constants ------------------------------------------------------------------------ */
PyObject *
aioshm_layout_dict(void)
{
    struct { const char *name; unsigned long long value; } items[] = {
        {"MAGIC", AIOSHM_MAGIC}, {"LAYOUT_VERSION", AIOSHM_LAYOUT_VERSION},
        {"HEADER_SIZE", AIOSHM_HEADER_SIZE}, {"H_MAGIC", H_MAGIC}, {"H_VERSION", H_VERSION},
        {"H_CAPACITY", H_CAPACITY}, {"H_RING_OFF", H_RING_OFF}, {"H_NONCE", H_NONCE},
        {"H_EPOCH", H_EPOCH}, {"H_NEXT_ID", H_NEXT_ID}, {"H_WAITING", H_WAITING},
        {"H_HITS", H_HITS}, {"H_MISSES", H_MISSES}, {"H_BYTES_USED", H_BYTES_USED},
        {"H_ITEMS", H_ITEMS}, {"H_SECRET", H_SECRET}, {"H_HEAD_POS", H_HEAD_POS},
        {"SLOT_HEADER", SLOT_HEADER}, {"RS_SESSION", RS_SESSION}, {"RS_HEAD", RS_HEAD},
        {"WS_CONSUMED", WS_CONSUMED}, {"WS_OWED", WS_OWED}, {"LOG_ENTRY_BYTES", LOG_ENTRY_BYTES},
        {"CHUNK_HEADER", CHUNK_HEADER}, {"CHUNK_MAGIC", CHUNK_MAGIC}, {"C_ID", C_ID},
        {"C_LENGTH", C_LENGTH}, {"C_STATE", C_STATE}, {"C_CHECK", C_CHECK},
        {"WRITING", CHUNK_WRITING}, {"COMMITTED", CHUNK_COMMITTED}, {"FREED", CHUNK_FREED},
        {"DEAD", CHUNK_DEAD}, {"TAG_M1", TAG_M1}, {"TAG_M2", TAG_M2}, {"TAG_M3", TAG_M3},
        {"TAG_M4", TAG_M4}, {"PAYLOAD_PREFIX_SIZE", PAYLOAD_PREFIX_SIZE},
        {"PAYLOAD_ALIGN", PAYLOAD_ALIGN},
    };
    PyObject *d = PyDict_New();
    if (d == NULL)
        return NULL;
    for (size_t i = 0; i < sizeof items / sizeof items[0]; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(items[i].value);
        if (v == NULL || PyDict_SetItemString(d, items[i].name, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(v);
    }
    return d;
}

/* --- the module ------------------------------------------------------------------------------ */
static PyMethodDef core_methods[] = {
    {"tag_base", (PyCFunction)(void (*)(void))core_tag_base, METH_FASTCALL,
     "tag_base(secret, epoch, address, cid, length, position) -> the tag's 64-bit base"},
    {"finish_tag", (PyCFunction)(void (*)(void))core_finish_tag, METH_FASTCALL,
     "finish_tag(base, seq) -> the 64-bit tag of hand-out seq"},
    {"copy_into", (PyCFunction)(void (*)(void))core_copy_into, METH_FASTCALL,
     "copy_into(dst, offset, src): src's bytes into dst[offset:] (streaming stores if big)"},
    {"bytes_of", core_bytes_of, METH_O,
     "bytes_of(src) -> a new bytes of src's bytes (the GIL released if big)"},
    {"copy_info", core_copy_info, METH_NOARGS,
     "copy_info() -> (kind, stream_min): the streaming copy in use and its threshold"},
    {"streamed_copies", core_streamed_copies, METH_NOARGS,
     "streamed_copies() -> how many copies took the streaming stores in this process"},
    {"set_stream_min", core_set_stream_min, METH_O,
     "set_stream_min(n): stream copies of n bytes or more (for benchmarks)"},
    {"set_stream_kind", core_set_stream_kind, METH_O,
     "set_stream_kind(kind): copy with this streaming kind, or 'memcpy' (for benchmarks)"},
    {"stream_kinds", core_stream_kinds, METH_NOARGS,
     "stream_kinds() -> the streaming kinds this CPU has, widest first, then 'memcpy'"},
    {"loop_turned", core_loop_turned, METH_NOARGS,
     "loop_turned(): count a loop turn an I/O callback witnessed, in this thread"},
    {"loop_turns", core_loop_turns, METH_NOARGS,
     "loop_turns() -> the loop turns counted in this thread so far"},
    {NULL, NULL, 0, NULL},
};

static int
core_exec(PyObject *m)
{
    detect_stream();
    PyObject *layout = aioshm_layout_dict();
    if (layout == NULL || PyModule_AddObject(m, "LAYOUT", layout) < 0) {
        Py_XDECREF(layout);
        return -1;
    }
    if (aioshm_state_init(m) < 0)
        return -1;
    if (PyModule_AddFunctions(m, aioshm_put_methods) < 0)
        return -1;
    if (PyModule_AddFunctions(m, aioshm_plan_methods) < 0)
        return -1;
    if (aioshm_read_methods != NULL && PyModule_AddFunctions(m, aioshm_read_methods) < 0)
        return -1;
    if (aioshm_read_init != NULL && aioshm_read_init(m) < 0)
        return -1;
    if (aioshm_spec_methods != NULL && PyModule_AddFunctions(m, aioshm_spec_methods) < 0)
        return -1;
    if (aioshm_chan_methods != NULL && PyModule_AddFunctions(m, aioshm_chan_methods) < 0)
        return -1;
    if (aioshm_kept_methods != NULL && PyModule_AddFunctions(m, aioshm_kept_methods) < 0)
        return -1;
    if (aioshm_kept_init != NULL && aioshm_kept_init(m) < 0)
        return -1;
    return 0;
}

static PyModuleDef_Slot core_slots[] = {
    {Py_mod_exec, core_exec},
    {0, NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "aioshmcache._core",
    .m_doc = "The compiled core of aioshmcache (reference: aioshmcache._core_py).",
    .m_size = 0,
    .m_methods = core_methods,
    .m_slots = core_slots,
};

PyMODINIT_FUNC
PyInit__core(void)
{
    return PyModuleDef_Init(&core_module);
}
