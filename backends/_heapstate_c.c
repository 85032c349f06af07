/* backends._heapstate_c: the heap store's per-record writes, with or without the change log.
 *
 * Why C: a per-record state update on the heap store is a dict write behind a key switch;
 * in Python the call frame around it costs as much as the write. Both the plain heap
 * store and the changelog wrapper use these same writes, so with the log on, the only
 * extra work per record is the record append (issue 4: at most 15% on the per-record
 * path, measured by ``python -m tools.bench run state-ops``).
 * backends/_heapstate_py.py is the same API in Python (the fallback; backends/_heapstate.py
 * picks).
 *
 * KeyContext
 *     Base type of HeapKeyedStateBackend: current_key, current_key_bytes and
 *     current_key_group as struct members (Python reads and writes them as fast slots;
 *     the states below read them without a lookup). All start as None.
 *     set_current_key_raw(key, key_bytes, key_group) sets the three and prefetches the
 *     key's entries of the column stores' indexes (see kc_set_raw).
 * HeapValue(backend, table, records=None, op=None, flush=None).update(value)
 * HeapList(...).add(value), .replace(items)
 * HeapMap(...).put(user_key, value)
 *     ``table`` is the state's dict {key_group: {key: entry}}; the entry is the value, a
 *     list of elements, or a dict of map entries. With ``records`` (a
 *     dstl._records_c.RecordColumns), each write first appends one change record
 *     (``op``, key bytes, key group, user key or None, value) converted by the buffer's
 *     kinds, so a value the buffer refuses changes nothing; when the buffer reports full,
 *     ``flush()`` is called after the write. ``replace(items)`` makes the list ``items``
 *     (a list, stored as it is: pass a fresh one) the current key's list; its record's
 *     value frames every element (dstl._records_c append_typed_list). The objects are
 *     read-only from Python (``_backend``, ``_table``) and meant as bases for the Python
 *     state classes.
 * ColumnStore(backend, kind), ColumnWriter(store, records, op, flush)
 *     A plain int64 / float64 value state kept columnar (see the section below).
 * key_group_for(key_bytes, max_parallelism)
 *     backends.keygroups' hash of a serialized key (see the key groups section).
 * pack(dicts, values, kind), pack_text(dicts, values, kind)
 *     The keys (or values) of the dicts, packed as native int64 ("q") or float64 ("d")
 *     exactly as array.array packs them, or as an Arrow string/binary column's offsets
 *     and data: a heap materialization's key and value columns.
 *
 * Why not Cython (measured for issue 17 with a Cython 3.3 port of the logged value update,
 * alternating processes, ns per update with the key switch): this C 342, the C before the
 * safety fixes 336, Cython 403 (its default code reads CPython internals such as
 * ob_digit), Cython in Limited API mode (public API only) 497, the Python twin 2803.
 *
 * Safe from Python (issue 17): nothing the C code reads is trusted. The key members may be
 * set to anything or deleted (a deleted one is an AttributeError, not a NULL read); a
 * state used before (or without) __init__ raises, and __init__ refuses a second call
 * before changing anything; an entry of the table of the wrong type is a TypeError. Each
 * write holds its own references to everything it uses while Python code can run (hashing
 * and comparing keys, converting values, flush), so that code cannot free them.
 * Public C API only.
 *
 * Not thread-safe: owned by the backend's task thread (key_group_for, a pure function: any
 * thread).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "records_capi.h"
#include <stddef.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#if PY_VERSION_HEX < 0x030C0000 /* 3.12 moved these into Python.h, with a Py_ prefix */
#include <structmember.h>
#define Py_T_OBJECT_EX T_OBJECT_EX
#define Py_READONLY READONLY
#endif

static RecordsCAPI *records_api;

/* -- KeyContext ------------------------------------------------------------------------ */

struct ColumnStore;
#define KC_PREFETCH_MAX 8

typedef struct {
    PyObject_HEAD
    PyObject *current_key;
    PyObject *current_key_bytes;
    PyObject *current_key_group;
    /* The column stores whose key index set_current_key_raw prefetches (kc_prefetch).
     * Borrowed: a store registers itself in cs_init and unregisters before it lets go of
     * its backend (cs_clear_refs), and it holds a reference to the backend until then, so
     * every pointer here is a live store. The first KC_PREFETCH_MAX stores only. */
    struct ColumnStore *prefetch[KC_PREFETCH_MAX];
    int nprefetch;
    int fanout; /* set by a key switch, cleared by the first lookup: see cs_fanout */
} KeyContext;

static void kc_prefetch(KeyContext *self, PyObject *key);

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

/* set_current_key_raw(key, key_bytes, key_group): set the three members, then start
 * loading the key's index entry of every registered column store (kc_prefetch). At 1M
 * keys a state's lookup misses the caches twice in a row (the index, then the value); the
 * prefetch overlaps the first miss with the Python code between the key switch and the
 * state's first get. */
static PyObject *
kc_set_raw(PyObject *op, PyObject *const *args, Py_ssize_t nargs)
{
    KeyContext *self = (KeyContext *)op;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError,
                     "set_current_key_raw takes 3 arguments (key, key_bytes, key_group), "
                     "%zd given", nargs);
        return NULL;
    }
    Py_XSETREF(self->current_key, Py_NewRef(args[0]));
    Py_XSETREF(self->current_key_bytes, Py_NewRef(args[1]));
    Py_XSETREF(self->current_key_group, Py_NewRef(args[2]));
    kc_prefetch(self, args[0]);
    Py_RETURN_NONE;
}

static PyMethodDef kc_methods[] = {
    {"set_current_key_raw", (PyCFunction)(void (*)(void))kc_set_raw, METH_FASTCALL,
     "set_current_key_raw(key, key_bytes, key_group): make key current, its bytes and "
     "group already known"},
    {NULL, NULL, 0, NULL},
};

/* Py_T_OBJECT_EX: CPython 3.11 specializes attribute access only for those. Python may
 * set them to anything or delete them (NULL): the states check (current_get). */
static PyMemberDef kc_members[] = {
    {"current_key", Py_T_OBJECT_EX, offsetof(KeyContext, current_key), 0, "the current key"},
    {"current_key_bytes", Py_T_OBJECT_EX, offsetof(KeyContext, current_key_bytes), 0,
     "the current key's serialized bytes"},
    {"current_key_group", Py_T_OBJECT_EX, offsetof(KeyContext, current_key_group), 0,
     "the current key's key group"},
    {NULL},
};

static PyTypeObject KeyContextType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "backends._heapstate_c.KeyContext",
    .tp_basicsize = sizeof(KeyContext),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The current key of a keyed backend, readable from C. Task thread only.",
    .tp_new = kc_new,
    .tp_traverse = kc_traverse,
    .tp_clear = kc_clear,
    .tp_dealloc = kc_dealloc,
    .tp_members = kc_members,
    .tp_methods = kc_methods,
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

static void
current_release(Current *cur)
{
    Py_XDECREF(cur->group);
    Py_XDECREF(cur->key);
    Py_XDECREF(cur->key_bytes);
}

/* A member Python deleted is NULL: AttributeError, as reading it from Python gives. */
static PyObject *
member(PyObject *value, const char *name)
{
    if (value == NULL) {
        PyErr_Format(PyExc_AttributeError, "the backend has no %s (it was deleted)", name);
        return NULL;
    }
    return Py_NewRef(value);
}

static int
current_get(HeapState *self, Current *cur)
{
    KeyContext *b = self->backend;
    if (b == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "heap state used before __init__");
        return -1;
    }
    *cur = (Current){NULL, NULL, NULL};
    if ((cur->group = member(b->current_key_group, "current_key_group")) == NULL ||
        (cur->key = member(b->current_key, "current_key")) == NULL ||
        (cur->key_bytes = member(b->current_key_bytes, "current_key_bytes")) == NULL) {
        current_release(cur);
        return -1;
    }
    return 0;
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

/* What one write uses, each owned for the call: hashing, comparing and converting the
 * parts runs Python code (__hash__, __eq__, __index__), which must not be able to free
 * anything the write still reads. */
