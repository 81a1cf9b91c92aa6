"""The gateway's Prometheus metrics (``--metrics-port``).

Requests, outcomes and latencies as clients see them at the gateway's front
come from the shared edge metrics (``edge/metrics.py``) under the
``skiff_gateway`` namespace, the same names the workers export under
``skiff``:

- ``skiff_gateway_requests_total{op}``, ``skiff_gateway_responses_total{op,code}``
  (``code`` is ``ok`` or the error code), ``skiff_gateway_request_errors_total{op,code}``;
- ``skiff_gateway_request_duration_seconds{op}`` (histogram, receipt to final
  reply), ``skiff_gateway_time_to_first_event_seconds{op}``,
  ``skiff_gateway_inter_event_seconds{op}``, ``skiff_gateway_requests_in_flight``.

The gateway's own, below: workers up, per-worker in-flight and load,
forwarded bytes and messages, migrations, affinity entries. Gauges are set
from the loop every tick (50 ms), so the exporter thread never reads the
loop's data structures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from edge.metrics import EdgeMetrics
from protocol.transport import Op

from .host import Host
from .pool import LLM, SPEECH, WorkerConn

NAMESPACE = "skiff_gateway"
OPS = (*(str(op) for op in Op), "gateway_status", "gateway_drain")


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        ns = NAMESPACE
        self.registry = registry
        self.edge = EdgeMetrics(registry, OPS, namespace=ns)
        forwarded = Counter(
            f"{ns}_forwarded_bytes",
            "Bytes passed through (header + buffer frames), by direction.",
            ["direction"],
            registry=registry,
        )
        messages = Counter(
            f"{ns}_forwarded_messages",
            "Messages passed through, by direction.",
            ["direction"],
            registry=registry,
        )
        self._bytes_in = forwarded.labels("to_worker").inc
        self._bytes_out = forwarded.labels("to_client").inc
        self._msgs_in = messages.labels("to_worker").inc
        self._msgs_out = messages.labels("to_client").inc
        self.migrations = Counter(
            f"{ns}_migrations",
            "Live session moves by drains, by result (ok, failed).",
            ["result"],
            registry=registry,
        )
        self.downs = Counter(
            f"{ns}_worker_down",
            "Times a worker was marked down.",
            ["worker"],
            registry=registry,
        )
        self.workers_up = Gauge(
            f"{ns}_workers_up", "Workers answering health checks, by kind.", ["kind"],
            registry=registry,
        )  # fmt: skip
        self.worker_up = Gauge(
            f"{ns}_worker_up", "1 when the worker is up.", ["worker", "kind"], registry=registry
        )
        self.worker_in_flight = Gauge(
            f"{ns}_worker_in_flight",
            "Client requests forwarded to the worker and not yet answered.",
            ["worker"],
            registry=registry,
        )
        self.worker_score = Gauge(
            f"{ns}_worker_load_score",
            "Routing load score 4*queued + running - free_lanes (estimated).",
            ["worker"],
            registry=registry,
        )
        self.sessions = Gauge(
            f"{ns}_sessions", "Named sessions in the affinity table.", registry=registry
        )
        self.held = Gauge(
            f"{ns}_held_requests",
            "Requests waiting for their session to finish moving.",
            registry=registry,
        )
        self.cache_routed = Gauge(
            f"{ns}_cache_routed",
            "Routing decisions that went to a worker holding the prompt's prefix (since start).",
            registry=registry,
        )

    # -- hot path ----------------------------------------------------------------------

    def to_worker(self, nbytes: int) -> None:
        self._msgs_in()
        self._bytes_in(nbytes)

    def to_client(self, header_bytes: int, buffers: Sequence[Any]) -> None:
        self._msgs_out()
        self._bytes_out(header_bytes + sum(len(f) for f in buffers) if buffers else header_bytes)

    # -- events and ticks --------------------------------------------------------------

    def migrated(self, result: str) -> None:
        self.migrations.labels(result).inc()

    def worker_down(self, w: WorkerConn) -> None:
        self.downs.labels(w.name).inc()

    def refresh(self, svc: Host) -> None:
        up = {LLM: 0, SPEECH: 0}
        for w in svc.pool.workers.values():
            up[w.kind] += w.up
            self.worker_up.labels(w.name, w.kind).set(1 if w.up else 0)
            self.worker_in_flight.labels(w.name).set(svc.client_work(w))
            if w.kind == LLM:
                self.worker_score.labels(w.name).set(w.candidate().score)
        for kind, n in up.items():
            self.workers_up.labels(kind).set(n)
        self.sessions.set(len(svc.affinity))
        self.held.set(sum(len(v) for v in svc.held.values()))
        self.cache_routed.set(svc.router.cache_routed)
