/* aioshmcache._core, the kept section: the sender's kept prompt updates (``aioshmcache._kept``).
 *
 * The sender keeps each cached item's prompt updates until the item leaves, in a form the
 * garbage collector need not walk (``_kept``'s docstring: one flat tuple of records, each a
 * code and what the value holds). The reference is ``_kept.keep_py`` and the pure core's
 * functions in ``aioshmcache/_core_py.py``:
 *
 *   atom_tuple(seq)       ``tuple(seq)`` of a list, untracked at once when it holds no
 *                         container the collector may need to watch;
 *   atom_runs(seq)        a list of atoms as its runs of one object, when shorter;
 *   keep_updates(updates, how, numbers, objects, max_depth, marker)
 *                         ``_kept.keep_py(updates)`` in one call, for updates of classes the
 *                         registry has met: the same records, or None (declined, nothing done)
 *                         for anything else (a class or enum member not numbered yet, an
 *                         instance dict that is not a dict, an attribute or a class's hash
 *                         that raises), and the Python walk then makes them (and numbers what
 *                         it meets).
 *   restore_kept(kept, objects, how)
 *                         ``(_kept.restore_py(kept),)``: the updates made again from their
 *                         records, or None (declined: anything unusual, any error; the Python
 *                         steps then restore them, or raise).
 *
 * Why compiled: a vLLM-shaped update (a frozen dataclass holding a str enum member and a
 * dataclass of 576 token ids) cost ~9-13 us a put in the Python walk, most of a 1 KiB put with
 * updates; this walk makes the same records with no Python frame, copying the token ids once.
 */
#include "_core.h"

/* record codes: ``_kept``'s ``_ATOM, _ATOM_LIST, ...`` (the differential test compares them) */
enum { K_ATOM, K_ATOM_LIST, K_LIST, K_TUPLE, K_DICT, K_DICT_OBJ, K_SLOT_OBJ, K_MEMBER, K_REF, K_ATOM_RUNS, K_FUNC };

/* a function definition in the registry (``_kept._definition``): code, globals, name,
 * qualname, module, doc, annotations (a dict) */
enum { D_CODE, D_GLOBALS, D_NAME, D_QUALNAME, D_MODULE, D_DOC, D_ANNOTATIONS, D_SIZE };

static inline int
is_atom(PyObject *v)
{
    PyTypeObject *t = Py_TYPE(v);
    return t == &PyLong_Type || t == &PyUnicode_Type || t == &PyFloat_Type || t == &PyBool_Type ||
           t == &PyBytes_Type || v == Py_None;
}

/* ``tuple(seq)`` of the exact list ``seq``, untracked at once when none of its items is a
 * container that may come to hold a cycle (an object of a GC type, but for an untracked
 * tuple): what CPython's next collection does to such a tuple anyway (``_PyTuple_MaybeUntrack``),
 * without that collection first walking every item of it. The sender keeps each entry's
 * prompt updates as one such tuple of hundreds of atoms: left tracked, a young-generation
 * collection walked ~700 of them at once, a stall of ~1-3 ms every ~700 puts. */
/* ``tuple(seq)`` of the exact list ``seq``, its items read after the tuple's allocation: that
 * allocation may run a collection (CPython 3.11 collects in the allocation itself) whose
 * finalizer changes the list, and ``PyList_AsTuple`` then copies the items it saw before, freed
 * since (a segfault); a list whose length changed is copied again. */
static PyObject *
list_snapshot(PyObject *seq)
{
    for (;;) {
        Py_ssize_t n = PyList_GET_SIZE(seq);
        PyObject *out = PyTuple_New(n);
        if (out == NULL || PyList_GET_SIZE(seq) != n) {
            Py_XDECREF(out);
            if (out == NULL)
                return NULL;
            continue;
        }
        for (Py_ssize_t i = 0; i < n; i++) /* no allocation: the list stays as it is */
            PyTuple_SET_ITEM(out, i, Py_NewRef(PyList_GET_ITEM(seq, i)));
        return out;
    }
}

static PyObject *
untracked_tuple(PyObject *seq)
{
    PyObject *out = list_snapshot(seq);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(out); i++) {
        PyObject *x = PyTuple_GET_ITEM(out, i);
        if (PyObject_IS_GC(x) && (!PyTuple_CheckExact(x) || PyObject_GC_IsTracked(x)))
            return out; /* it may hold a cycle through x: the collector keeps watching it */
    }
    if (PyObject_GC_IsTracked(out))
        PyObject_GC_UnTrack(out);
    return out;
}

/* A list of atoms as its runs, ``(item, count, item, count, ...)`` (an item the same object as
 * the one before it extends that one's run), untracked, when that is shorter than the list
 * (fewer runs than half its length); else None. vLLM's placeholder tokens are such runs: an
 * image's 576 tokens ``[image_token_id] * 576``, maybe between a start and an end token, are
 * one run to keep, not 576 pointers to copy into new memory a put. */
