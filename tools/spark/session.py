"""The Spark session of a command: the one ``spark-submit`` made, or a local one.

Under ``spark-submit`` (the JVM started this Python process: ``PYSPARK_GATEWAY_PORT`` is
set) the submitted session is used as configured. Otherwise a local session starts
(``local[2]`` unless a master is given) with the settings ENVIRONMENT.md measured here:
127.0.0.1, no UI, no console progress, this interpreter for the Python workers (they
import this project), and the JVM's own output (its start-up banner, warnings, Python
workers' stderr) in a log file instead of the command's stderr, which keeps one line per
failure. Caller's thread only: the JVM's output is redirected by swapping file
descriptors 1 and 2 around its start.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator

from pyspark.sql import SparkSession

DEFAULT_MASTER = "local[2]"


def submitted() -> bool:
    """Whether ``spark-submit`` (or pyspark's shell) started this process."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


@contextlib.contextmanager
def _output_to(path: str) -> Iterator[None]:
    """Point file descriptors 1 and 2 at ``path`` (child processes inherit it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


def get_session(
    master: str | None = None, app: str = "changelog-state"
) -> tuple[SparkSession, str | None]:
    """The session, and the file the JVM's output goes to (None under spark-submit)."""
    if submitted() and master is None:
        return SparkSession.builder.getOrCreate(), None
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    log_fd, log_path = tempfile.mkstemp(prefix="statectl-spark-", suffix=".log")
    os.close(log_fd)
    builder = (
        SparkSession.builder.master(master or DEFAULT_MASTER)
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", os.environ["SPARK_LOCAL_IP"])
        .config("spark.driver.bindAddress", os.environ["SPARK_LOCAL_IP"])
    )
    with _output_to(log_path):
        session = builder.getOrCreate()
        session.sparkContext.setLogLevel("WARN")
    return session, log_path
