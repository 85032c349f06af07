"""Real services for the tests, all on 127.0.0.1: S3 (moto's server), PostgreSQL, Spark.

Used by the fixtures in ``tests/conftest.py``. Nothing here skips: a service that cannot
start raises :class:`ServiceStartError` naming the service and the step that failed, so CI
runs every marker or fails loudly.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

LOCALHOST = "127.0.0.1"
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
# Variables that would point boto3/s3fs at a real account or another endpoint.
AWS_ENV_CLEARED = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL")


class ServiceStartError(RuntimeError):
    """A test service could not be started (or checked) at the named step."""

    def __init__(self, service: str, step: str, detail: str) -> None:
        self.service = service
        self.step = step
        super().__init__(f"{service}: {step} failed: {detail}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOCALHOST, 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def patched_environ(values: Mapping[str, str], cleared: tuple[str, ...] = ()) -> Iterator[None]:
    """Set (and unset) environment variables, restoring the previous values afterwards."""
    saved = {k: os.environ.get(k) for k in (*values, *cleared)}
    os.environ.update(values)
    for k in cleared:
        os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --------------------------------------------------------------------------------------------
# S3 through moto's server
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class S3Endpoint:
    """A running S3 HTTP endpoint. ``storage_options`` are s3fs/fsspec kwargs."""

    endpoint_url: str

    @property
    def storage_options(self) -> dict[str, Any]:
        # A fresh dict each time: callers may mutate theirs. No region_name (moto's bucket
        # creation through s3fs fails with it).
        return {
            "key": AWS_ENV["AWS_ACCESS_KEY_ID"],
            "secret": AWS_ENV["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"endpoint_url": self.endpoint_url},
        }

    def boto3_client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=AWS_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=AWS_ENV["AWS_SECRET_ACCESS_KEY"],
            region_name=AWS_ENV["AWS_DEFAULT_REGION"],
        )


@dataclass(frozen=True)
class S3Bucket:
    """A bucket on the test endpoint: ``url`` is ``s3://<name>``."""

    url: str
    storage_options: dict[str, Any] = field(compare=False, hash=False)

    @property
    def name(self) -> str:
        return self.url.removeprefix("s3://")


@contextlib.contextmanager
def s3_server() -> Iterator[S3Endpoint]:
    """Run moto's threaded S3 server on 127.0.0.1 (free port) with dummy credentials."""
    with patched_environ(AWS_ENV, AWS_ENV_CLEARED):
        try:
            from moto.server import ThreadedMotoServer
        except ImportError as e:
            raise ServiceStartError("s3", "import moto.server", repr(e)) from e
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
        server = ThreadedMotoServer(ip_address=LOCALHOST, port=0, verbose=False)
        # start() waits forever if the server thread dies while binding: run it with a limit.
        starter = threading.Thread(target=server.start, name="moto-start", daemon=True)
        starter.start()
        starter.join(timeout=30)
        if starter.is_alive():
            raise ServiceStartError("s3", "start moto server", "not listening after 30 s")
        try:
            host, port = server.get_host_and_port()
            endpoint = S3Endpoint(endpoint_url=f"http://{host}:{port}")
            try:
                endpoint.boto3_client().list_buckets()
            except Exception as e:
                raise ServiceStartError(
                    "s3", f"first request to {endpoint.endpoint_url}", repr(e)
                ) from e
            yield endpoint
        finally:
            server.stop()


@contextlib.contextmanager
def s3_bucket_on(endpoint: S3Endpoint) -> Iterator[S3Bucket]:
    """A fresh, uniquely named bucket; emptied and deleted afterwards."""
    name = f"test-{uuid.uuid4().hex[:24]}"
    client = endpoint.boto3_client()
    try:
        client.create_bucket(Bucket=name)
    except Exception as e:
        raise ServiceStartError("s3", f"create bucket {name}", repr(e)) from e
    try:
        yield S3Bucket(url=f"s3://{name}", storage_options=endpoint.storage_options)
    finally:
        with contextlib.suppress(Exception):  # best effort: moto keeps buckets in memory
            paginator = client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=name):
                keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if keys:
                    client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
            client.delete_bucket(Bucket=name)


