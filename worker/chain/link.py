"""The wire to the next pipeline stage: a ``runtime.Tail`` over ZeroMQ.

One DEALER per stage, connected to the next stage's ROUTER. A forward is a
``forward_frame`` request carrying the hidden rows as a frame (``hidden``,
token axis 0, positions) and the steps' metadata; its reply carries what the
last stage sampled and any asked outputs. Forwards are asynchronous: the
stage sends one and goes on with its next turn (the scheduler bounds how
many are in flight), collecting replies as they come; ``trim``/``drop``
and ``info`` wait for their answers, keeping any forward that lands
meanwhile.

The socket, request ids, deadlines and the watch on the connection are a
``protocol.peer.DealerPeer``; this module keeps the stage's policy. A dead
next stage is noticed at once rather than by timeout: the socket is
``ZMQ_IMMEDIATE`` (a send with no live connection fails instead of
queueing) and the peer's monitor reports the connection dropping while we
wait. Either ends every outstanding request with ``stage_unavailable``, as
does a request past its deadline; once the stage is back ZeroMQ reconnects
by itself and chain work resumes.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np
import zmq
from structlog import get_logger

from faults import BadRequest, Fault, SessionNotActive, StageUnavailable
from protocol import frames, sockets, transport
from protocol.envelope import fault_of, request
from protocol.peer import DealerPeer, NotSent

from ..runtime import Origin, wire
from ..runtime.tail import Landed, TailResult, TailStep

_log = get_logger("skiff.stage")
_SESSION_OP_MS = 5_000  # trim / drop downstream: no forward, answered within a turn
_STATE_MS = 60_000  # export / import of a session's KV downstream (megabytes)
Answer = tuple[dict[str, Any], list[memoryview]]  # a plain call's reply: header, buffers


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
        self.peer = DealerPeer(
            self._ctx,
            endpoint,
            sockets.SocketOptions(curve=curve, immediate=True),
            gone=lambda op: StageUnavailable(f"the next stage ({endpoint}) went away during {op}"),
            late=lambda op: StageUnavailable(f"the next stage ({endpoint}) did not answer {op}"),
        )
        self._landed: dict[int, Landed] = {}  # forwards home, not yet polled
        self._answers: dict[int, Answer] = {}  # plain calls home, not yet taken

    @property
    def connected(self) -> bool:
        return self.peer.connected

    def close(self) -> None:
        if self._direct is not None:
            self._direct.close(linger=0)
        self.peer.close()

    # -- the Tail protocol ---------------------------------------------------------

    def send(self, steps: list[TailStep], hidden: np.ndarray) -> int:
        if not self._direct_known:
            self._setup_direct()
        req_id = self.peer.next_id()
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
            self.peer.pump(timeout_ms)
        landed, self._landed = self._landed, {}
        return landed

    @property
    def in_flight(self) -> int:
        return sum(1 for p in self.peer.pending.values() if p.op == "forward_frame")

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
    ) -> Answer:
        req_id = self._send(op, session, args, buffers, timeout_ms, None)
        while req_id not in self._answers:
            self.peer.pump(timeout_ms)
        answer = self._answers.pop(req_id)
        if isinstance(answer, Fault):
            raise answer
        return answer

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
        self.peer.watch()
        if not self.peer.connected:
            # not yet connected, or the connection dropped: fail at once
            # rather than queue work a dead stage would never answer
            raise StageUnavailable(f"the next stage ({self.endpoint}) is not connected")
        req_id = self.peer.next_id() if req_id is None else req_id
        try:
            self.peer.request(
                op,
                session,
                args,
                buffers,
                on_reply=functools.partial(self._home, req_id, steps),
                on_fail=functools.partial(self._land, req_id, steps),
                timeout_s=timeout_ms / 1000,
                req_id=req_id,
            )
        except NotSent as exc:
            why = f"cannot take it: {exc.reason}"
            if exc.reason == transport.NOT_RECEIVING:  # IMMEDIATE: no finished connection
                why = "is not connected"
            raise StageUnavailable(f"the next stage ({self.endpoint}) {why}") from None
        return req_id

    def _home(
        self, req_id: int, steps: int | None, reply: dict[str, Any], msg: list[zmq.Frame]
    ) -> bool:
        """A reply: its outcome lands, unless it acknowledges a forward whose
        result comes on the direct socket (True: keep waiting)."""
        outcome = self._outcome(reply, [f.buffer for f in msg], steps)
        if outcome is _ACK:
            return True
        self._land(req_id, steps, outcome)
        return False

    def _land(self, req_id: int, steps: int | None, outcome: Any) -> None:
        if steps is None:
            self._answers[req_id] = outcome
        else:
            self._landed[req_id] = outcome

    def _outcome(
        self, reply: dict[str, Any], buffers: list[memoryview], steps: int | None
    ) -> Fault | Answer | list[TailResult] | object:
        if not reply.get("ok"):
            return fault_of(reply, "next stage: ")
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
        sock.send(transport.encode(request(0, "ping", None, None)))
        if not sock.poll(_SESSION_OP_MS):
            sock.close(linger=0)
            self._direct_known = False
            raise StageUnavailable(f"the chain's last stage ({endpoint}) did not answer")
        sock.recv_multipart()
        self._direct = sock
        self.direct_endpoint = endpoint
        self.peer.also(sock)
        _log.info("stage_direct_return", last_stage=endpoint)


_ACK = object()  # a forward's acknowledgement: its result comes on the direct socket


def _results(reply: dict[str, Any], buffers: list[memoryview], steps: int) -> list[TailResult]:
    """A ``forward_frame`` reply's per-step results, rows cut from its frame."""
    result = reply.get("result") or {}
    arrays: dict[str, np.ndarray] = {}
    if "frame" in result:
        arrays = {
            k: np.array(v) for k, v in frames.parse(result["frame"], buffers).arrays().items()
        }
    return wire.results_in(result, arrays, steps)
