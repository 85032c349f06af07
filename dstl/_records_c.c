/* dstl._records_c: a columnar buffer of change records, appended one record per C call.
 *
 * Why C: a logged state call must cost little more than the same call without the log
 * (issue 4: at most 15% on the per-record path). In CPython, appending a record to a few
 * Python lists, converting its value and checking for a flush costs about as much as the
 * heap store's whole update; one C call does it all in a fraction of that, and the
 * buffers it fills are already Arrow's layout (int32 key groups, int8 ops, binary
 * columns with int32 offsets and validity bitmaps), so a flush converts nothing.
 * dstl/_records_py.py is the same API in Python (the fallback; dstl/_records.py picks).
 *
 * Safe from Python (issue 17): the object is made whole in tp_new (no __init__ to skip or
 * repeat), it has no writable attributes, it holds no references to Python objects, and
 * every append checks and converts all its parts (which may run Python code) before it
 * touches the buffer, re-reading the buffer's state only after that. Sizes stay below
 * INT32_MAX (Arrow's int32 offsets), checked without overflowing. Public C API only.
 *
 * RecordColumns(capacity, max_bytes, user_key_kind, value_kind)
 *   append(op, key, key_group, user_key, value) -> bool
 *       user_key and value are bytes or None (already serialized).
 *   append_typed(op, key, key_group, user_key, value) -> bool
 *       user_key and value are converted by their kinds: KIND_BYTES (must be bytes),
 *       KIND_INT64 (int or __index__, written as 8 little-endian bytes, like struct "<q"),
 *       KIND_FLOAT64 (float or __float__, like struct "<d"), KIND_STR (str, UTF-8, like
 *       str.encode). They accept what those accept; None is refused.
 *   append_typed_list(op, key, key_group, user_key, values) -> bool
 *       values is a list; each element is converted by the value kind and the value is
 *       their framing as backends.serializers.pack_list writes it (4-byte little-endian
 *       length, then the bytes, per element): a list state's LIST_SET in one call.
 *   All check every argument before writing anything, so a refused record changes
 *   nothing (TypeError, OverflowError, UnicodeEncodeError), and return True when the
 *   buffer holds ``capacity`` records or ``max_bytes`` bytes: time to take() it.
 *   user_key_kind KIND_NONE: the buffer has no user-key column (user_key must be None).
 *   take() -> tuple | None
 *       (rows, key_groups, ops, key_offsets, key_data, user_key, value) and empties the
 *       buffer; user_key and value are (null_count, validity, offsets, data) with
 *       validity None when nothing is null; user_key is None without that column.
 *       None when empty.
 *
 * pack_int64(value) -> bytes, pack_float64(value) -> bytes
 *     One part converted as KIND_INT64 / KIND_FLOAT64 would convert it: the serializers
 *     INT64 and FLOAT64 use these, so a value is refused with the same error whichever
 *     store and path it takes (TypeError, OverflowError; never struct.error).
 *
 * Other C extensions append through the capsule ``_C_API`` (see records_capi.h).
 *
 * Not thread-safe: owned by one task thread, like the state that fills it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "records_capi.h"
#include <stdint.h>
#include <limits.h>
#include <string.h>

enum { KIND_NONE = -1, KIND_BYTES = 0, KIND_INT64 = 1, KIND_FLOAT64 = 2, KIND_STR = 3 };

typedef struct {
    char *data;
    Py_ssize_t len;
    Py_ssize_t cap;
} Buf;

/* Room for ``extra`` more bytes; callers keep ``len + extra`` <= INT32_MAX (the Arrow
 * offsets are int32), so neither the sum nor the doubling below can overflow. */
static int
buf_reserve(Buf *b, Py_ssize_t extra)
{
    Py_ssize_t need = b->len + extra;
    if (need <= b->cap) {
        return 0;
    }
    Py_ssize_t cap = b->cap ? b->cap : 64;
    while (cap < need) {
        cap *= 2;
    }
    char *p = PyMem_Realloc(b->data, (size_t)cap);
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = p;
    b->cap = cap;
    return 0;
}

