"""The state server: one process per job and executor host that keeps the ranges' state.

Spark runs a task in whichever Python worker of the executor is free, so the worker that
gets a partition changes from batch to batch (about half the time on ``local[2]``): state
kept in a worker would be restored every other batch. The ranges live in this process
instead, which every worker of the host reaches through a Unix socket in the job's
directory (:meth:`StepConfig.server_dir`), and which outlives the workers, the tasks and
the driver. It also gives the host one :class:`~dstl.changelog.ChangelogStorage`: the
persists of tasks that end together share one segment upload.

Life: the first task that finds no server takes ``spawn.lock`` (``flock``) and starts one
(``python -m coordinator.spark.server DIR``, its storage options on stdin, never on the
command line); the server holds ``server.lock`` for its life, so a killed server's
directory is recognised as dead and taken over (its socket file is replaced). It stops
after ``idle_timeout_s`` without a request, closing every range (materializations in
flight finish; nothing referenced is deleted).

Protocol (one request per connection): frames of an 8-byte big-endian length and bytes.
The task sends the JSON request, the pickled :class:`StepConfig`, then one Arrow IPC stream
per record batch and an empty frame; the server answers with one JSON frame,
``{"ok": ack}`` or ``{"error": class name, "message": one line}``.

Threads: the main thread accepts; each connection gets a named thread
(``state-conn-<n>``); :class:`~coordinator.spark.host.StateHost` is thread-safe.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import fcntl
import io
import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from backends import localdirs
from coordinator.metadata import one_line
from coordinator.spark.config import StepConfig
from coordinator.spark.host import BatchAck, BatchRequest, StateHost
from dstl.errors import StateBackendError, StorageError
from dstl.handles import handle_from_json, handle_to_json

log = logging.getLogger(__name__)

SOCKET = "server.sock"
SERVER_LOCK = "server.lock"
SPAWN_LOCK = "spawn.lock"
_LEN = struct.Struct(">Q")
MAX_FRAME = 1 << 31
START_TIMEOUT_S = 60.0


class StateServerError(StorageError):
    """The host's state server could not be reached or started, or broke off a request."""


# -- framing --------------------------------------------------------------------------
def send_frame(out: io.BufferedIOBase, data: bytes | memoryview) -> None:
    """Write one length-prefixed frame."""
    out.write(_LEN.pack(len(data)))
    out.write(data)


def recv_frame(inp: io.BufferedIOBase) -> bytes:
    """Read one length-prefixed frame; a closed or oversized stream is an error."""
    head = inp.read(_LEN.size)
    if len(head) != _LEN.size:
        raise StateServerError("connection closed before a frame")
    (n,) = _LEN.unpack(head)
    if n > MAX_FRAME:
        raise StateServerError(f"frame of {n} bytes refused")
    data = inp.read(n)
    if len(data) != n:
        raise StateServerError("connection closed inside a frame")
    return data


