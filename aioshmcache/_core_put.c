/* The compiled put of a plain item: ``put_plain(store, key, plan)``.
 *
 * The store's ``put_now`` (``aioshmcache/_store.py``, the reference) calls it first; it does
 * the same steps for the usual case in one call — duplicate checks, the ring's usual
 * allocation right after the tail (``ShmRingBuffer.try_allocate``), the payload write
 * (``MsgpackSerde.write`` of a plan: prefix and header, zeroed gaps, array bytes), the commit,
 * the tag's base, the row, key and index entries and the usage words (``_publish_put``) —
 * then the hand-out (``hand_out`` below, standing for the store's ``_hand_out_seq``) and
 * returns the ``ShmRef``. Anything else (a duplicate, room that needs the eviction policy, columns to grow, hints, another
 * serde, a source array that is not C-contiguous or changed size, ...) returns None *before
 * any side effect*, and the reference path handles it.
 *
 * Every check and every buffer is taken before the first store. Word stores into the segment
 * are release stores in program order: the ordering argument of ``_ring`` (chunk header, then
 * payload, then the committed state) holds against the compiler as well as the CPU. */
#include "_core.h"
#include <string.h>
#include <structmember.h>

#define MAX_RING_ID ((uint64_t)INT64_MAX)
#define STORE_WORD(p, v) __atomic_store_n((p), (uint64_t)(v), __ATOMIC_RELEASE)

/* --- attribute access through slot offsets ----------------------------------------------------
 * The writer's state lives in ``__slots__`` (the store, its parts, the sharded maps): a look-up
 * by name (``PyObject_GetAttr``) costs ~120-170 instructions, a slot read a few, and a put makes
 * about sixty. ``fast_getattr`` / ``fast_setattr`` read and write a plain object slot
 * (``T_OBJECT_EX``, found by the type's own look-up) at its offset, remembered per (type, name)
 * with the type's version tag — which changes whenever the class is modified, so a class whose
 * attribute was replaced (a property, a monkeypatch) is looked up again, as CPython's own
 * attribute caches do. Anything else — a type with its own ``__getattr__`` or ``__setattr__``,
 * a name that is not such a slot, an unset slot — takes the usual ``PyObject_GetAttr`` /
 * ``PyObject_SetAttr``, so the result is theirs in every case. */
typedef struct {
    PyTypeObject *type; /* not owned: a freed type's successor has another version tag */
    PyObject *name;     /* an interned name of this module (never freed) */
    unsigned int version;
    Py_ssize_t off; /* > 0: the slot's offset; -1: not a slot (the usual look-up) */
    int writable;
} SlotCache;

#define SLOT_CACHE_BITS 10
static SlotCache slot_cache[1 << SLOT_CACHE_BITS];

/* The entry's look-up when it does not hold (type, name) at the type's current version. */
static SlotCache *slot_cache_fill(SlotCache *e, PyTypeObject *t, PyObject *name);

/* The hit is inlined into every caller (a put makes about sixty); the rest is out of line. */
static inline SlotCache *
slot_cache_of(PyTypeObject *t, PyObject *name)
{
    if (!PyType_HasFeature(t, Py_TPFLAGS_VALID_VERSION_TAG))
        return NULL;
    uint64_t h = ((uint64_t)(uintptr_t)t ^ ((uint64_t)(uintptr_t)name << 17)) *
                 UINT64_C(0x9E3779B97F4A7C15); /* Fibonacci hashing: the top bits */
    SlotCache *e = &slot_cache[h >> (64 - SLOT_CACHE_BITS)];
    if (e->type == t && e->name == name && e->version == t->tp_version_tag)
        return e;
    return slot_cache_fill(e, t, name);
}

static SlotCache *
slot_cache_fill(SlotCache *e, PyTypeObject *t, PyObject *name)
{
    PyObject *d = _PyType_Lookup(t, name); /* borrowed; may assign the version tag */
    Py_ssize_t off = -1;
    int writable = 0;
    if (d != NULL && Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type == T_OBJECT_EX && m->offset > 0) {
            off = m->offset;
            writable = !(m->flags & READONLY);
        }
    }
    if (!PyType_HasFeature(t, Py_TPFLAGS_VALID_VERSION_TAG))
        return NULL;
    *e = (SlotCache){t, name, t->tp_version_tag, off, writable};
    return e;
}

static inline PyObject *
fast_getattr(PyObject *obj, PyObject *name)
{
    PyTypeObject *t = Py_TYPE(obj);
    if (t->tp_getattro == PyObject_GenericGetAttr) {
        SlotCache *e = slot_cache_of(t, name);
        if (e != NULL && e->off > 0) {
            PyObject *v = *(PyObject **)((char *)obj + e->off);
            if (v != NULL) {
                Py_INCREF(v);
                return v;
            }
        }
    }
    return PyObject_GetAttr(obj, name);
}

static int
fast_setattr(PyObject *obj, PyObject *name, PyObject *value)
{
    PyTypeObject *t = Py_TYPE(obj);
    if (value != NULL && t->tp_setattro == PyObject_GenericSetAttr) {
        SlotCache *e = slot_cache_of(t, name);
        if (e != NULL && e->off > 0 && e->writable) {
            PyObject **p = (PyObject **)((char *)obj + e->off);
            PyObject *old = *p;
            Py_INCREF(value);
            *p = value;
            Py_XDECREF(old);
            return 0;
        }
    }
    return PyObject_SetAttr(obj, name, value);
}

static PyObject *ref_type, *plan_type, *serde_type;
static PyObject *s_index, *s_pending, *s_waiting, *s_ring, *s_serde, *s_rows, *s_keys;
static PyObject *s_secret, *s_nonce, *s_guarded, *s_has_hints, *s_hand_out_seq, *s_seg;
static PyObject *s_tail, *s_limit, *s_end, *s_head, *s_mask, *s_addr, *s_size, *s_id, *s_cpos;
static PyObject *s_state, *s_at, *s_at_mask, *s_lap, *s_used, *s_w, *s_hw, *s_closed, *s_forked;
static PyObject *s_layout, *s_sources, *s_shards, *s_n, *s_map_mask, *s_pins;
static PyObject *s_evict, *s_acks, *s_entries, *s_hints, *s_marked, *s_second_chance;
static PyObject *s_evict_slack, *s_evictions, *s_on_evict, *s_capacity;

static int
intern_names(void)
{
    struct { PyObject **p; const char *s; } names[] = {
        {&s_index, "_index"}, {&s_pending, "_pending"}, {&s_waiting, "_waiting_keys"},
        {&s_ring, "ring"}, {&s_serde, "serde"}, {&s_rows, "_rows"}, {&s_keys, "_keys"},
        {&s_secret, "_secret"}, {&s_nonce, "_nonce"}, {&s_guarded, "guarded"}, {&s_pins, "_pins"},
        {&s_has_hints, "_has_hints"}, {&s_hand_out_seq, "_hand_out_seq"}, {&s_seg, "_seg"},
        {&s_tail, "_tail"}, {&s_limit, "_limit"}, {&s_end, "_end"}, {&s_head, "_head"},
        {&s_mask, "_mask"}, {&s_addr, "_addr"}, {&s_size, "_size"}, {&s_id, "_id"},
        {&s_cpos, "_cpos"}, {&s_state, "_state"}, {&s_at, "_at"}, {&s_at_mask, "_at_mask"},
        {&s_lap, "_lap"}, {&s_used, "used_bytes"}, {&s_w, "_w"}, {&s_hw, "_hw"},
        {&s_closed, "closed"}, {&s_forked, "forked"}, {&s_layout, "_layout"},
        {&s_sources, "_sources"}, {&s_shards, "shards"}, {&s_n, "n"},
        {&s_map_mask, "mask"}, {&s_evict, "_evict"}, {&s_acks, "_acks"},
        {&s_entries, "_entries"}, {&s_hints, "_hints"}, {&s_marked, "marked"},
        {&s_second_chance, "second_chance"}, {&s_evict_slack, "evict_slack"},
        {&s_evictions, "evictions"}, {&s_on_evict, "on_evict"}, {&s_capacity, "capacity"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (*names[i].p == NULL && (*names[i].p = PyUnicode_InternFromString(names[i].s)) == NULL)
            return -1;
    return 0;
}

/* ``configure(ShmRef, _Plan, MsgpackSerde)``: the types the fast path recognises. */
static PyObject *
core_configure(PyObject *self, PyObject *args)
{
    PyObject *r, *p, *s;
    if (!PyArg_ParseTuple(args, "O!O!O!:configure", &PyType_Type, &r, &PyType_Type, &p,
                          &PyType_Type, &s))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)r, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "the reference type must be a tuple subclass");
        return NULL;
    }
    if (intern_names() < 0)
        return NULL;
    Py_INCREF(r), Py_INCREF(p), Py_INCREF(s);
    Py_XSETREF(ref_type, r);
    Py_XSETREF(plan_type, p);
    Py_XSETREF(serde_type, s);
    Py_RETURN_NONE;
}

/* --- small helpers: each returns -1 with an exception set, or 1 for "decline" ------------- */

/* An exact int as int64 (1: not an exact int in range; -1: error). A put reads about thirty:
 * on CPython 3.11 one of at most two digits is read directly (what
 * ``PyLong_AsLongLongAndOverflow`` computes, without its generic steps); else that call. */
static inline int
as_i64(PyObject *v, int64_t *out)
{
    if (!PyLong_CheckExact(v))
        return 1;
#if PY_VERSION_HEX < 0x030C0000
    Py_ssize_t size = Py_SIZE(v);
    const digit *d = ((PyLongObject *)v)->ob_digit;
    if (size >= -1 && size <= 1) {
        *out = size == 0 ? 0 : size * (int64_t)d[0];
        return 0;
    }
    if (size == 2 || size == -2) {
        int64_t x = (int64_t)d[0] | ((int64_t)d[1] << PyLong_SHIFT);
        *out = size < 0 ? -x : x;
        return 0;
    }
#endif
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (x == -1 && PyErr_Occurred())
        return -1;
    if (overflow)
        return 1;
    *out = x;
    return 0;
}

/* ``PyLong_AsUnsignedLongLong(v)`` (the same result and errors), an exact int of at most
 * three digits read directly on CPython 3.11: that call converts through a byte array
 * (~100 instructions), and a put converts a few 64-bit words (secret, sessions, seq). */
static inline uint64_t
u64_of(PyObject *v)
{
#if PY_VERSION_HEX < 0x030C0000 && PyLong_SHIFT == 30
    if (PyLong_CheckExact(v)) {
        Py_ssize_t size = Py_SIZE(v);
        const digit *d = ((PyLongObject *)v)->ob_digit;
        if (size >= 0 && size <= 2)
            return size == 0 ? 0 : size == 1 ? d[0] : (uint64_t)d[0] | (uint64_t)d[1] << 30;
        if (size == 3 && d[2] < 16) /* 60 + 4 bits */
            return (uint64_t)d[0] | (uint64_t)d[1] << 30 | (uint64_t)d[2] << 60;
    }
#endif
    return PyLong_AsUnsignedLongLong(v);
}

/* An int attribute as int64 (1: not an int in range; -1: error). */
static int
get_i64(PyObject *obj, PyObject *name, int64_t *out)
{
    PyObject *v = fast_getattr(obj, name);
    if (v == NULL)
        return -1;
    int rc = as_i64(v, out);
    Py_DECREF(v);
    return rc;
}

static int
set_i64(PyObject *obj, PyObject *name, int64_t value)
{
    PyObject *v = PyLong_FromLongLong(value);
    if (v == NULL)
        return -1;
    int rc = fast_setattr(obj, name, v);
    Py_DECREF(v);
    return rc;
}

/* --- the writer's counters (``_core_state.c``) ------------------------------------------------
 * A ring or a sharded map whose base is the core's ``RingState`` / ``MapState`` (always, when
 * this core is the one in use) has its ints read and written in its struct; any other object
 * (e.g. one built on the pure core's bases) through its attributes, as before. */
#define IS_RING_STATE(o) PyObject_TypeCheck((o), &AioshmRingState_Type)
#define IS_MAP_STATE(o) PyObject_TypeCheck((o), &AioshmMapState_Type)

/* A ring's int field: its struct's (``off``: its offset there), else the attribute ``name``. */
static int
ring_get(PyObject *ring, PyObject *name, size_t off, int64_t *out)
{
    if (IS_RING_STATE(ring)) {
        *out = *(int64_t *)((char *)ring + off);
        return 0;
    }
    return get_i64(ring, name, out);
}

static int
ring_set(PyObject *ring, PyObject *name, size_t off, int64_t value)
{
    if (IS_RING_STATE(ring)) {
        *(int64_t *)((char *)ring + off) = value;
        return 0;
    }
    return set_i64(ring, name, value);
}

#define RING_GET(ring, field, out) ring_get((ring), s_##field, offsetof(AioshmRingState, field), (out))
#define RING_SET(ring, field, v) ring_set((ring), s_##field, offsetof(AioshmRingState, field), (v))

/* ``m.n += delta`` of a sharded map; the new count in ``out`` (if not NULL). 0, or -1. */
static int
map_count_add(PyObject *map, int64_t delta, int64_t *out)
{
    int64_t n;
    if (IS_MAP_STATE(map)) {
        n = ((AioshmMapState *)map)->n += delta;
    }
    else {
        int rc = get_i64(map, s_n, &n);
        if (rc != 0) {
            if (rc == 1)
                PyErr_SetString(PyExc_RuntimeError, "internal error: a map's count is not an int");
            return -1;
        }
        n += delta;
        if (set_i64(map, s_n, n) < 0)
            return -1;
    }
    if (out != NULL)
        *out = n;
    return 0;
}

/* A writable buffer of exactly what the reference reads as words (1: not such a buffer).
 * With ``borrow``, a live memoryview's own buffer as it is (``view->obj`` NULL: nothing to
 * release; the export and its release cost ~120 instructions, and a put takes seven): only
 * for a caller that runs no Python code until its last use of the buffer, so nothing can
 * release the view meanwhile. Else an export (a view cannot be released while exported). */
static int
get_words(PyObject *obj, PyObject *name, Py_buffer *view, int borrow)
{
    PyObject *v = fast_getattr(obj, name);
    if (v == NULL)
        return -1;
    if (borrow && Py_IS_TYPE(v, &PyMemoryView_Type) &&
        !(((PyMemoryViewObject *)v)->flags & _Py_MEMORYVIEW_RELEASED)) {
        Py_buffer *b = PyMemoryView_GET_BUFFER(v);
        if (!b->readonly && b->itemsize == 8 && b->ndim == 1 && b->len % 8 == 0 &&
            (b->strides == NULL || b->strides[0] == 8)) { /* one C-contiguous row of words */
            *view = *b;
            view->obj = NULL; /* borrowed: ``PyBuffer_Release`` does nothing */
            Py_DECREF(v);     /* still held by ``obj`` (no Python code runs to change that) */
            return 0;
        }
    }
    int rc = PyObject_GetBuffer(v, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT);
    Py_DECREF(v);
    if (rc < 0) {
        PyErr_Clear();
        return 1;
    }
    if (view->itemsize != 8 || view->len % 8 != 0) {
        PyBuffer_Release(view);
        return 1;
    }
    return 0;
}

/* ``m.shards[hash(key) & m.mask]`` of a ``ShardedMap`` (new reference), and ``m`` itself. */
static PyObject *
shard_of(PyObject *map, PyObject *key)
{
    Py_hash_t h = PyObject_Hash(key);
    if (h == -1)
        return NULL;
    PyObject *shards = fast_getattr(map, s_shards);
    if (shards == NULL)
        return NULL;
    int64_t mask;
    int rc = 0;
    if (IS_MAP_STATE(map))
        mask = ((AioshmMapState *)map)->mask;
    else
        rc = get_i64(map, s_map_mask, &mask);
    if (rc != 0 || !PyList_CheckExact(shards) || PyList_GET_SIZE(shards) != mask + 1) {
        Py_DECREF(shards);
        if (rc == 0 || rc == 1)
            PyErr_SetString(PyExc_RuntimeError, "internal error: not a ShardedMap");
        return NULL;
    }
    PyObject *d = PyList_GET_ITEM(shards, (Py_ssize_t)((uint64_t)h & (uint64_t)mask));
    Py_INCREF(d);
    Py_DECREF(shards);
    if (!PyDict_CheckExact(d)) {
        Py_DECREF(d);
        PyErr_SetString(PyExc_RuntimeError, "internal error: a shard is not a dict");
        return NULL;
    }
    return d;
}


/* A slice of exact ints ``[start, stop)`` within ``[0, limit]`` (0), else 1: the plan's own
 * slices. Anything else (an int subclass, whose ``__index__`` is Python code and could answer
 * differently when the copy reads the slice again) is the reference's. */
static int
slice_bounds(PyObject *sl, Py_ssize_t limit, Py_ssize_t *start, Py_ssize_t *stop)
{
    if (!PySlice_Check(sl))
        return 1;
    PySliceObject *so = (PySliceObject *)sl;
    if (so->step != Py_None || !PyLong_CheckExact(so->start) || !PyLong_CheckExact(so->stop))
        return 1;
    Py_ssize_t a = PyLong_AsSsize_t(so->start), b = a < 0 ? -1 : PyLong_AsSsize_t(so->stop);
    if (PyErr_Occurred()) {
        PyErr_Clear(); /* past Py_ssize_t: never a plan's */
        return 1;
    }
    *start = a, *stop = b;
    return a < 0 || a > b || b > limit;
}

#define MAX_SOURCES 64 /* the serde's flat items (``_FLAT_MAX``); more: the reference path */
#define NOGIL_COPY (64 * 1024) /* a source's copy from this size lets go of the GIL */

