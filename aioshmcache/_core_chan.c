/* aioshmcache._core, the channel section: the per-call steps of ``aioshmcache.channel``.
 *
 * The reference is ``aioshmcache/_channel_core_py.py`` (same names, same results); the
 * channel's modules call these first and take their general Python path whenever one
 * declines (returns ``None``, nothing done), so that path raises every typed error:
 *
 *   chan_cut(data, max_bytes)          ``wire.FrameDecoder._cut``: the whole frames at the
 *                                      start of ``data`` and where the rest begins; declines
 *                                      on a declared length over ``max_bytes``;
 *   chan_frame(data, max_bytes)        the gateway's usual read: received bytes that are
 *                                      exactly one whole frame, its payload (as ``chan_cut``
 *                                      would cut it, with no list);
 *   chan_unpack(data)                  ``wire.unpack_bounded(data, maps=True)`` of a message
 *                                      that is a msgpack array (an envelope);
 *   chan_call4(head)                   ``_channel_format.decode_call``'s version-4 branch:
 *                                      ``(payload, features)``;
 *   chan_take_call(data, max_bytes)    both at once for the worker's usual read: received
 *                                      bytes that are exactly a version-4 call's two frames
 *                                      (cut, then decoded as ``chan_call4``);
 *   chan_ok_frame(result, max_bytes)   the worker's plain ``ok`` answer as its frame
 *                                      (``_channel_format.encode`` and the frame);
 *   chan_ok_result(answer)             the gateway's read of that answer: ``(result,)``
 *                                      (``_channel_format.decode`` and the ``ok`` check);
 *   chan_call4_frames(payload, features, max_bytes)
 *                                      ``_channel_format._one_message`` and its two frames
 *                                      as one buffer (the call frame's prefix, the call, the
 *                                      empty frame's prefix).
 *
 * The decoder takes exactly what the bounded unpack accepts and builds the same objects:
 * the input is one complete object (every announced element is there, no trailing byte),
 * no extension type, map keys str or bytes, strict UTF-8, at most 32,768 containers. It
 * declines anything else, and also what it does not need to handle (nesting deeper than 64,
 * a type byte msgpack never writes): every byte is read through a bounds check, so a
 * truncated, forged or hostile input costs at most one pass over its bytes. The encoder
 * writes what ``msgpack.Packer(strict_types=True)`` writes for exact ``None``, ``bool``,
 * ``int``, ``float``, ``str``, ``bytes``, ``list`` and ``dict`` (the smallest integer and
 * length forms, doubles, ``bin`` for bytes) and declines any other type.
 */
#include "_core.h"
#include <string.h>

#define CHAN_TAG "aioshmcache.channel"
#define CHAN_TAG_LEN 19
#define MAX_CONTAINERS 32768
#define MAX_DEPTH 64
#define MAX_FEATURES 4096
#define REF_FIELDS 8
#define REF_BYTES 64

static PyTypeObject *spec_type; /* ``FeatureSpec``; NULL: the call steps decline */
static PyTypeObject *ref_type;  /* ``ShmRef`` */
static PyObject *empty_tuple;
static Py_ssize_t o_hash, o_data, o_ident, o_updates;

#define SPEC_SLOT(obj, off) (*(PyObject **)((char *)(obj) + (off)))

/* ``configure_chan(FeatureSpec, ShmRef)``: the classes the call steps build and read. */
static PyObject *
chan_configure(PyObject *self, PyObject *args)
{
    PyObject *st, *rt;
    if (!PyArg_ParseTuple(args, "O!O!:configure_chan", &PyType_Type, &st, &PyType_Type, &rt))
        return NULL;
    PyTypeObject *t = (PyTypeObject *)st;
    Py_ssize_t h = aioshm_member_offset(t, "mm_hash"), d = aioshm_member_offset(t, "data");
    Py_ssize_t i = aioshm_member_offset(t, "identifier");
    Py_ssize_t u = aioshm_member_offset(t, "prompt_updates");
    if (PyErr_Occurred())
        return NULL;
    Py_CLEAR(spec_type);
    Py_CLEAR(ref_type);
    if (h < 0 || d < 0 || i < 0 || u < 0 || t->tp_alloc == NULL ||
        !PyType_IsSubtype((PyTypeObject *)rt, &PyTuple_Type))
        Py_RETURN_NONE; /* not the classes this file knows: off */
    if (empty_tuple == NULL && (empty_tuple = PyTuple_New(0)) == NULL)
        return NULL;
    o_hash = h, o_data = d, o_ident = i, o_updates = u;
    spec_type = (PyTypeObject *)Py_NewRef(st);
    ref_type = (PyTypeObject *)Py_NewRef(rt);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------ */
/* The bounded decoder. Every function returns a new reference, or NULL: declined (no error
 * set) or a memory error (set). Any other Python error (bad UTF-8) is cleared: declined. */

typedef struct {
    const unsigned char *p, *end;
    Py_ssize_t containers;
} Reader;

static inline int
need(Reader *r, Py_ssize_t n)
{
    return n >= 0 && r->end - r->p >= n;
}

static inline uint64_t
be(const unsigned char *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = (v << 8) | p[i];
    return v;
}

/* NULL: declined, the error (if any) cleared unless it is a memory error */
static PyObject *
declined(void)
{
    if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_MemoryError))
        PyErr_Clear();
    return NULL;
}

