"""The one error hierarchy of skiff: every failure a peer can see, with its code.

This package sits below everything else and imports nothing, so the wire
side (``protocol``, ``edge``, clients, the gateway) and the core (scheduler,
jobs, runtime, engine) can share it without the core learning anything about
the wire. A class carries its stable wire code; ``code_of`` is the one place
an exception becomes a code, and ``from_code`` turns a code back into the
class, so a client can ``except LanesBusy`` as well as branch on strings.
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar


class ErrorCode(StrEnum):
    """Stable error codes. Clients branch on these strings; never rename one."""

    BAD_REQUEST = "bad_request"
    UNKNOWN_OP = "unknown_op"
    UNSUPPORTED_VERSION = "unsupported_version"
    LANES_BUSY = "lanes_busy"
    QUEUE_FULL = "queue_full"
    SESSION_NOT_ACTIVE = "session_not_active"
    CONTEXT_OVERFLOW = "context_overflow"
    CANCELLED = "cancelled"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    LIMIT_EXCEEDED = "limit_exceeded"
    UNSUPPORTED = "unsupported"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    STAGE_UNAVAILABLE = "stage_unavailable"
    WORKER_UNAVAILABLE = "worker_unavailable"
    SHUTTING_DOWN = "shutting_down"
    INTERNAL = "internal"


class Fault(Exception):
    """A request-level failure with a human message and a stable code."""

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL

    def __init__(self, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_ms = retry_after_ms


class BadRequest(Fault):
    """The request does not follow the protocol, or asks for something impossible."""

    code = ErrorCode.BAD_REQUEST


class UnknownOp(Fault):
    code = ErrorCode.UNKNOWN_OP


class UnsupportedVersion(Fault):
    code = ErrorCode.UNSUPPORTED_VERSION


class PayloadTooLarge(Fault):
    code = ErrorCode.PAYLOAD_TOO_LARGE


class LanesBusy(Fault):
    """No free lane for a session that needs one; nothing was admitted."""

    code = ErrorCode.LANES_BUSY


class QueueFull(Fault):
    """The wait queue is full; ``retry_after_ms`` estimates when to try again."""

    code = ErrorCode.QUEUE_FULL


class SessionNotActive(Fault):
    """The op needs an admitted session and this one is not."""

    code = ErrorCode.SESSION_NOT_ACTIVE


class ContextOverflow(Fault):
    """The tokens would not fit in the session's share of the KV cache; nothing ran."""

    code = ErrorCode.CONTEXT_OVERFLOW


class Cancelled(Fault):
    code = ErrorCode.CANCELLED


class DeadlineExceeded(Fault):
    code = ErrorCode.DEADLINE_EXCEEDED


class LimitExceeded(Fault):
    """A configured limit was exceeded: a size the request chose (tokens,
    ``max_tokens``, stop strings, grammar, frame parts, ...), a count its peer
    grew (sessions or streams held), or a per-request limit reached while
    running (speech ``max_seconds``). The message names the field, the limit
    and, for a worker setting, its flag; malformed input stays ``BadRequest``."""

    code = ErrorCode.LIMIT_EXCEEDED


class Unsupported(Fault):
    """A valid request for something this worker is not set up to do."""

    code = ErrorCode.UNSUPPORTED


class StageUnavailable(Fault):
    """The next pipeline stage is down or not answering; chain work cannot run."""

    code = ErrorCode.STAGE_UNAVAILABLE


class WorkerUnavailable(Fault):
    """The gateway has no live worker for this request, or the one holding it died."""

    code = ErrorCode.WORKER_UNAVAILABLE


class ShuttingDown(Fault):
    """The process is draining before it exits: it takes no new work. Nothing
    ran; ``retry_after_ms`` says when to try again (elsewhere, or here once
    restarted)."""

    code = ErrorCode.SHUTTING_DOWN


class Internal(Fault):
    """An invariant broke (a bug) or the engine failed; the session may be reset."""

    code = ErrorCode.INTERNAL


class PositionMismatch(Internal):
    """Tracked position and engine position disagree: surfaced, never patched."""


class EngineFault(Internal):
    """``llama_decode`` failed; ``advanced`` names sessions whose KV moved."""

    def __init__(self, message: str, advanced: dict[str, int]) -> None:
        super().__init__(message)
        self.advanced = advanced


_BY_CODE: dict[str, type[Fault]] = {
    cls.code.value: cls
    for cls in (
        BadRequest,
        UnknownOp,
        UnsupportedVersion,
        PayloadTooLarge,
        LanesBusy,
        QueueFull,
        SessionNotActive,
        ContextOverflow,
        Cancelled,
        DeadlineExceeded,
        LimitExceeded,
        Unsupported,
        StageUnavailable,
        WorkerUnavailable,
        ShuttingDown,
        Internal,
    )
}


def code_of(exc: BaseException) -> ErrorCode:
    """The wire code of any exception: its class's code, ``internal`` for the rest."""
    return exc.code if isinstance(exc, Fault) else ErrorCode.INTERNAL


def from_code(code: str) -> type[Fault]:
    """The class of a code received on the wire (``Fault`` for an unknown one)."""
    return _BY_CODE.get(code, Fault)


__all__ = [
    "BadRequest",
    "Cancelled",
    "ContextOverflow",
    "DeadlineExceeded",
    "EngineFault",
    "ErrorCode",
    "Fault",
    "Internal",
    "LanesBusy",
    "LimitExceeded",
    "PayloadTooLarge",
    "PositionMismatch",
    "QueueFull",
    "SessionNotActive",
    "ShuttingDown",
    "StageUnavailable",
    "UnknownOp",
    "Unsupported",
    "UnsupportedVersion",
    "WorkerUnavailable",
    "code_of",
    "from_code",
]
