/* The specs of a sender's request over features: ``split_features`` and ``specs_from``; and
 * the new spec of a reader's one-spec read, ``spec_with``.
 *
 * Their reference is ``aioshmcache/_request.py``: ``SenderRequest.for_features`` (each spec as
 * the sender's ``(item, prompt_updates)`` or ``None``, and its hash) and ``features_from`` (a new
 * ``FeatureSpec`` per result, built as ``FeatureSpec.with_data`` builds one: the frozen
 * dataclass's ``__init__`` bypassed, its four slots set). In Python each costs ~0.3 and
 * ~0.45 us per spec, more than the rest of a plain miss's steps in a request of several; here
 * a few dozen nanoseconds.
 *
 * Both read and write ``FeatureSpec``'s slots at their offsets (``configure_specs`` finds them
 * on the class: writable object slots, else the section stays off) on objects of exactly that
 * class, and decline (``None``, nothing changed) for anything else: a subclass, another
 * sequence than a list or tuple, a hash that is not an exact ``str``, a slot unset, results
 * that are not a list of pairs of the features' length, or updates in them that are not a
 * tuple or a list. The reference then runs and raises its own errors. What the reference
 * computes without a test (``tuple(updates)``, ``isinstance(data, ShmRef)``) is computed by the
 * same C-API call, so an error it raises is the same error, raised at the same spec with
 * nothing else done; that Python code may change the spec, so nothing borrowed from it is used
 * after such a call (``spec_item``, ``spec_hash``). */
#include "_core.h"

static PyTypeObject *spec_type; /* ``FeatureSpec``; NULL: the section is off (every call declines) */
static PyObject *ref_type;      /* ``ShmRef`` */
static Py_ssize_t o_hash, o_data, o_ident, o_updates;
static PyObject *s_mm_hash, *s_prompt_updates; /* their names (the errors of unset slots) */

#define SPEC_SLOT(obj, off) (*(PyObject **)((char *)(obj) + (off)))

/* ``configure_specs(FeatureSpec, ShmRef)``: the classes the section knows. */
static PyObject *
core_configure_specs(PyObject *self, PyObject *args)
{
    PyObject *st, *rt;
    if (!PyArg_ParseTuple(args, "O!O!:configure_specs", &PyType_Type, &st, &PyType_Type, &rt))
        return NULL;
    Py_CLEAR(spec_type);
    Py_CLEAR(ref_type);
    PyTypeObject *t = (PyTypeObject *)st;
    Py_ssize_t h = aioshm_member_offset(t, "mm_hash"), d = aioshm_member_offset(t, "data");
    Py_ssize_t i = aioshm_member_offset(t, "identifier");
    Py_ssize_t u = aioshm_member_offset(t, "prompt_updates");
    if (PyErr_Occurred())
        return NULL;
    if (h < 0 || d < 0 || i < 0 || u < 0 || t->tp_alloc == NULL)
        Py_RETURN_NONE; /* not the slots this file writes: off */
    if ((s_mm_hash == NULL && (s_mm_hash = PyUnicode_InternFromString("mm_hash")) == NULL) ||
        (s_prompt_updates == NULL &&
         (s_prompt_updates = PyUnicode_InternFromString("prompt_updates")) == NULL))
        return NULL;
    o_hash = h, o_data = d, o_ident = i, o_updates = u;
    spec_type = (PyTypeObject *)Py_NewRef(st);
    ref_type = Py_NewRef(rt);
    Py_RETURN_NONE;
}

/* ``u if type(u) is tuple else tuple(u)``: a new reference, or NULL with tuple()'s error. */
static PyObject *
as_tuple(PyObject *u)
{
    return PyTuple_CheckExact(u) ? Py_NewRef(u) : PySequence_Tuple(u);
}

/* ``feature_item(f)`` of a spec of exactly ``FeatureSpec``: 0 with ``*item`` (a new reference:
 * ``(data, prompt_updates)``, or None for a look-up), 1 (declined) or -1 (an error). As in the
 * reference, ``isinstance`` and ``tuple(updates)`` may run Python code (a ``__class__``
 * property, an ``__iter__``) that changes the spec: ``data`` and the updates are held across
 * them, and the updates slot is read after the first, where the reference reads it. */
