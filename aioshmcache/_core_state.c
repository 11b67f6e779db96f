/* The writer's counters as C integers: ``RingState`` and ``MapState``, the bases of
 * ``ShmRingBuffer`` (``_ring``) and ``ShardedMap`` (``_sharded_map``).
 *
 * Their reference is ``_core_py.RingState`` / ``MapState``: plain classes whose ``__slots__``
 * hold the same names. Here each field is a signed 64-bit C integer behind a descriptor:
 * Python reads and writes ``ring._tail`` or ``m.n`` as plain int attributes, and the compiled
 * put (``_core_put.c``) reads and writes the integers in the struct directly instead of
 * reading a Python int from a slot and making a new one for each store (a put touches about
 * twenty of them). Differences from the reference, none of which
 * the package meets: a field is 0 before its first assignment (the reference raises
 * ``AttributeError``), cannot be deleted, and takes only an int in ``[-2**63, 2**63)`` (else
 * ``OverflowError`` or ``TypeError``, the object unchanged). */
#include "_core.h"
#include <stddef.h>

/* Each field is a descriptor (getter and setter, the closure its offset): not a ``PyMemberDef``
 * ``T_LONGLONG`` member, whose setter in CPython 3.11 stores -1 before it checks the conversion
 * (a refused value would leave the field at -1). */
static PyObject *
field_get(PyObject *self, void *off)
{
    return PyLong_FromLongLong(*(int64_t *)((char *)self + (size_t)off));
}

static int
field_set(PyObject *self, PyObject *value, void *off)
{
    if (value == NULL) {
        PyErr_SetString(PyExc_TypeError, "a counter of the writer cannot be deleted");
        return -1;
    }
    long long v = PyLong_AsLongLong(value); /* an int, or an object with ``__index__`` */
    if (v == -1 && PyErr_Occurred())
        return -1; /* TypeError or OverflowError; the field as it was */
    *(int64_t *)((char *)self + (size_t)off) = (int64_t)v;
    return 0;
}

#define FIELD(T, name, field, doc)                                                             \
    {name, field_get, field_set, doc, (void *)offsetof(T, field)}

static PyGetSetDef ring_fields[] = {
    FIELD(AioshmRingState, "_tail", tail, "where the next chunk goes (the ring's tail address)"),
    FIELD(AioshmRingState, "_limit", limit, "end of the free run at the tail (-1: none)"),
    FIELD(AioshmRingState, "_end", end, "the number the next chunk gets"),
    FIELD(AioshmRingState, "_head", head, "the number of the oldest chunk"),
    FIELD(AioshmRingState, "_mask", mask, "the FIFO columns' slot mask (their length - 1)"),
    FIELD(AioshmRingState, "_at_mask", at_mask, "the address maps' mask (their count - 1)"),
    FIELD(AioshmRingState, "_lap", lap, "the position of address 0 in the tail's lap"),
    FIELD(AioshmRingState, "used_bytes", used, "bytes between head and tail (skipped tail too)"),
    FIELD(AioshmRingState, "capacity", capacity, "the ring's size in bytes"),
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject AioshmRingState_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "aioshmcache._core.RingState",
    .tp_doc = "The ring's counters as C integers (the base of ShmRingBuffer).",
    .tp_basicsize = sizeof(AioshmRingState),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_getset = ring_fields,
};

static PyGetSetDef map_fields[] = {
    FIELD(AioshmMapState, "mask", mask, "the shards' mask (their count - 1)"),
    FIELD(AioshmMapState, "n", n, "the entries (``len``)"),
    {NULL, NULL, NULL, NULL, NULL},
};
#undef FIELD

PyTypeObject AioshmMapState_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "aioshmcache._core.MapState",
    .tp_doc = "A sharded map's mask and count as C integers (the base of ShardedMap).",
    .tp_basicsize = sizeof(AioshmMapState),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_getset = map_fields,
};

int
aioshm_state_init(PyObject *module)
{
    if (PyType_Ready(&AioshmRingState_Type) < 0 || PyType_Ready(&AioshmMapState_Type) < 0)
        return -1;
    if (PyModule_AddObjectRef(module, "RingState", (PyObject *)&AioshmRingState_Type) < 0 ||
        PyModule_AddObjectRef(module, "MapState", (PyObject *)&AioshmMapState_Type) < 0)
        return -1;
    return 0;
}
