"""Every referenced file of a checkpoint, damaged in every way, is caught: never a wrong restore.

For a heap store, a RocksDB store and an unaligned checkpoint with channel state, each
file the checkpoint references is in turn bit-flipped, truncated, swapped with another
file of the checkpoint, emptied and deleted. ``statectl verify`` and ``statectl restore``
must then fail with their documented exit code (3 for a missing file, 4 for a damaged
one) and exactly one line naming the file, no traceback, and restore must write nothing.
(Regression: a flipped bit in an SST, and a heap piece swapped for another valid piece of
the same state, restored wrong state with exit 0.)
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from coordinator.checkpoint import CheckpointOptions
from coordinator.embedded import EmbeddedRuntime, RuntimeOptions
from coordinator.handles import ChannelStateHandle
from coordinator.metadata import CompletedCheckpoint, MetadataStore
from coordinator.options import BarrierMode
from dstl.errors import CorruptionError
from tools.cli import EXIT_CORRUPT, EXIT_NOT_FOUND, EXIT_OK, main
from tools.demo_job import DemoConfig, pipeline

CONFIG = DemoConfig(events_per_source=1500, users=60, rate_per_source=2500.0)


class Stop(Exception):
    """Ends a run right after a checkpoint with in-flight records was recorded."""


def _options(root: Path, **kw: object) -> RuntimeOptions:
    return RuntimeOptions(
        store_url=str(root),
        checkpoint=CheckpointOptions(interval_s=0.03, retain=2),
        materialization_interval_s=0.05,
        source_batch=64,
        **kw,  # type: ignore[arg-type]
    )


def _channel_records(cp: CompletedCheckpoint) -> int:
    return sum(
        h.records for s in cp.subtasks for h in s.handles if isinstance(h, ChannelStateHandle)
    )


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, int]]:
    """name -> (store, checkpoint id to damage)."""
    out: dict[str, tuple[Path, int]] = {}
    for name, kw in (("heap", {}), ("rocksdb", {"state_backend": "rocksdb"})):
        root = tmp_path_factory.mktemp(name)
        EmbeddedRuntime(pipeline(CONFIG, str(root / "out")), _options(root, **kw)).run()
        with MetadataStore.for_local_store(str(root)) as meta:
            latest = meta.latest("demo")
            assert latest is not None and any(
                h.materialized
                for s in latest.subtasks
                for h in s.handles
                if hasattr(h, "materialized")
            )
            out[name] = (root, latest.checkpoint_id)
    root = tmp_path_factory.mktemp("channel")
    unpaced = dataclasses.replace(CONFIG, events_per_source=6000, rate_per_source=None)
    stopped: list[int] = []

    def stop(cp: CompletedCheckpoint) -> None:
        if not stopped and _channel_records(cp) > 0:
            stopped.append(cp.checkpoint_id)
            raise Stop

    with pytest.raises(Stop):
        EmbeddedRuntime(
            pipeline(unpaced, str(root / "out")),
            _options(root, barrier_mode=BarrierMode.UNALIGNED),
            on_checkpoint=stop,
        ).run()
    out["channel"] = (root, stopped[0])
    return out


def _flip(p: Path, _other: Path) -> None:
    data = bytearray(p.read_bytes() or b"\x00")  # an empty file (a WAL) gets a byte instead
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


def _truncate(p: Path, _other: Path) -> None:
    p.write_bytes(p.read_bytes()[: max(len(p.read_bytes()) - 7, 1)])


def _swap(p: Path, other: Path) -> None:
    p.write_bytes(other.read_bytes())


def _empty(p: Path, _other: Path) -> None:
    p.write_bytes(b"")


def _delete(p: Path, _other: Path) -> None:
    p.unlink()


DAMAGES: dict[str, Callable[[Path, Path], None]] = {
    "flip": _flip,
    "truncate": _truncate,
    "swap": _swap,
    "empty": _empty,
    "delete": _delete,
}


def _files(root: Path, cid: int) -> list[str]:
    with MetadataStore.for_local_store(str(root)) as meta:
        return meta.get("demo", cid).files()


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("name", ["heap", "rocksdb", "channel"])
def test_every_damage_to_every_file_is_caught(
    stores: dict[str, tuple[Path, int]],
    name: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    source, cid = stores[name]
    files = _files(source, cid)
    assert len(files) >= 3
    if name == "channel":
        assert any("/channel-state/" in f for f in files)
    assert _run(capsys, "verify", "--store", str(source), "--checkpoint", str(cid))[0] == EXIT_OK
    caught = 0
    for i, location in enumerate(files):
        other = next(f for f in files[i + 1 :] + files[:i] if f != location)
        for damage, apply in DAMAGES.items():
            if damage in ("truncate", "empty") and (source / location).stat().st_size == 0:
                caught += 1  # nothing to take away from an empty file
                continue
            store = tmp_path / f"{i}-{damage}"
            shutil.copytree(source, store)
            apply(store / location, store / other)
            want = EXIT_NOT_FOUND if damage == "delete" else EXIT_CORRUPT
            case = f"{name}: {damage} {location}"
            code, err = _run(capsys, "verify", "--store", str(store), "--checkpoint", str(cid))
            assert code == want, f"verify, {case}: {err}"
            assert location in err and err.count("\n") == 1, f"verify, {case}: {err}"
            if "/channel-state/" not in location and "/sink/" not in location:
                out = tmp_path / f"restored-{i}-{damage}"
                code, err = _run(
                    capsys,
                    "restore",
                    "--store",
                    str(store),
                    "--checkpoint",
                    str(cid),
                    "-o",
                    str(out),
                )
                assert code == want, f"restore, {case}: {err}"
                assert err.count("\n") == 1 and "Traceback" not in err, f"restore, {case}: {err}"
                assert not out.exists()
            shutil.rmtree(store)
            caught += 1
    assert caught == 5 * len(files)


@pytest.mark.slow
def test_a_damaged_channel_state_fails_the_jobs_restore(
    stores: dict[str, tuple[Path, int]], tmp_path: Path
) -> None:
    source, cid = stores["channel"]
    store = tmp_path / "store"
    shutil.copytree(source, store)
    (victim,) = [f for f in _files(store, cid) if "/channel-state/" in f and "user-stats" in f][:1]
    _flip(store / victim, store / victim)
    unpaced = dataclasses.replace(CONFIG, events_per_source=6000, rate_per_source=None)
    with pytest.raises(Exception) as info:
        EmbeddedRuntime(
            pipeline(unpaced, str(store / "out")),
            _options(store, barrier_mode=BarrierMode.UNALIGNED),
        ).run()
    cause: BaseException | None = info.value
    while cause is not None and not isinstance(cause, CorruptionError):
        cause = cause.__cause__ or cause.__context__
    assert isinstance(cause, CorruptionError) and victim in str(cause)
