"""The gateway without a model: pure policy (router, affinity, config, load
estimate) and the real loop in-process against fake workers (threads with a
ROUTER socket speaking the protocol): id remapping, pass-through buffers,
affinity, cancel, a silent worker, affinity rebuilt from ``stats``, drain.
"""

from __future__ import annotations

import heapq
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from conftest import WAIT_S, wait_until
from gateway.affinity import AffinityTable
from gateway.config import GatewayConfig, add_serve_arguments, from_namespace
from gateway.pool import WorkerConn
from gateway.router import Candidate, PrefixIndex, Router, least_loaded, prompt_blocks
from gateway.runner import Gateway, connectable
from protocol import Client, SkiffError
from protocol.sockets import SocketOptions

# -- router ---------------------------------------------------------------------------


def test_least_loaded_uses_the_queue_score_and_free_lanes() -> None:
    a = Candidate("a", queued=1, running=0, free_lanes=0)  # 4
    b = Candidate("b", queued=0, running=3, free_lanes=1)  # 2
    assert (a.score, b.score) == (4, 2)
    assert least_loaded([a, b]) == "b"
    # same running, the one with room wins; a full tie goes by name
    c = Candidate("c", running=2, free_lanes=6)
    d = Candidate("d", running=2, free_lanes=0)
    assert least_loaded([d, c]) == "c"
    assert least_loaded([Candidate("y"), Candidate("x")]) == "x"
    # full ties rotate with the turn; a lower score is never rotated away
    tied = [Candidate("y"), Candidate("x"), Candidate("z", running=1)]
    assert [least_loaded(tied, t) for t in range(4)] == ["x", "y", "x", "y"]
    router = Router("least_loaded")
    assert {router.choose(tied) for _ in range(4)} == {"x", "y"}


def test_prompt_blocks_chain_on_shared_prefixes() -> None:
    base = list(range(64))
    one = prompt_blocks({"tokens": base})
    two = prompt_blocks({"tokens": [*base[:32], 999, *base[33:]]})
    assert len(one) == 4 and one[:2] == two[:2] and one[2] != two[2] and one[3] != two[3]
    assert prompt_blocks({"tokens": base[:15]}) == ()  # no whole block
    text = "x" * 64 + "y" * 64
    assert prompt_blocks({"prompt": text})[0] == prompt_blocks({"prompt": "x" * 64 + "z" * 70})[0]
    msgs = [{"role": "system", "content": "s" * 100}, {"role": "user", "content": "hi"}]
    other = [{"role": "system", "content": "s" * 100}, {"role": "user", "content": "yo"}]
    assert prompt_blocks({"messages": msgs})[0] == prompt_blocks({"messages": other})[0]
    assert prompt_blocks({"prompt": text}) != prompt_blocks({"tokens": base})  # kinds differ
    assert prompt_blocks({}) == ()


def test_cache_aware_prefers_the_prefix_holder_until_it_is_too_busy() -> None:
    router = Router("cache_aware", balance_threshold=2, cache_min_blocks=1, cache_full_blocks=1)
    system = list(range(100, 164))
    first = prompt_blocks({"tokens": [*system, 1, 2, 3]})
    idle = [Candidate("a", free_lanes=4), Candidate("b", free_lanes=4)]
    assert router.choose(idle, first) == "a"  # tie: least loaded by name; remembered
    again = prompt_blocks({"tokens": [*system, 7, 8]})
    # b is idler, but a holds the prefix and is within the threshold
    busy_a = [Candidate("a", running=1, free_lanes=3), Candidate("b", free_lanes=4)]
    assert router.choose(busy_a, again) == "a"
    assert router.cache_routed == 1
    # a is past the threshold: least loaded wins
    too_busy = [Candidate("a", running=3, free_lanes=1), Candidate("b", free_lanes=4)]
    assert router.choose(too_busy, again) == "b"
    # now both hold the prefix: the longer match wins, then the lower load
    longer = prompt_blocks({"tokens": [*system, 1, 2, 3, *range(20)]})
    both = [Candidate("a", free_lanes=4), Candidate("b", free_lanes=4)]
    router.index.insert("b", longer)
    assert router.choose(both, longer) == "b"
    # a prompt sharing nothing goes to the least loaded
    assert router.choose(busy_a, prompt_blocks({"tokens": list(range(500, 600))})) == "b"
    # within the threshold but with no free lane, while b has one: b (no queueing)
    full_a = [Candidate("a", running=4, free_lanes=0), Candidate("b", running=3, free_lanes=1)]
    assert full_a[0].score <= full_a[1].score + 2
    assert router.choose(full_a, again) == "b"
    # when no worker has a free lane, the prefix holder may still take it
    all_full = [Candidate("a", running=4), Candidate("b", running=4)]
    assert router.choose(all_full, again) == "a"
    # by default a match shorter than 8 blocks (128 tokens: one prefill piece) does not count
    strict = Router("cache_aware")
    strict.index.insert("a", first)
    assert strict.choose(busy_a, first) == "b"
    long_prompt = prompt_blocks({"tokens": list(range(1000, 1600))})
    strict.index.insert("a", long_prompt)
    assert strict.choose(busy_a, long_prompt) == "a"


