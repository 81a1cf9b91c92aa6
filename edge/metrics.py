"""Prometheus metrics every skiff process shares: requests in, replies out.

Any process running an ``EdgeServer`` (LLM worker, speech worker, gateway)
can hand it an ``EdgeMetrics``; the edge then calls ``received`` when a
request's header is decoded and ``replied`` as each reply or stream event is
handed to the socket (just before, so a client never holds a reply that is
not counted yet). Those two calls are the whole hot path: one dict insert or
lookup, one clock read and one histogram observe per message. Labelled children are
made once per op (and per op and code) so no call builds a label tuple.

What the edge measures is what a client sees at this process's socket:

- end-to-end time: request received to its final reply (``ok: false``, a
  single result, or the stream event carrying ``done``);
- time to the first stream event (TTFT for ``generate`` / ``chat``, first
  audio for ``synthesize``);
- time between consecutive stream events (inter-token), the ``done`` event
  excluded: it closes the stream, it carries no new token.

Label values are bounded whatever peers send: ``op`` is one of the ops the
process serves or ``other``; ``code`` is ``ok``, a ``faults`` error code, one
of the edge's lost-peer reasons, or ``other``.

Each process keeps its own ``CollectorRegistry`` (``new_registry``) and
serves it with ``serve`` (prometheus_client's exporter, on its own thread);
the process mains go through ``start``, which reads port 0 as "off".
The exporter thread only reads the metrics; it never calls the service.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)

from faults import ErrorCode

from . import logs

_log = logs.get_logger("skiff.metrics")

OTHER = "other"
OK = "ok"
# Why the edge gave up on a peer (see EdgeServer._send): its open requests end with these.
LOST_REASONS = ("peer_gone", "peer_not_receiving", "send_failed")
MAX_TRACKED = 65_536  # open requests remembered; beyond it the oldest is forgotten

# Seconds. Wide enough for a 1 ms ping and a minute-long generation.
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
INTER_EVENT_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
    0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip

# Called with (op label, header) for every final ``ok: true`` reply; a process
# reads what it knows about from it (the LLM worker: ``usage`` token counts).
DoneHook = Callable[[str, Mapping[str, Any]], None]


def new_registry(process_metrics: bool = True) -> CollectorRegistry:
    """A registry for one process: ours, plus process / platform / GC metrics."""
    registry = CollectorRegistry(auto_describe=True)
    if process_metrics:
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            registry.register(collector)
    return registry


@dataclass
class Exporter:
    """prometheus_client's HTTP exporter, running on its own daemon thread."""

    host: str
    port: int
    _server: Any

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve(registry: CollectorRegistry, port: int, host: str = "0.0.0.0") -> Exporter:
    """Serve ``registry`` as Prometheus text on ``http://host:port/metrics``.

    ``port`` 0 picks a free port (the flags treat 0 as "off" before getting
    here); the port actually bound is ``Exporter.port``. Raises ``OSError``
    when the address is taken, so a process fails at start-up, not silently.
    """
    server, _thread = start_http_server(port, addr=host, registry=registry)
    bound = int(server.server_address[1])
    _log.info("metrics_serving", host=host, port=bound)
    return Exporter(host, bound, server)


def start(registry: CollectorRegistry | None, port: int, host: str = "0.0.0.0") -> Exporter | None:
    """A process main's exporter for ``--metrics-port``: ``None`` when metrics
    are off (``port`` 0, or no registry), else ``serve``'s.

    An address that cannot be bound (in use, not local) raises ``OSError``
    naming it, so every process stops at start-up with the same message.
    """
    if registry is None or not port:
        return None
    try:
        return serve(registry, port, host)
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise OSError(exc.errno, f"cannot serve metrics on {host}:{port}: {why}") from exc


class _OpMetrics:
    """One op's labelled children, made once."""

    __slots__ = ("duration", "inter_event", "label", "requests", "ttft")

    def __init__(self, owner: EdgeMetrics, op: str) -> None:
        self.label = op
        self.requests = owner.requests.labels(op)
        self.duration = owner.duration.labels(op)
        self.ttft = owner.ttft.labels(op)
        self.inter_event = owner.inter_event.labels(op)


class _Open:
    """A request between receipt and its final reply."""

    __slots__ = ("last", "op", "start")

    def __init__(self, op: _OpMetrics, start: float) -> None:
        self.op = op
        self.start = start
        self.last: float | None = None  # when the last stream event went out


