"""Dotted option keys: parsed once at the edge, unknown keys and bad values rejected."""

from __future__ import annotations

import pytest

from coordinator.checkpoint import CheckpointOptions
from dstl.errors import ConfigError
from dstl.options import boolean, optional_float, parse_dotted
from materializer.scheduler import MaterializationOptions


def test_checkpoint_options_from_dotted_keys() -> None:
    opts = CheckpointOptions.from_dict({"checkpoint.interval-s": "2.5", "checkpoint.retain": "3"})
    assert opts == CheckpointOptions(interval_s=2.5, retain=3)


def test_materialization_options_from_dotted_keys() -> None:
    opts = MaterializationOptions.from_dict({"materialization.interval-s": 7})
    assert opts.interval_s == 7.0


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"checkpoint.interval": "1"}, "unknown checkpoint option 'checkpoint.interval'"),
        ({"checkpoint.retain": "many"}, "option 'checkpoint.retain': cannot parse 'many'"),
        ({"checkpoint.retain": "0"}, "retain"),
    ],
)
def test_bad_checkpoint_options_are_clear_errors(values: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        CheckpointOptions.from_dict(values)


def test_converters() -> None:
    assert optional_float("none") is None and optional_float("1.5") == 1.5
    assert boolean("on") is True and boolean("no") is False
    with pytest.raises(ValueError):
        boolean("maybe")
    keys = {"x.flag": ("flag", boolean)}
    assert parse_dotted(keys, {"x.flag": "yes"}, "x") == {"flag": True}