def test_a_short_shared_prefix_wins_only_among_equally_loaded_workers() -> None:
    """The slack a hit may cost grows with its length: a repeated 200-token
    prompt does not pile onto the busier worker, a long conversation does."""
    router = Router("cache_aware")  # threshold 2, hits from 8 blocks, the whole slack from 32
    assert router.slack(8) == 0.5 and router.slack(16) == 1.0 and router.slack(64) == 2.0
    short = prompt_blocks({"tokens": list(range(200))})  # 12 blocks
    long = prompt_blocks({"tokens": list(range(1000, 1600))})  # 37 blocks
    router.index.insert("a", short)
    router.index.insert("a", long)
    busier_a = [Candidate("a", running=4, free_lanes=4), Candidate("b", running=3, free_lanes=5)]
    assert busier_a[0].score - busier_a[1].score == 2
    assert router.choose(busier_a, short, remember=False) == "b"  # 0.75 < 2: balance
    assert router.choose(busier_a, long, remember=False) == "a"  # 2 <= 2: the hit
    level = [Candidate("a", running=4, free_lanes=4), Candidate("b", running=4, free_lanes=4)]
    assert router.choose(level, short, remember=False) == "a"  # a tie: the hit decides


def test_least_loaded_and_round_robin_ignore_prefixes() -> None:
    blocks = prompt_blocks({"tokens": list(range(64))})
    ll = Router("least_loaded")
    ll.index.insert("a", blocks)
    cands = [Candidate("a", running=1), Candidate("b")]
    assert ll.choose(cands, blocks) == "b"
    rr = Router("round_robin")
    picks = [rr.choose([Candidate("b"), Candidate("a")], blocks) for _ in range(4)]
    assert picks == ["a", "b", "a", "b"]
    assert Router().choose([], blocks) is None
    with pytest.raises(ValueError):
        Router("random")


def test_prefix_index_is_bounded_and_forgets_a_worker() -> None:
    index = PrefixIndex(capacity=3)
    index.insert("a", [1, 2, 3, 4])  # 1 evicted (oldest)
    assert index.size("a") == 3
    assert index.match("a", [1, 2]) == 0 and index.match("a", [2, 3, 9]) == 2
    index.insert("a", [2])  # touched: now newest
    index.insert("a", [5])  # evicts 3
    assert index.match("a", [2]) == 1 and index.match("a", [3]) == 0
    index.forget("a")
    assert index.size("a") == 0 and index.match("a", [2]) == 0


# -- affinity ---------------------------------------------------------------------------


def test_affinity_assign_confirm_drop_and_rebuild() -> None:
    clock = [1.0]
    table = AffinityTable(clock=lambda: clock[0])
    table.assign("s1", "a", now=1.0)
    table.assign("s2", "a", now=1.0, confirmed=True)
    table.assign("s3", "b", now=1.0)
    assert table.worker_of("s1") == "a" and not table.get("s1").confirmed  # type: ignore[union-attr]
    table.confirm("s1")
    assert table.get("s1").confirmed  # type: ignore[union-attr]
    table.assign("s1", "b", now=2.0)  # moved
    assert table.sessions_of("a") == ["s2"] and table.sessions_of("b") == ["s1", "s3"]
    # b lists s3 and a session the table lacks; s1 (made after the ask) stays
    added, removed = table.rebuild("b", ["s3", "s9"], asked_at=1.5, busy=lambda s: False)
    assert (added, removed) == (["s9"], []) and table.worker_of("s9") == "b"
    # a no longer lists s2: gone unless something is in flight for it
    assert table.rebuild("a", [], asked_at=5.0, busy=lambda s: s == "s2") == ([], [])
    assert table.rebuild("a", [], asked_at=5.0, busy=lambda s: False) == ([], ["s2"])
    # a session another worker already holds is not taken over by a listing
    assert table.rebuild("a", ["s1"], asked_at=6.0, busy=lambda s: False) == ([], [])
    assert table.worker_of("s1") == "b"
    # a drop that overtook the stats answer does not bring the session back
    clock[0] = 7.0
    table.remove("s9")
    listed = ["s1", "s3", "s9"]
    assert table.rebuild("b", listed, asked_at=6.5, busy=lambda s: False) == ([], [])
    assert table.rebuild("b", listed, asked_at=7.5, busy=lambda s: False) == (["s9"], [])
    # a drop is pending until its reply: a worker answers stats before running it
    table.drop_started("s9")
    clock[0] = 8.0
    assert table.rebuild("b", listed, asked_at=7.9, busy=lambda s: False) == ([], [])
    clock[0] = 8.5
    table.drop_finished("s9")
    assert table.rebuild("b", listed, asked_at=8.2, busy=lambda s: False) == ([], [])
    assert table.rebuild("b", listed, asked_at=8.6, busy=lambda s: False) == (["s9"], [])
    table.assign("s4", "b", now=8.0)  # unconfirmed: never existed as far as we know
    assert table.drop_worker("b") == ["s1", "s3", "s4", "s9"]
    assert len(table) == 0 and table.remove("nope") is None
    # confirmed sessions of a worker that went down are remembered as lost
    assert table.lost_on("s9") == "b"  # listed by b: confirmed
    assert table.lost_on("s3") is None and table.lost_on("s4") is None  # never confirmed
    assert table.forget_lost("s9") and table.lost_on("s9") is None
    table.assign("s2", "b", now=9.0, confirmed=True)
    table.drop_worker("b")
    table.assign("s2", "a", now=10.0)  # e.g. a worker came back listing it
    assert table.lost_on("s2") is None