typedef struct {
    Current cur;
    PyObject *table;
    PyObject *records; /* NULL: no log */
    PyObject *op;
    PyObject *flush;
} Write;

static int
write_begin(HeapState *self, Write *w)
{
    if (current_get(self, &w->cur) < 0) {
        return -1;
    }
    /* set together with backend in hs_init */
    w->table = Py_NewRef(self->table);
    w->records = Py_XNewRef(self->records);
    w->op = Py_XNewRef(self->op);
    w->flush = Py_XNewRef(self->flush);
    return 0;
}

static void
write_end(Write *w)
{
    current_release(&w->cur);
    Py_DECREF(w->table);
    Py_XDECREF(w->records);
    Py_XDECREF(w->op);
    Py_XDECREF(w->flush);
}

/* Log the change (if this state logs): 1 buffer full, 0 not, -1 refused (nothing changed).
 * The dict keys are checked first (hashable), so a key the write would refuse is not logged. */
static int
log_change(const Write *w, PyObject *user_key, PyObject *value, enum Shape shape)
{
    if (w->records == NULL) {
        return 0;
    }
    if (!hashable(w->cur.group) || !hashable(w->cur.key) ||
        (user_key != Py_None && !hashable(user_key))) {
        return -1;
    }
    PyObject *args[5] = {w->op, w->cur.key_bytes, w->cur.group, user_key, value};
    return shape == SHAPE_REPLACE ? records_api->append_typed_list(w->records, args)
                                  : records_api->append_typed(w->records, args);
}

/* ``obj`` (a new reference, or NULL) if it is a ``want`` (dict or list); else NULL and a
 * TypeError: the table is readable from Python, so anything may have been put in it. */
static PyObject *
checked(PyObject *obj, int want_list, const char *what)
{
    if (obj == NULL || (want_list ? PyList_Check(obj) : PyDict_Check(obj))) {
        return obj;
    }
    PyErr_Format(PyExc_TypeError, "heap state: %s is a %.100s, not a %s", what,
                 Py_TYPE(obj)->tp_name, want_list ? "list" : "dict");
    Py_DECREF(obj);
    return NULL;
}

/* The key group's dict of keys, created when missing (a new reference). */
static PyObject *
group_dict(PyObject *table, PyObject *group)
{
    PyObject *d = PyDict_GetItemWithError(table, group);
    if (d != NULL) {
        return checked(Py_NewRef(d), 0, "a key group's entry");
    }
    if (PyErr_Occurred()) {
        return NULL;
    }
    d = PyDict_New();
    if (d == NULL || PyDict_SetItem(table, group, d) < 0) {
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
    int is_list = shape == SHAPE_LIST;
    PyObject *entry = PyDict_GetItemWithError(d, key);
    if (entry != NULL) {
        /* Owned: the map's PyDict_SetItem calls user_key's __hash__ and __eq__, which
         * may delete this entry from ``d`` (the last reference but ours). */
        entry = checked(Py_NewRef(entry), is_list, is_list ? "a list state's value"
                                                           : "a map state's value");
        if (entry == NULL) {
            return -1;
        }
        int r = is_list ? PyList_Append(entry, value) : PyDict_SetItem(entry, user_key, value);
        Py_DECREF(entry);
        return r;
    }
    if (PyErr_Occurred()) {
        return -1;
    }
    entry = is_list ? PyList_New(0) : PyDict_New();
    if (entry == NULL) {
        return -1;
    }
    int failed = (is_list ? PyList_Append(entry, value)
                          : PyDict_SetItem(entry, user_key, value)) < 0 ||
                 PyDict_SetItem(d, key, entry) < 0;
    Py_DECREF(entry);
    return failed ? -1 : 0;
}

/* One write of the current key: log it (if this state logs), store it, flush if full. */
static PyObject *
heap_write(HeapState *self, PyObject *user_key, PyObject *value, enum Shape shape)
{
    Write w;
    if (write_begin(self, &w) < 0) {
        return NULL;
    }
    int full = log_change(&w, user_key, value, shape);
    int failed = full < 0;
    if (!failed) {
        PyObject *d = group_dict(w.table, w.cur.group);
        failed = d == NULL || store(d, w.cur.key, user_key, value, shape) < 0;
        Py_XDECREF(d);
    }
    if (!failed && full) {
        PyObject *r = PyObject_CallNoArgs(w.flush);
        failed = r == NULL;
        Py_XDECREF(r);
    }
    write_end(&w);
    if (failed) {
        return NULL;
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
    {"_backend", Py_T_OBJECT_EX, offsetof(HeapState, backend), Py_READONLY,
     "the backend (KeyContext)"},
    {"_table", Py_T_OBJECT_EX, offsetof(HeapState, table), Py_READONLY,
     "{key_group: {key: entry}}"},
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
        PyVarObject_HEAD_INIT(NULL, 0).tp_name = "backends._heapstate_c." pyname,           \
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

/* -- columnar value states ------------------------------------------------------------- */

/* ColumnStore(backend, kind): the entries of one value state whose values are fixed-width
 * (kind "q": int64, "d": float64), stored columnar: ``slots`` maps a key to its slot
 * (changed only when a key is added or cleared), the values sit in one C array. An
 * update writes 8 bytes of that array and no Python object: after a fork the task thread
 * moves that array to fresh memory (unshare) and no other page of the store is written,
 * and a snapshot copies the array (memcpy) instead of walking scattered objects. A
 * cleared key's slot is reused by the next new key (``deletes`` counts the clears, so a
 * snapshot knows when keys moved).
 *
 * get(default), update(value), clear(): the current key's (backend's KeyContext) value.
 * export(since_used, since_deletes): (used, deletes, live, kgs, vals, keys, full, ikeys):
 * the key groups (int32, -1 for a free slot) and values (8 bytes each) of slots
 * [0, used) as bytes, the keys of slots [since_used, used) (all of them, full true, if a
 * key was cleared or a free slot reused since ``since_deletes``), and, while every key is
 * an int64, the keys of slots [0, used) as int64 bytes (else None).
 * views(): (used, live, kgs, vals, ikeys): export's columns as read-only memoryviews of
 * the store's own arrays, no copy (see cs_views).
 * load(kg, keys, values): bulk set (restore). entries(): (kgs, keys, values) lists of the
 * live slots in slot order. len(): live keys. unshare(): see cs_unshare.
 * ColumnWriter(store, records, op, flush).update(value): the write that first appends a
 * change record (as HeapValue's). Task thread only. */

/* One entry of the int64 key index: a key and its slot side by side, so one prefetch
 * (kc_prefetch) brings a probe's whole entry. Two arrays, keys and slots, were no slower
 * without the prefetch (their two loads went out together), but needed two. At 1M keys
 * every lookup misses the caches: ~340 ns a get without the prefetch, ~30 ns at 10k keys. */
typedef struct {
    int64_t key;
    Py_ssize_t slot; /* -1: empty */
} HtEntry;

typedef struct ColumnStore {
    PyObject_HEAD
    KeyContext *backend;
    PyObject *slots; /* dict: key -> slot; NULL while every key is an exact int64 */
    HtEntry *ht;     /* ... and then this open-addressing index holds them instead */
    Py_ssize_t hcap; /* a power of two, or 0 */
    PyObject *keys;  /* list: slot -> key (None: free); see keys_tracked */
    int keys_tracked; /* ``keys`` is tracked by the cyclic GC (see cs_keep_key) */
    int32_t *kgs;
    int64_t *vals;  /* PyMem memory, or a mapping of its own (vals_mapped bytes): unshare */
    size_t vals_mapped;
    int64_t *ikeys; /* slot -> key, while ``slots`` is NULL (every key an int64) */
    Py_ssize_t used, cap, live;
    Py_ssize_t *free_slots;
    Py_ssize_t nfree, free_cap;
    unsigned long long deletes; /* clears and reuses of a free slot */
    Py_ssize_t views; /* ColumnViews alive (views()): the arrays must not move */
    int as_float;
} ColumnStore;

static PyTypeObject ColumnStoreType;

static int
cs_init(PyObject *op, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"backend", "kind", NULL};
    ColumnStore *self = (ColumnStore *)op;
    PyObject *backend;
    const char *kind;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!s", kwlist, &KeyContextType, &backend,
                                     &kind)) {
        return -1;
    }
    if (self->backend != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a column store is initialized once");
        return -1;
    }
    if (strcmp(kind, "q") != 0 && strcmp(kind, "d") != 0) {
        PyErr_SetString(PyExc_ValueError, "ColumnStore: kind must be 'q' or 'd'");
        return -1;
    }
    self->keys = PyList_New(0);
    if (self->keys == NULL) {
        return -1;
    }
    PyObject_GC_UnTrack(self->keys); /* until a key needs it: cs_keep_key */
    self->as_float = kind[0] == 'd';
    self->backend = (KeyContext *)Py_NewRef(backend);
    if (self->backend->nprefetch < KC_PREFETCH_MAX) {
        self->backend->prefetch[self->backend->nprefetch++] = self;
    }
    return 0;
}