static void
buf_free(Buf *b)
{
    PyMem_Free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
}

/* A binary column: int32 offsets (one per row + 1, offsets[0] == 0) and data; nullable
 * columns get a validity bitmap (LSB first, all valid) only once a null arrives. */
typedef struct {
    int32_t *offsets;
    uint8_t *validity;
    Py_ssize_t nulls;
    Buf data;
} BinCol;

/* A value converted for appending: bytes to copy, or null. */
typedef struct {
    const char *ptr;
    Py_ssize_t len;
    char fixed[8];
    int is_null;
} Cell;

typedef struct {
    PyObject_HEAD
    Py_ssize_t rows;
    Py_ssize_t row_cap; /* rows the per-row arrays have room for */
    Py_ssize_t capacity;
    Py_ssize_t max_bytes;
    int uk_kind;
    int value_kind;
    int32_t *key_groups;
    int8_t *ops;
    BinCol keys; /* never null */
    BinCol uks;
    BinCol values;
} RecordColumns;

static PyTypeObject RecordColumnsType;

/* An exact int's value when it is "compact" (fits a machine word), read without a call;
 * -1 for "use PyLong_AsLongLongAndOverflow". Hot: three per record. Only the public
 * (unstable-tier) API of 3.12+ reads the int's layout; 3.11 has no public way to, so it
 * always makes the call (its internal layout is not ours to read). */
#if PY_VERSION_HEX >= 0x030C0000
static inline int
small_long(PyObject *obj, long long *out)
{
    if (!PyLong_CheckExact(obj) || !PyUnstable_Long_IsCompact((PyLongObject *)obj)) {
        return -1;
    }
    *out = (long long)PyUnstable_Long_CompactValue((PyLongObject *)obj);
    return 0;
}
#else
static inline int
small_long(PyObject *obj, long long *out)
{
    (void)obj;
    (void)out;
    return -1;
}
#endif

/* ``obj`` (an int, or anything with __index__) in [lo, hi] into ``out``; -1 with an
 * exception set if it is not. */
static inline int
as_ranged(PyObject *obj, long long lo, long long hi, const char *what, long long *out)
{
    if (small_long(obj, out) < 0) {
        int overflow = 0;
        *out = PyLong_AsLongLongAndOverflow(obj, &overflow);
        if (overflow) {
            PyErr_Format(PyExc_OverflowError, "%s: %R is out of the int64 range", what, obj);
            return -1;
        }
        if (*out == -1 && PyErr_Occurred()) {
            return -1;
        }
    }
    if (*out < lo || *out > hi) {
        PyErr_Format(PyExc_OverflowError, "%s: %R is out of range [%lld, %lld]", what, obj,
                     lo, hi);
        return -1;
    }
    return 0;
}

static void
put_le64(char *out, uint64_t v)
{
    for (int i = 0; i < 8; i++) {
        out[i] = (char)(v & 0xFF);
        v >>= 8;
    }
}

/* Convert ``obj`` by ``kind`` into ``cell``; 0 on success, -1 with an exception set. */
/* ``cell`` holds the 8 little-endian bytes of ``bits``. */
static int
cell_fixed(Cell *cell, uint64_t bits)
{
    put_le64(cell->fixed, bits);
    cell->ptr = cell->fixed;
    cell->len = 8;
    return 0;
}