typedef struct {
    Py_buffer col[5]; /* the ring's columns: address, size, id, position, state */
    int ncol;
    Py_buffer ring, hw;
    int has_ring, has_hw;
    Py_buffer src[MAX_SOURCES];
    int nsrc;
} Held;

static void
release_all(Held *h)
{
    for (int i = 0; i < h->ncol; i++)
        PyBuffer_Release(&h->col[i]);
    for (int i = 0; i < h->nsrc; i++)
        PyBuffer_Release(&h->src[i]);
    if (h->has_ring)
        PyBuffer_Release(&h->ring);
    if (h->has_hw)
        PyBuffer_Release(&h->hw);
}

/* Is ``obj.<name>`` a true bool attribute (1), false (0); -1: error. */
static int
attr_true(PyObject *obj, PyObject *name)
{
    PyObject *v = fast_getattr(obj, name);
    if (v == NULL)
        return -1;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

#define DECLINE()                                                                              \
    do {                                                                                       \
        result = Py_None;                                                                      \
        Py_INCREF(result);                                                                     \
        goto done;                                                                             \
    } while (0)
#define CHECK(rc)                                                                              \
    do {                                                                                       \
        int rc_ = (rc);                                                                        \
        if (rc_ < 0)                                                                           \
            goto done;                                                                         \
        if (rc_ > 0)                                                                           \
            DECLINE();                                                                         \
    } while (0)
#define NEED(ptr)                                                                              \
    do {                                                                                       \
        if ((ptr) == NULL)                                                                     \
            goto done;                                                                         \
    } while (0)

/* ``ShmRef(nonce, epoch, address, id, length, tag, position, seq)`` as the store builds it
 * (``tuple.__new__``: no Python-level ``__new__``). */
static PyObject *
new_ref(PyObject *nonce, uint64_t epoch, uint64_t address, PyObject *cid_obj, uint64_t length,
        uint64_t tag, uint64_t position, PyObject *seq_obj)
{
    PyObject *t = PyLong_FromUnsignedLongLong(tag), *ep = PyLong_FromUnsignedLongLong(epoch);
    PyObject *addr = PyLong_FromUnsignedLongLong(address);
    PyObject *len = PyLong_FromUnsignedLongLong(length);
    PyObject *pos = PyLong_FromUnsignedLongLong(position);
    PyObject *result = NULL;
    /* what ``tuple.__new__(ShmRef, fields)`` makes (its ``tp_alloc``, the items set; the
     * generic allocation tracks it), without the two tuples it copies from */
    if (t && ep && addr && len && pos)
        result = ((PyTypeObject *)ref_type)->tp_alloc((PyTypeObject *)ref_type, 8);
    if (result != NULL) {
        PyObject *items[8] = {nonce, ep, addr, cid_obj, len, t, pos, seq_obj};
        for (Py_ssize_t i = 0; i < 8; i++)
            PyTuple_SET_ITEM(result, i, Py_NewRef(items[i]));
    }
    Py_XDECREF(t), Py_XDECREF(ep), Py_XDECREF(addr), Py_XDECREF(len), Py_XDECREF(pos);
    return result;
}

/* --- the publish step (``_publish_put``), shared by ``put_plain`` and ``publish_plain`` ---- */
typedef struct {
    PyObject *index, *ishard, *rows, *keys, *guarded, *nonce; /* from the store */
    PyObject *cid_obj, *rshard, *kshard;                        /* of the chunk */
    uint64_t secret, cid;
} Pub;

static void
pub_clear(Pub *p)
{
    PyObject **all[] = {&p->index, &p->ishard, &p->rows,   &p->keys,  &p->guarded,
                        &p->nonce, &p->cid_obj, &p->rshard, &p->kshard};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        Py_CLEAR(*all[i]);
}

/* What the publish step reads of the store (no side effect): 0, 1 (decline) or -1. ``index``
 * and ``ishard``: a caller's index and the key's shard of it, if known (else NULL), used when
 * that index is the store's own. */
static int
pub_prepare(PyObject *store, PyObject *key, Pub *p, PyObject *index, PyObject *ishard)
{
    if ((p->index = fast_getattr(store, s_index)) == NULL)
        return -1;
    if (ishard != NULL && index == p->index)
        p->ishard = Py_NewRef(ishard);
    else if ((p->ishard = shard_of(p->index, key)) == NULL)
        return -1;
    if (
        (p->rows = fast_getattr(store, s_rows)) == NULL ||
        (p->keys = fast_getattr(store, s_keys)) == NULL ||
        (p->nonce = fast_getattr(store, s_nonce)) == NULL)
        return -1;
    PyObject *pins = fast_getattr(store, s_pins); /* the pins part holds the guard */
    if (pins == NULL)
        return -1;
    p->guarded = fast_getattr(pins, s_guarded);
    Py_DECREF(pins);
    if (p->guarded == NULL)
        return -1;
    if (p->guarded != Py_None && !PyDict_CheckExact(p->guarded))
        return 1;
    PyObject *secret = fast_getattr(store, s_secret);
    if (secret == NULL)
        return -1;
    int ok = PyLong_CheckExact(secret) && PyLong_CheckExact(p->nonce);
    p->secret = ok ? u64_of(secret) : 0;
    Py_DECREF(secret);
    if (ok && p->secret == (uint64_t)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        ok = 0;
    }
    return ok ? 0 : 1;
}

/* The chunk's id and the row and key shards it goes to. */
static int
pub_chunk(Pub *p, uint64_t cid)
{
    p->cid = cid;
    if ((p->cid_obj = PyLong_FromUnsignedLongLong(cid)) == NULL ||
        (p->rshard = shard_of(p->rows, p->cid_obj)) == NULL ||
        (p->kshard = shard_of(p->keys, p->cid_obj)) == NULL)
        return -1;
    return 0;
}

/* --- the hand-out (``Acknowledgements.hand_out``, the reference) ------------------------------
 * ``hand_out(acks, cid)``: the writer's usual hand-out of a chunk in a broadcast store whose
 * reader slots did not change since the last look: the next ``seq``, owed by the live sessions.
 * A chunk the ledger does not track yet (every put's first hand-out) gets one ``Debts``
 * (``out = {seq: (owers, now)}``) if anyone owes it; a tracked one (a look-up hit while an
 * earlier hand-out is unacknowledged: an engine channel's every call) gets the seq added to its
 * ``out``, its ``debt`` raised and its touch ended (``HandoutLedger.hand_out``,
 * ``_retire`` included). Then the sessions' counts and their ``WS_OWED`` words; the drain once
 * the hand-outs since the last one could fill half a log (the Python ``drain``). The ledger's own
 * state, so both cores keep one. None (nothing done) for the rest — one-of-N, a slot whose
 * session changed (``sync_sessions``), anything of an unexpected type — and the reference
 * runs.
 *
 * ``configure_hand_out(Acknowledgements, HandoutLedger, Debts)`` names the classes: a store whose
 * ``_hand_out_seq`` is not the reference's method (e.g. a test's) has it called as it is. Their
 * state is read and written through the offsets of their ``__slots__`` (each a plain object
 * slot, checked here), on objects of exactly those types: an attribute look-up costs ~170
 * instructions, a slot a few, and a hand-out makes about twenty. */
static PyObject *drain_func, *hand_out_func, *acks_type, *ledger_type, *debts_type;
static PyObject *slot_state_type, *reader_table_type;
static PyObject *empty_tuple, *py_zero;
static PyObject *s_sessions_v, *s_owed_words, *s_log_entries, *s_drain, *s_all, *s_stride;
static PyObject *s_settle_from, *s_publish_owed;
static Py_ssize_t o_a_ledger, o_a_readers, o_a_known, o_a_live, o_a_live_slots, o_a_undrained;
static Py_ssize_t o_a_one_of_n, o_a_slots, o_l_one_of_n, o_l_entries, o_l_owed, o_l_next_seq;
static Py_ssize_t o_l_clock, o_l_progress;
static Py_ssize_t o_d_id, o_d_out, o_d_debt, o_d_pins, o_d_touched;
static Py_ssize_t o_s_session, o_s_cursor, o_s_alive;

#define SLOT(obj, off) (*(PyObject **)((char *)(obj) + (off)))

/* The offset of ``type``'s slot ``name`` (a writable object slot), or -1 with an error. */
static Py_ssize_t
slot_offset(PyObject *type, const char *name)
{
    PyObject *d = PyObject_GetAttrString(type, name);
    if (d == NULL)
        return -1;
    Py_ssize_t off = -1;
    if (Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type == T_OBJECT_EX && !(m->flags & READONLY) && m->offset > 0)
            off = m->offset;
    }
    Py_DECREF(d);
    if (off < 0)
        PyErr_Format(PyExc_TypeError, "%s is not a slot of %R", name, type);
    return off;
}

/* A slot's object as a new reference (1: unset; 0: ok). */
static int
slot_get(PyObject *obj, Py_ssize_t off, PyObject **out)
{
    PyObject *v = SLOT(obj, off);
    if (v == NULL)
        return 1;
    Py_INCREF(v);
    *out = v;
    return 0;
}

static void
slot_set(PyObject *obj, Py_ssize_t off, PyObject *v)
{
    PyObject *old = SLOT(obj, off);
    Py_INCREF(v);
    SLOT(obj, off) = v;
    Py_XDECREF(old);
}

/* A time the ledger keeps (a hand-out's, a touch's, or none): exactly a float, an int or None,
 * whose release runs no Python code. The clock is a Python callable (a test's may return any
 * object, a float subclass with a finalizer): anything else is the reference's to keep. */
static inline int
plain_time(PyObject *v)
{
    return v == Py_None || PyFloat_CheckExact(v) || PyLong_CheckExact(v);
}