# --------------------------------------------------------------------------------------------
# PostgreSQL in a scratch directory
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PostgresServer:
    """A running scratch PostgreSQL cluster: superuser ``postgres``, trust auth, TCP only."""

    host: str
    port: int
    user: str
    version: str
    datadir: Path

    def url(self, dbname: str = "postgres", driver: str = "postgresql+psycopg") -> str:
        """SQLAlchemy URL for ``dbname`` on this server."""
        return f"{driver}://{self.user}@{self.host}:{self.port}/{dbname}"

    def execute_autocommit(self, sql: str) -> None:
        """Run one statement on the ``postgres`` database outside a transaction."""
        import psycopg

        with psycopg.connect(
            host=self.host,
            port=self.port,
            user=self.user,
            dbname="postgres",
            autocommit=True,
            connect_timeout=10,
        ) as conn:
            conn.execute(sql.encode())

    def create_database(self, name: str) -> None:
        _check_identifier(name)
        self.execute_autocommit(f'CREATE DATABASE "{name}"')

    def drop_database(self, name: str) -> None:
        _check_identifier(name)
        self.execute_autocommit(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _check_identifier(name: str) -> None:
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", name):
        raise ValueError(f"not a plain database name: {name!r}")


def find_pg_bindir() -> Path:
    """The newest PostgreSQL server bindir (``$PG_BINDIR`` wins if set)."""
    if env := os.environ.get("PG_BINDIR"):
        candidates = [Path(env)]
    else:
        found = glob.glob("/usr/lib/postgresql/*/bin")

        def version(p: str) -> tuple[int, ...]:
            v = Path(p).parent.name
            return tuple(int(x) for x in v.split(".")) if re.fullmatch(r"[\d.]+", v) else (0,)

        candidates = [Path(p) for p in sorted(found, key=version, reverse=True)]
        if which := shutil.which("pg_ctl"):
            candidates.append(Path(which).resolve().parent)
    for c in candidates:
        if (c / "initdb").is_file() and (c / "pg_ctl").is_file():
            return c
    raise ServiceStartError(
        "postgres",
        "find server binaries",
        "no initdb/pg_ctl under /usr/lib/postgresql/*/bin or on PATH "
        "(run tools/setup/bootstrap.sh, or set PG_BINDIR)",
    )


def _run(cmd: list[str], *, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "LC_ALL": "C", "LANG": "C"},
    )


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