/* Drop ``s`` from its backend's prefetch list (before the store lets the backend go). */
static void
cs_unregister(ColumnStore *s)
{
    KeyContext *b = s->backend;
    if (b == NULL) {
        return;
    }
    for (int i = 0; i < b->nprefetch; i++) {
        if (b->prefetch[i] == s) {
            b->prefetch[i] = b->prefetch[--b->nprefetch];
            b->prefetch[b->nprefetch] = NULL;
            return;
        }
    }
}

static int
cs_traverse(PyObject *op, visitproc visit, void *arg)
{
    ColumnStore *self = (ColumnStore *)op;
    Py_VISIT(self->backend);
    Py_VISIT(self->slots);
    Py_VISIT(self->keys);
    return 0;
}

static int
cs_clear_refs(PyObject *op)
{
    ColumnStore *self = (ColumnStore *)op;
    cs_unregister(self);
    Py_CLEAR(self->backend);
    Py_CLEAR(self->slots);
    Py_CLEAR(self->keys);
    return 0;
}

/* Free a value array: its own mapping if ``mapped`` (bytes), else PyMem memory. */
static void
cs_vals_free(int64_t *vals, size_t mapped)
{
    if (mapped) {
        munmap(vals, mapped);
    }
    else {
        PyMem_Free(vals);
    }
}

static void
cs_dealloc(PyObject *op)
{
    ColumnStore *self = (ColumnStore *)op;
    PyObject_GC_UnTrack(op);
    cs_clear_refs(op);
    PyMem_Free(self->kgs);
    cs_vals_free(self->vals, self->vals_mapped);
    PyMem_Free(self->ikeys);
    PyMem_Free(self->free_slots);
    PyMem_Free(self->ht);
    Py_TYPE(op)->tp_free(op);
}

static int
cs_ready(ColumnStore *s)
{
    if (s->backend == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "column store used before __init__");
        return -1;
    }
    return 0;
}

/* ``value`` as the 8 bytes stored (refusals as array.array's "q"/"d"). */
static int
cs_convert(ColumnStore *s, PyObject *value, int64_t *out)
{
    if (s->as_float) {
        double d = PyFloat_AsDouble(value);
        if (d == -1.0 && PyErr_Occurred()) {
            return -1;
        }
        memcpy(out, &d, sizeof d);
        return 0;
    }
    if (PyFloat_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "an int64 state's value must be an integer");
        return -1;
    }
    long long v = PyLong_AsLongLong(value);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    *out = (int64_t)v;
    return 0;
}

static PyObject *
cs_box(ColumnStore *s, Py_ssize_t i)
{
    if (s->as_float) {
        double d;
        memcpy(&d, &s->vals[i], sizeof d);
        return PyFloat_FromDouble(d);
    }
    return PyLong_FromLongLong(s->vals[i]);
}

static int
cs_grow(ColumnStore *s)
{
    if (s->used < s->cap) {
        return 0;
    }
    if (s->views > 0) { /* a bytearray's rule: no resize while its memory is exported */
        PyErr_SetString(PyExc_BufferError, "a column store cannot grow while it is viewed");
        return -1;
    }
    Py_ssize_t cap = s->cap ? s->cap * 2 : 1024;
    int32_t *kgs = PyMem_Realloc(s->kgs, (size_t)cap * sizeof *kgs);
    if (kgs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    s->kgs = kgs;
    int64_t *vals;
    if (s->vals_mapped) { /* back to PyMem: the next fork moves it again */
        vals = PyMem_Malloc((size_t)cap * sizeof *vals);
        if (vals != NULL) {
            memcpy(vals, s->vals, (size_t)s->used * sizeof *vals);
            cs_vals_free(s->vals, s->vals_mapped);
            s->vals_mapped = 0;
        }
    }
    else {
        vals = PyMem_Realloc(s->vals, (size_t)cap * sizeof *vals);
    }
    if (vals == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    s->vals = vals;
    int64_t *ikeys = PyMem_Realloc(s->ikeys, (size_t)cap * sizeof *ikeys);
    if (ikeys == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    s->ikeys = ikeys;
    s->cap = cap;
    return 0;
}

/* The slot of ``key`` (added in key group ``group`` if new), or -1 with an exception. */
static Py_ssize_t cs_lookup(ColumnStore *s, PyObject *key);
static inline int cs_int_key(PyObject *key, int64_t *out);
static int cs_index_add(ColumnStore *s, PyObject *key, Py_ssize_t i);
static int cs_index_del(ColumnStore *s, PyObject *key);

/* The key list stays out of the cyclic GC while no key in it is tracked by the GC, as
 * CPython keeps a dict or tuple of atomic objects out (exact int and str keys are never
 * tracked, and a hashable object untracked once is never tracked again). A full
 * collection walks every tracked container, and the list of 1M int keys cost 8-15 ms
 * of a gen-2 pass per state, the GIL held, all threads stopped (issue 16). The first key
 * the GC tracks (a tuple of objects, an instance) puts the list back in the GC, for
 * good, so cycles through keys are still collected. Untracked, the list is walked by no
 * collection: its objects count as referenced from outside, which is safe. */
static void
cs_keep_key(ColumnStore *s, PyObject *key)
{
    if (!s->keys_tracked && PyObject_GC_IsTracked(key)) {
        PyObject_GC_Track(s->keys);
        s->keys_tracked = 1;
    }
}

static Py_ssize_t
cs_slot(ColumnStore *s, PyObject *key, PyObject *group)
{
    Py_ssize_t found = cs_lookup(s, key);
    if (found != -1) {
        return found < 0 ? -1 : found;
    }
    long kg = PyLong_AsLong(group);
    if (kg == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (kg < 0 || kg > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "key group %ld out of range", kg);
        return -1;
    }
    int reuse = s->nfree > 0;
    if (!reuse && cs_grow(s) < 0) {
        return -1;
    }
    Py_ssize_t i = reuse ? s->free_slots[s->nfree - 1] : s->used;
    if (cs_index_add(s, key, i) < 0) {
        return -1;
    }
    cs_keep_key(s, key);
    if (reuse) {
        if (PyList_SetItem(s->keys, i, Py_NewRef(key)) < 0) {
            return -1;
        }
        s->nfree--;
        s->deletes++; /* a key below ``used`` changed: the next export hands out all */
    }
    else {
        if (PyList_Append(s->keys, key) < 0) {
            cs_index_del(s, key);
            return -1;
        }
        s->used++;
    }
    s->kgs[i] = (int32_t)kg;
    int64_t k;
    if (s->slots == NULL && cs_int_key(key, &k)) {
        s->ikeys[i] = k;
    }
    s->live++;
    return i;
}

/* The key index. While every key is an exact int that fits int64 it is an open-addressing
 * table of int64 keys (linear probing, at most half full): a lookup reads only that table,
 * and writes nothing. (A dict lookup of an int key that is equal but not identical to the
 * stored one takes a reference to the stored key during the comparison: a write to a
 * random page per record, which after a fork is a copy-on-write fault.) The first other
 * key (a str, a float, a bool, a big int) moves every key into the dict ``slots``. */

static inline uint64_t
cs_hash(int64_t k)
{
    uint64_t z = (uint64_t)k + 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* The int64 of an exact int key; 0 if ``key`` is not one (no exception). */
static inline int
cs_int_key(PyObject *key, int64_t *out)
{
    if (!PyLong_CheckExact(key)) {
        return 0;
    }
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(key, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    *out = (int64_t)v;
    return 1;
}

static Py_ssize_t
ht_find(ColumnStore *s, int64_t k)
{
    if (s->hcap == 0) {
        return -1;
    }
    size_t mask = (size_t)s->hcap - 1, j = (size_t)cs_hash(k) & mask;
    while (s->ht[j].slot >= 0) {
        if (s->ht[j].key == k) {
            return s->ht[j].slot;
        }
        j = (j + 1) & mask;
    }
    return -1;
}

static void
kc_prefetch(KeyContext *self, PyObject *key)
{
    if (self->nprefetch == 0) {
        return;
    }
    int64_t k;
    if (!cs_int_key(key, &k)) {
        return;
    }
    uint64_t h = cs_hash(k);
    self->fanout = 1;
    for (int i = 0; i < self->nprefetch; i++) {
        ColumnStore *s = self->prefetch[i];
        if (s->slots == NULL && s->hcap > 0) {
            __builtin_prefetch(&s->ht[h & ((uint64_t)s->hcap - 1)]);
        }
    }
}

/* The first lookup after a key switch: the index entries kc_prefetch asked for have had
 * the Python code in between to arrive, so the other registered stores find the key's
 * slot without waiting, and the loads of their values start now; their own gets (a
 * count and a sum: the next line of the function) then find them in the cache. Reads
 * only. */
static void
cs_fanout(ColumnStore *s, int64_t k)
{
    KeyContext *b = s->backend;
    b->fanout = 0;
    for (int i = 0; i < b->nprefetch; i++) {
        ColumnStore *o = b->prefetch[i];
        if (o != s && o->slots == NULL) {
            Py_ssize_t j = ht_find(o, k);
            if (j >= 0) {
                __builtin_prefetch(&o->vals[j]);
            }
        }
    }
}

static void
ht_put(HtEntry *ht, Py_ssize_t hcap, int64_t k, Py_ssize_t slot)
{
    size_t mask = (size_t)hcap - 1, j = (size_t)cs_hash(k) & mask;
    while (ht[j].slot >= 0) {
        j = (j + 1) & mask;
    }
    ht[j].key = k;
    ht[j].slot = slot;
}

static int
ht_resize(ColumnStore *s, Py_ssize_t cap)
{
    HtEntry *ht = PyMem_Malloc((size_t)cap * sizeof *ht);
    if (ht == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t j = 0; j < cap; j++) {
        ht[j].slot = -1;
    }
    for (Py_ssize_t j = 0; j < s->hcap; j++) {
        if (s->ht[j].slot >= 0) {
            ht_put(ht, cap, s->ht[j].key, s->ht[j].slot);
        }
    }
    PyMem_Free(s->ht);
    s->ht = ht;
    s->hcap = cap;
    return 0;
}

static void
ht_del(ColumnStore *s, int64_t k)
{
    size_t mask = (size_t)s->hcap - 1, j = (size_t)cs_hash(k) & mask;
    while (s->ht[j].slot >= 0 && s->ht[j].key != k) {
        j = (j + 1) & mask;
    }
    if (s->ht[j].slot < 0) {
        return;
    }
    /* backward-shift deletion: no tombstones */
    size_t hole = j;
    for (size_t i = (j + 1) & mask; s->ht[i].slot >= 0; i = (i + 1) & mask) {
        size_t home = (size_t)cs_hash(s->ht[i].key) & mask;
        if (((i - home) & mask) >= ((i - hole) & mask)) {
            s->ht[hole] = s->ht[i];
            hole = i;
        }
    }
    s->ht[hole].slot = -1;
}

/* Move every key into the dict (the first key the int64 index cannot hold). */
static int
cs_to_dict(ColumnStore *s)
{
    PyObject *slots = PyDict_New();
    if (slots == NULL) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < s->used; i++) {
        PyObject *key = PyList_GET_ITEM(s->keys, i);
        if (s->kgs[i] < 0) {
            continue;
        }
        PyObject *slot = PyLong_FromSsize_t(i);
        if (slot == NULL || PyDict_SetItem(slots, key, slot) < 0) {
            Py_XDECREF(slot);
            Py_DECREF(slots);
            return -1;
        }
        Py_DECREF(slot);
    }
    s->slots = slots;
    PyMem_Free(s->ht);
    s->ht = NULL;
    s->hcap = 0;
    return 0;
}

/* The slot of ``key``: >= 0, -1 if absent, -2 with an exception set. */
static Py_ssize_t
cs_lookup(ColumnStore *s, PyObject *key)
{
    if (s->slots == NULL) {
        int64_t k;
        if (cs_int_key(key, &k)) {
            if (s->backend->fanout) {
                cs_fanout(s, k);
            }
            return ht_find(s, k);
        }
        if (s->live == 0) {
            return -1; /* nothing to compare with: stay on the int index for now */
        }
        if (cs_to_dict(s) < 0) {
            return -2;
        }
    }
    PyObject *found = PyDict_GetItemWithError(s->slots, key);
    if (found != NULL) {
        return PyLong_AsSsize_t(found);
    }
    return PyErr_Occurred() ? -2 : -1;
}

static int
cs_index_add(ColumnStore *s, PyObject *key, Py_ssize_t i)
{
    if (s->slots == NULL) {
        int64_t k;
        if (cs_int_key(key, &k)) {
            if ((s->live + 1) * 2 > s->hcap && ht_resize(s, s->hcap ? s->hcap * 2 : 1024) < 0) {
                return -1;
            }
            ht_put(s->ht, s->hcap, k, i);
            return 0;
        }
        if (cs_to_dict(s) < 0) {
            return -1;
        }
    }
    PyObject *slot = PyLong_FromSsize_t(i);
    if (slot == NULL) {
        return -1;
    }
    int r = PyDict_SetItem(s->slots, key, slot);
    Py_DECREF(slot);
    return r;
}

static int
cs_index_del(ColumnStore *s, PyObject *key)
{
    if (s->slots == NULL) {
        int64_t k;
        if (cs_int_key(key, &k)) {
            ht_del(s, k);
        }
        return 0;
    }
    return PyDict_DelItem(s->slots, key);
}

static PyObject *
cs_get(PyObject *op, PyObject *dflt)
{
    ColumnStore *s = (ColumnStore *)op;
    if (cs_ready(s) < 0) {
        return NULL;
    }
    PyObject *key = member(s->backend->current_key, "current_key");
    if (key == NULL) {
        return NULL;
    }
    Py_ssize_t i = cs_lookup(s, key);
    Py_DECREF(key);
    if (i < 0) {
        return i == -1 ? Py_NewRef(dflt) : NULL;
    }
    return cs_box(s, i);
}

/* Set the current key's value; with ``records``, log it first (see HeapValue). */
static PyObject *
cs_write(ColumnStore *s, PyObject *records, PyObject *opcode, PyObject *flush, PyObject *value)
{
    if (cs_ready(s) < 0) {
        return NULL;
    }
    Current cur = {NULL, NULL, NULL};
    KeyContext *b = s->backend;
    if ((cur.group = member(b->current_key_group, "current_key_group")) == NULL ||
        (cur.key = member(b->current_key, "current_key")) == NULL ||
        (cur.key_bytes = member(b->current_key_bytes, "current_key_bytes")) == NULL) {
        current_release(&cur);
        return NULL;
    }
    Py_INCREF(s);
    Py_INCREF(value);
    PyObject *result = NULL;
    int64_t bits;
    int full = 0;
    if (cs_convert(s, value, &bits) < 0) {
        goto done;
    }
    if (records != NULL) {
        if (!hashable(cur.group) || !hashable(cur.key)) {
            goto done;
        }
        PyObject *args[5] = {opcode, cur.key_bytes, cur.group, Py_None, value};
        full = records_api->append_typed(records, args);
        if (full < 0) {
            goto done;
        }
    }
    Py_ssize_t i = cs_slot(s, cur.key, cur.group);
    if (i < 0) {
        goto done;
    }
    s->vals[i] = bits;
    if (full) {
        PyObject *r = PyObject_CallNoArgs(flush);
        if (r == NULL) {
            goto done;
        }
        Py_DECREF(r);
    }
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(value);
    Py_DECREF(s);
    current_release(&cur);
    return result;
}

static PyObject *
cs_update(PyObject *op, PyObject *value)
{
    return cs_write((ColumnStore *)op, NULL, NULL, NULL, value);
}

static PyObject *
cs_clear(PyObject *op, PyObject *unused)
{
    ColumnStore *s = (ColumnStore *)op;
    if (cs_ready(s) < 0) {
        return NULL;
    }
    PyObject *key = member(s->backend->current_key, "current_key");
    if (key == NULL) {
        return NULL;
    }
    Py_ssize_t i = cs_lookup(s, key);
    if (i < 0) {
        Py_DECREF(key);
        if (i == -2) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    if (s->nfree == s->free_cap) {
        Py_ssize_t cap = s->free_cap ? s->free_cap * 2 : 256;
        Py_ssize_t *fs = PyMem_Realloc(s->free_slots, (size_t)cap * sizeof *fs);
        if (fs == NULL) {
            Py_DECREF(key);
            return PyErr_NoMemory();
        }
        s->free_slots = fs;
        s->free_cap = cap;
    }
    int r = cs_index_del(s, key);
    Py_DECREF(key);
    if (r < 0 || PyList_SetItem(s->keys, i, Py_NewRef(Py_None)) < 0) {
        return NULL;
    }
    s->kgs[i] = -1;
    s->free_slots[s->nfree++] = i;
    s->live--;
    s->deletes++;
    Py_RETURN_NONE;
}

static PyObject *
cs_export(PyObject *op, PyObject *const *args, Py_ssize_t nargs)
{
    ColumnStore *s = (ColumnStore *)op;
    if (cs_ready(s) < 0) {
        return NULL;
    }
    Py_ssize_t since_used;
    unsigned long long since_deletes;
    if (nargs != 2 || (since_used = PyLong_AsSsize_t(args[0])) == -1 ||
        ((since_deletes = PyLong_AsUnsignedLongLong(args[1])) == (unsigned long long)-1 &&
         PyErr_Occurred())) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "export(since_used, since_deletes)");
        }
        return NULL;
    }
    int full = since_deletes != s->deletes || since_used > s->used || since_used < 0;
    PyObject *keys = PyList_GetSlice(s->keys, full ? 0 : since_used, s->used);
    PyObject *kgs = PyBytes_FromStringAndSize((const char *)s->kgs, s->used * 4);
    PyObject *vals = PyBytes_FromStringAndSize((const char *)s->vals, s->used * 8);
    PyObject *ikeys = s->slots == NULL
                          ? PyBytes_FromStringAndSize((const char *)s->ikeys, s->used * 8)
                          : Py_NewRef(Py_None);
    PyObject *r = NULL;
    if (keys != NULL && kgs != NULL && vals != NULL && ikeys != NULL) {
        r = Py_BuildValue("nKnOOOOO", s->used, s->deletes, s->live, kgs, vals, keys,
                          full ? Py_True : Py_False, ikeys);
    }
    Py_XDECREF(ikeys);
    Py_XDECREF(keys);
    Py_XDECREF(kgs);
    Py_XDECREF(vals);
    return r;
}

/* A read-only view of one array of a ColumnStore (views()): the buffer protocol over the
 * store's own memory. It holds the store, and while any is alive the store refuses what
 * would move or free its arrays (growth: BufferError; unshare: False), as a bytearray
 * refuses to resize while exported. So a view never dangles; it sees later writes in
 * place (a clear, a new key in a free slot), which is why views() is for a process
 * where the store changes no more: a forked snapshot child. Not creatable from Python. */
typedef struct {
    PyObject_HEAD
    ColumnStore *store;
    char *buf;
    Py_ssize_t len;
} ColumnView;

static int
cv_getbuffer(PyObject *op, Py_buffer *view, int flags)
{
    ColumnView *v = (ColumnView *)op;
    return PyBuffer_FillInfo(view, op, v->buf, v->len, 1, flags); /* refuses WRITABLE */
}

static int
cv_traverse(PyObject *op, visitproc visit, void *arg)
{
    Py_VISIT(((ColumnView *)op)->store); /* a cycle back through a key is collectable */
    return 0;
}

static void
cv_dealloc(PyObject *op)
{
    ColumnView *v = (ColumnView *)op;
    PyObject_GC_UnTrack(op);
    v->store->views--;
    Py_DECREF(v->store);
    PyObject_GC_Del(op);
}

static PyBufferProcs cv_as_buffer = {.bf_getbuffer = cv_getbuffer};

static PyTypeObject ColumnViewType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "backends._heapstate_c.ColumnView",
    .tp_basicsize = sizeof(ColumnView),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = cv_traverse,
    .tp_doc = "A read-only view of one array of a ColumnStore (see the module source).",
    .tp_dealloc = cv_dealloc,
    .tp_as_buffer = &cv_as_buffer,
};

/* A memoryview of ``len`` bytes at ``buf`` (an array of ``s``) through a ColumnView. */
static PyObject *
cs_view(ColumnStore *s, void *buf, Py_ssize_t len)
{
    static char empty[1]; /* no array yet (cap 0): an empty view of something */
    ColumnView *v = PyObject_GC_New(ColumnView, &ColumnViewType);
    if (v == NULL) {
        return NULL;
    }
    v->store = (ColumnStore *)Py_NewRef(s);
    v->buf = len ? (char *)buf : empty;
    v->len = len;
    s->views++;
    PyObject_GC_Track((PyObject *)v);
    PyObject *mv = PyMemoryView_FromObject((PyObject *)v);
    Py_DECREF(v); /* the memoryview holds it (and so the store) while it lives */
    return mv;
}

/* views(): (used, live, kgs, vals, ikeys) as export hands them out, but memoryviews of
 * the arrays themselves instead of copies (ikeys None unless every key is an int64).
 * For a forked snapshot child: a copy there writes fresh pages (10k page faults and
 * ~30 ms at 1M keys x 2 states) of memory the fork already froze. */
static PyObject *
cs_views(PyObject *op, PyObject *unused)
{
    ColumnStore *s = (ColumnStore *)op;
    if (cs_ready(s) < 0) {
        return NULL;
    }
    PyObject *kgs = cs_view(s, s->kgs, s->used * 4);
    PyObject *vals = kgs ? cs_view(s, s->vals, s->used * 8) : NULL;
    PyObject *ikeys = NULL;
    if (vals != NULL) {
        ikeys = s->slots == NULL ? cs_view(s, s->ikeys, s->used * 8) : Py_NewRef(Py_None);
    }
    PyObject *r = NULL;
    if (ikeys != NULL) {
        r = Py_BuildValue("nnOOO", s->used, s->live, kgs, vals, ikeys);
    }
    Py_XDECREF(kgs);
    Py_XDECREF(vals);
    Py_XDECREF(ikeys);
    return r;
}

static PyObject *
cs_load(PyObject *op, PyObject *const *args, Py_ssize_t nargs)
{
    ColumnStore *s = (ColumnStore *)op;
    if (cs_ready(s) < 0) {
        return NULL;
    }
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "load(kg, keys, values) takes 3 arguments");
        return NULL;
    }
    PyObject *keys = PySequence_Fast(args[1], "load: keys must be a sequence");
    PyObject *values = keys ? PySequence_Fast(args[2], "load: values must be a sequence") : NULL;
    PyObject *result = NULL;
    if (values == NULL) {
        goto done;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    if (PySequence_Fast_GET_SIZE(values) != n) {
        PyErr_SetString(PyExc_ValueError, "load: keys and values differ in length");
        goto done;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        int64_t bits;
        if (cs_convert(s, PySequence_Fast_GET_ITEM(values, j), &bits) < 0) {
            goto done;
        }
        Py_ssize_t i = cs_slot(s, PySequence_Fast_GET_ITEM(keys, j), args[0]);
        if (i < 0) {
            goto done;
        }
        s->vals[i] = bits;
    }
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(keys);
    Py_XDECREF(values);
    return result;
}

