/* aioshmcache._core, the read section: a reader's read of one plain item, in one call.
 *
 * The Python reference is ``aioshmcache/_core_read_py.py`` (same names, same results, same
 * errors); ``ReadPath.read_item`` calls one or the other. ``read_item(ctx, ref)`` does what
 * ``ReadPath.get`` does for the usual case, in the same order:
 *
 *   1. the reference: an exact ``ShmRef`` of eight ints in [0, 2**64), this segment's nonce,
 *      the current epoch, the tag (``_types.reference_tag``), the writer live, this reader's
 *      session not revoked and no acknowledgement waiting for log room;
 *   2. the chunk: address 64-aligned and inside the ring with its payload, the header's id,
 *      length, check word and state COMMITTED, the position matching the address and not
 *      behind the reuse fence (``H_HEAD_POS``);
 *   3. the payload (``_serde_encode``'s layout): the prefix, then a structure header that is
 *      one msgpack map of str keys to ARRAY records without flags (non-empty, a dtype of
 *      ``DTYPES``) or simple scalars (nil, bool, int, float, str), in the canonical layout;
 *   4. each array copied into a new ``np.empty`` (memcpy; the GIL released for big copies);
 *      from OWN_PAGES bytes into pages of its own instead, mapped and populated in one system
 *      call without the GIL (huge pages from HUGE_PAGES), kept for reuse when the array is
 *      freed (``spare``): a fresh heap block would cost one page fault per 4 KiB page during
 *      the copy;
 *   5. the chunk re-checked (id, state, reuse fence): reclaimed during the copy is a
 *      ``StaleReferenceError``, never torn data;
 *   6. the hand-out acknowledged in the reader slot's log (under the slot's lock: the id and
 *      seq, then the head, each one aligned native 8-byte store).
 *
 * Anything else returns ``None`` with nothing done (no acknowledgement): the caller then takes
 * the Python path, which raises the typed error or reads what this does not handle. Every
 * read of segment bytes is bounds-checked against the buffer the call holds.
 */
#include "_core.h"
#include <string.h>
#include <sys/mman.h>

/* words and values this section reads besides _core.h's (checked against ``_layout`` by
 * ``READ_LAYOUT``'s test) */
#define H_STATE 19
#define STATE_LIVE 1
#define WS_REVOKED 9
#define PAYLOAD_VERSION 1
#define MAX_NDIM_FORMAT 32
#define SIZE_MAX_ELEMS ((UINT64_C(1) << 62) - 1)
#define MAX_ARRAYS_HERE 64
/* copies of at least this many bytes in all run with the GIL released */
#define NOGIL_COPY (64 * 1024)
/* an array of at least this many bytes gets pages of its own, mapped and populated in one
 * system call (a fresh heap block costs one page fault per 4 KiB page on the first copy) */
#define OWN_PAGES (256 * 1024)
/* and from this size, transparent huge pages (2 MiB aligned) */
#define HUGE_PAGES (4 * 1024 * 1024)
#define HUGE_ALIGN (2 * 1024 * 1024)
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

typedef struct {
    PyObject_HEAD
    PyObject *mem;       /* the segment's memoryview (``Segment.buf``) */
    PyObject *ref_type;  /* ShmRef */
    PyObject *serde;     /* the MsgpackSerde (its limits are read on each call) */
    PyObject *slot;      /* the ReaderSlot (``closed``, ``_ack_lock``, ``_overflow``) */
    PyObject *lock;
    PyObject *overflow;
    PyObject *np_empty;
    PyObject *np_ndarray;
    PyObject *np_frombuffer;
    PyObject *dtypes;    /* dict: dtype string (bytes) -> (dtype, itemsize) */
    PyObject *stale;     /* StaleReferenceError */
    uint64_t nonce, secret, session;
    uint64_t ring_off, capacity, slot_off, log_entries;
} ReadCtx;

static PyObject *s_acquire, *s_release, *s_closed, *s_max_header_bytes, *s_max_arrays,
    *s_max_ndim, *s_reshape, *s_toreadonly;

static inline uint64_t
ld(const unsigned char *p)
{
    return __atomic_load_n((const uint64_t *)p, __ATOMIC_ACQUIRE);
}

static inline uint64_t
le64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint64_t
be(const unsigned char *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = (v << 8) | p[i];
    return v;
}

/* release the GIL for a block only when ``cond`` (the copies are big enough to be worth it) */
#define Py_BEGIN_ALLOW_THREADS_IF(cond)                                                       \
    {                                                                                       \
        PyThreadState *_save = (cond) ? PyEval_SaveThread() : NULL;
#define Py_END_ALLOW_THREADS_IF(cond)                                                         \
    if (_save != NULL)                                                                      \
        PyEval_RestoreThread(_save);                                                        \
    }

