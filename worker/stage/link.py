"""The wire to the next pipeline stage: a ``runtime.Tail`` over ZeroMQ.

One DEALER per stage, connected to the next stage's ROUTER. A forward is a
``forward_frame`` request carrying the hidden rows as a frame (``hidden``,
token axis 0, positions) and the steps' metadata; its reply carries what the
last stage sampled and any asked outputs. The call blocks the stage's turn
(stages run one after another within a turn; see docs/architecture.md).

A dead next stage is noticed at once rather than by timeout: the socket is
``ZMQ_IMMEDIATE`` (a send with no live connection fails instead of
queueing) and a socket monitor reports the connection dropping while we
wait. Either ends the forward with ``stage_unavailable``; once the stage is
back ZeroMQ reconnects by itself and chain work resumes.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np
import zmq
from structlog import get_logger
from zmq.utils.monitor import recv_monitor_message

from faults import BadRequest, Fault, SessionNotActive, StageUnavailable, from_code
from protocol import codec, frames, sockets
from protocol.envelope import request

from ..runtime.tail import TailResult, TailStep

_log = get_logger("skiff.stage")
_SESSION_OP_MS = 5_000  # trim / drop downstream: no forward, answered within a turn


class StageLink:
    def __init__(
        self,
        endpoint: str,
        timeout_ms: int = 120_000,
        context: zmq.Context[Any] | None = None,
        frame_dtype: str = "f32",
    ) -> None:
        self.endpoint = endpoint
        # f16 halves the bytes a row costs on the wire, at a measured logit error
        # (scripts/bench_stages.py); f32 keeps the chain exact.
        self.frame_dtype = np.float16 if frame_dtype == "f16" else np.float32
        self.timeout_ms = timeout_ms
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket[Any] = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, sockets.DEFAULT_MAX_MESSAGE_BYTES)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._ids = itertools.count(1)
        self.connected = False
        self._sock.connect(endpoint)

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)

    # -- the Tail protocol ---------------------------------------------------------

    def forward(self, steps: list[TailStep], hidden: np.ndarray) -> list[TailResult]:
        positions = [s.position + k for s in steps for k in range(len(s.tokens))]
        wire = hidden.astype(self.frame_dtype) if hidden.dtype != self.frame_dtype else hidden
        frame = frames.make_frame(
            [("hidden", wire, 0)], positions=positions, sequence_count=len(steps)
        )
        buffers: list[Any] = []
        args = {
            "input": frames.attach(frame, buffers),
            "steps": [
                {
                    "session": s.session,
                    "tokens": s.tokens,
                    "position": s.position,
                    "sample": s.sample,
                    "sampling": s.sampling,
                    "output": list(s.outputs),
                    "capture_all": s.capture_all,
                    "top_logprobs": s.top_logprobs,
                }
                for s in steps
            ],
        }
        header, reply_buffers = self._call("forward_frame", None, args, buffers)
        result = header.get("result") or {}
        items = result.get("results")
        if not isinstance(items, list) or len(items) != len(steps):
            raise StageUnavailable("the next stage sent a malformed forward_frame reply")
        parts: dict[str, np.ndarray] = {}
        if "frame" in result:
            parts = {
                k: np.array(v)
                for k, v in frames.parse(result["frame"], reply_buffers).arrays().items()
            }
        out: list[TailResult] = []
        row = 0
        for item in items:
            n = int(item.get("rows", 0))
            mine = {k: v[row : row + n] for k, v in parts.items()}
            row += n
            out.append(
                TailResult(
                    token=item.get("token"),
                    logprobs=item.get("logprobs"),
                    error=item.get("error"),
                    parts=mine,
                )
            )
        return out

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

    def info(self) -> dict[str, Any]:
        header, _ = self._call("info", None, None, [], timeout_ms=5_000)
        value = header.get("result")
        return value if isinstance(value, dict) else {}

    # -- one request ------------------------------------------------------------------

    def _call(
        self,
        op: str,
        session: str | None,
        args: dict[str, Any] | None,
        buffers: list[Any],
        timeout_ms: int | None = None,
    ) -> tuple[dict[str, Any], list[memoryview]]:
        self._drain_monitor()
        if not self.connected:
            # not yet connected, or the connection dropped: fail at once
            # rather than queue work a dead stage would never answer
            raise StageUnavailable(f"the next stage ({self.endpoint}) is not connected")
        req_id = next(self._ids)
        header = request(req_id, op, session, args)
        try:
            self._sock.send_multipart([codec.encode(header), *buffers], zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise StageUnavailable(f"the next stage ({self.endpoint}) is not connected") from None
        deadline = time.monotonic() + (timeout_ms or self.timeout_ms) / 1000
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StageUnavailable(f"the next stage ({self.endpoint}) did not answer {op}")
            ready = dict(poller.poll(int(left * 1000) + 1))
            if self._monitor in ready and self._drain_monitor():
                raise StageUnavailable(f"the next stage ({self.endpoint}) went away during {op}")
            if self._sock not in ready:
                continue
            msg = self._sock.recv_multipart(copy=False)
            reply = codec.decode(msg[0].buffer, max_bytes=1 << 30)
            if not isinstance(reply, dict) or reply.get("id") != req_id:
                continue  # a late reply to a request that already gave up
            if not reply.get("ok"):
                err = reply.get("error") or {}
                cls = from_code(str(err.get("code", "internal")))
                message = f"next stage: {err.get('message', '')}"
                raise (cls if issubclass(cls, Fault) else BadRequest)(message)
            return reply, [f.buffer for f in msg[1:]]

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
