"""The gateway's service on the shared edge: route, forward, map replies back.

Clients speak the ordinary skiff protocol to the gateway's ROUTER (the edge
checks every envelope and limit). Per request the gateway:

1. picks a worker (the session's, else the routing policy's), gives the
   request a gateway-unique id and forwards ``[header, *buffers]``, the
   buffer frames untouched (``gateway/forward.py``);
2. maps each reply and stream event back (``gateway/replies.py``): decode
   the header, put the client's id back, send it with the worker's buffer
   frames untouched.

``ping``, ``info`` (a worker's, cached, plus a ``gateway`` section),
``stats`` (the workers' summed) and ``cancel`` are answered here, as are the
gateway's own ``gateway_status`` and ``gateway_drain``. ``drop`` clears a
session's affinity. A worker marked down ends every request in flight on it
with ``worker_unavailable``.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Collection, Mapping
from typing import Any

import zmq

from edge import EdgeServer, Handler, Outgoing, Request, failure_header, logs
from faults import BadRequest, Cancelled, Fault
from protocol.transport import ok_reply

from .affinity import AffinityTable
from .config import GatewayConfig
from .drain import Drainer
from .forward import Forwarder
from .ledger import Ledger
from .metrics import GatewayMetrics
from .ops import OpTable
from .placement import Placer
from .pool import LLM, Pool, WorkerConn
from .relay import Relay
from .replies import Replies
from .router import PrefixIndex, Router
from .views import gateway_info, gateway_stats, gateway_status

RECV_BATCH = 512  # messages taken from one worker per turn
_log = logs.get_logger("skiff.gateway")

# Ops a draining gateway still serves besides ping/info/stats/cancel.
_DRAIN_OPS = frozenset({"gateway_status"})

TICK_S = 0.05


class GatewayService:
    """Implements ``edge.Service``; ``gateway/cli.py`` runs it."""

    def __init__(
        self,
        cfg: GatewayConfig,
        context: zmq.Context[Any],
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.ids = itertools.count(1)
        self.pool = Pool(
            context,
            cfg.all_workers,
            cfg.all_speech,
            health_interval_ms=cfg.health_interval_ms,
            down_after_ms=cfg.down_after_ms,
            stall_after_ms=cfg.stall_after_ms,
            listener=self,
            ids=self.ids,
            curve=cfg.curve,
        )
        self.router = Router(
            cfg.policy,
            balance_threshold=cfg.balance_threshold,
            cache_min_blocks=cfg.cache_min_blocks,
            cache_full_blocks=cfg.cache_full_blocks,
            index=PrefixIndex(cfg.prefix_index_blocks),
        )
        self.affinity = AffinityTable()
        self.placer = Placer(self.pool, self.affinity, self.router)
        self.ledger = Ledger(self.affinity)
        self.held: dict[str, list[Request]] = {}  # sessions being moved -> waiting requests
        self.forwarder = Forwarder(
            self.pool,
            self.placer,
            self.ledger,
            self.affinity,
            self.held,
            self.ids,
            metrics,
            cfg.max_inflight_per_client,
        )
        self.drainer = Drainer(self)
        self.started = time.monotonic()
        self.streams_moved = 0
        self._out: list[Outgoing] = []
        self.ready: set[zmq.Socket[Any]] = set()  # worker sockets the last poll found readable
        self._next_tick = 0.0
        self.draining = False  # SIGTERM: relaying accepted work, refusing new
        local: dict[str, Handler] = {
            "ping": lambda req: {"pong": True},
            "info": lambda req: gateway_info(self),
            "stats": lambda req: gateway_stats(self),
            "cancel": self._cancel,
            "gateway_status": lambda req: gateway_status(self),
            "gateway_drain": self._drain,
        }
        self._handlers = OpTable(local, self.forwarder.forward)
        # Worker -> client. Until attach() gives it a relay, replies go via the edge.
        self.replies = Replies(
            self.ledger,
            metrics,
            self.send_later,
            lambda out: self._out.append(out),
            self.affinity,
            self.router,
            self.held,
            self.drainer,
        )

    def trust_peer(self) -> bytes:
        """A routing id for an in-process front (the HTTP one) that carries
        many clients' requests: the per-client limit does not apply to it.
        Random, so no outside client can claim it."""
        peer = b"\0front-" + os.urandom(16)
        self.forwarder.trusted.add(peer)
        return peer

    @property
    def forwarded(self) -> int:
        return self.forwarder.forwarded

    def attach(self, edge: EdgeServer) -> None:
        """Send forwarded replies straight on ``edge``'s socket (the hot path)."""
        self.replies.relay = Relay(edge, self.peer_lost)

    # -- edge.Service --------------------------------------------------------------

    @property
    def handlers(self) -> Mapping[str, Handler]:
        return self._handlers

    def has_work(self) -> bool:
        return bool(self.ready or self._out) or time.monotonic() >= self._next_tick

    def turn(self) -> list[Outgoing]:
        now = time.monotonic()
        if self.ready:
            ready, self.ready = self.ready, set()
            for sock in ready:
                w = self.pool.by_socket.get(sock)
                if w is None:
                    continue
                if sock is w.peer.sock:
                    self._recv(w, now)
                else:
                    self.pool.monitor_events(w)
            if self.replies.relay is not None:
                self.replies.relay.flush()
        if now >= self._next_tick:
            self._next_tick = now + TICK_S
            self.pool.poll_monitors()  # (also seen through the poller; a cheap backstop)
            self.pool.tick(now)
            self.drainer.poll()
            if self.metrics is not None:
                self.metrics.refresh(self)
        out, self._out = self._out, []
        return out

    def peer_lost(self, peer: bytes, reason: str) -> int:
        """Cancel a vanished client's work on the workers; drop its held requests."""
        gone = self.ledger.orphan(peer)
        for rec in gone:
            self.pool.call(rec.worker, "cancel", args={"id": rec.gid})
        lost = len(gone)
        for session, waiting in self.held.items():
            kept = [r for r in waiting if r.peer != peer]
            lost += len(waiting) - len(kept)
            self.held[session] = kept
        return lost

    def housekeeping(self, now: float) -> None:
        pass

    @property
    def drain_ops(self) -> frozenset[str]:
        return _DRAIN_OPS

    def begin_drain(self) -> None:
        self.draining = True

    def idle(self) -> bool:
        """No client request in flight or held, no worker drain running."""
        return not (len(self.ledger) or self._out or self.drainer.tasks) and not any(
            self.held.values()
        )

    def cancel_all(self, reason: str) -> int:
        """Cancel in-flight requests on their workers (their final events come
        back through the usual path) and end held ones here."""
        count = 0
        for rec in list(self.ledger.inflight.values()):
            if rec.peer is not None:
                self.pool.call(rec.worker, "cancel", args={"id": rec.gid})
                count += 1
        for waiting in self.held.values():
            for req in waiting:
                self._out.append(Outgoing(req.peer, failure_header(req.id, Cancelled(reason))))
                count += 1
            waiting.clear()
        return count

    # -- worker -> client (the hot path: gateway/replies.py) ---------------------------

    def _recv(self, w: WorkerConn, now: float) -> None:
        """Up to ``RECV_BATCH`` replies from ``w``: the pool's internal calls
        go to their callbacks, the rest to ``worker_reply``."""
        if w.peer.read(RECV_BATCH):
            w.last_seen = now

    def worker_reply(
        self, w: WorkerConn, header: dict[str, Any], buffers: list[zmq.Frame], size: int
    ) -> None:
        self.replies.reply(w, header, buffers, size)

    # -- client -> worker (gateway/forward.py) ------------------------------------

    def send_later(self, req: Request) -> None:
        """Route and send a request outside its handler (a held one); a failure
        becomes its error reply."""
        try:
            result = self._handlers[req.op](req)
        except Exception as exc:
            self._out.append(Outgoing(req.peer, failure_header(req.id, exc, req.op)))
            return
        if result is not None:
            self._out.append(Outgoing(req.peer, ok_reply(req.id, result)))

    # -- local ops -------------------------------------------------------------------

    def _cancel(self, req: Request) -> dict[str, Any] | None:
        target = req.args.get("id")
        if type(target) is not int:
            raise BadRequest("args.id must be an integer")
        rec = self.ledger.of_client(req.peer, target)
        if rec is None:
            for waiting in self.held.values():
                for queued in waiting:
                    if queued.peer == req.peer and queued.id == target:
                        waiting.remove(queued)
                        err = Cancelled("cancelled while its session was being moved")
                        self._out.append(Outgoing(queued.peer, failure_header(target, err)))
                        return {"cancelled": True}
            return {"cancelled": False}
        # The worker cancels by its own id (ours); its answer comes back to this client.
        self.forwarder.dispatch(
            dataclasses.replace(req, args={"id": rec.gid}), rec.worker, (), False
        )
        return None

    def _drain(self, req: Request) -> dict[str, Any] | None:
        name = req.args.get("worker")
        worker = self.pool.workers.get(name) if isinstance(name, str) else None
        if worker is None or worker.kind != LLM:
            raise BadRequest(f"args.worker must be one of {sorted(self.pool.workers)}")
        peer, rid = req.peer, req.id

        def done(result: dict[str, Any] | Fault) -> None:
            if isinstance(result, Fault):
                self._out.append(Outgoing(peer, failure_header(rid, result, "gateway_drain")))
            else:
                self._out.append(Outgoing(peer, ok_reply(rid, result)))

        self.drainer.start(worker, done)
        return None

    # -- what drains ask of the service (gateway/drain.py) -------------------------------

    def dispatch(self, req: Request, w: WorkerConn, sessions: tuple[str, ...]) -> bool:
        """Send a moved stream's request to ``w``; on failure its client gets the error."""
        try:
            self.forwarder.dispatch(req, w, sessions, placed=False)
        except Exception as exc:
            self._out.append(Outgoing(req.peer, failure_header(req.id, exc, req.op)))
            return False
        return True

    def hold(self, session: str) -> None:
        self.held.setdefault(session, [])

    def release(self, session: str) -> None:
        for req in self.held.pop(session, []):
            self.send_later(req)

    def busy(self, session: str) -> bool:
        return self.ledger.busy(session)

    def client_work(self, w: WorkerConn, ignore: Collection[str] = ()) -> int:
        return self.ledger.client_work(w, ignore)

    def migrated(self, result: str) -> None:
        if self.metrics is not None:
            self.metrics.migrated(result)

    def drains(self) -> list[dict[str, Any]]:
        return self.drainer.active()

    # -- pool listener: the workers' ups, downs and stats (gateway/replies.py) ------------

    def worker_down(self, worker: WorkerConn, reason: str) -> None:
        self.replies.worker_down(worker, reason)

    def worker_up(self, worker: WorkerConn) -> None:
        self.router.forget(worker.name)  # a (re)started worker's prefix cache is empty

    def worker_stats(self, worker: WorkerConn, stats: dict[str, Any], asked_at: float) -> None:
        self.replies.worker_stats(worker, stats, asked_at)