static PyObject *read_obj(Reader *r, int depth);

/* the length that follows a type byte (``n`` big-endian bytes), or -1: not there */
static Py_ssize_t
read_len(Reader *r, int n)
{
    if (!need(r, n))
        return -1;
    Py_ssize_t v = (Py_ssize_t)be(r->p, n);
    r->p += n;
    return v;
}

static PyObject *
read_str(Reader *r, Py_ssize_t n)
{
    if (n < 0 || !need(r, n))
        return NULL;
    PyObject *s = PyUnicode_DecodeUTF8((const char *)r->p, n, NULL);
    if (s == NULL)
        return declined();
    r->p += n;
    return s;
}

static PyObject *
read_bin(Reader *r, Py_ssize_t n)
{
    if (n < 0 || !need(r, n))
        return NULL;
    PyObject *b = PyBytes_FromStringAndSize((const char *)r->p, n);
    r->p += n;
    return b;
}

static PyObject *
read_array(Reader *r, Py_ssize_t n, int depth)
{
    /* every element takes a byte at least: more than the bytes left is incomplete */
    if (n < 0 || !need(r, n) || depth >= MAX_DEPTH || ++r->containers > MAX_CONTAINERS)
        return NULL;
    PyObject *list = PyList_New(n);
    if (list == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = read_obj(r, depth + 1);
        if (v == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, v);
    }
    return list;
}

static PyObject *
read_map(Reader *r, Py_ssize_t n, int depth)
{
    if (n < 0 || n > (r->end - r->p) / 2 || depth >= MAX_DEPTH ||
        ++r->containers > MAX_CONTAINERS)
        return NULL;
    PyObject *d = PyDict_New();
    if (d == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = read_obj(r, depth + 1);
        if (k == NULL)
            goto fail;
        if (!PyUnicode_CheckExact(k) && !PyBytes_CheckExact(k)) { /* strict map keys */
            Py_DECREF(k);
            goto fail;
        }
        PyObject *v = read_obj(r, depth + 1);
        if (v == NULL) {
            Py_DECREF(k);
            goto fail;
        }
        int rc = PyDict_SetItem(d, k, v);
        Py_DECREF(k), Py_DECREF(v);
        if (rc < 0)
            goto fail;
    }
    return d;
fail:
    Py_DECREF(d);
    return declined();
}

