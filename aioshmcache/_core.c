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
static inline uint64_t
tag_base_u64(uint64_t secret, uint64_t epoch, uint64_t address, uint64_t cid, uint64_t length,
             uint64_t position)
{
    uint64_t h = secret ^ (cid * TAG_M1) ^ (address * TAG_M2) ^ (length * TAG_M3) ^ (epoch * TAG_M4);
    return h ^ (uint64_t)(((unsigned __int128)position * TAG_M2) >> 7);
}

static inline uint64_t
finish_tag_u64(uint64_t base, uint64_t seq)
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
    return PyLong_FromUnsignedLongLong(tag_base_u64(v[0], v[1], v[2], v[3], v[4], v[5]));
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
    return PyLong_FromUnsignedLongLong(finish_tag_u64(base, seq));
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
    {NULL, NULL, 0, NULL},
};

static int
core_exec(PyObject *m)
{
    PyObject *layout = aioshm_layout_dict();
    if (layout == NULL || PyModule_AddObject(m, "LAYOUT", layout) < 0) {
        Py_XDECREF(layout);
        return -1;
    }
    if (aioshm_read_methods != NULL && PyModule_AddFunctions(m, aioshm_read_methods) < 0)
        return -1;
    if (aioshm_read_init != NULL && aioshm_read_init(m) < 0)
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