# -- load estimate -----------------------------------------------------------------------


def test_candidate_adds_gateway_traffic_to_the_last_stats() -> None:
    w = WorkerConn("w", "llm", peer=None)  # type: ignore[arg-type]
    w.mark_stats_sent(0.0)
    w.sent_work = 2  # sent after the stats request: not in the snapshot
    w.apply_stats({"lanes": {"total": 4, "active": 1, "idle": 3}, "running": 1, "queued": 0})
    w.done_work = 0
    assert w.candidate() == Candidate("w", queued=0, running=3, free_lanes=3)
    w.sent_work += 3  # 6 outstanding on 4 lanes
    w.lanes_taken += 2
    assert w.candidate() == Candidate("w", queued=2, running=4, free_lanes=1)
    w.done_work += 6
    w.lanes_freed += 2
    assert w.candidate() == Candidate("w", queued=0, running=0, free_lanes=3)


# -- config ---------------------------------------------------------------------------------


def _parse(argv: list[str]) -> GatewayConfig:
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return from_namespace(parser.parse_args(argv))


def test_config_flags_env_twins_and_workers_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    listing = tmp_path / "workers"
    listing.write_text("# pool\ntcp://w-1:5555\n\nspeech tcp://tts:5556  # voice\ntcp://w-2:5555\n")
    monkeypatch.setenv("SKIFF_GATEWAY_WORKERS", "tcp://a:1, tcp://b:2")
    monkeypatch.setenv("SKIFF_GATEWAY_POLICY", "least_loaded")
    monkeypatch.setenv("SKIFF_METRICS_PORT", "9100")
    cfg = _parse(["--workers-file", str(listing), "--http", "0.0.0.0:8080"])
    assert cfg.all_workers == ("tcp://a:1", "tcp://b:2", "tcp://w-1:5555", "tcp://w-2:5555")
    assert cfg.all_speech == ("tcp://tts:5556",)
    assert (cfg.policy, cfg.metrics_port, cfg.http_address) == (
        "least_loaded",
        9100,
        ("0.0.0.0", 8080),
    )
    # a flag wins over its variable
    cfg = _parse(["--worker", "tcp://c:3", "--policy", "round_robin"])
    assert cfg.all_workers == ("tcp://c:3",) and cfg.policy == "round_robin"
    monkeypatch.delenv("SKIFF_GATEWAY_WORKERS")
    with pytest.raises(SystemExit):
        _parse([])  # no worker at all
    with pytest.raises(SystemExit):
        _parse(["--worker", "tcp://c:3", "--health-interval-ms", "1500"])  # >= down-after
    assert connectable("tcp://0.0.0.0:5550") == "tcp://127.0.0.1:5550"
    assert connectable("tcp://*:5550") == "tcp://127.0.0.1:5550"
    assert connectable("ipc:///tmp/g.sock") == "ipc:///tmp/g.sock"


# -- the loop against fake workers -----------------------------------------------------------


