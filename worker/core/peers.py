"""Per-peer limits: named sessions one peer holds, generations it has in flight.

Without them one client could take every lane (sessions) or fill the wait
queue with its generations while others get ``lanes_busy`` / ``queue_full``.
A gateway is ONE peer to a worker, so the defaults (``worker/limits.py``) are
generous; they matter when clients connect to a worker directly.

Counts are taken from live state when a job is submitted — the scheduler's
queued and running jobs, the runtime's lanes — so every way work or a session
ends (finish, cancel, drop, a lost peer, idle expiry) gives its count back
with no bookkeeping to forget. The one thing remembered is which peer's job
admitted each named session (``holders``): entries whose session has left the
lanes are pruned at every count, and a lost peer's are forgotten at once.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable

from ..limits import exceeded
from ..runtime import SessionId
from .jobs.base import Job

QUOTA_RETRY_MS = 1000  # a peer's count goes down as its work ends: worth a retry


class PeerLimits:
    """``max_sessions`` / ``max_streams`` per peer; 0 turns a limit off."""

    def __init__(self, max_sessions: int = 0, max_streams: int = 0) -> None:
        self.max_sessions = max_sessions
        self.max_streams = max_streams
        self.holders: dict[SessionId, Hashable] = {}  # named session -> peer that admitted it

    def check(self, job: Job, jobs: Iterable[Job], lanes: Collection[SessionId]) -> None:
        """Refuse ``job`` (``limit_exceeded``) when its peer is at a limit.

        ``jobs`` are the queued and running ones, ``lanes`` the admitted
        sessions. Cancelled jobs do not count: they end within a turn.
        """
        if not (self.max_sessions or self.max_streams):
            return
        owner = job.ticket.owner
        mine = [j for j in jobs if j.ticket.owner == owner and not j.cancelled]
        if self.max_streams and job.generation:
            streams = 1 + sum(1 for j in mine if j.generation)
            if streams > self.max_streams:
                what = f"generations: this peer would have {streams} queued or running"
                raise exceeded(what, self.max_streams, "max_streams_per_peer", QUOTA_RETRY_MS)
        new = _named_new(job.sessions, lanes)
        if self.max_sessions and new:
            held = self.held_by(owner, lanes)
            for other in mine:
                held.update(_named_new(other.sessions, lanes))  # queued, not yet admitted
            sessions = len(held | new)
            if sessions > self.max_sessions:
                what = f"sessions: this peer would hold {sessions}, admitted or queued"
                raise exceeded(what, self.max_sessions, "max_sessions_per_peer", QUOTA_RETRY_MS)

    def held_by(self, owner: Hashable, lanes: Collection[SessionId]) -> set[SessionId]:
        """Named sessions in the lanes that ``owner``'s jobs admitted (prunes the rest)."""
        self.holders = {s: o for s, o in self.holders.items() if s in lanes}
        return {s for s, o in self.holders.items() if o == owner}

    def admitted(self, job: Job, new: Iterable[SessionId], lanes: Collection[SessionId]) -> None:
        """``job`` started: those of ``new`` (missing before) now in the lanes are its peer's."""
        if self.max_sessions:
            for sid in new:
                if isinstance(sid, str) and sid in lanes:
                    self.holders[sid] = job.ticket.owner

    def forget(self, owner: Hashable) -> None:
        """A peer went away: its sessions (left to idle expiry) no longer count for it."""
        self.holders = {s: o for s, o in self.holders.items() if o != owner}


def _named_new(sessions: Iterable[SessionId], lanes: Collection[SessionId]) -> set[SessionId]:
    """Peer-named sessions among ``sessions`` that would take a lane."""
    return {s for s in sessions if isinstance(s, str) and s not in lanes}


__all__ = ["PeerLimits"]