static PyObject *
read_obj(Reader *r, int depth)
{
    if (!need(r, 1))
        return NULL;
    unsigned b = *r->p++;
    if (b <= 0x7f)
        return PyLong_FromLong((long)b);
    if (b >= 0xe0)
        return PyLong_FromLong((long)(int8_t)b);
    if (b <= 0x8f)
        return read_map(r, b & 0x0f, depth);
    if (b <= 0x9f)
        return read_array(r, b & 0x0f, depth);
    if (b <= 0xbf)
        return read_str(r, b & 0x1f);
    switch (b) {
    case 0xc0:
        Py_RETURN_NONE;
    case 0xc2:
        Py_RETURN_FALSE;
    case 0xc3:
        Py_RETURN_TRUE;
    case 0xc4:
        return read_bin(r, read_len(r, 1));
    case 0xc5:
        return read_bin(r, read_len(r, 2));
    case 0xc6:
        return read_bin(r, read_len(r, 4));
    case 0xca: {
        if (!need(r, 4))
            return NULL;
        uint32_t w = (uint32_t)be(r->p, 4);
        float f;
        memcpy(&f, &w, 4);
        r->p += 4;
        return PyFloat_FromDouble((double)f);
    }
    case 0xcb: {
        if (!need(r, 8))
            return NULL;
        uint64_t w = be(r->p, 8);
        double f;
        memcpy(&f, &w, 8);
        r->p += 8;
        return PyFloat_FromDouble(f);
    }
    case 0xcc:
    case 0xcd:
    case 0xce:
    case 0xcf: {
        int n = 1 << (b - 0xcc);
        if (!need(r, n))
            return NULL;
        uint64_t v = be(r->p, n);
        r->p += n;
        return PyLong_FromUnsignedLongLong(v);
    }
    case 0xd0:
    case 0xd1:
    case 0xd2:
    case 0xd3: {
        int n = 1 << (b - 0xd0);
        if (!need(r, n))
            return NULL;
        uint64_t v = be(r->p, n);
        r->p += n;
        int64_t s = n == 1   ? (int64_t)(int8_t)v
                    : n == 2 ? (int64_t)(int16_t)v
                    : n == 4 ? (int64_t)(int32_t)v
                             : (int64_t)v;
        return PyLong_FromLongLong(s);
    }
    case 0xd9:
        return read_str(r, read_len(r, 1));
    case 0xda:
        return read_str(r, read_len(r, 2));
    case 0xdb:
        return read_str(r, read_len(r, 4));
    case 0xdc:
        return read_array(r, read_len(r, 2), depth);
    case 0xdd:
        return read_array(r, read_len(r, 4), depth);
    case 0xde:
        return read_map(r, read_len(r, 2), depth);
    case 0xdf:
        return read_map(r, read_len(r, 4), depth);
    default: /* 0xc1, extension types */
        return NULL;
    }
}

static int
get_bytes(PyObject *obj, const unsigned char **p, Py_ssize_t *n)
{
    if (!PyBytes_CheckExact(obj))
        return 0;
    *p = (const unsigned char *)PyBytes_AS_STRING(obj);
    *n = PyBytes_GET_SIZE(obj);
    return 1;
}

