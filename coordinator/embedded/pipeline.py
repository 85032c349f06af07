"""What a pipeline author declares: a job graph, built with a small fluent builder.

::

    job = PipelineBuilder("clicks", parallelism=2)
    clicks = job.source("clicks", FileSource("data/clicks"), watermarks=WatermarkStrategy(
        timestamp=lambda r: r["ts"], max_out_of_orderness_ms=5_000))
    views = job.source("views", GeneratorSource(make_view, seed=7), parallelism=1)
    per_user = (
        clicks.filter(lambda r: r["kind"] == "click")
        .key_by(lambda r: r["user"], STR)
        .process("sessions", Sessions)            # a keyed function, timers and all
        .key_by(lambda row: row[0], STR)
        .process("totals", Totals, parallelism=3)  # a second keyed operator in a row
    )
    joined = per_user.key_by(lambda row: row[0], STR).connect(
        views.key_by(lambda v: v["user"], STR)
    ).process("join", Join)                        # a two-input keyed function
    joined.map(to_row).sink("out", SqlSink(url, "out", (("user", "text"), ...)))
    graph = job.build()

Stateless steps (``map``, ``filter``, ``flat_map``) run in the task that produces the
records (chained, as Flink chains operators); ``key_by`` routes records by key group, the
key serialized and hashed once, there; keyed operators and sinks are tasks of their own.
A parallelism left out is the job's default (``statectl run --parallelism``). The old
:class:`Pipeline` (one source, one keyed operator, one file sink) is a special case.
Plain frozen values; :mod:`coordinator.embedded.runtime` turns them into tasks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from operator import itemgetter
from typing import Any

from backends.keygroups import DEFAULT_MAX_PARALLELISM
from backends.serializers import Serializer
from coordinator.embedded.sources import IteratorSource, ReplayableSource, WatermarkStrategy
from coordinator.sink import FileSink, SinkFactory
from dstl.errors import ConfigError
from dstl.layout import check_name

MAP, FILTER, FLAT_MAP = "map", "filter", "flat_map"


@dataclass(frozen=True, slots=True)
class Transform:
    """A stateless step chained into the producing task."""

    kind: str
    fn: Callable[[Any], Any]


@dataclass(frozen=True, slots=True)
class KeySpec:
    """How an edge keys its records: ``selector(record)`` is the key (serialized with
    ``serializer``), ``value(record)`` (default: the record) what the function gets."""

    selector: Callable[[Any], Any]
    serializer: Serializer
    value: Callable[[Any], Any] | None = None


@dataclass(frozen=True, slots=True)
class SourceNode:
    """A source: ``rate_per_s`` paces each subtask (a generated load)."""

    name: str
    parallelism: int
    source: ReplayableSource
    watermarks: WatermarkStrategy | None = None
    rate_per_s: float | None = None


@dataclass(frozen=True, slots=True)
class KeyedNode:
    """A keyed stateful operator; ``two_input``: a connect, the function has
    ``process1``/``process2`` instead of ``process``."""

    name: str
    parallelism: int
    function: Callable[[], Any]
    key_serializer: Serializer
    max_parallelism: int = DEFAULT_MAX_PARALLELISM
    two_input: bool = False


@dataclass(frozen=True, slots=True)
class SinkNode:
    """A transactional sink."""

    name: str
    parallelism: int
    sink: SinkFactory


Node = SourceNode | KeyedNode | SinkNode


@dataclass(frozen=True, slots=True)
class Edge:
    """Records from ``source`` to input ``input`` of ``target``: transformed by
    ``transforms`` in the source's task, then routed by key (``key``), one to one
    (``forward``: equal parallelism) or round robin."""

    source: str
    target: str
    input: int = 0
    transforms: tuple[Transform, ...] = ()
    key: KeySpec | None = None

    def forward(self, graph: JobGraph) -> bool:
        """Whether subtask ``i`` sends to subtask ``i`` only."""
        return (
            self.key is None
            and graph.node(self.source).parallelism == graph.node(self.target).parallelism
        )


@dataclass(frozen=True, slots=True)
class JobGraph:
    """Nodes in topological order and the edges between them (validated)."""

    job_id: str
    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]

    def __post_init__(self) -> None:
        check_name("job", self.job_id)
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise ConfigError(f"job {self.job_id}: node names must be unique: {names}")
        for n in self.nodes:
            check_name("operator", n.name)
            if n.parallelism < 1:
                raise ConfigError(f"{n.name}: parallelism must be >= 1")
            if isinstance(n, KeyedNode) and n.parallelism > n.max_parallelism:
                raise ConfigError(f"{n.name}: parallelism above max parallelism")
        for e in self.edges:
            target = self.node(e.target)
            if isinstance(target, KeyedNode) != (e.key is not None):
                raise ConfigError(
                    f"{e.source} -> {e.target}: key_by exactly before a keyed operator"
                )
            if (
                e.key is not None
                and isinstance(target, KeyedNode)
                and e.key.serializer.name != target.key_serializer.name
            ):
                raise ConfigError(f"{e.target}: its inputs must key with one serializer")
        if not any(isinstance(n, SourceNode) for n in self.nodes):
            raise ConfigError(f"job {self.job_id} has no source")

    def node(self, name: str) -> Node:
        """The node called ``name``."""
        for n in self.nodes:
            if n.name == name:
                return n
        raise ConfigError(f"job {self.job_id} has no node {name!r}")

    def inputs_of(self, name: str) -> list[Edge]:
        """Edges into ``name``, by input then declaration order."""
        return sorted((e for e in self.edges if e.target == name), key=lambda e: e.input)

    def outputs_of(self, name: str) -> list[Edge]:
        """Edges out of ``name``."""
        return [e for e in self.edges if e.source == name]

    def tasks(self) -> list[tuple[str, int]]:
        """Every (node, subtask): what the coordinator waits for."""
        return [(n.name, i) for n in self.nodes for i in range(n.parallelism)]

    def graph(self) -> JobGraph:
        """Itself (the runtime accepts anything with ``graph()``)."""
        return self


# -- the builder -----------------------------------------------------------------------------
@dataclass(slots=True)
class _Decl:
    node: Node
    parallelism_given: bool


class PipelineBuilder:
    """Declares a job fluently; :meth:`build` checks it and returns the :class:`JobGraph`.

    Not thread-safe (one declaring thread); the graph it builds is immutable.
    """

    def __init__(
        self,
        job_id: str,
        parallelism: int = 1,
        max_parallelism: int = DEFAULT_MAX_PARALLELISM,
    ) -> None:
        self.job_id = job_id
        self.parallelism = parallelism
        self.max_parallelism = max_parallelism
        self._decls: list[_Decl] = []
        self._edges: list[Edge] = []

    def _add(self, node: Node, given: bool) -> None:
        self._decls.append(_Decl(node, given))

    def source(
        self,
        name: str,
        source: ReplayableSource,
        parallelism: int | None = None,
        watermarks: WatermarkStrategy | None = None,
        rate_per_s: float | None = None,
    ) -> Stream:
        """A replayable source (see :mod:`coordinator.embedded.sources`)."""
        p = parallelism or self.parallelism
        self._add(SourceNode(name, p, source, watermarks, rate_per_s), parallelism is not None)
        return Stream(self, name, ())

    def build(self, parallelism: int | None = None) -> JobGraph:
        """The graph; ``parallelism`` replaces the default of every node declared without
        one (the sources of a generator that cannot rescale should declare theirs)."""
        nodes: list[Node] = []
        for d in self._decls:
            node = d.node
            if parallelism is not None and not d.parallelism_given:
                node = replace(node, parallelism=parallelism)
            nodes.append(node)
        return JobGraph(self.job_id, tuple(nodes), tuple(self._edges))

    def graph(self) -> JobGraph:
        """:meth:`build` with the declared parallelism."""
        return self.build()


@dataclass(frozen=True, slots=True)
class Stream:
    """Records out of node ``node``, through ``transforms`` (chained, no task of their own)."""

    builder: PipelineBuilder
    node: str
    transforms: tuple[Transform, ...]

    def map(self, fn: Callable[[Any], Any]) -> Stream:
        """Each record becomes ``fn(record)``."""
        return Stream(self.builder, self.node, (*self.transforms, Transform(MAP, fn)))

    def filter(self, fn: Callable[[Any], bool]) -> Stream:
        """Only records with a true ``fn(record)`` go on."""
        return Stream(self.builder, self.node, (*self.transforms, Transform(FILTER, fn)))

    def flat_map(self, fn: Callable[[Any], Any]) -> Stream:
        """Each record becomes the records of the iterable ``fn(record)``."""
        return Stream(self.builder, self.node, (*self.transforms, Transform(FLAT_MAP, fn)))

    def key_by(
        self,
        selector: Callable[[Any], Any],
        serializer: Serializer,
        value: Callable[[Any], Any] | None = None,
    ) -> KeyedStream:
        """Partition by ``selector(record)`` (its bytes decide the key group)."""
        return KeyedStream(self, KeySpec(selector, serializer, value))

    def sink(self, name: str, sink: SinkFactory, parallelism: int | None = None) -> None:
        """A transactional sink at any parallelism (one-to-one when it equals the
        upstream's, else round robin)."""
        b = self.builder
        b._add(SinkNode(name, parallelism or b.parallelism, sink), parallelism is not None)
        b._edges.append(Edge(self.node, name, 0, self.transforms))


@dataclass(frozen=True, slots=True)
class KeyedStream:
    """A stream partitioned by key, ready for a keyed operator."""

    stream: Stream
    key: KeySpec

    def _edge(self, target: str, input_: int) -> Edge:
        return Edge(self.stream.node, target, input_, self.stream.transforms, self.key)

    def process(
        self,
        name: str,
        function: Callable[[], Any],
        parallelism: int | None = None,
        max_parallelism: int | None = None,
    ) -> Stream:
        """A keyed operator running ``function()`` (a :class:`~coordinator.functions.
        KeyedFunction`) per subtask; its output is a stream."""
        return _keyed_operator((self,), name, function, parallelism, max_parallelism)

    def connect(self, other: KeyedStream) -> ConnectedStreams:
        """Two keyed streams into one two-input keyed operator (same key type)."""
        return ConnectedStreams(self, other)


@dataclass(frozen=True, slots=True)
class ConnectedStreams:
    """Two keyed streams awaiting a two-input keyed function."""

    first: KeyedStream
    second: KeyedStream

    def process(
        self,
        name: str,
        function: Callable[[], Any],
        parallelism: int | None = None,
        max_parallelism: int | None = None,
    ) -> Stream:
        """A two-input keyed operator: ``function()`` has ``process1`` (records of the
        first stream) and ``process2`` (of the second), timers as a keyed function."""
        inputs = (self.first, self.second)
        return _keyed_operator(inputs, name, function, parallelism, max_parallelism)


def _keyed_operator(
    inputs: tuple[KeyedStream, ...],
    name: str,
    function: Callable[[], Any],
    parallelism: int | None,
    max_parallelism: int | None,
) -> Stream:
    """Declare a keyed operator fed by ``inputs`` (input ``i`` from ``inputs[i]``)."""
    b = inputs[0].stream.builder
    node = KeyedNode(
        name,
        parallelism or b.parallelism,
        function,
        inputs[0].key.serializer,
        max_parallelism or b.max_parallelism,
        two_input=len(inputs) == 2,
    )
    b._add(node, parallelism is not None)
    b._edges.extend(keyed._edge(name, i) for i, keyed in enumerate(inputs))
    return Stream(b, name, ())


# -- the one-shape pipeline of before: a special case --------------------------------------------
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
    function: Callable[[], Any]
    max_parallelism: int = DEFAULT_MAX_PARALLELISM


@dataclass(frozen=True, slots=True)
class SinkSpec:
    """The transactional file sink (parallelism 1): committed parts go to ``output_url``."""

    name: str
    output_url: str


@dataclass(frozen=True, slots=True)
class Pipeline:
    """A linear job: source -> keyed operator -> sink; :meth:`graph` is its job graph."""

    job_id: str
    source: SourceSpec
    operator: OperatorSpec
    sink: SinkSpec

    def graph(self) -> JobGraph:
        """The same job declared with the builder."""
        s, o = self.source, self.operator
        b = PipelineBuilder(self.job_id, max_parallelism=o.max_parallelism)
        stream = b.source(s.name, IteratorSource(s.open), s.parallelism, rate_per_s=s.rate_per_s)
        keyed = stream.key_by(itemgetter(0), o.key_serializer, value=itemgetter(1))
        out = keyed.process(o.name, o.function, o.parallelism, o.max_parallelism)
        out.sink(self.sink.name, FileSink(self.sink.output_url), 1)
        return b.build()
