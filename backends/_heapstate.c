/* backends._heapstate: the heap store's per-record writes, with or without the change log.
 *
 * Why C: a per-record state update on the heap store is a dict write behind a key switch;
 * in Python the call frame around it costs as much as the write. Both the plain heap
 * store and the changelog wrapper use these same writes, so with the log on, the only
 * extra work per record is the record append (issue 4: at most 15% on the per-record
 * path, measured by ``python -m tools.bench run state-ops``).
 *
 * KeyContext
 *     Base type of HeapKeyedStateBackend: current_key, current_key_bytes and
 *     current_key_group as struct members (Python reads and writes them as fast slots;
 *     the states below read them without a lookup). All start as None.
 * HeapValue(backend, table, records=None, op=None, flush=None).update(value)
 * HeapList(...).add(value), .replace(items)
 * HeapMap(...).put(user_key, value)
 *     ``table`` is the state's dict {key_group: {key: entry}}; the entry is the value, a
 *     list of elements, or a dict of map entries. With ``records`` (a
 *     dstl._records.RecordColumns), each write first appends one change record
 *     (``op``, key bytes, key group, user key or None, value) converted by the buffer's
 *     kinds, so a value the buffer refuses changes nothing; when the buffer reports full,
 *     ``flush()`` is called after the write. ``replace(items)`` makes the list ``items``
 *     (a list, stored as it is: pass a fresh one) the current key's list; its record's
 *     value frames every element (dstl._records append_typed_list). The objects are
 *     read-only from Python
 *     (``_backend``, ``_table``) and meant as bases for the Python state classes.
 *
 * Not thread-safe: owned by the backend's task thread.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include "records_capi.h"

static RecordsCAPI *records_api;

/* -- KeyContext ------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyObject *current_key;
    PyObject *current_key_bytes;
    PyObject *current_key_group;
} KeyContext;

static PyObject *
kc_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    KeyContext *self = (KeyContext *)type->tp_alloc(type, 0);
    if (self != NULL) {
        self->current_key = Py_NewRef(Py_None);
        self->current_key_bytes = Py_NewRef(Py_None);
        self->current_key_group = Py_NewRef(Py_None);
    }
    return (PyObject *)self;
}

static int
kc_traverse(PyObject *op, visitproc visit, void *arg)
{
    KeyContext *self = (KeyContext *)op;
    Py_VISIT(self->current_key);
    Py_VISIT(self->current_key_bytes);
    Py_VISIT(self->current_key_group);
    return 0;
}

static int
kc_clear(PyObject *op)
{
    KeyContext *self = (KeyContext *)op;
    Py_CLEAR(self->current_key);
    Py_CLEAR(self->current_key_bytes);
    Py_CLEAR(self->current_key_group);
    return 0;
}

static void
kc_dealloc(PyObject *op)
{
    PyObject_GC_UnTrack(op);
    kc_clear(op);
    Py_TYPE(op)->tp_free(op);
}

/* T_OBJECT_EX: CPython 3.11 specializes attribute access only for those. */
static PyMemberDef kc_members[] = {
    {"current_key", T_OBJECT_EX, offsetof(KeyContext, current_key), 0, "the current key"},
    {"current_key_bytes", T_OBJECT_EX, offsetof(KeyContext, current_key_bytes), 0,
     "the current key's serialized bytes"},
    {"current_key_group", T_OBJECT_EX, offsetof(KeyContext, current_key_group), 0,
     "the current key's key group"},
    {NULL},
};

static PyTypeObject KeyContextType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "backends._heapstate.KeyContext",
    .tp_basicsize = sizeof(KeyContext),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The current key of a keyed backend, readable from C. Task thread only.",
    .tp_new = kc_new,
    .tp_traverse = kc_traverse,
    .tp_clear = kc_clear,
    .tp_dealloc = kc_dealloc,
    .tp_members = kc_members,
};

/* -- the states ------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    KeyContext *backend;
    PyObject *table;
    PyObject *records; /* RecordColumns or NULL: no log */
    PyObject *op;
    PyObject *flush;
} HeapState;

static int
hs_init(PyObject *op, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"backend", "table", "records", "op", "flush", NULL};
    HeapState *self = (HeapState *)op;
    PyObject *backend, *table, *records = Py_None, *opcode = Py_None, *flush = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!|OOO", kwlist, &KeyContextType, &backend,
                                     &PyDict_Type, &table, &records, &opcode, &flush)) {
        return -1;
    }
    if (self->backend != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a heap state is initialized once");
        return -1;
    }
    if (records != Py_None) {
        if (!PyObject_TypeCheck(records, records_api->type)) {
            PyErr_SetString(PyExc_TypeError, "records must be a dstl._records.RecordColumns");
            return -1;
        }
        if (!PyLong_Check(opcode) || !PyCallable_Check(flush)) {
            PyErr_SetString(PyExc_TypeError, "a logged heap state needs an int op and flush()");
            return -1;
        }
        self->records = Py_NewRef(records);
        self->op = Py_NewRef(opcode);
        self->flush = Py_NewRef(flush);
    }
    self->backend = (KeyContext *)Py_NewRef(backend);
    self->table = Py_NewRef(table);
    return 0;
}