/* The number of runs of one object in a list, or -1 if an item is not an atom: one pass,
 * each run's object type-tested once. */
static Py_ssize_t
atom_run_count(PyObject *seq)
{
    Py_ssize_t runs = 0;
    PyObject *prev = NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(seq); i++) {
        PyObject *x = PyList_GET_ITEM(seq, i);
        if (x != prev) {
            if (!is_atom(x))
                return -1;
            runs++;
            prev = x;
        }
    }
    return runs;
}

/* ``seq``'s runs (``runs`` of them, as ``atom_run_count`` counted), or None (not shorter), or
 * NULL: an error set, or none (an item is no longer an atom: the list changed). The tuple's
 * allocation may run a collection (CPython 3.11 collects in the allocation itself) whose
 * finalizer changes the list: it is read afresh after that, every bound checked, and counted
 * again when it changed. Nothing after the allocation runs Python code (a count is an int, no
 * object the collector tracks), so the copy never reads past the list nor writes past the
 * tuple, and the tuple holds atoms only. */
static PyObject *
runs_of(PyObject *seq, Py_ssize_t runs)
{
again:
    if (runs < 0)
        return NULL;
    if (2 * runs >= PyList_GET_SIZE(seq))
        Py_RETURN_NONE;
    PyObject *out = PyTuple_New(2 * runs);
    if (out == NULL)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(seq), i = 0, r = 0;
    while (i < n && r < runs) {
        PyObject *x = PyList_GET_ITEM(seq, i);
        if (!is_atom(x))
            break;
        Py_ssize_t j = i + 1;
        while (j < n && PyList_GET_ITEM(seq, j) == x)
            j++;
        PyObject *count = PyLong_FromSsize_t(j - i);
        if (count == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, 2 * r, Py_NewRef(x));
        PyTuple_SET_ITEM(out, 2 * r + 1, count);
        r++;
        i = j;
    }
    if (i < n || r < runs) { /* the list changed under the allocation: count it again */
        Py_DECREF(out);
        runs = atom_run_count(seq);
        goto again;
    }
    PyObject_GC_UnTrack(out); /* atoms and counts only: no cycle through it */
    return out;
}

static PyObject *
kept_atom_runs(PyObject *self, PyObject *seq)
{
    Py_ssize_t runs = PyList_CheckExact(seq) ? atom_run_count(seq) : -1;
    PyObject *out = runs < 0 ? NULL : runs_of(seq, runs);
    if (out == NULL && !PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "atom_runs: a list of atoms is expected");
    return out;
}

static PyObject *
kept_atom_tuple(PyObject *self, PyObject *seq)
{
    if (!PyList_CheckExact(seq)) {
        PyErr_SetString(PyExc_TypeError, "atom_tuple: a list is expected");
        return NULL;
    }
    return untracked_tuple(seq);
}

/* --- the walk: _kept._put ------------------------------------------------------------------ */

typedef struct {
    PyObject *out;     /* list: the records so far */
    PyObject *refs;    /* list: what is kept by reference */
    PyObject *how;     /* dict: class -> (code, field names), or None (kept by reference) */
    PyObject *numbers; /* dict: id(class, enum member or definition's code) -> its number */
    PyObject *objects; /* list: number -> class, enum member or definition */
    long max_depth;
    PyObject *met; /* set: the functions kept as their definitions so far (NULL: none) */
} Walk;

static PyObject *s_dict;   /* "__dict__", interned */
static PyObject *s_locals; /* "<locals>" */

/* Each step: 1 done, 0 declined (no exception set), -1 failed (an exception set). */

static int
add(PyObject *out, long code, PyObject *v)
{
    PyObject *c = PyLong_FromLong(code); /* a small int: shared, no allocation */
    if (c == NULL)
        return -1;
    int r = PyList_Append(out, c);
    Py_DECREF(c);
    return (r < 0 || PyList_Append(out, v) < 0) ? -1 : 1;
}

static int
add_n(PyObject *out, long code, Py_ssize_t n)
{
    PyObject *x = PyLong_FromSsize_t(n);
    if (x == NULL)
        return -1;
    int r = add(out, code, x);
    Py_DECREF(x);
    return r;
}

static int
by_reference(Walk *w, PyObject *v)
{
    if (add_n(w->out, K_REF, PyList_GET_SIZE(w->refs)) < 0)
        return -1;
    return PyList_Append(w->refs, v) < 0 ? -1 : 1;
}

/* ``_number(obj)`` when the registry has it (a new reference in *num), or declined. */
static int
number_of(Walk *w, PyObject *obj, PyObject **num)
{
    PyObject *id = PyLong_FromVoidPtr(obj);
    if (id == NULL)
        return -1;
    PyObject *n = PyDict_GetItemWithError(w->numbers, id);
    Py_DECREF(id);
    if (n == NULL)
        return PyErr_Occurred() ? -1 : 0;
    *num = Py_NewRef(n);
    return 1;
}

