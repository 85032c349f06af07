"""Which implementation runs (dstl/native.py): the C modules unless they do not import or
the environment asks for the Python twins; the heap states follow the record buffer."""

from __future__ import annotations

import os
import textwrap

import pytest

from tests.native.child import has_c, run_child

REPORT = """
import dstl._durable, dstl._records, backends._heapstate
print(dstl._records.NATIVE, dstl._durable.NATIVE, backends._heapstate.NATIVE)
"""


@pytest.mark.skipif(not has_c(), reason="C extensions not built")
def test_the_c_modules_by_default() -> None:
    env = os.environ.pop("CHANGELOG_STATE_PURE_PYTHON", None)
    try:
        assert run_child(REPORT).split() == ["True", "True", "True"]
    finally:
        if env is not None:
            os.environ["CHANGELOG_STATE_PURE_PYTHON"] = env


@pytest.mark.parametrize("value", ["1", "yes"])
def test_the_environment_forces_the_twins(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHANGELOG_STATE_PURE_PYTHON", value)
    assert run_child(REPORT).split() == ["False", "False", "False"]


def test_a_c_module_that_does_not_import_falls_back_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The record buffer's C module fails to import (as without a compiler): its twin runs,
    # and so do the heap states' (a C heap state appends only to a C buffer).
    monkeypatch.delenv("CHANGELOG_STATE_PURE_PYTHON", raising=False)
    out = run_child(
        textwrap.dedent(
            """
        import logging, sys
        logging.basicConfig(stream=sys.stdout, format="%(levelname)s %(message)s")

        class NoC:
            def find_spec(self, name, path=None, target=None):
                if name == "dstl._records_c":
                    raise ImportError("no compiler here")

        sys.meta_path.insert(0, NoC())
        """
        )
        + REPORT
    )
    assert out.splitlines()[-1].split() == ["False", "True", "False"]
    assert "WARNING C extension dstl._records_c unavailable" in out


def test_no_stale_extension_shadows_the_selecting_modules() -> None:
    # An extension module wins over a .py of the same name: a build from before the C
    # modules were renamed *_c would replace dstl/_records.py and friends unnoticed
    # (tools/setup/bootstrap.sh deletes them).
    out = run_child(
        """
        import dstl._durable, dstl._records, backends._heapstate
        for m in (dstl._records, dstl._durable, backends._heapstate):
            print(m.__file__)
        """
    )
    assert all(line.endswith(".py") for line in out.split()), out
