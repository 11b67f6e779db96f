/* The compiled plan of the usual items: ``plan_item(serde, value)``.
 *
 * ``MsgpackSerde.plan`` (``aioshmcache/_serde``) is the reference: this walks the same value,
 * packs the same msgpack structure header and lays out the same payload, producing a
 * ``MsgpackPlan`` whose ``nbytes``, ``_layout`` (nbytes, head slice, the prefix + header +
 * padding bytes, the array slots, the gaps) and ``_sources`` (the arrays themselves) equal the
 * reference's. It handles the shapes a put usually carries — exact ``dict`` (``str`` keys),
 * ``list``, ``tuple``, ``str``, ``int`` (in msgpack's range), ``float``, ``bool``, ``None``,
 * ``bytes`` of at most ``INLINE_BYTES_MAX`` bytes and exact ``numpy.ndarray`` of a dtype the
 * encoder already validated (``encode._ENC_DTYPES``) — and declines (returns ``None``, having
 * changed nothing) for anything else: a subclass, a numpy scalar, a tensor, large bytes, an
 * int out of range, a str that is not UTF-8 encodable, a dtype not validated yet, any limit of
 * the serde reached (depth, arrays, dimensions, containers, header bytes), an error of any
 * kind. The reference then plans it, and raises its typed errors.
 *
 * ``aioshm_plan_store(store, serde, value)`` is ``StoreWriter.plan`` (the serde's plan and the
 * store's ``max_object_bytes``) for the one-item miss of ``_core_put.c``; it declines as well
 * when either method is not the reference's own (a subclass, a monkeypatch), or the object is
 * over the limit (the reference raises ``ObjectTooLargeError``).
 *
 * Arrays are read through numpy's public ``PyArrayObject`` fields (data, nd, dimensions,
 * strides, base, descr: the struct layout numpy's C API exposes, unchanged since numpy 1.7),
 * without numpy's headers; ``configure_plan`` checks that layout on a live array first and
 * leaves the compiled plan off (declining every call) if it does not match. */
#include "_core.h"

#include <string.h>
#include <structmember.h>

/* numpy's public array struct, up to the fields read here */
typedef struct {
    PyObject_HEAD
    char *data;
    int nd;
    Py_ssize_t *dimensions;
    Py_ssize_t *strides;
    PyObject *base;
    PyObject *descr;
    int flags;
} NpArray;
#define NP_C_CONTIGUOUS 0x0001 /* ``NPY_ARRAY_C_CONTIGUOUS`` */

#define INLINE_BYTES_MAX 1023
#define BYTES_COPY (4 << 10)  /* ``encode._BYTES_COPY``: a slot's ``tiny`` */
#define SMALL_COPY (64 << 10) /* ``encode._SMALL_COPY``: a slot's ``small`` */
#define MAX_NDIM 64
#define DESCR_CACHE 16

static PyTypeObject *serde_t, *plan_t, *ndarray_t;
static PyObject *enc_dtypes, *zeros, *serde_plan_func, *writer_plan_func;
static PyObject *s_plan_name, *s_max_object_bytes;
static Py_ssize_t off_nbytes, off_layout, off_sources;
static Py_ssize_t off_depth, off_ndim, off_arrays, off_containers, off_header;
static int plan_on;

/* dtype -> (its descriptor string, its itemsize): by identity, holding the dtype */
static struct {
    PyObject *descr, *enc;
    Py_ssize_t itemsize;
} descr_cache[DESCR_CACHE];
static int descr_n;

/* --- the walk ---------------------------------------------------------------------------- */

typedef struct {
    Py_ssize_t off, nbytes;
    PyObject *src; /* held until the call ends */
} Chunk;

typedef struct {
    char *buf;
    Py_ssize_t len, cap;
    Chunk *chunks;
    Py_ssize_t nchunks, chunk_cap;
    Py_ssize_t cursor;
    long long max_depth, max_ndim, max_arrays, nodes_left, max_header;
    char sbuf[512];
    Chunk schunks[16];
} Walk;