class EdgeMetrics:
    """Request, error and latency metrics of one ``EdgeServer``.

    Not thread-safe by design: ``received``, ``replied`` and ``peer_lost``
    run on the edge's one thread. The exporter thread reads only
    prometheus_client's own (locked) values and ``len`` of the open table.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        ops: Iterable[str],
        *,
        namespace: str = "skiff",
        on_done: DoneHook | None = None,
    ) -> None:
        ns = namespace
        self.requests = Counter(
            f"{ns}_requests", "Requests received, by op.", ["op"], registry=registry
        )
        self.responses = Counter(
            f"{ns}_responses",
            "Requests finished, by op and outcome code (ok, or the error code).",
            ["op", "code"],
            registry=registry,
        )
        self.errors = Counter(
            f"{ns}_request_errors",
            "Requests that ended in an error, by op and error code.",
            ["op", "code"],
            registry=registry,
        )
        self.duration = Histogram(
            f"{ns}_request_duration_seconds",
            "Request received to final reply sent (end to end at this process).",
            ["op"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            f"{ns}_time_to_first_event_seconds",
            "Request received to its first stream event sent (TTFT for generate/chat).",
            ["op"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.inter_event = Histogram(
            f"{ns}_inter_event_seconds",
            "Time between consecutive stream events of one request (inter-token).",
            ["op"],
            buckets=INTER_EVENT_BUCKETS,
            registry=registry,
        )
        in_flight = Gauge(
            f"{ns}_requests_in_flight",
            "Requests received and not yet answered with a final reply.",
            registry=registry,
        )
        self._open: dict[tuple[bytes, Any], _Open] = {}
        in_flight.set_function(lambda: len(self._open))
        # Children appear on an op's first request, so a scrape lists only ops in use.
        self._known = frozenset(str(op) for op in ops)
        self._ops: dict[str | None, _OpMetrics] = {}
        self._codes = frozenset({OK, *(str(c) for c in ErrorCode), *LOST_REASONS})
        self._ends: dict[tuple[str, str], Callable[[], None]] = {}
        self._on_done = on_done
        self.clock = time.perf_counter

    # -- the edge's hooks ------------------------------------------------------------

    def received(self, peer: bytes, req_id: int | None, op: str | None) -> None:
        """A request's header was decoded (``req_id`` / ``op`` None when invalid)."""
        metrics = self._ops.get(op)
        if metrics is None:
            metrics = self._first(op)
        metrics.requests.inc()
        table = self._open
        table[(peer, req_id)] = _Open(metrics, self.clock())
        if len(table) > MAX_TRACKED:  # a service that never answers must not grow us
            del table[next(iter(table))]

    def replied(self, peer: bytes, header: Mapping[str, Any]) -> None:
        """A reply or stream event for ``header["id"]`` is being sent to ``peer``."""
        key = (peer, header.get("id"))
        entry = self._open.get(key)
        if entry is None:
            return
        now = self.clock()
        if header.get("ok") is True:
            if "event" in header and not header.get("done"):
                if entry.last is None:
                    entry.op.ttft.observe(now - entry.start)
                else:
                    entry.op.inter_event.observe(now - entry.last)
                entry.last = now
                return
            code = OK
            if self._on_done is not None:
                try:
                    self._on_done(entry.op.label, header)
                except Exception:  # a metrics bug must not cost a reply
                    _log.exception("metrics_hook_failed")
        else:
            error = header.get("error")
            raw = error.get("code") if isinstance(error, Mapping) else None
            code = raw if type(raw) is str and raw in self._codes else OTHER
        del self._open[key]
        entry.op.duration.observe(now - entry.start)
        self._end(entry.op.label, code)

    def peer_lost(self, peer: bytes, reason: str) -> None:
        """The edge gave up on ``peer``: its requests still open end with ``reason``
        (a reply handed to the socket before the loss has counted already)."""
        code = reason if reason in self._codes else OTHER
        for key in [k for k in self._open if k[0] == peer]:
            entry = self._open.pop(key)
            self._end(entry.op.label, code)

    # -- internals ---------------------------------------------------------------

    def _first(self, op: str | None) -> _OpMetrics:
        """An op's children, made on its first request; unknown names share ``other``."""
        label = op if op in self._known else OTHER
        metrics = self._ops.get(label)
        if metrics is None:
            metrics = self._ops[label] = _OpMetrics(self, label)
        if op in self._known:
            self._ops[op] = metrics
        return metrics

    def _end(self, op: str, code: str) -> None:
        inc = self._ends.get((op, code))
        if inc is None:
            inc = self._make_end(op, code)
        inc()

    def _make_end(self, op: str, code: str) -> Callable[[], None]:
        response = self.responses.labels(op, code)
        if code == OK:
            inc: Callable[[], None] = response.inc
        else:
            error = self.errors.labels(op, code)

            def inc() -> None:
                response.inc()
                error.inc()

        self._ends[(op, code)] = inc
        return inc


__all__ = [
    "LOST_REASONS",
    "OK",
    "OTHER",
    "DoneHook",
    "EdgeMetrics",
    "Exporter",
    "new_registry",
    "serve",
]