static int put(Walk *w, PyObject *v, long depth);

static int
put_items(Walk *w, PyObject *items, long depth)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(items); i++) {
        int r = put(w, PyTuple_GET_ITEM(items, i), depth);
        if (r <= 0)
            return r;
    }
    return 1;
}

/* A dict's length and items' records, from one snapshot of its items: what the walk meets
 * cannot change what it records, nor can a finalizer that a collection started by the
 * snapshot's allocations runs (its length read before them said more or fewer pairs than
 * followed: the records read back as other values). */
static int
put_pairs(Walk *w, PyObject *d, long depth)
{
    PyObject *pairs = PyDict_Items(d);
    if (pairs == NULL)
        return -1;
    PyObject *n = PyLong_FromSsize_t(PyList_GET_SIZE(pairs));
    int r = (n == NULL || PyList_Append(w->out, n) < 0) ? -1 : 1;
    Py_XDECREF(n);
    for (Py_ssize_t i = 0; r > 0 && i < PyList_GET_SIZE(pairs); i++) {
        PyObject *kv = PyList_GET_ITEM(pairs, i);
        r = put(w, PyTuple_GET_ITEM(kv, 0), depth);
        if (r > 0)
            r = put(w, PyTuple_GET_ITEM(kv, 1), depth);
    }
    Py_DECREF(pairs);
    return r;
}

/* An instance of a class the registry has met: an enum member, a dataclass instance kept by
 * its instance dict or by its slotted fields, or (``how`` None) one kept by reference. */
static int
put_object(Walk *w, PyObject *v, long depth)
{
    PyObject *how = PyDict_GetItemWithError(w->how, (PyObject *)Py_TYPE(v));
    if (how == NULL) { /* a class not met yet: the Python walk classifies it; or its look-up
                        * raised (a metaclass's ``__hash__``): the Python walk raises it, and
                        * ``keep`` keeps the updates as given */
        PyErr_Clear();
        return 0;
    }
    if (how == Py_None)
        return by_reference(w, v);
    if (!PyTuple_CheckExact(how) || PyTuple_GET_SIZE(how) != 2 ||
        !PyLong_CheckExact(PyTuple_GET_ITEM(how, 0)) || !PyTuple_CheckExact(PyTuple_GET_ITEM(how, 1)))
        return 0;
    Py_INCREF(how);
    long code = PyLong_AsLong(PyTuple_GET_ITEM(how, 0));
    if (code == -1 && PyErr_Occurred())
        PyErr_Clear(); /* no code of ours: declined below */
    PyObject *names = PyTuple_GET_ITEM(how, 1), *num = NULL, *state = NULL;
    int r = number_of(w, code == K_MEMBER ? v : (PyObject *)Py_TYPE(v), &num);
    if (r <= 0)
        goto done;
    if (code == K_MEMBER) {
        r = add(w->out, K_MEMBER, num);
    } else if (code == K_DICT_OBJ) {
        state = PyObject_GetAttr(v, s_dict);
        if (state == NULL || !PyDict_CheckExact(state)) {
            PyErr_Clear();
            r = 0; /* the Python walk raises what it raises, or walks what it is */
            goto done;
        }
        r = add(w->out, K_DICT_OBJ, num);
        if (r > 0)
            r = put_pairs(w, state, depth);
    } else if (code == K_SLOT_OBJ) {
        r = add(w->out, K_SLOT_OBJ, num);
        for (Py_ssize_t i = 0; r > 0 && i < PyTuple_GET_SIZE(names); i++) {
            PyObject *x = PyObject_GetAttr(v, PyTuple_GET_ITEM(names, i));
            if (x == NULL) {
                PyErr_Clear();
                r = 0; /* an unset slot: the Python walk keeps it by reference */
                break;
            }
            r = put(w, x, depth);
            Py_DECREF(x);
        }
    } else {
        r = 0;
    }
done:
    Py_XDECREF(state);
    Py_XDECREF(num);
    Py_DECREF(how);
    return r;
}

/* ``_kept._same(a, b)`` (NULL is None): 1, 0, or -1 with an error set. */
static int
same(PyObject *a, PyObject *b)
{
    a = a == NULL ? Py_None : a;
    b = b == NULL ? Py_None : b;
    return a == b ? 1 : PyObject_RichCompareBool(a, b, Py_EQ);
}

/* Whether the function ``f``'s annotations are its definition's ``d`` (a dict): what
 * ``f.__annotations__ == d`` says, without making ``f``'s dict of them. CPython 3.11-3.13 keep
 * a new function's annotations as the flat tuple ``(name, value, ...)`` its ``def`` built,
 * made a dict when first read. 1, 0, or -1 with an error set. */