/* --- pages of one array (the buffer an array copied out of a big item lives in) ----------- */
typedef struct {
    PyObject_HEAD
    void *map;
    size_t maplen;
    size_t size; /* the bytes of the array (what the buffer exposes) */
} Pages;

/* Mappings of freed arrays, kept for the next big read (warm: no page to fault or zero). A
 * read that drops its item before the next one reuses the same pages, as the heap would; a
 * batch of reads kept alive maps new ones. Bounded, the most recently freed kept, in the order
 * they were freed; only touched with the GIL held. */
#define SPARE_MAX 16
#define SPARE_BYTES (64 * 1024 * 1024)
static struct {
    void *map;
    size_t maplen;
} spare[SPARE_MAX];
static int n_spare;
static size_t spare_bytes;

static void
give_pages(void *map, size_t maplen)
{
    if (maplen > SPARE_BYTES) {
        munmap(map, maplen);
        return;
    }
    /* the oldest spares give way: a reader whose items grew (from 1 MiB to 16 MiB) mapped
     * fresh pages for every read while its spares, full of small mappings, were kept */
    while (n_spare == SPARE_MAX || spare_bytes + maplen > SPARE_BYTES) {
        munmap(spare[0].map, spare[0].maplen);
        spare_bytes -= spare[0].maplen;
        n_spare--;
        memmove(&spare[0], &spare[1], (size_t)n_spare * sizeof spare[0]);
    }
    spare[n_spare].map = map, spare[n_spare].maplen = maplen;
    n_spare++, spare_bytes += maplen;
}

/* a spare mapping of ``n`` to ``n + n / 4`` bytes (the smallest), or NULL */
static void *
take_pages(uint64_t n, size_t *maplen)
{
    int best = -1;
    for (int i = 0; i < n_spare; i++)
        if (spare[i].maplen >= n && spare[i].maplen - n <= n / 4
            && (best < 0 || spare[i].maplen < spare[best].maplen))
            best = i;
    if (best < 0)
        return NULL;
    void *m = spare[best].map;
    *maplen = spare[best].maplen;
    spare_bytes -= *maplen;
    n_spare--;
    memmove(&spare[best], &spare[best + 1], (size_t)(n_spare - best) * sizeof spare[0]);
    return m;
}

static void
pages_dealloc(Pages *self)
{
    if (self->map != NULL)
        give_pages(self->map, self->maplen);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
pages_getbuffer(Pages *self, Py_buffer *view, int flags)
{
    if (self->map == NULL) {
        PyErr_SetString(PyExc_BufferError, "no pages");
        return -1;
    }
    return PyBuffer_FillInfo(view, (PyObject *)self, self->map, (Py_ssize_t)self->size, 0,
                             flags);
}

static PyBufferProcs pages_as_buffer = {(getbufferproc)pages_getbuffer, NULL};

static PyTypeObject PagesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "aioshmcache._core.Pages",
    .tp_basicsize = sizeof(Pages),
    .tp_dealloc = (destructor)pages_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_as_buffer = &pages_as_buffer,
    .tp_doc = "The pages of one array read by read_item (unmapped when the array is freed).",
};

/* Map ``n`` bytes of private anonymous memory, populated (huge pages from HUGE_PAGES); the
 * mapping's start and length in *map / *maplen. Without the GIL. NULL if it failed. */
static char *
map_pages(uint64_t n, void **map, size_t *maplen)
{
    if (n < HUGE_PAGES) {
        void *m = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                       -1, 0);
        if (m == MAP_FAILED)
            return NULL;
        *map = m, *maplen = n;
        return m;
    }
    size_t len = (n + HUGE_ALIGN - 1) & ~(size_t)(HUGE_ALIGN - 1);
    char *m = mmap(NULL, len + HUGE_ALIGN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
    if (m == MAP_FAILED)
        return NULL;
    char *a = (char *)(((uintptr_t)m + HUGE_ALIGN - 1) & ~(uintptr_t)(HUGE_ALIGN - 1));
    if (a > m)
        munmap(m, a - m);
    if (m + len + HUGE_ALIGN > a + len)
        munmap(a + len, (m + len + HUGE_ALIGN) - (a + len));
    (void)madvise(a, len, MADV_HUGEPAGE);        /* advice: may be off on this host */
    (void)madvise(a, len, MADV_POPULATE_WRITE);  /* Linux >= 5.14; else the copy faults */
    *map = a, *maplen = len;
    return a;
}