class FakeWorker(threading.Thread):
    """A ROUTER speaking enough of the protocol to route, stream and migrate.

    ``generate`` streams ``max_tokens`` events, one per ``tick`` seconds,
    while ``streams_open`` is set (clear it to hold every stream where it
    is); ``export_state`` answers once ``exports_open`` is set; ``silent``
    makes it ignore everything (a hung process). The gates let a test hold
    work in flight for as long as it needs, instead of guessing how long a
    loaded machine takes to do the rest."""

    def __init__(self, endpoint: str, lanes: int = 4, sessions: tuple[str, ...] = ()) -> None:
        super().__init__(daemon=True)
        self.endpoint = endpoint
        self.lanes = lanes
        self.sessions: dict[str, int] = dict.fromkeys(sessions, 1)
        self.seen: list[dict[str, Any]] = []
        self.silent = threading.Event()
        self.shutting_down = False  # refuse new work as a draining worker does
        self.streams_open = threading.Event()
        self.streams_open.set()
        self.exports_open = threading.Event()
        self.exports_open.set()
        self.tick = 0.01
        self._halt = threading.Event()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._streams: dict[tuple[bytes, int], int] = {}
        self.started_at = time.monotonic()
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)

    def ops(self, op: str) -> list[dict[str, Any]]:
        return [h for h in list(self.seen) if h.get("op") == op]

    def stop(self) -> None:
        self._halt.set()
        self.join(WAIT_S)
        self.sock.close(linger=0)

    def _send(self, peer: bytes, header: dict[str, Any], buffers: list[Any] | None = None) -> None:
        self.sock.send_multipart([peer, msgpack.packb(header), *(buffers or [])])

    def _later(self, delay: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (time.monotonic() + delay, next(self._seq), fn))

    def _once_open(self, gate: threading.Event, fn: Callable[[], None]) -> None:
        """Run ``fn`` now if ``gate`` is set, else look again a tick later."""
        if gate.is_set():
            fn()
        else:
            self._later(self.tick, lambda: self._once_open(gate, fn))

    def run(self) -> None:
        while not self._halt.is_set():
            if self.sock.poll(5):
                frames = self.sock.recv_multipart()
                if not self.silent.is_set():
                    self._handle(frames[0], msgpack.unpackb(frames[1]), frames[2:])
            while self._timers and self._timers[0][0] <= time.monotonic():
                _, _, fn = heapq.heappop(self._timers)
                if not self.silent.is_set():
                    fn()

    def _handle(self, peer: bytes, h: dict[str, Any], bufs: list[bytes]) -> None:
        self.seen.append(h)
        rid, op, args = h["id"], h["op"], h.get("args", {})
        session: str = h.get("session") or ""

        def ok(result: dict[str, Any], buffers: list[Any] | None = None) -> None:
            self._send(peer, {"v": 1, "id": rid, "ok": True, "result": result}, buffers)

        def fail(code: str) -> None:
            err = {"code": code, "message": f"fake: {code}"}
            self._send(peer, {"v": 1, "id": rid, "ok": False, "error": err})

        if self.shutting_down and op not in ("ping", "info", "stats", "cancel", "drop"):
            fail("shutting_down")
        elif op == "ping":
            ok({"pong": True})
        elif op == "info":
            ok({"model": {"name": "fake", "n_vocab": 10}, "lanes": self.lanes, "ops": ["echo"]})
        elif op == "stats":
            ok(self._stats())
        elif op == "echo":
            ok({"frame": args.get("frame")}, bufs)
        elif op == "prefill":
            if session not in self.sessions and len(self.sessions) >= self.lanes:
                fail("lanes_busy")
                return
            self.sessions[session] = self.sessions.get(session, 0) + len(args["tokens"])
            ok({"position": self.sessions[session]})
        elif op == "drop":
            self.sessions.pop(session, None)
            ok({})
        elif op == "export_state":
            state = {"position": self.sessions[session]}
            self._once_open(
                self.exports_open, lambda: ok({"session_state": state}, [b"kv-" + session.encode()])
            )
        elif op == "import_state":
            if bufs != [b"kv-" + session.encode()] or session in self.sessions:
                fail("bad_request")
                return
            self.sessions[session] = args["session_state"]["position"]
            ok({"position": self.sessions[session]})
        elif op == "generate":
            self._streams[(peer, rid)] = int(args.get("max_tokens", 8))
            self._later(self.tick, lambda: self._stream(peer, rid, 0))
        elif op == "cancel":
            key = (peer, args["id"])
            found = key in self._streams
            if found:
                self._streams[key] = -1
            ok({"cancelled": found})
        else:
            fail("unknown_op")

    def _stream(self, peer: bytes, rid: int, i: int) -> None:
        if not self.streams_open.is_set():
            self._later(self.tick, lambda: self._stream(peer, rid, i))  # held where it is
            return
        left = self._streams.get((peer, rid), 0)
        if left <= i:
            reason = "cancelled" if left < 0 else "length"
            self._streams.pop((peer, rid), None)
            event = {"event": "done", "done": True, "finish_reason": reason, "tokens": i}
            self._send(peer, {"v": 1, "id": rid, "ok": True, **event})
            return
        self._send(peer, {"v": 1, "id": rid, "ok": True, "event": "token", "token": i})
        self._later(self.tick, lambda: self._stream(peer, rid, i + 1))

    def _stats(self) -> dict[str, Any]:
        running = sum(1 for v in self._streams.values() if v > 0)
        return {
            "lanes": {
                "total": self.lanes,
                "active": len(self.sessions),
                "idle": self.lanes - len(self.sessions),
            },
            "sessions": [
                {"lane": i, "session": s, "position": p}
                for i, (s, p) in enumerate(self.sessions.items())
            ],
            "running": running,
            "queued": 0,
            "draining": self.shutting_down,
            "uptime_s": time.monotonic() - self.started_at,
        }