static int
same_annotations(PyObject *raw, PyObject *d)
{
    if (!PyDict_CheckExact(d))
        return 0;
    if (raw == NULL || raw == Py_None)
        return PyDict_GET_SIZE(d) == 0;
    if (PyDict_Check(raw))
        return PyObject_RichCompareBool(raw, d, Py_EQ);
    if (!PyTuple_CheckExact(raw) || PyTuple_GET_SIZE(raw) % 2 ||
        PyTuple_GET_SIZE(raw) / 2 != PyDict_GET_SIZE(d))
        return 0; /* (a name twice would make fewer pairs: declined) */
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(raw); i += 2) {
        PyObject *want = PyDict_GetItemWithError(d, PyTuple_GET_ITEM(raw, i));
        if (want == NULL)
            return PyErr_Occurred() ? -1 : 0;
        Py_INCREF(want);
        int r = same(PyTuple_GET_ITEM(raw, i + 1), want);
        Py_DECREF(want);
        if (r <= 0)
            return r;
    }
    return 1;
}

/* A function as its definition's number and the records of its defaults, keyword defaults
 * and cells' contents (``_kept._put``); declined if its code is not numbered yet or it
 * differs from its definition in any way (the Python walk then keeps it by reference). */
static int
put_function(Walk *w, PyObject *v, long depth)
{
#if PY_VERSION_HEX >= 0x030E0000
    return 0; /* annotations made lazily (PEP 649): the Python walk keeps it by reference */
#else
    PyFunctionObject *f = (PyFunctionObject *)v;
    PyObject *num = NULL, *d = NULL, *held = NULL, *parts[3] = {NULL, NULL, NULL};
    int r = number_of(w, v, &num); /* a function its module names, numbered: itself */
    if (r != 0) {
        if (r > 0)
            r = add(w->out, K_MEMBER, num);
        Py_XDECREF(num);
        return r;
    }
    /* one its module may name (no "<locals>" in its qualified name): the Python walk looks */
    Py_ssize_t at = PyUnicode_Check(f->func_qualname)
                        ? PyUnicode_Find(f->func_qualname, s_locals, 0, PY_SSIZE_T_MAX, 1)
                        : -1;
    if (at < 0) {
        PyErr_Clear();
        return 0;
    }
    /* met before in this walk (a closure over itself, or over a table of closures holding
     * it): by reference, as ``_kept._put`` (each function copied once, not once a path) */
    r = w->met == NULL ? 0 : PySet_Contains(w->met, v);
    if (r != 0)
        return r < 0 ? -1 : by_reference(w, v);
    r = number_of(w, f->func_code, &num);
    if (r <= 0)
        return r;
    Py_ssize_t n = PyLong_AsSsize_t(num);
    if (n < 0 || n >= PyList_GET_SIZE(w->objects)) {
        PyErr_Clear();
        r = 0;
        goto done;
    }
    d = Py_NewRef(PyList_GET_ITEM(w->objects, n));
    r = 0;
    if (!PyTuple_CheckExact(d) || PyTuple_GET_SIZE(d) != D_SIZE ||
        PyTuple_GET_ITEM(d, D_CODE) != f->func_code ||
        PyTuple_GET_ITEM(d, D_GLOBALS) != f->func_globals)
        goto done;
    /* what a comparison may run (a caller's __eq__) cannot free what is compared; it may set
     * an attribute on the function or give it another code: checked after them, as
     * ``_kept._definition`` does */
    r = 1;
    for (int j = 0; r > 0 && j < 5; j++) { /* each read as the comparisons before left it */
        PyObject *mine = j == 0   ? f->func_name
                         : j == 1 ? f->func_qualname
                         : j == 2 ? f->func_module
                         : j == 3 ? f->func_doc
                                  : f->func_annotations;
        Py_XINCREF(mine);
        r = j < 4 ? same(mine, PyTuple_GET_ITEM(d, D_NAME + j))
                  : same_annotations(mine, PyTuple_GET_ITEM(d, D_ANNOTATIONS));
        Py_XDECREF(mine);
    }
    if (r <= 0) {
        PyErr_Clear(); /* the Python walk compares them again, and raises what they raise */
        r = 0;
        goto done;
    }
    r = 0;
    if (f->func_code != PyTuple_GET_ITEM(d, D_CODE) ||
        (f->func_dict != NULL &&
         (!PyDict_CheckExact(f->func_dict) || PyDict_GET_SIZE(f->func_dict))))
        goto done; /* (a dict of a subclass: the Python walk asks it whether it is empty) */
#if PY_VERSION_HEX >= 0x030C0000
    if (f->func_typeparams != NULL &&
        (!PyTuple_CheckExact(f->func_typeparams) || PyTuple_GET_SIZE(f->func_typeparams)))
        goto done;
#endif
    parts[0] = Py_XNewRef(f->func_defaults);
    parts[1] = Py_XNewRef(f->func_kwdefaults);
    parts[2] = Py_XNewRef(f->func_closure);
    if (parts[2] != NULL) { /* what its cells hold, at this moment */
        if (!PyTuple_CheckExact(parts[2])) {
            r = 0;
            goto done;
        }
        Py_ssize_t k = PyTuple_GET_SIZE(parts[2]);
        if ((held = PyTuple_New(k)) == NULL) {
            r = -1;
            goto done;
        }
        for (Py_ssize_t j = 0; j < k; j++) {
            PyObject *cell = PyTuple_GET_ITEM(parts[2], j);
            PyObject *x = PyCell_Check(cell) ? PyCell_GET(cell) : NULL;
            if (x == NULL) { /* an empty cell: the Python walk keeps the function by reference */
                r = 0;
                goto done;
            }
            PyTuple_SET_ITEM(held, j, Py_NewRef(x));
        }
    }
    if (w->met == NULL && (w->met = PySet_New(NULL)) == NULL) {
        r = -1;
        goto done;
    }
    r = PySet_Add(w->met, v) < 0 ? -1 : add(w->out, K_FUNC, num);
    for (int j = 0; r > 0 && j < 3; j++) {
        PyObject *x = j < 2 ? parts[j] : held;
        r = put(w, x == NULL ? Py_None : x, depth);
    }
done:
    Py_XDECREF(held);
    for (int j = 0; j < 3; j++)
        Py_XDECREF(parts[j]);
    Py_XDECREF(d);
    Py_DECREF(num);
    return r;
#endif
}