/* ``chan_unpack(data)``: the envelope (a list), or None (declined) */
static PyObject *
chan_unpack(PyObject *self, PyObject *data)
{
    const unsigned char *p;
    Py_ssize_t n;
    if (!get_bytes(data, &p, &n) || n < 1 || !((p[0] >= 0x90 && p[0] <= 0x9f) || p[0] == 0xdc ||
                                               p[0] == 0xdd))
        Py_RETURN_NONE;
    Reader r = {p, p + n, 0};
    PyObject *v = read_obj(&r, 0);
    if (v != NULL && r.p != r.end)
        Py_CLEAR(v);
    if (v == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    return v;
}

static inline uint64_t
le64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

/* ``ShmRef`` of the 64 bytes at ``p``: eight little-endian u64 */
static PyObject *
new_ref(const unsigned char *p)
{
    PyObject *ref = ref_type->tp_alloc(ref_type, REF_FIELDS);
    if (ref == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < REF_FIELDS; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(le64(p + 8 * i));
        if (v == NULL) {
            Py_DECREF(ref);
            return NULL;
        }
        PyTuple_SET_ITEM(ref, i, v);
    }
    return ref;
}

/* one row ``[mm_hash, identifier, reference]`` as a ``FeatureSpec``, or NULL (declined or an
 * error) */
static PyObject *
read_row(Reader *r)
{
    if (!need(r, 1) || *r->p != 0x93)
        return NULL;
    r->p++;
    if (++r->containers > MAX_CONTAINERS)
        return NULL;
    PyObject *h = read_obj(r, MAX_DEPTH), *ident = NULL, *data = NULL;
    if (h == NULL || !PyUnicode_CheckExact(h))
        goto fail;
    if (!need(r, 1))
        goto fail;
    if (*r->p == 0xc0) {
        r->p++;
        ident = Py_NewRef(Py_None);
    }
    else if ((ident = read_obj(r, MAX_DEPTH)) == NULL || !PyUnicode_CheckExact(ident))
        goto fail;
    if (!need(r, 1))
        goto fail;
    if (*r->p == 0xc0) {
        r->p++;
        data = Py_NewRef(Py_None);
    }
    else {
        if (!need(r, 2 + REF_BYTES) || r->p[0] != 0xc4 || r->p[1] != REF_BYTES)
            goto fail;
        if ((data = new_ref(r->p + 2)) == NULL)
            goto fail;
        r->p += 2 + REF_BYTES;
    }
    PyObject *spec = spec_type->tp_alloc(spec_type, 0);
    if (spec == NULL)
        goto fail;
    SPEC_SLOT(spec, o_hash) = h;
    SPEC_SLOT(spec, o_data) = data;
    SPEC_SLOT(spec, o_ident) = ident;
    SPEC_SLOT(spec, o_updates) = Py_NewRef(empty_tuple);
    return spec;
fail:
    Py_XDECREF(h), Py_XDECREF(ident), Py_XDECREF(data);
    return NULL;
}

/* the version-4 call in ``p[:n]`` as ``(payload, features)``; NULL: declined (no error set) or
 * a memory error */
static PyObject *
decode_call4(const unsigned char *p, Py_ssize_t n)
{
    static const unsigned char start[] = "\x95\xb3" CHAN_TAG "\x04\xa4"
                                         "call";
    if (spec_type == NULL || n < (Py_ssize_t)sizeof start - 1 ||
        memcmp(p, start, sizeof start - 1) != 0)
        return NULL;
    Reader r = {p + sizeof start - 1, p + n, 1};
    PyObject *payload = read_obj(&r, 1), *features = NULL;
    if (payload == NULL || !need(&r, 1))
        goto out;
    unsigned b = *r.p++;
    Py_ssize_t rows = b >= 0x90 && b <= 0x9f ? (Py_ssize_t)(b & 0x0f)
                      : b == 0xdc            ? read_len(&r, 2)
                      : b == 0xdd            ? read_len(&r, 4)
                                             : -1;
    /* a row takes four bytes at least */
    if (rows < 0 || rows > MAX_FEATURES || rows > (r.end - r.p) / 4 ||
        ++r.containers > MAX_CONTAINERS)
        goto out;
    if ((features = PyList_New(rows)) == NULL)
        goto out;
    for (Py_ssize_t i = 0; i < rows; i++) {
        PyObject *spec = read_row(&r);
        if (spec == NULL) {
            Py_CLEAR(features);
            goto out;
        }
        PyList_SET_ITEM(features, i, spec);
    }
    if (r.p != r.end)
        Py_CLEAR(features);
out:
    if (features == NULL) {
        Py_XDECREF(payload);
        return declined();
    }
    PyObject *call = PyTuple_Pack(2, payload, features);
    Py_DECREF(payload), Py_DECREF(features);
    return call;
}

/* a decoded call, or None when declined (NULL: an error) */
static PyObject *
call_or_none(PyObject *call)
{
    if (call != NULL || PyErr_Occurred())
        return call;
    Py_RETURN_NONE;
}

/* ``chan_call4(head)``: ``(payload, features)`` of a version-4 call, or None (declined) */
static PyObject *
chan_call4(PyObject *self, PyObject *head)
{
    const unsigned char *p;
    Py_ssize_t n;
    if (!get_bytes(head, &p, &n))
        Py_RETURN_NONE;
    return call_or_none(decode_call4(p, n));
}


/* the ``(data, max_bytes)`` arguments of the cuts: ``max_bytes`` read, or -1 (an error set) */
static int
cut_args(const char *name, PyObject *const *args, Py_ssize_t nargs, unsigned long long *max_bytes)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s takes 2 arguments (data, max_bytes)", name);
        return -1;
    }
    *max_bytes = PyLong_AsUnsignedLongLong(args[1]);
    return *max_bytes == (unsigned long long)-1 && PyErr_Occurred() ? -1 : 0;
}

/* ``data`` (bytes) that is exactly one frame within ``max_bytes`` and ``rest`` bytes after it:
 * 1 and the frame's payload (``*len`` bytes at ``*payload``); 0 if not (declined); -1 (an error
 * set) for bad arguments */
static int
lead_frame(const char *name, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t rest,
           const unsigned char **payload, Py_ssize_t *len)
{
    unsigned long long max_bytes;
    if (cut_args(name, args, nargs, &max_bytes) < 0)
        return -1;
    const unsigned char *p;
    Py_ssize_t n;
    if (!get_bytes(args[0], &p, &n) || n < 8 + rest)
        return 0;
    uint64_t head = le64(p);
    if (head > max_bytes || head != (uint64_t)(n - 8 - rest))
        return 0;
    *payload = p + 8, *len = (Py_ssize_t)head;
    return 1;
}

