"""Jobs: what one request asks of the scheduler.

A job names the sessions it needs, is started when those sessions are free
(per-session FIFO order), contributes ``Step``s to the turn's single forward
through ``plan``, and consumes the results in ``advance``. Ops that touch no
model (trim, align, drop) are instant jobs: they finish in ``start``, still
in order with the session's other work. On a pipeline stage such an op
also goes down the chain (``RuntimeState.ask``) without waiting: the job
sits out (``waiting``) until the answer lands (``landed``), and only then
replies (``after_chain``), so the loop serves everything else meanwhile.

Phases order a turn's batch: decode tokens first (running streams never
wait behind a prompt), then atomic batches, then prefill chunks.

A job never sends anything. It writes typed outputs (a ``Result``, stream
``Event``s, a ``Failure``) into the shared ``Outbox`` through its
``Ticket``; after each scheduler turn the edge takes them out, renders
headers and tensor frames, and sends them. So no call made during a turn
reaches a socket, and a peer found dead while sending is handled after the
turn (its work is cancelled before the next). ``Ticket.owner`` is opaque to
the core: it only groups the requests of one peer (``cancel``, a peer gone,
``PeerLimits``).

``PeerLimits`` caps the named sessions one peer holds and the generations it
has in flight, so one client cannot take every lane or fill the wait queue.
A gateway is ONE peer to a worker, so the defaults (``worker/limits.py``) are
generous; they matter when clients connect directly. Counts are taken from
live state when a job is submitted (the scheduler's queued and running
jobs, the runtime's lanes), so every way work or a session ends gives its
count back with no bookkeeping to forget. The one thing remembered is which
peer's job admitted each named session (``holders``): entries whose session
has left the lanes are pruned at every count, a lost peer's forgotten at once.

The jobs of each op family are beside this module: ``session`` (prefill,
decode, verify, trim / align / drop / signal), ``generate``, ``batch``,
``tensors``, ``media``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from faults import Cancelled

from ...limits import exceeded

if TYPE_CHECKING:  # annotations only: the Job protocol and its outputs load no engine
    from ...runtime import Call, RuntimeState, SessionId, Step, StepResult


# -- what a job writes: typed outputs, through its ticket ----------------------


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


# -- jobs ------------------------------------------------------------------------


# Most rows of logits one step asks for (a verify piece, a speculative span).
# Not for exactness (every row scores as if alone at any batch size): the
# logits buffer llama.cpp keeps grows to the most rows ever asked and never
# shrinks, n_vocab x 4 B a row (1 MiB for Gemma 3), so spans go in pieces.
MAX_LOGIT_ROWS = 7
# Rows the speculative spans of one forward share (the next tokens and their
# drafts): one stream drafts up to 32, n streams 32 / n each, but never fewer
# than a verify piece's 6, so the logits buffer is never larger than before
# (lanes x 7 rows) and one stream's long drafts cost ~33 rows, once.
MAX_SPAN_ROWS = 33

PHASE_DECODE = 0
PHASE_ATOMIC = 1
PHASE_PREFILL = 2


class Job:
    """Base job. Subclasses set ``sessions`` and override the hooks."""

    phase = PHASE_DECODE
    atomic = False  # all of plan() must go in one forward
    waits_for_lane = False  # queue (rather than lanes_busy) when no lane
    ephemeral = False  # sessions are created for this job and dropped after
    generation = False  # a generate/chat: counts against --max-streams-per-peer
    fills_queue = True  # counts against --max-queue (not: holds no lane, starts at once)

    def __init__(self, ticket: Ticket, sessions: Sequence[SessionId]) -> None:
        self.ticket = ticket
        self.sessions = tuple(sessions)
        self.cancelled = False
        self.suspend = False  # asked to stop at a token boundary and hand its state over
        # Jobs in the forward being planned, decoding or prefilling (the
        # scheduler sets it before ``plan``): whether extra rows, a
        # speculative draft's, pay.
        self.streams = 1
        self._then: Callable[[], None] | None = None  # the reply, once the chain has answered

    def start(self, rt: RuntimeState) -> bool:
        """Admit sessions and check preconditions. True = already finished."""
        rt.admit(self.sessions, ephemeral=self.ephemeral)
        return False

    def size(self) -> int:
        """Tokens this job wants in the next forward (atomic jobs only)."""
        return 0

    def prefill_left(self) -> int:
        """Prompt tokens still to prefill (the scheduler serves the fewest
        first); 0 where a job does not say."""
        return 0

    def wants_exclusive(self) -> bool:
        """True when the next ``plan`` must be the only work of its forward
        (media decoded with non-causal attention): the scheduler gives the
        job a turn of its own."""
        return False

    def plan(self, rt: RuntimeState, budget: int) -> list[Step]:
        return []

    def advance(self, rt: RuntimeState, results: list[StepResult]) -> bool:
        """Consume this turn's results. True = finished (reply sent)."""
        return True

    def fail(self, rt: RuntimeState, exc: BaseException) -> None:
        self.ticket.fail(exc)

    def on_cancel(self, rt: RuntimeState) -> None:
        self.ticket.fail(Cancelled("request cancelled"))

    def suspendable(self) -> bool:
        """Whether ``suspend`` can end this job here and let it continue on
        another worker (only streamed generations can)."""
        return False

    def on_suspend(self, rt: RuntimeState) -> None:
        """End at a token boundary with the state a continuation needs."""
        raise NotImplementedError

    # -- a pipeline stage: requests down the chain ------------------------------------

    def waiting(self, rt: RuntimeState) -> bool:
        """True while a request down the chain about this job's sessions is
        unanswered: the job is neither planned nor reaped until it lands."""
        return rt.owes(self.sessions)

    def awaits(self, call: Call) -> bool:
        """Whether ``call``'s answer is this job's to take (a session's jobs
        run one at a time, so it is the job holding the session)."""
        return call.session is not None and call.session in self.sessions

    def landed(self, rt: RuntimeState, call: Call) -> bool:
        """An answer from down the chain about this job's sessions (sent by
        it, or before it). A failed one fails the job, as when a stage
        waited for it; the last one due runs the reply ``after_chain`` kept.
        True = finished."""
        if call.fault is not None:
            raise call.fault
        if self._then is None or self.waiting(rt):
            return False
        then, self._then = self._then, None
        then()
        return True

    def after_chain(self, rt: RuntimeState, then: Callable[[], None]) -> bool:
        """Run ``then`` (the job's reply) now, or once every request down the
        chain about its sessions is answered (``landed``); True when it ran
        (the job is finished)."""
        if not self.waiting(rt):
            then()
            return True
        self._then = then
        return False

    def release(self, rt: RuntimeState) -> None:
        """Called once when the job leaves the scheduler, however it ended."""
        if self.ephemeral:
            for sid in self.sessions:
                if rt.lanes.get(sid) is not None:
                    rt.drop(sid)