def batch_frame(batch: pa.RecordBatch) -> bytes:
    """One record batch as a self-contained Arrow IPC stream."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def _read_batches(inp: io.BufferedIOBase) -> Iterator[pa.RecordBatch]:
    while True:
        frame = recv_frame(inp)
        if not frame:
            return
        yield from pa.ipc.open_stream(pa.py_buffer(frame))


def request_to_json(request: BatchRequest) -> dict[str, Any]:
    """The JSON form of a request (handles as in the metadata store)."""
    return {
        "subtask": request.subtask,
        "batch_id": request.batch_id,
        "base_id": request.base_id,
        "base_handles": [handle_to_json(h) for h in request.base_handles],
        "watermark_ms": request.watermark_ms,
        "now_ms": request.now_ms,
        "attempt": request.attempt,
    }


def request_from_json(raw: dict[str, Any]) -> BatchRequest:
    """Inverse of :func:`request_to_json`."""
    return BatchRequest(
        int(raw["subtask"]),
        int(raw["batch_id"]),
        int(raw["base_id"]),
        tuple(handle_from_json(h) for h in raw["base_handles"]),
        int(raw["watermark_ms"]),
        int(raw["now_ms"]),
        int(raw.get("attempt", 0)),
    )


def ack_to_json(ack: BatchAck) -> dict[str, Any]:
    """The JSON form of an acknowledgement."""
    return {
        "subtask": ack.subtask,
        "keyed": handle_to_json(ack.keyed),
        "output": None if ack.output is None else handle_to_json(ack.output),
        "stats": ack.stats,
    }


def ack_from_json(raw: dict[str, Any]) -> BatchAck:
    """Inverse of :func:`ack_to_json`."""
    output = raw.get("output")
    return BatchAck(
        int(raw["subtask"]),
        handle_from_json(raw["keyed"]),
        None if output is None else handle_from_json(output),
        dict(raw["stats"]),
    )


# -- the server -----------------------------------------------------------------------
class StateServer:
    """Accepts task connections for one job on this host until idle for too long.

    The accepting thread owns the listening socket; ``_lock`` guards ``_active`` and
    ``_last_request``.
    """

    def __init__(self, directory: str, host: StateHost, idle_timeout_s: float) -> None:
        self.directory = directory
        self.host = host
        self.idle_timeout_s = idle_timeout_s
        self._lock = threading.Lock()
        self._active = 0
        self._last_request = time.monotonic()
        self._connections = 0

    def serve(self, listener: socket.socket) -> None:
        """Accept until idle; then close every range."""
        listener.settimeout(1.0)
        try:
            while True:
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    if self._idle():
                        log.info("state server idle, stopping dir=%s", self.directory)
                        return
                    continue
                with self._lock:
                    self._active += 1
                    self._connections += 1
                    n = self._connections
                threading.Thread(
                    target=self._serve_one, args=(conn,), name=f"state-conn-{n}", daemon=True
                ).start()
        finally:
            listener.close()
            self.host.close()

    def _idle(self) -> bool:
        with self._lock:
            return (
                self._active == 0 and time.monotonic() - self._last_request >= self.idle_timeout_s
            )

    def _serve_one(self, conn: socket.socket) -> None:
        try:
            with conn, conn.makefile("rwb") as stream:
                try:
                    raw = json.loads(recv_frame(stream))
                    config = recv_frame(stream)
                    ack = self.host.process(config, request_from_json(raw), _read_batches(stream))
                    reply: dict[str, Any] = {"ok": ack_to_json(ack)}
                except Exception as exc:  # every failure goes back to the task as one line
                    log.warning("request failed error=%s", exc, exc_info=exc)
                    reply = {"error": type(exc).__name__, "message": one_line(exc)}
                with contextlib.suppress(OSError):  # the task may be gone (killed, retried)
                    send_frame(stream, json.dumps(reply).encode())
                    stream.flush()
        finally:
            with self._lock:
                self._active -= 1
                self._last_request = time.monotonic()


def _take_lock(path: str) -> int | None:
    """An exclusive ``flock`` on ``path`` (which then names our pid); None if held."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def live_servers(local_dir: str) -> dict[str, int]:
    """The live state servers under ``local_dir``: their directory -> pid."""
    found: dict[str, int] = {}
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(local_dir):
            path = os.path.join(entry.path, SERVER_LOCK)
            if not entry.is_dir() or not os.path.exists(path):
                continue
            fd = _take_lock(path)
            if fd is not None:  # free: nobody serves this directory
                os.close(fd)
                continue
            with open(path) as fh:
                text = fh.read().strip()
            if text.isdigit():
                found[entry.path] = int(text)
    return found


def stop_servers(local_dir: str, sig: int = signal.SIGTERM) -> list[int]:
    """Signal every live state server under ``local_dir`` (tests, the demo); their pids."""
    pids = list(live_servers(local_dir).values())
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return pids


def run_server(directory: str, settings: dict[str, Any]) -> int:
    """The server process's main: take the server lock, listen, say ready, serve."""
    lock = _take_lock(os.path.join(directory, SERVER_LOCK))
    if lock is None:
        print("busy", flush=True)  # another server owns the directory: use that one
        return 0
    path = os.path.join(directory, SOCKET)
    with contextlib.suppress(FileNotFoundError):  # a dead server's socket (we hold its lock)
        os.unlink(path)
    localdirs.reclaim(os.path.join(directory, "rocksdb"), recursive=True)  # a killed one's
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    host = StateHost(settings["store_url"], settings["storage_options"], settings["job"], directory)
    server = StateServer(directory, host, float(settings["idle_timeout_s"]))
    print("ready", flush=True)
    sys.stdout.close()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    server.serve(listener)
    return 0


# -- the task side --------------------------------------------------------------------
def _connect(path: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    return sock


def connect(config: StepConfig) -> socket.socket:
    """A connection to this host's state server for ``config``'s job, started if needed."""
    directory = config.server_dir()
    path = os.path.join(directory, SOCKET)
    sock = _connect(path)
    if sock is not None:
        return sock
    os.makedirs(directory, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(directory, SPAWN_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # one spawner at a time; the others then connect
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            sock = _connect(path)
            if sock is not None:
                return sock
            # "busy": an idle server is still shutting down (it holds the server lock);
            # once it is gone, the next spawn takes over
            if _spawn(directory, config) == "ready":
                sock = _connect(path)
                if sock is not None:
                    return sock
            time.sleep(0.2)
        raise StateServerError("the state server does not answer", path)
    finally:
        os.close(fd)


def _spawn(directory: str, config: StepConfig) -> str:
    """Start a server for ``directory``: "ready", or "busy" if another still holds it."""
    settings = {
        "store_url": config.store_url,
        "storage_options": config.storage_options,
        "job": config.job,
        "idle_timeout_s": config.server_idle_timeout_s,
    }
    env = dict(os.environ)
    # The worker's import path (on a cluster it holds the shipped --py-files archives).
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    log_path = os.path.join(directory, "server.log")
    with open(log_path, "ab") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "coordinator.spark.server", directory],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            env=env,
            start_new_session=True,  # outlives the worker, the task and the driver
        )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(json.dumps(settings).encode())
        proc.stdin.close()
    except OSError as exc:
        raise StateServerError(f"cannot start the state server ({exc})", log_path) from exc
    ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
    line = proc.stdout.readline().decode().strip() if ready else ""  # "" if it died
    proc.stdout.close()
    if line not in ("ready", "busy"):  # "busy": another server holds the directory
        raise StateServerError(f"the state server did not start (see {log_path})", directory)
    return line


def call(
    config: StepConfig,
    request: BatchRequest,
    batches: Iterator[pa.RecordBatch],
    abort_after: int | None = None,
) -> BatchAck:
    """Send one task's request and rows; the server's acknowledgement, or its error.

    ``abort_after`` (fault injection) drops the connection after that many batches.
    """
    sock = connect(config)
    with sock, sock.makefile("rwb") as stream:
        try:
            send_frame(stream, json.dumps(request_to_json(request)).encode())
            send_frame(stream, config.encode())
            for i, batch in enumerate(batches):
                if abort_after is not None and i >= abort_after:
                    return _abort(sock)
                send_frame(stream, batch_frame(batch))
            if abort_after is not None:
                return _abort(sock)
            send_frame(stream, b"")
            stream.flush()
            reply = json.loads(recv_frame(stream))
        except OSError as exc:
            raise StateServerError(f"lost the state server ({exc})", config.server_dir()) from exc
    if "ok" in reply:
        return ack_from_json(reply["ok"])
    raise remote_error(str(reply.get("error")), str(reply.get("message")))


def _abort(sock: socket.socket) -> BatchAck:
    sock.shutdown(socket.SHUT_RDWR)
    raise StateServerError("connection dropped on purpose (injected fault)")


def remote_error(name: str, message: str) -> Exception:
    """The server's error as the same class of our error tree; anything else (the keyed
    function's own errors) fails the job."""
    import dstl.errors as errors

    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, StateBackendError):
        return cls(message)
    if name == StateServerError.__name__:
        return StateServerError(message)
    return errors.JobFailedError(f"{name} in the stateful step: {message}")


def main(argv: list[str] | None = None) -> int:
    """``python -m coordinator.spark.server DIR`` with the settings JSON on stdin."""
    parser = argparse.ArgumentParser(prog="python -m coordinator.spark.server")
    parser.add_argument("directory")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(process)d %(threadName)s %(message)s"
    )
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 <pid>: every thread's stack to the log
    settings = json.loads(sys.stdin.read())
    return run_server(args.directory, settings)


if __name__ == "__main__":
    sys.exit(main())