/* ``chan_take_call(data, max_bytes)``: ``(payload, features)`` when ``data`` is exactly the two
 * frames of a version-4 call (its frame within ``max_bytes``, then the empty one), or None
 * (declined: the frames are cut and decoded one by one) */
static PyObject *
chan_take_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const unsigned char *head;
    Py_ssize_t n;
    int rc = lead_frame("chan_take_call", args, nargs, 8, &head, &n);
    if (rc < 0)
        return NULL;
    if (rc == 0 || le64(head + n) != 0) /* then the empty frame */
        Py_RETURN_NONE;
    return call_or_none(decode_call4(head, n));
}

/* ------------------------------------------------------------------------------------------ */
/* The encoder: ``msgpack.Packer(strict_types=True)``'s bytes for the exact plain types. */

typedef struct {
    char *buf;
    Py_ssize_t len, cap;
} Writer;

static int
grow(Writer *w, Py_ssize_t n)
{
    if (w->len + n <= w->cap)
        return 0;
    Py_ssize_t cap = w->cap * 2;
    while (cap < w->len + n)
        cap *= 2;
    char *b = PyMem_Realloc(w->buf, (size_t)cap);
    if (b == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    w->buf = b, w->cap = cap;
    return 0;
}

static int
put(Writer *w, const void *src, Py_ssize_t n)
{
    if (grow(w, n) < 0)
        return -1;
    memcpy(w->buf + w->len, src, (size_t)n);
    w->len += n;
    return 0;
}

/* type byte ``b`` then ``v`` big-endian in ``n`` bytes */
static int
put_be(Writer *w, unsigned b, uint64_t v, int n)
{
    unsigned char tmp[9];
    tmp[0] = (unsigned char)b;
    for (int i = 0; i < n; i++)
        tmp[1 + i] = (unsigned char)(v >> (8 * (n - 1 - i)));
    return put(w, tmp, 1 + n);
}

/* a length header: the fix form below ``fix_max`` (``fix | n``), else the 8/16/32-bit one
 * (``b8`` 0: no 8-bit form) */
static int
put_len(Writer *w, Py_ssize_t n, unsigned fix, Py_ssize_t fix_max, unsigned b8, unsigned b16,
        unsigned b32)
{
    if (n < fix_max) {
        unsigned char c = (unsigned char)(fix | (unsigned)n);
        return put(w, &c, 1);
    }
    if (b8 && n < 256)
        return put_be(w, b8, (uint64_t)n, 1);
    if (n < 65536)
        return put_be(w, b16, (uint64_t)n, 2);
    if ((uint64_t)n <= UINT32_MAX)
        return put_be(w, b32, (uint64_t)n, 4);
    return 1;
}

/* 0: written; 1: declined (not a type or value written here); -1: an error (set) */
static int
write_obj(Writer *w, PyObject *o, int depth)
{
    if (o == Py_None) {
        unsigned char c = 0xc0;
        return put(w, &c, 1);
    }
    if (o == Py_True || o == Py_False) {
        unsigned char c = o == Py_True ? 0xc3 : 0xc2;
        return put(w, &c, 1);
    }
    if (PyLong_CheckExact(o)) {
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow > 0) {
            unsigned long long u = PyLong_AsUnsignedLongLong(o);
            if (u == (unsigned long long)-1 && PyErr_Occurred()) {
                PyErr_Clear();
                return 1; /* over 2**64 - 1: msgpack's OverflowError */
            }
            return put_be(w, 0xcf, u, 8);
        }
        if (overflow < 0)
            return 1;
        if (v == -1 && PyErr_Occurred())
            return -1;
        if (v >= 0) {
            if (v < 128) {
                unsigned char c = (unsigned char)v;
                return put(w, &c, 1);
            }
            if (v < 256)
                return put_be(w, 0xcc, (uint64_t)v, 1);
            if (v < 65536)
                return put_be(w, 0xcd, (uint64_t)v, 2);
            if (v <= (long long)UINT32_MAX)
                return put_be(w, 0xce, (uint64_t)v, 4);
            return put_be(w, 0xcf, (uint64_t)v, 8);
        }
        if (v >= -32) {
            unsigned char c = (unsigned char)(int8_t)v;
            return put(w, &c, 1);
        }
        if (v >= -128)
            return put_be(w, 0xd0, (uint64_t)v & 0xff, 1);
        if (v >= -32768)
            return put_be(w, 0xd1, (uint64_t)v & 0xffff, 2);
        if (v >= INT32_MIN)
            return put_be(w, 0xd2, (uint64_t)v & 0xffffffffu, 4);
        return put_be(w, 0xd3, (uint64_t)v, 8);
    }
    if (PyFloat_CheckExact(o)) {
        double d = PyFloat_AS_DOUBLE(o);
        uint64_t bits;
        memcpy(&bits, &d, 8);
        return put_be(w, 0xcb, bits, 8);
    }
    if (PyUnicode_CheckExact(o)) {
        Py_ssize_t n;
        const char *s = PyUnicode_AsUTF8AndSize(o, &n);
        if (s == NULL) { /* a lone surrogate: msgpack's UnicodeEncodeError */
            if (PyErr_ExceptionMatches(PyExc_MemoryError))
                return -1;
            PyErr_Clear();
            return 1;
        }
        int rc = put_len(w, n, 0xa0, 32, 0xd9, 0xda, 0xdb);
        return rc != 0 ? rc : put(w, s, n);
    }
    if (PyBytes_CheckExact(o)) {
        Py_ssize_t n = PyBytes_GET_SIZE(o);
        int rc = put_len(w, n, 0, 0, 0xc4, 0xc5, 0xc6);
        return rc != 0 ? rc : put(w, PyBytes_AS_STRING(o), n);
    }
    if (depth >= MAX_DEPTH)
        return 1;
    if (PyList_CheckExact(o)) {
        Py_ssize_t n = PyList_GET_SIZE(o);
        int rc = put_len(w, n, 0x90, 16, 0, 0xdc, 0xdd);
        for (Py_ssize_t i = 0; rc == 0 && i < PyList_GET_SIZE(o); i++)
            rc = write_obj(w, PyList_GET_ITEM(o, i), depth + 1);
        if (rc == 0 && PyList_GET_SIZE(o) != n)
            return 1; /* changed while written (it cannot here: nothing runs Python code) */
        return rc;
    }
    if (PyDict_CheckExact(o)) {
        Py_ssize_t n = PyDict_GET_SIZE(o), pos = 0;
        PyObject *k, *v;
        int rc = put_len(w, n, 0x80, 16, 0, 0xde, 0xdf);
        while (rc == 0 && PyDict_Next(o, &pos, &k, &v)) {
            if (!PyUnicode_CheckExact(k) && !PyBytes_CheckExact(k))
                return 1; /* a key neither form of an envelope carries: the encode's error */
            rc = write_obj(w, k, depth + 1);
            if (rc == 0)
                rc = write_obj(w, v, depth + 1);
        }
        return rc;
    }
    return 1; /* a tuple, a subclass, an array, anything else: the Packer's own path */
}

static inline void
put_le64(char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (char)(v >> (8 * i));
}

/* a reference's eight fields as 64 bytes (0), or 1: not exactly eight ints in [0, 2**64) */
static int
write_ref(Writer *w, PyObject *ref)
{
    if (Py_TYPE(ref) != ref_type || PyTuple_GET_SIZE(ref) != REF_FIELDS)
        return 1;
    if (grow(w, 2 + REF_BYTES) < 0)
        return -1;
    char *p = w->buf + w->len;
    p[0] = (char)0xc4, p[1] = REF_BYTES;
    for (Py_ssize_t i = 0; i < REF_FIELDS; i++) {
        PyObject *v = PyTuple_GET_ITEM(ref, i);
        if (!PyLong_CheckExact(v))
            return 1;
        unsigned long long u = PyLong_AsUnsignedLongLong(v);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) {
            if (PyErr_ExceptionMatches(PyExc_MemoryError))
                return -1;
            PyErr_Clear(); /* negative or too big: the general form says why */
            return 1;
        }
        put_le64(p + 2 + 8 * i, u);
    }
    w->len += 2 + REF_BYTES;
    return 0;
}

static int
write_row(Writer *w, PyObject *f)
{
    if (Py_TYPE(f) != spec_type)
        return 1;
    PyObject *h = SPEC_SLOT(f, o_hash), *data = SPEC_SLOT(f, o_data);
    PyObject *ident = SPEC_SLOT(f, o_ident), *updates = SPEC_SLOT(f, o_updates);
    if (h == NULL || data == NULL || ident == NULL || updates == NULL ||
        !PyUnicode_CheckExact(h) || !PyTuple_CheckExact(updates) ||
        PyTuple_GET_SIZE(updates) != 0 || !(ident == Py_None || PyUnicode_CheckExact(ident)))
        return 1;
    unsigned char c = 0x93;
    int rc = put(w, &c, 1);
    if (rc == 0)
        rc = write_obj(w, h, 0);
    if (rc == 0)
        rc = write_obj(w, ident, 0);
    if (rc != 0)
        return rc;
    if (data == Py_None)
        return write_obj(w, data, 0);
    return write_ref(w, data);
}

