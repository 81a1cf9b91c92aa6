"""The affinity table: which worker holds each named session.

A named session's KV cells live in exactly one worker, so every request
naming it must go there. The table is filled three ways:

- routing: the first request of an unknown session places it (unconfirmed);
- replies: the first ``ok`` reply for a session confirms it; an unconfirmed
  placement whose first request failed (``lanes_busy``, ``session_not_active``
  ...) is forgotten, so the next try is placed afresh;
- workers' ``stats``: every non-ephemeral session a worker lists is added
  (this is how a restarted gateway learns where sessions live) unless the
  gateway removed it after that ``stats`` was asked (a ``drop`` overtaking
  the answer must not bring the session back), and entries
  the worker no longer lists (expired, dropped by someone else) are removed
  when they are older than the ``stats`` request and nothing is in flight
  for them.

A worker that goes down loses its entries (its KV is gone with it, or at
best unknown until it answers ``stats`` again). Its confirmed sessions are
remembered as *lost*: a later request naming one is refused
(``worker_unavailable``) rather than silently starting an empty session of
that name elsewhere, until the client drops it or the worker comes back
listing it.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

REMOVALS_KEPT_S = 60.0  # removals remembered, against stats answers older than them
MAX_LOST = 65_536  # lost sessions remembered (oldest forgotten first)


@dataclass(slots=True)
class Placement:
    worker: str
    confirmed: bool
    since: float  # monotonic time it was made


class AffinityTable:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._by_session: dict[str, Placement] = {}
        self._by_worker: dict[str, set[str]] = {}
        self._removed: dict[str, float] = {}  # session -> when it was last removed
        self._lost: OrderedDict[str, str] = OrderedDict()  # session -> the worker that died
        self._clock = clock

    def __len__(self) -> int:
        return len(self._by_session)

    def get(self, session: str) -> Placement | None:
        return self._by_session.get(session)

    def worker_of(self, session: str) -> str | None:
        placed = self._by_session.get(session)
        return placed.worker if placed is not None else None

    def assign(self, session: str, worker: str, now: float, confirmed: bool = False) -> None:
        self.remove(session)
        self._lost.pop(session, None)
        self._by_session[session] = Placement(worker, confirmed, now)
        self._by_worker.setdefault(worker, set()).add(session)

    def confirm(self, session: str) -> None:
        placed = self._by_session.get(session)
        if placed is not None:
            placed.confirmed = True

    def remove(self, session: str) -> str | None:
        placed = self._by_session.pop(session, None)
        if placed is None:
            return None
        self._removed.pop(session, None)  # keeps the dict in time order
        self._removed[session] = self._clock()
        held = self._by_worker.get(placed.worker)
        if held is not None:
            held.discard(session)
        return placed.worker

    def drop_started(self, session: str) -> None:
        """A client's ``drop`` was sent: forget the session now (the name is
        free for a new placement), and let no ``stats`` bring it back until
        the drop has run: a worker answers ``stats`` at once but runs a
        ``drop`` in its next turn, so a ``stats`` sent after the drop may
        still list the session."""
        self.remove(session)
        self._removed.pop(session, None)
        self._removed[session] = math.inf

    def drop_finished(self, session: str) -> None:
        """The drop's reply came: only ``stats`` asked before now can list it."""
        if session in self._removed:
            self._removed.pop(session)
            self._removed[session] = self._clock()

    def sessions_of(self, worker: str) -> list[str]:
        return sorted(self._by_worker.get(worker, ()))

    def drop_worker(self, worker: str) -> list[str]:
        """Forget every session placed on ``worker``; returns them."""
        gone = sorted(self._by_worker.pop(worker, ()))
        now = self._clock()
        for session in gone:
            placed = self._by_session.pop(session, None)
            self._removed.pop(session, None)
            self._removed[session] = now
            if placed is not None and placed.confirmed:
                self._lost[session] = worker
        while len(self._lost) > MAX_LOST:
            self._lost.popitem(last=False)
        return gone

    def lost_on(self, session: str) -> str | None:
        """The worker ``session`` was lost with, if it was."""
        return self._lost.get(session)

    def forget_lost(self, session: str) -> bool:
        return self._lost.pop(session, None) is not None

    def rebuild(
        self,
        worker: str,
        listed: Iterable[str],
        asked_at: float,
        busy: Callable[[str], bool],
    ) -> tuple[list[str], list[str]]:
        """Reconcile with a worker's ``stats`` sessions (asked at ``asked_at``).

        Adds listed sessions the table does not know and did not remove since
        the ask (an existing placement elsewhere wins: it was made by a later
        request). Removes this worker's entries made before the ask that it
        no longer lists, unless ``busy``. Returns (added, removed)."""
        names = set(listed)
        added: list[str] = []
        removed_at = self._removed
        for session in sorted(names):
            if session not in self._by_session and removed_at.get(session, -1.0) < asked_at:
                self.assign(session, worker, asked_at, confirmed=True)
                added.append(session)
        removed: list[str] = []
        for session in sorted(self._by_worker.get(worker, ())):
            placed = self._by_session[session]
            if session not in names and placed.since < asked_at and not busy(session):
                self.remove(session)
                removed.append(session)
        horizon = asked_at - REMOVALS_KEPT_S
        if removed_at and next(iter(removed_at.values())) < horizon:
            self._removed = {s: t for s, t in removed_at.items() if t >= horizon}
        return added, removed

    def snapshot(self) -> dict[str, str]:
        return {s: p.worker for s, p in self._by_session.items()}
