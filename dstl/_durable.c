/* dstl._durable: publish a new local file durably, in one call that releases the GIL once.
 *
 * Why C: the upload thread writes each changelog segment while the task thread is busy
 * running Python. In CPython 3.11 every call that releases the GIL (each os.open,
 * os.write, os.fsync, os.close, os.link, os.unlink ...) must take it back afterwards, and
 * while the task thread holds it that costs a forced switch: the upload thread waits up to
 * the switch interval (5 ms), then the task thread drops the GIL and waits to get it back.
 * On this VM each such hand-off costs the task thread 150-300 us (three thread wake-ups).
 * Written with os.* calls, one local segment write cost ~15 hand-offs; this is one.
 *
 * write_new(directory, tmp_name, name, data) -> None
 *     In ``directory`` (which must exist): create ``tmp_name`` (O_EXCL), write all of
 *     ``data`` (any bytes-like object), fsync and close it, hard-link it as ``name``
 *     (failing with FileExistsError if ``name`` exists: never replaces), unlink
 *     ``tmp_name`` and fsync the directory. On any failure the temporary file is removed
 *     and OSError (FileNotFoundError for a missing directory, FileExistsError ...) is
 *     raised naming the file; ``name`` exists only if the call succeeded up to the link.
 *
 * Thread-safe (no shared state); the data buffer is held for the duration of the call.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef O_CLOEXEC
#define O_CLOEXEC 0
#endif
#ifndef O_DIRECTORY
#define O_DIRECTORY 0
#endif

/* Which path a failure names. */
enum Where { AT_DIR, AT_TMP, AT_NAME };

static int
write_all(int fd, const char *p, Py_ssize_t len)
{
    while (len > 0) {
        ssize_t n = write(fd, p, (size_t)(len > (1 << 30) ? (1 << 30) : len));
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            return -1;
        }
        p += n;
        len -= n;
    }
    return 0;
}

static int
fsync_retry(int fd)
{
    int r;
    do {
        r = fsync(fd);
    } while (r < 0 && errno == EINTR);
    return r;
}

/* All the system calls, without the GIL. 0, or -1 with errno set and ``*where`` naming
 * the path the failure concerns. close() is not retried: Linux closes the descriptor
 * even when it reports EINTR. */
static int
publish(const char *dir, const char *tmp, const char *name, const char *data,
        Py_ssize_t len, enum Where *where)
{
    *where = AT_DIR;
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) {
        return -1;
    }
    int err = 0;
    *where = AT_TMP;
    int fd = openat(dfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) {
        err = errno;
        close(dfd);
        errno = err;
        return -1;
    }
    if (write_all(fd, data, len) < 0 || fsync_retry(fd) < 0) {
        err = errno;
        close(fd);
    }
    else if (close(fd) < 0) {
        err = errno;
    }
    if (!err) {
        *where = AT_NAME;
        if (linkat(dfd, tmp, dfd, name, 0) < 0) {
            err = errno;
        }
    }
    (void)unlinkat(dfd, tmp, 0); /* after a link or a failure alike */
    if (!err) {
        *where = AT_DIR;
        if (fsync_retry(dfd) < 0) {
            err = errno;
        }
    }
    close(dfd);
    if (err) {
        errno = err;
        return -1;
    }
    return 0;
}

static PyObject *
durable_write_new(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError,
                        "write_new(directory, tmp_name, name, data) takes 4 arguments");
        return NULL;
    }
    PyObject *paths[3] = {NULL, NULL, NULL};
    PyObject *result = NULL;
    Py_buffer view = {0};
    for (int i = 0; i < 3; i++) {
        if (!PyUnicode_FSConverter(args[i], &paths[i])) {
            goto done;
        }
    }
    if (PyObject_GetBuffer(args[3], &view, PyBUF_SIMPLE) < 0) {
        goto done;
    }
    const char *dir = PyBytes_AS_STRING(paths[0]);
    const char *tmp = PyBytes_AS_STRING(paths[1]);
    const char *name = PyBytes_AS_STRING(paths[2]);
    if (strchr(tmp, '/') != NULL || strchr(name, '/') != NULL) {
        PyErr_SetString(PyExc_ValueError, "tmp_name and name must be plain file names");
        goto done;
    }
    enum Where where;
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = publish(dir, tmp, name, view.buf, view.len, &where);
    Py_END_ALLOW_THREADS
    if (failed) {
        int saved = errno;
        PyObject *path = where == AT_DIR ? args[0] : PyUnicode_FromFormat(
                                                         "%U/%U", args[0],
                                                         where == AT_TMP ? args[1] : args[2]);
        if (path != NULL) {
            errno = saved;
            PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path);
            if (where != AT_DIR) {
                Py_DECREF(path);
            }
        }
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    if (view.obj != NULL) {
        PyBuffer_Release(&view);
    }
    for (int i = 0; i < 3; i++) {
        Py_XDECREF(paths[i]);
    }
    return result;
}

static PyMethodDef durable_methods[] = {
    {"write_new", (PyCFunction)(void (*)(void))durable_write_new, METH_FASTCALL,
     "write_new(directory, tmp_name, name, data): publish a new file durably (see source)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef durable_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "dstl._durable",
    .m_doc = "Publish a new local file durably, in one call that releases the GIL once.",
    .m_size = -1,
    .m_methods = durable_methods,
};

PyMODINIT_FUNC
PyInit__durable(void)
{
    return PyModule_Create(&durable_module);
}