/* --- the context ------------------------------------------------------------------------ */
static void
ctx_dealloc(ReadCtx *self)
{
    Py_XDECREF(self->mem);
    Py_XDECREF(self->ref_type);
    Py_XDECREF(self->serde);
    Py_XDECREF(self->slot);
    Py_XDECREF(self->lock);
    Py_XDECREF(self->overflow);
    Py_XDECREF(self->np_empty);
    Py_XDECREF(self->np_ndarray);
    Py_XDECREF(self->np_frombuffer);
    Py_XDECREF(self->dtypes);
    Py_XDECREF(self->stale);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
get_u64(PyObject *o, uint64_t *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

static PyObject *
ctx_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *mem, *ref_type, *serde, *slot, *np_empty, *dtypes, *stale;
    PyObject *nonce, *secret, *ring_off, *capacity, *slot_off;
    static char *kw[] = {"mem", "ref_type", "serde", "slot", "np_empty", "dtypes", "stale",
                         "nonce", "secret", "ring_off", "capacity", "slot_off", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOO!OOOOOO:ReadCtx", kw, &mem, &ref_type,
                                     &serde, &slot, &np_empty, &PyDict_Type, &dtypes, &stale,
                                     &nonce, &secret, &ring_off, &capacity, &slot_off))
        return NULL;
    ReadCtx *self = (ReadCtx *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    Py_INCREF(mem), self->mem = mem;
    Py_INCREF(ref_type), self->ref_type = ref_type;
    Py_INCREF(serde), self->serde = serde;
    Py_INCREF(slot), self->slot = slot;
    Py_INCREF(np_empty), self->np_empty = np_empty;
    Py_INCREF(dtypes), self->dtypes = dtypes;
    Py_INCREF(stale), self->stale = stale;
    PyObject *session = NULL, *table = NULL, *entries = NULL;
    if (get_u64(nonce, &self->nonce) < 0 || get_u64(secret, &self->secret) < 0
        || get_u64(ring_off, &self->ring_off) < 0 || get_u64(capacity, &self->capacity) < 0
        || get_u64(slot_off, &self->slot_off) < 0)
        goto fail;
    PyObject *numpy = PyImport_ImportModule("numpy");
    if (numpy == NULL)
        goto fail;
    self->np_ndarray = PyObject_GetAttrString(numpy, "ndarray");
    self->np_frombuffer = PyObject_GetAttrString(numpy, "frombuffer");
    Py_DECREF(numpy);
    if (self->np_ndarray == NULL || self->np_frombuffer == NULL)
        goto fail;
    if ((self->lock = PyObject_GetAttrString(slot, "_ack_lock")) == NULL
        || (self->overflow = PyObject_GetAttrString(slot, "_overflow")) == NULL
        || (session = PyObject_GetAttrString(slot, "session")) == NULL
        || get_u64(session, &self->session) < 0
        || (table = PyObject_GetAttrString(slot, "table")) == NULL
        || (entries = PyObject_GetAttrString(table, "log_entries")) == NULL
        || get_u64(entries, &self->log_entries) < 0)
        goto fail;
    if (!PyList_CheckExact(self->overflow)) {
        PyErr_SetString(PyExc_TypeError, "the slot's overflow must be a list");
        goto fail;
    }
    if ((self->ring_off | self->capacity | self->slot_off) & 7 || self->log_entries == 0
        || self->log_entries > (UINT64_C(1) << 40) || self->capacity > (UINT64_C(1) << 56)
        || self->ring_off > (UINT64_C(1) << 56) || self->slot_off > (UINT64_C(1) << 56)) {
        PyErr_SetString(PyExc_ValueError, "ReadCtx: offsets must be 8-aligned and in range");
        goto fail;
    }
    Py_DECREF(session);
    Py_DECREF(table);
    Py_DECREF(entries);
    return (PyObject *)self;
fail:
    Py_XDECREF(session);
    Py_XDECREF(table);
    Py_XDECREF(entries);
    Py_DECREF(self);
    return NULL;
}

static PyTypeObject ReadCtxType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "aioshmcache._core.ReadCtx",
    .tp_basicsize = sizeof(ReadCtx),
    .tp_dealloc = (destructor)ctx_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = ctx_new,
    .tp_doc = "What read_item needs of one reader: the segment, its slot, the serde.",
};

/* --- the structure header (a msgpack map, the subset ``read_item`` takes) ------------------ */
typedef struct {
    uint64_t start; /* absolute payload offset of the array's bytes */
    uint64_t nbytes;
    char *dst;
    /* an array on pages of its own (OWN_PAGES): made after the copy, under this key */
    PyObject *key, *shape, *dtype;
    void *map;
    size_t maplen;
} Copy;

typedef struct {
    const unsigned char *h; /* the header (in the payload) */
    uint64_t n, pos;
} Cursor;

/* 1: ok, 0: not handled here (nothing raised), -1: a Python error */
static int
take(Cursor *c, uint64_t k, const unsigned char **out)
{
    if (k > c->n - c->pos)
        return 0;
    *out = c->h + c->pos;
    c->pos += k;
    return 1;
}

