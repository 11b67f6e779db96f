/* The compiled put of a plain item: ``put_plain(store, key, plan)``.
 *
 * The store's ``_put_now`` (``aioshmcache/_store.py``, the reference) calls it first; it does
 * the same steps for the usual case in one call — duplicate checks, the ring's usual
 * allocation right after the tail (``ShmRingBuffer.try_allocate``), the payload write
 * (``MsgpackSerde.write`` of a plan: prefix and header, zeroed gaps, array bytes), the commit,
 * the tag's base, the row, key and index entries and the usage words (``_publish_put``) —
 * then takes the hand-out through the store's own ``_hand_out_seq`` and returns the
 * ``ShmRef``. Anything else (a duplicate, a wrap or no room, columns to grow, hints, another
 * serde, a source array that is not C-contiguous or changed size, ...) returns None *before
 * any side effect*, and the reference path handles it.
 *
 * Every check and every buffer is taken before the first store. Word stores into the segment
 * are release stores in program order: the ordering argument of ``_ring`` (chunk header, then
 * payload, then the committed state) holds against the compiler as well as the CPU. */
#include "_core.h"
#include <string.h>

#define MAX_RING_ID ((uint64_t)INT64_MAX)
#define STORE_WORD(p, v) __atomic_store_n((p), (uint64_t)(v), __ATOMIC_RELEASE)

static PyObject *ref_type, *plan_type, *serde_type;
static PyObject *s_index, *s_pending, *s_waiting, *s_ring, *s_serde, *s_rows, *s_keys;
static PyObject *s_secret, *s_nonce, *s_guarded, *s_has_hints, *s_hand_out_seq, *s_seg;
static PyObject *s_tail, *s_limit, *s_end, *s_head, *s_mask, *s_addr, *s_size, *s_id, *s_cpos;
static PyObject *s_state, *s_at, *s_at_mask, *s_lap, *s_used, *s_w, *s_hw, *s_closed, *s_forked;
static PyObject *s_layout, *s_sources, *s_shards, *s_n, *s_map_mask;

