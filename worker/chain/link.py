"""The wire to the next pipeline stage: a ``runtime.Tail`` over ZeroMQ.

One DEALER per stage, connected to the next stage's ROUTER. A forward is a
``forward_frame`` request carrying the hidden rows as a frame (``hidden``,
token axis 0, positions) and the steps' metadata; its reply carries what the
last stage sampled and any asked outputs. Everything is asynchronous: the
stage sends a forward and goes on with its next turn (the scheduler bounds
how many are in flight), collecting replies as they come; ``trim``,
``drop``, ``signal``, ``export_state``, ``import_state`` and ``info`` go the
same way, each reply read into an ``Answer`` when it lands (``poll``), so
a stopped or slow stage below never holds this stage's loop; so does the
head's set-up of its direct return from the last stage (``direct.py``).

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
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq
from structlog import get_logger

from faults import BadRequest, Fault, SessionNotActive, StageUnavailable
from protocol import frames, sockets, transport
from protocol.peer import DealerPeer, NotSent, OnReply
from protocol.transport import fault_of

from ..runtime import Origin, wire
from ..runtime.tail import Answer, Landed, TailResult, TailStep
from .direct import DirectReturn

_log = get_logger("skiff.stage")
_SESSION_OP_MS = 5_000  # trim / drop / signal / info downstream: no forward, within a turn
_STATE_MS = 60_000  # export / import of a session's KV downstream (megabytes)
# How a request's answer is read from its reply: result map, buffers -> Answer.
Read = Callable[[dict[str, Any], list[memoryview]], Answer]


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
        self._landed: dict[int, Landed | Answer] = {}  # home, not yet polled
        # The head stage of a chain of 3+ stages gets its sampled tokens from
        # the last stage directly, not relayed by the stages in between; set
        # up from the first forward on (``_direct_socket``), never waiting.
        self.head = head
        self.direct = DirectReturn(self._ctx, curve) if head else None
        self._setup: int | None = None  # the ``info`` asked for the set-up

    @property
    def connected(self) -> bool:
        return self.peer.connected

    @property
    def direct_endpoint(self) -> str | None:
        """The last stage, once the direct return is up."""
        return self.direct.endpoint if self.direct is not None else None

    def close(self) -> None:
        if self.direct is not None:
            self.direct.close()
        self.peer.close()

    # -- the Tail protocol ---------------------------------------------------------

    def send(self, steps: list[TailStep], hidden: np.ndarray) -> int:
        sock = self._direct_socket()
        req_id = self.peer.next_id()
        direct = sock.getsockopt(zmq.ROUTING_ID) if sock is not None else None
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
        return self._send(
            "forward_frame",
            None,
            args,
            buffers,
            self.timeout_ms,
            functools.partial(self._forwarded, req_id, len(steps)),
            functools.partial(self._put, req_id),
            req_id,
        )

    def poll(self, timeout_ms: int) -> dict[int, Landed | Answer]:
        if not self._landed:
            self.peer.pump(timeout_ms)
        landed, self._landed = self._landed, {}
        return landed

    @property
    def in_flight(self) -> int:
        return sum(1 for p in self.peer.pending.values() if p.op == "forward_frame")

    def session_op(self, op: str, session: str, token_count: int = 0) -> int:
        args = {"token_count": token_count} if op == "trim" else None
        try:
            return self._ask(op, session, args, [], _SESSION_OP_MS, _nothing)
        except StageUnavailable as exc:
            if op != "drop":
                raise
            ticket = self.peer.next_id()  # a drop is not refused: it lands at once
            self._landed[ticket] = self._excuse(op, session, exc)
            return ticket

    def session_query(self, op: str, session: str, window_tokens: int = 0) -> int:
        args = {"window_tokens": window_tokens} if op == "signal_window" else None
        return self._ask(op, session, args, [], _SESSION_OP_MS, _result)

    def export_state(self, session: str) -> int:
        return self._ask("export_state", session, None, [], _STATE_MS, _states)

    def import_state(self, session: str, metas: list[dict[str, Any]], kvs: list[np.ndarray]) -> int:
        if not metas or len(metas) != len(kvs):
            raise BadRequest("one session state per stage below is needed")
        meta = {**metas[0], "downstream": metas[1:]} if len(metas) > 1 else dict(metas[0])
        names = ["kv_state", *(f"kv_state.{i}" for i in range(1, len(kvs)))]
        frame = frames.make_frame([(n, kv, -1) for n, kv in zip(names, kvs, strict=True)])
        buffers: list[Any] = []
        args = {"session_state": meta, "frame": frames.attach(frame, buffers)}
        return self._ask("import_state", session, args, buffers, _STATE_MS, _nothing)

    def info(self) -> int:
        return self._ask("info", None, None, [], _SESSION_OP_MS, _result)

    # -- requests and replies ----------------------------------------------------------

    def _ask(
        self,
        op: str,
        session: str | None,
        args: dict[str, Any] | None,
        buffers: list[Any],
        timeout_ms: int,
        read: Read,
    ) -> int:
        """Send a request other than a forward; its ``Answer`` (``read`` from
        the reply's result) or ``Fault`` lands for ``poll``."""
        req_id = self.peer.next_id()
        return self._send(
            op,
            session,
            args,
            buffers,
            timeout_ms,
            functools.partial(self._answered, req_id, op, session, read),
            lambda fault: self._put(req_id, self._excuse(op, session, fault)),
            req_id,
        )

    def _direct_socket(self) -> zmq.Socket[Any] | None:
        """The direct return's socket once it is up, else None (the forward
        is relayed); moves its set-up on without waiting: asks the next
        stage for the chain, then dials the last stage. A chain found not
        to be diallable fails this forward (and is asked again next time)."""
        d = self.direct
        if d is None or d.sock is not None or d.known:
            return d.sock if d is not None else None
        if d.dialing and d.ready():
            assert d.sock is not None
            self.peer.also(d.sock)
            return d.sock
        if d.refused is not None:
            refused, d.refused = d.refused, None
            raise refused
        if self._setup is None and not d.dialing:
            self._setup = self.info()
        return None

    def _send(
        self,
        op: str,
        session: str | None,
        args: dict[str, Any] | None,
        buffers: list[Any],
        timeout_ms: int,
        on_reply: OnReply,
        on_fail: Callable[[Fault], None],
        req_id: int,
    ) -> int:
        self.peer.watch()
        if not self.peer.connected:
            # not yet connected, or the connection dropped: fail at once
            # rather than queue work a dead stage would never answer
            raise StageUnavailable(f"the next stage ({self.endpoint}) is not connected")
        try:
            self.peer.request(
                op,
                session,
                args,
                buffers,
                on_reply=on_reply,
                on_fail=on_fail,
                timeout_s=timeout_ms / 1000,
                req_id=req_id,
            )
        except NotSent as exc:
            why = f"cannot take it: {exc.reason}"
            if exc.reason == transport.NOT_RECEIVING:  # IMMEDIATE: no finished connection
                why = "is not connected"
            raise StageUnavailable(f"the next stage ({self.endpoint}) {why}") from None
        return req_id

    def _put(self, req_id: int, outcome: Landed | Answer) -> None:
        if req_id == self._setup and self.direct is not None:
            self._setup = None  # the chain, for the direct return (not polled)
            if isinstance(outcome, Answer):
                self.direct.learn(outcome.result.get("chain"))
            elif isinstance(outcome, Fault):
                self.direct.refused = outcome
            return
        self._landed[req_id] = outcome

    def _excuse(self, op: str, session: str | None, fault: Fault) -> Fault | Answer:
        """How a failed trim / drop downstream counts: a session the next stage
        does not hold never reached it (or was dropped there), and a drop the
        chain cannot take is logged, not refused (this stage has let the
        session go); anything else fails the request."""
        if op in ("trim", "drop") and isinstance(fault, SessionNotActive):
            return Answer()
        if op == "drop" and isinstance(fault, StageUnavailable):
            _log.warning("stage_drop_lost", session=session, error=fault.message)
            return Answer()
        return fault

    def _answered(
        self,
        req_id: int,
        op: str,
        session: str | None,
        read: Read,
        reply: dict[str, Any],
        msg: list[zmq.Frame],
    ) -> bool:
        outcome: Fault | Answer
        if not reply.get("ok"):
            outcome = self._excuse(op, session, fault_of(reply, "next stage: "))
        else:
            result = reply.get("result")
            try:
                outcome = read(result if isinstance(result, dict) else {}, [f.buffer for f in msg])
            except (Fault, ValueError, KeyError, TypeError) as exc:
                outcome = StageUnavailable(f"the next stage sent a malformed {op} reply: {exc}")
        self._put(req_id, outcome)
        return False

    def _forwarded(
        self, req_id: int, steps: int, reply: dict[str, Any], msg: list[zmq.Frame]
    ) -> bool:
        """A forward's reply: its outcome lands, unless it acknowledges a
        forward whose result comes on the direct socket (True: keep waiting)."""
        outcome = self._outcome(reply, [f.buffer for f in msg], steps)
        if outcome is None:
            return True
        self._put(req_id, outcome)
        return False

    def _outcome(
        self, reply: dict[str, Any], buffers: list[memoryview], steps: int
    ) -> Landed | None:
        if not reply.get("ok"):
            return fault_of(reply, "next stage: ")
        items = (reply.get("result") or {}).get("results")
        if self.direct is not None and self.direct.sock is not None and wire.is_direct(items):
            return None  # the stages below took it; the last stage answers us directly
        try:
            return _results(reply, buffers, steps)
        except (Fault, ValueError, KeyError, TypeError) as exc:
            return StageUnavailable(f"the next stage sent a malformed forward_frame reply: {exc}")


def _nothing(result: dict[str, Any], buffers: list[memoryview]) -> Answer:
    return Answer()


def _result(result: dict[str, Any], buffers: list[memoryview]) -> Answer:
    return Answer(result)


def _states(result: dict[str, Any], buffers: list[memoryview]) -> Answer:
    """``export_state``'s reply: the next stage's state first, then those below it."""
    meta = result.get("session_state")
    if not isinstance(meta, dict) or "frame" not in result:
        raise ValueError("no session_state and frame")
    arrays = frames.parse(result["frame"], buffers).arrays()
    below = list(meta.pop("downstream", None) or [])
    kvs = [np.array(arrays["kv_state"])]
    kvs += [np.array(arrays[f"kv_state.{i + 1}"]) for i in range(len(below))]
    return Answer(states=[meta, *below], kvs=kvs)


def _results(reply: dict[str, Any], buffers: list[memoryview], steps: int) -> list[TailResult]:
    """A ``forward_frame`` reply's per-step results, rows cut from its frame."""
    result = reply.get("result") or {}
    arrays: dict[str, np.ndarray] = {}
    if "frame" in result:
        arrays = {
            k: np.array(v) for k, v in frames.parse(result["frame"], buffers).arrays().items()
        }
    return wire.results_in(result, arrays, steps)
