"""Which implementation of the native modules runs: the C extension, or its Python twin.

Three modules have a C extension for speed and a pure-Python fallback with the same API
and the same bytes: ``dstl._records`` (``_records_c`` / ``_records_py``), ``dstl._durable``
and ``backends._heapstate``. Each of those names is a small module that calls :func:`load`
once, at import, and re-exports what it got. The C one is used unless it cannot be
imported (no compiler at install time, an interpreter it was not built for) or the
environment variable ``CHANGELOG_STATE_PURE_PYTHON`` is set to anything but ``""`` or
``"0"`` (to run the suite against the fallbacks: ``make test-fallback``). A fallback in
use because the C module failed to import is logged once, as a warning.

The choice is per process and fixed at first import: objects of the two implementations
do not mix (a C heap state appends only to a C record buffer).
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

log = logging.getLogger(__name__)

PURE_PYTHON_ENV = "CHANGELOG_STATE_PURE_PYTHON"


def pure_python_forced() -> bool:
    """Whether the environment asks for the Python fallbacks."""
    return os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0")


def load(name: str, native_allowed: bool = True) -> ModuleType:
    """``{name}_c`` if it imports and neither the environment nor ``native_allowed`` rules
    it out, else ``{name}_py``."""
    if native_allowed and not pure_python_forced():
        try:
            return importlib.import_module(f"{name}_c")
        except ImportError as exc:
            log.warning("C extension %s_c unavailable (%s): using %s_py", name, exc, name)
    return importlib.import_module(f"{name}_py")