static int
intern_names(void)
{
    struct { PyObject **p; const char *s; } names[] = {
        {&s_index, "_index"}, {&s_pending, "_pending"}, {&s_waiting, "_waiting_keys"},
        {&s_ring, "ring"}, {&s_serde, "serde"}, {&s_rows, "_rows"}, {&s_keys, "_keys"},
        {&s_secret, "_secret"}, {&s_nonce, "_nonce"}, {&s_guarded, "_guarded"},
        {&s_has_hints, "_has_hints"}, {&s_hand_out_seq, "_hand_out_seq"}, {&s_seg, "_seg"},
        {&s_tail, "_tail"}, {&s_limit, "_limit"}, {&s_end, "_end"}, {&s_head, "_head"},
        {&s_mask, "_mask"}, {&s_addr, "_addr"}, {&s_size, "_size"}, {&s_id, "_id"},
        {&s_cpos, "_cpos"}, {&s_state, "_state"}, {&s_at, "_at"}, {&s_at_mask, "_at_mask"},
        {&s_lap, "_lap"}, {&s_used, "used_bytes"}, {&s_w, "_w"}, {&s_hw, "_hw"},
        {&s_closed, "closed"}, {&s_forked, "forked"}, {&s_layout, "_layout"},
        {&s_sources, "_sources"}, {&s_shards, "shards"}, {&s_n, "n"},
        {&s_map_mask, "mask"},
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

/* An int attribute as int64 (1: not an int in range; -1: error). */
static int
get_i64(PyObject *obj, PyObject *name, int64_t *out)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    if (!PyLong_CheckExact(v)) {
        Py_DECREF(v);
        return 1;
    }
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    Py_DECREF(v);
    if (x == -1 && PyErr_Occurred())
        return -1;
    if (overflow)
        return 1;
    *out = x;
    return 0;
}

static int
set_i64(PyObject *obj, PyObject *name, int64_t value)
{
    PyObject *v = PyLong_FromLongLong(value);
    if (v == NULL)
        return -1;
    int rc = PyObject_SetAttr(obj, name, v);
    Py_DECREF(v);
    return rc;
}

/* A writable buffer of exactly what the reference reads as words (1: not such a buffer). */
static int
get_words(PyObject *obj, PyObject *name, Py_buffer *view)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
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
    PyObject *shards = PyObject_GetAttr(map, s_shards);
    if (shards == NULL)
        return NULL;
    int64_t mask;
    int rc = get_i64(map, s_map_mask, &mask);
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

static int
bump_n(PyObject *map, int64_t *out)
{
    int64_t n;
    int rc = get_i64(map, s_n, &n);
    if (rc != 0) {
        if (rc == 1)
            PyErr_SetString(PyExc_RuntimeError, "internal error: a map's count is not an int");
        return -1;
    }
    if (out != NULL)
        *out = n + 1;
    return set_i64(map, s_n, n + 1);
}

/* A slice of ints ``[start, stop)`` within ``[0, limit]`` (0), else 1. */
static int
slice_bounds(PyObject *sl, Py_ssize_t limit, Py_ssize_t *start, Py_ssize_t *stop)
{
    if (!PySlice_Check(sl))
        return 1;
    Py_ssize_t step;
    if (PySlice_Unpack(sl, start, stop, &step) < 0) {
        PyErr_Clear();
        return 1;
    }
    if (step != 1 || *start < 0 || *start > *stop || *stop > limit)
        return 1;
    return 0;
}

#define MAX_SOURCES 64 /* the serde's flat items (``_FLAT_MAX``); more: the reference path */

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
    PyObject *v = PyObject_GetAttr(obj, name);
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

static PyObject *
core_put_plain(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "put_plain takes 3 arguments (store, key, plan)");
        return NULL;
    }
    if (ref_type == NULL)
        Py_RETURN_NONE; /* not configured: the reference path */
    PyObject *store = args[0], *key = args[1], *plan = args[2];
    if (!PyUnicode_CheckExact(key) || (PyObject *)Py_TYPE(plan) != plan_type)
        Py_RETURN_NONE;

    PyObject *result = NULL;
    Held held = {.ncol = 0, .has_ring = 0, .has_hw = 0, .nsrc = 0};
    PyObject *serde = NULL, *index = NULL, *ishard = NULL, *pending = NULL, *waiting = NULL;
    PyObject *ring = NULL, *seg = NULL, *layout = NULL, *sources = NULL, *at = NULL;
    PyObject *atshard = NULL, *rows = NULL, *keys = NULL, *rshard = NULL, *kshard = NULL;
    PyObject *guarded = NULL, *cid_obj = NULL, *k_obj = NULL, *u_obj = NULL, *row = NULL;
    PyObject *seq_obj = NULL, *fields = NULL, *nonce = NULL, *secret_obj = NULL;

    /* --- every check, no side effect -------------------------------------------------- */
    NEED(serde = PyObject_GetAttr(store, s_serde));
    if ((PyObject *)Py_TYPE(serde) != serde_type)
        DECLINE();
    {
        int hints = attr_true(store, s_has_hints);
        CHECK(hints);
    }
    NEED(index = PyObject_GetAttr(store, s_index));
    NEED(ishard = shard_of(index, key));
    {
        int has = PyDict_Contains(ishard, key);
        CHECK(has); /* a duplicate: the reference raises DuplicateKeyError */
    }
    NEED(pending = PyObject_GetAttr(store, s_pending));
    NEED(waiting = PyObject_GetAttr(store, s_waiting));
    if (!PyDict_CheckExact(pending) || !PyAnySet_CheckExact(waiting))
        DECLINE();
    CHECK(PyDict_Contains(pending, key));
    CHECK(PySet_Contains(waiting, key));

    NEED(layout = PyObject_GetAttr(plan, s_layout));
    NEED(sources = PyObject_GetAttr(plan, s_sources));
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
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(sources); i++) {
        PyObject *slot = PyTuple_GET_ITEM(slots, i);
        Py_ssize_t a, b;
        if (!PyTuple_CheckExact(slot) || PyTuple_GET_SIZE(slot) != 3)
            DECLINE();
        CHECK(slice_bounds(PyTuple_GET_ITEM(slot, 0), nbytes, &a, &b));
        Py_buffer *v = &held.src[held.nsrc];
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(sources, i), v, PyBUF_FULL_RO) < 0) {
            PyErr_Clear(); /* e.g. a datetime array: the reference copies it by numpy */
            DECLINE();
        }
        held.nsrc++;
        if (!PyBuffer_IsContiguous(v, 'C') || v->len != b - a)
            DECLINE(); /* the reference copies it, or raises SerdeError (size changed) */
    }

    NEED(ring = PyObject_GetAttr(store, s_ring));
    NEED(seg = PyObject_GetAttr(ring, s_seg));
    {
        int closed = attr_true(seg, s_closed);
        CHECK(closed);
        int forked = attr_true(seg, s_forked);
        CHECK(forked);
    }
    int64_t tail, limit, end, headk, mask, at_mask, lap, used;
    CHECK(get_i64(ring, s_tail, &tail));
    CHECK(get_i64(ring, s_limit, &limit));
    CHECK(get_i64(ring, s_end, &end));
    CHECK(get_i64(ring, s_head, &headk));
    CHECK(get_i64(ring, s_mask, &mask));
    CHECK(get_i64(ring, s_at_mask, &at_mask));
    CHECK(get_i64(ring, s_lap, &lap));
    CHECK(get_i64(ring, s_used, &used));
    int64_t size = CHUNK_HEADER + (((int64_t)nbytes + 63) & -64);
    if (tail < 0 || tail % 64 != 0 || tail + size > limit)
        DECLINE(); /* a wrap, or no room: the reference (which may evict) */
    if (end - headk > mask)
        DECLINE(); /* the columns must grow first */
    CHECK(get_words(ring, s_w, &held.ring));
    held.has_ring = 1;
    if (tail + size > held.ring.len)
        DECLINE();
    CHECK(get_words(store, s_hw, &held.hw));
    held.has_hw = 1;
    if (held.hw.len < AIOSHM_HEADER_SIZE)
        DECLINE();
    PyObject *cols[5] = {s_addr, s_size, s_id, s_cpos, s_state};
    int64_t j = end & mask;
    for (int c = 0; c < 5; c++) {
        CHECK(get_words(ring, cols[c], &held.col[held.ncol]));
        held.ncol++;
        if (held.col[c].len / 8 <= j)
            DECLINE();
    }
    NEED(at = PyObject_GetAttr(ring, s_at));
    if (!PyList_CheckExact(at) || PyList_GET_SIZE(at) != at_mask + 1)
        DECLINE();
    atshard = PyList_GET_ITEM(at, (Py_ssize_t)((tail >> 6) & at_mask));
    Py_INCREF(atshard);
    if (!PyDict_CheckExact(atshard))
        DECLINE();
    volatile uint64_t *hw = (uint64_t *)held.hw.buf;
    uint64_t cid = hw[H_NEXT_ID];
    if (cid > MAX_RING_ID || cid == 0)
        DECLINE(); /* exhausted: the reference raises */
    uint64_t secret;
    NEED(secret_obj = PyObject_GetAttr(store, s_secret));
    NEED(nonce = PyObject_GetAttr(store, s_nonce));
    if (!PyLong_CheckExact(secret_obj) || !PyLong_CheckExact(nonce))
        DECLINE();
    secret = PyLong_AsUnsignedLongLong(secret_obj);
    if (secret == (uint64_t)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        DECLINE();
    }
    NEED(rows = PyObject_GetAttr(store, s_rows));
    NEED(keys = PyObject_GetAttr(store, s_keys));
    NEED(guarded = PyObject_GetAttr(store, s_guarded));
    if (guarded != Py_None && !PyDict_CheckExact(guarded))
        DECLINE();
    NEED(cid_obj = PyLong_FromUnsignedLongLong(cid));
    NEED(rshard = shard_of(rows, cid_obj));
    NEED(kshard = shard_of(keys, cid_obj));
    NEED(k_obj = PyLong_FromLongLong(end));
    NEED(u_obj = PyLong_FromLongLong(tail >> 6));

    /* --- side effects, in the reference's order ----------------------------------------- */
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
    if (PyDict_SetItem(atshard, u_obj, k_obj) < 0 || set_i64(ring, s_end, end + 1) < 0 ||
        set_i64(ring, s_tail, tail + size) < 0 || set_i64(ring, s_used, used + size) < 0)
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
        if (b - a >= 64 * 1024) {
            Py_BEGIN_ALLOW_THREADS
            aioshm_copy_bytes(payload + a, held.src[i].buf, (size_t)(b - a));
            Py_END_ALLOW_THREADS
        }
        else {
            memcpy(payload + a, held.src[i].buf, (size_t)(b - a));
        }
    }
    /* ``commit``: the state word after every payload byte */
    STORE_WORD(&w[C_STATE], CHUNK_COMMITTED);
    ((int64_t *)held.col[4].buf)[j] = CHUNK_COMMITTED;
    /* ``_publish_put``: the tag's base, the row, key and index entries, the usage words */
    uint64_t epoch = hw[H_EPOCH];
    uint64_t base = aioshm_tag_base(secret, epoch, (uint64_t)tail, cid, (uint64_t)nbytes,
                                    (uint64_t)position);
    uint64_t packed[5] = {(uint64_t)tail, (uint64_t)nbytes, (uint64_t)position, base, epoch};
    NEED(row = PyBytes_FromStringAndSize((const char *)packed, sizeof packed));
    int64_t n_items;
    if (PyDict_SetItem(rshard, cid_obj, row) < 0 || bump_n(rows, NULL) < 0 ||
        PyDict_SetItem(kshard, cid_obj, key) < 0 || bump_n(keys, NULL) < 0 ||
        PyDict_SetItem(ishard, key, cid_obj) < 0 || bump_n(index, &n_items) < 0)
        goto done;
    if (guarded != Py_None && PyDict_SetItem(guarded, cid_obj, Py_None) < 0)
        goto done;
    STORE_WORD(&hw[H_BYTES_USED], (uint64_t)(used + size));
    STORE_WORD(&hw[H_ITEMS], (uint64_t)n_items);
    /* the hand-out: the store's own (the ledger), then the reference */
    release_all(&held);
    held = (Held){.ncol = 0, .has_ring = 0, .has_hw = 0, .nsrc = 0};
    NEED(seq_obj = PyObject_CallMethodOneArg(store, s_hand_out_seq, cid_obj));
    uint64_t seq = PyLong_AsUnsignedLongLong(seq_obj);
    if (seq == (uint64_t)-1 && PyErr_Occurred())
        goto done;
    PyObject *tag = PyLong_FromUnsignedLongLong(aioshm_finish_tag(base, seq));
    PyObject *ep = PyLong_FromUnsignedLongLong(epoch);
    PyObject *addr = PyLong_FromLongLong(tail);
    PyObject *len = PyLong_FromSsize_t(nbytes);
    PyObject *pos = PyLong_FromLongLong(position);
    if (tag && ep && addr && len && pos)
        fields = PyTuple_Pack(8, nonce, ep, addr, cid_obj, len, tag, pos, seq_obj);
    Py_XDECREF(tag), Py_XDECREF(ep), Py_XDECREF(addr), Py_XDECREF(len), Py_XDECREF(pos);
    if (fields == NULL)
        goto done;
    {
        PyObject *targs = PyTuple_Pack(1, fields);
        if (targs == NULL)
            goto done;
        result = PyTuple_Type.tp_new((PyTypeObject *)ref_type, targs, NULL);
        Py_DECREF(targs);
    }

