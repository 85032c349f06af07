"""What a pipeline author declares: the job's source, keyed operator and sink.

Plain, frozen values; the runtime (:mod:`coordinator.embedded.runtime`) turns them into
tasks. The options of a run are :class:`coordinator.options.RuntimeOptions`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from backends.keygroups import (
    DEFAULT_MAX_PARALLELISM,
)
from backends.serializers import Serializer
from coordinator.functions import KeyedFunction


@dataclass(frozen=True, slots=True)
class SourceSpec:
    """A replayable source: ``open(subtask, parallelism, offset)`` yields ``(key, value)``
    records from ``offset`` (records already emitted by that subtask)."""

    name: str
    parallelism: int
    open: Callable[[int, int, int], Iterator[tuple[Any, Any]]]
    rate_per_s: float | None = None


@dataclass(frozen=True, slots=True)
class OperatorSpec:
    """The keyed stateful operator."""

    name: str
    parallelism: int
    key_serializer: Serializer
    function: Callable[[], KeyedFunction]
    max_parallelism: int = DEFAULT_MAX_PARALLELISM


@dataclass(frozen=True, slots=True)
class SinkSpec:
    """The transactional file sink (parallelism 1): committed parts go to ``output_url``."""

    name: str
    output_url: str


@dataclass(frozen=True, slots=True)
class Pipeline:
    """A linear job: source -> keyed operator -> sink."""

    job_id: str
    source: SourceSpec
    operator: OperatorSpec
    sink: SinkSpec