static int
spec_item(PyObject *f, PyObject **item)
{
    PyObject *h = SPEC_SLOT(f, o_hash), *data = SPEC_SLOT(f, o_data), *u;
    if (h == NULL || !PyUnicode_CheckExact(h) || data == NULL)
        return 1;
    if (data == Py_None) {
        *item = Py_NewRef(Py_None);
        return 0;
    }
    Py_INCREF(data);
    int rc = -1;
    if (!PyDict_CheckExact(data)) { /* a dict is never a ShmRef (a plain class: no hook) */
        int r = PyObject_IsInstance(data, ref_type);
        if (r < 0)
            goto done;
        if (r) {
            *item = Py_NewRef(Py_None);
            rc = 0;
            goto done;
        }
    }
    if ((u = SPEC_SLOT(f, o_updates)) == NULL) {
        Py_XDECREF(PyObject_GetAttr(f, s_prompt_updates)); /* unset: its AttributeError */
        goto done;
    }
    Py_INCREF(u); /* held too: its own ``__iter__`` may replace it in the spec */
    Py_SETREF(u, as_tuple(u));
    if (u == NULL)
        goto done;
    *item = PyTuple_Pack(2, data, u);
    Py_DECREF(u);
    rc = *item == NULL ? -1 : 0;
done:
    Py_DECREF(data);
    return rc;
}

/* ``check_hash(f.mm_hash)`` read after ``spec_item`` (as the reference reads it, after the Python
 * code that may have run there): a new reference to an exact ``str``, or NULL with the error. */
static PyObject *
spec_hash(PyObject *f)
{
    PyObject *h = SPEC_SLOT(f, o_hash);
    if (h != NULL && PyUnicode_CheckExact(h))
        return Py_NewRef(h);
    if ((h = PyObject_GetAttr(f, s_mm_hash)) == NULL) /* unset meanwhile: AttributeError */
        return NULL;
    if (!PyUnicode_Check(h)) {
        PyErr_Format(PyExc_TypeError, "mm_hash must be a str, not %.200s", Py_TYPE(h)->tp_name);
        Py_DECREF(h);
        return NULL;
    }
    Py_SETREF(h, PyUnicode_FromObject(h)); /* a subclass's characters: an exact str */
    return h;
}

/* ``split_features(features)``: ``(specs, items, hashes)`` — a new list of the specs, each
 * one's ``feature_item`` and its hash — or None (declined). */
static PyObject *
core_split_features(PyObject *self, PyObject *features)
{
    if (spec_type == NULL || !(PyList_CheckExact(features) || PyTuple_CheckExact(features)))
        Py_RETURN_NONE;
    PyObject *specs = PySequence_List(features); /* this call's own: nobody else changes it */
    if (specs == NULL)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(specs);
    PyObject *items = PyList_New(n), *hashes = PyList_New(n);
    if (items == NULL || hashes == NULL)
        goto fail;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *f = PyList_GET_ITEM(specs, k), *item, *h;
        if (Py_TYPE(f) != spec_type)
            goto decline;
        int r = spec_item(f, &item);
        if (r < 0)
            goto fail;
        if (r > 0)
            goto decline;
        PyList_SET_ITEM(items, k, item);
        if ((h = spec_hash(f)) == NULL)
            goto fail;
        PyList_SET_ITEM(hashes, k, h);
    }
    PyObject *out = PyTuple_Pack(3, specs, items, hashes);
    Py_DECREF(specs), Py_DECREF(items), Py_DECREF(hashes);
    return out;
decline:
    Py_DECREF(specs), Py_DECREF(items), Py_DECREF(hashes);
    Py_RETURN_NONE;
fail:
    Py_DECREF(specs), Py_XDECREF(items), Py_XDECREF(hashes);
    return NULL;
}

