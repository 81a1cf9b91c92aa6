"""What a process plugs into the edge: the ``Service`` protocol and the
typed request / outgoing message it speaks, and ``failure_header``, the
error reply any failure becomes (the loop's own and a service's).

``edge/server.py`` owns the socket and the loop; a service (the LLM worker,
the speech worker, the gateway) owns everything else. Kept apart so a
service's author reads the contract without the loop's mechanics.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from faults import ErrorCode, Fault, code_of
from protocol.transport import error_reply

from . import logs

_log = logs.get_logger("skiff.edge")


@dataclass
class Request:
    """One request after the envelope checks: every field has its promised type."""

    peer: bytes
    id: int
    op: str
    session: str | None
    args: dict[str, Any]
    buffers: list[memoryview]
    received: float
    deadline: float | None  # monotonic seconds


@dataclass
class Outgoing:
    """One message to send: ``[peer, header, *buffers]``."""

    peer: bytes
    header: dict[str, Any]
    buffers: Sequence[Any] = ()


def failure_header(req_id: int | None, exc: BaseException, op: str | None = None) -> dict[str, Any]:
    """The error reply for ``exc``: its class's code, ``internal`` for anything else."""
    code = code_of(exc)
    if not isinstance(exc, Fault):
        _log.error("unexpected_error", op=op, error=f"{type(exc).__name__}: {exc}", exc_info=exc)
    message = (exc.message if isinstance(exc, Fault) else str(exc)) or type(exc).__name__
    if code is not ErrorCode.CANCELLED:
        _log.info("request_failed", code=str(code), message=message[:500])
    retry = exc.retry_after_ms if isinstance(exc, Fault) else None
    return error_reply(req_id, code, message, retry)


# A handler answers at once (a result map) or takes the request on (None).
Handler = Callable[[Request], dict[str, Any] | None]


class Service(Protocol):
    """What a process plugs into the edge."""

    @property
    def handlers(self) -> Mapping[str, Handler]: ...

    def has_work(self) -> bool:
        """True when ``turn`` has something to do (the loop then does not sleep)."""
        ...

    def turn(self) -> list[Outgoing]:
        """One bounded unit of work; the messages it produced."""
        ...

    def peer_lost(self, peer: bytes, reason: str) -> int:
        """Stop all work for ``peer``; returns how many requests were cancelled."""
        ...

    def housekeeping(self, now: float) -> None:
        """Called about once a second (idle sessions, ...)."""
        ...

    @property
    def drain_ops(self) -> frozenset[str]:
        """Ops still served while draining besides ``ping``, ``info``, ``stats``
        and ``cancel``: those that finish or move accepted work, never new work."""
        ...

    def begin_drain(self) -> None:
        """The process is draining (SIGTERM): say so in ``stats``; new work is refused."""
        ...

    def idle(self) -> bool:
        """True when no accepted request waits for its final reply."""
        ...

    def cancel_all(self, reason: str) -> int:
        """End every accepted request with its final event or error (sent by
        later turns); returns how many were cancelled."""
        ...