static int
put(Walk *w, PyObject *v, long depth)
{
    if (is_atom(v))
        return add(w->out, K_ATOM, v);
    if (depth > w->max_depth)
        return by_reference(w, v);
    depth++;
    if (PyList_CheckExact(v)) {
        Py_ssize_t runs = atom_run_count(v);
        if (runs >= 0) {
            PyObject *items = runs_of(v, runs);
            long code = K_ATOM_RUNS;
            if (items == NULL && !PyErr_Occurred())
                return 0; /* it changed under runs_of (a finalizer): the Python walk walks it */
            if (items == Py_None) {
                Py_DECREF(items);
                items = untracked_tuple(v);
                code = K_ATOM_LIST;
            }
            if (items == NULL)
                return -1;
            int r = add(w->out, code, items);
            Py_DECREF(items);
            return r;
        }
        PyObject *items = list_snapshot(v); /* a snapshot, as put_pairs's */
        if (items == NULL)
            return -1;
        int r = add_n(w->out, K_LIST, PyTuple_GET_SIZE(items));
        if (r > 0)
            r = put_items(w, items, depth);
        Py_DECREF(items);
        return r;
    }
    if (PyTuple_CheckExact(v)) {
        int r = add_n(w->out, K_TUPLE, PyTuple_GET_SIZE(v));
        return r > 0 ? put_items(w, v, depth) : r;
    }
    if (PyDict_CheckExact(v)) {
        PyObject *c = PyLong_FromLong(K_DICT);
        int r = (c == NULL || PyList_Append(w->out, c) < 0) ? -1 : 1;
        Py_XDECREF(c);
        return r > 0 ? put_pairs(w, v, depth) : r;
    }
    if (PyFunction_Check(v) && Py_IS_TYPE(v, &PyFunction_Type))
        return put_function(w, v, depth);
    return put_object(w, v, depth);
}

/* keep_updates(updates, how, numbers, objects, max_depth, marker) -> the kept form, or None. */
static PyObject *
kept_keep_updates(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 || !PyDict_CheckExact(args[1]) || !PyDict_CheckExact(args[2]) ||
        !PyList_CheckExact(args[3]) || !PyLong_CheckExact(args[4])) {
        PyErr_SetString(PyExc_TypeError, "keep_updates(updates, how: dict, numbers: dict, "
                                         "objects: list, max_depth: int, marker)");
        return NULL;
    }
    PyObject *updates = args[0], *marker = args[5];
    if (!PyTuple_CheckExact(updates))
        return Py_NewRef(updates);
    Py_ssize_t i = 0;
    while (i < PyTuple_GET_SIZE(updates) && is_atom(PyTuple_GET_ITEM(updates, i)))
        i++;
    if (i == PyTuple_GET_SIZE(updates))
        return Py_NewRef(updates); /* atoms (or empty): an untracked tuple already */
    long max_depth = PyLong_AsLong(args[4]);
    if (max_depth == -1 && PyErr_Occurred())
        return NULL;
    Walk w = {PyList_New(0), PyList_New(0), args[1], args[2], args[3], max_depth, NULL};
    PyObject *result = NULL;
    if (w.out == NULL || w.refs == NULL || PyList_Append(w.out, marker) < 0 ||
        PyList_Append(w.out, Py_None) < 0)
        goto done;
    int r = put(&w, updates, 0);
    if (r < 0)
        goto done;
    if (r == 0) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    PyObject *records = untracked_tuple(w.out);
    if (records == NULL || PyList_GET_SIZE(w.refs) == 0) {
        result = records;
        goto done;
    }
    PyObject *refs = PyList_AsTuple(w.refs);
    if (refs != NULL)
        result = PyTuple_Pack(3, marker, refs, records);
    Py_XDECREF(refs);
    Py_DECREF(records);