static int
read_str(Cursor *c, PyObject **out)
{
    const unsigned char *p;
    if (!take(c, 1, &p))
        return 0;
    unsigned t = p[0];
    uint64_t len;
    if ((t & 0xe0) == 0xa0)
        len = t & 0x1f;
    else if (t == 0xd9 || t == 0xda || t == 0xdb) {
        int w = t == 0xd9 ? 1 : t == 0xda ? 2 : 4;
        if (!take(c, w, &p))
            return 0;
        len = be(p, w);
    } else
        return 0;
    if (!take(c, len, &p))
        return 0;
    *out = PyUnicode_DecodeUTF8((const char *)p, (Py_ssize_t)len, NULL);
    if (*out == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    return 1;
}

typedef struct {
    ReadCtx *ctx;
    uint64_t data_off, data_len, cursor, max_ndim, max_arrays;
    PyObject *ro; /* views (a lease): the payload, read-only; NULL: copies */
    int n_arrays, n_copies;
    Copy copies[MAX_ARRAYS_HERE];
} Walk;

static int
read_array(Walk *w, const unsigned char *rec, uint64_t rlen, PyObject **out)
{
    if (rlen < 19)
        return 0;
    uint64_t off = le64(rec), nbytes = le64(rec + 8);
    unsigned flags = rec[16], ndim = rec[17], dlen = rec[18];
    if (flags || ndim > MAX_NDIM_FORMAT || ndim > w->max_ndim
        || rlen != 19 + 8 * (uint64_t)ndim + dlen || w->n_arrays >= MAX_ARRAYS_HERE
        || (uint64_t)w->n_arrays >= w->max_arrays)
        return 0;
    PyObject *key = PyBytes_FromStringAndSize((const char *)rec + 19 + 8 * ndim, dlen);
    if (key == NULL)
        return -1;
    PyObject *entry = PyDict_GetItemWithError(w->ctx->dtypes, key); /* borrowed */
    Py_DECREF(key);
    if (entry == NULL)
        return PyErr_Occurred() ? -1 : 0;
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 2)
        return 0;
    uint64_t itemsize;
    if (get_u64(PyTuple_GET_ITEM(entry, 1), &itemsize) < 0)
        return -1;
    /* the dims are read once: the record lives in shared memory, which may change under the
     * read (a hostile writer, a chunk reused meanwhile); a second read could build a shape
     * other than the one checked here */
    uint64_t dims[MAX_NDIM_FORMAT], count = 1;
    for (unsigned i = 0; i < ndim; i++) {
        uint64_t d = dims[i] = le64(rec + 19 + 8 * i);
        if (d == 0 || d > SIZE_MAX_ELEMS || count > SIZE_MAX_ELEMS / d)
            return 0; /* empty arrays and impossible shapes: the Python path */
        count *= d;
    }
    if (itemsize == 0 || count > SIZE_MAX_ELEMS / itemsize || count * itemsize != nbytes)
        return 0;
    uint64_t expected = (w->cursor + 63) & ~(uint64_t)63;
    if (off != expected || nbytes > w->data_len || off > w->data_len - nbytes)
        return 0;
    w->cursor = off + nbytes;
    PyObject *shape = PyTuple_New(ndim);
    if (shape == NULL)
        return -1;
    for (unsigned i = 0; i < ndim; i++) {
        PyObject *d = PyLong_FromUnsignedLongLong(dims[i]);
        if (d == NULL) {
            Py_DECREF(shape);
            return -1;
        }
        PyTuple_SET_ITEM(shape, i, d);
    }
    w->n_arrays++;
    if (w->ro != NULL) { /* a read-only view of the payload, as the serde's ``copy=False`` */
        PyObject *cnt = PyLong_FromUnsignedLongLong(count);
        PyObject *at = PyLong_FromUnsignedLongLong(w->data_off + off);
        PyObject *view = NULL;
        if (cnt != NULL && at != NULL) {
            PyObject *argv[4] = {w->ro, PyTuple_GET_ITEM(entry, 0), cnt, at};
            view = PyObject_Vectorcall(w->ctx->np_frombuffer, argv, 4, NULL);
        }
        Py_XDECREF(cnt);
        Py_XDECREF(at);
        if (view != NULL && ndim != 1)
            Py_SETREF(view, PyObject_CallMethodOneArg(view, s_reshape, shape));
        Py_DECREF(shape);
        if (view == NULL)
            return -1;
        *out = view;
        return 1;
    }
    Copy *cp = &w->copies[w->n_copies];
    cp->start = w->data_off + off;
    cp->nbytes = nbytes;
    cp->key = cp->shape = cp->dtype = NULL;
    cp->map = NULL;
    if (nbytes >= OWN_PAGES) {
        /* the array is made after the copy, on its own pages (``finish_pages``) */
        cp->shape = shape;
        cp->dtype = Py_NewRef(PyTuple_GET_ITEM(entry, 0));
        cp->dst = cp->map = take_pages(nbytes, &cp->maplen); /* else mapped without the GIL */
        w->n_copies++;
        *out = Py_NewRef(Py_None);
        return 2;
    }
    PyObject *argv[2] = {shape, PyTuple_GET_ITEM(entry, 0)};
    PyObject *arr = PyObject_Vectorcall(w->ctx->np_empty, argv, 2, NULL);
    Py_DECREF(shape);
    if (arr == NULL)
        return -1;
    Py_buffer view;
    if (PyObject_GetBuffer(arr, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        Py_DECREF(arr);
        return -1;
    }
    int ok = (uint64_t)view.len == nbytes;
    char *dst = view.buf;
    PyBuffer_Release(&view); /* the array owns its data; ``arr`` is held */
    if (!ok) {
        Py_DECREF(arr);
        return 0;
    }
    cp->dst = dst;
    w->n_copies++;
    *out = arr;
    return 1;
}

static int
read_value(Walk *w, Cursor *c, PyObject **out)
{
    const unsigned char *p;
    if (!take(c, 1, &p))
        return 0;
    unsigned t = p[0];
    if (t <= 0x7f) {
        *out = PyLong_FromLong((long)t);
    } else if (t >= 0xe0) {
        *out = PyLong_FromLong((long)t - 256);
    } else if (t == 0xc0) {
        *out = Py_NewRef(Py_None);
    } else if (t == 0xc2 || t == 0xc3) {
        *out = PyBool_FromLong(t == 0xc3);
    } else if (t >= 0xcc && t <= 0xcf) {
        int n = 1 << (t - 0xcc);
        if (!take(c, n, &p))
            return 0;
        *out = PyLong_FromUnsignedLongLong(be(p, n));
    } else if (t >= 0xd0 && t <= 0xd3) {
        int n = 1 << (t - 0xd0);
        if (!take(c, n, &p))
            return 0;
        uint64_t u = be(p, n);
        int sh = 64 - 8 * n; /* sign-extend the n-byte value */
        int64_t v = (int64_t)(u << sh) >> sh;
        *out = PyLong_FromLongLong(v);
    } else if (t == 0xca) {
        if (!take(c, 4, &p))
            return 0;
        uint32_t u = (uint32_t)be(p, 4);
        float f;
        memcpy(&f, &u, 4);
        *out = PyFloat_FromDouble((double)f);
    } else if (t == 0xcb) {
        if (!take(c, 8, &p))
            return 0;
        uint64_t u = be(p, 8);
        double d;
        memcpy(&d, &u, 8);
        *out = PyFloat_FromDouble(d);
    } else if ((t & 0xe0) == 0xa0 || t == 0xd9 || t == 0xda || t == 0xdb) {
        c->pos--;
        return read_str(c, out);
    } else if (t == 0xc7 || t == 0xc8) { /* ext 8 / ext 16: an ARRAY record */
        int n = t == 0xc7 ? 1 : 2;
        if (!take(c, n, &p))
            return 0;
        uint64_t rlen = be(p, n);
        if (!take(c, 1, &p) || p[0] != 1)
            return 0;
        const unsigned char *rec;
        if (!take(c, rlen, &rec))
            return 0;
        return read_array(w, rec, rlen, out);
    } else {
        return 0;
    }
    return *out == NULL ? -1 : 1;
}

/* The payload at ``pl`` (``size`` bytes, ``pl_off`` its offset in the mapping) as a dict with
 * the arrays allocated and their copies planned in ``w``: 1, 0 (not handled), -1 (error). */
static int
decode(Walk *w, const unsigned char *pl, uint64_t size, PyObject **out)
{
    if (size < PAYLOAD_PREFIX_SIZE || memcmp(pl, "ASHM", 4) != 0)
        return 0;
    unsigned version = pl[4] | pl[5] << 8, pflags = pl[6] | pl[7] << 8;
    uint64_t hlen = (uint64_t)pl[8] | (uint64_t)pl[9] << 8 | (uint64_t)pl[10] << 16
                    | (uint64_t)pl[11] << 24;
    uint64_t data_len = le64(pl + 12);
    uint64_t max_header, max_arrays, max_ndim;
    PyObject *v;
    if ((v = PyObject_GetAttr(w->ctx->serde, s_max_header_bytes)) == NULL)
        return -1;
    int bad = get_u64(v, &max_header);
    Py_DECREF(v);
    if (bad || (v = PyObject_GetAttr(w->ctx->serde, s_max_arrays)) == NULL)
        return -1;
    bad = get_u64(v, &max_arrays);
    Py_DECREF(v);
    if (bad || (v = PyObject_GetAttr(w->ctx->serde, s_max_ndim)) == NULL)
        return -1;
    bad = get_u64(v, &max_ndim);
    Py_DECREF(v);
    if (bad)
        return -1;
    if (version != PAYLOAD_VERSION || pflags != 0 || hlen == 0 || hlen > max_header)
        return 0;
    uint64_t data_off = (PAYLOAD_PREFIX_SIZE + hlen + 63) & ~(uint64_t)63;
    if (data_off > size || data_len != size - data_off)
        return 0;
    w->data_off = data_off;
    w->data_len = data_len;
    w->cursor = 0;
    w->max_ndim = max_ndim;
    w->max_arrays = max_arrays;
    w->n_copies = w->n_arrays = 0;
    Cursor c = {pl + PAYLOAD_PREFIX_SIZE, hlen, 0};
    const unsigned char *p;
    if (!take(&c, 1, &p))
        return 0;
    uint64_t n;
    if ((p[0] & 0xf0) == 0x80)
        n = p[0] & 0x0f;
    else if (p[0] == 0xde) {
        if (!take(&c, 2, &p))
            return 0;
        n = be(p, 2);
    } else
        return 0;
    PyObject *d = PyDict_New();
    if (d == NULL)
        return -1;
    int r = 1;
    for (uint64_t i = 0; i < n && r == 1; i++) {
        PyObject *key = NULL, *value = NULL;
        r = read_str(&c, &key);
        if (r == 1) {
            r = read_value(w, &c, &value);
            if (r == 2) { /* an array made after the copy: its key kept for it */
                w->copies[w->n_copies - 1].key = Py_NewRef(key);
                r = 1;
            }
        }
        if (r == 1 && PyDict_SetItem(d, key, value) < 0)
            r = -1;
        Py_XDECREF(key);
        Py_XDECREF(value);
        if (r == 1 && (uint64_t)PyDict_GET_SIZE(d) != i + 1)
            r = 0; /* a duplicate key: the Python path decides */
    }
    if (r == 1 && (c.pos != c.n || w->cursor != data_len))
        r = 0;
    if (r != 1) {
        Py_DECREF(d);
        return r;
    }
    *out = d;
    return 1;
}

/* Free what the copies hold that no array owns yet (on every exit of read_item). */
static void
release_copies(Walk *w)
{
    for (int i = 0; i < w->n_copies; i++) {
        Copy *cp = &w->copies[i];
        Py_CLEAR(cp->key);
        Py_CLEAR(cp->shape);
        Py_CLEAR(cp->dtype);
        if (cp->map != NULL) {
            give_pages(cp->map, cp->maplen);
            cp->map = NULL;
        }
    }
    w->n_copies = 0;
}

/* The arrays on pages of their own, into the dict ``d`` under their keys: 0, or -1. */
static int
finish_pages(Walk *w, PyObject *d)
{
    for (int i = 0; i < w->n_copies; i++) {
        Copy *cp = &w->copies[i];
        if (cp->key == NULL)
            continue;
        Pages *pages = PyObject_New(Pages, &PagesType);
        if (pages == NULL)
            return -1;
        pages->map = cp->map, pages->maplen = cp->maplen, pages->size = cp->nbytes;
        cp->map = NULL; /* the pages own it now */
        PyObject *argv[3] = {cp->shape, cp->dtype, (PyObject *)pages};
        PyObject *arr = PyObject_Vectorcall(w->ctx->np_ndarray, argv, 3, NULL);
        Py_DECREF(pages);
        if (arr == NULL)
            return -1;
        int bad = PyDict_SetItem(d, cp->key, arr);
        Py_DECREF(arr);
        if (bad)
            return -1;
    }
    return 0;
}

/* --- read_item ---------------------------------------------------------------------------- */
static inline uint64_t
reference_tag(uint64_t secret, uint64_t epoch, uint64_t address, uint64_t cid, uint64_t length,
              uint64_t position, uint64_t seq)
{
    uint64_t h = secret ^ (cid * TAG_M1) ^ (address * TAG_M2) ^ (length * TAG_M3)
                 ^ (epoch * TAG_M4) ^ (uint64_t)(((unsigned __int128)position * TAG_M2) >> 7);
    h ^= (uint64_t)(((unsigned __int128)seq * TAG_M3) >> 11);
    h ^= h >> 29;
    return h * TAG_M1;
}

/* the acknowledgement (``ReaderSlot.ack``'s usual case): 1 done, 0 not here, -1 error */
static int
acknowledge(ReadCtx *ctx, unsigned char *slot, uint64_t cid, uint64_t seq)
{
    PyObject *r = PyObject_CallMethodNoArgs(ctx->lock, s_acquire);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    int done = 0;
    PyObject *closed = PyObject_GetAttr(ctx->slot, s_closed);
    if (closed == NULL)
        done = -1;
    else if (closed == Py_False && PyList_GET_SIZE(ctx->overflow) == 0) {
        uint64_t head = ld(slot + 8 * RS_HEAD), consumed = ld(slot + 8 * WS_CONSUMED);
        if (head - consumed < ctx->log_entries) {
            unsigned char *e = slot + SLOT_HEADER + LOG_ENTRY_BYTES * (head % ctx->log_entries);
            __atomic_store_n((uint64_t *)e, cid, __ATOMIC_RELAXED);
            __atomic_store_n((uint64_t *)(e + 8), seq, __ATOMIC_RELAXED);
            __atomic_store_n((uint64_t *)(slot + 8 * RS_HEAD), head + 1, __ATOMIC_RELEASE);
            done = 1;
        }
    }
    Py_XDECREF(closed);
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    r = PyObject_CallMethodNoArgs(ctx->lock, s_release);
    if (r == NULL) {
        Py_XDECREF(et);
        Py_XDECREF(ev);
        Py_XDECREF(tb);
        return -1;
    }
    Py_DECREF(r);
    PyErr_Restore(et, ev, tb);
    return done;
}

static PyObject *
core_read_item(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 && nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "read_item takes 2 or 3 arguments (ctx, ref, copy)");
        return NULL;
    }
    int copy = 1;
    if (nargs == 3 && (copy = PyObject_IsTrue(args[2])) < 0)
        return NULL;
    if (!Py_IS_TYPE(args[0], &ReadCtxType)) {
        PyErr_SetString(PyExc_TypeError, "read_item: ctx must be a ReadCtx");
        return NULL;
    }
    ReadCtx *ctx = (ReadCtx *)args[0];
    PyObject *ref = args[1];
    if ((PyObject *)Py_TYPE(ref) != ctx->ref_type || PyTuple_GET_SIZE(ref) != 8)
        Py_RETURN_NONE;
    uint64_t f[8];
    for (int i = 0; i < 8; i++) {
        PyObject *o = PyTuple_GET_ITEM(ref, i);
        if (!PyLong_CheckExact(o))
            Py_RETURN_NONE;
        f[i] = PyLong_AsUnsignedLongLong(o);
        if (f[i] == (uint64_t)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
    }
    uint64_t nonce = f[0], epoch = f[1], address = f[2], cid = f[3], length = f[4], tag = f[5],
             position = f[6], seq = f[7];
    if (nonce != ctx->nonce
        || tag != reference_tag(ctx->secret, epoch, address, cid, length, position, seq))
        Py_RETURN_NONE;

    Py_buffer mem;
    if (PyObject_GetBuffer(ctx->mem, &mem, PyBUF_WRITABLE) < 0) {
        PyErr_Clear(); /* released (closed): the Python path raises the typed error */
        Py_RETURN_NONE;
    }
    PyObject *result = NULL, *value = NULL;
    Walk w;
    w.n_copies = 0;
    w.ro = NULL;
    unsigned char *base = mem.buf;
    uint64_t total = (uint64_t)mem.len;
    if (total < AIOSHM_HEADER_SIZE || ctx->ring_off > total || ctx->capacity > total - ctx->ring_off
        || ctx->slot_off > total
        || SLOT_HEADER + LOG_ENTRY_BYTES * ctx->log_entries > total - ctx->slot_off)
        goto pass;
    unsigned char *slot = base + ctx->slot_off;
    unsigned char *ring = base + ctx->ring_off;
    uint64_t cap = ctx->capacity;
    if (ld(base + 8 * H_STATE) != STATE_LIVE || ld(base + 8 * H_EPOCH) != epoch
        || ld(slot + 8 * WS_REVOKED) == ctx->session || PyList_GET_SIZE(ctx->overflow) != 0)
        goto pass;
    if (address & 63 || cap < CHUNK_HEADER || address > cap - CHUNK_HEADER
        || length > cap - CHUNK_HEADER - address)
        goto pass;
    unsigned char *ch = ring + address;
    if (ld(ch + 8 * C_ID) != cid || ld(ch + 8 * C_LENGTH) != length
        || ld(ch + 8 * C_CHECK) != (cid ^ length ^ CHUNK_MAGIC)
        || ld(ch + 8 * C_STATE) != CHUNK_COMMITTED || position % cap != address
        || ld(base + 8 * H_HEAD_POS) > position)
        goto pass;

    w.ctx = ctx;
    w.n_copies = 0;
    uint64_t pl_off = ctx->ring_off + address + CHUNK_HEADER;
    if (!copy) { /* views of a read-only slice of the segment's view (it keeps it mapped) */
        PyObject *start = PyLong_FromUnsignedLongLong(pl_off);
        PyObject *stop = PyLong_FromUnsignedLongLong(pl_off + length);
        PyObject *sl = start && stop ? PySlice_New(start, stop, NULL) : NULL;
        PyObject *part = sl ? PyObject_GetItem(ctx->mem, sl) : NULL;
        Py_XDECREF(start);
        Py_XDECREF(stop);
        Py_XDECREF(sl);
        if (part == NULL)
            goto done;
        w.ro = PyObject_CallMethodNoArgs(part, s_toreadonly);
        Py_DECREF(part);
        if (w.ro == NULL)
            goto done;
    }
    int r = decode(&w, base + pl_off, length, &value);
    if (r < 0)
        goto done;
    if (r == 0)
        goto pass;
    uint64_t sum = 0;
    for (int i = 0; i < w.n_copies; i++)
        sum += w.copies[i].nbytes;
    int unmapped = 0;
    Py_BEGIN_ALLOW_THREADS_IF(sum >= NOGIL_COPY)
    for (int i = 0; i < w.n_copies; i++) {
        Copy *cp = &w.copies[i];
        if (cp->key != NULL && cp->dst == NULL
            && (cp->dst = map_pages(cp->nbytes, &cp->map, &cp->maplen)) == NULL) {
            unmapped = 1;
            continue;
        }
        memcpy(cp->dst, base + pl_off + cp->start, cp->nbytes);
    }
    Py_END_ALLOW_THREADS_IF(sum >= NOGIL_COPY)
    if (unmapped)
        goto pass; /* no memory to map: the Python path (which reports it) */
    /* the copy is verified: the chunk was not reclaimed meanwhile (``ShmRingBuffer.verify``) */
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (ld(base + 8 * H_HEAD_POS) > position || ld(ch + 8 * C_ID) != cid
        || ld(ch + 8 * C_STATE) != CHUNK_COMMITTED) {
        PyErr_Format(ctx->stale, "chunk %llu was reclaimed during the read",
                     (unsigned long long)cid);
        goto done;
    }
    if (finish_pages(&w, value) < 0)
        goto done;
    if (ld(slot + 8 * WS_REVOKED) == ctx->session)
        goto pass; /* revoked meanwhile: the Python path raises it (nothing acknowledged) */
    if (!copy) { /* a lease: acknowledged when it is settled (``ReadPath.ack``) */
        result = value;
        value = NULL;
        goto done;
    }
    r = acknowledge(ctx, slot, cid, seq);
    if (r < 0)
        goto done;
    if (r == 0)
        goto pass;
    result = value;
    value = NULL;
    goto done;
pass:
    result = Py_NewRef(Py_None);
done:
    release_copies(&w);
    Py_XDECREF(w.ro);
    Py_XDECREF(value);
    PyBuffer_Release(&mem);
    return result;
}

