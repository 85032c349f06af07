"""The ``changelog-state`` PySpark data source: checkpointed state and its change feed.

::

    from tools.spark import register
    register(spark)
    counts = (spark.read.format("changelog-state")
              .option("store", "s3://bucket/state")
              .option("metadata", "postgresql+psycopg://host/db")
              .option("storage.client_kwargs.endpoint_url", "http://127.0.0.1:9000")
              .option("checkpoint", "latest")
              .option("operator", "user-stats").option("state", "count")
              .load())
    changes = (spark.read.format("changelog-state").option("store", ...)
               .option("readChangeFeed", "true")
               .option("changeStartCheckpoint", 7).option("changeEndCheckpoint", 9)
               .option("state", "count").load())

Options: :mod:`tools.spark.options`; rows: :mod:`tools.spark.shape`; what is read where:
:mod:`tools.spark.plan`. Planning (``schema``, ``reader``, ``partitions``) runs in the
driver's Python planner processes and opens the metadata store there; ``read`` runs in
executors and touches only the store's files, through our FileIO, so a local path or an
S3 store (s3fs inside the tasks) work alike.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema
from pyspark.sql.types import StructType

from tools.spark import plan as plan_mod
from tools.spark.options import FORMAT, parse
from tools.spark.read import batches, read_changes, read_state
from tools.spark.shape import change_schema, state_schema


class StateDataSource(DataSource):
    """``spark.read.format("changelog-state")``: one state of a checkpoint, or the changes
    of one state between two checkpoints (``readChangeFeed``).

    The plan is made once, in :meth:`schema`, and travels with the pickled source to
    :meth:`reader` (Spark calls them in different processes).
    """

    @classmethod
    def name(cls) -> str:
        """The format name."""
        return FORMAT

    def _plan(self) -> tuple[Any, ...]:
        planned = self.__dict__.get("_planned")
        if planned is None:
            opts = parse(self.options)
            parts: list[Any]
            if opts.change_feed:
                fileio, tgt, parts = plan_mod.plan_changes(opts)
                arrow = change_schema(tgt.meta, tgt.key_serializer)
            else:
                fileio, tgt, parts = plan_mod.plan_state(opts)
                arrow = state_schema(tgt.meta, tgt.key_serializer)
            planned = (opts.change_feed, fileio, tgt, parts, arrow)
            self.__dict__["_planned"] = planned
        return tuple(planned)

    def schema(self) -> StructType:
        """The rows' Spark schema (typed by the state's serializers)."""
        return from_arrow_schema(self._plan()[4])

    def reader(self, schema: StructType) -> DataSourceReader:
        """The reader of the planned partitions."""
        feed, fileio, tgt, parts, _ = self._plan()
        return StateReader(feed, fileio, tgt, parts, to_arrow_schema(schema, timezone="UTC"))


class StateReader(DataSourceReader):
    """Reads the planned slices; pickled to the executors. Holds values only."""

    def __init__(
        self,
        feed: bool,
        fileio: Any,
        tgt: plan_mod.Target,
        parts: list[Any],
        arrow: pa.Schema,
    ) -> None:
        self.feed = feed
        self.fileio = fileio
        self.target = tgt
        self.parts = parts
        self.arrow = arrow

    def partitions(self) -> list[InputPartition]:
        """One partition per slice (key-group range, or segment file of the feed)."""
        return [InputPartition(p) for p in self.parts]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """The rows of one slice, as Arrow batches of exactly the declared schema."""
        tgt = self.target
        part = partition.value
        if part is None:  # Spark's stand-in when there is no partition (an empty feed)
            return
        if self.feed:
            for table in read_changes(self.fileio, part, tgt.meta, tgt.key_serializer):
                yield from batches(table, self.arrow)
        else:
            table = read_state(self.fileio, part, tgt.meta, tgt.key_serializer, tgt.max_parallelism)
            yield from batches(table, self.arrow)


_REGISTERED: weakref.WeakSet[SparkSession] = weakref.WeakSet()


def register(spark: SparkSession) -> None:
    """Make ``spark.read.format("changelog-state")`` available in ``spark`` (idempotent:
    Spark warns about a registration that replaces another, so it is made once)."""
    if spark not in _REGISTERED:
        spark.dataSource.register(StateDataSource)
        _REGISTERED.add(spark)
