"""Lane and session bookkeeping (pure Python, no engine).

A lane is a llama.cpp sequence id. A session is admitted to a free lane on
first use and keeps it until dropped. ``admit`` is all-or-nothing: when a
request names several new sessions and there are not enough free lanes,
nothing is admitted.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from faults import LanesBusy, SessionNotActive

SIGNAL_HISTORY = 4096


@dataclass(frozen=True)
class Ephemeral:
    """The id of a session a sessionless ``generate`` runs in.

    Peers name sessions with strings; an ephemeral id is not a string, so no
    peer can name (join, trim or drop) another client's internal session.
    """

    n: int

    def __str__(self) -> str:
        return f"~gen-{self.n}"


SessionId = str | Ephemeral


@dataclass
class Session:
    id: SessionId
    lane: int
    position: int = 0
    tokens: list[int] = field(default_factory=list)
    ephemeral: bool = False
    sampler: Any = None  # engine Sampler, owned by the runtime
    last_used: float = field(default_factory=time.monotonic)
    last_token: int | None = None
    pending: list[int] = field(default_factory=list)  # shown by generate, not yet fed
    # Named sessions keep per-token signals (runtime/signals.py) for `signal`.
    signals: deque[Any] = field(default_factory=lambda: deque(maxlen=SIGNAL_HISTORY))
    last_logprobs: dict[str, Any] | None = None


class LanePool:
    def __init__(self, n_lanes: int) -> None:
        self.n_lanes = n_lanes
        self._free: list[int] = list(range(n_lanes))
        self.sessions: dict[SessionId, Session] = {}

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def active(self) -> int:
        return len(self.sessions)

    def get(self, session_id: SessionId) -> Session | None:
        return self.sessions.get(session_id)

    def require(self, session_id: SessionId) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionNotActive(f"session {str(session_id)!r} is not active")
        return session

    def missing(self, session_ids: Iterable[SessionId]) -> list[SessionId]:
        """Sessions among ``session_ids`` that would need a new lane."""
        seen: set[SessionId] = set()
        out = []
        for sid in session_ids:
            if sid not in self.sessions and sid not in seen:
                seen.add(sid)
                out.append(sid)
        return out

    def admit(self, session_ids: Iterable[SessionId], ephemeral: bool = False) -> list[Session]:
        """Admit every new session or none; return all named sessions in order."""
        ids = list(session_ids)
        new = self.missing(ids)
        if len(new) > len(self._free):
            raise LanesBusy(
                f"request requires {len(new)} new sessions but only "
                f"{len(self._free)} execution lanes are available"
            )
        for sid in new:
            self._free.sort()
            lane = self._free.pop(0)
            self.sessions[sid] = Session(sid, lane, ephemeral=ephemeral)
        return [self.sessions[sid] for sid in ids]

    def release(self, session_id: SessionId) -> Session:
        session = self.require(session_id)
        del self.sessions[session_id]
        self._free.append(session.lane)
        return session
