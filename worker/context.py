"""Per-request context: who asked, how to answer, and error mapping.

Jobs and handlers answer through ``RequestCtx`` and never see the socket.
``fail(exc)`` is the one place a typed runtime error becomes a wire code.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from protocol import envelope
from protocol.envelope import ErrorCode

from . import logs
from .runtime import errors as rt

# Sends [header, *buffers] to a peer; returns False when the peer is gone or
# not receiving (the caller then cancels that peer's work).
SendFn = Callable[[bytes, dict[str, Any], Sequence[Any]], bool]

_CODES: list[tuple[type[Exception], ErrorCode]] = [
    (rt.InvalidArgument, ErrorCode.BAD_REQUEST),
    (rt.LanesBusy, ErrorCode.LANES_BUSY),
    (rt.QueueFull, ErrorCode.QUEUE_FULL),
    (rt.SessionNotActive, ErrorCode.SESSION_NOT_ACTIVE),
    (rt.ContextOverflow, ErrorCode.CONTEXT_OVERFLOW),
    (rt.Cancelled, ErrorCode.CANCELLED),
    (rt.DeadlineExceeded, ErrorCode.DEADLINE_EXCEEDED),
    (rt.Unsupported, ErrorCode.UNSUPPORTED),
    (rt.InternalFault, ErrorCode.INTERNAL),
]


def code_for(exc: BaseException) -> ErrorCode:
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return ErrorCode.INTERNAL


_log = logs.get_logger("skiff.request")


@dataclass
class RequestCtx:
    peer: bytes
    id: int | None
    op: str
    session: str | None
    send: SendFn
    deadline: float | None = None  # monotonic seconds
    received: float = field(default_factory=time.monotonic)
    finished: bool = False
    dead: bool = False  # the peer stopped receiving

    def _emit(self, header: dict[str, Any], buffers: Sequence[Any] = ()) -> None:
        if self.dead:
            return
        if not self.send(self.peer, header, buffers):
            self.dead = True

    def reply(self, result: dict[str, Any], buffers: Sequence[Any] = ()) -> None:
        self.finished = True
        self._emit(envelope.ok_reply(self.id, result), buffers)

    def reply_done(self, result: dict[str, Any]) -> None:
        """The single reply of a non-streaming streamable op (``done: true``)."""
        self.finished = True
        self._emit({**envelope.ok_reply(self.id, result), "done": True})

    def event(self, event: dict[str, Any], buffers: Sequence[Any] = ()) -> None:
        if event.get("done"):
            self.finished = True
        self._emit(envelope.event_reply(self.id if self.id is not None else -1, event), buffers)

    def error(self, code: str, message: str, retry_after_ms: int | None = None) -> None:
        self.finished = True
        _log.info(
            "request_failed",
            request_id=self.id,
            op=self.op,
            session=self.session,
            code=str(code),
            message=message,
        )
        self._emit(envelope.error_reply(self.id, code, message, retry_after_ms))

    def fail(self, exc: BaseException) -> None:
        """Answer with the wire code of a typed error (``internal`` otherwise)."""
        code = code_for(exc)
        if code is ErrorCode.INTERNAL and not isinstance(exc, rt.InternalFault):
            _log.error(
                "unexpected_error",
                request_id=self.id,
                op=self.op,
                session=self.session,
                exc_info=exc,
            )
        retry = exc.retry_after_ms if isinstance(exc, rt.QueueFull) else None
        self.error(code, str(exc) or type(exc).__name__, retry)

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline
