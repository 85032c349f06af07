"""Run code that might crash the interpreter in a child process, and judge its end.

A child killed by a signal (SIGSEGV, SIGABRT ...) or stopped by AddressSanitizer fails
the test with a message that says so, instead of taking pytest down with it. The child
runs with CPython's debug memory allocator (``PYTHONMALLOC=debug`` unless set), and
inherits the environment, so under ``make test-asan`` (LD_PRELOAD of libasan) it runs
sanitized too.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# The implementations the tests run against: the C modules and their Python twins, by the
# suffix of their module names (dstl._records_c, dstl._records_py, ...).
IMPLS = ("c", "py")


def has_c() -> bool:
    """Whether the C extensions are built for this interpreter."""
    return all(
        importlib.util.find_spec(m) is not None
        for m in ("dstl._records_c", "dstl._durable_c", "backends._heapstate_c")
    )


def impl_params() -> list[object]:
    """``IMPLS`` as pytest params; the C one skipped where it is not built."""
    return [
        pytest.param(
            impl, marks=pytest.mark.skipif(impl == "c" and not has_c(), reason="C not built")
        )
        for impl in IMPLS
    ]


def run_child(code: str, timeout_s: float = 300, **subst: str) -> str:
    """Run ``code`` (dedented; ``{name}`` placeholders replaced by ``subst``) in a fresh
    interpreter in the repository; its stdout. Fails the calling test if the child
    crashed, was stopped by a sanitizer, or exited non-zero (an assertion in the code)."""
    source = textwrap.dedent(code)
    for name, value in subst.items():
        source = source.replace("{" + name + "}", value)
    proc = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", source],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        # The debug allocator hooks fill freed memory with 0xDD and guard each block, so a
        # use after free or an overflow crashes (or is reported) instead of going unseen.
        env={"PYTHONMALLOC": "debug", **os.environ, "PYTHONPATH": str(REPO)},
    )
    tail = proc.stderr[-4000:]
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        pytest.fail(f"the interpreter crashed ({name}) running:\n{source}\n--- stderr:\n{tail}")
    if "Sanitizer" in proc.stderr:
        pytest.fail(f"a sanitizer reported a memory error running:\n{source}\n--- stderr:\n{tail}")
    if proc.returncode != 0:
        pytest.fail(f"the child failed (exit {proc.returncode}):\n{source}\n--- stderr:\n{tail}")
    return proc.stdout
