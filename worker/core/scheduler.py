"""Continuous batching: every turn runs at most ONE forward.

A turn: expire deadlines, apply cancels, start queued jobs whose sessions
are free (per-session FIFO, so a pipelining client sees its ops in order),
then build one batch under the token budget:

1. one decode token per running generation / pending ``decode`` (so
   concurrent decodes from different peers coalesce into one forward);
2. atomic batches (``decode_batch``, ``iteration_batch``), whole or not at
   all; one that did not fit goes first next turn;
3. prefill pieces, shortest remaining prompt first (the order that makes
   the mean time to first token smallest), and while several prompts wait,
   one piece a turn: each turn finishes the next prompt and starts its
   stream instead of carrying every prompt a little further, and a long
   prompt never holds running streams for more than one piece. A prompt
   that has waited ``PREFILL_AGE_S`` goes first whatever its length.

A job whose next step must run alone (``Job.wants_exclusive``: an image
decoded with non-causal attention, which llama.cpp applies to the whole
micro-batch) gets a turn of its own instead: its steps are the forward and
everything else waits one turn. The turn after one is ordinary whenever
other work is ready, so media never takes more than every other turn.

Turns are budgeted by time as well as tokens. The scheduler learns what a
decode-only turn costs and what a prompt piece adds (``TurnClock``). While
streams are decoding, prefill gets only the tokens that keep the turn
within ``cadence`` x a decode-only turn, the prompt cut in pieces of one
size (where it is cut does not change its numbers: rows are
batch-invariant), so a prompt arriving mid-stream delays each running
stream's next token by a bounded amount instead of a whole piece.

The scheduler knows nothing about sockets: jobs answer through their
``Ticket`` into the outbox, which the edge empties after the turn.

What happens after a forward (the turn clock, completing and failing jobs,
isolating a failed forward, a stage's flights and answers down the chain)
is ``self.outcomes`` (``outcomes.py``), which borrows ``_finish``. A job
waiting for the chain (``Outcomes.aside``) is neither planned nor reaped and
holds its sessions, so their later ops stay behind it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from structlog import get_logger

from faults import Cancelled, DeadlineExceeded, Fault, LanesBusy, QueueFull

from ..runtime import RuntimeState, SessionId, Step, runs
from .jobs.base import PHASE_ATOMIC, PHASE_DECODE, Job, PeerLimits, even_piece, piece_limit
from .outcomes import Outcomes, SchedulerStats

_log = get_logger("skiff.scheduler")
PREFILL_AGE_S = 2.0  # a prompt waiting this long goes first, whatever its length
_LAND_WAIT_MS = 20  # a stage with nothing to plan waits this long for the chain


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_tokens: int = 512
    max_queue: int = 64
    admission_timeout_ms: int = 60_000
    cadence: float = 0.0  # a turn with streams decoding lasts at most this x a decode turn; 0 = off
    chain_credit: int = 2  # a pipeline stage's forwards in flight down the chain at once
    # decode groups a stage keeps apart (one per stage on separate hosts, each
    # computing one while the next computes another); 1 = rejoin (shared cores)
    pipeline_groups: int = 1
    prefill_chunk: int = 128  # while several prompts wait, one turn's prefill (a piece)
    max_sessions_per_peer: int = 0  # named sessions one peer holds, admitted or queued; 0 = off
    max_streams_per_peer: int = 0  # generations one peer has queued or running; 0 = off


class Scheduler:
    def __init__(self, rt: RuntimeState, cfg: SchedulerConfig) -> None:
        self.rt = rt
        self.cfg = cfg
        self.pending: deque[Job] = deque()
        self.active: list[Job] = []
        self.busy: set[SessionId] = set()
        self.stats = SchedulerStats()
        self._turn = 0
        self._boost: Job | None = None  # atomic job that missed the last turn
        self.outcomes = Outcomes(rt, self.stats, self._finish, self.active)
        self.peers = PeerLimits(cfg.max_sessions_per_peer, cfg.max_streams_per_peer)
        self._exclusive_last = False  # the last turn was one job's alone
        self._started = 0.0  # when this turn began (admission's time is the turn's too)
        # A session a running job holds is never parked to make room.
        rt.pinned = self.busy.__contains__

    # -- intake ------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue a job; refuse at once when its peer is at a per-peer limit
        (``limit_exceeded``) or the wait queue is full.

        Jobs that free lanes will take this turn do not count as waiting.
        """
        self.peers.check(job, self._all_jobs(), self.rt.lanes.sessions)
        full = len(self.pending) >= self.cfg.max_queue + self.rt.lanes.free
        if full and job.fills_queue:
            self.stats.rejected += 1
            raise QueueFull(
                f"{len(self.pending)} requests already queued (max {self.cfg.max_queue})",
                retry_after_ms=self._retry_hint_ms(),
            )
        self.pending.append(job)

    def _retry_hint_ms(self) -> int:
        # A rough wait: one average turn per queued request ahead of us.
        return max(10, int(self.stats.mean_turn_ms() * max(1, len(self.pending))))

    def cancel(self, owner: Hashable, req_id: int) -> bool:
        for job in self._all_jobs():  # a request's id: its first live job
            if job.ticket.owner == owner and job.ticket.id == req_id and not job.cancelled:
                job.cancelled = True
                return True
        return False

    def suspend(self, owner: Hashable, req_id: int) -> bool:
        """Ask one of ``owner``'s streams to stop between two turns and hand
        its state over (``Job.on_suspend``: a ``suspended`` final event); one
        still queued ends at once with ``resume: None``. False: none, or unmovable."""
        for job in list(self.pending):
            if job.ticket.owner == owner and job.ticket.id == req_id and job.suspendable():
                self.pending.remove(job)
                job.ticket.event({"event": "suspended", "done": True, "resume": None})
                job.release(self.rt)
                return True
        for job in self.active:
            mine = job.ticket.owner == owner and job.ticket.id == req_id
            if mine and not job.cancelled and job.suspendable():
                job.suspend = True
                return True
        return False

    def cancel_owner(self, owner: Hashable) -> int:
        """Cancel every job of one owner (a peer that went away or stopped reading);
        the sessions it admitted stop counting against it."""
        self.peers.forget(owner)
        return self._cancel(lambda j: j.ticket.owner == owner)

    def cancel_all(self) -> int:
        """Cancel every job (a drain's timeout); each ends with its final event."""
        return self._cancel(lambda j: True)

    def _cancel(self, which: Callable[[Job], bool]) -> int:
        """Mark the live jobs ``which`` picks cancelled (the next turn reaps them)."""
        picked = [j for j in self._all_jobs() if not j.cancelled and which(j)]
        for job in picked:
            job.cancelled = True
        return len(picked)

    def knows_session(self, session_id: SessionId) -> bool:
        """True when queued or running work names this session."""
        return any(session_id in job.sessions for job in self._all_jobs())

    def has_work(self) -> bool:
        return bool(self.active) or bool(self.pending)

    def _all_jobs(self) -> Iterable[Job]:
        yield from self.active
        yield from self.pending

    # -- one turn ------------------------------------------------------------

    def turn(self) -> None:
        """Advance the world by at most one forward (or one launch down the chain)."""
        self._turn += 1
        if self.outcomes.expecting:
            self.outcomes.land(0)
        t0 = self._started = time.perf_counter()
        now = time.monotonic()
        self._reap(now)
        self._start_pending(now)
        groups = max(1, self.cfg.pipeline_groups) if self.rt.chained else 1
        credit = max(1, self.cfg.chain_credit, groups)
        if len(self.outcomes.flying) >= credit or (
            groups == 1 and self.outcomes.rejoin(self.active)
        ):
            self.outcomes.land(_LAND_WAIT_MS)  # out of credit, or decodes waiting to rejoin
            return
        steps, owners = self._plan(self._group_size(groups))
        timing = self.stats.timing
        timing["plan"] += time.perf_counter() - t0
        if not steps:
            if self.outcomes.expecting:
                self.outcomes.land(_LAND_WAIT_MS)
            return
        if self.rt.chained:
            t1 = time.perf_counter()
            self.outcomes.launch(steps, owners)
            timing["launch"] += time.perf_counter() - t1
            return
        self.outcomes.run(steps, owners)

    def _reap(self, now: float) -> None:
        """Apply cancels, dead peers and deadlines to queued and running jobs."""
        for job in list(self.pending):
            reason = self._stop_reason(job, now, queued=True)
            if reason is not None:
                self.pending.remove(job)
                self._count_stop(reason)
                job.fail(self.rt, reason)
                job.release(self.rt)
        for job in list(self.active):
            if self.outcomes.aside(job):
                continue  # reaped once its forward (or the chain's answer) lands
            if job.suspend and not job.cancelled and job.suspendable():
                held = list(job.sessions)  # a sessionless stream's session is renamed
                job.on_suspend(self.rt)
                self.busy.difference_update(held)
                self._finish(job, None)
                continue
            reason = self._stop_reason(job, now, queued=False)
            if reason is None:
                continue
            self._count_stop(reason)
            if isinstance(reason, Cancelled):
                job.on_cancel(self.rt)
                self._finish(job, None)
            else:
                self._finish(job, reason)

    def _stop_reason(self, job: Job, now: float, queued: bool) -> Fault | None:
        if job.cancelled:
            return Cancelled("request cancelled")
        if job.ticket.expired(now):
            return DeadlineExceeded("deadline passed")
        if queued and job.waits_for_lane:
            most = self.cfg.admission_timeout_ms
            if (now - job.ticket.received) * 1000 > most:
                return DeadlineExceeded(
                    f"not started within {most} ms (no lane, or its session busy)"
                )
        return None

    def _count_stop(self, reason: Fault) -> None:
        cancelled = isinstance(reason, Cancelled)
        self.stats.cancelled += cancelled
        self.stats.expired += not cancelled

    def _start_pending(self, now: float) -> None:
        """Start queued jobs in order. A session's jobs run one at a time; and
        once a generation waits for a lane, later jobs that need a new lane
        wait behind it (or fail ``lanes_busy``), so a lane freed later in the
        same pass goes to the earliest waiter, not to whoever comes next."""
        blocked: set[SessionId] = set(self.busy)
        lanes_reserved = False
        for job in list(self.pending):
            if blocked.intersection(job.sessions):
                blocked.update(job.sessions)
                continue
            new = self.rt.lanes.missing(job.sessions)
            try:
                if lanes_reserved and new:
                    raise LanesBusy("every free lane is promised to a generation queued earlier")
                finished = job.start(self.rt)
            except LanesBusy as exc:
                if job.waits_for_lane:
                    blocked.update(job.sessions)
                    lanes_reserved = True
                    continue
                self.pending.remove(job)
                self.stats.rejected += 1
                job.fail(self.rt, exc)
                job.release(self.rt)  # every way out of the scheduler releases
                continue
            except Exception as exc:
                self.pending.remove(job)
                job.fail(self.rt, exc)
                job.release(self.rt)
                continue
            self.pending.remove(job)
            self.peers.admitted(job, new, self.rt.lanes.sessions)
            self.stats.admitted += 1
            self.stats.record_queue_wait(now - job.ticket.received)
            if finished:
                job.release(self.rt)
                continue
            self.active.append(job)
            self.busy.update(job.sessions)
            blocked.update(job.sessions)

    def _group_size(self, groups: int) -> int | None:
        """The most decode streams one launch takes: with ``groups`` > 1 they
        split into that many equal groups taking turns down the chain (lane
        order keeps each group the same from turn to turn); None = all."""
        if groups <= 1:
            return None
        decoding = sum(1 for j in self.active if j.phase == PHASE_DECODE)
        return max(1, -(-decoding // groups))

    def _plan(self, group_size: int | None = None) -> tuple[list[Step], list[tuple[Job, int]]]:
        budget = self.cfg.max_batch_tokens
        decodes = 0  # decode streams taken into this forward (``group_size`` caps them)
        steps: list[Step] = []
        owners: list[tuple[Job, int]] = []
        # Decode rows go in lane order, the same every turn: llama.cpp reuses
        # its compute graph when consecutive batches have the same layout, and
        # a reshuffled batch measured ~35% slower per token. Prefill pieces go
        # shortest remaining prompt first (``_prefill_order``).
        ready = [j for j in self.active if not self.outcomes.aside(j)]
        exclusive = self._exclusive_turn(ready)
        if exclusive is not None:
            return exclusive
        ready = [j for j in ready if not j.wants_exclusive()]  # they wait for their turn
        stable = sorted(ready, key=self._first_lane)
        prefills = self._prefill_order([j for j in ready if j.phase > PHASE_ATOMIC])
        boosted = self._boost if self._boost in ready else None
        self._boost = None
        if boosted is not None:
            stable.remove(boosted)
            stable.insert(0, boosted)
        # the jobs this forward carries, a prompt's among them: a drafter asks
        # whether drafts pay (beside a piece a row costs a prompt token's time)
        streams = sum(1 for j in stable if j.phase == PHASE_DECODE)
        streams = min(streams, group_size) if group_size is not None else streams
        streams += len(prefills)
        for phase in (PHASE_DECODE, PHASE_ATOMIC, None):
            if phase is None and (allowance := self._allowance(prefills, steps)) is not None:
                budget = min(budget, allowance)  # the time left for prefill this turn
            if phase is None and len(prefills) > 1:
                budget = min(budget, piece_limit(self.cfg.prefill_chunk))  # one piece
            for job in stable if phase is not None else prefills:
                in_phase = job.phase == phase if phase is not None else job.phase > PHASE_ATOMIC
                if boosted is job and phase is PHASE_DECODE:
                    in_phase = True  # the starved atomic job goes before everyone
                elif boosted is job:
                    continue
                if not in_phase:
                    continue
                if phase == PHASE_DECODE and job is not boosted:
                    if group_size is not None and decodes >= group_size:
                        continue  # the next group's: it goes in the next launch
                    decodes += 1
                    job.streams = streams
                # plan() with no budget left returns nothing, and an atomic job
                # that could not run is boosted to go first next turn.
                try:
                    planned = job.plan(self.rt, max(0, budget))
                except Exception as exc:  # a request's bad plan fails it, not every turn after
                    if not isinstance(exc, Fault):
                        _log.exception("plan_crashed", op=job.ticket.op)
                    self._finish(job, exc)
                    continue
                if not planned:
                    if job.atomic and self._boost is None:
                        self._boost = job
                    continue
                steps.extend(planned)
                owners.append((job, len(planned)))
                budget -= sum(len(s.tokens) for s in planned)
        return steps, owners

    def _allowance(self, prefills: list[Job], steps: list[Step]) -> int | None:
        """The next prompt's piece while streams decode (``--cadence``): what
        keeps the turn in time beside the rows planned so far, in pieces of
        one size; None = only the token budget applies. Not on a stage (a
        turn is a flight down the chain), nor in a unified KV cache (a
        prompt taking shared cells piecemeal could starve a running stream,
        where a whole piece that does not fit fails alone)."""
        rows = [s for s in steps if len(s.tokens) == 1 or s.all_rows]  # streams, drafts
        if not prefills or not rows or self.rt.chained or self.rt.engine.kv_unified:
            return None
        lanes = {s.session.lane for s in rows} | {self._first_lane(prefills[0])}
        drafts = sum(len(s.tokens) - 1 for s in rows)
        clock = self.outcomes.clock
        spent = (time.perf_counter() - self._started) * 1000  # reaping, admission, planning
        most = clock.prefill_allowance(self.cfg.cadence, len(rows), runs(lanes) - 1, drafts, spent)
        return None if most is None else even_piece(prefills[0].prefill_left(), most)

    def _exclusive_turn(self, ready: list[Job]) -> tuple[list[Step], list[tuple[Job, int]]] | None:
        """This turn's forward when it belongs to one job alone; None for an
        ordinary turn (also right after an exclusive one, if others are ready)."""
        wanting = [j for j in ready if j.wants_exclusive()]
        if not wanting or (self._exclusive_last and len(wanting) < len(ready)):
            self._exclusive_last = False
            return None
        self._exclusive_last = True
        job = wanting[self._turn % len(wanting)]  # media jobs take turns
        try:
            planned = job.plan(self.rt, self.cfg.max_batch_tokens)
        except Exception as exc:  # e.g. the projector failed to encode: this job only
            _log.exception("plan_failed", op=job.ticket.op)
            self._finish(job, exc)
            return [], []
        return planned, [(job, len(planned))] if planned else []

    def _first_lane(self, job: Job) -> int:
        session = self.rt.lanes.get(job.sessions[0]) if job.sessions else None
        return session.lane if session is not None else self.rt.lanes.n_lanes

    def _prefill_order(self, jobs: list[Job]) -> list[Job]:
        """Prompts by tokens left to prefill, fewest first (ties: arrival);
        those waiting ``PREFILL_AGE_S`` or more first of all, by arrival."""
        now = time.monotonic()

        def key(job: Job) -> tuple[int, int, float]:
            arrived = job.ticket.received
            if now - arrived >= PREFILL_AGE_S:
                return (0, 0, arrived)
            return (1, job.prefill_left(), arrived)

        return sorted(jobs, key=key)

    def _finish(self, job: Job, exc: BaseException | None) -> None:
        """End a job (failing it with ``exc``), freeing its sessions for others."""
        if exc is not None:
            job.fail(self.rt, exc)
        if job in self.active:
            self.active.remove(job)
            self.busy.difference_update(job.sessions)
        job.release(self.rt)
