"""The embedded host: every task of a job as a thread of one worker process.

Sources, keyed operators and sinks run as named threads connected by bounded inboxes;
checkpoint barriers flow with the records and are handled in the configured barrier
mode. What this host shares with the Spark host (the keyed function API, the options,
the sinks' two-phase commit, the handle types) sits beside the protocol in
``coordinator/``; this package and ``coordinator/spark/`` never import each other.
"""

from __future__ import annotations

from coordinator.embedded.pipeline import (
    JobGraph,
    OperatorSpec,
    Pipeline,
    PipelineBuilder,
    SinkSpec,
    SourceSpec,
)
from coordinator.embedded.runtime import EmbeddedRuntime, RunResult
from coordinator.embedded.sources import (
    FileSource,
    GeneratorSource,
    IteratorSource,
    ReplayableSource,
    SourceReader,
    WatermarkStrategy,
)
from coordinator.functions import Context, KeyedCoFunction, KeyedFunction, StateAccess
from coordinator.options import BarrierMode, RuntimeOptions
from coordinator.sink import CollectSink, FileSink, PrintSink
from coordinator.sql_sink import SqlSink

__all__ = [
    "BarrierMode",
    "CollectSink",
    "Context",
    "EmbeddedRuntime",
    "FileSink",
    "FileSource",
    "GeneratorSource",
    "IteratorSource",
    "JobGraph",
    "KeyedCoFunction",
    "KeyedFunction",
    "OperatorSpec",
    "Pipeline",
    "PipelineBuilder",
    "PrintSink",
    "ReplayableSource",
    "RunResult",
    "RuntimeOptions",
    "SinkSpec",
    "SourceReader",
    "SourceSpec",
    "SqlSink",
    "StateAccess",
    "WatermarkStrategy",
]