static int
cell_typed(PyObject *obj, int kind, const char *what, Cell *cell)
{
    cell->is_null = 0;
    if (obj == Py_None) {
        PyErr_Format(PyExc_TypeError, "%s: None cannot be serialized", what);
        return -1;
    }
    switch (kind) {
    case KIND_INT64: { /* like struct "<q": an int or anything with __index__ */
        long long v;
        if (as_ranged(obj, LLONG_MIN, LLONG_MAX, what, &v) < 0) {
            return -1;
        }
        return cell_fixed(cell, (uint64_t)v);
    }
    case KIND_FLOAT64: {
        double d = PyFloat_AsDouble(obj);
        if (d == -1.0 && PyErr_Occurred()) {
            return -1;
        }
        uint64_t bits;
        memcpy(&bits, &d, 8);
        return cell_fixed(cell, bits);
    }
    case KIND_STR: {
        if (!PyUnicode_Check(obj)) {
            PyErr_Format(PyExc_TypeError, "%s: str expects a str, got %.100s", what,
                         Py_TYPE(obj)->tp_name);
            return -1;
        }
        cell->ptr = PyUnicode_AsUTF8AndSize(obj, &cell->len);
        return cell->ptr == NULL ? -1 : 0;
    }
    default:
        if (!PyBytes_Check(obj)) {
            PyErr_Format(PyExc_TypeError, "%s: expected bytes, got %.100s", what,
                         Py_TYPE(obj)->tp_name);
            return -1;
        }
        cell->ptr = PyBytes_AS_STRING(obj);
        cell->len = PyBytes_GET_SIZE(obj);
        return 0;
    }
}

static int
cell_raw(PyObject *obj, const char *what, Cell *cell)
{
    if (obj == Py_None) {
        cell->is_null = 1;
        cell->ptr = NULL;
        cell->len = 0;
        return 0;
    }
    return cell_typed(obj, KIND_BYTES, what, cell);
}

static Py_ssize_t
bitmap_size(Py_ssize_t rows)
{
    return rows / 8 + 1;
}