static PyObject *
core_configure_hand_out(PyObject *self, PyObject *args)
{
    PyObject *a, *l, *d, *st, *rt;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!:configure_hand_out", &PyType_Type, &a, &PyType_Type,
                          &l, &PyType_Type, &d, &PyType_Type, &st, &PyType_Type, &rt))
        return NULL;
    struct { PyObject **p; const char *s; } names[] = {
        {&s_sessions_v, "_sessions"}, {&s_owed_words, "owed_words"},
        {&s_log_entries, "log_entries"}, {&s_drain, "drain"}, {&s_all, "_all"},
        {&s_stride, "_stride"}, {&s_settle_from, "settle_from"},
        {&s_publish_owed, "publish_owed"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (*names[i].p == NULL && (*names[i].p = PyUnicode_InternFromString(names[i].s)) == NULL)
            return NULL;
    if (empty_tuple == NULL && (empty_tuple = PyTuple_New(0)) == NULL)
        return NULL;
    if (py_zero == NULL && (py_zero = PyLong_FromLong(0)) == NULL)
        return NULL;
    struct { Py_ssize_t *p; PyObject *t; const char *s; } slots[] = {
        {&o_a_ledger, a, "_ledger"}, {&o_a_readers, a, "_readers"},
        {&o_a_known, a, "_known_sessions"}, {&o_a_live, a, "live_sessions"},
        {&o_a_live_slots, a, "live_slots"}, {&o_a_undrained, a, "_undrained"},
        {&o_a_one_of_n, a, "one_of_n"}, {&o_a_slots, a, "slots"},
        {&o_l_one_of_n, l, "one_of_n"}, {&o_l_entries, l, "entries"}, {&o_l_owed, l, "owed"},
        {&o_l_next_seq, l, "next_seq"}, {&o_l_clock, l, "clock"},
        {&o_l_progress, l, "_progress"}, {&o_d_id, d, "id"}, {&o_d_out, d, "out"},
        {&o_d_debt, d, "debt"}, {&o_d_pins, d, "pins"},
        {&o_d_touched, d, "touched_at"}, {&o_s_session, st, "session"},
        {&o_s_cursor, st, "cursor"}, {&o_s_alive, st, "alive"},
    };
    for (size_t i = 0; i < sizeof slots / sizeof slots[0]; i++)
        if ((*slots[i].p = slot_offset(slots[i].t, slots[i].s)) < 0)
            return NULL;
    PyObject *f = PyObject_GetAttrString(a, "hand_out");
    if (f == NULL)
        return NULL;
    Py_XSETREF(hand_out_func, f);
    PyObject *dr = _PyType_Lookup((PyTypeObject *)a, s_drain); /* borrowed */
    if (dr == NULL) {
        PyErr_SetString(PyExc_TypeError, "the acknowledgements' class has no drain");
        return NULL;
    }
    Py_INCREF(dr);
    Py_XSETREF(drain_func, dr);
    Py_INCREF(a), Py_INCREF(l), Py_INCREF(d), Py_INCREF(st), Py_INCREF(rt);
    Py_XSETREF(acks_type, a);
    Py_XSETREF(ledger_type, l);
    Py_XSETREF(debts_type, d);
    Py_XSETREF(slot_state_type, st);
    Py_XSETREF(reader_table_type, rt);
    Py_RETURN_NONE;
}

/* A strided buffer of native 8-byte words (1: not such a buffer); ``borrow`` as for
 * ``get_words`` (a live memoryview's own buffer, for a caller that runs no Python code until
 * its last use of it). */
static int
get_strided(PyObject *obj, PyObject *name, Py_buffer *view, int writable, int borrow)
{
    PyObject *v = fast_getattr(obj, name);
    if (v == NULL)
        return -1;
    if (borrow && Py_IS_TYPE(v, &PyMemoryView_Type) &&
        !(((PyMemoryViewObject *)v)->flags & _Py_MEMORYVIEW_RELEASED)) {
        Py_buffer *b = PyMemoryView_GET_BUFFER(v);
        if ((!writable || !b->readonly) && b->ndim == 1 && b->itemsize == 8 &&
            b->format != NULL && strcmp(b->format, "Q") == 0 && b->strides != NULL &&
            b->strides[0] % 8 == 0) {
            *view = *b;
            view->obj = NULL; /* borrowed: ``PyBuffer_Release`` does nothing */
            Py_DECREF(v);
            return 0;
        }
    }
    int rc = PyObject_GetBuffer(v, view, PyBUF_STRIDES | PyBUF_FORMAT |
                                             (writable ? PyBUF_WRITABLE : 0));
    Py_DECREF(v);
    if (rc < 0) {
        PyErr_Clear();
        return 1;
    }
    if (view->ndim != 1 || view->itemsize != 8 || view->format == NULL ||
        strcmp(view->format, "Q") != 0 || view->strides == NULL || view->strides[0] % 8 != 0) {
        PyBuffer_Release(view);
        return 1;
    }
    return 0;
}

/* The most live sessions a compiled hand-out takes (a segment has up to 256 reader slots):
 * their distinctness is checked pairwise; more are the reference's, whose cost is then the
 * sessions' own anyway. */
#define MAX_LIVE 32

static PyObject *call_drain(PyObject *acks); /* below, with the drain */

/* The hand-out itself: a new reference to its seq, Py_None (declined) or NULL. */
static PyObject *
hand_out_acks(PyObject *acks, PyObject *cid_obj)
{
    PyObject *result = NULL, *ledger = NULL, *readers = NULL, *known = NULL, *live = NULL;
    PyObject *live_slots = NULL, *entries = NULL, *owed = NULL, *next = NULL, *clock = NULL;
    PyObject *now = NULL, *seq1 = NULL, *e = NULL, *owers = NULL, *out = NULL;
    PyObject *pair = NULL, *debt = NULL, *und1 = NULL, *v = NULL, *tracked = NULL;
    Py_buffer sess, words;
    int has_sess = 0, has_words = 0, gc_off = 0, gc_was = 0;
    int64_t seq, und, log_entries;
    /* --- every check, no side effect --- */
    if ((PyObject *)Py_TYPE(acks) != acks_type)
        DECLINE();
    CHECK(slot_get(acks, o_a_ledger, &ledger));
    if ((PyObject *)Py_TYPE(ledger) != ledger_type || SLOT(acks, o_a_one_of_n) != Py_False ||
        SLOT(ledger, o_l_one_of_n) != Py_False)
        DECLINE(); /* one-of-N: the reference */
    CHECK(slot_get(ledger, o_l_entries, &entries));
    CHECK(slot_get(ledger, o_l_owed, &owed));
    if (!PyDict_CheckExact(entries) || !PyDict_CheckExact(owed))
        DECLINE();
    /* tracked (owed, pinned or touched): its ``Debts``, with exactly the reference's types */
    int64_t old_debt = 0, pins = 0;
    if ((tracked = PyDict_GetItemWithError(entries, cid_obj)) != NULL) {
        Py_INCREF(tracked);
        if ((PyObject *)Py_TYPE(tracked) != debts_type)
            DECLINE();
        PyObject *id = SLOT(tracked, o_d_id), *o = SLOT(tracked, o_d_out);
        PyObject *d = SLOT(tracked, o_d_debt);
        PyObject *p = SLOT(tracked, o_d_pins);
        if (id == NULL || o == NULL || d == NULL || p == NULL ||
            SLOT(tracked, o_d_touched) == NULL || !plain_time(SLOT(tracked, o_d_touched)) ||
            !PyDict_CheckExact(o) || !PyLong_CheckExact(id) || !PyLong_CheckExact(d) ||
            !PyLong_CheckExact(p))
            DECLINE();
        int same = PyObject_RichCompareBool(id, cid_obj, Py_EQ); /* ints: no Python code */
        CHECK(same < 0 ? -1 : !same);
        CHECK(as_i64(d, &old_debt));
        CHECK(as_i64(p, &pins));
        if (old_debt < 0 || old_debt > INT64_MAX - MAX_LIVE || pins < 0)
            DECLINE();
        Py_INCREF(o);
        out = o;
    }
    else if (PyErr_Occurred())
        goto done;
    CHECK(slot_get(ledger, o_l_next_seq, &next)); /* the seq this hand-out gets: that int */
    CHECK(as_i64(next, &seq));
    if (seq < 0 || seq == INT64_MAX)
        DECLINE();
    CHECK(slot_get(acks, o_a_readers, &readers));
    CHECK(slot_get(acks, o_a_known, &known));
    if (!PyList_CheckExact(known) || (PyObject *)Py_TYPE(readers) != reader_table_type)
        DECLINE(); /* the table's attributes are then plain slots: no Python code reads them */
    CHECK(get_strided(readers, s_sessions_v, &sess, 0, 1)); /* read at once, only C between */
    has_sess = 1;
    Py_ssize_t n_slots = sess.shape[0];
    if (PyList_GET_SIZE(known) != n_slots)
        DECLINE();
    for (Py_ssize_t i = 0; i < n_slots; i++) {
        PyObject *k = PyList_GET_ITEM(known, i);
        uint64_t w = __atomic_load_n((uint64_t *)((char *)sess.buf + i * sess.strides[0]),
                                     __ATOMIC_ACQUIRE);
        if (!PyLong_CheckExact(k))
            DECLINE();
        uint64_t kv = u64_of(k);
        if (kv == (uint64_t)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            DECLINE();
        }
        if (kv != w)
            DECLINE(); /* a session changed: the reference syncs them first */
    }
    CHECK(slot_get(acks, o_a_live, &live));
    CHECK(slot_get(acks, o_a_live_slots, &live_slots));
    if (!PyTuple_CheckExact(live) || !PyList_CheckExact(live_slots) ||
        PyTuple_GET_SIZE(live) != PyList_GET_SIZE(live_slots))
        DECLINE();
    Py_ssize_t n_live = PyTuple_GET_SIZE(live);
    if (n_live > MAX_LIVE)
        DECLINE();
    int64_t owes[MAX_LIVE];         /* each live session's count before this hand-out */
    Py_ssize_t owes_slot[MAX_LIVE]; /* and its slot */
    uint64_t owes_session[MAX_LIVE];
    PyObject *live_obj[MAX_LIVE]; /* the sessions as listed (borrowed from the tuple) */
    for (Py_ssize_t i = 0; i < n_live; i++) {
        PyObject *s = PyTuple_GET_ITEM(live, i), *pair = PyList_GET_ITEM(live_slots, i);
        if (!PyLong_CheckExact(s) || !PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2 ||
            !PyLong_CheckExact(PyTuple_GET_ITEM(pair, 0)) || PyTuple_GET_ITEM(pair, 1) != s)
            DECLINE();
        /* distinct sessions, as the counts below assume (the reference counts a session once
         * per slot holding it; two slots with one session are a reader table gone wrong) */
        owes_session[i] = u64_of(s);
        if (owes_session[i] == (uint64_t)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            DECLINE();
        }
        for (Py_ssize_t j = 0; j < i; j++)
            if (owes_session[j] == owes_session[i])
                DECLINE();
        Py_ssize_t slot = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 0));
        if (slot == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            DECLINE();
        }
        if (slot < 0 || slot >= n_slots)
            DECLINE();
        owes_slot[i] = slot, live_obj[i] = s;
    }
    CHECK(slot_get(acks, o_a_undrained, &v));
    CHECK(as_i64(v, &und));
    Py_CLEAR(v);
    CHECK(get_i64(readers, s_log_entries, &log_entries));
    if (und < 0 || und == INT64_MAX)
        DECLINE();
    NEED(seq1 = PyLong_FromLongLong(seq + 1));
    NEED(und1 = PyLong_FromLongLong(und + 1));
    if (n_live) { /* the entry, built before any change (its clock read first) */
        CHECK(slot_get(ledger, o_l_clock, &clock));
        NEED(now = PyObject_CallNoArgs(clock));
        /* From here to the drain no Python code may run: the collector, which an allocation
         * can start (Python 3.11), could run a finalizer that reaches this ledger or closes
         * the store under the borrowed debt words. Off until the drain (``settle_pairs``). */
        gc_was = PyGC_Disable(), gc_off = 1;
        /* The clock is Python code: what was read before it is read again (the seq, the
         * hand-outs since the drain, the live sessions, the entry), and anything changed
         * declines to the reference; the counts and the entry's debt are read only now. */
        int64_t seq_now, und_now;
        PyObject *still = PyDict_GetItemWithError(entries, cid_obj); /* borrowed */
        if (still == NULL && PyErr_Occurred())
            goto done;
        if (still != tracked || SLOT(ledger, o_l_next_seq) == NULL ||
            SLOT(acks, o_a_undrained) == NULL || SLOT(acks, o_a_live) != live)
            DECLINE();
        CHECK(as_i64(SLOT(ledger, o_l_next_seq), &seq_now));
        CHECK(as_i64(SLOT(acks, o_a_undrained), &und_now));
        if (seq_now != seq || und_now != und)
            DECLINE();
        for (Py_ssize_t i = 0; i < n_live; i++) {
            PyObject *o = PyDict_GetItemWithError(owed, live_obj[i]); /* borrowed */
            if (o == NULL && PyErr_Occurred())
                goto done;
            owes[i] = 0;
            if (o != NULL)
                CHECK(as_i64(o, &owes[i]));
            if (owes[i] < 0 || owes[i] == INT64_MAX)
                DECLINE();
        }
        if (!plain_time(now))
            DECLINE(); /* kept in the entry, untracked: a plain time only */
        if (tracked != NULL) {
            PyObject *d = SLOT(tracked, o_d_debt), *touched = SLOT(tracked, o_d_touched);
            if (d == NULL || !PyLong_CheckExact(d) || SLOT(tracked, o_d_out) != out ||
                touched == NULL || !plain_time(touched))
                DECLINE(); /* the touch ended below must release no Python code */
            CHECK(as_i64(d, &old_debt));
            if (old_debt < 0 || old_debt > INT64_MAX - MAX_LIVE)
                DECLINE();
        }
        /* the slots' debt words, after the clock (Python code): borrowed, only C from here */
        CHECK(get_strided(readers, s_owed_words, &words, 1, 1));
        has_words = 1;
        if (words.shape[0] != n_slots)
            DECLINE();
        owers = live; /* the live sessions' own tuple, shared by the hand-outs (the ledger
                       * replaces owers, never changes them); ints only (see below) */
        Py_INCREF(owers);
        PyObject_GC_UnTrack(owers);
        NEED(pair = PyTuple_Pack(2, owers, now)); /* ints and a float: untracked, as ``out`` */
        PyObject_GC_UnTrack(pair);
        NEED(debt = PyLong_FromLongLong(old_debt + n_live));
    }
    if (n_live && tracked == NULL) {
        NEED(e = ((PyTypeObject *)debts_type)->tp_new((PyTypeObject *)debts_type, empty_tuple,
                                                      NULL));
        NEED(out = PyDict_New());
        if (PyDict_SetItem(out, next, pair) < 0)
            goto done;
        slot_set(e, o_d_id, cid_obj);
        slot_set(e, o_d_out, out);
        slot_set(e, o_d_debt, debt);
        slot_set(e, o_d_pins, py_zero);
        slot_set(e, o_d_touched, Py_None);
        /* The entry holds ints, a float, None and these containers of ints and floats: it can
         * never be part of a reference cycle, so the collector need not walk it (as CPython
         * untracks such dicts and tuples itself). A put made four tracked objects, and each
         * young collection walked every one of them: ~1.5k instructions a put with a reader
         * attached (before ``out`` held pairs: a second dict of times). (The ledger's Python code may track ``out`` again when it stores in it;
         * nothing it stores in the entry could make a cycle either.) */
        PyObject_GC_UnTrack(out);
        if (PyType_IS_GC(Py_TYPE(e)))
            PyObject_GC_UnTrack(e);
    }
    /* --- side effects, in the reference's order --- */
    slot_set(ledger, o_l_next_seq, seq1);
    if (tracked != NULL) { /* ``hand_out(e)``: this seq owed, the touch ended, then ``_retire`` */
        if (n_live) {
            if (PyDict_SetItem(out, next, pair) < 0)
                goto done;
            slot_set(tracked, o_d_debt, debt);
        }
        slot_set(tracked, o_d_touched, Py_None);
        if (PyDict_GET_SIZE(out) == 0 && pins == 0 && PyDict_DelItem(entries, cid_obj) < 0)
            goto done; /* idle (it was tracked for a touch alone): no longer tracked */
    }
    if (n_live) {
        if (tracked == NULL && PyDict_SetItem(entries, cid_obj, e) < 0)
            goto done;
        /* each live session owes one more (the live sessions are distinct), and its slot's
         * word publishes the count, for inspect */
        for (Py_ssize_t i = 0; i < n_live; i++) {
            PyObject *c1 = PyLong_FromLongLong(owes[i] + 1);
            if (c1 == NULL || PyDict_SetItem(owed, PyTuple_GET_ITEM(live, i), c1) < 0) {
                Py_XDECREF(c1);
                goto done;
            }
            Py_DECREF(c1);
            STORE_WORD((uint64_t *)((char *)words.buf + owes_slot[i] * words.strides[0]),
                       owes[i] + 1);
        }
    }
    slot_set(acks, o_a_undrained, und1);
    /* ``undrained * 2 >= log_entries`` (the drain's turn), without the product */
    if (und + 1 >= log_entries / 2 + (log_entries % 2 != 0)) {
        if (has_sess) /* the drain reads these words itself */
            PyBuffer_Release(&sess), has_sess = 0;
        if (has_words)
            PyBuffer_Release(&words), has_words = 0;
        if (gc_off && gc_was) /* Python code again */
            PyGC_Enable();
        gc_off = 0;
        PyObject *r = call_drain(acks);
        if (r == NULL)
            goto done;
        Py_DECREF(r);
    }
    result = next;
    next = NULL;
done:
    if (has_sess)
        PyBuffer_Release(&sess);
    if (has_words)
        PyBuffer_Release(&words);
    if (gc_off && gc_was)
        PyGC_Enable();
    Py_XDECREF(ledger), Py_XDECREF(readers), Py_XDECREF(known), Py_XDECREF(live);
    Py_XDECREF(live_slots), Py_XDECREF(entries), Py_XDECREF(owed), Py_XDECREF(next);
    Py_XDECREF(clock), Py_XDECREF(now), Py_XDECREF(seq1), Py_XDECREF(e), Py_XDECREF(v);
    Py_XDECREF(owers), Py_XDECREF(out), Py_XDECREF(pair), Py_XDECREF(debt), Py_XDECREF(und1);
    Py_XDECREF(tracked);
    return result;
}

static PyObject *
core_hand_out(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "hand_out takes 2 arguments (acks, cid)");
        return NULL;
    }
    if (debts_type == NULL || !PyLong_CheckExact(args[1]))
        Py_RETURN_NONE;
    return hand_out_acks(args[0], args[1]);
}

/* --- the settlement (``HandoutLedger.settle_all``, the reference) ----------------------------
 * ``settle_pairs(ledger, acks, session)``: ``settle_all``'s loop over the flat ``(cid, seq)``
 * pairs of ``acks`` that ``session`` acknowledged (its caller read the clock and recorded the
 * session's progress first). A pair settles a hand-out still out: a one-of-N one, or a broadcast
 * one ``session`` owes (one debt less for the entry and the session; its owers replaced by a
 * tuple without it, or the hand-out dropped with its last debt); an entry left idle is no
 * longer tracked (``_retire``). Returns ``(settled, done)``: the pairs settled and how many ints
 * of ``acks`` it went through. The reference goes on from ``done``: ``len(acks)`` in the usual
 * case, earlier at a pair whose entry, hand-out or count is of a type the core does not know
 * (checked before anything of that pair changes).
 *
 * No Python code runs meanwhile: ints hash and compare, the dicts and tuples hold ints and
 * floats, the ``Debts`` an entry drops has no code of its own, and the garbage collector is
 * off for the call. (On Python 3.11 an allocation can start a collection, which can run
 * finalizers, and one of those could reach this ledger: a review made one release the very
 * hand-outs being settled, and the owers tuple read from ``out`` was freed under the loop.) */
static int
settle_pairs(PyObject *ledger, PyObject *acks, PyObject *session, Py_ssize_t *settled_out,
             Py_ssize_t *done_out)
{
    Py_ssize_t k = 0, settled = 0;
    *settled_out = *done_out = 0;
    if (debts_type == NULL || (PyObject *)Py_TYPE(ledger) != ledger_type ||
        !PyList_CheckExact(acks) || PyList_GET_SIZE(acks) % 2 || !PyLong_CheckExact(session))
        return 0;
    PyObject *entries = SLOT(ledger, o_l_entries), *owed = SLOT(ledger, o_l_owed);
    if (entries == NULL || owed == NULL || !PyDict_CheckExact(entries) || !PyDict_CheckExact(owed))
        return 0;
    Py_INCREF(entries), Py_INCREF(owed);
    int gc_was = PyGC_Disable(), result = -1;
    PyObject *e = NULL;
    for (; k < PyList_GET_SIZE(acks); k += 2) {
        PyObject *cid = PyList_GET_ITEM(acks, k), *seq = PyList_GET_ITEM(acks, k + 1);
        if (!PyLong_CheckExact(cid) || !PyLong_CheckExact(seq))
            break;
        Py_CLEAR(e);
        if ((e = PyDict_GetItemWithError(entries, cid)) == NULL) {
            if (PyErr_Occurred())
                goto done;
            continue; /* not tracked: nothing out */
        }
        Py_INCREF(e);
        if ((PyObject *)Py_TYPE(e) != debts_type)
            break;
        PyObject *out = SLOT(e, o_d_out);
        PyObject *debt = SLOT(e, o_d_debt), *pins = SLOT(e, o_d_pins);
        PyObject *touched = SLOT(e, o_d_touched);
        int64_t d = 0, p = 0, ow = 0;
        int rd = debt == NULL ? 1 : as_i64(debt, &d), rp = pins == NULL ? 1 : as_i64(pins, &p);
        if (rd < 0 || rp < 0)
            goto done;
        if (out == NULL || touched == NULL || !PyDict_CheckExact(out) || rd || rp ||
            d == INT64_MIN)
            break;
        PyObject *pair = PyDict_GetItemWithError(out, seq); /* borrowed: nothing frees it here */
        if (pair == NULL) {
            if (PyErr_Occurred())
                goto done;
            continue; /* not out (released, expired, or never handed to this reader) */
        }
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2)
            break;
        PyObject *owers = PyTuple_GET_ITEM(pair, 0), *when = PyTuple_GET_ITEM(pair, 1);
        if (!plain_time(when) || when == Py_None)
            break; /* released below with the pair: it must run no Python code */
        Py_ssize_t at = -1, n = 0;
        if (owers != Py_None) { /* broadcast: ints only, and owed by this session? */
            if (!PyTuple_CheckExact(owers))
                break;
            n = PyTuple_GET_SIZE(owers);
            Py_ssize_t i;
            for (i = 0; i < n; i++) {
                PyObject *s = PyTuple_GET_ITEM(owers, i);
                if (!PyLong_CheckExact(s))
                    break;
                if (at < 0) {
                    int eq = PyObject_RichCompareBool(s, session, Py_EQ); /* ints: only C */
                    if (eq < 0)
                        goto done;
                    if (eq)
                        at = i;
                }
            }
            if (i < n)
                break; /* an ower that is not an int */
            if (at < 0)
                continue;
            PyObject *o = PyDict_GetItemWithError(owed, session);
            if (o == NULL && PyErr_Occurred())
                goto done;
            int ro = o == NULL ? 0 : as_i64(o, &ow);
            if (ro < 0)
                goto done;
            if (ro || ow == INT64_MIN)
                break;
        }
        int last = owers == Py_None || n == 1;
        /* --- this pair's changes (the reference's, in another order: nothing runs between) --- */
        if (!last) { /* the owers without this session (``_without``), handed out when it was */
            PyObject *rest = PyTuple_New(n - 1), *again = NULL;
            if (rest == NULL)
                goto done;
            for (Py_ssize_t i = 0, j = 0; i < n; i++)
                if (i != at)
                    PyTuple_SET_ITEM(rest, j++, Py_NewRef(PyTuple_GET_ITEM(owers, i)));
            again = PyTuple_Pack(2, rest, when);
            Py_DECREF(rest);
            if (again == NULL)
                goto done;
            PyObject_GC_UnTrack(rest); /* ints only: ``out`` stays untracked (the hand-out's) */
            PyObject_GC_UnTrack(again);
            int rc = PyDict_SetItem(out, seq, again); /* ``pair`` and ``owers`` may go */
            Py_DECREF(again);
            if (rc < 0)
                goto done;
        }
        PyObject *d1 = PyLong_FromLongLong(d - 1);
        if (d1 == NULL)
            goto done;
        slot_set(e, o_d_debt, d1);
        Py_DECREF(d1);
        if (owers != Py_None) {
            PyObject *o1 = PyLong_FromLongLong(ow - 1);
            if (o1 == NULL || PyDict_SetItem(owed, session, o1) < 0) {
                Py_XDECREF(o1);
                goto done;
            }
            Py_DECREF(o1);
        }
        settled++;
        if (!last)
            continue;
        if (PyDict_DelItem(out, seq) < 0)
            goto done;
        if (PyDict_GET_SIZE(out) == 0 && p == 0 && touched == Py_None &&
            PyDict_DelItem(entries, cid) < 0) /* ``_retire``: idle, no longer tracked */
            goto done;
    }
    *settled_out = settled, *done_out = k;
    result = 0;
done:
    Py_XDECREF(e);
    Py_DECREF(entries), Py_DECREF(owed);
    if (gc_was)
        PyGC_Enable();
    return result;
}