# Gateway health timing for the in-process clusters: pings every 50 ms (a
# worker that answers again rejoins at once), but a worker is cut off only
# after seconds of silence. The fakes are threads in this process: on a loaded
# machine they can miss a few hundred milliseconds, and a worker marked down
# by accident fails the test that did not ask for it.
HEALTH_MS = 50
DOWN_AFTER_MS = 2_000  # heartbeats (answered by ZeroMQ's I/O thread, not Python)
STALL_AFTER_MS = 10_000  # loop silence; the silent-worker test asks for less


class Cluster:
    """The gateway loop in a thread in front of ``n`` fake workers.

    ``sessions_on[i]`` are sessions fake ``i`` holds before the gateway
    starts (so its first ``stats`` already lists them)."""

    def __init__(
        self,
        tmp: Path,
        n: int = 2,
        sessions_on: tuple[dict[str, int], ...] = (),
        stall_after_ms: int = STALL_AFTER_MS,
        **fake: Any,
    ) -> None:
        self.fakes = [FakeWorker(f"ipc://{tmp}/fake{i}.sock", **fake) for i in range(n)]
        for f, sessions in zip(self.fakes, sessions_on, strict=False):
            f.sessions.update(sessions)
        for f in self.fakes:
            f.start()
        cfg = GatewayConfig(
            bind=f"ipc://{tmp}/gw.sock",
            workers=tuple(f.endpoint for f in self.fakes),
            health_interval_ms=HEALTH_MS,
            down_after_ms=DOWN_AFTER_MS,
            stall_after_ms=stall_after_ms,
        )
        self.gateway = Gateway(cfg)
        self.thread = threading.Thread(target=self.gateway.serve_forever, daemon=True)
        self.thread.start()
        self.endpoint = self.gateway.endpoint

    def client(self, timeout_ms: int = int(WAIT_S * 1000)) -> Client:
        return Client(self.endpoint, timeout_ms=timeout_ms)

    def status(self) -> dict[str, Any]:
        with self.client() as c:
            result: dict[str, Any] = c.call("gateway_status").result
            return result

    def wait_up(self, n: int | None = None) -> None:
        want = len(self.fakes) if n is None else n
        wait_until(
            lambda: sum(w["up"] for w in self.status()["workers"]) == want, what="workers up"
        )

    def holder(self, session: str) -> FakeWorker:
        (found,) = [f for f in self.fakes if session in f.sessions]
        return found

    def close(self) -> None:
        self.gateway.stop()
        self.thread.join(WAIT_S)
        self.gateway.close()
        for f in self.fakes:
            f.stop()


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    c.wait_up()
    yield c
    c.close()


def test_no_worker_up_is_worker_unavailable(tmp_path: Path) -> None:
    cfg = GatewayConfig(bind=f"ipc://{tmp_path}/gw.sock", workers=(f"ipc://{tmp_path}/none.sock",))
    gateway = Gateway(cfg)
    thread = threading.Thread(target=gateway.serve_forever, daemon=True)
    thread.start()
    try:
        with Client(gateway.endpoint, timeout_ms=int(WAIT_S * 1000)) as c:
            assert c.ping() == {"pong": True}  # the gateway itself answers
            for op in ("tokenize", "info"):
                with pytest.raises(SkiffError) as err:
                    c.call(op, None, {"text": "hi"})
                assert err.value.code == "worker_unavailable"
    finally:
        gateway.stop()
        thread.join(WAIT_S)
        gateway.close()


def test_ids_are_remapped_and_buffers_pass_through(cluster: Cluster) -> None:
    payload = os.urandom(1 << 20)
    with cluster.client() as one, cluster.client() as two:
        # both clients count ids from 1: the same ids are in flight at once
        sent = [
            (c, c.send("echo", None, {"frame": {"n": i}}, [payload[i:], b"tail%d" % i]))
            for i, c in enumerate((one, two, one, two))
        ]
        assert sent[0][1] == sent[1][1]
        for i, (c, rid) in enumerate(sent):
            reply = c.recv(rid).raise_for_error()
            assert reply.header["id"] == rid and reply.result == {"frame": {"n": i}}
            assert [bytes(b) for b in reply.buffers] == [payload[i:], b"tail%d" % i]
    echoes = [h for f in cluster.fakes for h in f.ops("echo")]
    assert len(echoes) == 4 and len({h["id"] for h in echoes}) == 4


def test_ping_info_stats_are_answered_by_the_gateway(cluster: Cluster) -> None:
    with cluster.client() as c:
        before = [len(f.ops("info")) for f in cluster.fakes]
        info = c.info()
        stats = c.stats()
        assert c.ping() == {"pong": True}
    assert info["model"]["name"] == "fake" and "gateway_drain" in info["ops"]
    assert info["gateway"]["workers_up"] == 2
    models = info["gateway"]["models"]  # each worker's own model, for /v1/models
    assert [(m["worker"], m["name"], m["up"]) for m in models] == [
        (f.endpoint, "fake", True) for f in cluster.fakes
    ]
    assert stats["gateway"] is True and stats["lanes"]["total"] == 8
    assert [len(f.ops("info")) for f in cluster.fakes] == before  # from the cache