static int
grow(Walk *w, Py_ssize_t n)
{
    if (w->len + n <= w->cap)
        return 0;
    Py_ssize_t cap = w->cap * 2;
    while (cap < w->len + n)
        cap *= 2;
    if (cap > w->max_header + 64 + n)
        cap = w->max_header + 64 + n;
    if (w->len + n > cap)
        return -1; /* past max_header_bytes: the reference refuses it */
    char *b = w->buf == w->sbuf ? PyMem_Malloc(cap) : PyMem_Realloc(w->buf, cap);
    if (b == NULL)
        return -1;
    if (w->buf == w->sbuf)
        memcpy(b, w->sbuf, w->len);
    w->buf = b;
    w->cap = cap;
    return 0;
}

static inline int
put(Walk *w, const void *p, Py_ssize_t n)
{
    if (grow(w, n) < 0)
        return -1;
    memcpy(w->buf + w->len, p, n);
    w->len += n;
    return 0;
}

static inline int
put_be(Walk *w, unsigned char tag, uint64_t v, int n)
{
    unsigned char b[9];
    b[0] = tag;
    for (int i = 0; i < n; i++)
        b[1 + i] = (unsigned char)(v >> (8 * (n - 1 - i)));
    return put(w, b, 1 + n);
}

/* msgpack's headers as msgpack-python's packer writes them */
static int
put_len(Walk *w, Py_ssize_t n, unsigned char fix, Py_ssize_t fixmax, unsigned char t8,
        unsigned char t16, unsigned char t32)
{
    if (n <= fixmax)
        return put_be(w, (unsigned char)(fix | n), 0, 0);
    if (t8 && n <= 0xff)
        return put_be(w, t8, (uint64_t)n, 1);
    if (n <= 0xffff)
        return put_be(w, t16, (uint64_t)n, 2);
    if ((uint64_t)n <= UINT32_MAX)
        return put_be(w, t32, (uint64_t)n, 4);
    return -1;
}

static int
put_ext_head(Walk *w, Py_ssize_t n, int code)
{
    unsigned char b[6];
    int k;
    switch (n) {
    case 1: b[0] = 0xd4, k = 1; break;
    case 2: b[0] = 0xd5, k = 1; break;
    case 4: b[0] = 0xd6, k = 1; break;
    case 8: b[0] = 0xd7, k = 1; break;
    case 16: b[0] = 0xd8, k = 1; break;
    default:
        if (n <= 0xff)
            b[0] = 0xc7, b[1] = (unsigned char)n, k = 2;
        else if (n <= 0xffff)
            b[0] = 0xc8, b[1] = (unsigned char)(n >> 8), b[2] = (unsigned char)n, k = 3;
        else if ((uint64_t)n <= UINT32_MAX) {
            b[0] = 0xc9;
            for (int i = 0; i < 4; i++)
                b[1 + i] = (unsigned char)((uint64_t)n >> (8 * (3 - i)));
            k = 5;
        } else
            return -1;
    }
    b[k++] = (unsigned char)code;
    return put(w, b, k);
}

static int
put_str(Walk *w, PyObject *s)
{
    Py_ssize_t n;
    const char *p = PyUnicode_AsUTF8AndSize(s, &n);
    if (p == NULL) {
        PyErr_Clear(); /* e.g. a lone surrogate: the reference raises SerdeError */
        return -1;
    }
    if (put_len(w, n, 0xa0, 31, 0xd9, 0xda, 0xdb) < 0)
        return -1;
    return put(w, p, n);
}

static int
put_le(Walk *w, uint64_t v, int n)
{
    unsigned char b[8];
    for (int i = 0; i < n; i++)
        b[i] = (unsigned char)(v >> (8 * i));
    return put(w, b, n);
}

/* the dtype's descriptor string and itemsize, if the encoder validated it (else 0) */
static PyObject *
dtype_enc(PyObject *descr, Py_ssize_t *itemsize)
{
    for (int i = 0; i < descr_n; i++)
        if (descr_cache[i].descr == descr) {
            *itemsize = descr_cache[i].itemsize;
            return descr_cache[i].enc;
        }
    PyObject *enc = PyDict_GetItemWithError(enc_dtypes, descr); /* borrowed */
    if (enc == NULL || !PyBytes_CheckExact(enc)) {
        PyErr_Clear();
        return NULL; /* not validated yet: the reference validates (and remembers) it */
    }
    PyObject *isz = PyObject_GetAttrString(descr, "itemsize");
    if (isz == NULL) {
        PyErr_Clear();
        return NULL;
    }
    Py_ssize_t n = PyLong_AsSsize_t(isz);
    Py_DECREF(isz);
    if (n <= 0) {
        PyErr_Clear();
        return NULL;
    }
    if (descr_n < DESCR_CACHE) {
        descr_cache[descr_n].descr = Py_NewRef(descr);
        descr_cache[descr_n].enc = Py_NewRef(enc);
        descr_cache[descr_n].itemsize = n;
        descr_n++;
    }
    *itemsize = n;
    return enc;
}