/* the constants this section adds (a test compares them with ``_layout``) */
static PyObject *
core_read_layout(PyObject *module, PyObject *unused)
{
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K}", "H_STATE", (unsigned long long)H_STATE,
                         "STATE_LIVE", (unsigned long long)STATE_LIVE, "WS_REVOKED",
                         (unsigned long long)WS_REVOKED, "NOGIL_COPY",
                         (unsigned long long)NOGIL_COPY, "OWN_PAGES",
                         (unsigned long long)OWN_PAGES, "HUGE_PAGES",
                         (unsigned long long)HUGE_PAGES);
}

PyMethodDef aioshm_read_methods[] = {
    {"read_item", (PyCFunction)(void (*)(void))core_read_item, METH_FASTCALL,
     "read_item(ctx, ref, copy=True) -> the item (a verified copy, acknowledged; with copy "
     "false read-only views, not acknowledged), or None: not handled here, nothing done"},
    {"read_layout", core_read_layout, METH_NOARGS,
     "read_layout() -> the layout constants the read section is built with"},
    {NULL, NULL, 0, NULL},
};

int
aioshm_read_init(PyObject *module)
{
#define INTERN(var, text)                                                                    \
    if ((var) == NULL && ((var) = PyUnicode_InternFromString(text)) == NULL)               \
        return -1;
    INTERN(s_acquire, "acquire");
    INTERN(s_release, "release");
    INTERN(s_closed, "closed");
    INTERN(s_max_header_bytes, "max_header_bytes");
    INTERN(s_max_arrays, "max_arrays");
    INTERN(s_max_ndim, "max_ndim");
    INTERN(s_reshape, "reshape");
    INTERN(s_toreadonly, "toreadonly");
#undef INTERN
    if (PyType_Ready(&ReadCtxType) < 0 || PyType_Ready(&PagesType) < 0)
        return -1;
    Py_INCREF(&ReadCtxType);
    if (PyModule_AddObject(module, "ReadCtx", (PyObject *)&ReadCtxType) < 0) {
        Py_DECREF(&ReadCtxType);
        return -1;
    }
    return 0;
}
