"""The ROUTER loop: receive, decode, validate, dispatch, reply.

One thread owns the socket, the runtime and the scheduler. Each loop pass
drains every waiting message without blocking (cheap ops are answered at
once), then runs one scheduler turn (at most one forward). So ``ping`` is
never more than one forward away, and the loop only sleeps in ``poll``
when there is no work.

Replies go out with ROUTER_MANDATORY and NOBLOCK: a peer that vanished
(unroutable) or stopped reading (its queue is full) is detected on send,
and its work is cancelled instead of holding lanes forever.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import zmq

from protocol import codec, envelope
from protocol.envelope import VERSION, ErrorCode

from . import logs
from .chat import ChatTemplate
from .config import WorkerConfig
from .context import RequestCtx
from .engine import Engine
from .handlers import HANDLERS
from .runtime import RuntimeFault, RuntimeState
from .scheduler import Scheduler, SchedulerConfig
from .speculative import DraftModel

_log = logs.get_logger("skiff.server")
_DRAIN_MAX = 256  # messages handled per pass before the model gets a turn
_IDLE_POLL_MS = 100


class Server:
    def __init__(
        self,
        cfg: WorkerConfig,
        engine: Engine,
        context: zmq.Context[Any] | None = None,
        draft: DraftModel | None = None,
    ) -> None:
        self.cfg = cfg
        self.engine = engine
        self.draft = draft  # speculative.mode = "draft_model"
        self.rt = RuntimeState(engine)
        self.chat = ChatTemplate.load(cfg.chat_template, engine)
        self.sched = Scheduler(
            self.rt,
            SchedulerConfig(
                max_batch_tokens=cfg.budget,
                prefill_chunk=cfg.prefill_chunk,
                max_queue=cfg.max_queue,
                admission_timeout_ms=cfg.admission_timeout_ms,
            ),
        )
        self._zctx = context or zmq.Context.instance()
        self.sock: zmq.Socket[Any] = self._zctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 10_000)
        self.sock.setsockopt(zmq.RCVHWM, 10_000)
        self.sock.bind(cfg.bind)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.requests = 0
        self._stop = threading.Event()
        self._last_sweep = time.monotonic()

    # -- lifecycle -----------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self.sock.close(linger=0)

    def serve_forever(self) -> None:
        _log.info(
            "worker_ready",
            endpoint=self.endpoint,
            lanes=self.rt.lanes.n_lanes,
            n_ctx=self.engine.n_ctx,
            model=self.engine.cfg.model_path,
        )
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            timeout = 0 if self.sched.has_work() else _IDLE_POLL_MS
            if poller.poll(timeout):
                self._drain()
            if self.sched.has_work():
                self.sched.turn()
            self._sweep_idle_sessions()
        _log.info("worker_stopped", requests=self.requests)

    def _drain(self) -> None:
        for _ in range(_DRAIN_MAX):
            if not int(self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return
            self._handle(*self._recv())

    def _recv(self) -> tuple[bytes, bytes | None, list[memoryview]]:
        """One message: peer id and header copied (small), buffers zero-copy."""
        sock = self.sock
        peer = sock.recv(zmq.NOBLOCK)
        header = sock.recv() if sock.getsockopt(zmq.RCVMORE) else None
        buffers: list[memoryview] = []
        while sock.getsockopt(zmq.RCVMORE):
            buffers.append(sock.recv(copy=False).buffer)
        return peer, header, buffers

    # -- one request -----------------------------------------------------------

    def _handle(self, peer: bytes, raw: bytes | None, buffers: list[memoryview]) -> None:
        self.requests += 1
        if raw is None:
            self._send(
                peer, envelope.error_reply(None, ErrorCode.BAD_REQUEST, "no header frame"), ()
            )
            return
        try:
            header = codec.decode(raw, self.cfg.max_request_bytes)
        except codec.HeaderTooLarge as exc:
            self._send(peer, envelope.error_reply(None, ErrorCode.PAYLOAD_TOO_LARGE, str(exc)), ())
            return
        except codec.CodecError as exc:
            self._send(peer, envelope.error_reply(None, ErrorCode.BAD_REQUEST, str(exc)), ())
            return
        req_id = header.get("id")
        if isinstance(req_id, bool) or not isinstance(req_id, int):
            req_id = None
        op = header.get("op")
        session = header.get("session")
        logs.bind_request(req_id, op, session)
        try:
            ctx = RequestCtx(
                peer, req_id, str(op), session if isinstance(session, str) else None, self._send
            )
            self._dispatch(ctx, header, buffers)
        finally:
            logs.clear_request()

    def _dispatch(self, ctx: RequestCtx, header: dict[str, Any], buffers: list[Any]) -> None:
        if header.get("v") != VERSION:
            code = ErrorCode.BAD_REQUEST if "v" not in header else ErrorCode.UNSUPPORTED_VERSION
            ctx.error(code, f"protocol version must be {VERSION}")
            return
        if ctx.id is None:
            ctx.error(ErrorCode.BAD_REQUEST, "id must be an integer")
            return
        if not isinstance(header.get("op"), str):
            ctx.error(ErrorCode.BAD_REQUEST, "op must be a string")
            return
        handler = HANDLERS.get(ctx.op)
        if handler is None:
            ctx.error(ErrorCode.UNKNOWN_OP, f"unknown op {header.get('op')!r}")
            return
        deadline_ms = header.get("deadline_ms")
        if deadline_ms is not None:
            if (
                isinstance(deadline_ms, bool)
                or not isinstance(deadline_ms, int)
                or deadline_ms <= 0
            ):
                ctx.error(ErrorCode.BAD_REQUEST, "deadline_ms must be a positive integer")
                return
            ctx.deadline = ctx.received + deadline_ms / 1000
        try:
            handler(self, ctx, header, buffers)
        except RuntimeFault as exc:
            ctx.fail(exc)
        except Exception as exc:  # the worker never dies of a request
            _log.exception("handler_crashed")
            ctx.fail(exc)

    def _send(self, peer: bytes, header: dict[str, Any], buffers: Sequence[Any]) -> bool:
        sock = self.sock
        try:
            sock.send(peer, zmq.SNDMORE | zmq.NOBLOCK)
            if not buffers:
                sock.send(codec.encode(header), zmq.NOBLOCK)
                return True
            sock.send(codec.encode(header), zmq.SNDMORE | zmq.NOBLOCK)
            for buf in buffers[:-1]:
                sock.send(buf, zmq.SNDMORE | zmq.NOBLOCK, copy=False)
            sock.send(buffers[-1], zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            reason = "peer_not_receiving"
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            reason = "peer_gone"
        cancelled = self.sched.cancel_peer(peer)
        _log.warning(reason, peer=peer.hex(), cancelled=cancelled)
        return False

    # -- housekeeping ----------------------------------------------------------

    def _sweep_idle_sessions(self) -> None:
        now = time.monotonic()
        if now - self._last_sweep < 1.0:
            return
        self._last_sweep = now
        for session in list(self.rt.lanes.sessions.values()):
            idle = now - session.last_used
            if idle > self.cfg.session_idle_s and not self.sched.knows_session(session.id):
                self.rt.drop(session.id)
                _log.info("session_expired", session=session.id, idle_s=round(idle, 1))

    def info(self) -> dict[str, Any]:
        e = self.engine
        return {
            "model": {
                "path": e.cfg.model_path,
                "name": e.metadata("general.name"),
                "n_vocab": e.n_vocab,
                "n_embd": e.n_embd,
                "n_layer": e.n_layer,
                "n_ctx_train": e.n_ctx_train,
                "bos": e.bos,
                "eos": e.eos,
            },
            "lanes": self.rt.lanes.n_lanes,
            "n_ctx": e.n_ctx,
            "n_ctx_per_lane": self.rt.ctx_per_lane,
            "n_batch": e.n_batch,
            "max_batch_tokens": self.cfg.budget,
            "prefill_chunk": self.cfg.prefill_chunk,
            "ops": sorted(HANDLERS),
            "chat_template": self.chat.info(),
            "speech": False,
            "draft_model": self.draft.path if self.draft else None,
            "protocol": VERSION,
        }

    def stats(self) -> dict[str, Any]:
        out = self.rt.stats()
        out.update(self.sched.stats.snapshot())
        out["running"] = len(self.sched.active)
        out["queued"] = len(self.sched.pending)
        out["requests"] = self.requests
        return out