static PyObject *
core_settle_pairs(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "settle_pairs takes 3 arguments (ledger, acks, session)");
        return NULL;
    }
    Py_ssize_t settled, done;
    if (settle_pairs(args[0], args[1], args[2], &settled, &done) < 0)
        return NULL;
    return Py_BuildValue("(nn)", settled, done);
}

/* ``settle_all(pairs, session)`` as a drain calls it, ``top`` the highest seq of the pairs: the
 * ledger's clock read once, the session's progress recorded, then the pairs settled
 * (``settle_pairs``, then ``settle_from`` where it stopped). 0, or -1 with an exception. */
static int
settle_logged(PyObject *ledger, PyObject *pairs, PyObject *session, uint64_t top)
{
    PyObject *clock = NULL, *now = NULL, *progress = NULL, *top_obj = NULL, *record = NULL;
    int rc = -1;
    if (slot_get(ledger, o_l_clock, &clock) != 0) {
        PyErr_SetString(PyExc_AttributeError, "the ledger has no clock");
        goto done;
    }
    if ((now = PyObject_CallNoArgs(clock)) == NULL)
        goto done;
    if (slot_get(ledger, o_l_progress, &progress) != 0 || !PyDict_CheckExact(progress)) {
        PyErr_SetString(PyExc_TypeError, "the ledger's progress is not a dict");
        goto done;
    }
    if ((top_obj = PyLong_FromUnsignedLongLong(top)) == NULL)
        goto done;
    PyObject *best = top_obj, *prev = PyDict_GetItemWithError(progress, session), *p0 = NULL;
    if (prev == NULL && PyErr_Occurred())
        goto done;
    if (prev != NULL) { /* ``max(top, prev[0])`` */
        Py_INCREF(prev);
        p0 = PySequence_GetItem(prev, 0);
        Py_DECREF(prev);
        if (p0 == NULL)
            goto done;
        int gt = PyObject_RichCompareBool(p0, top_obj, Py_GT);
        if (gt < 0) {
            Py_DECREF(p0);
            goto done;
        }
        if (gt)
            best = p0;
    }
    record = PyTuple_Pack(2, best, now);
    Py_XDECREF(p0);
    if (record == NULL || PyDict_SetItem(progress, session, record) < 0)
        goto done;
    Py_ssize_t settled, k;
    if (settle_pairs(ledger, pairs, session, &settled, &k) < 0)
        goto done;
    if (k < PyList_GET_SIZE(pairs)) { /* the reference goes on from there */
        PyObject *start = PyLong_FromSsize_t(k);
        if (start == NULL)
            goto done;
        PyObject *r = PyObject_CallMethodObjArgs(ledger, s_settle_from, pairs, session, start,
                                                 NULL);
        Py_DECREF(start);
        if (r == NULL)
            goto done;
        Py_DECREF(r);
    }
    rc = 0;
done:
    Py_XDECREF(clock), Py_XDECREF(now), Py_XDECREF(progress), Py_XDECREF(top_obj);
    Py_XDECREF(record);
    return rc;
}

/* A slot as a drain first read it: its state, that state's session and cursor (new references:
 * Python code run meanwhile may replace them), and the head read then. */
typedef struct {
    PyObject *st, *session, *cursor;
    uint64_t head;
} SlotSnap;

/* Whether slot ``i`` is still as ``snap`` read it (the same state object, session and cursor in
 * the same list): else Python code run meanwhile changed or took it, and the drain leaves it. */
static inline int
slot_unchanged(PyObject *slots, Py_ssize_t i, const SlotSnap *snap)
{
    return i < PyList_GET_SIZE(slots) && PyList_GET_ITEM(slots, i) == snap->st &&
           SLOT(snap->st, o_s_session) == snap->session &&
           SLOT(snap->st, o_s_cursor) == snap->cursor;
}

/* A slot of a drain (``snap``, its cursor below its head; ``w`` its words): its new pairs
 * settled if its reader may settle (one-of-N, or a live broadcast session), then the cursor of
 * that state and the slot's ``WS_CONSUMED`` moved to the head, as the reference does whatever
 * the settlement's Python code did meanwhile. 0, or -1 with an exception. */
static int
drain_slot(PyObject *ledger, const SlotSnap *snap, uint64_t *w, int64_t log_entries, int one_of_n)
{
    uint64_t cur = u64_of(snap->cursor), n = snap->head - cur;
    int live = SLOT(snap->st, o_s_alive) == Py_True && Py_SIZE(snap->session) != 0;
    if (one_of_n || live) {
        PyObject *pairs = PyList_New(2 * (Py_ssize_t)n);
        if (pairs == NULL)
            return -1;
        const uint64_t *log = w + SLOT_HEADER / 8; /* entry k: words 2k (id) and 2k + 1 (seq) */
        uint64_t top = 0;
        for (uint64_t j = 0; j < n; j++) {
            uint64_t at = (cur + j) % (uint64_t)log_entries;
            uint64_t seq = log[2 * at + 1];
            PyObject *c = PyLong_FromUnsignedLongLong(log[2 * at]);
            PyObject *q = c == NULL ? NULL : PyLong_FromUnsignedLongLong(seq);
            if (q == NULL) {
                Py_XDECREF(c);
                Py_DECREF(pairs);
                return -1;
            }
            PyList_SET_ITEM(pairs, 2 * j, c);
            PyList_SET_ITEM(pairs, 2 * j + 1, q);
            top = seq > top ? seq : top;
        }
        int rc = settle_logged(ledger, pairs, snap->session, top);
        Py_DECREF(pairs);
        if (rc < 0)
            return -1;
    }
    PyObject *h = PyLong_FromUnsignedLongLong(snap->head);
    if (h == NULL)
        return -1;
    slot_set(snap->st, o_s_cursor, h);
    Py_DECREF(h);
    STORE_WORD(w + WS_CONSUMED, snap->head);
    return 0;
}

/* ``publish_owed``: each slot's debt, ``max(0, owed.get(session, 0))``, in its ``WS_OWED`` word
 * (of ``rows`` slots mapped); the method (the reference) for anything not a plain count, or
 * where Python code replaced the slots or the ledger meanwhile. */
