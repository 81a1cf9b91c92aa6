"""Lane and session bookkeeping (pure Python, no engine).

A lane is a llama.cpp sequence id. A session is admitted to a free lane on
first use and keeps it until dropped. ``admit`` is all-or-nothing: when a
request names several new sessions and there are not enough free lanes,
nothing is admitted.

A lane without a session is free. It is either empty or *cached*: a dropped
session's lane may keep its KV cells and remember their tokens (the prefix
cache), so a later prompt that starts the same way can take the lane and
prefill only what is new. Cached lanes are kept in LRU order, at most
``cache_limit`` of them. Lanes the pool stops caching are listed in
``evicted`` for the runtime to clear before anyone uses them.

Which lane a new session gets matters for speed: llama.cpp computes a batch
as one micro-batch per run of consecutive lanes (each lane is a KV stream,
and a micro-batch spans consecutive streams), and every micro-batch reads
all the weights again. Measured on Gemma 3 270M (2 cores, AVX-512, exact
kernels), 4 decode rows on lanes 0-3 took 31 ms, on lanes 0-2 and 7 (two
micro-batches) 45 ms, on 0, 2, 4, 6 61 ms, more than 8 rows on lanes 0-7
(47 ms). So a new session takes the lane with the lowest cost: the runs
the held lanes would make, each worth ``TOKENS_PER_RUN`` tokens, plus the
tokens a cached lane holds (evicting it costs their prefill when its
prompt comes back); among equals the least recently cached first (an
empty lane before any cached one), then the lowest. The shortest cached
prompt goes first: measured behind the gateway, when lanes were weighed
by runs alone a lane holding a 74-token prompt was evicted as readily as
one holding 564, and the workers reused half the tokens that a perfect
partition did.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from faults import LanesBusy, SessionNotActive

SIGNAL_HISTORY = 4096

# What one more run of lanes weighs against a cached lane's tokens when a new
# session takes a lane: one more run costs ~13 ms on every decode step of
# every stream in the forward (4 rows: 31 ms in one run, 45 in two), ~0.8 s
# over a 64-token stream and ~1.7 s over 128; recomputing a prompt costs
# ~1.75 ms a token (~570 tokens/s with the exact kernels): a run is worth
# ~500-1,000 tokens. It was 128 when prefill was 2-4x slower; then distinct
# prompts arriving into 4 and 8 streams left the lanes in two runs and gave
# 1.01-1.08 of llama-server's tok/s, against 1.16 / 1.11 with the prefix
# cache off and 1.09-1.21 / 1.06-1.11 at 512-1,024 in runs of those cells
# alone; a full run of the final build gave 1.04 / 1.01, so the gain is not
# yet shown beyond the ~10% runs vary, and a simulation of that closed loop
# (completions in arrival order) kept one run under the old weight too. The
# weight follows the measured costs (docs/gateway.md: behind the gateway).
TOKENS_PER_RUN = 512

# Forwards a gap between their lanes may last before a session moves to close
# it (``gap_move``): a stream that ends leaves one, and in a closed loop the
# next prompt mostly fills it within a forward or two.
GAP_FORWARDS = 2

# The most cells a session may hold to be moved before a forward that carries
# a prompt piece. Such a forward is paced to what streams can wait, and the
# gap is charged to it; it lasts while the prompt goes in (4-8 paced turns),
# each a micro-batch more (~10-13 ms), where a move of 512 cells costs ~7 ms
# once. Before 2026-12-07 nothing moved before a piece: a prompt admitted on
# a lane apart from the streams' went in 7 turns of 19 tokens at 2.8-3.0 x a
# decode step, instead of 33 a turn (traced, AMD EPYC, repeated burst c=4).
PIECE_MOVE_CELLS = 512


@dataclass(frozen=True)
class Ephemeral:
    """The id of a session a sessionless ``generate`` runs in.

    Peers name sessions with strings; an ephemeral id is not a string, so no
    peer can name (join, trim or drop) another client's internal session.
    """

    n: int

    def __str__(self) -> str:
        return f"~gen-{self.n}"

    @classmethod
    def fresh(cls) -> Ephemeral:
        """A new id, never given before in this process (sessionless
        ``generate``, ``embed``)."""
        return cls(next(_ephemeral_ids))


_ephemeral_ids = itertools.count(1)


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


def runs(lanes: set[int]) -> int:
    """Runs of consecutive numbers in ``lanes`` (llama.cpp's micro-batches
    for a batch over them)."""
    return sum(1 for lane in lanes if lane - 1 not in lanes)


class LanePool:
    def __init__(self, n_lanes: int, cache_limit: int = 0) -> None:
        self.n_lanes = n_lanes
        self.cache_limit = n_lanes if cache_limit < 0 else min(cache_limit, n_lanes)
        self._free: list[int] = list(range(n_lanes))
        # lane -> the tokens its KV holds; LRU first
        self._cached: OrderedDict[int, list[int]] = OrderedDict()
        self.evicted: list[int] = []  # lanes to clear before reuse
        self.evicted_tokens: dict[int, list[int]] = {}  # what those lanes held
        self.sessions: dict[SessionId, Session] = {}
        self.gapped = 0  # forwards in a row whose lanes had a gap

    @property
    def free(self) -> int:
        """Lanes without a session (empty or cached)."""
        return len(self._free) + len(self._cached)

    @property
    def cached(self) -> int:
        return len(self._cached)

    def best_prefix(self, tokens: Sequence[int], longest: int) -> tuple[int, int] | None:
        """(lane, shared tokens) of the cached lane sharing the longest prefix
        with ``tokens`` (at most ``longest``); None when none shares any."""
        best: tuple[int, int] | None = None
        for lane, held in self._cached.items():
            n = min(len(held), longest)
            common = 0
            while common < n and held[common] == tokens[common]:
                common += 1
            if common and (best is None or common > best[1]):
                best = (lane, common)
        return best

    def _take_lane(self, prefer: int | None) -> int:
        if prefer is not None and prefer in self._cached:
            del self._cached[prefer]
            return prefer
        keys = self._lane_keys({s.lane for s in self.sessions.values()})
        lane = min(keys, key=keys.__getitem__)
        self._take(lane)
        return lane

    def _lane_keys(self, held: set[int]) -> dict[int, tuple[int, int, int]]:
        """Every free lane (empty or cached) -> its cost for a session beside
        those on ``held`` (the module docstring): the runs they would make,
        each worth ``TOKENS_PER_RUN`` tokens, plus a cached lane's tokens;
        then the least recently cached (an empty lane first), the lowest."""
        order = {lane: rank for rank, lane in enumerate(self._cached)}  # LRU first
        return {
            lane: (
                runs(held | {lane}) * TOKENS_PER_RUN + len(self._cached.get(lane, ())),
                order.get(lane, -1),
                lane,
            )
            for lane in [*self._free, *self._cached]
        }

    def _take(self, lane: int) -> None:
        """Take a free lane from the pool; a cached one is evicted."""
        if lane in self._cached:
            self.evicted_tokens[lane] = self._cached.pop(lane)
            self.evicted.append(lane)
        else:
            self._free.remove(lane)

    def gap_move(self, lanes: set[int], piece: bool) -> tuple[Session, int] | None:
        """Asked before every forward (over ``lanes``; ``piece``: it carries a
        prompt piece): the move to make first, once a gap between the lanes
        has lasted ``GAP_FORWARDS`` forwards. Each run of lanes is one more
        pass over the weights (3 streams on lanes 3, 5, 6 decoded in 36 ms,
        on 4-6 in 23), and moving a session's cells costs ~1.4 ms per 100;
        before a forward with a piece (as long as streams can wait already)
        only a session of at most ``PIECE_MOVE_CELLS``."""
        self.gapped = self.gapped + 1 if runs(lanes) > 1 else 0
        if self.gapped <= GAP_FORWARDS:
            return None
        choice = self.closing_move(lanes, PIECE_MOVE_CELLS if piece else None)
        if choice is not None:
            self.gapped = 0
        return choice

    def closing_move(
        self, lanes: set[int], most_cells: int | None = None
    ) -> tuple[Session, int] | None:
        """(session, lane) of the one move that best closes the gaps between
        ``lanes`` (a forward's): a session on one of them (of at most
        ``most_cells``) to a free lane, weighed as a new session's lane is
        (``_lane_keys``), the shortest session first (its cells are
        copied); None when no move leaves fewer runs."""
        now = runs(lanes)
        best: tuple[tuple[int, int, int, int], Session, int] | None = None
        for session in self.sessions.values():
            if session.lane not in lanes:
                continue
            if most_cells is not None and session.position > most_cells:
                continue
            rest = lanes - {session.lane}
            for lane, (cost, rank, _) in self._lane_keys(rest).items():
                if runs(rest | {lane}) >= now:
                    continue
                key = (cost, session.position, rank, lane)
                if best is None or key < best[0]:
                    best = (key, session, lane)
        return None if best is None else (best[1], best[2])

    def move(self, session_id: SessionId, lane: int) -> int:
        """Give a session the free ``lane`` (a cached one is evicted) and
        free the lane it had, which it returns; the runtime moves the cells."""
        session = self.require(session_id)
        self._take(lane)
        old, session.lane = session.lane, lane
        self._free.append(old)
        return old

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

    def admit(
        self,
        session_ids: Iterable[SessionId],
        ephemeral: bool = False,
        prefer: int | None = None,
    ) -> list[Session]:
        """Admit every new session or none; return all named sessions in order.

        ``prefer`` names a cached lane for the (single) new session.
        """
        ids = list(session_ids)
        new = self.missing(ids)
        if len(new) > self.free:
            raise LanesBusy(
                f"request requires {len(new)} new sessions but only "
                f"{self.free} execution lanes are available"
            )
        for sid in new:
            lane = self._take_lane(prefer)
            self.sessions[sid] = Session(sid, lane, ephemeral=ephemeral)
        return [self.sessions[sid] for sid in ids]

    def release(self, session_id: SessionId, keep: bool = False) -> Session:
        """Free a session's lane; with ``keep`` cache its tokens (its KV stays)."""
        session = self.require(session_id)
        del self.sessions[session_id]
        if keep and session.tokens and self.cache_limit > 0:
            self._cached[session.lane] = session.tokens
            while len(self._cached) > self.cache_limit:
                lane, held = self._cached.popitem(last=False)
                self.evicted_tokens[lane] = held
                self.evicted.append(lane)
                self._free.append(lane)
        else:
            self._free.append(session.lane)
        return session

    def evict_cached(self) -> int:
        """Stop caching every idle lane (their cells are wanted); they join ``evicted``."""
        count = len(self._cached)
        while self._cached:
            lane, held = self._cached.popitem(last=False)
            self.evicted_tokens[lane] = held
            self.evicted.append(lane)
            self._free.append(lane)
        return count

    def take_evicted(self) -> list[int]:
        lanes, self.evicted = self.evicted, []
        return lanes
