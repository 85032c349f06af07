/* dstl._durable_c: the upload thread's blocking I/O, each in one call that releases the GIL
 * once. dstl/_durable_py.py is the same API with os.* calls (the fallback; dstl/_durable.py
 * picks).
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
 * exchange(wfd, rfd, parts, capacity, timeout) -> (status, bytes)
 *     One request/reply round trip with a helper process (dstl.encoder): write every
 *     buffer of ``parts`` to ``wfd``, then read a 16-byte header (status, length: two
 *     little-endian int64) and ``length`` reply bytes from ``rfd``. Both descriptors
 *     must be non-blocking (the call polls them), so it gives up with TimeoutError once
 *     ``timeout`` seconds have passed in total. The reply is read into a buffer sized from
 *     its header, without the GIL, then copied into the bytes returned (with the public
 *     API a bytes object cannot be made or shrunk without the GIL). ``capacity`` (>= 0)
 *     is unused since then; it stays for callers. EOFError when the peer closed its end,
 *     OSError for other failures (BrokenPipeError when it exited); after any failure the
 *     stream is out of step and the helper must be replaced.
 *
 * Safe from Python (issue 17): the parts are snapshotted into a tuple before their
 * buffers are taken (taking one may run Python code), every buffer is held until the
 * call returns, and error paths build their messages from the converted paths (str or
 * bytes alike). Public C API only.
 *
 * Thread-safe (no shared state); the data buffers are held for the duration of a call.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
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

/* The path an OSError of write_new names: the directory as given, or "directory/file"
 * built from the converted (file system encoded) names, as bytes when the directory was
 * given as bytes (like os.* functions) and as str otherwise. A new reference. */
static PyObject *
failed_path(PyObject *dir_arg, const char *dir, const char *file, enum Where where)
{
    if (where == AT_DIR) {
        return Py_NewRef(dir_arg);
    }
    PyObject *joined = PyBytes_FromFormat("%s/%s", dir, file);
    if (joined == NULL || PyBytes_Check(dir_arg)) {
        return joined;
    }
    PyObject *path = PyUnicode_DecodeFSDefaultAndSize(PyBytes_AS_STRING(joined),
                                                      PyBytes_GET_SIZE(joined));
    Py_DECREF(joined);
    return path;
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
        PyObject *path = failed_path(args[0], dir, where == AT_TMP ? tmp : name, where);
        if (path != NULL) {
            errno = saved;
            PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path);
            Py_DECREF(path);
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

/* -- exchange ------------------------------------------------------------------------ */

/* Why the exchange stopped, for the error raised once the GIL is back. */
enum Fail { FAIL_NONE, FAIL_ERRNO, FAIL_EOF, FAIL_TIMEOUT, FAIL_HEADER, FAIL_NOMEM };

static double
now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Wait until ``fd`` is ready for ``events`` or the deadline passes. */
static enum Fail
wait_fd(int fd, short events, double deadline)
{
    for (;;) {
        double left = deadline - now_s();
        if (left <= 0) {
            return FAIL_TIMEOUT;
        }
        struct pollfd p = {.fd = fd, .events = events};
        int ms = left > 1e6 ? 1000000000 : (int)(left * 1000.0) + 1;
        int r = poll(&p, 1, ms);
        if (r > 0) {
            return FAIL_NONE; /* readable, writable, or hung up: the I/O call tells which */
        }
        if (r < 0 && errno != EINTR) {
            return FAIL_ERRNO;
        }
    }
}

/* After a read or write failed: go on (interrupted, or ready after waiting for
 * ``events``), or the reason to stop. */
static enum Fail
after_error(int fd, short events, double deadline)
{
    if (errno == EINTR) {
        return FAIL_NONE;
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
        return FAIL_ERRNO;
    }
    return wait_fd(fd, events, deadline);
}

static enum Fail
send_iov(int fd, struct iovec *iov, int count, double deadline)
{
    while (count > 0) {
        ssize_t n = writev(fd, iov, count > IOV_MAX ? IOV_MAX : count);
        if (n < 0) {
            enum Fail f = after_error(fd, POLLOUT, deadline);
            if (f != FAIL_NONE) {
                return f;
            }
            continue;
        }
        while (count > 0 && (size_t)n >= iov->iov_len) {
            n -= (ssize_t)iov->iov_len;
            iov++;
            count--;
        }
        if (count > 0) {
            iov->iov_base = (char *)iov->iov_base + n;
            iov->iov_len -= (size_t)n;
        }
    }
    return FAIL_NONE;
}

static enum Fail
recv_exact(int fd, char *p, int64_t len, double deadline)
{
    while (len > 0) {
        ssize_t n = read(fd, p, (size_t)(len > (1 << 30) ? (1 << 30) : len));
        if (n > 0) {
            p += n;
            len -= n;
            continue;
        }
        if (n == 0) {
            return FAIL_EOF;
        }
        enum Fail f = after_error(fd, POLLIN, deadline);
        if (f != FAIL_NONE) {
            return f;
        }
    }
    return FAIL_NONE;
}

static int64_t
le64(const unsigned char *b)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) {
        v = (v << 8) | b[i];
    }
    return (int64_t)v;
}