static int
publish_owed(PyObject *acks, PyObject *ledger, PyObject *slots, uint64_t *words, int64_t stride,
             Py_ssize_t rows)
{
    PyObject *owed = SLOT(ledger, o_l_owed);
    Py_ssize_t n = PyList_GET_SIZE(slots);
    int plain = owed != NULL && PyDict_CheckExact(owed) && n <= rows &&
                SLOT(acks, o_a_slots) == slots && SLOT(acks, o_a_ledger) == ledger;
    for (Py_ssize_t i = 0; plain && i < n; i++) {
        PyObject *st = PyList_GET_ITEM(slots, i), *s;
        if ((PyObject *)Py_TYPE(st) != slot_state_type || (s = SLOT(st, o_s_session)) == NULL ||
            !PyLong_CheckExact(s)) {
            plain = 0;
            break;
        }
        if (Py_SIZE(s) == 0)
            continue; /* a free slot */
        PyObject *o = PyDict_GetItemWithError(owed, s); /* ints: no Python code */
        int64_t v = 0;
        if (o == NULL && PyErr_Occurred())
            return -1;
        if (o != NULL && as_i64(o, &v) != 0) {
            PyErr_Clear();
            plain = 0;
            break;
        }
        STORE_WORD(words + i * stride + WS_OWED, v > 0 ? v : 0);
    }
    if (plain)
        return 0;
    PyObject *r = PyObject_CallMethodNoArgs(acks, s_publish_owed);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* --- the drain (``Acknowledgements.drain``, the reference) ------------------------------------
 * ``drain_logs(acks)``: the writer's usual drain of the readers' acknowledgement logs, when every
 * slot's session is the one the writer knows (no attach, close or replacement to sync) and
 * every log holds between 0 and ``log_entries`` new entries. For each slot with new entries, in
 * slot order: its ``(cid, seq)`` pairs read into one flat list; if the slot's reader may settle
 * (one-of-N, or a live broadcast session) the ledger's clock read, the session's progress
 * recorded and the pairs settled (``settle_pairs``, then ``HandoutLedger.settle_from`` from
 * where it stopped: ``settle_all``); then the slot's cursor and ``WS_CONSUMED`` word moved to
 * its head. Then each session's debt published (``publish_owed``). Returns how many entries it
 * read; None, before any side effect, for anything else (the reference runs).
 *
 * The clock and ``settle_from`` may be Python code. The reader table stays mapped meanwhile
 * (this holds a buffer of it), the collector is off (no finalizer runs), and a slot is taken
 * only if its state, session and cursor are still the objects read first (a nested drain, or a
 * replaced state, leaves it as it is then), as the reference skips a slot whose state no longer
 * holds the session in shared memory or whose cursor is at its head. Every head is read before
 * the first settlement: an
 * acknowledgement a reader writes meanwhile waits for the next drain, as one written by
 * another process while this runs. */
static PyObject *
drain_logs(PyObject *acks)
{
    PyObject *result = NULL, *ledger = NULL, *readers = NULL, *known = NULL, *slots = NULL;
    SlotSnap snap[256];
    Py_buffer all;
    int has_all = 0, gc_was = 0, gc_off = 0;
    Py_ssize_t n_slots = 0, n_snap = 0;
    int64_t stride, log_entries;
    /* --- every check, no side effect --- */
    if (slot_state_type == NULL || (PyObject *)Py_TYPE(acks) != acks_type)
        DECLINE();
    CHECK(slot_get(acks, o_a_ledger, &ledger));
    CHECK(slot_get(acks, o_a_readers, &readers));
    CHECK(slot_get(acks, o_a_known, &known));
    CHECK(slot_get(acks, o_a_slots, &slots));
    PyObject *one_of_n = SLOT(acks, o_a_one_of_n);
    if ((PyObject *)Py_TYPE(ledger) != ledger_type || !PyList_CheckExact(known) ||
        (PyObject *)Py_TYPE(readers) != reader_table_type || !PyList_CheckExact(slots) ||
        (one_of_n != Py_True && one_of_n != Py_False))
        DECLINE();
    n_slots = PyList_GET_SIZE(slots);
    if (n_slots > 256 || PyList_GET_SIZE(known) != n_slots)
        DECLINE();
    CHECK(get_i64(readers, s_stride, &stride));
    CHECK(get_i64(readers, s_log_entries, &log_entries));
    CHECK(get_strided(readers, s_all, &all, 1, 0)); /* held: the table stays mapped */
    has_all = 1;
    if (all.strides[0] != 8 || stride < SLOT_HEADER / 8 || log_entries < 1 ||
        log_entries > (stride - SLOT_HEADER / 8) / 2 || all.shape[0] / stride < n_slots)
        DECLINE();
    uint64_t *words = (uint64_t *)all.buf;
    int any = 0;
    for (Py_ssize_t i = 0; i < n_slots; i++) {
        PyObject *st = PyList_GET_ITEM(slots, i), *k = PyList_GET_ITEM(known, i);
        if ((PyObject *)Py_TYPE(st) != slot_state_type || !PyLong_CheckExact(k))
            DECLINE();
        PyObject *session = SLOT(st, o_s_session), *cursor = SLOT(st, o_s_cursor);
        PyObject *alive = SLOT(st, o_s_alive);
        if (session == NULL || cursor == NULL || !PyLong_CheckExact(session) ||
            !PyLong_CheckExact(cursor) || (alive != Py_True && alive != Py_False))
            DECLINE();
        uint64_t *w = words + i * stride;
        /* the session around the head, as the reference reads them: a slot claimed or closed
         * meanwhile is the reference's */
        uint64_t s0 = __atomic_load_n(w + RS_SESSION, __ATOMIC_ACQUIRE);
        uint64_t head = __atomic_load_n(w + RS_HEAD, __ATOMIC_ACQUIRE);
        uint64_t s1 = __atomic_load_n(w + RS_SESSION, __ATOMIC_ACQUIRE);
        uint64_t kv = u64_of(k), sv = u64_of(session), cur = u64_of(cursor);
        if (PyErr_Occurred()) { /* a word out of range: not this core's case */
            PyErr_Clear();
            DECLINE();
        }
        if (s0 != s1 || s0 != kv || s0 != sv || head < cur ||
            head - cur > (uint64_t)log_entries)
            DECLINE(); /* a session to sync, or a corrupted log: the reference */
        snap[i] = (SlotSnap){st, session, cursor, head};
        any |= head != cur;
    }
    for (Py_ssize_t i = 0; i < n_slots; i++)
        Py_INCREF(snap[i].st), Py_INCREF(snap[i].session), Py_INCREF(snap[i].cursor);
    n_snap = n_slots;
    /* --- side effects, in the reference's order --- */
    slot_set(acks, o_a_undrained, py_zero);
    if (!any) {
        result = PyLong_FromLong(0);
        goto done;
    }
    gc_was = PyGC_Disable(), gc_off = 1;
    uint64_t n_total = 0;
    for (Py_ssize_t i = 0; i < n_slots; i++) {
        uint64_t n = snap[i].head - u64_of(snap[i].cursor);
        if (n == 0 || !slot_unchanged(slots, i, &snap[i]))
            continue; /* nothing new, or changed by Python code meanwhile (left as it is) */
        if (drain_slot(ledger, &snap[i], words + i * stride, log_entries, one_of_n == Py_True) < 0)
            goto done;
        n_total += n;
    }
    if (publish_owed(acks, ledger, slots, words, stride, all.shape[0] / stride) < 0)
        goto done;
    result = PyLong_FromUnsignedLongLong(n_total);
done:
    if (gc_off && gc_was)
        PyGC_Enable();
    if (has_all)
        PyBuffer_Release(&all);
    for (Py_ssize_t i = 0; i < n_snap; i++)
        Py_DECREF(snap[i].st), Py_DECREF(snap[i].session), Py_DECREF(snap[i].cursor);
    Py_XDECREF(ledger), Py_XDECREF(readers), Py_XDECREF(known), Py_XDECREF(slots);
    return result;
}

/* ``acks.drain()``: the compiled drain, or the method where it declines (and always a method
 * that is not the reference's, e.g. a test's). A new reference to the count, or NULL. */
static PyObject *
call_drain(PyObject *acks)
{
    if (s_drain == NULL && (s_drain = PyUnicode_InternFromString("drain")) == NULL)
        return NULL;
    if (drain_func != NULL && _PyType_Lookup(Py_TYPE(acks), s_drain) == drain_func) {
        PyObject *r = drain_logs(acks);
        if (r != Py_None)
            return r;
        Py_DECREF(r);
    }
    return PyObject_CallMethodNoArgs(acks, s_drain);
}

static PyObject *
core_drain_logs(PyObject *self, PyObject *acks)
{
    return drain_logs(acks);
}

/* The store's hand-out step of chunk ``cid``: the compiled one when the store's
 * ``_hand_out_seq`` is the reference's (bound to its acknowledgements part), else (or
 * declined) that step called. */
static PyObject *
store_hand_out(PyObject *store, PyObject *cid_obj)
{
    PyObject *h = fast_getattr(store, s_hand_out_seq);
    if (h == NULL)
        return NULL;
    if (debts_type != NULL && PyMethod_Check(h) && PyMethod_GET_FUNCTION(h) == hand_out_func) {
        PyObject *seq = hand_out_acks(PyMethod_GET_SELF(h), cid_obj);
        if (seq != Py_None) {
            Py_DECREF(h);
            return seq;
        }
        Py_DECREF(seq);
    }
    PyObject *seq = PyObject_CallOneArg(h, cid_obj);
    Py_DECREF(h);
    return seq;
}

/* ``_publish_put`` after the commit: the tag's base, the row, key and index entries, the usage
 * words; then the hand-out (the store's own ``_hand_out_seq``: the ledger) and the ``ShmRef``.
 * ``held`` is released before the store's Python code runs. */
static PyObject *
pub_finish(PyObject *store, PyObject *key, Pub *p, Held *held, volatile uint64_t *hw,
           int64_t address, Py_ssize_t nbytes, int64_t position, int64_t used)
{
    PyObject *row = NULL, *seq_obj = NULL, *result = NULL;
    uint64_t epoch = hw[H_EPOCH];
    uint64_t base = aioshm_tag_base(p->secret, epoch, (uint64_t)address, p->cid,
                                    (uint64_t)nbytes, (uint64_t)position);
    uint64_t packed[5] = {(uint64_t)address, (uint64_t)nbytes, (uint64_t)position, base, epoch};
    int64_t n_items;
    if ((row = PyBytes_FromStringAndSize((const char *)packed, sizeof packed)) == NULL ||
        PyDict_SetItem(p->rshard, p->cid_obj, row) < 0 || map_count_add(p->rows, 1, NULL) < 0 ||
        PyDict_SetItem(p->kshard, p->cid_obj, key) < 0 || map_count_add(p->keys, 1, NULL) < 0 ||
        PyDict_SetItem(p->ishard, key, p->cid_obj) < 0 || map_count_add(p->index, 1, &n_items) < 0)
        goto done;
    if (p->guarded != Py_None && PyDict_SetItem(p->guarded, p->cid_obj, Py_None) < 0)
        goto done;
    STORE_WORD(&hw[H_BYTES_USED], (uint64_t)used);
    STORE_WORD(&hw[H_ITEMS], (uint64_t)n_items);
    release_all(held);
    *held = (Held){.ncol = 0, .has_ring = 0, .has_hw = 0, .nsrc = 0};
    if ((seq_obj = store_hand_out(store, p->cid_obj)) == NULL)
        goto done;
    uint64_t seq = u64_of(seq_obj);
    if (seq == (uint64_t)-1 && PyErr_Occurred())
        goto done;
    result = new_ref(p->nonce, epoch, (uint64_t)address, p->cid_obj, (uint64_t)nbytes,
                     aioshm_finish_tag(base, seq), (uint64_t)position, seq_obj);
done:
    Py_XDECREF(row), Py_XDECREF(seq_obj);
    return result;
}

/* --- the eviction pass of a put (``Eviction.make_room`` with no wait, the reference) ---------
 * When the chunk does not fit right after the tail, ``put_plain`` makes the room itself in the
 * usual case instead of declining: a wrap to address 0 (``ShmRingBuffer._allocate_rare``), or
 * the log drain and one FIFO pass from the head (``Eviction._reclaim``'s ``ring.free`` with its
 * batch slack, then ``Eviction.forget``), exactly as the reference does them. The whole pass is
 * planned first, reading only: the chunks it frees are the oldest, in order, each free by the
 * reference's own test — dead, or committed, not guarded by a request, not tracked by the
 * ledger (nothing owed, pinned or touched) and, with second chance, not marked while the put
 * still needs room. It declines (the reference runs) before any side effect for anything else:
 * a tracked entry (debts to probe, expiry, pins: the ledger's policy), a marked head (a
 * relocation), no room after the pass (waiting, probing or the typed error), a key hint table,
 * another eviction class. The one thing done before such a decline is the drain — the
 * reference's own first step, which applies the readers' acknowledgements and finds nothing new
 * when the reference runs it again — so either path ends in the same state.
 *
 * ``configure_evict(Eviction, EVICT_AHEAD_PUTS, EVICT_SLACK_CHUNKS, H_EVICTIONS)``: the class
 * and the constants, from ``aioshmcache._evict`` (their one definition). */
static PyObject *evict_type;
static int64_t ev_ahead_puts, ev_slack_chunks;
static Py_ssize_t ev_h_evictions = -1;

static PyObject *
core_configure_evict(PyObject *self, PyObject *args)
{
    PyObject *t;
    long long ahead, chunks;
    Py_ssize_t h;
    if (!PyArg_ParseTuple(args, "O!LLn:configure_evict", &PyType_Type, &t, &ahead, &chunks, &h))
        return NULL;
    if (ahead < 0 || chunks < 0 || h < 0 || h >= AIOSHM_HEADER_SIZE / 8) {
        PyErr_SetString(PyExc_ValueError, "configure_evict: a constant out of range");
        return NULL;
    }
    if (intern_names() < 0)
        return NULL;
    Py_INCREF(t);
    Py_XSETREF(evict_type, t);
    ev_ahead_puts = ahead;
    ev_slack_chunks = chunks;
    ev_h_evictions = h;
    Py_RETURN_NONE;
}

/* ``ShmRingBuffer._place``: where a chunk of ``size`` fits with the head at number ``k``. */
static int64_t
ring_place(int64_t cap, int64_t tail, int64_t k, int64_t end, const int64_t *addrs, int64_t mask,
           int64_t size)
{
    if (end == k)
        return size <= cap ? 0 : -1;
    int64_t head = addrs[k & mask];
    if (tail > head) {
        if (cap - tail >= size)
            return tail;
        return head >= size ? 0 : -1;
    }
    return head - tail >= size ? tail : -1;
}

/* The room a put makes, planned (nothing changed yet). */
typedef struct {
    int64_t nfree;                  /* chunks freed from the head: numbers headk .. headk+nfree-1 */
    int64_t head, tail, lap, limit, used, head_pos; /* the ring after the frees and any wrap */
    PyObject *ev, *marked, *keys, *index, *rows, *on_evict; /* the eviction's, when nfree > 0 */
    PyObject *dropped; /* the evicted keys' prompt updates, released once the put is done */
} Room;

static void
room_clear(Room *r)
{
    Py_CLEAR(r->ev);
    Py_CLEAR(r->marked);
    Py_CLEAR(r->keys);
    Py_CLEAR(r->index);
    Py_CLEAR(r->rows);
    Py_CLEAR(r->on_evict);
    Py_CLEAR(r->dropped); /* last: a value's own code (``__del__``) runs after the put */
}

static int is_forget(PyObject *on_evict);

/* ``key = keys.get(cid)`` and ``index.get(key) == cid`` (``Eviction._is_marked``'s second half):
 * 1 if so, 0 if not, -1 on error. */
static int
still_indexed(PyObject *keys, PyObject *index, PyObject *cid_obj)
{
    PyObject *ks = shard_of(keys, cid_obj);
    if (ks == NULL)
        return -1;
    PyObject *key = PyDict_GetItemWithError(ks, cid_obj);
    Py_XINCREF(key);
    Py_DECREF(ks);
    if (key == NULL)
        return PyErr_Occurred() ? -1 : 0;
    PyObject *is = shard_of(index, key);
    if (is == NULL) {
        Py_DECREF(key);
        return -1;
    }
    PyObject *c = PyDict_GetItemWithError(is, key);
    Py_XINCREF(c);
    Py_DECREF(is);
    Py_DECREF(key);
    if (c == NULL)
        return PyErr_Occurred() ? -1 : 0;
    int eq = PyObject_RichCompareBool(c, cid_obj, Py_EQ);
    Py_DECREF(c);
    return eq;
}

/* Is ``cid`` in the sharded map ``m`` (1/0/-1). */
static int
map_contains(PyObject *m, PyObject *key)
{
    PyObject *d = shard_of(m, key);
    if (d == NULL)
        return -1;
    int rc = PyDict_Contains(d, key);
    Py_DECREF(d);
    return rc;
}

/* Plan the room for a chunk of ``size`` bytes (payload ``nbytes``) when it does not fit after
 * the tail: 0 (planned, maybe with frees: ``r``), 1 (decline), -1 (error). Reads only, but for
 * the drain (see above). */
static int
plan_room(PyObject *store, PyObject *ring, Room *r, int64_t nbytes, int64_t size, int64_t cap,
          int64_t tail, int64_t limit, int64_t headk, int64_t end, int64_t lap, int64_t used,
          int64_t mask, const int64_t *addrs, const int64_t *ids, const int64_t *states,
          const int64_t *cpos)
{
    int rc = 1;
    PyObject *acks = NULL, *entries = NULL, *hints = NULL, *pins = NULL, *guarded = NULL;
    PyObject *cid_obj = NULL;
    *r = (Room){.nfree = 0, .head = headk, .tail = tail, .lap = lap, .limit = limit,
                .used = used, .head_pos = 0};
    int64_t k = headk;
    if (ring_place(cap, tail, k, end, addrs, mask, size) < 0) {
        /* no room without freeing: the reference's eviction pass (``make_room``, no wait) */
        if (evict_type == NULL || nbytes <= 0)
            return 1;
        if ((r->ev = fast_getattr(store, s_evict)) == NULL)
            return -1;
        if ((PyObject *)Py_TYPE(r->ev) != evict_type)
            return 1;
        int sc = attr_true(r->ev, s_second_chance);
        int64_t slack, evictions;
        if (sc < 0 || (rc = get_i64(r->ev, s_evict_slack, &slack)) != 0 ||
            (rc = get_i64(r->ev, s_evictions, &evictions)) != 0)
            return sc < 0 ? -1 : rc;
        rc = 1;
        if ((hints = fast_getattr(r->ev, s_hints)) == NULL)
            return -1;
        if (hints != Py_None)
            goto out; /* a group shard's key hints: the reference */
        if ((acks = fast_getattr(r->ev, s_acks)) == NULL ||
            (r->marked = fast_getattr(r->ev, s_marked)) == NULL ||
            (r->keys = fast_getattr(r->ev, s_keys)) == NULL ||
            (r->index = fast_getattr(r->ev, s_index)) == NULL ||
            (r->rows = fast_getattr(r->ev, s_rows)) == NULL ||
            (r->on_evict = fast_getattr(r->ev, s_on_evict)) == NULL ||
            (pins = fast_getattr(r->ev, s_pins)) == NULL ||
            (guarded = fast_getattr(pins, s_guarded)) == NULL) {
            rc = -1;
            goto out;
        }
        if (guarded != Py_None && !PyDict_CheckExact(guarded))
            goto out;
        /* the reference's first step: the readers' acknowledgements applied */
        PyObject *d = call_drain(acks);
        if (d == NULL) {
            rc = -1;
            goto out;
        }
        Py_DECREF(d);
        if ((entries = fast_getattr(r->ev, s_entries)) == NULL) {
            rc = -1;
            goto out;
        }
        if (!PyDict_CheckExact(entries))
            goto out;
        /* ``ring.free(pred, nbytes, slack=..., max_extra=EVICT_SLACK_CHUNKS)``, planned */
        if (0 < slack && slack < nbytes) { /* a big put: room for a few more like it */
            int64_t ahead = ev_ahead_puts * size, sixteenth = cap / 16;
            int64_t more = ahead < sixteenth ? ahead : sixteenth;
            if (more > slack)
                slack = more;
        }
        int64_t need = size, extra = 0;
        int fits = 0;
        while (end != k) {
            if (!fits)
                fits = tail + need <= limit || ring_place(cap, tail, k, end, addrs, mask, need) >= 0;
            if (fits) {
                if (extra >= ev_slack_chunks)
                    break;
                int64_t a = addrs[k & mask];
                int64_t u = tail > a ? tail - a : cap - a + tail;
                int64_t want; /* need + slack, saturated: a slack of "everything" is a value */
                if (__builtin_add_overflow(need, slack, &want))
                    want = slack < 0 ? INT64_MIN : INT64_MAX;
                if (cap - u >= want)
                    break;
                extra++;
            }
            int64_t j = k & mask, st = states[j];
            if (st == CHUNK_WRITING)
                break;
            Py_XSETREF(cid_obj, PyLong_FromLongLong(ids[j]));
            if (cid_obj == NULL) {
                rc = -1;
                goto out;
            }
            int in = PyDict_Contains(entries, cid_obj);
            if (in < 0) {
                rc = -1;
                goto out;
            }
            if (in)
                goto out; /* tracked by the ledger (owed, pinned, touched): its policy */
            if (st == CHUNK_COMMITTED) {
                if (guarded != Py_None) {
                    int g = PyDict_Contains(guarded, cid_obj);
                    if (g < 0) {
                        rc = -1;
                        goto out;
                    }
                    if (g)
                        break; /* guarded by the request deciding now: not free */
                }
                if (sc) {
                    int m = map_contains(r->marked, cid_obj);
                    if (m < 0) {
                        rc = -1;
                        goto out;
                    }
                    if (m) {
                        if (!fits)
                            goto out; /* a second chance while room is needed: relocation */
                        int still = still_indexed(r->keys, r->index, cid_obj);
                        if (still < 0) {
                            rc = -1;
                            goto out;
                        }
                        if (still)
                            break; /* kept in the slack */
                    }
                }
            }
            k++;
        }
        if (!fits) /* nothing more is free: probing, waiting or the typed error */
            fits = k != headk && ring_place(cap, tail, k, end, addrs, mask, need) >= 0;
        if (!fits)
            goto out;
        r->nfree = k - headk;
        if (r->nfree && r->on_evict != Py_None && !is_forget(r->on_evict))
            goto out; /* another ``on_evict``: Python code amid the frees, the reference's */
        if (r->nfree) { /* ``_publish_head`` */
            r->head = k;
            if (end != k) {
                r->head_pos = cpos[k & mask];
                r->used = lap + tail - r->head_pos;
            } else {
                int64_t pos = lap + tail;
                r->lap = (pos + cap - 1) / cap * cap;
                r->tail = 0;
                r->head_pos = r->lap;
                r->used = 0;
            }
            if (end == k)
                r->limit = r->tail == 0 ? cap : -1;
            else
                r->limit = r->tail > addrs[k & mask] ? cap : addrs[k & mask];
        }
    }
    /* the allocation: right after the tail, or a wrap to 0 first (``_allocate_rare``) */
    if (r->tail + size > r->limit) {
        int64_t at = ring_place(cap, r->tail, r->head, end, addrs, mask, size);
        if (at < 0)
            goto out; /* never: planned to fit */
        if (at != r->tail) {
            r->lap += cap;
            r->used += cap - r->tail;
            r->tail = 0;
        }
        if (end == r->head)
            r->limit = r->tail == 0 ? cap : -1;
        else
            r->limit = r->tail > addrs[r->head & mask] ? cap : addrs[r->head & mask];
        if (r->tail + size > r->limit)
            goto out;
    }
    rc = 0;
out:
    Py_XDECREF(acks), Py_XDECREF(entries), Py_XDECREF(hints), Py_XDECREF(pins);
    Py_XDECREF(guarded), Py_XDECREF(cid_obj);
    return rc;
}

/* ``del m[key]`` of a sharded map when present (``m.n`` counted down): 0, or -1. */
static int
map_discard(PyObject *m, PyObject *key, PyObject **popped)
{
    PyObject *d = shard_of(m, key);
    if (d == NULL)
        return -1;
    PyObject *v = PyDict_GetItemWithError(d, key);
    if (v == NULL) {
        Py_DECREF(d);
        return PyErr_Occurred() ? -1 : 0;
    }
    if (popped != NULL)
        *popped = Py_NewRef(v);
    int rc = PyDict_DelItem(d, key);
    Py_DECREF(d);
    if (rc < 0)
        return -1;
    return map_count_add(m, -1, NULL);
}

/* ``SenderBook.forget`` and ``ShardedMap``, found once ``aioshmcache._request`` is imported
 * (before that no sender exists, so no hook can be its ``forget``): see evict_hook. */
static PyObject *forget_func, *sharded_map_type, *s_book_updates;

static void
find_forget(void)
{
    PyObject *name = PyUnicode_FromString("aioshmcache._request");
    PyObject *mod = name == NULL ? NULL : PyImport_GetModule(name);
    Py_XDECREF(name);
    if (mod == NULL) {
        PyErr_Clear(); /* not imported yet: looked for again at the next eviction */
        return;
    }
    PyObject *book = PyObject_GetAttrString(mod, "SenderBook");
    PyObject *func = book == NULL ? NULL : PyObject_GetAttrString(book, "forget");
    PyObject *map = PyObject_GetAttrString(mod, "ShardedMap");
    PyObject *pu = PyUnicode_InternFromString("prompt_updates");
    Py_DECREF(mod);
    Py_XDECREF(book);
    if (func != NULL && PyFunction_Check(func) && map != NULL && PyType_Check(map) && pu != NULL) {
        forget_func = func, sharded_map_type = map, s_book_updates = pu;
        return;
    }
    PyErr_Clear(); /* not the classes this knows: the hook is always called */
    Py_XDECREF(func), Py_XDECREF(map), Py_XDECREF(pu);
}

/* Whether ``on_evict`` is the sender's own ``SenderBook.forget`` (a bound method of that very
 * function): the one hook the eviction pass runs inline; any other is Python code that could
 * change the store amid the frees, and the pass declines it (``plan_room``). */
static int
is_forget(PyObject *on_evict)
{
    if (!PyMethod_Check(on_evict))
        return 0;
    if (forget_func == NULL)
        find_forget();
    return forget_func != NULL && PyMethod_GET_FUNCTION(on_evict) == forget_func;
}

/* ``on_evict(key)`` of the sender's own ``SenderBook.forget`` (``is_forget``) whose book's
 * ``prompt_updates`` is a ``ShardedMap``: its one step inline, ``prompt_updates.pop(key,
 * None)`` (a call costs more than the step), the value kept in ``r->dropped`` until the put is
 * done (its last reference may be one whose ``__del__`` is Python code); else the call.
 * 0, or -1 with an error. */
static int
evict_hook(PyObject *on_evict, PyObject *key, Room *r)
{
    if (is_forget(on_evict)) {
        PyObject *pu = fast_getattr(PyMethod_GET_SELF(on_evict), s_book_updates);
        if (pu == NULL)
            return -1;
        if (Py_IS_TYPE(pu, (PyTypeObject *)sharded_map_type)) {
            PyObject *v = NULL;
            int rc = map_discard(pu, key, &v);
            Py_DECREF(pu);
            if (rc == 0 && v != NULL) {
                if (r->dropped == NULL) { /* made by put_plain before its first change */
                    PyErr_SetString(PyExc_SystemError, "internal error: no list for the drops");
                    rc = -1;
                }
                else if (PyList_Append(r->dropped, v) < 0)
                    rc = -1;
            }
            Py_XDECREF(v);
            return rc;
        }
        Py_DECREF(pu);
    }
    PyObject *res = PyObject_CallOneArg(on_evict, key);
    Py_XDECREF(res);
    return res == NULL ? -1 : 0;
}

/* The planned frees, in the reference's order: each chunk's state word and address entry
 * (``ring.free``), the reuse fence (``_publish_head``: before any byte is reused), then
 * ``Eviction.forget``: marks, rows, keys, index entries, the evictions counted (and
 * ``on_evict`` called) and published. 0, or -1. */
static int
apply_frees(PyObject *ring, Room *r, uint64_t *ringw, volatile uint64_t *hw, int64_t headk,
            int64_t mask, const int64_t *addrs, const int64_t *ids, PyObject *at,
            int64_t at_mask)
{
    for (int64_t k = headk; k < headk + r->nfree; k++) {
        int64_t a = addrs[k & mask];
        STORE_WORD(&ringw[(a >> 3) + C_STATE], CHUNK_FREED);
        PyObject *u = PyLong_FromLongLong(a >> 6);
        if (u == NULL)
            return -1;
        int rc = PyDict_DelItem(PyList_GET_ITEM(at, (Py_ssize_t)((a >> 6) & at_mask)), u);
        Py_DECREF(u);
        if (rc < 0)
            return -1;
    }
    STORE_WORD(&hw[H_HEAD_POS], (uint64_t)r->head_pos);
    if (RING_SET(ring, head, r->head) < 0 || RING_SET(ring, lap, r->lap) < 0 ||
        RING_SET(ring, tail, r->tail) < 0 || RING_SET(ring, used, r->used) < 0 ||
        RING_SET(ring, limit, r->limit) < 0)
        return -1;
    int64_t evictions, before;
    int g = get_i64(r->ev, s_evictions, &evictions);
    if (g != 0) {
        if (g == 1)
            PyErr_SetString(PyExc_RuntimeError, "internal error: evictions is not an int");
        return -1;
    }
    before = evictions;
    for (int64_t k = headk; k < headk + r->nfree; k++) {
        PyObject *cid = PyLong_FromLongLong(ids[k & mask]), *key = NULL;
        if (cid == NULL)
            return -1;
        int rc = map_discard(r->marked, cid, NULL);
        if (rc == 0)
            rc = map_discard(r->rows, cid, NULL);
        if (rc == 0)
            rc = map_discard(r->keys, cid, &key);
        if (rc == 0 && key != NULL) {
            PyObject *is = shard_of(r->index, key);
            PyObject *c = is == NULL ? NULL : PyDict_GetItemWithError(is, key);
            int same = c == NULL ? (PyErr_Occurred() ? -1 : 0)
                                 : PyObject_RichCompareBool(c, cid, Py_EQ);
            if (same > 0) { /* ``del index[key]``, then counted and told */
                if (PyDict_DelItem(is, key) < 0)
                    same = -1;
                else {
                    if (map_count_add(r->index, -1, NULL) < 0 ||
                        set_i64(r->ev, s_evictions, ++evictions) < 0)
                        same = -1;
                    else if (r->on_evict != Py_None && evict_hook(r->on_evict, key, r) < 0)
                        same = -1;
                }
            }
            Py_XDECREF(is);
            rc = same < 0 ? -1 : 0;
        }
        Py_XDECREF(key);
        Py_DECREF(cid);
        if (rc < 0)
            return -1;
    }
    if (evictions != before)
        STORE_WORD(&hw[ev_h_evictions], (uint64_t)evictions);
    return 0;
}

/* 1 if the ring's counters are not these any more (Python code ran since they were read), 0 if
 * they are, -1 on error. */
static int
ring_changed(PyObject *ring, int64_t tail, int64_t limit, int64_t end, int64_t head, int64_t lap,
             int64_t used)
{
    int64_t v[6];
    if (IS_RING_STATE(ring)) {
        AioshmRingState *rs = (AioshmRingState *)ring;
        v[0] = rs->tail, v[1] = rs->limit, v[2] = rs->end, v[3] = rs->head, v[4] = rs->lap;
        v[5] = rs->used;
    }
    else {
        PyObject *names[6] = {s_tail, s_limit, s_end, s_head, s_lap, s_used};
        for (int i = 0; i < 6; i++) {
            int rc = get_i64(ring, names[i], &v[i]);
            if (rc != 0)
                return rc;
        }
    }
    return v[0] != tail || v[1] != limit || v[2] != end || v[3] != head || v[4] != lap ||
           v[5] != used;
}

static PyObject *put_plain(PyObject *store, PyObject *key, PyObject *plan, PyObject *index,
                           PyObject *ishard);

static PyObject *
core_put_plain(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "put_plain takes 3 arguments (store, key, plan)");
        return NULL;
    }
    return put_plain(args[0], args[1], args[2], NULL, NULL);
}