/* unshare(): right after a fork, move the value array to fresh memory of its own: one
 * mmap(MAP_POPULATE) and a memcpy (GIL released), then the old array is freed (in the
 * child it stays). Updates then write pages nobody shares, instead of taking one
 * copy-on-write fault per page, each with the GIL held and, in a process with threads on
 * other CPUs, a TLB shootdown. True if moved; False if the mapping failed or a view
 * (views()) pins the array (nothing changed: the faults come as before). The store is
 * the task thread's, so nothing else touches the array while the GIL is released.
 * Growth moves it back to PyMem memory. */
static PyObject *
cs_unshare(PyObject *op, PyObject *unused)
{
    ColumnStore *s = (ColumnStore *)op;
    if (cs_ready(s) < 0) {
        return NULL;
    }
    if (s->cap == 0) {
        Py_RETURN_TRUE;
    }
    if (s->views > 0) { /* a view points at the array: it stays where it is */
        Py_RETURN_FALSE;
    }
    long page = sysconf(_SC_PAGESIZE);
    if (page <= 0) {
        Py_RETURN_FALSE;
    }
    size_t bytes = (size_t)s->cap * sizeof *s->vals;
    size_t len = (bytes + (size_t)page - 1) / (size_t)page * (size_t)page;
    int flags = MAP_PRIVATE | MAP_ANONYMOUS;
#ifdef MAP_POPULATE
    flags |= MAP_POPULATE;
#endif
    void *fresh;
    Py_BEGIN_ALLOW_THREADS
    fresh = mmap(NULL, len, PROT_READ | PROT_WRITE, flags, -1, 0);
    if (fresh != MAP_FAILED) {
        memcpy(fresh, s->vals, (size_t)s->used * sizeof *s->vals);
    }
    Py_END_ALLOW_THREADS
    if (fresh == MAP_FAILED) {
        Py_RETURN_FALSE;
    }
    cs_vals_free(s->vals, s->vals_mapped);
    s->vals = fresh;
    s->vals_mapped = len;
    Py_RETURN_TRUE;
}