def test_unknown_ops_reach_a_worker(cluster: Cluster) -> None:
    with cluster.client() as c, pytest.raises(SkiffError) as err:
        c.call("frobnicate")
    assert err.value.code == "unknown_op" and "fake" in err.value.message


def test_sessions_stick_to_their_worker_and_drop_clears_affinity(cluster: Cluster) -> None:
    names = [f"s{i}" for i in range(6)]
    with cluster.client() as c:
        for s in names:
            assert c.prefill(s, [1, 2]) == 2
        holders = {s: cluster.holder(s) for s in names}
        assert {id(h) for h in holders.values()} == {id(f) for f in cluster.fakes}  # spread
        for s in names:
            assert c.prefill(s, [3]) == 3  # landed where its first two tokens are
        status = cluster.status()
        placed = {s: w["endpoint"] for w in status["workers"] for s in w["sessions"]}
        assert placed == {s: h.endpoint for s, h in holders.items()}
        c.drop("s0")
        assert "s0" not in {s for w in cluster.status()["workers"] for s in w["sessions"]}
        assert all("s0" not in f.sessions for f in cluster.fakes)
        # a batch over sessions of two workers cannot be served by one
        a = next(s for s in names[1:] if holders[s] is cluster.fakes[0])
        b = next(s for s in names[1:] if holders[s] is cluster.fakes[1])
        with pytest.raises(SkiffError) as err:
            c.decode_batch([{"session": a, "token": 1}, {"session": b, "token": 1}])
        assert err.value.code == "bad_request"


def test_a_refused_first_request_does_not_pin_the_session(tmp_path: Path) -> None:
    cl = Cluster(tmp_path, lanes=1)
    try:
        cl.wait_up()
        with cl.client() as c:
            assert c.prefill("a", [1]) == 1 and c.prefill("b", [1]) == 1  # one on each
            with pytest.raises(SkiffError) as err:
                c.prefill("c", [1])
            assert err.value.code == "lanes_busy"
            assert "c" not in {s for w in cl.status()["workers"] for s in w["sessions"]}
            c.drop("a")
            assert c.prefill("c", [1]) == 1  # placed afresh, on the worker with room
    finally:
        cl.close()


def test_cancel_reaches_the_worker_running_the_request(cluster: Cluster) -> None:
    with cluster.client() as c:
        rid = c.send("generate", None, {"prompt": "x", "max_tokens": 100_000})
        assert c.recv(rid).header["event"] == "token"
        assert c.cancel(rid) is True
        last = list(c.follow(rid))[-1]
        assert last.header["finish_reason"] == "cancelled"
        assert c.cancel(12345) is False  # nothing of ours by that id
    (gen,) = [h for f in cluster.fakes for h in f.ops("generate")]
    (cancel,) = [h for f in cluster.fakes for h in f.ops("cancel")]
    assert cancel["args"] == {"id": gen["id"]} and gen["id"] != rid


def test_a_silent_worker_fails_its_streams_and_rejoins(tmp_path: Path) -> None:
    # A hung worker is told only by its silence: 2 s of it here (the other
    # tests allow 10 s, so a slow fake thread is never taken for a hung one).
    cluster = Cluster(tmp_path, stall_after_ms=2_000)
    try:
        cluster.wait_up()
        with cluster.client() as c:
            # two streams, one per worker (the second sees the first one's load)
            rids = [c.send("generate", None, {"prompt": "x", "max_tokens": 200}) for _ in range(2)]
            for rid in rids:
                c.recv(rid)
            assert all(f.ops("generate") for f in cluster.fakes)
            victim, other = cluster.fakes
            c.prefill("doomed", [1])  # the idler worker: the second stream's is busier
            assert "doomed" in victim.sessions
            victim.silent.set()
            outcomes = []
            for rid in rids:
                try:
                    outcomes.append(list(c.follow(rid))[-1].header["finish_reason"])
                except SkiffError as exc:
                    outcomes.append(exc.code)
            assert sorted(outcomes) == ["length", "worker_unavailable"]
            down = {w["endpoint"]: w["up"] for w in cluster.status()["workers"]}
            assert down == {victim.endpoint: False, other.endpoint: True}
            assert c.prefill("after", [1]) == 1 and "after" in other.sessions
            # a session lost with its worker is refused, not silently restarted elsewhere
            with pytest.raises(SkiffError) as err:
                c.prefill("doomed", [2])
            assert err.value.code == "worker_unavailable" and "drop it" in err.value.message
            assert c.drop("doomed") == {}
            assert c.prefill("doomed", [2]) == 1 and "doomed" in other.sessions
            victim.silent.clear()
            cluster.wait_up()
            assert c.prefill("again", [1]) == 1 and "again" in victim.sessions  # the idler one
    finally:
        cluster.close()