done:
    Py_XDECREF(w.out);
    Py_XDECREF(w.refs);
    Py_XDECREF(w.met);
    return result;
}

/* --- restoring: _kept._get ------------------------------------------------------------------- */

typedef struct {
    PyObject *flat;    /* tuple: the records */
    PyObject *refs;    /* tuple: what was kept by reference */
    PyObject *objects; /* list: number -> class or enum member */
    PyObject *how;     /* dict: class -> (code, field names) or None */
} Unwalk;

static PyObject *s_new; /* "__new__", interned */

/* ``flat[*i]`` as a non-negative index below ``limit`` (advancing *i), or -1 (declined). */
static Py_ssize_t
next_index(Unwalk *u, Py_ssize_t *i, Py_ssize_t limit)
{
    if (*i >= PyTuple_GET_SIZE(u->flat))
        return -1;
    PyObject *x = PyTuple_GET_ITEM(u->flat, (*i)++);
    if (!PyLong_CheckExact(x))
        return -1;
    Py_ssize_t n = PyLong_AsSsize_t(x);
    if (n == -1 && PyErr_Occurred())
        PyErr_Clear();
    return (n >= 0 && n < limit) ? n : -1;
}

/* Whether ``object.__setattr__`` may set an attribute of ``cls``'s instances: the check
 * Python makes (its first static base is ``object``); else the Python steps raise its error. */
static int
object_setattr_applies(PyTypeObject *cls)
{
    while (cls != NULL && (cls->tp_flags & Py_TPFLAGS_HEAPTYPE))
        cls = cls->tp_base;
    return cls == &PyBaseObject_Type;
}

static PyObject *get(Unwalk *u, Py_ssize_t *i, int depth);

/* A function made again (``_kept._get``'s ``_FUNC``): a new function of its definition's code
 * and globals, its defaults, keyword defaults, new cells holding what they held, and a copy of
 * its definition's annotations; or NULL: declined (any error cleared). */
static PyObject *
get_function(Unwalk *u, Py_ssize_t *i, int depth)
{
#if PY_VERSION_HEX >= 0x030E0000
    return NULL;
#else
    Py_ssize_t num = next_index(u, i, PyList_GET_SIZE(u->objects));
    if (num < 0)
        return NULL;
    PyObject *d = Py_NewRef(PyList_GET_ITEM(u->objects, num)), *fn = NULL, *cells = NULL;
    PyObject *parts[3] = {NULL, NULL, NULL};
    for (int j = 0; j < 3; j++)
        if ((parts[j] = get(u, i, depth + 1)) == NULL)
            goto done;
    PyObject *defaults = parts[0], *kwdefaults = parts[1], *held = parts[2];
    if (!PyTuple_CheckExact(d) || PyTuple_GET_SIZE(d) != D_SIZE ||
        !PyCode_Check(PyTuple_GET_ITEM(d, D_CODE)) ||
        !PyDict_CheckExact(PyTuple_GET_ITEM(d, D_ANNOTATIONS)) ||
        (defaults != Py_None && !PyTuple_CheckExact(defaults)) ||
        (kwdefaults != Py_None && !PyDict_CheckExact(kwdefaults)) ||
        (held != Py_None && !PyTuple_CheckExact(held)))
        goto done;
    PyCodeObject *code = (PyCodeObject *)PyTuple_GET_ITEM(d, D_CODE);
    if ((held == Py_None ? 0 : PyTuple_GET_SIZE(held)) != code->co_nfreevars)
        goto done;
    if (held != Py_None) {
        if ((cells = PyTuple_New(PyTuple_GET_SIZE(held))) == NULL)
            goto done;
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(held); j++) {
            PyObject *cell = PyCell_New(PyTuple_GET_ITEM(held, j));
            if (cell == NULL)
                goto done;
            PyTuple_SET_ITEM(cells, j, cell);
        }
    }
    fn = PyFunction_New((PyObject *)code, PyTuple_GET_ITEM(d, D_GLOBALS));
    if (fn == NULL || (defaults != Py_None && PyFunction_SetDefaults(fn, defaults) < 0) ||
        (kwdefaults != Py_None && PyFunction_SetKwDefaults(fn, kwdefaults) < 0) ||
        (cells != NULL && PyFunction_SetClosure(fn, cells) < 0)) {
        Py_CLEAR(fn);
        goto done;
    }
    PyObject *annotations = PyTuple_GET_ITEM(d, D_ANNOTATIONS);
    if (PyDict_GET_SIZE(annotations)) {
        PyObject *mine = PyDict_Copy(annotations);
        if (mine == NULL || PyFunction_SetAnnotations(fn, mine) < 0)
            Py_CLEAR(fn);
        Py_XDECREF(mine);
    }
