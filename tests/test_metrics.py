"""Prometheus metrics: the edge's request/latency metrics, the LLM worker's
gauges and aliases, the speech worker's endpoint.

The unit tests drive ``EdgeMetrics`` with a fake clock (exact sums, no timing
thresholds) and an ``EdgeServer`` with a toy service (no model). The process
tests start real workers with ``--metrics-port``, run a few requests and
scrape ``/metrics`` over HTTP, asserting that each counter moved by exactly
what the requests did.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import ROOT, WAIT_S, start_worker, stop_worker
from edge import EdgeConfig, EdgeServer, Outgoing, Request
from edge.metrics import EdgeMetrics, new_registry, serve, start
from protocol import Client, SkiffError, transport
from protocol.envelope import error_reply, event_reply, ok_reply

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of a Prometheus text page, keyed by (name, labels)."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=WAIT_S) as resp:
        assert resp.status == 200
        return parse(resp.read().decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value; 0 when absent (a labelled child not created yet)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


# -- a real LLM worker -------------------------------------------------------------

# Over one 128-token prefill piece, so a second run can reuse the first piece.
LONG_PROMPT = " ".join(f"Item {n} is a small round pebble from the shore." for n in range(12))


@pytest.fixture(scope="module")
def metered_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    port = free_port()
    tmp = tmp_path_factory.mktemp("metrics_worker")
    proc, endpoint, _log = start_worker(
        tmp,
        "--lanes",
        "2",
        "--ctx",
        "2048",
        "--metrics-port",
        str(port),
        "--metrics-host",
        "127.0.0.1",
    )
    yield endpoint, port
    stop_worker(proc)


def test_worker_metrics_move_with_requests(metered_worker: tuple[str, int]) -> None:
    endpoint, port = metered_worker
    before = scrape(port)
    with Client(endpoint, timeout_ms=60_000) as c:
        prompt = c.tokenize("The capital of France is")
        c.prefill_sampled("m1", prompt)
        token = 2
        for _ in range(3):
            token = c.decode("m1", token)["token"]
        with pytest.raises(SkiffError) as info:
            c.decode("m1", -1)
        assert info.value.code == "bad_request"
        held = scrape(port)  # m1 holds one of the two lanes
        c.drop("m1")

        args = {"prompt": LONG_PROMPT, "max_tokens": 4, "ignore_eos": True}
        replies = list(c.generate(args))
        tokens = [r for r in replies if r.header.get("event") == "token"]
        done = replies[-1].header
        assert done["done"] and len(tokens) == 4
        # The same prompt again, not streamed: its prefix comes from the cache.
        again = c.call("generate", args={**args, "stream": False}).header["result"]
    after = scrape(port)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("skiff_requests_total", op="prefill_sampled") == 1
    assert delta("skiff_requests_total", op="decode") == 4
    assert delta("skiff_requests_total", op="generate") == 2
    assert delta("skiff_responses_total", op="decode", code="ok") == 3
    assert delta("skiff_request_errors_total", op="decode", code="bad_request") == 1
    assert delta("skiff_request_duration_seconds_count", op="decode") == 4
    assert delta("skiff_request_duration_seconds_count", op="generate") == 2
    assert delta("skiff_time_to_first_event_seconds_count", op="generate") == 1
    assert delta("skiff_inter_event_seconds_count", op="generate") == len(tokens) - 1
    usage = [done["usage"], again["usage"]]
    assert delta("skiff_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
    completion = sum(u["completion_tokens"] for u in usage)
    assert delta("skiff_generation_tokens_total") == completion == 8
    assert again["usage"]["cached_tokens"] > 0
    assert delta("skiff_prefix_cache_hits_total") >= 1
    assert delta("skiff_prefix_cache_reused_tokens_total") == again["usage"]["cached_tokens"]
    # Forward metrics: every forward observed once, every token counted once.
    forwards = delta("skiff_forward_seconds_count")
    assert forwards > 0
    assert delta("skiff_batch_tokens_count") == forwards == delta("skiff_batch_sequences_count")
    assert delta("skiff_batch_tokens_sum") == delta("skiff_tokens_evaluated_total")
    assert delta("skiff_scheduler_admitted_total") >= 3
    # Scrape-time gauges and the vLLM aliases, while m1 held a lane and after.
    names = {k[0] for k in held}
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting"} <= names
    alias_labels = {dict(k[1]).get("model_name", "") for k in held if k[0].startswith("vllm:")}
    assert len(alias_labels) == 1 and "" not in alias_labels  # one model_name, never empty
    model = {"model_name": alias_labels.pop()}
    assert value(held, "skiff_lanes_total") == 2
    assert value(held, "skiff_lanes_busy") == 1
    assert value(held, "skiff_lanes_free") == 1
    assert value(held, "skiff_kv_cells_used") == len(prompt) + 3
    assert value(held, "skiff_kv_cells_total") == 2048
    assert value(held, "vllm:kv_cache_usage_perc", **model) == 0.5
    for snapshot in (held, after):
        assert value(snapshot, "vllm:num_requests_running", **model) == 0
        assert value(snapshot, "vllm:num_requests_waiting", **model) == 0
        assert value(snapshot, "skiff_queue_depth") == 0
        assert value(snapshot, "skiff_requests_in_flight") == 0
    assert value(after, "skiff_lanes_busy") == 0
    assert value(after, "vllm:kv_cache_usage_perc", **model) == 0.0


def test_worker_metrics_show_the_park_as_stats_does(metered_worker: tuple[str, int]) -> None:
    """Two lanes, three sessions: the third parks the first, naming the
    first again restores it (parking the second). ``/metrics`` counts the
    same parks, restores, parked sessions and bytes as ``stats.park``."""
    endpoint, port = metered_worker
    before = scrape(port)
    with Client(endpoint, timeout_ms=60_000) as c:
        for i in range(3):
            c.prefill(f"park{i}", list(range(1000 + i, 1040 + i)))
        c.decode("park0", 5)  # restored; park1 goes to the park
        park = c.stats()["park"]
        held = scrape(port)
        for i in range(3):
            c.drop(f"park{i}")

    def delta(name: str) -> float:
        return value(held, name) - value(before, name)

    assert delta("skiff_parks_total") == 2
    assert delta("skiff_park_restores_total") == 1
    assert delta("skiff_park_restore_seconds_total") > 0
    assert value(held, "skiff_parked_sessions") == park["sessions"] == 1
    assert value(held, "skiff_park_bytes") == park["bytes"] > 0
    assert value(held, "skiff_park_disk_bytes") == park["disk_bytes"] == 0
    assert value(held, "skiff_parks_total") == park["parks"]
    assert value(held, "skiff_park_restores_total") == park["restores"]
    assert value(scrape(port), "skiff_parked_sessions") == 0  # dropped, parked or not


def test_worker_metrics_port_off_by_default() -> None:
    from worker import config

    assert config.parse([]).metrics_port == 0
    with pytest.raises(SystemExit):
        config.parse(["--metrics-port", "70000"])


# -- the speech worker ------------------------------------------------------------


def test_speech_worker_serves_metrics(tmp_path: Path) -> None:
    pytest.importorskip("piper")
    port = free_port()
    endpoint = f"ipc://{tmp_path}/speech.sock"
    log_path = tmp_path / "speech.log"
    env = {**os.environ, "SKIFF_METRICS_PORT": str(port), "SKIFF_METRICS_HOST": "127.0.0.1"}
    cmd = [sys.executable, "-m", "speech.cli", "--bind", endpoint, "--threads", "1"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        with Client(endpoint, timeout_ms=60_000) as c:
            c.wait_ready(2 * WAIT_S, alive=lambda: proc.poll() is None)
            reply = c.call("synthesize", args={"text": "Hello there.", "format": "pcm_s16le"})
            seconds = reply.result["sample_count"] / reply.result["sample_rate"]
        s = scrape(port)
    finally:
        proc.terminate()
        proc.wait(WAIT_S)
    assert value(s, "skiff_requests_total", op="synthesize") == 1
    assert value(s, "skiff_responses_total", op="synthesize", code="ok") == 1
    assert value(s, "skiff_request_duration_seconds_count", op="synthesize") == 1
    assert value(s, "skiff_speech_audio_seconds_total") == pytest.approx(seconds, rel=1e-6)
    assert value(s, "skiff_speech_synthesis_seconds_total") > 0
    assert value(s, "skiff_speech_completed_total") == 1
    assert value(s, "skiff_speech_queue_depth") == 0