/* ``aioshm_array_bytes`` (``_core.h``): an exact, C-contiguous array of a dtype met here. */
int
aioshm_array_bytes(PyObject *obj, const char **data, Py_ssize_t *nbytes)
{
    if (!plan_on || Py_TYPE(obj) != ndarray_t)
        return 0;
    NpArray *a = (NpArray *)obj;
    if (!(a->flags & NP_C_CONTIGUOUS) || a->nd < 0 || a->nd > MAX_NDIM)
        return 0;
    Py_ssize_t n = -1;
    for (int i = 0; i < descr_n; i++)
        if (descr_cache[i].descr == a->descr)
            n = descr_cache[i].itemsize;
    for (int i = 0; i < a->nd && n >= 0; i++)
        if (a->dimensions[i] < 0 || __builtin_mul_overflow(n, a->dimensions[i], &n))
            n = -1;
    if (n < 0)
        return 0;
    *data = a->data, *nbytes = n;
    return 1;
}

static int
node(Walk *w, int n)
{
    w->nodes_left -= n;
    return w->nodes_left < 0 ? -1 : 0;
}

static int
put_array(Walk *w, PyObject *obj)
{
    NpArray *a = (NpArray *)obj;
    Py_ssize_t itemsize;
    PyObject *enc = dtype_enc(a->descr, &itemsize);
    if (enc == NULL)
        return -1;
    int nd = a->nd;
    if (nd < 0 || nd > MAX_NDIM || nd > w->max_ndim)
        return -1;
    uint64_t nbytes = (uint64_t)itemsize;
    for (int i = 0; i < nd; i++) {
        if (a->dimensions[i] < 0)
            return -1;
        if (__builtin_mul_overflow(nbytes, (uint64_t)a->dimensions[i], &nbytes))
            return -1;
    }
    if (nbytes > (uint64_t)PY_SSIZE_T_MAX / 2)
        return -1;
    if (w->nchunks >= w->max_arrays)
        return -1;
    if (w->nchunks == w->chunk_cap) {
        Py_ssize_t cap = w->chunk_cap * 2;
        Chunk *c = w->chunks == w->schunks ? PyMem_Malloc(cap * sizeof *c)
                                           : PyMem_Realloc(w->chunks, cap * sizeof *c);
        if (c == NULL)
            return -1;
        if (w->chunks == w->schunks)
            memcpy(c, w->schunks, sizeof w->schunks);
        w->chunks = c;
        w->chunk_cap = cap;
    }
    Py_ssize_t off = (w->cursor + PAYLOAD_ALIGN - 1) & ~(Py_ssize_t)(PAYLOAD_ALIGN - 1);
    if ((uint64_t)off > (uint64_t)PY_SSIZE_T_MAX / 2 - nbytes)
        return -1; /* the arrays' total past any store's size: the reference's sums decide */
    w->cursor = off + (Py_ssize_t)nbytes;
    w->chunks[w->nchunks++] = (Chunk){off, (Py_ssize_t)nbytes, Py_NewRef(obj)};
    Py_ssize_t dlen = PyBytes_GET_SIZE(enc);
    if (dlen > 0xff)
        return -1;
    if (put_ext_head(w, 19 + 8 * (Py_ssize_t)nd + dlen, 1) < 0 || put_le(w, (uint64_t)off, 8) < 0 ||
        put_le(w, nbytes, 8) < 0)
        return -1;
    unsigned char fb[3] = {0, (unsigned char)nd, (unsigned char)dlen};
    if (put(w, fb, 3) < 0)
        return -1;
    for (int i = 0; i < nd; i++)
        if (put_le(w, (uint64_t)a->dimensions[i], 8) < 0)
            return -1;
    return put(w, PyBytes_AS_STRING(enc), dlen);
}

