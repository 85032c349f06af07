"""Benchmarks (not tests): ``python -m tools.bench run NAME [--quick] --json OUT``.

A benchmark is a module ``tools/bench/<name>.py`` (dashes in NAME become underscores)
exposing ``COLUMNS: list[str]`` and ``run(quick: bool) -> dict`` whose result holds a list
``cases`` (rows printed with ``COLUMNS``) plus any summary fields. Each benchmark compares
against a baseline measured in the same run (a ratio), since the machine is shared.
"""