/* ``put_plain(store, key, plan)``; ``index`` and ``ishard``: see ``pub_prepare`` (the one-item
 * miss has just found the key's shard of the index). */
static PyObject *
put_plain(PyObject *store, PyObject *key, PyObject *plan, PyObject *index, PyObject *ishard)
{
    if (ref_type == NULL)
        Py_RETURN_NONE; /* not configured: the reference path */
    if (!PyUnicode_CheckExact(key) || (PyObject *)Py_TYPE(plan) != plan_type)
        Py_RETURN_NONE;

    PyObject *result = NULL;
    Held held = {.ncol = 0, .has_ring = 0, .has_hw = 0, .nsrc = 0};
    Pub pub = {0};
    PyObject *serde = NULL, *pending = NULL, *waiting = NULL, *ring = NULL, *seg = NULL;
    PyObject *layout = NULL, *sources = NULL, *at = NULL, *atshard = NULL, *k_obj = NULL;
    PyObject *u_obj = NULL;
    Room room = {.nfree = 0};

    /* --- every check, no side effect -------------------------------------------------- */
    NEED(serde = fast_getattr(store, s_serde));
    if ((PyObject *)Py_TYPE(serde) != serde_type)
        DECLINE();
    {
        int hints = attr_true(store, s_has_hints);
        CHECK(hints);
    }
    CHECK(pub_prepare(store, key, &pub, index, ishard));
    CHECK(PyDict_Contains(pub.ishard, key)); /* a duplicate: the reference raises */
    NEED(pending = fast_getattr(store, s_pending));
    NEED(waiting = fast_getattr(store, s_waiting));
    if (!PyDict_CheckExact(pending) || !PyAnySet_CheckExact(waiting))
        DECLINE();
    CHECK(PyDict_Contains(pending, key));
    CHECK(PySet_Contains(waiting, key));

    NEED(layout = fast_getattr(plan, s_layout));
    NEED(sources = fast_getattr(plan, s_sources));
    if (!PyTuple_CheckExact(layout) || PyTuple_GET_SIZE(layout) != 5 || !PyTuple_CheckExact(sources))
        DECLINE();
    PyObject *nbytes_o = PyTuple_GET_ITEM(layout, 0), *head = PyTuple_GET_ITEM(layout, 1);
    PyObject *blob = PyTuple_GET_ITEM(layout, 2), *slots = PyTuple_GET_ITEM(layout, 3);
    PyObject *gaps = PyTuple_GET_ITEM(layout, 4);
    if (!PyLong_CheckExact(nbytes_o) || !PyBytes_CheckExact(blob) || !PyTuple_CheckExact(slots) ||
        !PyTuple_CheckExact(gaps) || PyTuple_GET_SIZE(slots) != PyTuple_GET_SIZE(sources) ||
        PyTuple_GET_SIZE(sources) > MAX_SOURCES)
        DECLINE();
    Py_ssize_t nbytes = PyLong_AsSsize_t(nbytes_o);
    if (nbytes < 0) {
        PyErr_Clear();
        DECLINE();
    }
    Py_ssize_t hs, he;
    CHECK(slice_bounds(head, nbytes, &hs, &he));
    if (hs != 0 || he != PyBytes_GET_SIZE(blob))
        DECLINE();
    for (Py_ssize_t g = 0; g < PyTuple_GET_SIZE(gaps); g++) {
        PyObject *gap = PyTuple_GET_ITEM(gaps, g);
        Py_ssize_t a, b;
        if (!PyTuple_CheckExact(gap) || PyTuple_GET_SIZE(gap) != 2)
            DECLINE();
        CHECK(slice_bounds(PyTuple_GET_ITEM(gap, 0), nbytes, &a, &b));
    }
    NEED(ring = fast_getattr(store, s_ring));
    NEED(seg = fast_getattr(ring, s_seg));
    {
        int closed = attr_true(seg, s_closed);
        CHECK(closed);
        int forked = attr_true(seg, s_forked);
        CHECK(forked);
    }
    int64_t tail, limit, end, headk, mask, at_mask, lap, used;
    if ((int64_t)nbytes > ((int64_t)1 << 62))
        DECLINE(); /* larger than any ring: the reference raises CacheFullError */
    int64_t size = CHUNK_HEADER + (((int64_t)nbytes + 63) & -64), cap;
    if (IS_RING_STATE(ring)) { /* the usual ring: its ints at once */
        AioshmRingState *rs = (AioshmRingState *)ring;
        tail = rs->tail, limit = rs->limit, end = rs->end, headk = rs->head, mask = rs->mask;
        at_mask = rs->at_mask, lap = rs->lap, used = rs->used, cap = rs->capacity;
    }
    else {
        CHECK(get_i64(ring, s_tail, &tail));
        CHECK(get_i64(ring, s_limit, &limit));
        CHECK(get_i64(ring, s_end, &end));
        CHECK(get_i64(ring, s_head, &headk));
        CHECK(get_i64(ring, s_mask, &mask));
        CHECK(get_i64(ring, s_at_mask, &at_mask));
        CHECK(get_i64(ring, s_lap, &lap));
        CHECK(get_i64(ring, s_used, &used));
        CHECK(get_i64(ring, s_capacity, &cap));
    }
    if (tail < 0 || tail % 64 != 0 || size > cap || mask < 0 || headk > end)
        DECLINE(); /* a chunk that can never fit: the reference raises */
    /* The usual small put: the chunk fits after the tail, so no eviction pass runs (the one
     * place that calls Python code before the copy: the drain, ``on_evict``), and every copy
     * is below ``NOGIL_COPY`` (the GIL held: no other thread runs either). From here to the
     * copy and the publish only this C code runs, and the buffers are read as they are
     * (``borrow``: the ring's and the header's views, the source arrays) instead of
     * exported. A bigger put, or one that needs room, takes exports: then a view cannot be
     * released (the ring closed) while its bytes are being written. */
    const int borrow = IS_RING_STATE(ring) && tail + size <= limit && nbytes < NOGIL_COPY;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(sources); i++) {
        PyObject *slot = PyTuple_GET_ITEM(slots, i), *src = PyTuple_GET_ITEM(sources, i);
        Py_ssize_t a, b;
        if (!PyTuple_CheckExact(slot) || PyTuple_GET_SIZE(slot) != 3)
            DECLINE();
        CHECK(slice_bounds(PyTuple_GET_ITEM(slot, 0), nbytes, &a, &b));
        Py_buffer *v = &held.src[held.nsrc];
        const char *data;
        Py_ssize_t len;
        if (borrow && aioshm_array_bytes(src, &data, &len)) {
            /* copied under the GIL with nothing run before: its fields, no export */
            v->buf = (void *)data, v->len = len, v->obj = NULL;
            held.nsrc++;
            if (len != b - a)
                DECLINE(); /* the reference raises SerdeError (size changed) */
            continue;
        }
        if (PyObject_GetBuffer(src, v, PyBUF_FULL_RO) < 0) {
            PyErr_Clear(); /* e.g. a datetime array: the reference copies it by numpy */
            DECLINE();
        }
        held.nsrc++;
        if (!PyBuffer_IsContiguous(v, 'C') || v->len != b - a)
            DECLINE(); /* the reference copies it, or raises SerdeError (size changed) */
    }
    CHECK(get_words(ring, s_w, &held.ring, borrow));
    held.has_ring = 1;
    if (held.ring.len < cap)
        DECLINE();
    CHECK(get_words(store, s_hw, &held.hw, borrow));
    held.has_hw = 1;
    if (held.hw.len < AIOSHM_HEADER_SIZE)
        DECLINE();
    PyObject *cols[5] = {s_addr, s_size, s_id, s_cpos, s_state};
    int64_t j = end & mask;
    for (int c = 0; c < 5; c++) {
        CHECK(get_words(ring, cols[c], &held.col[held.ncol], borrow));
        held.ncol++;
        if (held.col[c].len / 8 != mask + 1)
            DECLINE();
    }
    const int64_t *addrs = held.col[0].buf, *ids = held.col[2].buf;
    for (int64_t k = headk; k < end && tail + size > limit; k++) /* chunks the pass may visit */
        if (addrs[k & mask] < 0 || addrs[k & mask] % 64 || addrs[k & mask] + CHUNK_HEADER > cap)
            DECLINE();
    room = (Room){.head = headk, .tail = tail, .lap = lap, .limit = limit, .used = used};
    if (tail + size > limit) { /* a wrap, or no room: the eviction pass, planned (or declined) */
        CHECK(plan_room(store, ring, &room, nbytes, size, cap, tail, limit, headk, end, lap, used,
                        mask, addrs, ids, held.col[4].buf, held.col[3].buf));
        /* the list of the values the sender's hook drops, made now: it is the one object the
         * side effects below would allocate that the collector tracks, and a collection it
         * started amid the frees could run a finalizer that puts into this store */
        if (room.nfree && room.on_evict != Py_None && room.dropped == NULL)
            NEED(room.dropped = PyList_New(0));
        /* The pass drains the readers' logs first: Python code, and any allocation in it can
         * start a collection whose finalizers run anything (a put, an eviction, a close). What
         * was read before it is read again, and anything changed declines to the reference,
         * whose own drain then finds nothing new. */
        CHECK(ring_changed(ring, tail, limit, end, headk, lap, used));
        CHECK(attr_true(seg, s_closed));
        CHECK(PyDict_Contains(pub.ishard, key));
        CHECK(PyDict_Contains(pending, key));
        CHECK(PySet_Contains(waiting, key));
    }
    if (end - room.head > mask)
        DECLINE(); /* the columns must grow first */
    int64_t at_tail = room.tail;
    if (at_tail + size > cap)
        DECLINE();
    NEED(at = fast_getattr(ring, s_at));
    if (!PyList_CheckExact(at) || PyList_GET_SIZE(at) != at_mask + 1)
        DECLINE();
    atshard = PyList_GET_ITEM(at, (Py_ssize_t)((at_tail >> 6) & at_mask));
    Py_INCREF(atshard);
    if (!PyDict_CheckExact(atshard))
        DECLINE();
    volatile uint64_t *hw = (uint64_t *)held.hw.buf;
    uint64_t cid = hw[H_NEXT_ID];
    if (cid > MAX_RING_ID || cid == 0)
        DECLINE(); /* exhausted: the reference raises */
    CHECK(pub_chunk(&pub, cid));
    NEED(k_obj = PyLong_FromLongLong(end));
    NEED(u_obj = PyLong_FromLongLong(at_tail >> 6));

    /* --- side effects, in the reference's order ----------------------------------------- */
    /* the room: the frees and their bookkeeping (``make_room``), a wrap (``_allocate_rare``) */
    if (room.nfree && apply_frees(ring, &room, held.ring.buf, hw, headk, mask, addrs, ids, at,
                                  at_mask) < 0)
        goto done;
    if ((room.lap != lap && RING_SET(ring, lap, room.lap) < 0) ||
        (room.limit != limit && RING_SET(ring, limit, room.limit) < 0))
        goto done;
    tail = at_tail, lap = room.lap, used = room.used;
    /* ``try_allocate``: the id, the chunk header (state first), the columns, the address map */
    STORE_WORD(&hw[H_NEXT_ID], cid + 1);
    uint64_t *w = (uint64_t *)held.ring.buf + (tail >> 3);
    STORE_WORD(&w[C_STATE], CHUNK_WRITING);
    STORE_WORD(&w[C_ID], cid);
    STORE_WORD(&w[C_LENGTH], (uint64_t)nbytes);
    STORE_WORD(&w[C_CHECK], cid ^ (uint64_t)nbytes ^ CHUNK_MAGIC);
    int64_t position = lap + tail;
    ((int64_t *)held.col[0].buf)[j] = tail;
    ((int64_t *)held.col[1].buf)[j] = size;
    ((int64_t *)held.col[2].buf)[j] = (int64_t)cid;
    ((int64_t *)held.col[3].buf)[j] = position;
    ((int64_t *)held.col[4].buf)[j] = CHUNK_WRITING;
    if (PyDict_SetItem(atshard, u_obj, k_obj) < 0 || RING_SET(ring, end, end + 1) < 0 ||
        RING_SET(ring, tail, tail + size) < 0 || RING_SET(ring, used, used + size) < 0)
        goto done;
    /* ``MsgpackSerde.write``: the prefix and header, zeroed gaps, every array's bytes */
    char *payload = (char *)held.ring.buf + tail + CHUNK_HEADER;
    memcpy(payload, PyBytes_AS_STRING(blob), (size_t)he);
    for (Py_ssize_t g = 0; g < PyTuple_GET_SIZE(gaps); g++) {
        Py_ssize_t a, b;
        slice_bounds(PyTuple_GET_ITEM(PyTuple_GET_ITEM(gaps, g), 0), nbytes, &a, &b);
        memset(payload + a, 0, (size_t)(b - a));
    }
    for (int i = 0; i < held.nsrc; i++) {
        Py_ssize_t a, b;
        slice_bounds(PyTuple_GET_ITEM(PyTuple_GET_ITEM(slots, i), 0), nbytes, &a, &b);
        if (b - a >= NOGIL_COPY) {
            Py_BEGIN_ALLOW_THREADS
            aioshm_copy_bytes(payload + a, held.src[i].buf, (size_t)(b - a));
            Py_END_ALLOW_THREADS
        }
        else { /* a source viewing the ring itself may overlap: moved, as aioshm_copy_bytes */
            char *d = payload + a;
            const char *from = held.src[i].buf;
            if (d < from + (b - a) && from < d + (b - a))
                memmove(d, from, (size_t)(b - a));
            else
                memcpy(d, from, (size_t)(b - a));
        }
    }
    /* ``commit``: the state word after every payload byte */
    STORE_WORD(&w[C_STATE], CHUNK_COMMITTED);
    ((int64_t *)held.col[4].buf)[j] = CHUNK_COMMITTED;
    result = pub_finish(store, key, &pub, &held, hw, tail, nbytes, position, used + size);

done:
    release_all(&held);
    pub_clear(&pub);
    Py_XDECREF(serde), Py_XDECREF(pending), Py_XDECREF(waiting), Py_XDECREF(ring);
    Py_XDECREF(seg), Py_XDECREF(layout), Py_XDECREF(sources), Py_XDECREF(at);
    Py_XDECREF(atshard), Py_XDECREF(k_obj), Py_XDECREF(u_obj);
    room_clear(&room);
    return result;
}

/* ``publish_plain(store, key, address, cid, length)``: ``StoreWriter._publish_put`` of a chunk
 * whose payload is written (a reservation's commit): the ring's ``commit``, then the publish
 * step as in ``put_plain``. None, before any side effect, unless the chunk at ``address`` is
 * ``cid`` being written, in a live writer's ring with no key hints: the reference then runs
 * (and raises what it raises). */
static PyObject *
core_publish_plain(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "publish_plain takes 5 arguments");
        return NULL;
    }
    PyObject *store = args[0], *key = args[1];
    if (ref_type == NULL || !PyUnicode_CheckExact(key) || !PyLong_CheckExact(args[2]) ||
        !PyLong_CheckExact(args[3]) || !PyLong_CheckExact(args[4]))
        Py_RETURN_NONE;
    int64_t address = PyLong_AsLongLong(args[2]);
    uint64_t cid = u64_of(args[3]);
    Py_ssize_t nbytes = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *result = NULL, *ring = NULL, *seg = NULL, *at = NULL, *u_obj = NULL;
    Held held = {.ncol = 0, .has_ring = 0, .has_hw = 0, .nsrc = 0};
    Pub pub = {0};
    if (address < 0 || address % 64 != 0 || nbytes < 0 || cid == 0 || cid > MAX_RING_ID)
        DECLINE();
    CHECK(attr_true(store, s_has_hints));
    NEED(ring = fast_getattr(store, s_ring));
    NEED(seg = fast_getattr(ring, s_seg));
    CHECK(attr_true(seg, s_closed));
    CHECK(attr_true(seg, s_forked));
    int64_t mask, at_mask, used;
    CHECK(RING_GET(ring, mask, &mask));
    CHECK(RING_GET(ring, at_mask, &at_mask));
    CHECK(RING_GET(ring, used, &used));
    NEED(at = fast_getattr(ring, s_at));
    if (!PyList_CheckExact(at) || PyList_GET_SIZE(at) != at_mask + 1)
        DECLINE();
    NEED(u_obj = PyLong_FromLongLong(address >> 6));
    PyObject *k_obj = PyDict_GetItemWithError(  /* borrowed: the chunk's number */
        PyList_GET_ITEM(at, (Py_ssize_t)((address >> 6) & at_mask)), u_obj);
    if (k_obj == NULL) {
        if (PyErr_Occurred())
            goto done;
        DECLINE(); /* no chunk starts there: the reference raises */
    }
    int64_t k = PyLong_AsLongLong(k_obj);
    if (k == -1 && PyErr_Occurred())
        goto done;
    int64_t j = k & mask;
    PyObject *cols[5] = {s_addr, s_size, s_id, s_cpos, s_state};
    for (int c = 0; c < 5; c++) {
        CHECK(get_words(ring, cols[c], &held.col[held.ncol], 0));
        held.ncol++;
        if (held.col[c].len / 8 <= j)
            DECLINE();
    }
    if (((int64_t *)held.col[4].buf)[j] != CHUNK_WRITING ||
        ((int64_t *)held.col[2].buf)[j] != (int64_t)cid ||
        ((int64_t *)held.col[0].buf)[j] != address)
        DECLINE(); /* not this chunk being written: the reference raises */
    CHECK(get_words(ring, s_w, &held.ring, 0));
    held.has_ring = 1;
    if (address + CHUNK_HEADER > held.ring.len)
        DECLINE();
    CHECK(get_words(store, s_hw, &held.hw, 0));
    held.has_hw = 1;
    if (held.hw.len < AIOSHM_HEADER_SIZE)
        DECLINE();
    CHECK(pub_prepare(store, key, &pub, NULL, NULL));
    CHECK(pub_chunk(&pub, cid));
    /* --- side effects: ``commit``, then the publish step --- */
    uint64_t *w = (uint64_t *)held.ring.buf + (address >> 3);
    STORE_WORD(&w[C_STATE], CHUNK_COMMITTED);
    ((int64_t *)held.col[4].buf)[j] = CHUNK_COMMITTED;
    int64_t position = ((int64_t *)held.col[3].buf)[j];
    result = pub_finish(store, key, &pub, &held, (volatile uint64_t *)held.hw.buf, address,
                        nbytes, position, used);
done:
    release_all(&held);
    pub_clear(&pub);
    Py_XDECREF(ring), Py_XDECREF(seg), Py_XDECREF(at), Py_XDECREF(u_obj);
    return result;
}

/* ``make_ref(store, cid, seq)``: the reference of hand-out ``seq`` of the cached chunk ``cid``
 * (``StoreWriter._ref``, the reference): its row, the tag's base (recomputed, and the row
 * rewritten, once per epoch), the tag. None (nothing done) when the row is missing or not what
 * the reference packs: the reference then runs (and raises what it raises). */
static PyObject *
make_ref(PyObject *store, PyObject *cid_obj, PyObject *seq_obj)
{
    if (ref_type == NULL || !PyLong_CheckExact(cid_obj) || !PyLong_CheckExact(seq_obj))
        Py_RETURN_NONE;
    uint64_t cid = u64_of(cid_obj), seq = u64_of(seq_obj);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *result = NULL, *rows = NULL, *shard = NULL, *secret_obj = NULL, *nonce = NULL;
    PyObject *row = NULL;
    Held held = {.ncol = 0, .has_ring = 0, .has_hw = 0, .nsrc = 0};
    NEED(rows = fast_getattr(store, s_rows));
    NEED(shard = shard_of(rows, cid_obj));
    PyObject *packed = PyDict_GetItemWithError(shard, cid_obj); /* borrowed */
    if (packed == NULL) {
        if (PyErr_Occurred())
            goto done;
        DECLINE(); /* the reference raises KeyError */
    }
    if (!PyBytes_CheckExact(packed) || PyBytes_GET_SIZE(packed) != 5 * 8)
        DECLINE();
    uint64_t f[5]; /* address, length, position, base, epoch of the base */
    memcpy(f, PyBytes_AS_STRING(packed), sizeof f);
    CHECK(get_words(store, s_hw, &held.hw, 0));
    held.has_hw = 1;
    if (held.hw.len < AIOSHM_HEADER_SIZE)
        DECLINE();
    uint64_t epoch = ((volatile uint64_t *)held.hw.buf)[H_EPOCH];
    NEED(nonce = fast_getattr(store, s_nonce));
    if (f[4] != epoch) { /* the tag's base, once per epoch */
        NEED(secret_obj = fast_getattr(store, s_secret));
        uint64_t secret = u64_of(secret_obj);
        if (secret == (uint64_t)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            DECLINE();
        }
        f[3] = aioshm_tag_base(secret, epoch, f[0], cid, f[1], f[2]);
        f[4] = epoch;
        NEED(row = PyBytes_FromStringAndSize((const char *)f, sizeof f));
        if (PyDict_SetItem(shard, cid_obj, row) < 0)
            goto done;
    }
    result = new_ref(nonce, epoch, f[0], cid_obj, f[1], aioshm_finish_tag(f[3], seq), f[2],
                     seq_obj);
done:
    release_all(&held);
    Py_XDECREF(rows), Py_XDECREF(shard), Py_XDECREF(secret_obj), Py_XDECREF(nonce);
    Py_XDECREF(row);
    return result;
}

static PyObject *
core_make_ref(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "make_ref takes 3 arguments (store, cid, seq)");
        return NULL;
    }
    return make_ref(args[0], args[1], args[2]);
}

/* --- a sender's one-item miss, hit or look-up (``_request.run_one``) -------------------------
 * ``put_item(store, book, mm_item, mm_hash, inline_below)``: ``SenderCache.get_and_update_item``
 * of one item, in one call, as ``SenderRequest`` decides it (``_request``, the reference): the
 * owner checked (its typed error raised, as the request's first step does), the writer lock
 * taken, the look-up. A cached hash (a given item, or a look-up: ``mm_item`` None) is a hit
 * (``hit_locked`` below: the hand-out, ``(ShmRef, prompt_updates)``). Not cached: a look-up
 * declines (the request raises ``CacheMissError``); an item: its plan (``store.plan``),
 * ``put_plain`` (above), the miss counted and published (``H_MISSES``), the prompt updates
 * kept (``book.keep_updates``), the lock let go; returns ``(ShmRef, prompt_updates)``. An item
 * measured too large is remembered and served inline (``mm_item`` returned), as the request
 * does; the plan's other errors are raised (nothing done), and a put that raises is counted a
 * miss, as in the request. It declines (None) before any side effect for anything else — a
 * look-up not cached, a group shard, another serde, a hash remembered too large, an item
 * that is not a dict or is ``inline_below`` bytes or more, and whatever ``put_plain`` declines
 * (room that needs the eviction policy) — and the request runs. */
static PyObject *s_check_owner, *s_lock, *s_acquire, *s_release, *s_plan, *s_siblings;
static PyObject *s_too_large, *s_sizes, *s_counters, *s_total, *s_hits, *s_words, *s_keep;
static PyObject *s_nbytes, *s_pub_index, *s_found_too_large, *s_count_miss, *too_large_error;
static PyObject *s_prompt_updates, *keep_func; /* ``SenderBook.keep_updates``: see keep_updates */
static PyObject *kept_keep; /* ``_kept.keep``: the form the book stores */
static PyObject *owner_func, *s_reading; /* ``StoreWriter.check_owner``: see check_owner */
/* ``StoreWriter.hand_out`` and ``StoreWriter._ref``, ``_kept.KEPT`` and ``_kept.restore``: see
 * hit_locked */
static PyObject *s_hand_out, *s_ref, *writer_hand_out, *writer_ref, *kept_marker, *kept_restore;
/* ``_thread.RLock`` and its ``acquire`` / ``release`` descriptors: see lock_call */
static PyObject *rlock_type, *rlock_acquire, *rlock_release;

/* ``module.name`` (``module`` imported), a new reference, or NULL with an exception. */
static PyObject *
module_attr(const char *module, const char *name)
{
    PyObject *m = PyImport_ImportModule(module);
    if (m == NULL)
        return NULL;
    PyObject *v = PyObject_GetAttrString(m, name);
    Py_DECREF(m);
    return v;
}