static int
conv(Walk *w, PyObject *obj, long long depth)
{
    PyTypeObject *t = Py_TYPE(obj);
    if (t == &PyUnicode_Type)
        return put_str(w, obj);
    if (t == &PyFloat_Type) {
        double d = PyFloat_AS_DOUBLE(obj);
        uint64_t u;
        memcpy(&u, &d, 8);
        return put_be(w, 0xcb, u, 8);
    }
    if (t == &PyBool_Type)
        return put_be(w, obj == Py_True ? 0xc3 : 0xc2, 0, 0);
    if (obj == Py_None)
        return put_be(w, 0xc0, 0, 0);
    if (t == &PyLong_Type) {
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
        if (v == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return -1;
        }
        if (overflow < 0)
            return -1; /* below msgpack's range: the reference raises */
        if (overflow > 0) {
            unsigned long long u = PyLong_AsUnsignedLongLong(obj);
            if (u == (unsigned long long)-1 && PyErr_Occurred()) {
                PyErr_Clear();
                return -1; /* above it */
            }
            return put_be(w, 0xcf, u, 8);
        }
        if (v >= 0) {
            if (v < 0x80)
                return put_be(w, (unsigned char)v, 0, 0);
            if (v <= 0xff)
                return put_be(w, 0xcc, (uint64_t)v, 1);
            if (v <= 0xffff)
                return put_be(w, 0xcd, (uint64_t)v, 2);
            if (v <= 0xffffffffLL)
                return put_be(w, 0xce, (uint64_t)v, 4);
            return put_be(w, 0xcf, (uint64_t)v, 8);
        }
        if (v >= -32)
            return put_be(w, (unsigned char)(int8_t)v, 0, 0);
        if (v >= -128)
            return put_be(w, 0xd0, (uint64_t)v, 1);
        if (v >= -32768)
            return put_be(w, 0xd1, (uint64_t)v, 2);
        if (v >= -2147483648LL)
            return put_be(w, 0xd2, (uint64_t)v, 4);
        return put_be(w, 0xd3, (uint64_t)v, 8);
    }
    if (t == ndarray_t)
        return put_array(w, obj);
    if (t == &PyDict_Type) {
        depth += 1;
        if (depth > w->max_depth || node(w, 1) < 0)
            return -1;
        if (put_len(w, PyDict_GET_SIZE(obj), 0x80, 15, 0, 0xde, 0xdf) < 0)
            return -1;
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(obj, &pos, &k, &v)) {
            if (!PyUnicode_CheckExact(k))
                return -1; /* bytes and str subclasses: the reference */
            if (put_str(w, k) < 0 || conv(w, v, depth) < 0)
                return -1;
        }
        return 0;
    }
    if (t == &PyList_Type || t == &PyTuple_Type) {
        int tup = t == &PyTuple_Type;
        depth += 1;
        if (depth > w->max_depth || node(w, tup ? 2 : 1) < 0)
            return -1;
        Py_ssize_t n = Py_SIZE(obj);
        if (put_len(w, n + tup, 0x90, 15, 0, 0xdc, 0xdd) < 0)
            return -1;
        if (tup && put_ext_head(w, 0, 3) < 0) /* the tuple's marker */
            return -1;
        PyObject **items = tup ? ((PyTupleObject *)obj)->ob_item : ((PyListObject *)obj)->ob_item;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (Py_SIZE(obj) != n)
                return -1; /* cannot happen (no Python code runs), but never read past */
            if (conv(w, items[i], depth) < 0)
                return -1;
        }
        return 0;
    }
    if (t == &PyBytes_Type) {
        Py_ssize_t n = PyBytes_GET_SIZE(obj);
        if (n > INLINE_BYTES_MAX)
            return -1; /* a data-section blob: the reference */
        if (put_len(w, n, 0, -1, 0xc4, 0xc5, 0xc6) < 0)
            return -1;
        return put(w, PyBytes_AS_STRING(obj), n);
    }
    return -1;
}

/* --- the plan ---------------------------------------------------------------------------- */

static inline PyObject *
slot_get(PyObject *obj, Py_ssize_t off)
{
    return *(PyObject **)((char *)obj + off);
}

