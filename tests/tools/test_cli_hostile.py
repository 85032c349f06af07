"""statectl against hostile input: every command, every mistake, one line and its exit code.

Three families, each a regression of something that once went wrong:

- destructive commands: ``restore --force -o`` onto the store (or a folder of it, or ``.``
  inside it) deleted checkpoints; ``gc --delete`` through a symlink deleted referenced
  files. The store must be byte-for-byte intact afterwards.
- hostile input to every command (malformed rows, oversized ids, bad URLs, unwritable
  targets, a closed pipe): 25 of 208 ended in a traceback, 53 had the wrong exit code,
  and a metadata URL's password was printed in 9.
- hostile names planted in the metadata and in table metadata: restore created a
  directory outside its target.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from coordinator.checkpoint import CheckpointOptions
from coordinator.embedded import EmbeddedRuntime, RuntimeOptions
from tools.cli import (
    EXIT_CORRUPT,
    EXIT_FAIL,
    EXIT_IO,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_USAGE,
    main,
)
from tools.demo_job import DemoConfig, pipeline

REPO = Path(__file__).resolve().parents[2]
PASSWORD = "hunter2-s3cr3t"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pristine") / "store"
    config = DemoConfig(events_per_source=1200, users=50, rate_per_source=3000.0)
    options = RuntimeOptions(
        store_url=str(root),
        checkpoint=CheckpointOptions(interval_s=0.05, retain=2),
        materialization_interval_s=0.1,
    )
    EmbeddedRuntime(pipeline(config, str(root / "output")), options).run()
    return root


@pytest.fixture
def store(pristine: Path, tmp_path: Path) -> Path:
    root = tmp_path / "store"
    shutil.copytree(pristine, root)
    return root


def _files(root: Path) -> set[Path]:
    """Every file below ``root`` but the metadata database's (SQLite adds -wal/-shm)."""
    return {p for p in root.rglob("*") if "metadata.db" not in p.name}


def _digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith("metadata.db")
    }


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


# -- destructive commands ---------------------------------------------------------------
@pytest.mark.parametrize("where", ["store", "inside", "dot", "parent", "symlink"])
def test_restore_onto_the_store_is_refused_and_the_store_is_intact(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    before = _digest(store)
    cwd = os.getcwd()
    target = {
        "store": str(store),
        "inside": str(store / "jobs"),
        "dot": ".",
        "parent": str(store.parent),
        "symlink": str(tmp_path / "link"),
    }[where]
    if where == "symlink":
        (tmp_path / "link").symlink_to(store / "jobs")
    os.chdir(store / "jobs" / "demo" if where == "dot" else cwd)
    try:
        code, _, err = _cli(
            capsys,
            "restore",
            "--store",
            str(store),
            "--checkpoint",
            "latest",
            "-o",
            target,
            "--force",
        )
    finally:
        os.chdir(cwd)
    assert code == EXIT_REFUSED and "inside the store" in err and err.count("\n") == 1
    assert _digest(store) == before


def test_force_replaces_only_an_earlier_statectl_output(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    args = ("restore", "--store", str(store), "--checkpoint", "latest", "--force")
    code, _, err = _cli(capsys, *args, "-o", str(precious))
    assert code == EXIT_REFUSED and "not a statectl output" in err
    assert (precious / "thesis.tex").read_text() == "years of work"
    out = tmp_path / "out"
    assert _cli(capsys, *args, "-o", str(out))[0] == EXIT_OK
    assert _cli(capsys, *args, "-o", str(out))[0] == EXIT_OK  # its own output: replaced


def test_gc_through_a_symlink_keeps_every_referenced_file(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _digest(store)
    link = tmp_path / "via-link"
    link.symlink_to(store)
    code, out, _ = _cli(
        capsys, "gc", "--store", str(link), "--delete", "--min-age-s", "0", "--json"
    )
    assert code == EXIT_OK
    deleted = [p for job in json.loads(out)["jobs"] for p in job["deleted"]]
    after = _digest(store)
    assert set(after) == set(before) - set(deleted)  # only orphans went...
    assert not any(p.startswith("jobs/demo/materialized") for p in deleted)  # ...no referenced file
    assert _cli(capsys, "verify", "--store", str(store), "--checkpoint", "all")[0] == EXIT_OK


# -- hostile input to every command -------------------------------------------------------
def _corrupt_db(store: Path, sql: str) -> None:
    with sqlite3.connect(store / "metadata.db") as conn:
        conn.execute(sql)


def _damage_file(store: Path, how: str) -> None:
    db = store / "metadata.db"
    for extra in ("metadata.db-wal", "metadata.db-shm"):
        (store / extra).unlink(missing_ok=True)
    if how == "garbage":
        db.write_bytes(b"this is not a database at all" * 100)
    elif how == "empty":
        db.write_bytes(b"")
    elif how == "truncated":
        db.write_bytes(db.read_bytes()[:1500])


CASES: list[tuple[str, list[str], str | None, int, str]] = [
    # (id, argv after the command's store options, setup, exit code, text in the error)
    ("list-ok", ["checkpoints", "list"], None, EXIT_OK, ""),
    ("show-huge-id", ["checkpoints", "show", str(1 << 70)], None, EXIT_USAGE, "out of range"),
    ("show-negative-id", ["checkpoints", "show", "-5"], None, EXIT_USAGE, "checkpoint"),
    (
        "show-max-id",
        ["checkpoints", "show", str((1 << 63) - 1)],
        None,
        EXIT_NOT_FOUND,
        "does not exist",
    ),
    ("show-word", ["checkpoints", "show", "newest"], None, EXIT_USAGE, "latest"),
    (
        "restore-missing-cp",
        ["restore", "--checkpoint", "99999", "-o", "{tmp}/o"],
        None,
        EXIT_NOT_FOUND,
        "99999",
    ),
    (
        "restore-under-file",
        ["restore", "--checkpoint", "latest", "-o", "{tmp}/afile/o"],
        "afile",
        EXIT_IO,
        "afile",
    ),
    # /sys refuses writes even to root, who ignores permission bits
    (
        "restore-read-only",
        ["restore", "--checkpoint", "latest", "-o", "/sys/statectl-test/o"],
        None,
        EXIT_IO,
        "/sys",
    ),
    (
        "export-read-only",
        ["export", "--checkpoint", "latest", "-o", "/sys/statectl-test/o"],
        None,
        EXIT_IO,
        "/sys",
    ),
    (
        "export-under-file",
        ["export", "--checkpoint", "latest", "-o", "{tmp}/afile/o"],
        "afile",
        EXIT_IO,
        "afile",
    ),
    ("verify-bad-ref", ["verify", "--checkpoint", "some"], None, EXIT_USAGE, "checkpoint"),
    ("gc-job-slash", ["gc", "--job", "a/b"], None, EXIT_REFUSED, "job name"),
    ("gc-job-dots", ["gc", "--job", ".."], None, EXIT_REFUSED, "job name"),
    ("gc-age-nan", ["gc", "--min-age-s", "nan"], None, EXIT_USAGE, "min-age-s"),
    ("savepoint-unknown-job", ["savepoint", "--job", "nope"], None, EXIT_NOT_FOUND, "nope"),
    (
        "rows-bad-json",
        ["checkpoints", "show", "latest"],
        "UPDATE subtask_states SET state = '{not json'",
        EXIT_CORRUPT,
        "damaged",
    ),
    (
        "rows-bad-handle",
        ["restore", "--checkpoint", "latest", "-o", "{tmp}/o"],
        """UPDATE subtask_states SET state = '{"handles": [{"type": "changelog", "v": 1, "location": "../../etc/passwd"}]}'""",
        EXIT_CORRUPT,
        "damaged",
    ),
    (
        "rows-unknown-type",
        ["verify", "--checkpoint", "latest"],
        """UPDATE subtask_states SET state = '{"handles": [{"type": "bogus", "v": 1}]}'""",
        EXIT_CORRUPT,
        "damaged",
    ),
    (
        "rows-bad-stats",
        ["checkpoints", "list"],
        "UPDATE checkpoints SET stats = 'nope'",
        EXIT_CORRUPT,
        "damaged",
    ),
    (
        "rows-bad-time",
        ["checkpoints", "list"],
        "UPDATE checkpoints SET completed_at = 1e300",
        EXIT_OK,
        "",
    ),
    ("db-garbage", ["checkpoints", "list"], "garbage", EXIT_CORRUPT, "metadata"),
    ("db-empty", ["checkpoints", "list"], "empty", EXIT_CORRUPT, "metadata"),
    ("db-truncated", ["verify", "--checkpoint", "latest"], "truncated", EXIT_CORRUPT, "metadata"),
    (
        "db-newer-schema",
        ["checkpoints", "list"],
        "UPDATE schema_version SET version = 99",
        EXIT_FAIL,
        "newer",
    ),
]


@pytest.mark.parametrize(
    ("argv", "setup", "code", "text"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_hostile_input_to_every_command(
    store: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    setup: str | None,
    code: int,
    text: str,
) -> None:
    if setup == "afile":
        (tmp_path / "afile").write_text("x")
    elif setup in ("garbage", "empty", "truncated"):
        _damage_file(store, setup)
    elif setup is not None:
        _corrupt_db(store, setup)
    command = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    split = 2 if command[0] == "checkpoints" else 1
    full = [*command[:split], "--store", str(store), *command[split:]]
    got, _, err = _cli(capsys, *full)
    assert got == code, err
    if code != EXIT_OK:
        assert err.count("\n") == 1 and "Traceback" not in err and text in err, err


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql+psycopg://user:{PASSWORD}@127.0.0.1:1/db",
        f"postgresql+psycopg://user:{PASSWORD}@127.0.0.1:notaport/db",
        f"nosuchdialect://user:{PASSWORD}@host/db",
        f"mysql://user:{PASSWORD}@host/db",
        f"postgresql+psycopg://127.0.0.1:1/db?password={PASSWORD}",
        f"postgresql+psycopg://user@127.0.0.1:1/db?sslpassword={PASSWORD}&x=1",
        f"not a url but {PASSWORD}",
    ],
)
def test_a_metadata_password_is_never_printed(
    store: Path, capsys: pytest.CaptureFixture[str], url: str
) -> None:
    for argv in (["checkpoints", "list"], ["verify", "--checkpoint", "latest"], ["gc"]):
        split = 2 if argv[0] == "checkpoints" else 1
        code, out, err = _cli(
            capsys, *argv[:split], "--store", str(store), "--metadata", url, *argv[split:]
        )
        assert code in (EXIT_FAIL, EXIT_REFUSED, EXIT_NOT_FOUND), err
        assert PASSWORD not in out + err and err.count("\n") == 1 and "Traceback" not in err


def test_storage_option_secrets_are_never_printed(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _cli(
        capsys,
        "checkpoints",
        "list",
        "--store",
        "s3://no-such-bucket/x",
        "--metadata",
        f"sqlite:///{store}/metadata.db",
        "--storage-option",
        f"secret={PASSWORD}",
        "--storage-option",
        "client_kwargs.endpoint_url=http://127.0.0.1:1",
    )
    assert code == EXIT_OK and PASSWORD not in out + err
    code, out, err = _cli(
        capsys, "verify", "--checkpoint", "latest", "--store", "s3://no-such-bucket/x",
        "--metadata", f"sqlite:///{store}/metadata.db", "--storage-option", f"secret={PASSWORD}",
        "--storage-option", "client_kwargs.endpoint_url=http://127.0.0.1:1", "--quiet",
    )  # fmt: skip
    assert code != EXIT_OK and PASSWORD not in out + err and err.count("\n") >= 1


_FULL_DISK = """
import resource, signal, sqlite3, sys
# SQLite's shared-memory file (32 KiB) exists before the limit: only our writes hit it
keep = sqlite3.connect(sys.argv[1] + "/metadata.db")
keep.execute("SELECT count(*) FROM checkpoints").fetchall()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))
from tools.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_a_full_disk_is_one_line(store: Path, tmp_path: Path) -> None:
    """Files may grow to 1 KiB only, like a disk that fills up mid-write (root ignores
    permissions, not a file-size limit). The demo state's tables are larger."""
    for command in ("restore", "export"):
        proc = subprocess.run(
            [sys.executable, "-c", _FULL_DISK, str(store), command, "--store", str(store), "--checkpoint",
             "latest", "-o", str(tmp_path / command), "--quiet"],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == EXIT_IO, proc.stderr
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert not (tmp_path / command / "_STATECTL.json").exists()


def test_a_closed_pipe_ends_quietly(store: Path) -> None:
    cmd = (
        f"{sys.executable} -m tools.cli checkpoints show latest --store {store} --json | head -c 10"
    )
    proc = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {cmd}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in proc.stderr and "Error" not in proc.stderr, proc.stderr
    assert len(proc.stdout) == 10


def test_bad_storage_option_and_config(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _cli(
        capsys, "checkpoints", "list", "--store", str(store), "--storage-option", "noequals"
    )
    assert code == EXIT_REFUSED and "KEY=VALUE" in err
    bad = tmp_path / "c.toml"
    bad.write_text("store = [unclosed")
    code, _, err = _cli(capsys, "checkpoints", "list", "--config", str(bad))
    assert code == EXIT_REFUSED and err.count("\n") == 1
    code, _, err = _cli(capsys, "checkpoints", "list", "--config", str(tmp_path / "missing.toml"))
    assert code == EXIT_NOT_FOUND
    good = tmp_path / "ok.toml"
    good.write_text(f'store = "{store}"\n[storage_options]\nanon = false\n')
    assert _cli(capsys, "checkpoints", "list", "--config", str(good))[0] == EXIT_OK


# -- hostile names -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "name", ["../../escaped", "/tmp/absolute-escape", "..", "a/b", ".hidden", "x" * 300]
)
def test_a_hostile_operator_name_in_the_metadata_writes_nothing_outside(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    _corrupt_db(
        store, f"UPDATE subtask_states SET operator = '{name}' WHERE operator = 'user-stats'"
    )
    target = tmp_path / "deep" / "target"
    target.parent.mkdir()
    before = _files(tmp_path)
    for command in ("restore", "export"):
        code, _, err = _cli(
            capsys, command, "--store", str(store), "--checkpoint", "latest", "-o", str(target)
        )
        assert code == EXIT_CORRUPT and "corrupt metadata" in err and err.count("\n") == 1
    assert _files(tmp_path) == before and not os.path.exists("/tmp/absolute-escape")


def test_a_hostile_state_name_in_a_table_writes_nothing_outside(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A state name from a Parquet footer (the file rewritten and its hash updated, as an
    attacker who also controls the metadata would) must not become a path."""
    from coordinator.metadata import MetadataStore
    from dstl.integrity import content_hash

    with MetadataStore.for_local_store(str(store)) as meta:
        cp = meta.latest("demo")
    assert cp is not None
    piece = next(f for f in cp.files() if f.endswith(".parquet") and "/materialized/" in f)
    table = pq.read_table(store / piece)
    md = dict(table.schema.metadata)
    state_meta = json.loads(md[b"state.meta"])
    state_meta["name"] = "../../../escaped"
    md[b"state.meta"] = json.dumps(state_meta).encode()
    sink = pa.BufferOutputStream()
    pq.write_table(table.replace_schema_metadata(md), sink)
    data = sink.getvalue().to_pybytes()
    (store / piece).write_bytes(data)
    rows = sqlite3.connect(store / "metadata.db")
    for op, sub, text in rows.execute(
        "SELECT operator, subtask, state FROM subtask_states"
    ).fetchall():
        raw = json.loads(text)
        for h in raw["handles"]:
            h["changelog"] = []  # only the materialization: its names reach the output
            for m in h.get("materialized", []):
                for f in m["state_files"]:
                    if f["location"] == piece:
                        f["file_id"] = "sha256:" + content_hash(data)
                        f["size_bytes"] = len(data)
        rows.execute(
            "UPDATE subtask_states SET state = ? WHERE operator = ? AND subtask = ?",
            (json.dumps(raw), op, sub),
        )
    rows.commit()
    rows.close()
    target = tmp_path / "deep" / "target"
    target.parent.mkdir()
    before = _files(tmp_path)
    code, _, err = _cli(
        capsys, "restore", "--store", str(store), "--checkpoint", "latest", "-o", str(target)
    )
    assert code == EXIT_CORRUPT and "corrupt metadata" in err and err.count("\n") == 1
    assert _files(tmp_path) == before
