"""Dependencies point one way: dstl <- backends <- materializer <- coordinator <- tools.

A package may import itself and the packages to its left, never one to its right. Inside
``coordinator/`` the two hosts (``coordinator.embedded``, ``coordinator.spark``) never
import each other, and what they share (the protocol, the metadata store, the keyed
function API, options, sinks, handle types) imports neither host. pyspark is imported
only by the Spark host (``coordinator.spark``) and the Spark tools (``tools.spark``, and
the benchmark against Spark's own state store), so nothing else needs a JVM or pays for
importing it.
Checked statically (ast) on every .py file of the five packages, including imports inside
functions and ``if TYPE_CHECKING:`` blocks, and ``importlib.import_module("...")`` /
``__import__("...")`` with a literal name.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

LAYERS = ("dstl", "backends", "materializer", "coordinator", "tools")
HOSTS = ("coordinator.embedded", "coordinator.spark")
# The Spark benchmark also runs Spark's own state store, the peer it is measured against.
SPARK_PACKAGES = ("coordinator.spark", "tools.spark", "tools.bench.spark_pipeline")
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Violation:
    module: str
    line: int
    imported: str
    reason: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line}: imports {self.imported!r}: {self.reason}"


def _allowed(own: str, target_top: str) -> bool:
    if target_top not in LAYERS:
        return True  # stdlib / third party
    return LAYERS.index(target_top) <= LAYERS.index(own)


def _host_of(module: str) -> str | None:
    return next((h for h in HOSTS if module == h or module.startswith(h + ".")), None)


def _host_violation(module: str, target: str) -> str | None:
    """Why ``module`` may not import ``target`` across the hosts, or None."""
    if not module.startswith("coordinator"):
        return None
    target_host = _host_of(target)
    if target_host is None:
        return None
    own_host = _host_of(module)
    if own_host is None:
        return f"shared coordinator code may not import the host {target_host}"
    if own_host != target_host:
        return f"host {own_host} may not import host {target_host}"
    return None


def check_source(source: str, module: str, *, is_package: bool = False) -> list[Violation]:
    """Violations of the layer order in ``source``, the code of module ``module``.

    ``module`` is dotted (``backends.heap``); ``is_package`` is True for an ``__init__.py``
    (relative imports then resolve against the module itself).
    """
    own = module.split(".")[0]
    if own not in LAYERS:
        raise ValueError(f"{module} is not in one of {LAYERS}")
    package = module.split(".") if is_package else module.split(".")[:-1]
    tree = ast.parse(source, filename=module)
    found: list[Violation] = []

    in_spark = any(module == p or module.startswith(p + ".") for p in SPARK_PACKAGES)

    def check(line: int, target: str) -> None:
        top = target.split(".")[0]
        if not _allowed(own, top):
            found.append(Violation(module, line, target, f"{own} may not import {top} (above it)"))
        elif (why := _host_violation(module, target)) is not None:
            found.append(Violation(module, line, target, why))
        elif top == "pyspark" and not in_spark:
            found.append(
                Violation(
                    module, line, target, f"only {' and '.join(SPARK_PACKAGES)} import pyspark"
                )
            )

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                check(node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                assert node.module is not None
                check(node.lineno, node.module)
                for alias in node.names:  # ``from coordinator import embedded``
                    if _host_of(node.module) is None and _host_of(f"{node.module}.{alias.name}"):
                        check(node.lineno, f"{node.module}.{alias.name}")
            else:
                up = node.level - 1
                if up >= len(package):
                    dots = "." * node.level
                    found.append(
                        Violation(
                            module,
                            node.lineno,
                            f"{dots}{node.module or ''}",
                            "relative import leaves its own package",
                        )
                    )
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = (
                func.attr
                if isinstance(func, ast.Attribute)
                else func.id
                if isinstance(func, ast.Name)
                else ""
            )
            first = node.args[0]
            if (
                name in ("import_module", "__import__")
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
                and not first.value.startswith(".")
            ):
                check(node.lineno, first.value)
    return found


def iter_modules(root: Path) -> list[tuple[Path, str, bool]]:
    """(path, dotted module name, is_package) for every .py file of the layers under root."""
    out: list[tuple[Path, str, bool]] = []
    for layer in LAYERS:
        base = root / layer
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(root)
            if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
                continue
            parts = list(rel.with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            out.append((path, ".".join(parts), is_package))
    return out


def check_tree(root: Path) -> list[Violation]:
    found: list[Violation] = []
    for path, module, is_package in iter_modules(root):
        found.extend(check_source(path.read_text(), module, is_package=is_package))
    return found


# --- the real tree -----------------------------------------------------------------------


def test_packages_import_only_downwards() -> None:
    violations = check_tree(REPO)
    assert not violations, (
        "imports against dstl <- backends <- materializer <- coordinator <- tools:\n"
        + "\n".join(map(str, violations))
    )


# --- the checker itself -------------------------------------------------------------------

BAD = [
    ("dstl.fileio", "import backends"),
    ("dstl.fileio", "import backends.heap as h"),
    ("dstl.fileio", "import os, coordinator.metadata"),
    ("dstl.fileio", "from tools import cli"),
    ("backends.heap", "from materializer.upload import x"),
    ("backends.heap", "from coordinator import store"),
    ("materializer.run", "import coordinator"),
    ("coordinator.store", "from tools.cli import main"),
    ("backends.heap", "def f():\n    import coordinator\n"),
    (
        "backends.heap",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from materializer import M\n",
    ),
    ("backends.heap", "import importlib\nimportlib.import_module('coordinator.runtime')\n"),
    ("backends.heap", "__import__('tools')\n"),
    ("backends.heap", "from ... import x\n"),  # backends.heap: '..' is already the root
    ("dstl", "from .. import x\n"),  # dstl/__init__.py
    ("coordinator.embedded.tasks", "from coordinator.spark.host import H\n"),
    ("coordinator.spark.host", "import coordinator.embedded.channels\n"),
    ("coordinator.spark.host", "from coordinator import embedded\n"),
    ("coordinator.metadata", "from coordinator.embedded.channel_state import x\n"),
    ("coordinator.functions", "def f():\n    import coordinator.spark\n"),
    ("tools.cli.compact", "from pyspark.sql import SparkSession\n"),
    ("tools.bench.compaction", "import pyspark\n"),
    ("coordinator.embedded.tasks", "def f():\n    import pyspark.sql.functions as F\n"),
    ("tools.sparkling", "import pyspark\n"),  # a prefix of tools.spark is not it
]

GOOD = [
    ("dstl.fileio", "import os\nimport fsspec\nfrom dstl.errors import E\nfrom . import layout\n"),
    ("dstl.fileio", "import dstlx\nimport toolsy\nimport backends_extra\n"),  # prefixes only
    ("backends.heap", "import dstl\nfrom dstl.changelog import W\nfrom backends.state import S\n"),
    ("backends.sub.mod", "from .. import state\nfrom ..keygroups import KeyGroupRange\n"),
    ("materializer.run", "import dstl, backends.heap\nfrom materializer import x\n"),
    ("coordinator.store", "from materializer import M\nimport backends\nimport sqlalchemy\n"),
    ("tools.cli", "import coordinator, materializer, backends, dstl, tools.bench\n"),
    ("tools.bench.run", "from .. import cli\n"),
    ("backends.heap", "importlib.import_module('.x', 'backends')\n"),  # relative: own package
    ("coordinator.embedded.tasks", "from coordinator.embedded.channels import C\n"),
    ("coordinator.embedded.tasks", "from coordinator import functions, sink, handles\n"),
    ("coordinator.spark.host", "from coordinator.functions import KeyedRunner\n"),
    ("coordinator.embedded", "from coordinator.embedded.runtime import R\n"),
    ("tools.cli.run", "from coordinator.embedded import EmbeddedRuntime\n"),
    ("tools.spark.x", "import coordinator.spark, coordinator.embedded\n"),
    ("tools.spark.source", "from pyspark.sql.datasource import DataSource\n"),
    ("tools.spark", "import pyspark\n"),
    ("coordinator.spark.host", "import pyspark.sql\nfrom coordinator import metadata\n"),
]


@pytest.mark.parametrize(("module", "source"), BAD)
def test_checker_flags(module: str, source: str) -> None:
    assert len(check_source(source, module, is_package="." not in module)) == 1


@pytest.mark.parametrize(("module", "source"), GOOD)
def test_checker_accepts(module: str, source: str) -> None:
    assert check_source(source, module, is_package="." not in module) == []


def test_check_tree_walks_files(tmp_path: Path) -> None:
    (tmp_path / "dstl" / "sub").mkdir(parents=True)
    (tmp_path / "dstl" / "__init__.py").write_text("from dstl.sub import x\n")
    (tmp_path / "dstl" / "sub" / "__init__.py").write_text("from .. import y\n")
    (tmp_path / "dstl" / "sub" / "bad.py").write_text("\n\nfrom coordinator import z\n")
    (tmp_path / "dstl" / "__pycache__").mkdir()
    (tmp_path / "dstl" / "__pycache__" / "junk.py").write_text("import tools\n")
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "cli.py").write_text("import dstl, coordinator\n")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.py").write_text("import tools\n")  # not a layer: ignored
    assert [str(v) for v in check_tree(tmp_path)] == [
        "dstl.sub.bad:3: imports 'coordinator': dstl may not import coordinator (above it)"
    ]
