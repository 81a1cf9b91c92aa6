"""Prometheus metrics of the edge, without a model: ``EdgeMetrics`` driven with
a fake clock (exact sums, no timing thresholds), an ``EdgeServer`` with a toy
service reporting every request, and how a process main starts its exporter.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from _metrics_scrape import Samples, parse, scrape, value

from conftest import WAIT_S
from edge import EdgeConfig, EdgeServer, Outgoing, Request
from edge.metrics import EdgeMetrics, new_registry, serve, start
from protocol import Client, SkiffError, transport
from protocol.transport import error_reply, event_reply, ok_reply

# -- EdgeMetrics alone ----------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def edge_metrics(ops: tuple[str, ...] = ("ping", "generate")) -> tuple[EdgeMetrics, Any, FakeClock]:
    registry = new_registry(process_metrics=False)
    metrics = EdgeMetrics(registry, ops)
    clock = FakeClock()
    metrics.clock = clock
    return metrics, registry, clock


def registry_samples(registry: Any) -> Samples:
    from prometheus_client import generate_latest

    return parse(generate_latest(registry).decode())


def test_edge_metrics_stream_reply_error_and_lost_peer() -> None:
    m, registry, clock = edge_metrics()
    # A stream: received at 100, events at 100.25, 100.35, 100.40, done at 100.5.
    m.received(b"a", 1, "generate")
    for t in (100.25, 100.35, 100.40):
        clock.now = t
        m.replied(b"a", event_reply(1, {"event": "token", "token": 5}))
    clock.now = 100.5
    m.replied(b"a", event_reply(1, {"event": "done", "done": True}))
    # A single reply, an error reply, an unknown op, a lost peer.
    m.received(b"a", 2, "ping")
    clock.now = 101.0
    m.replied(b"a", ok_reply(2, {"pong": True}))
    m.received(b"b", 2, "ping")  # same id, other peer: a different request
    m.replied(b"b", error_reply(2, "bad_request", "no"))
    m.received(b"a", 3, "no_such_op")
    m.replied(b"a", error_reply(3, "unknown_op", "no"))
    m.received(b"a", 4, "generate")
    m.replied(b"a", error_reply(4, "made_up_code", "odd"))  # bounded: becomes "other"
    m.received(b"c", 7, "generate")
    m.received(b"c", 8, "generate")
    s = registry_samples(registry)
    assert value(s, "skiff_requests_in_flight") == 2
    m.peer_lost(b"c", "peer_gone")
    m.replied(b"c", ok_reply(7, {}))  # after the loss: untracked, not counted twice
    m.replied(b"z", ok_reply(9, {}))  # never received: ignored

    s = registry_samples(registry)
    assert value(s, "skiff_requests_total", op="generate") == 4
    assert value(s, "skiff_requests_total", op="ping") == 2
    assert value(s, "skiff_requests_total", op="other") == 1
    assert value(s, "skiff_responses_total", op="generate", code="ok") == 1
    assert value(s, "skiff_responses_total", op="ping", code="ok") == 1
    assert value(s, "skiff_responses_total", op="ping", code="bad_request") == 1
    assert value(s, "skiff_request_errors_total", op="ping", code="bad_request") == 1
    assert value(s, "skiff_request_errors_total", op="other", code="unknown_op") == 1
    assert value(s, "skiff_request_errors_total", op="generate", code="other") == 1
    assert value(s, "skiff_responses_total", op="generate", code="peer_gone") == 2
    assert value(s, "skiff_requests_in_flight") == 0
    # TTFT: one stream, 0.25 s. Inter-event: 0.10 + 0.05 (the done event is not a gap).
    assert value(s, "skiff_time_to_first_event_seconds_count", op="generate") == 1
    assert value(s, "skiff_time_to_first_event_seconds_sum", op="generate") == pytest.approx(0.25)
    assert value(s, "skiff_inter_event_seconds_count", op="generate") == 2
    assert value(s, "skiff_inter_event_seconds_sum", op="generate") == pytest.approx(0.15)
    # End to end: the stream (0.5 s) and the error reply (0 s); lost requests got no reply.
    assert value(s, "skiff_request_duration_seconds_count", op="generate") == 2
    assert value(s, "skiff_request_duration_seconds_sum", op="generate") == pytest.approx(0.5)
    assert value(s, "skiff_request_duration_seconds_count", op="ping") == 2


def test_edge_metrics_done_hook_sees_final_ok_replies_only() -> None:
    seen: list[tuple[str, Mapping[str, Any]]] = []
    registry = new_registry(process_metrics=False)

    def hook(op: str, header: Mapping[str, Any]) -> None:
        seen.append((op, header))
        raise RuntimeError("a broken hook must not cost the reply")

    m = EdgeMetrics(registry, ["generate"], on_done=hook)
    m.received(b"a", 1, "generate")
    m.replied(b"a", event_reply(1, {"event": "token"}))
    m.replied(b"a", event_reply(1, {"event": "done", "done": True, "usage": {}}))
    m.received(b"a", 2, "generate")
    m.replied(b"a", error_reply(2, "cancelled", "x"))
    assert [(op, h.get("event")) for op, h in seen] == [("generate", "done")]
    s = registry_samples(registry)
    assert value(s, "skiff_responses_total", op="generate", code="ok") == 1
    assert value(s, "skiff_responses_total", op="generate", code="cancelled") == 1


# -- EdgeServer hooks with a toy service, no model ---------------------------------


class ToyService:
    """ping answers at once; ``count`` streams ``n`` events over later turns."""

    def __init__(self) -> None:
        self.jobs: list[tuple[Request, int]] = []

    @property
    def handlers(self) -> Mapping[str, Any]:
        return {"ping": lambda req: {"pong": True}, "count": self._count}

    def _count(self, req: Request) -> None:
        self.jobs.append((req, 0))

    def has_work(self) -> bool:
        return bool(self.jobs)

    def turn(self) -> list[Outgoing]:
        out: list[Outgoing] = []
        still: list[tuple[Request, int]] = []
        for req, sent in self.jobs:
            n = int(req.args.get("n", 3))
            if sent < n:
                event = {"event": "tick", "i": sent}
                out.append(Outgoing(req.peer, event_reply(req.id, event)))
                still.append((req, sent + 1))
            else:
                out.append(Outgoing(req.peer, event_reply(req.id, {"event": "done", "done": True})))
        self.jobs = still
        return out

    def peer_lost(self, peer: bytes, reason: str) -> int:
        return 0

    def housekeeping(self, now: float) -> None:
        return None


@pytest.fixture()
def toy_server(tmp_path: Path) -> Iterator[tuple[str, int]]:
    registry = new_registry()
    service = ToyService()
    metrics = EdgeMetrics(registry, service.handlers)
    server = EdgeServer(EdgeConfig(bind=f"ipc://{tmp_path}/toy.sock"), service, metrics=metrics)
    exporter = serve(registry, 0, "127.0.0.1")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.endpoint, exporter.port
    server.stop()
    thread.join(WAIT_S)
    server.close()
    exporter.close()


def test_edge_server_reports_every_request(toy_server: tuple[str, int]) -> None:
    endpoint, port = toy_server
    with Client(endpoint, timeout_ms=int(WAIT_S * 1000)) as c:
        assert c.ping()["pong"]
        events = list(c.stream("count", args={"n": 4}))
        assert len(events) == 5
        with pytest.raises(SkiffError) as info:
            c.call("nope")
        assert info.value.code == "unknown_op"
        c.send_raw([b"\xc1 not msgpack"])  # undecodable: answered with id null
        assert c.recv_any().header["error"]["code"] == "bad_request"
        c.send_raw([transport.encode({"v": 2, "id": 9, "op": "ping"})])
        assert c.recv(9).header["error"]["code"] == "unsupported_version"
    s = scrape(port)
    assert value(s, "skiff_requests_total", op="ping") == 2
    assert value(s, "skiff_responses_total", op="ping", code="ok") == 1
    assert value(s, "skiff_request_errors_total", op="ping", code="unsupported_version") == 1
    assert value(s, "skiff_requests_total", op="other") == 2
    assert value(s, "skiff_request_errors_total", op="other", code="unknown_op") == 1
    assert value(s, "skiff_request_errors_total", op="other", code="bad_request") == 1
    assert value(s, "skiff_time_to_first_event_seconds_count", op="count") == 1
    assert value(s, "skiff_inter_event_seconds_count", op="count") == 3
    assert value(s, "skiff_request_duration_seconds_count", op="count") == 1
    assert value(s, "skiff_requests_in_flight") == 0
    assert value(s, "process_cpu_seconds_total") > 0  # the process collector is there


def test_start_is_off_at_port_0_and_names_a_taken_address() -> None:
    """Every process main starts its exporter through ``start``: 0 (or no
    registry) is off; an address in use is an OSError naming it."""
    registry = new_registry(process_metrics=False)
    assert start(registry, 0, "127.0.0.1") is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert start(None, port, "127.0.0.1") is None
        with pytest.raises(OSError, match=rf"cannot serve metrics on 127\.0\.0\.1:{port}: "):
            start(registry, port, "127.0.0.1")
