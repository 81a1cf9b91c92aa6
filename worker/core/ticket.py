"""A request as the core sees it, and the typed outputs it produces.

The core (scheduler, jobs, generation) never sends anything. A job writes
typed outputs — a ``Result``, stream ``Event``s, a ``Failure`` — into the
shared ``Outbox`` through its ``Ticket``; after each scheduler turn the edge
takes them out, renders headers and tensor frames, and sends them. So no
call made during a turn ever reaches a socket, and a peer found dead while
sending is handled after the turn (its work is cancelled before the next).

``Ticket.owner`` is opaque to the core: it only groups the requests of one
peer (for ``cancel`` and for a peer that went away).
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Tensors:
    """Tensors one output carries; the edge sends them as one frame.

    ``parts`` maps an identity ("hidden", "logits", "kv_state", ...) to an
    array; ``axes`` gives a part's token axis (default 0; -1: none).
    ``positions`` are the tokens' positions; ``token_count`` defaults to the
    token-axis length of the parts.
    """

    parts: dict[str, np.ndarray]
    positions: list[int] | None = None
    sequence_count: int = 1
    layer_start: int = 0
    layer_end: int = 0
    axes: dict[str, int] = field(default_factory=dict)
    token_count: int | None = None
    producer_stage: int = 0


@dataclass(frozen=True)
class Result:
    """The one reply of a request. ``done`` marks the reply of a streamable op
    run with ``stream: false``. ``tensors`` travel as one frame."""

    data: dict[str, Any]
    tensors: Tensors | None = None
    done: bool = False


@dataclass(frozen=True)
class Event:
    """One message of a stream; ``data["event"]`` names it, the last has ``done``."""

    data: dict[str, Any]
    tensors: Tensors | None = None

    @property
    def done(self) -> bool:
        return bool(self.data.get("done"))


@dataclass(frozen=True)
class Failure:
    """The request ended with this error (its class carries the wire code)."""

    error: BaseException


Output = Result | Event | Failure


class Outbox:
    """Outputs written during a turn, in order, until the edge takes them."""

    def __init__(self) -> None:
        self._items: list[tuple[Ticket, Output]] = []

    def put(self, ticket: Ticket, output: Output) -> None:
        self._items.append((ticket, output))

    def take(self) -> list[tuple[Ticket, Output]]:
        items, self._items = self._items, []
        return items

    def __len__(self) -> int:
        return len(self._items)


@dataclass(eq=False)
class Ticket:
    """Who asked (``owner``, ``id``), for what, by when, and where answers go."""

    owner: Hashable
    id: int
    op: str
    outbox: Outbox
    session: str | None = None  # for logs only
    deadline: float | None = None  # monotonic seconds
    received: float = field(default_factory=time.monotonic)
    finished: bool = False

    def _put(self, output: Output) -> None:
        self.outbox.put(self, output)

    def reply(self, data: dict[str, Any], tensors: Tensors | None = None) -> None:
        self.finished = True
        self._put(Result(data, tensors))

    def reply_done(self, data: dict[str, Any], tensors: Tensors | None = None) -> None:
        """The single reply of a streamable op run with ``stream: false``."""
        self.finished = True
        self._put(Result(data, tensors, done=True))

    def event(self, data: dict[str, Any], tensors: Tensors | None = None) -> None:
        output = Event(data, tensors)
        if output.done:
            self.finished = True
        self._put(output)

    def fail(self, exc: BaseException) -> None:
        self.finished = True
        self._put(Failure(exc))

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline
