"""The wire to the next pipeline stage: a ``runtime.Tail`` over ZeroMQ.

One DEALER per stage, connected to the next stage's ROUTER. A forward is a
``forward_frame`` request carrying the hidden rows as a frame (``hidden``,
token axis 0, positions) and the steps' metadata; its reply carries what the
last stage sampled and any asked outputs. Forwards are asynchronous: the
stage sends one and goes on with its next turn (the scheduler bounds how
many are in flight), collecting replies as they come; ``trim``/``drop``
and ``info`` wait for their answers, keeping any forward that lands
meanwhile.

A dead next stage is noticed at once rather than by timeout: the socket is
``ZMQ_IMMEDIATE`` (a send with no live connection fails instead of
queueing) and a socket monitor reports the connection dropping while we
wait. Either ends every outstanding request with ``stage_unavailable``;
once the stage is back ZeroMQ reconnects by itself and chain work resumes.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq
from structlog import get_logger
from zmq.utils.monitor import recv_monitor_message

from faults import BadRequest, Fault, SessionNotActive, StageUnavailable, from_code
from protocol import codec, frames, sockets, transport
from protocol.envelope import request

from ..runtime import Origin, wire
from ..runtime.tail import Landed, TailResult, TailStep

_log = get_logger("skiff.stage")
_SESSION_OP_MS = 5_000  # trim / drop downstream: no forward, answered within a turn
_STATE_MS = 60_000  # export / import of a session's KV downstream (megabytes)


class StageLink:
    def __init__(
        self,
        endpoint: str,
        timeout_ms: int = 120_000,
        context: zmq.Context[Any] | None = None,
        frame_dtype: str = "f32",
        head: bool = False,
        curve: sockets.Curve | None = None,
    ) -> None:
        self.endpoint = endpoint
        # CURVE: this stage's pair; ``server_key`` is the next stage's. The
        # direct socket to the last stage uses the key that stage reports.
        self.curve = curve
        # The head stage of a chain of 3+ stages gets its sampled tokens from
        # the last stage directly (``_direct``), not relayed by the stages in
        # between; set up on the first forward, once the chain is known.
        self.head = head
        self._direct: zmq.Socket[Any] | None = None
        self._direct_known = not head
        self.direct_endpoint: str | None = None  # the last stage, once connected
        # f16 halves the bytes a row costs on the wire, at a measured logit error
        # (scripts/bench_stages.py); f32 keeps the chain exact.
        self.frame_dtype = np.float16 if frame_dtype == "f16" else np.float32
        self.timeout_ms = timeout_ms
        self._ctx = context or zmq.Context.instance()
        # frames from the next stage are capped as a worker caps its peers'
        opts = sockets.SocketOptions(curve=curve)
        self._sock: zmq.Socket[Any] = sockets.dealer(self._ctx, endpoint, opts, connect=False)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._landed: dict[int, Landed] = {}  # forwards home, not yet polled
        self._answers: dict[
            int, Fault | tuple[dict[str, Any], list[memoryview]]
        ] = {}  # plain calls home, not yet taken
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self.connected = False
        self._sock.connect(endpoint)

    def close(self) -> None:
        if self._direct is not None:
            self._direct.close(linger=0)
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)

    # -- the Tail protocol ---------------------------------------------------------

    def send(self, steps: list[TailStep], hidden: np.ndarray) -> int:
        if not self._direct_known:
            self._setup_direct()
        req_id = next(self._ids)
        direct = self._direct.getsockopt(zmq.ROUTING_ID) if self._direct is not None else None
        if isinstance(direct, bytes):
            # answered by the last stage straight to our direct socket
            for i, step in enumerate(steps):
                step.origin = Origin(direct, req_id, i, len(steps))
        positions = [s.position + k for s in steps for k in range(len(s.tokens))]
        rows = hidden.astype(self.frame_dtype) if hidden.dtype != self.frame_dtype else hidden
        frame = frames.make_frame(
            [("hidden", rows, 0)], positions=positions, sequence_count=len(steps)
        )
        buffers: list[Any] = []
        args = {
            "input": frames.attach(frame, buffers),
            "steps": [wire.step_out(s) for s in steps],
        }
        return self._send("forward_frame", None, args, buffers, self.timeout_ms, len(steps), req_id)

    def poll(self, timeout_ms: int) -> dict[int, Landed]:
        if not self._landed:
            self._pump(timeout_ms)
        landed, self._landed = self._landed, {}
        return landed

    @property
    def in_flight(self) -> int:
        return sum(1 for p in self._pending.values() if p.steps is not None)

    def session_op(self, op: str, session: str, token_count: int = 0) -> None:
        args = {"token_count": token_count} if op == "trim" else None
        try:
            self._call(op, session, args, [], timeout_ms=_SESSION_OP_MS)
        except SessionNotActive:
            pass  # the session never reached the next stage (or was dropped there)
        except StageUnavailable as exc:
            if op != "drop":
                raise
            _log.warning("stage_drop_lost", session=session, error=exc.message)

    def session_query(self, op: str, session: str, window_tokens: int = 0) -> dict[str, Any]:
        args = {"window_tokens": window_tokens} if op == "signal_window" else None
        header, _ = self._call(op, session, args, [], timeout_ms=_SESSION_OP_MS)
        value = header.get("result")
        return value if isinstance(value, dict) else {}

    def export_state(self, session: str) -> tuple[list[dict[str, Any]], list[np.ndarray]]:
        header, buffers = self._call("export_state", session, None, [], _STATE_MS)
        result = header.get("result") or {}
        meta = result.get("session_state")
        if not isinstance(meta, dict) or "frame" not in result:
            raise StageUnavailable("the next stage sent a malformed export_state reply")
        arrays = frames.parse(result["frame"], buffers).arrays()
        below = list(meta.pop("downstream", None) or [])
        kvs = [np.array(arrays["kv_state"])]
        kvs += [np.array(arrays[f"kv_state.{i + 1}"]) for i in range(len(below))]
        return [meta, *below], kvs

    def import_state(
        self, session: str, metas: list[dict[str, Any]], kvs: list[np.ndarray]
    ) -> None:
        if not metas or len(metas) != len(kvs):
            raise BadRequest("one session state per stage below is needed")
        meta = {**metas[0], "downstream": metas[1:]} if len(metas) > 1 else dict(metas[0])
        names = ["kv_state", *(f"kv_state.{i}" for i in range(1, len(kvs)))]
        frame = frames.make_frame([(n, kv, -1) for n, kv in zip(names, kvs, strict=True)])
        buffers: list[Any] = []
        args = {"session_state": meta, "frame": frames.attach(frame, buffers)}
        self._call("import_state", session, args, buffers, _STATE_MS)

    def info(self) -> dict[str, Any]:
        header, _ = self._call("info", None, None, [], timeout_ms=5_000)
        value = header.get("result")
        return value if isinstance(value, dict) else {}

    # -- requests and replies ----------------------------------------------------------

    def _call(
        self,
        op: str,
        session: str | None,
        args: dict[str, Any] | None,
        buffers: list[Any],
        timeout_ms: int,
    ) -> tuple[dict[str, Any], list[memoryview]]:
        req_id = self._send(op, session, args, buffers, timeout_ms, None)
        while req_id not in self._answers:
            self._pump(timeout_ms)
        answer = self._answers.pop(req_id)
        if isinstance(answer, Fault):
            raise answer
        header, reply_buffers = answer
        return header, reply_buffers

    def _send(
        self,
        op: str,
        session: str | None,
        args: dict[str, Any] | None,
        buffers: list[Any],
        timeout_ms: int,
        steps: int | None,
        req_id: int | None = None,
    ) -> int:
        self._drain_monitor()
        if not self.connected:
            # not yet connected, or the connection dropped: fail at once
            # rather than queue work a dead stage would never answer
            raise StageUnavailable(f"the next stage ({self.endpoint}) is not connected")
        req_id = next(self._ids) if req_id is None else req_id
        header = request(req_id, op, session, args)
        reason = transport.send(self._sock, codec.encode(header), buffers)
        if reason == transport.NOT_RECEIVING:  # IMMEDIATE: no finished connection (or handshake)
            raise StageUnavailable(f"the next stage ({self.endpoint}) is not connected")
        if reason is not None:
            raise StageUnavailable(f"the next stage ({self.endpoint}) cannot take it: {reason}")
        self._pending[req_id] = _Pending(op, steps, time.monotonic() + timeout_ms / 1000)
        return req_id

    def _pump(self, timeout_ms: int) -> None:
        """Take in what has arrived, waiting up to ``timeout_ms`` for the first
        message; requests past their deadline or cut off by a dropped link
        land as ``stage_unavailable``."""
        now = time.monotonic()
        for req_id, p in list(self._pending.items()):
            if p.deadline <= now:
                self._land(
                    req_id,
                    StageUnavailable(f"the next stage ({self.endpoint}) did not answer {p.op}"),
                )
        if self._drain_monitor():
            self._fail_all(f"the next stage ({self.endpoint}) went away")
            return
        if not self._pending:
            return
        wait = min(
            timeout_ms,
            max(0, int((min(p.deadline for p in self._pending.values()) - now) * 1000) + 1),
        )
        ready = dict(self._poller.poll(wait))
        if self._monitor in ready and self._drain_monitor():
            self._fail_all(f"the next stage ({self.endpoint}) went away")
            return
        for sock in (self._sock, self._direct):
            while sock is not None and sock.poll(0):
                msg = sock.recv_multipart(copy=False)
                reply = codec.decode(msg[0].buffer, max_bytes=1 << 30)
                got = reply.get("id") if isinstance(reply, dict) else None
                if not isinstance(got, int) or got not in self._pending:
                    continue  # a late reply (or acknowledgement) of a request gone home
                outcome = self._outcome(reply, [f.buffer for f in msg[1:]], got)
                if outcome is not _ACK:
                    self._land(got, outcome)

    def _outcome(
        self, reply: dict[str, Any], buffers: list[memoryview], req_id: int
    ) -> Fault | tuple[dict[str, Any], list[memoryview]] | list[TailResult] | object:
        if not reply.get("ok"):
            err = reply.get("error") or {}
            cls = from_code(str(err.get("code", "internal")))
            message = f"next stage: {err.get('message', '')}"
            return (cls if issubclass(cls, Fault) else BadRequest)(message)
        steps = self._pending[req_id].steps
        if steps is None:
            return reply, buffers
        items = (reply.get("result") or {}).get("results")
        if self._direct is not None and wire.is_direct(items):
            return _ACK  # the stages below took it; the last stage answers us directly
        try:
            return _results(reply, buffers, steps)
        except (Fault, ValueError, KeyError, TypeError) as exc:
            return StageUnavailable(f"the next stage sent a malformed forward_frame reply: {exc}")

    def _setup_direct(self) -> None:
        """With 3+ stages, connect straight to the last one (as its previous
        stage dials it) so sampled tokens come home in one hop; wait for a
        ``ping`` through it so the last stage can route to us from the start."""
        chain = self.info().get("chain") or []
        self._direct_known = True
        if not isinstance(chain, list) or len(chain) < 2:
            return  # the next stage is the last: its replies are already direct
        endpoint = chain[-2].get("next") if isinstance(chain[-2], dict) else None
        if not isinstance(endpoint, str) or not endpoint:
            self._direct_known = False
            raise StageUnavailable("the chain's last stage endpoint is unknown")
        curve = None
        if self.curve is not None:
            last = chain[-1] if isinstance(chain[-1], dict) else {}
            key = last.get("curve_key")
            if not isinstance(key, str):
                self._direct_known = False
                raise StageUnavailable("the chain's last stage reports no CURVE key")
            curve = self.curve.toward(key.encode())
        routing_id = b"skiff-head-" + os.urandom(8).hex().encode()
        opts = sockets.SocketOptions(curve=curve, routing_id=routing_id)
        sock: zmq.Socket[Any] = sockets.dealer(self._ctx, endpoint, opts)
        sock.send(codec.encode(request(0, "ping", None, None)))
        if not sock.poll(_SESSION_OP_MS):
            sock.close(linger=0)
            self._direct_known = False
            raise StageUnavailable(f"the chain's last stage ({endpoint}) did not answer")
        sock.recv_multipart()
        self._direct = sock
        self.direct_endpoint = endpoint
        self._poller.register(sock, zmq.POLLIN)
        _log.info("stage_direct_return", last_stage=endpoint)

    def _land(self, req_id: int, outcome: Any) -> None:
        p = self._pending.pop(req_id)
        if p.steps is None:
            self._answers[req_id] = outcome
        else:
            self._landed[req_id] = outcome

    def _fail_all(self, why: str) -> None:
        for req_id, p in list(self._pending.items()):
            self._land(req_id, StageUnavailable(f"{why} during {p.op}"))

    def _drain_monitor(self) -> bool:
        """Read pending connection events; True when the link dropped."""
        dropped = False
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                dropped = True
                self.connected = False
            elif event["event"] == zmq.EVENT_CONNECTED:
                self.connected = True
        return dropped


_ACK = object()  # a forward's acknowledgement: its result comes on the direct socket


@dataclass(slots=True)
class _Pending:
    op: str
    steps: int | None  # a forward's step count; None for a plain call
    deadline: float


def _results(reply: dict[str, Any], buffers: list[memoryview], steps: int) -> list[TailResult]:
    """A ``forward_frame`` reply's per-step results, rows cut from its frame."""
    result = reply.get("result") or {}
    arrays: dict[str, np.ndarray] = {}
    if "frame" in result:
        arrays = {
            k: np.array(v) for k, v in frames.parse(result["frame"], buffers).arrays().items()
        }
    return wire.results_in(result, arrays, steps)
