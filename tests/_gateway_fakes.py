"""Fake workers and the gateway loop in front of them, for the test_gateway_*
modules: ``FakeWorker`` (a thread with a ROUTER socket speaking enough of the
protocol to route, stream and migrate, with gates that hold work in flight)
and ``Cluster`` (the real gateway loop in a thread before ``n`` of them).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import zmq

from conftest import WAIT_S, wait_until
from gateway.config import GatewayConfig
from gateway.runner import Gateway
from protocol import Client


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


def started_cluster(tmp: Path) -> Iterator[Cluster]:
    """The ``cluster`` fixture of the modules: two fakes, up, closed after."""
    c = Cluster(tmp)
    c.wait_up()
    yield c
    c.close()
