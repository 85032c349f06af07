"""Copy the tree to OUT and build its C extensions there with AddressSanitizer.

    python tools/setup/build_asan.py OUT

For ``make test-asan``, which then runs the native tests from OUT with libasan preloaded
(CPython is not built with ASan; preloading its runtime makes the sanitized extension
modules loadable, and PYTHONMALLOC=malloc routes Python objects through the intercepted
malloc so overflows and uses after free of them are seen). The copy keeps the normal
build of the work tree untouched: ASan-built modules do not load without the preload.
The extensions are those of pyproject.toml, built with its flags plus the sanitizer's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from setuptools import Distribution, Extension  # type: ignore[import-untyped]
from setuptools.command.build_ext import build_ext  # type: ignore[import-untyped]

ROOT = Path(__file__).resolve().parents[2]
ASAN_FLAGS = ["-fsanitize=address", "-fno-omit-frame-pointer", "-g", "-O1"]


def copy_tree(out: Path) -> None:
    """The work tree's files (tracked, and new ones not ignored) into ``out``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    shutil.rmtree(out, ignore_errors=True)
    for name in filter(None, listed.decode().split("\0")):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the work tree is skipped
            target = out / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def extensions() -> list[Extension]:
    """pyproject.toml's extension modules, with the sanitizer's flags added."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [
        Extension(
            spec["name"],
            sources=spec["sources"],
            include_dirs=spec.get("include-dirs", []),
            depends=spec.get("depends", []),
            extra_compile_args=[*spec.get("extra-compile-args", []), *ASAN_FLAGS],
            extra_link_args=["-fsanitize=address"],
        )
        for spec in config["tool"]["setuptools"]["ext-modules"]
    ]


def main(out: Path) -> None:
    """Copy, then build every extension in place in the copy (fails on any error)."""
    copy_tree(out)
    os.chdir(out)
    command = build_ext(Distribution({"name": "asan-build", "ext_modules": extensions()}))
    command.inplace = True
    command.force = True
    command.ensure_finalized()
    command.run()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: build_asan.py OUT")
    main(Path(sys.argv[1]).resolve())