def test_affinity_is_rebuilt_from_workers_stats(tmp_path: Path) -> None:
    # listed by the second worker before the gateway's first stats (a session
    # added later would show only after a later stats: a race with the check)
    cl = Cluster(tmp_path, sessions_on=({}, {"kept": 5}))
    try:
        cl.wait_up()  # up only after its stats are applied
        with cl.client() as c:
            placed = {s: w["endpoint"] for w in cl.status()["workers"] for s in w["sessions"]}
            assert placed == {"kept": cl.fakes[1].endpoint}
            assert c.prefill("kept", [1]) == 6
    finally:
        cl.close()


def test_drain_moves_sessions_and_holds_their_requests(cluster: Cluster) -> None:
    with cluster.client() as c:
        for i in range(4):  # two on each worker (4 lanes each): room for two more
            c.prefill(f"d{i}", [1, 2, 3])
        src = cluster.fakes[0]
        dst = cluster.fakes[1]
        moving = sorted(s for s in src.sessions)
        assert moving
        src.exports_open.clear()  # the first move stops at its export until we say
        drain_id = c.send("gateway_drain", None, {"worker": src.endpoint})
        (held,) = wait_until(lambda: cluster.status()["held"], what="a session moving")
        follow = {s: c.send("prefill", s, {"tokens": [4]}) for s in moving}
        wait_until(
            lambda: cluster.status()["held"].get(held) == 1, what="its request held in the gateway"
        )
        src.exports_open.set()
        result = c.recv(drain_id).raise_for_error().result
        assert result["failed"] == [], result
        assert sorted(m["session"] for m in result["moved"]) == moving, result
        for rid in follow.values():
            assert c.recv(rid).raise_for_error().result["position"] == 4
        # every follow-up ran once, before its session left or after it landed
        assert all(dst.sessions.get(s) == 4 and s not in src.sessions for s in moving)
        # the held one waited in the gateway: it ran on the new worker, after the import
        order = [(h["op"], h.get("session")) for h in dst.seen]
        assert order.index(("import_state", held)) < order.index(("prefill", held))
        view = {w["endpoint"]: w for w in cluster.status()["workers"]}
        assert view[src.endpoint]["drained"] and view[src.endpoint]["sessions"] == []
        c.drop(moving[0])
        assert c.prefill("new", [1]) == 1 and "new" in dst.sessions  # nothing new on src
        with pytest.raises(SkiffError) as err:
            c.call("gateway_drain", None, {"worker": "tcp://nowhere:1"})
        assert err.value.code == "bad_request"