done:
    if (fn == NULL)
        PyErr_Clear();
    Py_XDECREF(cells);
    for (int j = 0; j < 3; j++)
        Py_XDECREF(parts[j]);
    Py_DECREF(d);
    return fn;
#endif
}

/* The value whose record starts at ``flat[*i]`` (a new reference; *i after that record), or
 * NULL: declined (any error cleared: the Python steps raise it). */
static PyObject *
get(Unwalk *u, Py_ssize_t *i, int depth)
{
    Py_ssize_t big = PY_SSIZE_T_MAX;
    Py_ssize_t code = depth > 64 ? -1 : next_index(u, i, K_FUNC + 1);
    if (code < 0 || *i >= PyTuple_GET_SIZE(u->flat))
        return NULL;
    PyObject *arg = PyTuple_GET_ITEM(u->flat, *i);
    switch (code) {
    case K_ATOM:
        (*i)++;
        return Py_NewRef(arg);
    case K_MEMBER:
    case K_REF: {
        PyObject *from = code == K_MEMBER ? u->objects : u->refs;
        Py_ssize_t n = next_index(u, i, PyList_CheckExact(from) ? PyList_GET_SIZE(from)
                                                              : PyTuple_GET_SIZE(from));
        if (n < 0)
            return NULL;
        return Py_NewRef(PyList_CheckExact(from) ? PyList_GET_ITEM(from, n)
                                                 : PyTuple_GET_ITEM(from, n));
    }
    case K_ATOM_LIST:
        if (!PyTuple_CheckExact(arg))
            return NULL;
        (*i)++;
        return PySequence_List(arg);
    case K_ATOM_RUNS: {
        if (!PyTuple_CheckExact(arg) || PyTuple_GET_SIZE(arg) % 2)
            return NULL;
        (*i)++;
        Py_ssize_t total = 0, n = PyTuple_GET_SIZE(arg);
        for (Py_ssize_t j = 1; j < n; j += 2) {
            PyObject *c = PyTuple_GET_ITEM(arg, j);
            Py_ssize_t k = PyLong_CheckExact(c) ? PyLong_AsSsize_t(c) : -1;
            if (k < 0 || k > (1 << 24) || total > (1 << 24)) {
                PyErr_Clear();
                return NULL;
            }
            total += k;
        }
        PyObject *out = PyList_New(total);
        if (out == NULL) {
            PyErr_Clear();
            return NULL;
        }
        for (Py_ssize_t j = 0, at = 0; j < n; j += 2) {
            PyObject *x = PyTuple_GET_ITEM(arg, j);
            for (Py_ssize_t k = PyLong_AsSsize_t(PyTuple_GET_ITEM(arg, j + 1)); k > 0; k--)
                PyList_SET_ITEM(out, at++, Py_NewRef(x));
        }
        return out;
    }
    case K_LIST:
    case K_TUPLE:
    case K_DICT: {
        Py_ssize_t n = next_index(u, i, big);
        if (n < 0 || n > PyTuple_GET_SIZE(u->flat))
            return NULL;
        PyObject *out = code == K_LIST ? PyList_New(n) : code == K_TUPLE ? PyTuple_New(n) : PyDict_New();
        if (out == NULL) {
            PyErr_Clear();
            return NULL;
        }
        for (Py_ssize_t j = 0; j < n; j++) {
            PyObject *k = NULL, *v = NULL;
            if (code == K_DICT && (k = get(u, i, depth + 1)) == NULL)
                goto failed;
            if ((v = get(u, i, depth + 1)) == NULL) {
                Py_XDECREF(k);
                goto failed;
            }
            if (code == K_LIST) {
                PyList_SET_ITEM(out, j, v);
            } else if (code == K_TUPLE) {
                PyTuple_SET_ITEM(out, j, v);
            } else {
                int r = PyDict_SetItem(out, k, v);
                Py_DECREF(k);
                Py_DECREF(v);
                if (r < 0)
                    goto failed;
            }
            continue;
        failed:
            PyErr_Clear();
            Py_DECREF(out);
            return NULL;
        }
        return out;
    }
    case K_FUNC:
        return get_function(u, i, depth);
    default: /* K_DICT_OBJ, K_SLOT_OBJ: an instance of a numbered class */
        break;
    }
    Py_ssize_t num = next_index(u, i, PyList_GET_SIZE(u->objects));
    if (num < 0)
        return NULL;
    PyObject *cls = PyList_GET_ITEM(u->objects, num);
    if (!PyType_Check(cls))
        return NULL;
    PyObject *names = NULL, *state = NULL, *obj = NULL;
    Py_ssize_t n = 0;
    if (code == K_DICT_OBJ) {
        if ((n = next_index(u, i, big)) < 0)
            return NULL;
    } else {
        PyObject *how = PyDict_GetItemWithError(u->how, cls);
        if (how == NULL || !object_setattr_applies((PyTypeObject *)cls)) {
            PyErr_Clear();
            return NULL;
        }
        if (how != Py_None) {
            if (!PyTuple_CheckExact(how) || PyTuple_GET_SIZE(how) != 2 ||
                !PyTuple_CheckExact(PyTuple_GET_ITEM(how, 1)))
                return NULL;
            names = Py_NewRef(PyTuple_GET_ITEM(how, 1));
            n = PyTuple_GET_SIZE(names);
        }
    }
    Py_INCREF(cls);
    PyObject *make = PyObject_GetAttr(cls, s_new); /* cls.__new__(cls), as the Python steps */
    if (make != NULL)
        obj = PyObject_CallOneArg(make, cls);
    Py_XDECREF(make);
    if (obj != NULL && code == K_DICT_OBJ) {
        state = PyObject_GetAttr(obj, s_dict);
        if (state != NULL && !PyDict_CheckExact(state))
            Py_CLEAR(state);
        if (state == NULL)
            Py_CLEAR(obj);
    }
    for (Py_ssize_t j = 0; obj != NULL && j < n; j++) {
        PyObject *k = code == K_DICT_OBJ ? get(u, i, depth + 1) : Py_NewRef(PyTuple_GET_ITEM(names, j));
        PyObject *v = k == NULL ? NULL : get(u, i, depth + 1);
        int r = v == NULL ? -1
                : code == K_DICT_OBJ ? PyDict_SetItem(state, k, v)
                                     : PyObject_GenericSetAttr(obj, k, v);
        Py_XDECREF(k);
        Py_XDECREF(v);
        if (r < 0)
            Py_CLEAR(obj);
    }
    if (obj == NULL)
        PyErr_Clear();
    Py_XDECREF(state);
    Py_XDECREF(names);
    Py_DECREF(cls);
    return obj;
}

