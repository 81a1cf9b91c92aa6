"""One gateway process's loop: the edge's ROUTER front plus the worker DEALERs
in one ``zmq.Poller``, one thread.

The edge (``edge/server.py``) owns the front socket: it drains client
requests, checks envelopes and limits, and sends replies. The gateway's
``turn`` (run by the same ``run_once`` whenever a worker socket is readable
or a 50 ms tick is due) drains worker replies and health timers. Nothing
blocks: a poll with no work sleeps until a socket is readable (after a
short spin while messages come fast: ``_SplitPoller``).
"""

from __future__ import annotations

import time
from typing import Any

import zmq

from edge import EdgeConfig, EdgeServer
from protocol.sockets import SocketOptions

from .config import GatewayConfig
from .metrics import GatewayMetrics
from .server import TICK_S, GatewayService

POLLIN = int(zmq.POLLIN)  # a plain int: cheaper to combine than zmq's enum


class Gateway:
    def __init__(
        self,
        cfg: GatewayConfig,
        context: zmq.Context[Any] | None = None,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.cfg = cfg
        self.context = context or zmq.Context.instance()
        self.service = GatewayService(cfg, self.context, metrics)
        edge_cfg = EdgeConfig(
            bind=cfg.bind,
            max_header_bytes=cfg.max_request_bytes,
            socket=SocketOptions(max_message_bytes=cfg.max_message_bytes, curve=cfg.curve),
            idle_poll_ms=int(TICK_S * 1000),
            authorized=cfg.curve_authorized,
        )
        self.edge = EdgeServer(
            edge_cfg, self.service, self.context, metrics=metrics.edge if metrics else None
        )
        self.service.attach(self.edge)
        self.endpoint = self.edge.endpoint

    @property
    def local_endpoint(self) -> str:
        """The front's endpoint as a local client dials it (wildcards -> loopback)."""
        return connectable(self.endpoint)

    def ready(self) -> bool:
        """Any LLM worker up (``GET /health`` of the HTTP front)."""
        return self.service.pool.any_up()

    def stop(self) -> None:
        """End the loop after the current pass (signal- and thread-safe)."""
        self.edge.stop()

    def drain(self, timeout_s: float) -> None:
        """Refuse new requests, relay accepted ones to their end (at most
        ``timeout_s``, then cancel them), then end the loop (signal-safe)."""
        self.edge.drain(timeout_s)

    def serve_forever(self) -> None:
        zap = self.edge.zap.socket if self.edge.zap is not None else None
        poller = _SplitPoller(self.edge.sock, self.service, zap, self.cfg.poll_spin_us)
        for sock in self.service.pool.sockets():
            poller.register(sock, zmq.POLLIN)
        self.edge.serve_forever(poller)

    def close(self) -> None:
        self.service.pool.close()
        self.edge.close()


class _SplitPoller(zmq.Poller):
    """One poll over the front and every worker socket. The edge sees only
    the front's readiness (so it drains clients only when there are any);
    readable worker sockets are handed to the service, whose ``has_work``
    then runs a turn for them. This saves a failing ``recv`` per socket and
    pass (``zmq.Again`` costs ~10 us in Python). The ZAP socket (CURVE on)
    is the edge's too: its readiness is passed through.

    Waiting, it spins first (``spin_us`` of non-blocking polls) while
    messages have lately come within a few spins of each other: a sleeping
    process is woken by the kernel, ~50-70 us per crossing here, which a
    relay pays on both hops. Measured (``scripts/bench_gateway.py``, 2-core
    Xeon): ~120 us extra per message spinning 250 us against ~155 sleeping,
    same run (docs/gateway.md). The gap it
    judges by is a moving average of the waits, whether they ended in a
    message or in the timeout (an idle gateway stops spinning at once), and
    it spins while that is under ``SPIN_WHILE`` spins: measured sleeping,
    a wait includes the wake-up. Streamed tokens, ~20 ms apart a worker,
    never spin and cost the workers' cores nothing."""

    ALPHA = 0.25
    SPIN_WHILE = 4  # spin while the average gap is under this many spins

    def __init__(
        self,
        front: zmq.Socket[Any],
        service: GatewayService,
        zap: zmq.Socket[Any] | None = None,
        spin_us: int = 0,
    ) -> None:
        super().__init__()
        self.front = front
        self.zap = zap
        self.service = service
        self.spin_s = spin_us / 1e6
        self.gap_s = 1.0  # moving average of waits for a message
        self.spun = 0  # waits that spun (tests read it)
        self.register(front, zmq.POLLIN)
        if zap is not None:
            self.register(zap, zmq.POLLIN)

    def _wait(self, timeout: int | None) -> list[tuple[Any, int]]:
        """``poll(timeout)``, awake for the first ``spin_s`` while messages
        come fast; learns how far apart they come."""
        start = time.perf_counter()
        events = super().poll(0)
        if not events and self.gap_s < self.SPIN_WHILE * self.spin_s:
            self.spun += 1
            end = start + self.spin_s
            while not events and time.perf_counter() < end:
                events = super().poll(0)
        if not events:
            events = super().poll(timeout)
        self.gap_s += self.ALPHA * (time.perf_counter() - start - self.gap_s)
        return events

    def poll(self, timeout: int | None = None) -> list[tuple[Any, int]]:
        events = self._wait(timeout) if timeout and self.spin_s else super().poll(timeout)
        front = zap = False
        for sock, _ in events:
            if sock is self.front:
                front = True
            elif sock is self.zap:
                zap = True
            else:
                self.service.ready.add(sock)
        out = [(self.front, POLLIN)] if front else []
        return [*out, (self.zap, POLLIN)] if zap else out


def connectable(endpoint: str) -> str:
    """``tcp://0.0.0.0:P`` / ``tcp://*:P`` -> ``tcp://127.0.0.1:P`` (and ``[::]``)."""
    for wildcard, local in (("0.0.0.0", "127.0.0.1"), ("*", "127.0.0.1"), ("[::]", "[::1]")):
        prefix = f"tcp://{wildcard}:"
        if endpoint.startswith(prefix):
            return f"tcp://{local}:" + endpoint[len(prefix) :]
    return endpoint