static int
limit_of(PyObject *serde, Py_ssize_t off, long long *out)
{
    PyObject *v = slot_get(serde, off);
    if (v == NULL || !PyLong_CheckExact(v))
        return -1;
    *out = PyLong_AsLongLong(v);
    if (*out == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return 0;
}

static PyObject *
slice_of(Py_ssize_t a, Py_ssize_t b)
{
    PyObject *lo = PyLong_FromSsize_t(a), *hi = lo == NULL ? NULL : PyLong_FromSsize_t(b);
    PyObject *s = hi == NULL ? NULL : PySlice_New(lo, hi, NULL);
    Py_XDECREF(lo), Py_XDECREF(hi);
    return s;
}

/* The layout of a finished walk (``encode._layout``): a new tuple, or NULL with an error. */
static PyObject *
build_layout(Walk *w, Py_ssize_t data_off)
{
    Py_ssize_t hlen = w->len, hend = PAYLOAD_PREFIX_SIZE + hlen;
    Py_ssize_t data_len = w->cursor, n = w->nchunks, ngaps = 0;
    PyObject *blob = NULL, *head = NULL, *slots = NULL, *gaps = NULL, *nb = NULL;
    PyObject *layout = NULL;
    if ((blob = PyBytes_FromStringAndSize(NULL, data_off)) == NULL)
        goto done;
    char *p = PyBytes_AS_STRING(blob);
    memcpy(p, "ASHM", 4);
    p[4] = 1, p[5] = 0, p[6] = 0, p[7] = 0; /* version 1, flags 0 */
    for (int i = 0; i < 4; i++)
        p[8 + i] = (char)((uint64_t)hlen >> (8 * i));
    for (int i = 0; i < 8; i++)
        p[12 + i] = (char)((uint64_t)data_len >> (8 * i));
    memcpy(p + PAYLOAD_PREFIX_SIZE, w->buf, hlen);
    memset(p + hend, 0, data_off - hend);
    Py_ssize_t prev = data_off;
    for (Py_ssize_t i = 0; i < n; i++) { /* the gaps: a run of padding before a slot */
        ngaps += data_off + w->chunks[i].off != prev;
        prev = data_off + w->chunks[i].off + w->chunks[i].nbytes;
    }
    if ((head = slice_of(0, data_off)) == NULL || (slots = PyTuple_New(n)) == NULL ||
        (gaps = PyTuple_New(ngaps)) == NULL)
        goto done;
    prev = data_off;
    for (Py_ssize_t i = 0, g = 0; i < n; i++) {
        Chunk *c = &w->chunks[i];
        Py_ssize_t start = data_off + c->off;
        if (start != prev) {
            PyObject *gs = slice_of(prev, start);
            PyObject *z = gs == NULL ? NULL : PySequence_GetSlice(zeros, 0, start - prev);
            PyObject *gap = z == NULL ? NULL : PyTuple_Pack(2, gs, z);
            Py_XDECREF(gs), Py_XDECREF(z);
            if (gap == NULL)
                goto done;
            PyTuple_SET_ITEM(gaps, g++, gap);
        }
        prev = start + c->nbytes;
        PyObject *ss = slice_of(start, prev);
        if (ss == NULL)
            goto done;
        PyObject *tiny = (c->nbytes > 0 && c->nbytes <= BYTES_COPY) ? Py_True : Py_False;
        PyObject *small = (c->nbytes > 0 && c->nbytes <= SMALL_COPY) ? Py_True : Py_False;
        PyObject *slot = PyTuple_Pack(3, ss, tiny, small);
        Py_DECREF(ss);
        if (slot == NULL)
            goto done;
        PyTuple_SET_ITEM(slots, i, slot);
    }
    if ((nb = PyLong_FromSsize_t(data_off + data_len)) == NULL)
        goto done;
    layout = PyTuple_Pack(5, nb, head, blob, slots, gaps);
done:
    Py_XDECREF(blob), Py_XDECREF(head), Py_XDECREF(slots), Py_XDECREF(gaps), Py_XDECREF(nb);
    return layout;
}

/* Layouts by their first bytes (prefix, header, padding), which determine all of it: items of
 * one shape share one layout, as the reference's flat items do (``MsgpackSerde._shapes``),
 * without its objects made again each time. A direct-mapped table of small layouts; the walk
 * (and its checks against the serde's limits) runs on every plan all the same. */
#define LAYOUT_CACHE 64
#define LAYOUT_CACHE_BLOB_MAX 4096
static PyObject *layout_cache[LAYOUT_CACHE];

static uint64_t
blob_hash(const Walk *w)
{
    uint64_t h = UINT64_C(0x9E3779B97F4A7C15) ^ (uint64_t)w->cursor ^ ((uint64_t)w->len << 40);
    Py_ssize_t i = 0;
    for (; i + 8 <= w->len; i += 8) {
        uint64_t v;
        memcpy(&v, w->buf + i, 8);
        h = (h ^ v) * UINT64_C(0xC2B2AE3D27D4EB4F);
        h ^= h >> 29;
    }
    uint64_t v = 0;
    memcpy(&v, w->buf + i, w->len - i);
    h = (h ^ v) * UINT64_C(0x165667B19E3779F9);
    return h ^ (h >> 32);
}

/* the cached layout of this walk's bytes (a new reference), or NULL (none) */
static PyObject *
cached_layout(const Walk *w, Py_ssize_t data_off, size_t idx)
{
    PyObject *layout = layout_cache[idx];
    if (layout == NULL)
        return NULL;
    PyObject *blob = PyTuple_GET_ITEM(layout, 2);
    const char *p = PyBytes_AS_STRING(blob);
    uint32_t hlen;
    uint64_t data_len;
    memcpy(&hlen, p + 8, 4);
    memcpy(&data_len, p + 12, 8);
    if (PyBytes_GET_SIZE(blob) != data_off || hlen != (uint64_t)w->len ||
        data_len != (uint64_t)w->cursor ||
        memcmp(p + PAYLOAD_PREFIX_SIZE, w->buf, (size_t)w->len) != 0)
        return NULL;
    return Py_NewRef(layout);
}

/* the plan of a finished walk (``encode._layout`` and ``encode._new_plan``) */
static PyObject *
build_plan(Walk *w)
{
    Py_ssize_t hend = PAYLOAD_PREFIX_SIZE + w->len;
    Py_ssize_t data_off = (hend + PAYLOAD_ALIGN - 1) & ~(Py_ssize_t)(PAYLOAD_ALIGN - 1);
    Py_ssize_t n = w->nchunks;
    size_t idx = (size_t)(blob_hash(w) % LAYOUT_CACHE);
    int cacheable = data_off <= LAYOUT_CACHE_BLOB_MAX;
    PyObject *layout = cacheable ? cached_layout(w, data_off, idx) : NULL;
    PyObject *sources = NULL, *plan = NULL;
    if (layout == NULL) {
        if ((layout = build_layout(w, data_off)) == NULL)
            return NULL;
        if (cacheable)
            Py_XSETREF(layout_cache[idx], Py_NewRef(layout));
    }
    if ((sources = PyTuple_New(n)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++)
        PyTuple_SET_ITEM(sources, i, Py_NewRef(w->chunks[i].src));
    if ((plan = plan_t->tp_alloc(plan_t, 0)) == NULL)
        goto done;
    *(PyObject **)((char *)plan + off_nbytes) = Py_NewRef(PyTuple_GET_ITEM(layout, 0));
    *(PyObject **)((char *)plan + off_layout) = Py_NewRef(layout);
    *(PyObject **)((char *)plan + off_sources) = Py_NewRef(sources);
done:
    Py_XDECREF(layout), Py_XDECREF(sources);
    return plan;
}

/* ``serde.plan(value)`` compiled: a new plan, or NULL (declined; no error set) */
static PyObject *
plan_of(PyObject *serde, PyObject *value)
{
    if (!plan_on || Py_TYPE(serde) != serde_t)
        return NULL;
    if (_PyType_Lookup(serde_t, s_plan_name) != serde_plan_func)
        return NULL; /* the reference's method was replaced: it decides */
    Walk w;
    w.buf = w.sbuf, w.len = 0, w.cap = sizeof w.sbuf;
    w.chunks = w.schunks, w.nchunks = 0, w.chunk_cap = sizeof w.schunks / sizeof w.schunks[0];
    w.cursor = 0;
    PyObject *plan = NULL;
    if (limit_of(serde, off_depth, &w.max_depth) < 0 || limit_of(serde, off_ndim, &w.max_ndim) < 0 ||
        limit_of(serde, off_arrays, &w.max_arrays) < 0 ||
        limit_of(serde, off_containers, &w.nodes_left) < 0 ||
        limit_of(serde, off_header, &w.max_header) < 0)
        goto done;
    /* the serde's ranges (it refuses others when set): sums with them cannot overflow */
    if ((unsigned long long)(w.max_depth | w.max_ndim | w.max_arrays | w.nodes_left |
                             w.max_header) >> 33) /* (a negative one has its top bits set) */
        goto done;
    if (conv(&w, value, 0) < 0 || w.len > w.max_header)
        goto done;
    plan = build_plan(&w);
    if (plan == NULL)
        PyErr_Clear(); /* e.g. no memory: the reference tries, and raises */
done:
    for (Py_ssize_t i = 0; i < w.nchunks; i++)
        Py_DECREF(w.chunks[i].src);
    if (w.buf != w.sbuf)
        PyMem_Free(w.buf);
    if (w.chunks != w.schunks)
        PyMem_Free(w.chunks);
    return plan;
}

PyObject *
aioshm_plan_store(PyObject *store, PyObject *serde, PyObject *value)
{
    if (!plan_on)
        Py_RETURN_NONE;
    if (writer_plan_func == NULL) {
        PyObject *mod = PyImport_ImportModule("aioshmcache._store");
        PyObject *cls = mod == NULL ? NULL : PyObject_GetAttrString(mod, "StoreWriter");
        Py_XDECREF(mod);
        if (cls == NULL || !PyType_Check(cls)) {
            Py_XDECREF(cls);
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        PyObject *f = _PyType_Lookup((PyTypeObject *)cls, s_plan_name);
        writer_plan_func = Py_XNewRef(f);
        Py_DECREF(cls);
        if (writer_plan_func == NULL)
            Py_RETURN_NONE;
    }
    if (_PyType_Lookup(Py_TYPE(store), s_plan_name) != writer_plan_func)
        Py_RETURN_NONE; /* a store with its own plan */
    PyObject *d = _PyType_Lookup(Py_TYPE(store), s_max_object_bytes);
    if (d == NULL || !Py_IS_TYPE(d, &PyMemberDescr_Type) ||
        Py_TYPE(store)->tp_getattro != PyObject_GenericGetAttr)
        Py_RETURN_NONE;
    PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
    if (m->type != T_OBJECT_EX || m->offset <= 0)
        Py_RETURN_NONE;
    PyObject *limit = slot_get(store, m->offset);
    if (limit == NULL || !PyLong_CheckExact(limit))
        Py_RETURN_NONE;
    Py_ssize_t max = PyLong_AsSsize_t(limit);
    if (max == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *plan = plan_of(serde, value);
    if (plan == NULL)
        Py_RETURN_NONE;
    PyObject *nb = slot_get(plan, off_nbytes);
    if (PyLong_AsSsize_t(nb) > max) {
        Py_DECREF(plan);
        Py_RETURN_NONE; /* too large: the reference raises ObjectTooLargeError */
    }
    return plan;
}

/* --- the module's functions -------------------------------------------------------------- */

static Py_ssize_t
member_offset(PyTypeObject *t, const char *name)
{
    PyObject *n = PyUnicode_InternFromString(name);
    if (n == NULL)
        return -1;
    PyObject *d = _PyType_Lookup(t, n);
    Py_DECREF(n);
    if (d == NULL || !Py_IS_TYPE(d, &PyMemberDescr_Type))
        return -1;
    PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
    return m->type == T_OBJECT_EX && m->offset > 0 ? m->offset : -1;
}

/* ``member_offset`` for the other sections (``_core.h``). */
Py_ssize_t
aioshm_member_offset(PyTypeObject *t, const char *name)
{
    return member_offset(t, name);
}

/* numpy's array struct as this file reads it, checked on a live array: 1 if it matches */
static int
array_layout_ok(PyObject *numpy)
{
    int ok = 0;
    PyObject *arr = PyObject_CallMethod(numpy, "empty", "((ii)s)", 3, 5, "float32");
    PyObject *dt = NULL, *iface = NULL;
    if (arr == NULL || (PyObject *)Py_TYPE(arr) != (PyObject *)ndarray_t)
        goto done;
    if ((dt = PyObject_GetAttrString(arr, "dtype")) == NULL ||
        (iface = PyObject_GetAttrString(arr, "__array_interface__")) == NULL)
        goto done;
    PyObject *data = PyDict_Check(iface) ? PyDict_GetItemString(iface, "data") : NULL;
    if (data == NULL || !PyTuple_Check(data) || PyTuple_GET_SIZE(data) < 1)
        goto done;
    void *ptr = PyLong_AsVoidPtr(PyTuple_GET_ITEM(data, 0));
    NpArray *a = (NpArray *)arr;
    /* no pointer read is followed unless the fields before it matched */
    ok = (void *)a->data == ptr && a->nd == 2 && a->descr == dt && a->base == NULL &&
         a->dimensions[0] == 3 && a->dimensions[1] == 5 && a->strides[0] == 20 &&
         a->strides[1] == 4 && (a->flags & NP_C_CONTIGUOUS);
    if (ok) { /* the flags word too: its transpose is not C-contiguous */
        PyObject *t = PyObject_GetAttrString(arr, "T");
        ok = t != NULL && Py_TYPE(t) == ndarray_t && !(((NpArray *)t)->flags & NP_C_CONTIGUOUS);
        Py_XDECREF(t);
    }
done:
    PyErr_Clear();
    Py_XDECREF(arr), Py_XDECREF(dt), Py_XDECREF(iface);
    return ok;
}

static PyObject *
core_configure_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyType_Check(args[0]) || !PyType_Check(args[1]) ||
        !PyDict_CheckExact(args[2]) || !PyMemoryView_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError,
                        "configure_plan(serde type, plan type, dtype cache: dict, zeros: memoryview)");
        return NULL;
    }
    plan_on = 0;
    if (s_plan_name == NULL && (s_plan_name = PyUnicode_InternFromString("plan")) == NULL)
        return NULL;
    if (s_max_object_bytes == NULL &&
        (s_max_object_bytes = PyUnicode_InternFromString("max_object_bytes")) == NULL)
        return NULL;
    PyTypeObject *st = (PyTypeObject *)args[0], *pt = (PyTypeObject *)args[1];
    Py_ssize_t o[8] = {
        member_offset(pt, "nbytes"), member_offset(pt, "_layout"), member_offset(pt, "_sources"),
        member_offset(st, "max_depth"), member_offset(st, "max_ndim"),
        member_offset(st, "max_arrays"), member_offset(st, "max_containers"),
        member_offset(st, "max_header_bytes"),
    };
    if (PyErr_Occurred())
        return NULL;
    PyObject *numpy = PyImport_ImportModule("numpy");
    if (numpy == NULL)
        return NULL;
    PyObject *nd = PyObject_GetAttrString(numpy, "ndarray");
    if (nd == NULL) {
        Py_DECREF(numpy);
        return NULL;
    }
    Py_XSETREF(ndarray_t, (PyTypeObject *)nd);
    int layout_ok = array_layout_ok(numpy);
    Py_DECREF(numpy);
    Py_XSETREF(serde_t, (PyTypeObject *)Py_NewRef(st));
    Py_XSETREF(plan_t, (PyTypeObject *)Py_NewRef(pt));
    Py_XSETREF(enc_dtypes, Py_NewRef(args[2]));
    Py_XSETREF(zeros, Py_NewRef(args[3]));
    Py_XSETREF(serde_plan_func, Py_XNewRef(_PyType_Lookup(st, s_plan_name)));
    for (int i = 0; i < descr_n; i++) {
        Py_CLEAR(descr_cache[i].descr);
        Py_CLEAR(descr_cache[i].enc);
    }
    descr_n = 0;
    for (int i = 0; i < LAYOUT_CACHE; i++)
        Py_CLEAR(layout_cache[i]);
    off_nbytes = o[0], off_layout = o[1], off_sources = o[2];
    off_depth = o[3], off_ndim = o[4], off_arrays = o[5], off_containers = o[6], off_header = o[7];
    int offsets_ok = 1;
    for (int i = 0; i < 8; i++)
        offsets_ok &= o[i] > 0;
    plan_on = offsets_ok && layout_ok && serde_plan_func != NULL &&
              PyMemoryView_GET_BUFFER(zeros)->len >= PAYLOAD_ALIGN;
    return PyBool_FromLong(plan_on);
}

static PyObject *
core_plan_item(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "plan_item takes 2 arguments (serde, value)");
        return NULL;
    }
    PyObject *plan = plan_of(args[0], args[1]);
    if (plan == NULL)
        Py_RETURN_NONE;
    return plan;
}

PyMethodDef aioshm_plan_methods[] = {
    {"configure_plan", (PyCFunction)(void (*)(void))core_configure_plan, METH_FASTCALL,
     "configure_plan(serde type, plan type, dtype cache, zeros) -> bool: whether plan_item runs"},
    {"plan_item", (PyCFunction)(void (*)(void))core_plan_item, METH_FASTCALL,
     "plan_item(serde, value) -> MsgpackPlan, or None (declined: MsgpackSerde.plan decides)"},
    {NULL, NULL, 0, NULL},
};
