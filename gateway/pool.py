"""Worker connections: one DEALER per worker, health, load, internal calls.

Health, two signals:

- The connection. Each DEALER runs ZeroMQ heartbeats (``ZMQ_HEARTBEAT_IVL``
  = ``--health-interval-ms``, timeout ``--down-after-ms``). The worker's
  ZeroMQ I/O thread answers them, even while its Python loop is inside a long
  forward, so a worker is only cut off when its process or host is gone,
  stopped or unreachable; a ZeroMQ monitor then reports the dropped
  connection and the worker is marked down at once (a killed process closes
  its socket: no timeout needed). Requests in flight on a dropped
  connection are lost anyway: the worker's ROUTER can no longer address
  their replies.
- The loop. Every ``--health-interval-ms`` each worker gets a ``ping`` (one
  at a time) and a ``stats``. Any message from a worker counts as an answer;
  one whose loop answers nothing for ``--stall-after-ms`` is hung and marked
  down. This limit is generous on purpose: a worker answers ``ping`` between
  two forwards, and on a loaded host one forward can take seconds (measured
  here: 2.7 s on 2 oversubscribed cores); failing its streams then would turn
  a slow worker into a dead one.

A down worker rejoins when it answers ``ping`` and then ``stats`` again (the
``stats`` reply rebuilds its sessions' affinity before it takes new work).

Each connection is a ``protocol.peer.DealerPeer`` (socket, internal calls
by id, the monitor); this module keeps the gateway's policy: when a worker
is up or down, health, load. Its socket has ``ZMQ_IMMEDIATE``: a send to a
worker with no live connection fails at once (``EAGAIN``) instead of queueing
for a worker that may come back without the session, so the caller answers
``worker_unavailable`` and nothing stale is replayed on reconnect.

Load. ``stats`` gives ``running``, ``queued`` and free lanes at one instant;
between two ``stats`` the pool adds what the gateway itself sent and saw
finish, counted so that replies ordered on the same connection make the
estimate exact for gateway traffic: work sent after the ``stats`` request
was sent, minus work finished after its reply arrived.

The owner (``gateway/server.py``) learns of transitions and gets the
replies to its forwarded client requests through a ``PoolListener``, and
runs the pool from its loop (``tick``, ``recv``).
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq

from edge import logs
from faults import Fault, WorkerUnavailable
from protocol import sockets, transport
from protocol.peer import DealerPeer, NotSent
from protocol.transport import error_reply

from .router import Candidate

_log = logs.get_logger("skiff.gateway.pool")

LLM = "llm"
SPEECH = "speech"

# A call's reply: the decoded header and the buffer frames after it.
OnReply = Callable[[dict[str, Any], list[zmq.Frame]], None]


class PoolListener(Protocol):
    def worker_reply(
        self, worker: WorkerConn, header: dict[str, Any], buffers: list[zmq.Frame], size: int
    ) -> None:
        """A reply that is no internal call's (``size``: its header frame's bytes)."""

    def worker_down(self, worker: WorkerConn, reason: str) -> None: ...

    def worker_up(self, worker: WorkerConn) -> None: ...

    def worker_stats(self, worker: WorkerConn, stats: dict[str, Any], asked_at: float) -> None: ...


@dataclass(eq=False)
class WorkerConn:
    """One worker as the gateway sees it."""

    name: str  # the endpoint, as configured
    kind: str  # LLM or SPEECH
    peer: DealerPeer
    up: bool = False
    probing: bool = False  # answered ping while down; waiting for stats to rejoin
    draining: bool = False  # no new sessions or ephemeral work
    drained: bool = False  # no new work at all
    last_seen: float = 0.0
    ping_sent: float = 0.0  # 0 = no ping outstanding
    stats_sent: float = 0.0
    next_health: float = 0.0
    info: dict[str, Any] | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    uptime_s: float = -1.0
    inflight: set[int] = field(default_factory=set)  # gateway ids of client requests here
    downs: int = 0
    # load estimate (see module doc): counters and their values at the last stats
    sent_work: int = 0
    done_work: int = 0
    lanes_taken: int = 0
    lanes_freed: int = 0
    _base: tuple[int, int, int, int] = (0, 0, 0, 0)

    @property
    def eligible(self) -> bool:
        """May take new sessions and ephemeral work."""
        return self.up and not self.draining and not self.drained

    def candidate(self) -> Candidate:
        s = self.stats
        lanes = s.get("lanes") if isinstance(s.get("lanes"), dict) else {}
        total = int(lanes.get("total", 0) or 0) if lanes else 0
        sent0, done0, taken0, freed0 = self._base
        outstanding = int(s.get("running", 0) or 0) + int(s.get("queued", 0) or 0)
        outstanding = max(0, outstanding + (self.sent_work - sent0) - (self.done_work - done0))
        # "room" counts the lanes of sessions a worker would park (else idle ones)
        free = int(lanes.get("room", lanes.get("idle", 0)) or 0) if lanes else 0
        free = max(0, free - (self.lanes_taken - taken0) + (self.lanes_freed - freed0))
        if total:
            running = min(outstanding, total)
            return Candidate(self.name, outstanding - running, running, min(free, total))
        return Candidate(self.name, 0, outstanding, free)

    def mark_stats_sent(self, now: float) -> tuple[int, int]:
        """A ``stats`` request goes out now: the counters its reply will already
        include (work and lanes sent before it), for ``apply_stats``."""
        self.stats_sent = now
        return (self.sent_work, self.lanes_taken)

    def apply_stats(self, stats: dict[str, Any], asked: tuple[int, int]) -> None:
        """The reply to the ``stats`` request that ``mark_stats_sent`` returned
        ``asked`` for. Each reply keeps its own request's counters: a reply
        slower than ``down_after`` is overtaken by a second request, and
        the first reply with the second's counters left out the work sent
        between the two (a worker running a stream looked idle)."""
        sent, taken = asked
        self._base = (sent, self.done_work, taken, self.lanes_freed)
        self.stats = stats


class Pool:
    """Owns the worker sockets; sends, receives, pings, and calls back."""

    def __init__(
        self,
        context: zmq.Context[Any],
        llm: Sequence[str],
        speech: Sequence[str],
        *,
        health_interval_ms: int = 500,
        down_after_ms: int = 1500,
        stall_after_ms: int = 15_000,
        listener: PoolListener,
        ids: itertools.count[int] | None = None,
        curve: sockets.Curve | None = None,
    ) -> None:
        self.interval = health_interval_ms / 1000
        self.down_after = down_after_ms / 1000
        self.stall_after = stall_after_ms / 1000
        self.listener = listener
        self.ids = ids or itertools.count(1)
        self.workers: dict[str, WorkerConn] = {}
        # Workers are trusted peers: no frame cap. With ``curve`` (the gateway's own
        # pair and the workers' public key) every worker link is a CURVE client.
        opts = sockets.SocketOptions(
            max_message_bytes=-1,
            curve=curve,
            immediate=True,
            reconnect_max_ms=1000,
            heartbeat_ms=health_interval_ms,
            heartbeat_timeout_ms=down_after_ms,
        )
        for kind, endpoints in ((LLM, llm), (SPEECH, speech)):
            for ep in endpoints:
                self.workers[ep] = self._connect(context, ep, kind, opts)
        self.by_socket: dict[zmq.Socket[Any], WorkerConn] = {}
        for w in self.workers.values():
            self.by_socket[w.peer.sock] = w
            self.by_socket[w.peer.monitor] = w

    def _connect(
        self, context: zmq.Context[Any], ep: str, kind: str, opts: sockets.SocketOptions
    ) -> WorkerConn:
        # A worker's headers are read uncapped (trusted; the cheapest decode).
        lost = functools.partial(_lost, ep, "connection dropped")
        peer = DealerPeer(context, ep, opts, gone=lost, ids=self.ids, max_header_bytes=None)
        w = WorkerConn(ep, kind, peer)
        peer.other = functools.partial(self.listener.worker_reply, w)
        peer.on_connected = functools.partial(self._connected, w)
        peer.on_dropped = functools.partial(self._dropped, w)
        peer.on_garbage = functools.partial(_garbage, w)
        return w

    # -- views ------------------------------------------------------------------

    def of_kind(self, kind: str) -> list[WorkerConn]:
        return [w for w in self.workers.values() if w.kind == kind]

    def any_up(self, kind: str = LLM) -> bool:
        return any(w.up for w in self.workers.values() if w.kind == kind)

    def sockets(self) -> list[zmq.Socket[Any]]:
        """The sockets to poll: the DEALERs and their monitors."""
        return list(self.by_socket)

    # -- sending ----------------------------------------------------------------

    def send(self, worker: WorkerConn, header: dict[str, Any], buffers: Sequence[Any]) -> int:
        """Send ``[header, *buffers]`` without blocking or copying buffers; the
        bytes sent, or 0 when the worker has no live connection or its queue
        is full."""
        payload = transport.encode(header)
        reason = worker.peer.send(payload, buffers)
        if reason is None:
            return len(payload) + sum(len(b) for b in buffers)
        if reason != transport.NOT_RECEIVING:
            _log.warning("send_failed", worker=worker.name, error=reason)
        return 0

    def call(
        self,
        worker: WorkerConn,
        op: str,
        session: str | None = None,
        args: dict[str, Any] | None = None,
        buffers: Sequence[Any] = (),
        on_reply: OnReply | None = None,
    ) -> int | None:
        """An internal request (health, stats, migration). ``on_reply`` gets the
        reply, or a ``worker_unavailable`` error if the worker goes down first
        or cannot be sent to (then at once, and None is returned)."""
        gid = worker.peer.next_id()
        answer = functools.partial(_answer, worker, on_reply)

        def failed(fault: Fault) -> None:
            answer(error_reply(gid, fault.code, fault.message), [])

        try:
            return worker.peer.request(
                op, session, args, buffers, on_reply=answer, on_fail=failed, req_id=gid
            )
        except NotSent as exc:
            if exc.reason != transport.NOT_RECEIVING:
                _log.warning("send_failed", worker=worker.name, error=exc.reason)
            failed(_lost(worker.name, "not connected", op))
            return None

    # -- health -----------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Pings, stats and down checks that are due."""
        for w in self.workers.values():
            if w.up and now - w.last_seen > self.stall_after:
                self.mark_down(w, f"no answer for {now - w.last_seen:.1f} s")
            if now < w.next_health:
                continue
            w.next_health = now + self.interval
            if w.ping_sent and now - w.ping_sent > self.down_after:
                w.ping_sent = 0.0  # lost with a dropped connection; ask again
            if not w.ping_sent:
                w.ping_sent = now
                self.call(w, "ping", on_reply=functools.partial(self._pong, w))
            if w.up and (not w.stats_sent or now - w.stats_sent > self.down_after):
                self._ask_stats(w, now)

    def _pong(self, w: WorkerConn, header: dict[str, Any], _frames: list[zmq.Frame]) -> None:
        w.ping_sent = 0.0
        if not header.get("ok") or w.up or w.probing:
            return
        # Answering again: learn what it is and what it holds before routing to it.
        w.probing = True
        self.call(w, "info", on_reply=lambda h, f: self._info(w, h))
        self._ask_stats(w, time.monotonic())

    def _info(self, w: WorkerConn, header: dict[str, Any]) -> None:
        result = header.get("result")
        if header.get("ok") and isinstance(result, dict):
            w.info = result

    def _ask_stats(self, w: WorkerConn, now: float) -> None:
        counted = w.mark_stats_sent(now)
        self.call(w, "stats", on_reply=lambda h, f: self._stats(w, h, now, counted))

    def _stats(
        self, w: WorkerConn, header: dict[str, Any], asked_at: float, counted: tuple[int, int]
    ) -> None:
        w.stats_sent = 0.0
        result = header.get("result")
        if not header.get("ok") or not isinstance(result, dict):
            w.probing = False  # not back yet: the next answered ping tries again
            return
        uptime = result.get("uptime_s")
        if isinstance(uptime, int | float):
            if 0 <= uptime < w.uptime_s and w.up:
                # Restarted between two looks (faster than down-after): its KV is new.
                _log.warning("worker_restarted", worker=w.name)
                self.mark_down(w, "restarted")
                w.probing = True
            w.uptime_s = float(uptime)
        w.apply_stats(result, counted)
        if result.get("draining") is True and not w.draining and not w.drained and w.up:
            w.draining = True  # shutting down: no new work until it restarts and rejoins
            _log.warning("worker_shutting_down", worker=w.name)
        if w.probing:
            w.probing = False
            w.up = True
            w.draining = w.drained = False  # a drained worker rejoins after a restart
            w.last_seen = max(w.last_seen, asked_at)
            self.listener.worker_stats(w, result, asked_at)
            _log.info("worker_up", worker=w.name, kind=w.kind)
            self.listener.worker_up(w)
        else:
            self.listener.worker_stats(w, result, asked_at)

    def poll_monitors(self) -> None:
        for w in self.workers.values():
            w.peer.watch()

    def monitor_events(self, w: WorkerConn) -> None:
        """Connection events of ``w``: a drop marks it down at once."""
        w.peer.watch()

    def _connected(self, w: WorkerConn) -> None:
        w.next_health = 0.0  # ping at the next tick: rejoin fast

    def _dropped(self, w: WorkerConn) -> None:
        if w.up or w.probing:
            self.mark_down(w, "connection dropped")

    def mark_down(self, w: WorkerConn, reason: str) -> None:
        """Down: internal calls fail, then the listener fails client requests."""
        was_up = w.up
        w.up = w.probing = False
        w.ping_sent = w.stats_sent = 0.0
        w.stats = {}
        w.downs += was_up
        w.peer.fail_all(functools.partial(_lost, w.name, reason))
        if was_up:
            _log.warning("worker_down", worker=w.name, reason=reason)
        self.listener.worker_down(w, reason)

    def close(self) -> None:
        for w in self.workers.values():
            w.peer.close()


def _lost(name: str, reason: str, op: str) -> Fault:
    return WorkerUnavailable(f"worker {name} is unavailable: {reason}")


def _answer(
    w: WorkerConn, on_reply: OnReply | None, header: dict[str, Any], frames: list[zmq.Frame]
) -> None:
    """An internal call's reply to its callback; a callback's bug is logged, not raised
    into the loop."""
    if on_reply is not None:
        try:
            on_reply(header, frames)
        except Exception:
            _log.exception("call_callback_failed", worker=w.name)


def _garbage(w: WorkerConn, error: str) -> None:
    _log.error("worker_reply_undecodable", worker=w.name, error=error)