done:
    release_all(&held);
    Py_XDECREF(serde), Py_XDECREF(index), Py_XDECREF(ishard), Py_XDECREF(pending);
    Py_XDECREF(waiting), Py_XDECREF(ring), Py_XDECREF(seg), Py_XDECREF(layout);
    Py_XDECREF(sources), Py_XDECREF(at), Py_XDECREF(atshard), Py_XDECREF(rows);
    Py_XDECREF(keys), Py_XDECREF(rshard), Py_XDECREF(kshard), Py_XDECREF(guarded);
    Py_XDECREF(cid_obj), Py_XDECREF(k_obj), Py_XDECREF(u_obj), Py_XDECREF(row);
    Py_XDECREF(seq_obj), Py_XDECREF(fields), Py_XDECREF(nonce), Py_XDECREF(secret_obj);
    return result;
}

/* ``make_ref(store, cid, seq)``: the reference of hand-out ``seq`` of the cached chunk ``cid``
 * (``StoreWriter._ref``, the reference): its row, the tag's base (recomputed, and the row
 * rewritten, once per epoch), the tag. None (nothing done) when the row is missing or not what
 * the reference packs: the reference then runs (and raises what it raises). */
static PyObject *
core_make_ref(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "make_ref takes 3 arguments (store, cid, seq)");
        return NULL;
    }
    if (ref_type == NULL)
        Py_RETURN_NONE;
    PyObject *store = args[0], *cid_obj = args[1], *seq_obj = args[2];
    if (!PyLong_CheckExact(cid_obj) || !PyLong_CheckExact(seq_obj))
        Py_RETURN_NONE;
    uint64_t cid = PyLong_AsUnsignedLongLong(cid_obj), seq = PyLong_AsUnsignedLongLong(seq_obj);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *result = NULL, *rows = NULL, *shard = NULL, *secret_obj = NULL, *nonce = NULL;
    PyObject *fields = NULL, *row = NULL;
    Held held = {.ncol = 0, .has_ring = 0, .has_hw = 0, .nsrc = 0};
    NEED(rows = PyObject_GetAttr(store, s_rows));
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
    CHECK(get_words(store, s_hw, &held.hw));
    held.has_hw = 1;
    if (held.hw.len < AIOSHM_HEADER_SIZE)
        DECLINE();
    uint64_t epoch = ((volatile uint64_t *)held.hw.buf)[H_EPOCH];
    NEED(nonce = PyObject_GetAttr(store, s_nonce));
    if (f[4] != epoch) { /* the tag's base, once per epoch */
        NEED(secret_obj = PyObject_GetAttr(store, s_secret));
        uint64_t secret = PyLong_AsUnsignedLongLong(secret_obj);
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
    {
        PyObject *tag = PyLong_FromUnsignedLongLong(aioshm_finish_tag(f[3], seq));
        PyObject *ep = PyLong_FromUnsignedLongLong(epoch);
        PyObject *addr = PyLong_FromUnsignedLongLong(f[0]);
        PyObject *len = PyLong_FromUnsignedLongLong(f[1]);
        PyObject *pos = PyLong_FromUnsignedLongLong(f[2]);
        if (tag && ep && addr && len && pos)
            fields = PyTuple_Pack(8, nonce, ep, addr, cid_obj, len, tag, pos, seq_obj);
        Py_XDECREF(tag), Py_XDECREF(ep), Py_XDECREF(addr), Py_XDECREF(len), Py_XDECREF(pos);
    }
    if (fields == NULL)
        goto done;
    {
        PyObject *targs = PyTuple_Pack(1, fields);
        if (targs == NULL)
            goto done;
        result = PyTuple_Type.tp_new((PyTypeObject *)ref_type, targs, NULL);
        Py_DECREF(targs);
    }
done:
    release_all(&held);
    Py_XDECREF(rows), Py_XDECREF(shard), Py_XDECREF(secret_obj), Py_XDECREF(nonce);
    Py_XDECREF(fields), Py_XDECREF(row);
    return result;
}

PyMethodDef aioshm_put_methods[] = {
    {"make_ref", (PyCFunction)(void (*)(void))core_make_ref, METH_FASTCALL,
     "make_ref(store, cid, seq) -> the ShmRef of a hand-out, or None (the reference decides)"},
    {"configure", core_configure, METH_VARARGS,
     "configure(ShmRef, plan type, serde type): the types put_plain recognises"},
    {"put_plain", (PyCFunction)(void (*)(void))core_put_plain, METH_FASTCALL,
     "put_plain(store, key, plan) -> ShmRef, or None (declined before any side effect)"},
    {NULL, NULL, 0, NULL},
};
