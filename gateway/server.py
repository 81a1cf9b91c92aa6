"""The gateway's service on the shared edge: route, forward, map replies back.

Clients speak the ordinary skiff protocol to the gateway's ROUTER (the edge
checks every envelope and limit). Per request the gateway:

1. picks a worker: the session's (affinity), else the routing policy's
   (``gateway/router.py``); speech ops go to the least busy speech worker;
2. gives it a gateway-unique id (clients choose their own ids, so two
   clients' ids may collide) and forwards ``[header, *buffers]``: only the
   header is encoded again, the buffer frames are the received ZeroMQ
   frames sent on with ``copy=False``;
3. maps each reply and stream event back (``gateway/replies.py``): decode
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
from faults import (
    BadRequest,
    Cancelled,
    DeadlineExceeded,
    Fault,
    LimitExceeded,
    WorkerUnavailable,
)
from protocol.envelope import VERSION, ok_reply

from .affinity import AffinityTable
from .config import GatewayConfig
from .drain import Drainer
from .ledger import Ledger
from .metrics import GatewayMetrics
from .ops import SPEECH_OPS, OpTable, sessions_of
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
STREAM_OPS = frozenset({"generate", "chat"})  # streams a drain can move mid-way


class _NotSent(WorkerUnavailable):
    """The worker's socket refused the message (no live connection, or full)."""


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
            index=PrefixIndex(cfg.prefix_index_blocks),
        )
        self.affinity = AffinityTable()
        self.placer = Placer(self.pool, self.affinity, self.router)
        self.ledger = Ledger(self.affinity)
        self.held: dict[str, list[Request]] = {}  # sessions being moved -> waiting requests
        self.drainer = Drainer(self)
        self.started = time.monotonic()
        self.forwarded = 0
        self.streams_moved = 0
        self._out: list[Outgoing] = []
        self.ready: set[zmq.Socket[Any]] = set()  # worker sockets the last poll found readable
        self._next_tick = 0.0
        self.draining = False  # SIGTERM: relaying accepted work, refusing new
        self.trusted: set[bytes] = set()  # peers the per-client limit spares (trust_peer)
        local: dict[str, Handler] = {
            "ping": lambda req: {"pong": True},
            "info": lambda req: gateway_info(self),
            "stats": lambda req: gateway_stats(self),
            "cancel": self._cancel,
            "gateway_status": lambda req: gateway_status(self),
            "gateway_drain": self._drain,
        }
        self._handlers = OpTable(local, self._forward)
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
        self.trusted.add(peer)
        return peer

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

    # -- client -> worker -----------------------------------------------------------

    def _forward(self, req: Request) -> dict[str, Any] | None:
        limit = self.cfg.max_inflight_per_client
        if (
            limit
            and self.ledger.per_client.get(req.peer, 0) >= limit
            and req.peer not in self.trusted
        ):
            raise LimitExceeded(
                f"this client has {limit} requests in flight; the limit is {limit} "
                "(--max-inflight-per-client)",
                retry_after_ms=100,
            )
        if req.op in SPEECH_OPS:
            self._dispatch(req, self.placer.speech_worker(), (), placed=False)
            return None
        sessions = sessions_of(req)
        for s in sessions:
            waiting = self.held.get(s)
            if waiting is not None:
                waiting.append(req)  # its session is moving; sent on when it lands
                return None
            lost = self.affinity.lost_on(s)
            if lost is not None and self.affinity.worker_of(s) is None:
                if req.op == "drop":  # the client lets it go: the name is free again
                    self.affinity.forget_lost(s)
                    return {}
                raise WorkerUnavailable(
                    f"session {s!r} was on worker {lost}, which went down: its state is "
                    "lost; drop it to start a new session of that name"
                )
        worker, placed, chosen = self.placer.place(req, sessions)
        try:
            self._dispatch(req, worker, sessions, placed)
        except _NotSent:
            # Its connection just went (ZMQ_IMMEDIATE refused the send): let the
            # monitor say so, and give new work one more choice among the others.
            self.pool.monitor_events(worker)
            if not chosen:
                raise
            worker, placed, _ = self.placer.place(req, sessions, exclude=worker)
            self._dispatch(req, worker, sessions, placed)
        return None

    def _dispatch(
        self, req: Request, w: WorkerConn, sessions: tuple[str, ...], placed: bool
    ) -> None:
        """Send ``req`` to ``w`` under a gateway id; raises a Fault when it cannot."""
        gid = next(self.ids)
        header: dict[str, Any] = {"v": VERSION, "id": gid, "op": req.op}
        if req.session is not None:
            header["session"] = req.session
        if req.args:
            header["args"] = req.args
        if req.deadline is not None:
            left = int((req.deadline - time.monotonic()) * 1000)
            if left <= 0:
                if placed:
                    self.ledger.unplace(w, sessions)
                raise DeadlineExceeded("deadline_ms passed before a worker was free")
            header["deadline_ms"] = left
        sent = self.pool.send(w, header, req.buffers)
        if not sent:
            if placed:
                self.ledger.unplace(w, sessions)
            raise _NotSent(f"worker {w.name} is not accepting requests")
        rec = self.ledger.open(gid, req.peer, req.id, req.op, w, sessions, placed)
        if placed or not sessions:
            rec.retry = req
        if req.op in STREAM_OPS and req.args.get("stream", True) is True:
            rec.stream = req  # with media, movable once decoding (the worker says)
        self.forwarded += 1
        if req.op == "drop" and req.session is not None:
            self.affinity.drop_started(req.session)
        if self.metrics is not None:
            self.metrics.to_worker(sent)

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
        self._dispatch(dataclasses.replace(req, args={"id": rec.gid}), rec.worker, (), False)
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
            self._dispatch(req, w, sessions, placed=False)
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
