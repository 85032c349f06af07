/* The C API of dstl._records_c for other extension modules (backends._heapstate_c).
 *
 *     RecordsCAPI *api = PyCapsule_Import(RECORDS_CAPI_NAME, 0);
 *
 * ``type`` is RecordColumns (not subclassable); the appends check it too and raise
 * TypeError for anything else;
 * ``append_typed(rc, args)`` is RecordColumns.append_typed with the five arguments
 * (op, key, key_group, user_key, value): 1 when the buffer is full, 0 when not, -1 with
 * an exception set (then nothing was appended). ``append_typed_list(rc, args)`` is the
 * same with ``args[4]`` a list: its elements are converted by the value kind and framed
 * into one value as backends.serializers.pack_list frames them (a list's LIST_SET).
 * ``args`` must be references the caller holds for the whole call: converting them may
 * run Python code (__index__, __float__). Task thread only, like the buffer.
 */
#ifndef DSTL_RECORDS_CAPI_H
#define DSTL_RECORDS_CAPI_H

#include <Python.h>

#define RECORDS_CAPI_NAME "dstl._records_c._C_API"

typedef struct {
    PyTypeObject *type;
    int (*append_typed)(PyObject *rc, PyObject *const *args);
    int (*append_typed_list)(PyObject *rc, PyObject *const *args);
} RecordsCAPI;

#endif