static PyObject *
cs_entries(PyObject *op, PyObject *unused)
{
    ColumnStore *s = (ColumnStore *)op;
    if (cs_ready(s) < 0) {
        return NULL;
    }
    PyObject *kgs = PyList_New(0), *keys = PyList_New(0), *vals = PyList_New(0), *r = NULL;
    if (kgs == NULL || keys == NULL || vals == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < s->used; i++) {
        if (s->kgs[i] < 0) {
            continue;
        }
        PyObject *kg = PyLong_FromLong(s->kgs[i]);
        PyObject *v = cs_box(s, i);
        int bad = kg == NULL || v == NULL || PyList_Append(kgs, kg) < 0 ||
                  PyList_Append(keys, PyList_GET_ITEM(s->keys, i)) < 0 ||
                  PyList_Append(vals, v) < 0;
        Py_XDECREF(kg);
        Py_XDECREF(v);
        if (bad) {
            goto done;
        }
    }
    r = PyTuple_Pack(3, kgs, keys, vals);
done:
    Py_XDECREF(kgs);
    Py_XDECREF(keys);
    Py_XDECREF(vals);
    return r;
}

static Py_ssize_t
cs_len(PyObject *op)
{
    return ((ColumnStore *)op)->live;
}

static PyObject *
cs_get_deletes(PyObject *op, void *closure)
{
    return PyLong_FromUnsignedLongLong(((ColumnStore *)op)->deletes);
}

static PyObject *
cs_get_used(PyObject *op, void *closure)
{
    return PyLong_FromSsize_t(((ColumnStore *)op)->used);
}

static PyGetSetDef cs_getset[] = {
    {"deletes", cs_get_deletes, NULL, "how many keys were cleared so far", NULL},
    {"used", cs_get_used, NULL, "slots in use or free (the columns' length)", NULL},
    {NULL},
};

static PyMethodDef cs_methods[] = {
    {"get", cs_get, METH_O, "get(default): the current key's value, or default"},
    {"update", cs_update, METH_O, "update(value): set the current key's value"},
    {"clear", cs_clear, METH_NOARGS, "clear(): remove the current key's value"},
    {"export", (PyCFunction)(void (*)(void))cs_export, METH_FASTCALL,
     "export(since_used, since_deletes): the columns (see the module source)"},
    {"views", cs_views, METH_NOARGS,
     "views(): the columns as read-only views of the store's arrays (see the source)"},
    {"load", (PyCFunction)(void (*)(void))cs_load, METH_FASTCALL,
     "load(kg, keys, values): set many keys of one key group"},
    {"entries", cs_entries, METH_NOARGS, "entries(): (kgs, keys, values) of the live keys"},
    {"unshare", cs_unshare, METH_NOARGS,
     "unshare(): after a fork, move the values to memory the child does not share"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods cs_as_sequence = {.sq_length = cs_len};

static PyTypeObject ColumnStoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "backends._heapstate_c.ColumnStore",
    .tp_basicsize = sizeof(ColumnStore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A value state's entries stored columnar (see the module source).",
    .tp_new = PyType_GenericNew,
    .tp_init = cs_init,
    .tp_traverse = cs_traverse,
    .tp_clear = cs_clear_refs,
    .tp_dealloc = cs_dealloc,
    .tp_methods = cs_methods,
    .tp_getset = cs_getset,
    .tp_as_sequence = &cs_as_sequence,
};

typedef struct {
    PyObject_HEAD
    ColumnStore *store;
    PyObject *records;
    PyObject *op;
    PyObject *flush;
} ColumnWriter;

static int
cw_init(PyObject *op, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"store", "records", "op", "flush", NULL};
    ColumnWriter *self = (ColumnWriter *)op;
    PyObject *store, *records, *opcode, *flush;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!OOO", kwlist, &ColumnStoreType, &store,
                                     &records, &opcode, &flush)) {
        return -1;
    }
    if (self->store != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a column writer is initialized once");
        return -1;
    }
    if (!PyObject_TypeCheck(records, records_api->type)) {
        PyErr_SetString(PyExc_TypeError, "records must be a dstl._records.RecordColumns");
        return -1;
    }
    if (!PyLong_Check(opcode) || !PyCallable_Check(flush)) {
        PyErr_SetString(PyExc_TypeError, "a column writer needs an int op and flush()");
        return -1;
    }
    self->store = (ColumnStore *)Py_NewRef(store);
    self->records = Py_NewRef(records);
    self->op = Py_NewRef(opcode);
    self->flush = Py_NewRef(flush);
    return 0;
}

static int
cw_traverse(PyObject *op, visitproc visit, void *arg)
{
    ColumnWriter *self = (ColumnWriter *)op;
    Py_VISIT(self->store);
    Py_VISIT(self->records);
    Py_VISIT(self->op);
    Py_VISIT(self->flush);
    return 0;
}

static int
cw_clear(PyObject *op)
{
    ColumnWriter *self = (ColumnWriter *)op;
    Py_CLEAR(self->store);
    Py_CLEAR(self->records);
    Py_CLEAR(self->op);
    Py_CLEAR(self->flush);
    return 0;
}

static void
cw_dealloc(PyObject *op)
{
    PyObject_GC_UnTrack(op);
    cw_clear(op);
    Py_TYPE(op)->tp_free(op);
}