/* A frame being written: its 8-byte prefix left for ``frame_end``, then ``start``. 0, or -1 (an
 * error set). */
static int
frame_start(Writer *w, const char *start, Py_ssize_t n)
{
    w->len = 0, w->cap = 256;
    if ((w->buf = PyMem_Malloc(256)) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    w->len = 8;
    return put(w, start, n);
}

/* The frame written (``rc`` 0) as bytes, its prefix set, followed by an empty frame if
 * ``empty_after``; None if declined (``rc`` 1, or a frame over ``max_bytes``); NULL on an error
 * (``rc`` -1). Frees the buffer. */
static PyObject *
frame_end(Writer *w, int rc, unsigned long long max_bytes, int empty_after)
{
    static const char none[8] = {0};
    PyObject *out = NULL;
    if (rc == 0 && (unsigned long long)(w->len - 8) <= max_bytes) {
        put_le64(w->buf, (uint64_t)(w->len - 8));
        if (!empty_after || put(w, none, 8) == 0)
            out = PyBytes_FromStringAndSize(w->buf, w->len);
    }
    else if (rc >= 0) {
        out = Py_NewRef(Py_None);
    }
    PyMem_Free(w->buf);
    return out;
}

/* ``chan_call4_frames(payload, features, max_bytes)``: the version-4 call's two frames as one
 * buffer, or None (declined: the call is not version 4, or its frame exceeds ``max_bytes``) */
static PyObject *
chan_call4_frames(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char start[] = "\x95\xb3" CHAN_TAG "\x04\xa4"
                                "call";
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "chan_call4_frames takes 3 arguments");
        return NULL;
    }
    PyObject *payload = args[0], *features = args[1];
    unsigned long long max_bytes = PyLong_AsUnsignedLongLong(args[2]);
    if (max_bytes == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (spec_type == NULL || !(PyList_CheckExact(features) || PyTuple_CheckExact(features)))
        Py_RETURN_NONE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(features);
    if (n > MAX_FEATURES)
        Py_RETURN_NONE;
    Writer w;
    int rc = frame_start(&w, start, sizeof start - 1);
    if (w.buf == NULL)
        return NULL;
    if (rc == 0)
        rc = write_obj(&w, payload, 1);
    if (rc == 0)
        rc = put_len(&w, n, 0x90, 16, 0, 0xdc, 0xdd);
    PyObject **items = PySequence_Fast_ITEMS(features);
    for (Py_ssize_t i = 0; rc == 0 && i < n; i++)
        rc = write_row(&w, items[i]);
    return frame_end(&w, rc, max_bytes, 1);
}

/* ``chan_ok_frame(result, max_bytes)``: the frame of the plain answer
 * ``["aioshmcache.channel", 1, "ok", result]``, or None (declined: a result the encoder does not
 * write, or a frame over ``max_bytes``) */
static PyObject *
chan_ok_frame(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char start[] = "\x94\xb3" CHAN_TAG "\x01\xa2"
                                "ok";
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "chan_ok_frame takes 2 arguments (result, max_bytes)");
        return NULL;
    }
    unsigned long long max_bytes = PyLong_AsUnsignedLongLong(args[1]);
    if (max_bytes == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    Writer w;
    int rc = frame_start(&w, start, sizeof start - 1);
    if (w.buf == NULL)
        return NULL;
    if (rc == 0)
        rc = write_obj(&w, args[0], 1);
    return frame_end(&w, rc, max_bytes, 0);
}

/* ``chan_ok_result(answer)``: ``(result,)`` of a plain answer
 * ``["aioshmcache.channel", 1, "ok", result]``, or None (declined: any other answer) */
