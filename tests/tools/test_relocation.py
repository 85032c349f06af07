"""A store (and a savepoint) copied or synced elsewhere restores as it did.

Regression: the metadata recorded absolute file URLs, so a store directory copied
elsewhere (a backup, a bucket synced to another prefix) refused to restore ("... is not
inside store ..."). Locations are now relative to the store root.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from coordinator.checkpoint import CheckpointOptions
from coordinator.embedded import EmbeddedRuntime, RuntimeOptions
from coordinator.metadata import MetadataStore
from coordinator.sink import read_output
from dstl.fileio import FileIO
from tests.services import S3Bucket
from tools.cli import EXIT_OK, main
from tools.demo_job import DemoConfig, pipeline, reference

CONFIG = DemoConfig(events_per_source=1500, users=80, rate_per_source=3000.0)


def _options(store: str, **kw: object) -> RuntimeOptions:
    return RuntimeOptions(
        store_url=store,
        checkpoint=CheckpointOptions(interval_s=0.05, retain=2),
        materialization_interval_s=0.1,
        **kw,  # type: ignore[arg-type]
    )


def _tables(directory: Path) -> dict[str, list[dict[str, object]]]:
    return {
        str(p.relative_to(directory)): sorted(pq.read_table(p).to_pylist(), key=repr)
        for p in sorted(directory.rglob("*.parquet"))
    }


def _restore(capsys: pytest.CaptureFixture[str], out: Path, *args: str) -> dict[str, object]:
    assert main(["restore", *args, "-o", str(out), "--quiet"]) == EXIT_OK, capsys.readouterr().err
    capsys.readouterr()
    return _tables(out)


@pytest.mark.parametrize("backend", ["heap", "rocksdb"])
def test_a_copied_store_and_savepoint_restore_from_their_new_place(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], backend: str
) -> None:
    original = tmp_path / "original"
    EmbeddedRuntime(
        pipeline(CONFIG, str(tmp_path / "out")), _options(str(original), state_backend=backend)
    ).run()
    assert main(["savepoint", "--store", str(original), "--json"]) == EXIT_OK
    savepoint = json.loads(capsys.readouterr().out)["savepoint"]
    with MetadataStore.for_local_store(str(original)) as meta:
        latest = meta.latest("demo", kind="checkpoint")
    assert latest is not None
    expected = _restore(
        capsys, tmp_path / "r0", "--store", str(original), "--checkpoint", str(latest.checkpoint_id)
    )

    moved = tmp_path / "elsewhere" / "backup"
    shutil.copytree(original, moved)
    shutil.rmtree(original)  # nothing may still point at the old place
    assert main(["verify", "--store", str(moved), "--checkpoint", "all", "--quiet"]) == EXIT_OK
    assert (
        _restore(
            capsys,
            tmp_path / "r1",
            "--store",
            str(moved),
            "--checkpoint",
            str(latest.checkpoint_id),
        )
        == expected
    )

    # the savepoint alone: the job's own files gone, its copies are all it needs
    shutil.rmtree(moved / "jobs")
    assert (
        _restore(capsys, tmp_path / "r2", "--store", str(moved), "--checkpoint", str(savepoint))
        == expected
    )

    # and the job itself resumes from the copied savepoint into its own output and
    # finishes exactly once (the savepoint's staged transactions are published again on
    # restore, idempotently: into a new output directory they would be duplicates)
    out = tmp_path / "out"
    longer = DemoConfig(events_per_source=2500, users=80, rate_per_source=None)
    result = EmbeddedRuntime(
        pipeline(longer, str(out)), _options(str(moved), state_backend=backend)
    ).run(restore_from=savepoint)
    assert result.restored_from == savepoint
    want, _ = reference(longer)
    assert sorted(tuple(r) for r in read_output(FileIO(str(out)))) == want


def test_a_bucket_synced_to_another_prefix_restores(
    s3_bucket: S3Bucket, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    metadata = f"sqlite:///{tmp_path}/metadata.db"
    first = f"{s3_bucket.url}/first"
    EmbeddedRuntime(
        pipeline(CONFIG, str(tmp_path / "out")),
        RuntimeOptions(
            store_url=first,
            metadata_url=metadata,
            storage_options=s3_bucket.storage_options,
            checkpoint=CheckpointOptions(interval_s=0.1, retain=1),
            materialization_interval_s=0.2,
        ),
    ).run()
    s3 = [
        f"--storage-option=client_kwargs.endpoint_url={s3_bucket.storage_options['client_kwargs']['endpoint_url']}"
    ]
    for key in ("key", "secret"):
        if key in s3_bucket.storage_options:
            s3.append(f"--storage-option={key}={s3_bucket.storage_options[key]}")
    args = ("--metadata", metadata, "--checkpoint", "latest", *s3)
    expected = _restore(capsys, tmp_path / "r0", "--store", first, *args)
    src, dst = (
        FileIO(first, s3_bucket.storage_options),
        FileIO(f"{s3_bucket.url}/second", s3_bucket.storage_options),
    )
    for info in src.list(""):  # what `aws s3 sync` would do
        dst.write_new(info.path, src.read(info.path))
        src.delete(info.path)
    assert (
        _restore(capsys, tmp_path / "r1", "--store", f"{s3_bucket.url}/second", *args) == expected
    )