static PyObject *
cw_update(PyObject *op, PyObject *value)
{
    ColumnWriter *self = (ColumnWriter *)op;
    if (self->store == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "column writer used before __init__");
        return NULL;
    }
    PyObject *records = Py_NewRef(self->records), *opcode = Py_NewRef(self->op);
    PyObject *flush = Py_NewRef(self->flush);
    PyObject *r = cs_write(self->store, records, opcode, flush, value);
    Py_DECREF(records);
    Py_DECREF(opcode);
    Py_DECREF(flush);
    return r;
}

static PyMethodDef cw_methods[] = {
    {"update", cw_update, METH_O, "update(value): log and set the current key's value"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ColumnWriterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "backends._heapstate_c.ColumnWriter",
    .tp_basicsize = sizeof(ColumnWriter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The logged write of a ColumnStore (see the module source).",
    .tp_new = PyType_GenericNew,
    .tp_init = cw_init,
    .tp_traverse = cw_traverse,
    .tp_clear = cw_clear,
    .tp_dealloc = cw_dealloc,
    .tp_methods = cw_methods,
};

/* -- packing columns for materialization ------------------------------------------------ */

/* One key or value as the array module's "q" (int64) or "d" (float64) packs it. Exact
 * ints and floats are read in place, without a reference: nothing is written to their
 * memory (a forked snapshot child copies no page for them). Anything else may run Python
 * code (__index__, __float__), so it is held for the call. 0, or -1 with an exception. */
static int
pack_one(PyObject *obj, int as_float, char *out)
{
    if (!as_float) {
        long long v;
        if (PyLong_CheckExact(obj)) {
            v = PyLong_AsLongLong(obj);
        }
        else if (PyFloat_Check(obj)) {
            PyErr_SetString(PyExc_TypeError, "array item must be integer");
            return -1;
        }
        else {
            Py_INCREF(obj);
            v = PyLong_AsLongLong(obj);
            Py_DECREF(obj);
        }
        if (v == -1 && PyErr_Occurred()) {
            return -1;
        }
        memcpy(out, &v, sizeof v);
        return 0;
    }
    double d;
    if (PyFloat_CheckExact(obj)) {
        d = PyFloat_AS_DOUBLE(obj);
    }
    else {
        Py_INCREF(obj);
        d = PyFloat_AsDouble(obj);
        Py_DECREF(obj);
        if (d == -1.0 && PyErr_Occurred()) {
            return -1;
        }
    }
    memcpy(out, &d, sizeof d);
    return 0;
}

/* How many objects ahead pack_exact asks the CPU to load: the ints of a state that was
 * updated for a while lie all over the heap, one cache miss each; a few misses in flight
 * at a time instead of one (1M scattered ints: about 2x faster). */
#define PACK_AHEAD 16

/* The fast path of pack for one dict: every item is an exact int (float), read in place
 * without running Python code, loaded PACK_AHEAD ahead. ``ptrs`` holds the dict's size.
 * The number packed; -1 if an item is not exact (nothing was converted: the caller packs
 * the dict the careful way); -2 with an exception set (an int past 64 bits). */
static Py_ssize_t
pack_exact(PyObject *d, int values, int as_float, char *out, PyObject **ptrs)
{
    Py_ssize_t pos = 0, k = 0;
    PyObject *key, *value;
    while (PyDict_Next(d, &pos, &key, &value)) {
        ptrs[k++] = values ? value : key;
    }
    for (Py_ssize_t j = 0; j < k; j++) {
#if defined(__GNUC__) || defined(__clang__)
        if (j + PACK_AHEAD < k) {
            __builtin_prefetch(ptrs[j + PACK_AHEAD]);
        }
#endif
        PyObject *o = ptrs[j];
        if (as_float) {
            if (!PyFloat_CheckExact(o)) {
                return -1;
            }
            double v = PyFloat_AS_DOUBLE(o);
            memcpy(out + j * 8, &v, sizeof v);
        }
        else {
            if (!PyLong_CheckExact(o)) {
                return -1;
            }
            long long v = PyLong_AsLongLong(o);
            if (v == -1 && PyErr_Occurred()) {
                return -2;
            }
            memcpy(out + j * 8, &v, sizeof v);
        }
    }
    return k;
}

static PyObject *
hs_pack(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyUnicode_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "pack(dicts, values, kind) takes 3 arguments");
        return NULL;
    }
    int values = PyObject_IsTrue(args[1]);
    if (values < 0) {
        return NULL;
    }
    int as_float;
    if (PyUnicode_CompareWithASCIIString(args[2], "q") == 0) {
        as_float = 0;
    }
    else if (PyUnicode_CompareWithASCIIString(args[2], "d") == 0) {
        as_float = 1;
    }
    else {
        PyErr_SetString(PyExc_ValueError, "pack: kind must be 'q' or 'd'");
        return NULL;
    }
    /* A tuple of the dicts, each held: Python code run by a conversion may change the
     * list or drop a dict. */
    PyObject *dicts = PySequence_Tuple(args[0]);
    if (dicts == NULL) {
        return NULL;
    }
    Py_ssize_t ndicts = PyTuple_GET_SIZE(dicts), total = 0;
    for (Py_ssize_t i = 0; i < ndicts; i++) {
        PyObject *d = PyTuple_GET_ITEM(dicts, i);
        if (!PyDict_Check(d)) {
            PyErr_Format(PyExc_TypeError, "pack: expected dicts, got %.100s", Py_TYPE(d)->tp_name);
            Py_DECREF(dicts);
            return NULL;
        }
        total += PyDict_GET_SIZE(d);
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, total * 8);
    if (out == NULL) {
        Py_DECREF(dicts);
        return NULL;
    }
    char *buf = PyBytes_AS_STRING(out);
    Py_ssize_t n = 0, largest = 0;
    for (Py_ssize_t i = 0; i < ndicts; i++) {
        Py_ssize_t size = PyDict_GET_SIZE(PyTuple_GET_ITEM(dicts, i));
        largest = size > largest ? size : largest;
    }
    PyObject **ptrs = PyMem_Malloc((size_t)(largest ? largest : 1) * sizeof(PyObject *));
    if (ptrs == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < ndicts; i++) {
        PyObject *d = PyTuple_GET_ITEM(dicts, i);
        Py_ssize_t size = PyDict_GET_SIZE(d), pos = 0;
        if (n + size > total) {
            PyErr_SetString(PyExc_RuntimeError, "pack: a dict changed size during packing");
            goto fail;
        }
        Py_ssize_t fast = pack_exact(d, values, as_float, buf + n * 8, ptrs);
        if (fast == -2) {
            goto fail;
        }
        if (fast >= 0) {
            n += fast;
            continue;
        }
        PyObject *key, *value;
        while (PyDict_Next(d, &pos, &key, &value)) {
            if (n == total || PyDict_GET_SIZE(d) != size) {
                PyErr_SetString(PyExc_RuntimeError, "pack: a dict changed size during packing");
                goto fail;
            }
            if (pack_one(values ? value : key, as_float, buf + n * 8) < 0) {
                goto fail;
            }
            n++;
            if (PyDict_GET_SIZE(d) != size) {
                PyErr_SetString(PyExc_RuntimeError, "pack: a dict changed size during packing");
                goto fail;
            }
        }
    }
    PyMem_Free(ptrs);
    Py_DECREF(dicts);
    if (n != total) {
        Py_DECREF(out);
        PyErr_SetString(PyExc_RuntimeError, "pack: a dict changed size during packing");
        return NULL;
    }
    return out;
fail:
    PyMem_Free(ptrs);
    Py_DECREF(dicts);
    Py_DECREF(out);
    return NULL;
}

/* The UTF-8 (str) or raw (bytes) contents of ``obj`` if it is an exact str (kind 's') or
 * exact bytes ('b'); NULL without an exception otherwise (the caller falls back), and
 * NULL with an exception only for memory errors. Runs no Python code. */