def test_a_stopped_worker_process_is_cut_off_by_heartbeats(tmp_path: Path) -> None:
    """SIGSTOP freezes the worker's ZeroMQ I/O thread too: the connection's
    heartbeats time out (down-after), not the much longer loop stall limit."""
    endpoint = f"ipc://{tmp_path}/proc.sock"
    code = (
        f"import sys, time; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        f"from test_gateway import FakeWorker; FakeWorker({endpoint!r}).start(); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    cfg = GatewayConfig(
        bind=f"ipc://{tmp_path}/gw.sock",
        workers=(endpoint,),
        health_interval_ms=HEALTH_MS,
        down_after_ms=DOWN_AFTER_MS,
        stall_after_ms=600_000,
    )
    gateway = Gateway(cfg)
    thread = threading.Thread(target=gateway.serve_forever, daemon=True)
    thread.start()
    try:
        with Client(gateway.endpoint, timeout_ms=int(WAIT_S * 1000)) as c:

            def up() -> bool:
                return bool(c.call("gateway_status").result["workers"][0]["up"])

            wait_until(up, what="the fake worker process up")
            rid = c.send("generate", None, {"prompt": "x", "max_tokens": 100_000})
            c.recv(rid)
            os.kill(proc.pid, signal.SIGSTOP)
            with pytest.raises(SkiffError) as err:
                for _ in c.follow(rid):
                    pass
            assert err.value.code == "worker_unavailable"
            assert not up()
            os.kill(proc.pid, signal.SIGCONT)
            wait_until(up, what="the fake worker back up")
    finally:
        proc.kill()
        proc.wait(WAIT_S)
        gateway.stop()
        thread.join(WAIT_S)
        gateway.close()


def test_a_session_that_cannot_move_stays_and_is_served(tmp_path: Path) -> None:
    cl = Cluster(tmp_path, lanes=1)
    try:
        cl.wait_up()
        with cl.client() as c:
            c.prefill("a", [1])
            c.prefill("b", [1])  # both workers full: nowhere to move "a"
            src = cl.holder("a")
            result = c.call("gateway_drain", None, {"worker": src.endpoint}).result
            assert result["moved"] == [] and [f["session"] for f in result["failed"]] == ["a"]
            assert "free lane" in result["failed"][0]["error"]
            assert c.prefill("a", [2]) == 2 and cl.holder("a") is src  # still served there
            c.drop("b")
            with pytest.raises(SkiffError) as err:  # nothing new goes to the drained worker
                c.prefill("c", [1])
                c.prefill("d", [1])
            assert err.value.code == "lanes_busy"
            assert "c" not in src.sessions and "d" not in src.sessions
    finally:
        cl.close()


def test_work_a_shutting_down_worker_refuses_goes_to_another(cluster: Cluster) -> None:
    """``shutting_down`` means nothing ran: the gateway sends the request to
    the other worker, and no new work to the draining one until it restarts."""
    draining, other = cluster.fakes
    draining.shutting_down = True
    with cluster.client() as c:
        for i in range(4):  # whichever worker the policy picks first
            assert c.prefill(f"s{i}", [1, 2]) == 2
            rid = c.send("generate", None, {"max_tokens": 2})
            assert [r.header.get("finish_reason") for r in c.follow(rid)][-1] == "length"
    assert set(other.sessions) == {f"s{i}" for i in range(4)}
    assert draining.sessions == {}
    # Draining, then drained once the gateway has moved what it held (here
    # nothing; its stats say it is draining): no new work either way.
    wait_until(
        lambda: (
            [w["draining"] or w["drained"] for w in cluster.status()["workers"]] == [True, False]
        ),
        what="the refusing worker seen as draining",
    )


def test_a_draining_gateway_refuses_new_work_and_relays_the_rest(tmp_path: Path) -> None:
    cl = Cluster(tmp_path, n=1)
    cl.wait_up()
    try:
        fake = cl.fakes[0]
        with cl.client() as c:
            rid = c.send("generate", None, {"max_tokens": 20})
            c.recv(rid).raise_for_error()
            # the stream stays in flight (the drain waits for it) until we are done
            fake.streams_open.clear()
            cl.gateway.drain(WAIT_S)
            wait_until(lambda: c.call("stats").result["draining"], what="the gateway draining")
            with pytest.raises(SkiffError) as err:
                c.prefill("late", [1])
            assert err.value.code == "shutting_down"
            fake.streams_open.set()
            events = list(c.follow(rid))
            assert events[-1].header["finish_reason"] == "length"
        cl.thread.join(WAIT_S)
        assert not cl.thread.is_alive()  # the loop ended by itself once idle
    finally:
        cl.close()


def test_requests_in_flight_per_client_are_limited(tmp_path: Path) -> None:
    fake = FakeWorker(f"ipc://{tmp_path}/fake.sock")
    fake.start()
    cfg = GatewayConfig(
        bind=f"ipc://{tmp_path}/gw.sock",
        workers=(fake.endpoint,),
        health_interval_ms=HEALTH_MS,
        down_after_ms=DOWN_AFTER_MS,
        stall_after_ms=STALL_AFTER_MS,
        max_inflight_per_client=2,
    )
    gateway = Gateway(cfg)
    trusted = gateway.service.trust_peer()
    thread = threading.Thread(target=gateway.serve_forever, daemon=True)
    thread.start()
    try:
        wait_ms = int(WAIT_S * 1000)
        with (
            Client(gateway.endpoint, timeout_ms=wait_ms) as a,
            Client(gateway.endpoint, timeout_ms=wait_ms) as b,
        ):
            wait_until(
                lambda: a.call("gateway_status").result["workers"][0]["up"], what="worker up"
            )
            fake.streams_open.clear()  # a's two streams stay in flight until we say
            first = [a.send("generate", None, {"max_tokens": 10}) for _ in range(2)]
            with pytest.raises(SkiffError) as err:
                a.call("generate", None, {"max_tokens": 1})
            assert err.value.code == "limit_exceeded" and "--max-inflight-per-client" in str(
                err.value
            )
            other = b.send("generate", None, {"max_tokens": 1})  # others go on
            wait_until(lambda: len(fake.ops("generate")) == 3, what="b's request forwarded")
            fake.streams_open.set()
            assert list(b.follow(other))[-1].header["finish_reason"] == "length"
            for rid in first:
                assert list(a.follow(rid))[-1].header["finish_reason"] == "length"
            assert list(a.follow(a.send("generate", None, {"max_tokens": 1})))  # room again
        opts = SocketOptions(max_message_bytes=-1, routing_id=trusted)
        with Client(gateway.endpoint, timeout_ms=wait_ms, options=opts) as front:
            fake.streams_open.clear()  # all four in flight at once
            ids = [front.send("generate", None, {"max_tokens": 3}) for _ in range(4)]
            wait_until(lambda: len(fake.ops("generate")) == 8, what="the front's 4 forwarded")
            fake.streams_open.set()
            for rid in ids:  # the in-process HTTP front carries many clients: not limited
                assert list(front.follow(rid))[-1].header["finish_reason"] == "length"
    finally:
        gateway.stop()
        thread.join(WAIT_S)
        gateway.close()
        fake.stop()