static int
intern_item_names(void)
{
    struct { PyObject **p; const char *s; } names[] = {
        {&s_check_owner, "check_owner"}, {&s_lock, "_lock"}, {&s_acquire, "acquire"},
        {&s_release, "release"}, {&s_plan, "plan"}, {&s_siblings, "siblings"},
        {&s_too_large, "too_large"}, {&s_sizes, "sizes"}, {&s_counters, "counters"},
        {&s_total, "total"}, {&s_hits, "hits"}, {&s_words, "words"}, {&s_keep, "keep_updates"},
        {&s_nbytes, "nbytes"}, {&s_pub_index, "index"}, {&s_found_too_large, "found_too_large"},
        {&s_count_miss, "count_miss"}, {&s_prompt_updates, "prompt_updates"},
        {&s_reading, "_reading"}, {&s_hand_out, "hand_out"}, {&s_ref, "_ref"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (*names[i].p == NULL && (*names[i].p = PyUnicode_InternFromString(names[i].s)) == NULL)
            return -1;
    if (too_large_error == NULL &&
        (too_large_error = module_attr("aioshmcache.errors", "ObjectTooLargeError")) == NULL)
        return -1;
    if (keep_func == NULL) {
        PyObject *book_type = module_attr("aioshmcache._request", "SenderBook");
        if (book_type == NULL)
            return -1;
        keep_func = PyObject_GetAttrString(book_type, "keep_updates");
        Py_DECREF(book_type);
        if (keep_func == NULL)
            return -1;
    }
    if (owner_func == NULL) {
        PyObject *writer_type = module_attr("aioshmcache._store", "StoreWriter");
        if (writer_type == NULL)
            return -1;
        if (PyType_Check(writer_type)) {
            owner_func = Py_XNewRef(_PyType_Lookup((PyTypeObject *)writer_type, s_check_owner));
            writer_hand_out = Py_XNewRef(_PyType_Lookup((PyTypeObject *)writer_type, s_hand_out));
            writer_ref = Py_XNewRef(_PyType_Lookup((PyTypeObject *)writer_type, s_ref));
        }
        Py_DECREF(writer_type);
        if (owner_func == NULL || writer_hand_out == NULL || writer_ref == NULL) {
            PyErr_SetString(PyExc_TypeError,
                            "StoreWriter's check_owner, hand_out or _ref not found");
            return -1;
        }
    }
    if (rlock_type == NULL) {
        PyObject *t = module_attr("_thread", "RLock");
        if (t == NULL)
            return -1;
        if (PyType_Check(t) && PyType_HasFeature((PyTypeObject *)t, Py_TPFLAGS_IMMUTABLETYPE)) {
            rlock_acquire = Py_XNewRef(_PyType_Lookup((PyTypeObject *)t, s_acquire));
            rlock_release = Py_XNewRef(_PyType_Lookup((PyTypeObject *)t, s_release));
        }
        rlock_type = t;
    }
    if (kept_keep == NULL) {
        PyObject *kept = PyImport_ImportModule("aioshmcache._kept");
        if (kept == NULL)
            return -1;
        kept_keep = PyObject_GetAttrString(kept, "keep");
        kept_marker = PyObject_GetAttrString(kept, "KEPT");
        kept_restore = PyObject_GetAttrString(kept, "restore");
        Py_DECREF(kept);
        if (kept_keep == NULL || kept_marker == NULL || kept_restore == NULL)
            return -1;
    }
    return 0;
}

/* Is ``obj.<part>.<name>`` true (1), false (0); -1: error. */
static int
part_attr_true(PyObject *obj, PyObject *part, PyObject *name)
{
    PyObject *p = fast_getattr(obj, part);
    if (p == NULL)
        return -1;
    int t = attr_true(p, name);
    Py_DECREF(p);
    return t;
}

/* ``store.check_owner()``: when it is ``StoreWriter``'s own (found on the store's class, which
 * has no instance dict to shadow it), its one test in C — ``self._reading.closed or
 * self._seg.forked`` — and the call only when it is true (the call then raises the typed
 * error, as the reference does); else the call. 0, or -1 with an error. */
static int
check_owner(PyObject *store)
{
    PyTypeObject *t = Py_TYPE(store);
    if (t->tp_dictoffset == 0 && t->tp_getattro == PyObject_GenericGetAttr &&
        _PyType_Lookup(t, s_check_owner) == owner_func) {
        int bad = part_attr_true(store, s_reading, s_closed);
        if (bad == 0)
            bad = part_attr_true(store, s_seg, s_forked);
        if (bad <= 0)
            return bad;
    }
    PyObject *r = PyObject_CallMethodNoArgs(store, s_check_owner);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* ``lock.acquire()`` or ``lock.release()`` (``name``): on an exact ``_thread.RLock``, whose
 * methods cannot be replaced, its type's method ``descr`` called at once (the bound method's
 * look-up costs ~110 instructions); else the call by name. */
static PyObject *
lock_call(PyObject *lock, PyObject *name, PyObject *descr)
{
    if (descr != NULL && (PyObject *)Py_TYPE(lock) == rlock_type)
        return PyObject_Vectorcall(descr, &lock, 1, NULL);
    return PyObject_CallMethodNoArgs(lock, name);
}

/* ``book.keep_updates(h, updates)``: when it is ``SenderBook``'s own, its steps inline (``pu[h] = keep(updates)``
 * on the sharded map, counted once per new hash; a call costs more than the steps),
 * else the call. 0, or -1 with an error. */
static int
keep_updates(PyObject *book, PyObject *key, PyObject *updates)
{
    PyTypeObject *t = Py_TYPE(book);
    /* the class's own method on a book with no instance dict to shadow it (``SenderBook``'s
     * ``__slots__``): known without making the bound method */
    if (t->tp_dictoffset != 0 || t->tp_getattro != PyObject_GenericGetAttr ||
        _PyType_Lookup(t, s_keep) != keep_func) {
        PyObject *m = fast_getattr(book, s_keep);
        if (m == NULL)
            return -1;
        if (!PyMethod_Check(m) || PyMethod_GET_FUNCTION(m) != keep_func ||
            PyMethod_GET_SELF(m) != book) {
            PyObject *r = PyObject_CallFunctionObjArgs(m, key, updates, NULL);
            Py_DECREF(m);
            Py_XDECREF(r);
            return r == NULL ? -1 : 0;
        }
        Py_DECREF(m);
    }
    PyObject *pu = fast_getattr(book, s_prompt_updates);
    if (pu == NULL)
        return -1;
    /* the form the book keeps (``_kept``): ``()`` as it is, anything else through ``keep`` */
    PyObject *kept;
    if (PyTuple_CheckExact(updates) && PyTuple_GET_SIZE(updates) == 0) {
        kept = Py_NewRef(updates);
    } else {
        kept = PyObject_CallOneArg(kept_keep, updates);
        if (kept == NULL) {
            Py_DECREF(pu);
            return -1;
        }
    }
    PyObject *d = shard_of(pu, key);
    int rc = d == NULL ? -1 : PyDict_Contains(d, key);
    if (rc == 0)
        rc = map_count_add(pu, 1, NULL);
    if (rc >= 0)
        rc = PyDict_SetItem(d, key, kept);
    Py_XDECREF(d);
    Py_DECREF(kept);
    Py_DECREF(pu);
    return rc < 0 ? -1 : 0;
}

/* ``words[i] = value`` of the store's header words: when ``words`` is a live memoryview of
 * native 8-byte words, one release store into its buffer (nothing runs between the check and
 * the store; the item assignment costs ~300 instructions), else that assignment. 0, or -1. */
static int
set_header_word(PyObject *words, Py_ssize_t i, PyObject *value)
{
    if (PyMemoryView_Check(words) && PyLong_CheckExact(value) && Py_SIZE(value) >= 0 &&
        !(((PyMemoryViewObject *)words)->flags & _Py_MEMORYVIEW_RELEASED)) {
        Py_buffer *b = PyMemoryView_GET_BUFFER(words);
        uint64_t v = u64_of(value);
        if (!(v == (uint64_t)-1 && PyErr_Occurred()) && !b->readonly && b->ndim == 1 &&
            b->itemsize == 8 && b->format != NULL && strcmp(b->format, "Q") == 0 &&
            b->strides != NULL && b->strides[0] == 8 && b->shape[0] > i) {
            STORE_WORD((uint64_t *)b->buf + i, v);
            return 0;
        }
        PyErr_Clear();
    }
    PyObject *w = PyLong_FromSsize_t(i);
    if (w == NULL)
        return -1;
    int rc = PyObject_SetItem(words, w, value);
    Py_DECREF(w);
    return rc;
}

/* ``n + 1`` of an int counter (a new reference), without generic int arithmetic when it fits. */
static PyObject *
plus_one(PyObject *n)
{
    int64_t v, v1;
    if (as_i64(n, &v) == 0 && !__builtin_add_overflow(v, 1, &v1))
        return PyLong_FromLongLong(v1);
    PyErr_Clear();
    PyObject *one = PyLong_FromLong(1);
    if (one == NULL)
        return NULL;
    PyObject *r = PyNumber_Add(n, one);
    Py_DECREF(one);
    return r;
}

/* A hand-out given back after a failed allocation, as the request's roll back does; the
 * error being raised is kept. */
static void
give_back(PyObject *store, PyObject *ref)
{
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *r = PyObject_CallMethodOneArg(store, s_release, ref);
    Py_XDECREF(r);
    PyErr_Clear();
    PyErr_Restore(et, ev, tb);
}

/* A hit of ``key``, cached as chunk ``cid_obj`` (``_decide_locked``'s hit, the reference): the
 * store's ``hand_out(cid)`` — the mark for the second chance, the hand-out (``_hand_out_seq``:
 * the ledger, whatever it keeps for expiry, pins and touches) and the ``ShmRef`` (``_ref``) —
 * then the prompt updates (the caller's own for a given item; for a look-up, ``item`` None,
 * the kept ones, restored from the kept form as ``_kept.restore`` does), the hit counted
 * (``total``, ``hits``) and published (``H_HITS``). Declines (None) before any side effect when
 * the store's ``hand_out`` or ``_ref`` is not ``StoreWriter``'s, the eviction is another class,
 * or the counters are not ints. An error after the hand-out gives it back (``store.release``),
 * as the request's roll back does. */
static PyObject *
hit_locked(PyObject *store, PyObject *book, PyObject *item, PyObject *key, PyObject *cid_obj)
{
    PyObject *result = NULL, *ev = NULL, *marks = NULL, *mshard = NULL, *counters = NULL;
    PyObject *total = NULL, *hits = NULL, *words = NULL, *pu = NULL, *ushard = NULL;
    PyObject *updates = NULL, *seq = NULL, *ref = NULL, *total1 = NULL, *hits1 = NULL;
    PyTypeObject *t = Py_TYPE(store);
    if (writer_hand_out == NULL || writer_ref == NULL || kept_restore == NULL ||
        empty_tuple == NULL || evict_type == NULL || !PyLong_CheckExact(cid_obj) ||
        t->tp_dictoffset != 0 || t->tp_getattro != PyObject_GenericGetAttr ||
        _PyType_Lookup(t, s_hand_out) != writer_hand_out || _PyType_Lookup(t, s_ref) != writer_ref)
        DECLINE(); /* a store of its own: its ``hand_out`` runs in the request */
    NEED(ev = fast_getattr(store, s_evict));
    if ((PyObject *)Py_TYPE(ev) != evict_type)
        DECLINE();
    NEED(counters = fast_getattr(book, s_counters));
    NEED(total = fast_getattr(counters, s_total));
    NEED(hits = fast_getattr(counters, s_hits));
    NEED(words = fast_getattr(store, s_words));
    if (!PyLong_CheckExact(total) || !PyLong_CheckExact(hits))
        DECLINE();
    if (item != Py_None)
        updates = Py_NewRef(PyTuple_GET_ITEM(item, 1));
    /* ``store.hand_out(cid)``: the mark (``ev.mark(cid)``), the hand-out, the reference */
    int sc = attr_true(ev, s_second_chance);
    if (sc < 0)
        goto done;
    if (sc) {
        NEED(marks = fast_getattr(ev, s_marked));
        NEED(mshard = shard_of(marks, cid_obj));
        int in = PyDict_Contains(mshard, cid_obj);
        if (in < 0)
            goto done;
        if (!in && (PyDict_SetItem(mshard, cid_obj, Py_None) < 0 ||
                    map_count_add(marks, 1, NULL) < 0))
            goto done;
    }
    NEED(seq = store_hand_out(store, cid_obj));
    NEED(ref = make_ref(store, cid_obj, seq));
    if (ref == Py_None) { /* the reference's steps (``_ref`` asks the core again: declined) */
        Py_SETREF(ref, PyObject_CallMethodObjArgs(store, s_ref, cid_obj, seq, NULL));
        NEED(ref);
    }
    /* From here an error gives the hand-out back. The hand-out may have run Python code (the
     * ledger's clock, the drain, a finalizer of a collection started by an allocation), as the
     * reference's does: what the reference reads after it is read only now, the kept updates
     * (``book.prompt_updates.get(h, ())``) and the counters. */
    if (item == Py_None) {
        if ((pu = fast_getattr(book, s_prompt_updates)) == NULL ||
            (ushard = shard_of(pu, key)) == NULL)
            goto undo;
        updates = PyDict_GetItemWithError(ushard, key);
        if (updates == NULL && PyErr_Occurred())
            goto undo;
        updates = Py_NewRef(updates == NULL ? empty_tuple : updates);
    }
    Py_CLEAR(total);
    Py_CLEAR(hits);
    if ((total = fast_getattr(counters, s_total)) == NULL ||
        (hits = fast_getattr(counters, s_hits)) == NULL)
        goto undo;
    if (item == Py_None &&
        (!PyTuple_CheckExact(updates) ||
         (PyTuple_GET_SIZE(updates) && PyTuple_GET_ITEM(updates, 0) == kept_marker))) {
        Py_SETREF(updates, PyObject_CallOneArg(kept_restore, updates));
        if (updates == NULL)
            goto undo;
    }
    /* ``c.total += 1``, ``c.hits = hits = c.hits + 1``, ``words[H_HITS] = hits`` */
    if ((total1 = plus_one(total)) == NULL || fast_setattr(counters, s_total, total1) < 0 ||
        (hits1 = plus_one(hits)) == NULL || fast_setattr(counters, s_hits, hits1) < 0 ||
        set_header_word(words, H_HITS, hits1) < 0)
        goto undo;
    if ((result = PyTuple_Pack(2, ref, updates)) == NULL)
        goto undo;
    goto done;
undo:
    give_back(store, ref);
done:
    Py_XDECREF(ev), Py_XDECREF(marks), Py_XDECREF(mshard), Py_XDECREF(counters);
    Py_XDECREF(total), Py_XDECREF(hits), Py_XDECREF(words), Py_XDECREF(pu);
    Py_XDECREF(ushard), Py_XDECREF(updates), Py_XDECREF(seq), Py_XDECREF(ref);
    Py_XDECREF(total1), Py_XDECREF(hits1);
    return result;
}

/* What is decided under the lock: the put's ``(ref, updates)``, None (declined) or NULL. */
static PyObject *
put_item_locked(PyObject *store, PyObject *book, PyObject *item, PyObject *key,
                Py_ssize_t inline_below)
{
    PyObject *result = NULL, *index = NULL, *shard = NULL, *tl = NULL, *sizes = NULL;
    PyObject *plan = NULL, *nb = NULL, *ref = NULL, *counters = NULL, *total = NULL;
    PyObject *hits = NULL, *total1 = NULL, *misses = NULL, *words = NULL;
    PyObject *serde = NULL;
    NEED(index = fast_getattr(store, s_pub_index));
    NEED(shard = shard_of(index, key));
    PyObject *cid_obj = PyDict_GetItemWithError(shard, key); /* borrowed */
    if (cid_obj != NULL) { /* a hit (the look-up of ``_decide_locked``) */
        Py_INCREF(cid_obj);
        result = hit_locked(store, book, item, key, cid_obj);
        Py_DECREF(cid_obj);
        goto done;
    }
    if (PyErr_Occurred())
        goto done;
    if (item == Py_None || !PyDict_CheckExact(PyTuple_GET_ITEM(item, 0)))
        DECLINE(); /* a look-up not cached (the request's CacheMissError), or not a plain item */
    PyObject *value = PyTuple_GET_ITEM(item, 0), *updates = PyTuple_GET_ITEM(item, 1);
    NEED(serde = fast_getattr(store, s_serde));
    if ((PyObject *)Py_TYPE(serde) != serde_type)
        DECLINE(); /* another serde's plan is its own business: the request calls it */
    NEED(tl = fast_getattr(book, s_too_large));
    NEED(sizes = fast_getattr(tl, s_sizes));
    if (!PyDict_Check(sizes))
        DECLINE();
    if (PyDict_GET_SIZE(sizes))
        CHECK(PyDict_Contains(sizes, key)); /* remembered too large: served inline */
    plan = aioshm_plan_store(store, serde, value); /* the compiled plan (_core_plan.c) */
    if (plan == Py_None)
        Py_SETREF(plan, PyObject_CallMethodOneArg(store, s_plan, value)); /* declined */
    if (plan == NULL && PyErr_ExceptionMatches(too_large_error)) {
        /* measured too large: remembered and counted, the item served inline, as the
         * request does (``book.found_too_large``) */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        PyErr_NormalizeException(&et, &ev, &tb);
        PyObject *n = ev == NULL ? NULL : fast_getattr(ev, s_nbytes);
        Py_XDECREF(et), Py_XDECREF(ev), Py_XDECREF(tb);
        if (n == NULL)
            goto done;
        PyObject *fargs[3] = {book, key, n};
        PyObject *r = PyObject_VectorcallMethod(s_found_too_large, fargs,
                                                3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_DECREF(n);
        if (r == NULL)
            goto done;
        Py_DECREF(r);
        result = item;
        Py_INCREF(result);
        goto done;
    }
    if (plan == NULL) /* the plan's error, raised as the request raises it (nothing done yet):
                       * never cleared, or an interrupt would be lost and the plan run twice */
        goto done;
    NEED(nb = fast_getattr(plan, s_nbytes));
    if (!PyLong_CheckExact(nb))
        DECLINE();
    Py_ssize_t nbytes = PyLong_AsSsize_t(nb);
    if (nbytes == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        DECLINE();
    }
    if (nbytes >= inline_below)
        DECLINE(); /* a copy job */
    /* the counters and words, read before the put (nothing is changed if they are odd) */
    NEED(counters = fast_getattr(book, s_counters));
    NEED(total = fast_getattr(counters, s_total));
    NEED(hits = fast_getattr(counters, s_hits));
    NEED(words = fast_getattr(store, s_words));
    if (!PyLong_CheckExact(total) || !PyLong_CheckExact(hits))
        DECLINE();
    if ((ref = put_plain(store, key, plan, index, shard)) == NULL) {
        /* the put raised: a miss all the same, as the request's ``put_now`` path counts it
         * (``book.count_miss()``; an error of its own replaces the put's, as in Python) */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        PyObject *r = PyObject_CallMethodNoArgs(book, s_count_miss);
        if (r == NULL) {
            Py_XDECREF(et), Py_XDECREF(ev), Py_XDECREF(tb);
            goto done;
        }
        Py_DECREF(r);
        PyErr_Restore(et, ev, tb);
        goto done;
    }
    if (ref == Py_None)
        DECLINE(); /* no room (eviction), or anything else put_plain leaves to the reference */
    /* the put is made: ``book.count_miss()`` and ``book.keep_updates(h, updates)``, the
     * counters read again (the put may have run Python code that counted too: its drain, its
     * hand-out's clock, a finalizer) */
    Py_CLEAR(total);
    Py_CLEAR(hits);
    if ((total = fast_getattr(counters, s_total)) == NULL ||
        (hits = fast_getattr(counters, s_hits)) == NULL)
        goto undo;
    int64_t t, h, t1, m;
    if (as_i64(total, &t) == 0 && as_i64(hits, &h) == 0 && !__builtin_add_overflow(t, 1, &t1) &&
        !__builtin_sub_overflow(t1, h, &m)) { /* the usual counts: no generic int arithmetic */
        total1 = PyLong_FromLongLong(t1);
        misses = total1 == NULL ? NULL : PyLong_FromLongLong(m);
    }
    else {
        PyObject *one = PyLong_FromLong(1);
        if (one == NULL)
            goto undo;
        total1 = PyNumber_Add(total, one);
        Py_DECREF(one);
        misses = total1 == NULL ? NULL : PyNumber_Subtract(total1, hits);
    }
    if (total1 == NULL || misses == NULL || fast_setattr(counters, s_total, total1) < 0)
        goto undo;
    if (set_header_word(words, H_MISSES, misses) < 0)
        goto undo;
    if (keep_updates(book, key, updates) < 0)
        goto undo;
    result = PyTuple_Pack(2, ref, updates);
    if (result == NULL)
        goto undo;
    goto done;
undo: /* a failed allocation, or a counter gone meanwhile */
    give_back(store, ref);
done:
    Py_XDECREF(index), Py_XDECREF(shard), Py_XDECREF(tl), Py_XDECREF(sizes);
    Py_XDECREF(plan), Py_XDECREF(nb), Py_XDECREF(ref), Py_XDECREF(counters);
    Py_XDECREF(total), Py_XDECREF(hits), Py_XDECREF(total1), Py_XDECREF(misses);
    Py_XDECREF(words), Py_XDECREF(serde);
    return result;
}

static PyObject *
core_put_item(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "put_item takes 5 arguments (store, book, mm_item, mm_hash, inline_below)");
        return NULL;
    }
    PyObject *store = args[0], *book = args[1], *item = args[2], *key = args[3];
    if (ref_type == NULL || !PyUnicode_CheckExact(key) ||
        (item != Py_None && (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 2)) ||
        !PyLong_CheckExact(args[4]))
        Py_RETURN_NONE;
    Py_ssize_t inline_below = PyLong_AsSsize_t(args[4]);
    if (inline_below == -1 && PyErr_Occurred())
        return NULL;
    if (s_check_owner == NULL && intern_item_names() < 0)
        return NULL;
    PyObject *siblings = fast_getattr(book, s_siblings);
    if (siblings == NULL)
        return NULL;
    int shard = siblings != Py_None; /* a group shard: the request looks at its siblings */
    Py_DECREF(siblings);
    if (shard)
        Py_RETURN_NONE;
    /* the request's first step: the owner (a forked child may have inherited the lock held) */
    if (check_owner(store) < 0)
        return NULL;
    PyObject *r;
    PyObject *lock = fast_getattr(store, s_lock);
    if (lock == NULL)
        return NULL;
    if ((r = lock_call(lock, s_acquire, rlock_acquire)) == NULL) {
        Py_DECREF(lock);
        return NULL;
    }
    Py_DECREF(r);
    PyObject *result = put_item_locked(store, book, item, key, inline_below);
    PyObject *et = NULL, *ev = NULL, *tb = NULL;
    if (result == NULL)
        PyErr_Fetch(&et, &ev, &tb);
    r = lock_call(lock, s_release, rlock_release);
    Py_DECREF(lock);
    if (r == NULL) {
        Py_XDECREF(result);
        Py_XDECREF(et), Py_XDECREF(ev), Py_XDECREF(tb);
        return NULL;
    }
    Py_DECREF(r);
    if (result == NULL)
        PyErr_Restore(et, ev, tb);
    return result;
}

PyMethodDef aioshm_put_methods[] = {
    {"put_item", (PyCFunction)(void (*)(void))core_put_item, METH_FASTCALL,
     "put_item(store, book, mm_item, mm_hash, inline_below) -> (ShmRef, prompt_updates), or "
     "None (declined before any side effect: the sender request runs)"},
    {"publish_plain", (PyCFunction)(void (*)(void))core_publish_plain, METH_FASTCALL,
     "publish_plain(store, key, address, cid, length) -> ShmRef, or None (the reference runs)"},
    {"make_ref", (PyCFunction)(void (*)(void))core_make_ref, METH_FASTCALL,
     "make_ref(store, cid, seq) -> the ShmRef of a hand-out, or None (the reference decides)"},
    {"hand_out", (PyCFunction)(void (*)(void))core_hand_out, METH_FASTCALL,
     "hand_out(acks, cid) -> seq of the writer's usual hand-out, or None (the reference runs)"},
    {"settle_pairs", (PyCFunction)(void (*)(void))core_settle_pairs, METH_FASTCALL,
     "settle_pairs(ledger, acks, session) -> (settled, done): settle_all's loop, as far as it "
     "goes (the reference goes on from done)"},
    {"drain_logs", core_drain_logs, METH_O,
     "drain_logs(acks) -> how many acknowledgements the writer's usual drain read, or None "
     "(declined before any side effect: the reference runs)"},
    {"configure_hand_out", core_configure_hand_out, METH_VARARGS,
     "configure_hand_out(Acknowledgements, HandoutLedger, Debts, SlotState, ReaderTable): the "
     "classes hand_out and drain_logs know"},
    {"configure", core_configure, METH_VARARGS,
     "configure(ShmRef, plan type, serde type): the types put_plain recognises"},
    {"configure_evict", core_configure_evict, METH_VARARGS,
     "configure_evict(Eviction, EVICT_AHEAD_PUTS, EVICT_SLACK_CHUNKS, H_EVICTIONS): what the "
     "eviction pass of put_plain follows"},
    {"put_plain", (PyCFunction)(void (*)(void))core_put_plain, METH_FASTCALL,
     "put_plain(store, key, plan) -> ShmRef, or None (declined before any side effect)"},
    {NULL, NULL, 0, NULL},
};