static PyObject *
chan_ok_result(PyObject *self, PyObject *answer)
{
    static const unsigned char start[] = "\x94\xb3" CHAN_TAG "\x01\xa2"
                                         "ok";
    const unsigned char *p;
    Py_ssize_t n;
    if (!get_bytes(answer, &p, &n) || n < (Py_ssize_t)sizeof start - 1 ||
        memcmp(p, start, sizeof start - 1) != 0)
        Py_RETURN_NONE;
    Reader r = {p + sizeof start - 1, p + n, 1};
    PyObject *result = read_obj(&r, 1);
    if (result != NULL && r.p != r.end)
        Py_CLEAR(result);
    if (result == NULL) {
        if (declined() == NULL && PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    PyObject *out = PyTuple_Pack(1, result);
    Py_DECREF(result);
    return out;
}

/* ------------------------------------------------------------------------------------------ */

/* ``chan_cut(data, max_bytes)``: ``(frames, pos)``, or None (declined: a declared length over
 * ``max_bytes``) */
static PyObject *
chan_cut(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long long max_bytes;
    if (cut_args("chan_cut", args, nargs, &max_bytes) < 0)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *p = view.buf;
    Py_ssize_t size = view.len, pos = 0;
    PyObject *frames = PyList_New(0), *out = NULL;
    if (frames == NULL)
        goto done;
    while (size - pos >= 8) {
        uint64_t n = le64(p + pos);
        if (n > max_bytes) {
            out = Py_NewRef(Py_None);
            goto done;
        }
        if (n > (uint64_t)(size - pos - 8))
            break;
        PyObject *frame = PyBytes_FromStringAndSize((const char *)p + pos + 8, (Py_ssize_t)n);
        if (frame == NULL || PyList_Append(frames, frame) < 0) {
            Py_XDECREF(frame);
            goto done;
        }
        Py_DECREF(frame);
        pos += 8 + (Py_ssize_t)n;
    }
    out = Py_BuildValue("(On)", frames, pos);
done:
    Py_XDECREF(frames);
    PyBuffer_Release(&view);
    return out;
}

/* ``chan_frame(data, max_bytes)``: the payload when ``data`` (bytes) is exactly one whole frame
 * within ``max_bytes``, or None (declined: anything else is cut by the decoder) */
static PyObject *
chan_frame(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const unsigned char *payload;
    Py_ssize_t n;
    switch (lead_frame("chan_frame", args, nargs, 0, &payload, &n)) {
    case 1:
        return PyBytes_FromStringAndSize((const char *)payload, n);
    case 0:
        Py_RETURN_NONE;
    default:
        return NULL;
    }
}

PyMethodDef aioshm_chan_methods[] = {
    {"configure_chan", chan_configure, METH_VARARGS,
     "configure_chan(FeatureSpec, ShmRef): the classes the channel's call steps know"},
    {"chan_cut", (PyCFunction)(void (*)(void))chan_cut, METH_FASTCALL,
     "chan_cut(data, max_bytes) -> (frames, pos), or None (declined)"},
    {"chan_frame", (PyCFunction)(void (*)(void))chan_frame, METH_FASTCALL,
     "chan_frame(data, max_bytes) -> the payload of data that is one whole frame, or None"},
    {"chan_unpack", chan_unpack, METH_O,
     "chan_unpack(data) -> a plain envelope under the bounded unpack's rules, or None"},
    {"chan_take_call", (PyCFunction)(void (*)(void))chan_take_call, METH_FASTCALL,
     "chan_take_call(data, max_bytes) -> (payload, features) of a version-4 call's two "
     "frames, or None (declined)"},
    {"chan_call4", chan_call4, METH_O,
     "chan_call4(head) -> (payload, features) of a version-4 call, or None (declined)"},
    {"chan_call4_frames", (PyCFunction)(void (*)(void))chan_call4_frames, METH_FASTCALL,
     "chan_call4_frames(payload, features, max_bytes) -> the version-4 call's frames, or None"},
    {"chan_ok_frame", (PyCFunction)(void (*)(void))chan_ok_frame, METH_FASTCALL,
     "chan_ok_frame(result, max_bytes) -> the plain ok answer's frame, or None (declined)"},
    {"chan_ok_result", chan_ok_result, METH_O,
     "chan_ok_result(answer) -> (result,) of a plain ok answer, or None (declined)"},
    {NULL, NULL, 0, NULL},
};