/* restore_kept(kept, objects, how) -> ``(updates,)`` restored from a kept form (``_kept.keep``
 * made it: ``(KEPT, None, records...)`` or ``(KEPT, refs, records)``), or None: declined. */
static PyObject *
kept_restore_kept(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyList_CheckExact(args[1]) || !PyDict_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "restore_kept(kept, objects: list, how: dict)");
        return NULL;
    }
    PyObject *kept = args[0];
    if (!PyTuple_CheckExact(kept) || PyTuple_GET_SIZE(kept) < 3)
        Py_RETURN_NONE;
    PyObject *refs = PyTuple_GET_ITEM(kept, 1);
    Unwalk u = {kept, PyTuple_New(0), args[1], args[2]};
    if (u.refs == NULL)
        return NULL;
    if (refs != Py_None) {
        u.flat = PyTuple_GET_ITEM(kept, 2);
        Py_SETREF(u.refs, Py_NewRef(refs));
        if (!PyTuple_CheckExact(u.flat) || !PyTuple_CheckExact(u.refs)) {
            Py_DECREF(u.refs);
            Py_RETURN_NONE;
        }
    }
    Py_INCREF(u.flat);
    Py_ssize_t i = 2;
    PyObject *v = get(&u, &i, 0);
    Py_DECREF(u.flat);
    Py_DECREF(u.refs);
    if (v == NULL)
        Py_RETURN_NONE;
    PyObject *out = PyTuple_Pack(1, v);
    Py_DECREF(v);
    return out;
}

PyMethodDef aioshm_kept_methods[] = {
    {"atom_tuple", kept_atom_tuple, METH_O,
     "atom_tuple(seq) -> tuple(seq), untracked at once if it holds no tracked container"},
    {"atom_runs", kept_atom_runs, METH_O,
     "atom_runs(seq) -> the runs (item, count, ...) of a list of atoms, or None if not shorter"},
    {"restore_kept", (PyCFunction)(void (*)(void))kept_restore_kept, METH_FASTCALL,
     "restore_kept(kept, objects, how) -> (updates,) restored, or None (declined)"},
    {"keep_updates", (PyCFunction)(void (*)(void))kept_keep_updates, METH_FASTCALL,
     "keep_updates(updates, how, numbers, objects, max_depth, marker) -> _kept's kept form of "
     "updates, or None (declined)"},
    {NULL, NULL, 0, NULL},
};

int
aioshm_kept_init(PyObject *module)
{
    if (s_dict == NULL && (s_dict = PyUnicode_InternFromString("__dict__")) == NULL)
        return -1;
    if (s_new == NULL && (s_new = PyUnicode_InternFromString("__new__")) == NULL)
        return -1;
    if (s_locals == NULL && (s_locals = PyUnicode_InternFromString("<locals>")) == NULL)
        return -1;
    return 0;
}