# The smallest piece a turn cuts from a prompt (less is not worth a row).
MIN_CUT = 16


def piece_limit(chunk: int) -> int:
    """The most prompt tokens one piece takes: ``chunk``, or up to an eighth
    more when that finishes the prompt. A 134-token prompt at the default 128
    would otherwise spend a whole turn (a decode step of every stream, and
    its first token one turn later) on a 6-token tail."""
    return chunk + chunk // 8


def even_piece(left: int, most: int) -> int:
    """The piece to take of a prompt with ``left`` tokens to go, at most
    ``most`` a turn: as many turns as ``most`` needs, in pieces of one size
    (100 at 30 a turn is 25 x 4, not 30 x 3 and a 10-token turn that costs
    the streams a turn for little); never below ``MIN_CUT``, under which a
    piece would wait."""
    if left <= most:
        return most
    turns = -(-left // most)
    return max(-(-left // turns), min(most, MIN_CUT))


def chunk_bounds(done: int, total: int, chunk: int, budget: int) -> int:
    """How many prompt tokens to take now (0 = wait for a later turn).

    Up to ``chunk`` tokens (``--prefill-chunk``), or the whole rest when it is
    within ``piece_limit``; a piece larger than the turn's ``budget`` is cut
    to it, unless that would leave less than ``MIN_CUT`` (then it waits).
    Where a prompt is cut does not matter for its numbers: every row is
    computed as if alone (``engine.kernels``), so a prompt prefilled in any
    pieces, or after a reused prefix, has the KV cells and logits of a cold
    prefill in one piece.
    """
    left = total - done
    n = left if left <= piece_limit(chunk) else chunk
    if n <= budget:
        return n
    return budget if budget >= MIN_CUT else 0


# -- per-peer limits, checked when the scheduler takes a job ---------------------

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