/* Room for ``len`` more data bytes, and a validity bitmap if ``cell`` is null. */
static int
bincol_reserve(BinCol *c, const Cell *cell, Py_ssize_t row_cap)
{
    if (cell->len > INT32_MAX - c->data.len) { /* not a sum: it could overflow */
        PyErr_SetString(PyExc_OverflowError,
                        "change records: more than 2 GiB in one buffer (flush more often)");
        return -1;
    }
    if (buf_reserve(&c->data, cell->len) < 0) {
        return -1;
    }
    if (cell->is_null && c->validity == NULL) {
        c->validity = PyMem_Malloc((size_t)bitmap_size(row_cap));
        if (c->validity == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        memset(c->validity, 0xFF, (size_t)bitmap_size(row_cap));
    }
    return 0;
}

static void
bincol_write(BinCol *c, Py_ssize_t row, const Cell *cell)
{
    if (cell->is_null) {
        c->validity[row / 8] &= (uint8_t) ~(1u << (row % 8));
        c->nulls++;
    }
    else if (cell->len == 8) { /* int64, float64, 8-byte keys: one store, no call */
        memcpy(c->data.data + c->data.len, cell->ptr, 8);
        c->data.len += 8;
    }
    else if (cell->len) {
        memcpy(c->data.data + c->data.len, cell->ptr, (size_t)cell->len);
        c->data.len += cell->len;
    }
    c->offsets[row + 1] = (int32_t)c->data.len;
}

static void
bincol_clear(BinCol *c, Py_ssize_t row_cap)
{
    if (c->nulls) {
        memset(c->validity, 0xFF, (size_t)bitmap_size(row_cap));
    }
    c->data.len = 0;
    c->nulls = 0;
}

static void
bincol_free(BinCol *c)
{
    PyMem_Free(c->offsets);
    PyMem_Free(c->validity);
    c->offsets = NULL;
    c->validity = NULL;
    buf_free(&c->data);
}

static int
grow(void **p, size_t size)
{
    void *q = PyMem_Realloc(*p, size);
    if (q == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *p = q;
    return 0;
}

static int
bincol_grow_rows(BinCol *c, Py_ssize_t old_cap, Py_ssize_t cap)
{
    if (grow((void **)&c->offsets, sizeof(int32_t) * (size_t)(cap + 1)) < 0) {
        return -1;
    }
    c->offsets[0] = 0;
    if (c->validity != NULL) {
        if (grow((void **)&c->validity, (size_t)bitmap_size(cap)) < 0) {
            return -1;
        }
        memset(c->validity + bitmap_size(old_cap), 0xFF,
               (size_t)(bitmap_size(cap) - bitmap_size(old_cap)));
    }
    return 0;
}

/* Room for ``cap`` rows in every per-row array. The row count stays below INT32_MAX (an
 * Arrow array's length here; also keeps every size below from overflowing). */
static int
grow_rows(RecordColumns *self, Py_ssize_t cap)
{
    Py_ssize_t old = self->row_cap;
    if (cap <= old || cap > INT32_MAX - 1) {
        PyErr_SetString(PyExc_OverflowError, "change records: too many rows in one buffer");
        return -1;
    }
    if (grow((void **)&self->key_groups, sizeof(int32_t) * (size_t)cap) < 0 ||
        grow((void **)&self->ops, (size_t)cap) < 0 ||
        bincol_grow_rows(&self->keys, old, cap) < 0 ||
        bincol_grow_rows(&self->uks, old, cap) < 0 ||
        bincol_grow_rows(&self->values, old, cap) < 0) {
        return -1;
    }
    self->row_cap = cap;
    return 0;
}

/* The parts of a record besides its value, checked and converted. */
typedef struct {
    long long op;
    long long kg;
    Cell key;
    Cell uk;
    int has_uk;
} Head;

static int
head_parse(RecordColumns *self, PyObject *const *args, int typed, Head *h)
{
    if (as_ranged(args[0], -128, 127, "op", &h->op) < 0) {
        return -1;
    }
    PyObject *key = args[1];
    if (!PyBytes_Check(key)) {
        PyErr_Format(PyExc_TypeError, "key: expected bytes, got %.100s", Py_TYPE(key)->tp_name);
        return -1;
    }
    if (as_ranged(args[2], INT32_MIN, INT32_MAX, "key group", &h->kg) < 0) {
        return -1;
    }
    h->key = (Cell){PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key), {0}, 0};
    h->uk = (Cell){NULL, 0, {0}, 1};
    h->has_uk = self->uk_kind != KIND_NONE;
    if (!h->has_uk) {
        if (args[3] != Py_None) {
            PyErr_SetString(PyExc_TypeError, "user_key: this buffer has no user-key column");
            return -1;
        }
        return 0;
    }
    return typed ? cell_typed(args[3], self->uk_kind, "user key", &h->uk)
                 : cell_raw(args[3], "user key", &h->uk);
}

/* Write a value framed as backends.serializers.pack_list frames list elements: each part
 * as its 4-byte little-endian length, then its bytes (the room is reserved). */
static void
framed_write(BinCol *c, Py_ssize_t row, const Cell *parts, Py_ssize_t nparts)
{
    for (Py_ssize_t i = 0; i < nparts; i++) {
        uint32_t n = (uint32_t)parts[i].len;
        char *out = c->data.data + c->data.len;
        for (int b = 0; b < 4; b++) {
            out[b] = (char)((n >> (8 * b)) & 0xFF);
        }
        if (n) {
            memcpy(out + 4, parts[i].ptr, n);
        }
        c->data.len += 4 + (Py_ssize_t)n;
    }
    c->offsets[row + 1] = (int32_t)c->data.len;
}

/* Append the record: everything was checked, now reserve and write. ``parts`` (when not
 * NULL) are the list elements ``value`` frames. 1 full, 0 not, -1 out of memory. */
static int
commit(RecordColumns *self, const Head *h, const Cell *value, const Cell *parts,
       Py_ssize_t nparts)
{
    Py_ssize_t row = self->rows;
    if ((row == self->row_cap &&
         grow_rows(self, row > INT32_MAX / 2 - 1 ? INT32_MAX - 1 : 2 * row) < 0) ||
        bincol_reserve(&self->keys, &h->key, self->row_cap) < 0 ||
        (h->has_uk && bincol_reserve(&self->uks, &h->uk, self->row_cap) < 0) ||
        bincol_reserve(&self->values, value, self->row_cap) < 0) {
        return -1;
    }
    /* Everything is checked and reserved: nothing below can fail. */
    self->key_groups[row] = (int32_t)h->kg;
    self->ops[row] = (int8_t)h->op;
    bincol_write(&self->keys, row, &h->key);
    if (h->has_uk) {
        bincol_write(&self->uks, row, &h->uk);
    }
    if (parts != NULL) {
        framed_write(&self->values, row, parts, nparts);
    }
    else {
        bincol_write(&self->values, row, value);
    }
    self->rows = row + 1;
    return self->rows >= self->capacity ||
           self->keys.data.len + self->uks.data.len + self->values.data.len >= self->max_bytes;
}

/* Append one record: ``args`` = (op, key, key_group, user_key, value). 1 when the buffer
 * is full, 0 when not, -1 with an exception set (then nothing was appended). Hot: the
 * capsule calls it once per logged heap write. */
static int
do_append(RecordColumns *self, PyObject *const *args, int typed)
{
    Head h;
    Cell value;
    if (head_parse(self, args, typed, &h) < 0 ||
        (typed ? cell_typed(args[4], self->value_kind, "value", &value)
               : cell_raw(args[4], "value", &value)) < 0) {
        return -1;
    }
    return commit(self, &h, &value, NULL, 0);
}

/* Like do_append (typed), with ``args[4]`` a list whose elements are converted by the
 * value kind and framed into one value (a list state's LIST_SET). */
static int
do_append_list(RecordColumns *self, PyObject *const *args)
{
    Head h;
    if (head_parse(self, args, 1, &h) < 0) {
        return -1;
    }
    if (!PyList_Check(args[4])) {
        PyErr_Format(PyExc_TypeError, "value: expected a list, got %.100s",
                     Py_TYPE(args[4])->tp_name);
        return -1;
    }
    /* A snapshot: converting an element may run Python code that changes the list. */
    PyObject *items = PyList_AsTuple(args[4]);
    if (items == NULL) {
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(items);
    Cell small[16];
    Cell *parts = n <= 16 ? small : PyMem_New(Cell, (size_t)n);
    Cell value = {NULL, 0, {0}, 0};
    int result = -1;
    if (parts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (cell_typed(PyTuple_GET_ITEM(items, i), self->value_kind, "list element",
                       &parts[i]) < 0) {
            goto done;
        }
        /* The framed value must fit one buffer (checked again on reserving): stopping
         * here also keeps the sum from overflowing. */
        if (parts[i].len > INT32_MAX - 4 - value.len) {
            PyErr_SetString(PyExc_OverflowError,
                            "change records: more than 2 GiB in one buffer (flush more often)");
            goto done;
        }
        value.len += 4 + parts[i].len;
    }
    result = commit(self, &h, &value, parts, n);
done:
    if (parts != small) {
        PyMem_Free(parts); /* NULL-safe */
    }
    Py_DECREF(items); /* after the write: the parts point into the elements */
    return result;
}

/* ``how``: 0 append, 1 append_typed, 2 append_typed_list. */
static PyObject *
append_method(PyObject *self, PyObject *const *args, Py_ssize_t nargs, int how)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "append(op, key, key_group, user_key, value) takes 5 arguments");
        return NULL;
    }
    int full = how == 2 ? do_append_list((RecordColumns *)self, args)
                        : do_append((RecordColumns *)self, args, how);
    if (full < 0) {
        return NULL;
    }
    return Py_NewRef(full ? Py_True : Py_False);
}

static PyObject *
rc_append(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return append_method(self, args, nargs, 0);
}

static PyObject *
rc_append_typed(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return append_method(self, args, nargs, 1);
}

static PyObject *
rc_append_typed_list(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return append_method(self, args, nargs, 2);
}

/* The C-level typed append for other extension modules (see records_capi.h): the same as
 * append_typed with ``args`` = (op, key, key_group, user_key, value); 1 when the buffer
 * is full, 0 when not, -1 with an exception set. ``rc`` must be a RecordColumns. */
static int
check_type(PyObject *rc)
{
    if (Py_IS_TYPE(rc, &RecordColumnsType)) {
        return 0;
    }
    PyErr_Format(PyExc_TypeError, "expected a dstl._records_c.RecordColumns, got %.100s",
                 Py_TYPE(rc)->tp_name);
    return -1;
}

static int
capi_append_typed(PyObject *rc, PyObject *const *args)
{
    return check_type(rc) < 0 ? -1 : do_append((RecordColumns *)rc, args, 1);
}

/* The same with ``args[4]`` a list, framed into one value (see do_append_list). */
static int
capi_append_typed_list(PyObject *rc, PyObject *const *args)
{
    return check_type(rc) < 0 ? -1 : do_append_list((RecordColumns *)rc, args);
}