static const char *
text_of(PyObject *obj, int is_str, Py_ssize_t *size)
{
    if (is_str) {
        if (!PyUnicode_CheckExact(obj)) {
            return NULL;
        }
        const char *utf8 = PyUnicode_AsUTF8AndSize(obj, size);
        if (utf8 == NULL && PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) {
            PyErr_Clear(); /* a lone surrogate: the fallback raises what Arrow raises */
        }
        return utf8;
    }
    if (!PyBytes_CheckExact(obj)) {
        return NULL;
    }
    *size = PyBytes_GET_SIZE(obj);
    return PyBytes_AS_STRING(obj);
}

static PyObject *
hs_pack_text(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyUnicode_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "pack_text(dicts, values, kind) takes 3 arguments");
        return NULL;
    }
    int values = PyObject_IsTrue(args[1]);
    if (values < 0) {
        return NULL;
    }
    int is_str;
    if (PyUnicode_CompareWithASCIIString(args[2], "s") == 0) {
        is_str = 1;
    }
    else if (PyUnicode_CompareWithASCIIString(args[2], "b") == 0) {
        is_str = 0;
    }
    else {
        PyErr_SetString(PyExc_ValueError, "pack_text: kind must be 's' or 'b'");
        return NULL;
    }
    PyObject *dicts = PySequence_Tuple(args[0]);
    if (dicts == NULL) {
        return NULL;
    }
    PyObject *offsets = NULL, *data = NULL, *result = NULL;
    PyObject **ptrs = NULL;
    Py_ssize_t ndicts = PyTuple_GET_SIZE(dicts), count = 0, total = 0, size;
    for (Py_ssize_t i = 0; i < ndicts; i++) {
        PyObject *d = PyTuple_GET_ITEM(dicts, i);
        if (!PyDict_Check(d)) {
            PyErr_Format(PyExc_TypeError, "pack_text: expected dicts, got %.100s",
                         Py_TYPE(d)->tp_name);
            goto done;
        }
        count += PyDict_GET_SIZE(d);
    }
    /* The items first (the dicts' entries are contiguous), then the objects, which lie all
     * over the heap, loaded PACK_AHEAD ahead (as in pack_exact). Nothing below runs
     * Python code, so the borrowed pointers stay valid. */
    ptrs = PyMem_Malloc((size_t)(count ? count : 1) * sizeof(PyObject *));
    if (ptrs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < ndicts; i++) {
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        while (PyDict_Next(PyTuple_GET_ITEM(dicts, i), &pos, &key, &value)) {
            ptrs[k++] = values ? value : key;
        }
    }
    for (Py_ssize_t j = 0; j < count; j++) {
#if defined(__GNUC__) || defined(__clang__)
        if (j + PACK_AHEAD < count) {
            __builtin_prefetch(ptrs[j + PACK_AHEAD]);
        }
#endif
        if (text_of(ptrs[j], is_str, &size) == NULL) {
            if (!PyErr_Occurred()) {
                result = Py_NewRef(Py_None);
            }
            goto done;
        }
        total += size;
        if (total > INT32_MAX) { /* past Arrow's 32-bit offsets: the fallback decides */
            result = Py_NewRef(Py_None);
            goto done;
        }
    }
    offsets = PyBytes_FromStringAndSize(NULL, (count + 1) * 4);
    data = PyBytes_FromStringAndSize(NULL, total);
    if (offsets == NULL || data == NULL) {
        goto done;
    }
    int32_t *off = (int32_t *)PyBytes_AS_STRING(offsets);
    char *out = PyBytes_AS_STRING(data);
    Py_ssize_t at = 0;
    off[0] = 0;
    for (Py_ssize_t j = 0; j < count; j++) {
#if defined(__GNUC__) || defined(__clang__)
        if (j + PACK_AHEAD < count) {
            __builtin_prefetch(ptrs[j + PACK_AHEAD]);
        }
#endif
        const char *text = text_of(ptrs[j], is_str, &size);
        if (text == NULL) { /* checked above; only a memory error can get here */
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_RuntimeError, "pack_text: an item changed");
            }
            goto done;
        }
        memcpy(out + at, text, (size_t)size);
        at += size;
        off[j + 1] = (int32_t)at;
    }
    result = PyTuple_Pack(2, offsets, data);
done:
    PyMem_Free(ptrs);
    Py_DECREF(dicts);
    Py_XDECREF(offsets);
    Py_XDECREF(data);
    return result;
}

/* -- key groups ------------------------------------------------------------------------ */

/* key_group_for(key_bytes, max_parallelism): backends.keygroups' hash, the same ints:
 * fmix32(crc32(key_bytes)) % max_parallelism, crc32 as zlib's (reflected, polynomial
 * 0xEDB88320). In Python it took ~300 ns a record (crc32, then five operations on ints
 * past 30 bits); every keyed record is hashed once, by its sender. */
static uint32_t crc_table[256];

static void
crc_init(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) {
            c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        }
        crc_table[n] = c;
    }
}

static uint32_t
crc32_of(const unsigned char *p, Py_ssize_t n)
{
    uint32_t c = 0xFFFFFFFFu;
    for (Py_ssize_t i = 0; i < n; i++) {
        c = crc_table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
    }
    return c ^ 0xFFFFFFFFu;
}

static PyObject *
hs_key_group_for(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError,
                     "key_group_for takes 2 arguments (key_bytes, max_parallelism), %zd given",
                     nargs);
        return NULL;
    }
    long long max_par = PyLong_AsLongLong(args[1]);
    if (max_par == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (max_par < 1) {
        PyErr_SetString(PyExc_ValueError, "max_parallelism must be >= 1");
        return NULL;
    }
    uint32_t h;
    if (PyBytes_CheckExact(args[0])) {
        h = crc32_of((const unsigned char *)PyBytes_AS_STRING(args[0]),
                     PyBytes_GET_SIZE(args[0]));
    }
    else {
        Py_buffer view;
        if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
            return NULL;
        }
        h = crc32_of((const unsigned char *)view.buf, view.len);
        PyBuffer_Release(&view);
    }
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return PyLong_FromLongLong((long long)((unsigned long long)h % (unsigned long long)max_par));
}

static PyMethodDef module_methods[] = {
    {"key_group_for", (PyCFunction)(void (*)(void))hs_key_group_for, METH_FASTCALL,
     "key_group_for(key_bytes, max_parallelism) -> int: the key group of a serialized key "
     "(see backends.keygroups)"},
    {"pack", (PyCFunction)(void (*)(void))hs_pack, METH_FASTCALL,
     "pack(dicts, values, kind) -> bytes: the keys (values false) or values of the dicts, "
     "in order, as native int64 (kind 'q') or float64 ('d'), as array.array packs them"},
    {"pack_text", (PyCFunction)(void (*)(void))hs_pack_text, METH_FASTCALL,
     "pack_text(dicts, values, kind) -> (offsets, data) | None: the keys or values of the "
     "dicts as an Arrow string (kind 's', exact str) or binary ('b', exact bytes) column's "
     "int32 offsets and data; None if an item is of another type or they pass 2 GiB"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef heapstate_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "backends._heapstate_c",
    .m_doc = "The heap store's per-record writes, with or without the change log.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__heapstate_c(void)
{
    crc_init();
    /* PyCapsule_Import imports only the package, then walks attributes: the submodule
     * must be imported already. */
    PyObject *records = PyImport_ImportModule("dstl._records_c");
    if (records == NULL) {
        return NULL;
    }
    Py_DECREF(records);
    records_api = (RecordsCAPI *)PyCapsule_Import(RECORDS_CAPI_NAME, 0);
    if (records_api == NULL) {
        return NULL;
    }
    PyTypeObject *types[] = {&KeyContextType, &HeapValueType, &HeapListType, &HeapMapType,
                             &ColumnStoreType, &ColumnWriterType, &ColumnViewType};
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
        PyModule_AddObjectRef(m, "HeapMap", (PyObject *)&HeapMapType) < 0 ||
        PyModule_AddObjectRef(m, "ColumnStore", (PyObject *)&ColumnStoreType) < 0 ||
        PyModule_AddObjectRef(m, "ColumnWriter", (PyObject *)&ColumnWriterType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
