"""What a process plugs into the edge: the ``Service`` protocol and the
typed request / outgoing message it speaks.

``edge/server.py`` owns the socket and the loop; a service (the LLM worker,
the speech worker, the gateway) owns everything else. Kept apart so a
service's author reads the contract without the loop's mechanics.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


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