static int
hs_traverse(PyObject *op, visitproc visit, void *arg)
{
    HeapState *self = (HeapState *)op;
    Py_VISIT(self->backend);
    Py_VISIT(self->table);
    Py_VISIT(self->records);
    Py_VISIT(self->op);
    Py_VISIT(self->flush);
    return 0;
}

static int
hs_clear(PyObject *op)
{
    HeapState *self = (HeapState *)op;
    Py_CLEAR(self->backend);
    Py_CLEAR(self->table);
    Py_CLEAR(self->records);
    Py_CLEAR(self->op);
    Py_CLEAR(self->flush);
    return 0;
}

static void
hs_dealloc(PyObject *op)
{
    PyObject_GC_UnTrack(op);
    hs_clear(op);
    Py_TYPE(op)->tp_free(op);
}

/* The current key's group, key and bytes, owned for the duration of one call: converting
 * a value may run Python code (__index__, __float__) that switches the key. */
typedef struct {
    PyObject *group;
    PyObject *key;
    PyObject *key_bytes;
} Current;

static int
current_get(HeapState *self, Current *cur)
{
    if (self->backend == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "heap state used before __init__");
        return -1;
    }
    cur->group = Py_NewRef(self->backend->current_key_group);
    cur->key = Py_NewRef(self->backend->current_key);
    cur->key_bytes = Py_NewRef(self->backend->current_key_bytes);
    return 0;
}

static void
current_release(Current *cur)
{
    Py_DECREF(cur->group);
    Py_DECREF(cur->key);
    Py_DECREF(cur->key_bytes);
}

/* Whether the dict write will accept ``obj`` as a key: 0 with an exception set if not.
 * Exact str, bytes and int always hash (the common keys: no call for them). */
static inline int
hashable(PyObject *obj)
{
    if (PyUnicode_CheckExact(obj) || PyBytes_CheckExact(obj) || PyLong_CheckExact(obj)) {
        return 1;
    }
    return PyObject_Hash(obj) != -1;
}

enum Shape { SHAPE_VALUE, SHAPE_LIST, SHAPE_MAP, SHAPE_REPLACE };

/* Log the change (if this state logs): 1 buffer full, 0 not, -1 refused (nothing changed).
 * The dict keys are checked first (hashable), so a key the write would refuse is not logged. */
static int
log_change(HeapState *self, const Current *cur, PyObject *user_key, PyObject *value,
           enum Shape shape)
{
    if (self->records == NULL) {
        return 0;
    }
    if (!hashable(cur->group) || !hashable(cur->key) ||
        (user_key != Py_None && !hashable(user_key))) {
        return -1;
    }
    PyObject *args[5] = {self->op, cur->key_bytes, cur->group, user_key, value};
    return shape == SHAPE_REPLACE ? records_api->append_typed_list(self->records, args)
                                  : records_api->append_typed(self->records, args);
}

/* The key group's dict of keys, created when missing (a new reference). */
static PyObject *
group_dict(HeapState *self, PyObject *group)
{
    PyObject *d = PyDict_GetItemWithError(self->table, group);
    if (d != NULL) {
        return Py_NewRef(d);
    }
    if (PyErr_Occurred()) {
        return NULL;
    }
    d = PyDict_New();
    if (d == NULL || PyDict_SetItem(self->table, group, d) < 0) {
        Py_XDECREF(d);
        return NULL;
    }
    return d;
}

/* Store into the key group's dict ``d``: the value (or the new list), one more list
 * element, or a map entry; a missing list or map is created. 0, or -1 with an exception
 * set. */
static int
store(PyObject *d, PyObject *key, PyObject *user_key, PyObject *value, enum Shape shape)
{
    if (shape == SHAPE_VALUE || shape == SHAPE_REPLACE) {
        return PyDict_SetItem(d, key, value);
    }
    PyObject *entry = PyDict_GetItemWithError(d, key);
    if (entry != NULL) {
        return shape == SHAPE_LIST ? PyList_Append(entry, value)
                                   : PyDict_SetItem(entry, user_key, value);
    }
    if (PyErr_Occurred()) {
        return -1;
    }
    entry = shape == SHAPE_LIST ? PyList_New(0) : PyDict_New();
    if (entry == NULL) {
        return -1;
    }
    int failed = (shape == SHAPE_LIST ? PyList_Append(entry, value)
                                      : PyDict_SetItem(entry, user_key, value)) < 0 ||
                 PyDict_SetItem(d, key, entry) < 0;
    Py_DECREF(entry);
    return failed ? -1 : 0;
}