static PyObject *
bytes_at(const void *p, Py_ssize_t len)
{
    return PyBytes_FromStringAndSize(len ? (const char *)p : "", len);
}

static PyObject *
bincol_take(const BinCol *c, Py_ssize_t rows)
{
    PyObject *validity;
    if (c->nulls) {
        validity = bytes_at(c->validity, (rows + 7) / 8);
        if (validity == NULL) {
            return NULL;
        }
    }
    else {
        validity = Py_NewRef(Py_None);
    }
    return Py_BuildValue("(nNNN)", c->nulls, validity,
                         bytes_at(c->offsets, 4 * (rows + 1)),
                         bytes_at(c->data.data, c->data.len));
}

static PyObject *
rc_take(PyObject *op, PyObject *Py_UNUSED(ignored))
{
    RecordColumns *self = (RecordColumns *)op;
    Py_ssize_t rows = self->rows;
    if (rows == 0) {
        Py_RETURN_NONE;
    }
    PyObject *uks;
    if (self->uk_kind == KIND_NONE) {
        uks = Py_NewRef(Py_None);
    }
    else if ((uks = bincol_take(&self->uks, rows)) == NULL) {
        return NULL;
    }
    PyObject *out = Py_BuildValue(
        "(nNNNNNN)", rows, bytes_at(self->key_groups, 4 * rows), bytes_at(self->ops, rows),
        bytes_at(self->keys.offsets, 4 * (rows + 1)),
        bytes_at(self->keys.data.data, self->keys.data.len), uks,
        bincol_take(&self->values, rows));
    if (out == NULL) {
        return NULL;
    }
    self->rows = 0;
    bincol_clear(&self->keys, self->row_cap);
    bincol_clear(&self->uks, self->row_cap);
    bincol_clear(&self->values, self->row_cap);
    return out;
}

static Py_ssize_t
rc_len(PyObject *self)
{
    return ((RecordColumns *)self)->rows;
}

static int
check_kind(int kind, int allow_none, const char *what)
{
    if ((kind == KIND_NONE && allow_none) || (kind >= KIND_BYTES && kind <= KIND_STR)) {
        return 0;
    }
    PyErr_Format(PyExc_ValueError, "unknown %s kind %d", what, kind);
    return -1;
}

/* The only constructor: the object exists only fully set up (no __init__ to skip or to
 * call again, so no half-made or re-made buffer is reachable from Python). */
static PyObject *
rc_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"capacity", "max_bytes", "user_key_kind", "value_kind", NULL};
    Py_ssize_t capacity, max_bytes;
    int uk_kind, value_kind;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nnii", kwlist, &capacity, &max_bytes,
                                     &uk_kind, &value_kind)) {
        return NULL;
    }
    if (capacity < 1 || max_bytes < 1) {
        PyErr_SetString(PyExc_ValueError, "capacity and max_bytes must be >= 1");
        return NULL;
    }
    if (check_kind(uk_kind, 1, "user key") < 0 || check_kind(value_kind, 0, "value") < 0) {
        return NULL;
    }
    RecordColumns *self = (RecordColumns *)type->tp_alloc(type, 0); /* zeroed */
    if (self == NULL) {
        return NULL;
    }
    self->capacity = capacity;
    self->max_bytes = max_bytes;
    self->uk_kind = uk_kind;
    self->value_kind = value_kind;
    if (grow_rows(self, capacity < 4096 ? capacity : 4096) < 0) {
        Py_DECREF(self); /* rc_dealloc frees what was allocated */
        return NULL;
    }
    return (PyObject *)self;
}

