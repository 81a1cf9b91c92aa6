"""The one ROUTER loop every skiff process runs (LLM worker, speech worker, gateway).

Bytes in, typed requests to a service's op table; the service's typed
answers, already rendered as ``Outgoing`` messages, out. The loop:

1. waits in ``poll`` only when the service has no work;
2. drains up to ``drain_max`` messages without blocking. Each is decoded
   with size and depth caps; the envelope (``v``, ``id``, ``op``,
   ``session``, ``args``, ``deadline_ms``) is checked for type and range
   before any value is logged or used; ``bind_request`` then puts its id, op
   and session on every line logged while it is handled (the server is where
   a request meets the log); the op's handler answers at once
   (a result map) or takes the request on (``None``) and answers later
   through the service's turn;
3. runs one ``service.turn()`` (for the LLM worker: at most one forward) and
   sends what it returns;
4. sends with ``NOBLOCK`` on a ``ROUTER_MANDATORY`` socket: a vanished peer
   (``EHOSTUNREACH``) or one that stopped reading (its queue is full,
   ``EAGAIN``) is reported to ``service.peer_lost`` *after* the batch, so
   the service cancels that peer's work without being re-entered mid-turn.

Every failure becomes a reply with the code its ``faults`` class carries;
anything else is ``internal``. Nothing a request does ends the loop.

Graceful drain (SIGTERM, ``drain()``): new work is refused with
``shutting_down``, accepted work runs to its end or to the drain timeout,
after which the service cancels the rest with their final events; then
``serve_forever`` returns and the process exits 0.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
import zmq

from faults import BadRequest, PayloadTooLarge, ShuttingDown, UnknownOp, UnsupportedVersion
from protocol import sockets, transport
from protocol.transport import MAX_SESSION_CHARS, VERSION, ok_reply

from . import logs, memory, zap
from .service import Outgoing, Request, Service, failure_header

if TYPE_CHECKING:
    from .metrics import EdgeMetrics

_log = logs.get_logger("skiff.edge")

MAX_OP_CHARS = 64
# Served while draining, whatever the service: liveness, state and stopping work.
ALWAYS_SERVED = frozenset({"ping", "info", "stats", "cancel"})
# After a drain's timeout cancels the rest, the cancellations get this long to go out.
CANCEL_GRACE_S = 5.0
CLOSE_LINGER_MS = 2000  # after a drain: how long the last replies may take to leave


class _Undecodable(BadRequest):
    """A header that parsed but may not be used; its id is still known."""

    def __init__(self, message: str, req_id: int | None) -> None:
        super().__init__(message)
        self.req_id = req_id


@dataclass(frozen=True)
class EdgeConfig:
    bind: str
    max_header_bytes: int = transport.DEFAULT_MAX_HEADER_BYTES
    socket: sockets.SocketOptions = field(default_factory=sockets.SocketOptions)
    drain_max: int = 256  # messages handled per pass before the service gets a turn
    idle_poll_ms: int = 100
    authorized: str = ""  # CURVE (socket.curve): directory of the client keys allowed (ZAP)


def bind_request(req_id: int | None, op: str | None, session: str | None) -> None:
    """Bind the keys every log line of this request carries (contextvars: no
    logger threaded through calls). Only validated values: mypy holds callers to it."""
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(request_id=req_id, op=op, session=session)


def clear_request() -> None:
    """Unbind them: nothing logged after the request carries its keys."""
    structlog.contextvars.clear_contextvars()


class EdgeServer:
    """Owns the ROUTER socket and runs ``service`` on it, one thread."""

    def __init__(
        self,
        cfg: EdgeConfig,
        service: Service,
        context: zmq.Context[Any] | None = None,
        metrics: EdgeMetrics | None = None,
    ) -> None:
        self.cfg = cfg
        self.service = service
        self.metrics = metrics  # requests in, replies out (edge/metrics.py); None = off
        self._zctx = context or zmq.Context.instance()
        # ZAP before the bind: a CURVE ROUTER without it admits any client.
        self.zap = zap.for_server(self._zctx, cfg.bind, cfg.socket.curve, cfg.authorized)
        self.sock = sockets.router(self._zctx, cfg.bind, cfg.socket)
        self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.requests = 0
        self.peers_lost = 0
        self._stop = threading.Event()
        self._last_housekeeping = time.monotonic()
        self._trimmed_at_requests = 0  # ``requests`` when the heap was last trimmed
        # seconds per part of the loop since start (a worker's stats profile):
        # waiting in poll, receiving + handling requests, the service's turns,
        # sending replies, housekeeping
        self.timing = {"poll": 0.0, "receive": 0.0, "turn": 0.0, "send": 0.0, "housekeeping": 0.0}
        self.started = time.perf_counter()
        self._drain_deadline: float | None = None  # set by drain() (a signal handler)
        self._drain_begun = False
        self._cancelled_at: float | None = None

    # -- lifecycle -----------------------------------------------------------

    def stop(self) -> None:
        """Ask the loop to end after the current pass (signal-safe)."""
        self._stop.set()

    def drain(self, timeout_s: float) -> None:
        """Stop taking new work, finish what was accepted, then end the loop.

        Signal-safe: it only sets a deadline the loop reads after its pass, so
        the service is never re-entered mid-turn. New requests get
        ``shutting_down`` (except ``ALWAYS_SERVED`` and the service's
        ``drain_ops``); accepted ones run until ``timeout_s``, then the rest
        are cancelled with their final event and the loop ends. A second
        call (a second SIGTERM or Ctrl-C) cancels at once.
        """
        now = time.monotonic()
        if self._drain_deadline is None:
            self._drain_deadline = now + max(0.0, timeout_s)
        else:
            self._drain_deadline = min(self._drain_deadline, now)

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    def close(self) -> None:
        """Close the socket. After a drain, wait (bounded) for the last replies
        to leave: they are queued in ZeroMQ, and linger 0 would drop them."""
        self.sock.close(linger=CLOSE_LINGER_MS if self._drain_begun else 0)
        if self.zap is not None:
            self.zap.close()

    def serve_forever(self, poller: zmq.Poller | None = None) -> None:
        """Serve until ``stop()``, or until a ``drain()`` has run its course.
        ``poller`` (the gateway's) may watch more sockets than the front."""
        if poller is None:
            poller = zmq.Poller()
            poller.register(self.sock, zmq.POLLIN)
            if self.zap is not None:
                poller.register(self.zap.socket, zmq.POLLIN)
        while not self._stop.is_set():
            self.run_once(poller)
            if self._drain_deadline is not None and self._drain_step():
                return

    def _drain_step(self) -> bool:
        """One drain check after a pass; True when the loop may end."""
        assert self._drain_deadline is not None
        now = time.monotonic()
        if not self._drain_begun:
            self._drain_begun = True
            _log.info("drain_started", timeout_s=round(self._drain_deadline - now, 3))
            self.service.begin_drain()
        if self.service.idle():
            _log.info("drain_done", cancelled=self._cancelled_at is not None)
            return True
        if self._cancelled_at is None:
            if now >= self._drain_deadline:
                self._cancelled_at = now
                n = self.service.cancel_all("the worker is shutting down (drain timeout)")
                _log.warning("drain_timeout", cancelled=n)
            return False
        if now - self._cancelled_at > CANCEL_GRACE_S:
            _log.error("drain_gave_up", grace_s=CANCEL_GRACE_S)
            return True
        return False

    def run_once(self, poller: zmq.Poller) -> None:
        """One pass: wait (only when idle), drain, one service turn, housekeeping."""
        timing = self.timing
        t0 = time.perf_counter()
        busy = self.service.has_work()
        events = poller.poll(0 if busy else self.cfg.idle_poll_ms)
        t1 = time.perf_counter()
        timing["poll"] += t1 - t0
        if self.zap is not None:  # CURVE: handshakes are answered even when busy
            events = zap.split_events(self.zap, events)
        if events:
            self._drain()
            t2 = time.perf_counter()
            timing["receive"] += t2 - t1
            t1 = t2
        if self.service.has_work():
            try:
                out = self.service.turn()
            except Exception:  # a service bug must not end the process
                _log.exception("turn_crashed")
                out = []
            t2 = time.perf_counter()
            timing["turn"] += t2 - t1
            self.deliver(out)
            timing["send"] += time.perf_counter() - t2
        now = time.monotonic()
        if now - self._last_housekeeping >= 1.0:
            self._last_housekeeping = now
            t0 = time.perf_counter()
            try:
                self.service.housekeeping(now)
            except Exception:
                _log.exception("housekeeping_crashed")
            if self.requests != self._trimmed_at_requests and not self.service.has_work():
                self._trimmed_at_requests = self.requests
                memory.trim_heap()  # idle after traffic: freed frames go back to the kernel
            timing["housekeeping"] += time.perf_counter() - t0

    # -- receiving -------------------------------------------------------------

    def _drain(self) -> None:
        for _ in range(self.cfg.drain_max):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.requests += 1
            peer = frames[0].bytes
            try:
                self._handle(peer, frames[1:])
            except Exception as exc:  # belt and braces: nothing ends the loop
                _log.exception("handle_crashed")
                self.deliver([Outgoing(peer, failure_header(None, exc))])
            finally:
                clear_request()

    def _handle(self, peer: bytes, frames: Sequence[zmq.Frame]) -> None:
        req_id: int | None = None
        op: str | None = None
        counted = False
        try:
            if not frames:
                raise BadRequest("message has no header frame")
            try:
                header = self._decode(frames[0])
            except _Undecodable as exc:
                req_id = exc.req_id
                raise
            raw_id = header.get("id")
            if type(raw_id) is int:
                req_id = raw_id
            raw_op = header.get("op")
            if type(raw_op) is str and len(raw_op) <= MAX_OP_CHARS:
                op = raw_op
            if self.metrics is not None:
                counted = True
                self.metrics.received(peer, req_id, op)
            request = self._envelope(peer, header, req_id, op, frames)
            bind_request(request.id, request.op, request.session)
            if self._drain_deadline is not None:
                self._refuse_while_draining(request.op)
            handler = self.service.handlers.get(request.op)
            if handler is None:
                raise UnknownOp(f"unknown op {request.op!r}")
            result = handler(request)
        except Exception as exc:
            if self.metrics is not None and not counted:  # undecodable: count it all the same
                self.metrics.received(peer, req_id, op)
            self.deliver([Outgoing(peer, failure_header(req_id, exc, op))])
            return
        if result is not None:
            self.deliver([Outgoing(peer, ok_reply(req_id, result))])

    def _refuse_while_draining(self, op: str) -> None:
        if op in ALWAYS_SERVED or op in self.service.drain_ops:
            return
        assert self._drain_deadline is not None
        left_ms = int((self._drain_deadline - time.monotonic()) * 1000)
        raise ShuttingDown(
            "this process is shutting down and takes no new work; retry elsewhere or later",
            retry_after_ms=max(1000, left_ms),
        )

    def _decode(self, frame: zmq.Frame) -> dict[str, Any]:
        try:
            return transport.decode(frame.buffer, self.cfg.max_header_bytes)
        except transport.HeaderTooLarge as exc:
            raise PayloadTooLarge(str(exc)) from None
        except transport.TooDeep as exc:
            raise _Undecodable(str(exc), exc.req_id) from None
        except transport.CodecError as exc:
            raise BadRequest(str(exc)) from None

    def _envelope(
        self,
        peer: bytes,
        header: dict[str, Any],
        req_id: int | None,
        op: str | None,
        frames: Sequence[zmq.Frame],
    ) -> Request:
        """Check every envelope field's type and range; nothing else is trusted."""
        version = header.get("v")
        if type(version) is not int or version != VERSION:
            # 1.0 and true compare equal to 1 in Python; only the integer 1 is version 1.
            raise UnsupportedVersion(f"protocol version must be the integer {VERSION}")
        if req_id is None:
            raise BadRequest("id must be an integer")
        if op is None:
            raise BadRequest(f"op must be a string of at most {MAX_OP_CHARS} characters")
        session = header.get("session")
        if session is not None and (
            type(session) is not str or not 0 < len(session) <= MAX_SESSION_CHARS
        ):
            raise BadRequest(
                f"session must be a non-empty string of at most {MAX_SESSION_CHARS} characters"
            )
        args = header.get("args")
        if args is None:
            args = {}
        elif not isinstance(args, dict):
            raise BadRequest("args must be a map")
        received = time.monotonic()
        deadline: float | None = None
        deadline_ms = header.get("deadline_ms")
        if deadline_ms is not None:
            if type(deadline_ms) is not int or deadline_ms <= 0:
                raise BadRequest("deadline_ms must be a positive integer")
            deadline = received + deadline_ms / 1000
        buffers = [f.buffer for f in frames[1:]]
        return Request(peer, req_id, op, session, args, buffers, received, deadline)

    # -- sending ---------------------------------------------------------------

    def deliver(self, messages: Iterable[Outgoing]) -> None:
        """Send each message; tell the service about peers lost on the way."""
        lost: dict[bytes, str] = {}
        metrics = self.metrics
        for msg in messages:
            if msg.peer in lost:
                continue
            if metrics is not None:  # before the send: a client never sees a reply uncounted
                metrics.replied(msg.peer, msg.header)
            reason = self._send(msg)
            if reason is not None:
                lost[msg.peer] = reason
        for peer, reason in lost.items():
            self.peers_lost += 1
            if metrics is not None:
                metrics.peer_lost(peer, reason)
            try:
                cancelled = self.service.peer_lost(peer, reason)
            except Exception:
                _log.exception("peer_lost_crashed")
                cancelled = -1
            _log.warning(reason, peer=peer.hex(), cancelled=cancelled)

    def _send(self, msg: Outgoing) -> str | None:
        """Send one message without blocking; the reason it could not be, or None."""
        sock = self.sock
        try:
            payload = transport.encode(msg.header)  # before the first frame: never half a message
        except Exception as exc:
            _log.error("reply_unencodable", error=f"{type(exc).__name__}: {exc}")
            payload = transport.encode(failure_header(msg.header.get("id"), exc))
        reason = transport.send(sock, payload, msg.buffers, route=msg.peer)
        if transport.failed(reason):
            _log.error("send_failed", error=reason)
            return transport.FAILED
        return reason
