"""Handing a worker's sessions over when it is told to stop.

On SIGTERM the worker tells each peer that last named one of its sessions
that it is leaving: a message without an id (``leaving``, with the names),
which a plain client ignores. A peer that answers ``handoff`` (a gateway)
claims them: the drain then waits until they are gone (moved away or
dropped), until the claimer says it is done, or until the drain timeout. A
notice nobody claims within ``WAIT_S`` does not hold the worker. A gateway
also claims, unasked, from a worker whose ``stats`` say it is draining (one
holding only sessionless streams has no session to tell anyone about).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from edge import Outgoing
from protocol.transport import VERSION

# How long a draining worker holding named sessions waits for a peer told
# ``leaving`` to claim them: a gateway answers within one loop pass.
WAIT_S = 3.0


class Handoff:
    """Who named which session, the notices, and whether a claimer is at work."""

    def __init__(self, held: Callable[[], list[str]]) -> None:
        self._held = held  # the named sessions the worker holds (lanes and park)
        self._namers: dict[str, bytes] = {}
        self.notices: list[Outgoing] = []
        self._leaving_at: float | None = None
        self.claimed = False
        self._given_up = False

    def named(self, session: str, peer: bytes) -> None:
        """``peer`` sent a request naming ``session``."""
        self._namers[session] = peer

    def leaving(self) -> tuple[int, int]:
        """Write the notices (taken by the next turn); (peers, sessions) told."""
        by_peer: dict[bytes, list[str]] = {}
        for session in self._held():
            peer = self._namers.get(session)
            if peer is not None:
                by_peer.setdefault(peer, []).append(session)
        self.notices = [
            Outgoing(peer, {"v": VERSION, "event": "leaving", "sessions": sorted(names)})
            for peer, names in by_peer.items()
        ]
        if by_peer:
            self._leaving_at = time.monotonic()
        return len(by_peer), sum(map(len, by_peer.values()))

    def claim(self, done: bool) -> list[str]:
        """A peer takes the sessions (``done``: it took what it could)."""
        self.claimed = not done
        if done:
            self._leaving_at = None  # nothing more to wait for
        return self._held()

    def give_up(self) -> None:
        """The drain timed out: sessions not handed over stay behind."""
        self._given_up = True

    def waiting(self) -> bool:
        """Whether the drain must wait for a hand-over (claimed, or told
        and not yet past ``WAIT_S``) while named sessions remain. A claim
        counts without a notice: a gateway that saw this worker draining in
        its ``stats`` (it held only sessionless streams, so nobody was told)
        moves them under a name of the worker's, which it must wait for."""
        if self._given_up or not self._held():
            return False
        if self.claimed:
            return True
        return self._leaving_at is not None and time.monotonic() - self._leaving_at <= WAIT_S

    def forget_gone(self) -> None:
        """Keep the names of sessions still held (housekeeping)."""
        if len(self._namers) > 2 * len(self._held()) + 1024:
            held = set(self._held())
            self._namers = {s: p for s, p in self._namers.items() if s in held}