static void
rc_dealloc(PyObject *op)
{
    RecordColumns *self = (RecordColumns *)op;
    PyMem_Free(self->key_groups);
    PyMem_Free(self->ops);
    bincol_free(&self->keys);
    bincol_free(&self->uks);
    bincol_free(&self->values);
    Py_TYPE(op)->tp_free(op);
}

static PyMethodDef rc_methods[] = {
    {"append", (PyCFunction)(void (*)(void))rc_append, METH_FASTCALL,
     "append(op, key, key_group, user_key, value) -> bool: one record of serialized parts"},
    {"append_typed", (PyCFunction)(void (*)(void))rc_append_typed, METH_FASTCALL,
     "append_typed(op, key, key_group, user_key, value) -> bool: parts converted by kind"},
    {"append_typed_list", (PyCFunction)(void (*)(void))rc_append_typed_list, METH_FASTCALL,
     "append_typed_list(op, key, key_group, user_key, values) -> bool: a list, framed"},
    {"take", rc_take, METH_NOARGS, "take() -> tuple | None: the buffered columns; empties"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods rc_as_sequence = {
    .sq_length = rc_len,
};

static PyTypeObject RecordColumnsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dstl._records_c.RecordColumns",
    .tp_basicsize = sizeof(RecordColumns),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A columnar buffer of change records (see the module source). Task thread only.",
    .tp_new = rc_new,
    .tp_dealloc = rc_dealloc,
    .tp_methods = rc_methods,
    .tp_as_sequence = &rc_as_sequence,
};

static PyObject *
pack_kind(PyObject *value, int kind, const char *what)
{
    Cell cell;
    if (cell_typed(value, kind, what, &cell) < 0) {
        return NULL;
    }
    return PyBytes_FromStringAndSize(cell.ptr, cell.len);
}

static PyObject *
pack_int64(PyObject *module, PyObject *value)
{
    return pack_kind(value, KIND_INT64, "int64");
}

static PyObject *
pack_float64(PyObject *module, PyObject *value)
{
    return pack_kind(value, KIND_FLOAT64, "float64");
}

static PyMethodDef records_functions[] = {
    {"pack_int64", pack_int64, METH_O, "pack_int64(value) -> bytes: 8 bytes, like struct '<q'"},
    {"pack_float64", pack_float64, METH_O,
     "pack_float64(value) -> bytes: 8 bytes, like struct '<d'"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef records_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "dstl._records_c",
    .m_doc = "A columnar buffer of change records, appended one record per C call.",
    .m_size = -1,
    .m_methods = records_functions,
};

PyMODINIT_FUNC
PyInit__records_c(void)
{
    if (PyType_Ready(&RecordColumnsType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&records_module);
    if (m == NULL) {
        return NULL;
    }
    static RecordsCAPI capi;
    capi.type = &RecordColumnsType;
    capi.append_typed = capi_append_typed;
    capi.append_typed_list = capi_append_typed_list;
    PyObject *capsule = PyCapsule_New(&capi, RECORDS_CAPI_NAME, NULL);
    int added = capsule == NULL ? -1 : PyModule_AddObjectRef(m, "_C_API", capsule);
    Py_XDECREF(capsule);
    if (added < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "RecordColumns", (PyObject *)&RecordColumnsType) < 0 ||
        PyModule_AddIntConstant(m, "KIND_NONE", KIND_NONE) < 0 ||
        PyModule_AddIntConstant(m, "KIND_BYTES", KIND_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "KIND_INT64", KIND_INT64) < 0 ||
        PyModule_AddIntConstant(m, "KIND_FLOAT64", KIND_FLOAT64) < 0 ||
        PyModule_AddIntConstant(m, "KIND_STR", KIND_STR) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
