/* The writer's counters as C integers: ``RingState`` and ``MapState``, the bases of
 * ``ShmRingBuffer`` (``_ring``) and ``ShardedMap`` (``_sharded_map``).
 *
 * Their reference is ``_core_py.RingState`` / ``MapState``: plain classes whose ``__slots__``
 * hold the same names. Here each field is a signed 64-bit C integer exposed to Python as a
 * member (``T_LONGLONG``): Python reads and writes ``ring._tail`` or ``m.n`` as plain int
 * attributes, and the compiled put (``_core_put.c``) reads and writes the integers in the
 * struct directly instead of reading a Python int from a slot and making a new one for each
 * store (a put touches about twenty of them). Differences from the reference, none of which
 * the package meets: a field is 0 before its first assignment (the reference raises
 * ``AttributeError``), cannot be deleted, and takes only an int in ``[-2**63, 2**63)`` (else
 * ``OverflowError`` or ``TypeError``, the object unchanged). */
#include "_core.h"
#include <stddef.h>
#include <structmember.h>

#define FIELD(name, field, doc)                                                                \
    {name, T_LONGLONG, offsetof(AioshmRingState, field), 0, doc}

static PyMemberDef ring_members[] = {
    FIELD("_tail", tail, "where the next chunk goes (the ring's tail address)"),
    FIELD("_limit", limit, "end of the free run at the tail (-1: none)"),
    FIELD("_end", end, "the number the next chunk gets"),
    FIELD("_head", head, "the number of the oldest chunk"),
    FIELD("_mask", mask, "the FIFO columns' slot mask (their length - 1)"),
    FIELD("_at_mask", at_mask, "the address maps' mask (their count - 1)"),
    FIELD("_lap", lap, "the position of address 0 in the tail's lap"),
    FIELD("used_bytes", used, "bytes between head and tail, the skipped tail included"),
    FIELD("capacity", capacity, "the ring's size in bytes"),
    {NULL, 0, 0, 0, NULL},
};
#undef FIELD

PyTypeObject AioshmRingState_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "aioshmcache._core.RingState",
    .tp_doc = "The ring's counters as C integers (the base of ShmRingBuffer).",
    .tp_basicsize = sizeof(AioshmRingState),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_members = ring_members,
};

static PyMemberDef map_members[] = {
    {"mask", T_LONGLONG, offsetof(AioshmMapState, mask), 0, "the shards' mask (their count - 1)"},
    {"n", T_LONGLONG, offsetof(AioshmMapState, n), 0, "the entries (``len``)"},
    {NULL, 0, 0, 0, NULL},
};

PyTypeObject AioshmMapState_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "aioshmcache._core.MapState",
    .tp_doc = "A sharded map's mask and count as C integers (the base of ShardedMap).",
    .tp_basicsize = sizeof(AioshmMapState),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_members = map_members,
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
