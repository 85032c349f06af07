"""The embedded host: every task of a job as a thread of one worker process.

Sources, keyed operators and sinks run as named threads connected by bounded channels;
checkpoint barriers flow with the records and are handled in the configured barrier
mode. What this host shares with the Spark host (the keyed function API, the options,
the sinks' two-phase commit, the handle types) sits beside the protocol in
``coordinator/``; this package and ``coordinator/spark/`` never import each other.
"""

from __future__ import annotations

from coordinator.embedded.pipeline import OperatorSpec, Pipeline, SinkSpec, SourceSpec
from coordinator.embedded.runtime import EmbeddedRuntime, RunResult
from coordinator.functions import Context, KeyedFunction, StateAccess
from coordinator.options import BarrierMode, RuntimeOptions

__all__ = [
    "BarrierMode",
    "Context",
    "EmbeddedRuntime",
    "KeyedFunction",
    "OperatorSpec",
    "Pipeline",
    "RunResult",
    "RuntimeOptions",
    "SinkSpec",
    "SourceSpec",
    "StateAccess",
]