/* One write of the current key: log it (if this state logs), store it, flush if full. */
static PyObject *
heap_write(HeapState *self, PyObject *user_key, PyObject *value, enum Shape shape)
{
    Current cur;
    if (current_get(self, &cur) < 0) {
        return NULL;
    }
    int full = log_change(self, &cur, user_key, value, shape);
    int failed = full < 0;
    if (!failed) {
        PyObject *d = group_dict(self, cur.group);
        failed = d == NULL || store(d, cur.key, user_key, value, shape) < 0;
        Py_XDECREF(d);
    }
    current_release(&cur);
    if (failed) {
        return NULL;
    }
    if (full) {
        PyObject *r = PyObject_CallNoArgs(self->flush);
        if (r == NULL) {
            return NULL;
        }
        Py_DECREF(r);
    }
    Py_RETURN_NONE;
}

static PyObject *
hv_update(PyObject *op, PyObject *value)
{
    return heap_write((HeapState *)op, Py_None, value, SHAPE_VALUE);
}

static PyObject *
hl_add(PyObject *op, PyObject *value)
{
    return heap_write((HeapState *)op, Py_None, value, SHAPE_LIST);
}

static PyObject *
hl_replace(PyObject *op, PyObject *items)
{
    if (!PyList_CheckExact(items)) {
        PyErr_Format(PyExc_TypeError, "replace: expected a list, got %.100s",
                     Py_TYPE(items)->tp_name);
        return NULL;
    }
    return heap_write((HeapState *)op, Py_None, items, SHAPE_REPLACE);
}

static PyObject *
hm_put(PyObject *op, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "put(user_key, value) takes 2 arguments");
        return NULL;
    }
    return heap_write((HeapState *)op, args[0], args[1], SHAPE_MAP);
}

static PyMemberDef hs_members[] = {
    {"_backend", T_OBJECT, offsetof(HeapState, backend), READONLY, "the backend (KeyContext)"},
    {"_table", T_OBJECT, offsetof(HeapState, table), READONLY, "{key_group: {key: entry}}"},
    {NULL},
};

static PyMethodDef hv_methods[] = {
    {"update", hv_update, METH_O, "update(value): set the current key's value"},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef hl_methods[] = {
    {"add", hl_add, METH_O, "add(value): append to the current key's list"},
    {"replace", hl_replace, METH_O, "replace(items): make the list items the current key's"},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef hm_methods[] = {
    {"put", (PyCFunction)(void (*)(void))hm_put, METH_FASTCALL,
     "put(user_key, value): set an entry of the current key's map"},
    {NULL, NULL, 0, NULL},
};

#define HEAP_STATE_TYPE(cname, pyname, methods, doc)                                      \
    static PyTypeObject cname = {                                                          \
        PyVarObject_HEAD_INIT(NULL, 0).tp_name = "backends._heapstate." pyname,           \
        .tp_basicsize = sizeof(HeapState),                                                 \
        .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,        \
        .tp_doc = doc,                                                                     \
        .tp_new = PyType_GenericNew,                                                       \
        .tp_init = hs_init,                                                                \
        .tp_traverse = hs_traverse,                                                        \
        .tp_clear = hs_clear,                                                              \
        .tp_dealloc = hs_dealloc,                                                          \
        .tp_members = hs_members,                                                          \
        .tp_methods = methods,                                                             \
    }

HEAP_STATE_TYPE(HeapValueType, "HeapValue", hv_methods,
                "The heap store's value-state write (see the module source).");
HEAP_STATE_TYPE(HeapListType, "HeapList", hl_methods,
                "The heap store's list-state add (see the module source).");
HEAP_STATE_TYPE(HeapMapType, "HeapMap", hm_methods,
                "The heap store's map-state put (see the module source).");

static struct PyModuleDef heapstate_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "backends._heapstate",
    .m_doc = "The heap store's per-record writes, with or without the change log.",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__heapstate(void)
{
    records_api = (RecordsCAPI *)PyCapsule_Import(RECORDS_CAPI_NAME, 0);
    if (records_api == NULL) {
        return NULL;
    }
    PyTypeObject *types[] = {&KeyContextType, &HeapValueType, &HeapListType, &HeapMapType};
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
        if (PyType_Ready(types[i]) < 0) {
            return NULL;
        }
    }
    PyObject *m = PyModule_Create(&heapstate_module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "KeyContext", (PyObject *)&KeyContextType) < 0 ||
        PyModule_AddObjectRef(m, "HeapValue", (PyObject *)&HeapValueType) < 0 ||
        PyModule_AddObjectRef(m, "HeapList", (PyObject *)&HeapListType) < 0 ||
        PyModule_AddObjectRef(m, "HeapMap", (PyObject *)&HeapMapType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