static PyObject *
raise_fail(enum Fail f, int saved_errno)
{
    switch (f) {
    case FAIL_EOF:
        PyErr_SetString(PyExc_EOFError, "the helper process closed its pipe");
        break;
    case FAIL_TIMEOUT:
        PyErr_SetString(PyExc_TimeoutError, "the helper process did not answer in time");
        break;
    case FAIL_HEADER:
        PyErr_SetString(PyExc_OSError, "the helper process sent a malformed reply header");
        break;
    case FAIL_NOMEM:
        PyErr_NoMemory();
        break;
    default:
        errno = saved_errno;
        PyErr_SetFromErrno(PyExc_OSError);
    }
    return NULL;
}

static PyObject *
durable_exchange(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "exchange(wfd, rfd, parts, capacity, timeout) takes 5 arguments");
        return NULL;
    }
    long wfd = PyLong_AsLong(args[0]);
    long rfd = PyErr_Occurred() ? -1 : PyLong_AsLong(args[1]);
    Py_ssize_t capacity = PyErr_Occurred() ? -1 : PyLong_AsSsize_t(args[3]);
    double timeout = PyErr_Occurred() ? -1.0 : PyFloat_AsDouble(args[4]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (wfd < 0 || wfd > INT_MAX || rfd < 0 || rfd > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "exchange: bad file descriptor");
        return NULL;
    }
    if (capacity < 0 || !(timeout >= 0)) {
        PyErr_SetString(PyExc_ValueError, "exchange: capacity and timeout must be >= 0");
        return NULL;
    }
    /* A tuple, not the caller's list: getting a buffer may run Python code (__buffer__,
     * 3.12+), which could shrink a list under the loop below. */
    PyObject *seq = PySequence_Tuple(args[2]);
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t count = PyTuple_GET_SIZE(seq);
    if (count > INT_MAX / 2) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "exchange: too many parts");
        return NULL;
    }
    Py_buffer *views = PyMem_Calloc((size_t)count + 1, sizeof(Py_buffer));
    struct iovec *iov = PyMem_Calloc((size_t)count + 1, sizeof(struct iovec));
    PyObject *result = NULL;
    Py_ssize_t held = 0;
    if (views == NULL || iov == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < count; held++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(seq, held), &views[held], PyBUF_SIMPLE) < 0) {
            goto done;
        }
        iov[held].iov_base = views[held].buf;
        iov[held].iov_len = (size_t)views[held].len;
    }
    unsigned char header[16];
    int64_t status = 0, length = 0;
    char *body = NULL;
    enum Fail f;
    int saved = 0;
    Py_BEGIN_ALLOW_THREADS
    double deadline = now_s() + timeout;
    f = send_iov((int)wfd, iov, (int)count, deadline);
    if (f == FAIL_NONE) {
        f = recv_exact((int)rfd, (char *)header, 16, deadline);
    }
    if (f == FAIL_NONE) {
        status = le64(header);
        length = le64(header + 8);
        if (status < 0 || status > 255 || length < 0 || length > ((int64_t)1 << 40)) {
            f = FAIL_HEADER;
        }
    }
    if (f == FAIL_NONE) {
        /* Sized from the header, without the GIL (the raw allocator needs none): the whole
         * round trip stays one GIL release. */
        body = PyMem_RawMalloc(length ? (size_t)length : 1);
        f = body == NULL ? FAIL_NOMEM : recv_exact((int)rfd, body, length, deadline);
    }
    saved = errno;
    Py_END_ALLOW_THREADS
    if (f != FAIL_NONE) {
        raise_fail(f, saved);
    }
    else {
        /* One copy into the bytes object: no public API lets a bytes object be allocated
         * without the GIL or shrunk after (_PyBytes_Resize is private). */
        result = Py_BuildValue("(Ly#)", (long long)status, body, (Py_ssize_t)length);
    }
    PyMem_RawFree(body);
done:
    for (Py_ssize_t i = 0; i < held; i++) {
        PyBuffer_Release(&views[i]);
    }
    PyMem_Free(views);
    PyMem_Free(iov);
    Py_DECREF(seq);
    return result;
}

static PyMethodDef durable_methods[] = {
    {"write_new", (PyCFunction)(void (*)(void))durable_write_new, METH_FASTCALL,
     "write_new(directory, tmp_name, name, data): publish a new file durably (see source)"},
    {"exchange", (PyCFunction)(void (*)(void))durable_exchange, METH_FASTCALL,
     "exchange(wfd, rfd, parts, capacity, timeout) -> (status, bytes): one round trip "
     "with a helper process (see source)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef durable_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "dstl._durable_c",
    .m_doc = "Durable local writes and helper-process round trips, each releasing the GIL once.",
    .m_size = -1,
    .m_methods = durable_methods,
};

PyMODINIT_FUNC
PyInit__durable_c(void)
{
    return PyModule_Create(&durable_module);
}