/* ``specs_from``'s specs, of lists checked by it (no Python code runs here). */
static PyObject *
build_specs(PyObject *features, PyObject *results, Py_ssize_t n)
{
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *f = PyList_GET_ITEM(features, k), *r = PyList_GET_ITEM(results, k);
        PyObject *u = as_tuple(PyTuple_GET_ITEM(r, 1));
        if (u == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyObject *new = spec_type->tp_alloc(spec_type, 0);
        if (new == NULL) {
            Py_DECREF(u);
            Py_DECREF(out);
            return NULL;
        }
        SPEC_SLOT(new, o_hash) = Py_NewRef(SPEC_SLOT(f, o_hash));
        SPEC_SLOT(new, o_data) = Py_NewRef(PyTuple_GET_ITEM(r, 0));
        SPEC_SLOT(new, o_ident) = Py_NewRef(SPEC_SLOT(f, o_ident));
        SPEC_SLOT(new, o_updates) = u;
        PyList_SET_ITEM(out, k, new);
    }
    return out;
}

/* ``specs_from(features, results)``: ``features_from``'s new specs, or None (declined). */
static PyObject *
core_specs_from(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "specs_from takes 2 arguments (features, results)");
        return NULL;
    }
    PyObject *features = args[0], *results = args[1];
    if (spec_type == NULL || !PyList_CheckExact(features) || !PyList_CheckExact(results) ||
        PyList_GET_SIZE(features) != PyList_GET_SIZE(results))
        Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(features);
    for (Py_ssize_t k = 0; k < n; k++) { /* every check first: a decline builds nothing */
        PyObject *f = PyList_GET_ITEM(features, k), *r = PyList_GET_ITEM(results, k);
        if (Py_TYPE(f) != spec_type || SPEC_SLOT(f, o_hash) == NULL ||
            SPEC_SLOT(f, o_ident) == NULL || !PyTuple_CheckExact(r) || PyTuple_GET_SIZE(r) != 2)
            Py_RETURN_NONE;
        PyObject *u = PyTuple_GET_ITEM(r, 1);
        if (!PyTuple_CheckExact(u) && !PyList_CheckExact(u))
            Py_RETURN_NONE; /* ``tuple(updates)`` would run Python code amid the borrowed items */
    }
    /* no Python code below (the updates are a tuple or a list; the collector, which could run a
     * finalizer at an allocation, is off): the checked items stay as they were checked */
    int gc_was = PyGC_Disable();
    PyObject *out = build_specs(features, results, n);
    if (gc_was)
        PyGC_Enable();
    return out;
}

/* ``spec_with(spec, data)``: ``spec.with_data(data)`` (its other three slots as they are), or
 * None (declined: not exactly a ``FeatureSpec``, or a slot unset). A reader's one-spec read
 * makes one per call (``_receiver_request.read_one_feature``): ~1k instructions in Python. */
static PyObject *
core_spec_with(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "spec_with takes 2 arguments (spec, data)");
        return NULL;
    }
    PyObject *f = args[0];
    if (spec_type == NULL || Py_TYPE(f) != spec_type || SPEC_SLOT(f, o_hash) == NULL ||
        SPEC_SLOT(f, o_ident) == NULL || SPEC_SLOT(f, o_updates) == NULL)
        Py_RETURN_NONE;
    PyObject *new = spec_type->tp_alloc(spec_type, 0);
    if (new == NULL)
        return NULL;
    SPEC_SLOT(new, o_hash) = Py_NewRef(SPEC_SLOT(f, o_hash));
    SPEC_SLOT(new, o_data) = Py_NewRef(args[1]);
    SPEC_SLOT(new, o_ident) = Py_NewRef(SPEC_SLOT(f, o_ident));
    SPEC_SLOT(new, o_updates) = Py_NewRef(SPEC_SLOT(f, o_updates));
    return new;
}

PyMethodDef aioshm_spec_methods[] = {
    {"configure_specs", core_configure_specs, METH_VARARGS,
     "configure_specs(FeatureSpec, ShmRef): the classes split_features and specs_from know"},
    {"split_features", core_split_features, METH_O,
     "split_features(features) -> (specs, items, hashes) of a sender's request over features, "
     "or None (declined: SenderRequest.for_features splits them)"},
    {"specs_from", (PyCFunction)(void (*)(void))core_specs_from, METH_FASTCALL,
     "specs_from(features, results) -> the new specs of a request's results, or None "
     "(declined: _request.features_from builds them)"},
    {"spec_with", (PyCFunction)(void (*)(void))core_spec_with, METH_FASTCALL,
     "spec_with(spec, data) -> spec.with_data(data), or None (declined: FeatureSpec.with_data "
     "builds it)"},
    {NULL, NULL, 0, NULL},
};
