"""Spark jobs over a store: its checkpointed state as DataFrames, and offline compaction.

- :func:`register` adds the ``changelog-state`` data source to a Spark session
  (:mod:`tools.spark.source`): one DataFrame per state of a checkpoint, or the change feed
  between two checkpoints.
- :mod:`tools.spark.compact` folds a checkpoint's log into new materialized tables on
  Spark (``statectl compact``, or ``spark-submit tools/spark/compact.py``).

pyspark is imported only below this package (and ``coordinator/spark/``); importing
``tools.spark`` itself does not import it.
"""

from __future__ import annotations

from typing import Any


def register(spark: Any) -> None:
    """Make ``spark.read.format("changelog-state")`` available in ``spark`` (idempotent)."""
    from tools.spark.source import register as register_source

    register_source(spark)


__all__ = ["register"]