@contextlib.contextmanager
def postgres_server_proc() -> Iterator[PostgresServer]:
    """initdb + pg_ctl start in a scratch dir; pg_ctl stop -m fast and remove it afterwards.

    ``initdb`` refuses to run as root, so as root both run as the ``postgres`` OS user via
    ``runuser``, in a directory under /tmp that user owns.
    """
    bindir = find_pg_bindir()
    as_user: list[str] = []
    scratch_parent: str | None = None
    if os.geteuid() == 0:
        runuser = shutil.which("runuser")
        if runuser is None:
            raise ServiceStartError("postgres", "find runuser", "runuser not on PATH (util-linux)")
        try:
            import pwd

            pwd.getpwnam("postgres")
        except KeyError as e:
            raise ServiceStartError(
                "postgres", "find OS user 'postgres'", "no such user (initdb refuses root)"
            ) from e
        as_user = [runuser, "-u", "postgres", "--"]
        scratch_parent = "/tmp"  # world-traversable, unlike a root-only $TMPDIR
    scratch = Path(tempfile.mkdtemp(prefix="pgtest-", dir=scratch_parent))
    datadir = scratch / "data"
    sockdir = scratch / "sock"
    logfile = scratch / "server.log"
    started = False
    try:
        sockdir.mkdir()
        for p in (scratch, sockdir):
            p.chmod(0o700)
            if as_user:
                shutil.chown(p, user="postgres", group="postgres")

        init = _run(
            [
                *as_user,
                str(bindir / "initdb"),
                "-D",
                str(datadir),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
                "--no-instructions",
            ],
            cwd=scratch,
            timeout=120,
        )
        if init.returncode != 0:
            raise ServiceStartError(
                "postgres", f"initdb ({bindir})", _tail(init.stdout + init.stderr)
            )

        port = 0
        for attempt in range(3):  # the free port can be taken between probe and bind
            port = free_port()
            opts = (
                f"-c listen_addresses={LOCALHOST} -p {port} -k {sockdir} "
                "-c fsync=off -c full_page_writes=off"
            )
            start = _run(
                [
                    *as_user,
                    str(bindir / "pg_ctl"),
                    "-D",
                    str(datadir),
                    "-l",
                    str(logfile),
                    "-w",
                    "-t",
                    "60",
                    "-o",
                    opts,
                    "start",
                ],
                cwd=scratch,
                timeout=90,
            )
            if start.returncode == 0:
                started = True
                break
            log = logfile.read_text(errors="replace") if logfile.exists() else ""
            if ("could not bind" in log or "already in use" in log) and attempt < 2:
                continue
            raise ServiceStartError(
                "postgres",
                f"pg_ctl start on {LOCALHOST}:{port}",
                _tail(start.stdout + start.stderr + "\n--- server.log ---\n" + log),
            )

        version = (datadir / "PG_VERSION").read_text().strip()
        server = PostgresServer(
            host=LOCALHOST, port=port, user="postgres", version=version, datadir=datadir
        )
        try:
            server.execute_autocommit("SELECT 1")
        except Exception as e:
            raise ServiceStartError("postgres", f"connect to {server.url()}", repr(e)) from e
        yield server
    finally:
        if started:
            stop = _run(
                [
                    *as_user,
                    str(bindir / "pg_ctl"),
                    "-D",
                    str(datadir),
                    "-w",
                    "-t",
                    "30",
                    "-m",
                    "fast",
                    "stop",
                ],
                cwd=scratch,
                timeout=60,
            )
            if stop.returncode != 0:
                _run(
                    [
                        *as_user,
                        str(bindir / "pg_ctl"),
                        "-D",
                        str(datadir),
                        "-m",
                        "immediate",
                        "stop",
                    ],
                    cwd=scratch,
                    timeout=60,
                )
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def postgres_database(server: PostgresServer) -> Iterator[str]:
    """A fresh database on ``server``; yields its SQLAlchemy URL, drops it afterwards."""
    name = f"test_{uuid.uuid4().hex[:16]}"
    try:
        server.create_database(name)
    except Exception as e:
        raise ServiceStartError("postgres", f"CREATE DATABASE {name}", repr(e)) from e
    try:
        yield server.url(name)
    finally:
        server.drop_database(name)


# --------------------------------------------------------------------------------------------
# Spark
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def spark_session(app_name: str = "changelog-state-tests") -> Iterator[SparkSession]:
    """A local[2] SparkSession bound to 127.0.0.1, UI off, log level WARN."""
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        raise ServiceStartError(
            "spark", "find java", "no java on PATH and no JAVA_HOME (run tools/setup/bootstrap.sh)"
        )
    env = {
        "SPARK_LOCAL_IP": LOCALHOST,
        # Python workers must be this interpreter (the venv), not whatever python3 is on PATH.
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
    }
    with patched_environ(env):
        try:
            from pyspark.sql import SparkSession
        except ImportError as e:
            raise ServiceStartError("spark", "import pyspark", repr(e)) from e
        warehouse = tempfile.mkdtemp(prefix="spark-warehouse-")
        builder: Any = SparkSession.builder
        builder = (
            builder.master("local[2]")
            .appName(app_name)
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.driver.host", LOCALHOST)
            .config("spark.driver.bindAddress", LOCALHOST)
            .config("spark.sql.session.timeZone", "UTC")
            .config("spark.sql.warehouse.dir", warehouse)
        )
        t0 = time.monotonic()
        try:
            session = builder.getOrCreate()
        except Exception as e:
            shutil.rmtree(warehouse, ignore_errors=True)
            raise ServiceStartError(
                "spark", f"SparkSession.getOrCreate after {time.monotonic() - t0:.1f} s", repr(e)
            ) from e
        try:
            session.sparkContext.setLogLevel("WARN")
            yield session
        finally:
            session.stop()
            shutil.rmtree(warehouse, ignore_errors=True)
