"""What becomes of a forward the scheduler planned: results, failures, flights.

The ``Scheduler`` hands each planned forward to ``Outcomes``: it is
measured (for the stats and the ``TurnClock`` the cadence budget reads),
its results go to the jobs owning its steps, a failed one is isolated (jobs
whose KV moved fail, the others run again alone), and a pipeline stage's
forwards and other requests go down the chain (``launch``) and come home
(``land``) to the job waiting for them while other work runs. The
scheduler owns the jobs and lends ``finish`` and its running list.

``SchedulerStats`` (admissions, throughput, batch shapes) lives here too,
since forwards are most of what it counts: a sliding 10 s window and a
fixed power-of-two histogram of tokens per forward, both bounded.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from structlog import get_logger

from faults import EngineFault, Fault

from ..runtime import Call, Flight, RuntimeState, Step, StepResult, runs
from .jobs.base import MIN_CUT, PHASE_DECODE, Job

_log = get_logger("skiff.scheduler")


# -- counters ---------------------------------------------------------------------

WINDOW_S = 10.0
_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)

# Told of every forward: (steps, tokens, seconds). Metrics export hooks in here.
ForwardObserver = Callable[[int, int, float], None]


@dataclass
class _Mix:
    """One kind of forward, counted since start."""

    forwards: int = 0
    seconds: float = 0.0  # in ``RuntimeState.forward``: llama_decode and the rows
    prompt_tokens: int = 0

    def snapshot(self) -> dict[str, Any]:
        return {
            "forwards": self.forwards,
            "seconds": round(self.seconds, 6),
            "prompt_tokens": self.prompt_tokens,
        }


class SchedulerStats:
    def __init__(self) -> None:
        self.admitted = 0
        self.rejected = 0
        self.cancelled = 0
        self.expired = 0
        self.forwards = 0
        self.decode_steps = 0
        self.coalesced_steps = 0
        self.overlapped = 0  # a stage's forwards launched while another was down the chain
        self.occupancy = [0] * len(_BUCKETS)
        self._window: deque[tuple[float, int, int]] = deque()
        self._turn_s_total = 0.0
        self._recent_forwards: deque[float] = deque(maxlen=1024)
        self._queue_wait_s = 0.0
        self._queue_waits = 0
        # forwards without and with prompt pieces, apart: what prompts
        # arriving cost the streams running beside them
        self.mix = {"decode_only": _Mix(), "with_prompt": _Mix()}
        self.observer: ForwardObserver | None = None
        # seconds per part of a turn (stats' profile): planning (reap, admit,
        # plan), completing jobs after a forward, a stage's launches and its
        # waits for the chain
        self.timing = {"plan": 0.0, "complete": 0.0, "launch": 0.0, "land_wait": 0.0}

    def record_forward(self, steps: Sequence[Step], seconds: float, prompt_tokens: int = 0) -> None:
        decode = sum(1 for s in steps if len(s.tokens) == 1 and s.sample)
        total = sum(len(s.tokens) for s in steps)
        mix = self.mix["with_prompt" if prompt_tokens else "decode_only"]
        mix.forwards += 1
        mix.seconds += seconds
        mix.prompt_tokens += prompt_tokens
        self.forwards += 1
        self._turn_s_total += seconds
        self._recent_forwards.append(seconds)
        self.decode_steps += decode
        if decode > 1:
            self.coalesced_steps += decode
        for i, edge in enumerate(_BUCKETS):
            if total <= edge or i == len(_BUCKETS) - 1:
                self.occupancy[i] += 1
                break
        now = time.monotonic()
        self._window.append((now, total - decode, decode))
        while self._window and now - self._window[0][0] > WINDOW_S:
            self._window.popleft()
        if self.observer is not None:
            self.observer(len(steps), total, seconds)

    def record_queue_wait(self, seconds: float) -> None:
        self._queue_wait_s += seconds
        self._queue_waits += 1

    def mean_turn_ms(self) -> float:
        return 1000 * self._turn_s_total / self.forwards if self.forwards else 50.0

    def _forward_percentiles(self) -> dict[str, float]:
        """p50/p99/max of the last 1024 forwards: how long a ping may wait."""
        ordered = sorted(self._recent_forwards) or [0.0]
        at = {"p50": 0.5, "p99": 0.99, "max": 1.0}
        n = len(ordered)
        return {k: round(ordered[min(n - 1, int(q * n))] * 1000, 3) for k, q in at.items()}

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        recent = [w for w in self._window if now - w[0] <= WINDOW_S]
        span = max(1e-3, min(WINDOW_S, now - recent[0][0])) if recent else WINDOW_S
        return {
            "admitted": self.admitted,
            "rejected": self.rejected,
            "cancelled": self.cancelled,
            "expired": self.expired,
            "forwards": self.forwards,
            "mean_forward_ms": round(self.mean_turn_ms(), 3),
            "forward_ms": self._forward_percentiles(),
            "mean_queue_ms": round(1000 * self._queue_wait_s / max(1, self._queue_waits), 3),
            "tokens_per_s": {
                "prefill": round(sum(w[1] for w in recent) / span, 2),
                "decode": round(sum(w[2] for w in recent) / span, 2),
            },
            "decode_coalescing_rate": round(self.coalesced_steps / max(1, self.decode_steps), 4),
            "decode_steps": self.decode_steps,
            "coalesced_decode_steps": self.coalesced_steps,
            "overlapped_forwards": self.overlapped,
            "batch_occupancy": {str(b): n for b, n in zip(_BUCKETS, self.occupancy, strict=True)},
            "forward_mix": {kind: mix.snapshot() for kind, mix in self.mix.items()},
        }


# -- a forward's outcomes -----------------------------------------------------------


@dataclass
class _Flying:
    flight: Flight
    owners: list[tuple[Job, int]]
    started: float


class TurnClock:
    """What a turn costs, learned from forwards without drafts, for
    ``--cadence``: a decode-only turn per row count, what a gap between the
    lanes adds (a micro-batch: moving averages), and what a prompt piece
    adds beside decode rows, a fixed part (its own micro-batch) plus a part
    per token, a line over the last ``SAMPLES`` (one average per token
    undercharged small pieces, and turns overran)."""

    ALPHA = 0.2
    SAMPLES = 32

    def __init__(self) -> None:
        self.decode_ms: dict[int, float] = {}  # decode rows -> ms of a decode-only turn
        self.pieces: deque[tuple[int, float]] = deque(maxlen=self.SAMPLES)  # (tokens, ms added)
        self.alone: deque[tuple[int, float]] = deque(maxlen=self.SAMPLES)  # (tokens, ms) by itself
        self.gap_ms: float | None = None  # a gap between a forward's lanes: a micro-batch more

    def record(self, rows: int, pieces: int, tokens: int, ms: float, gaps: int = 0) -> None:
        """A forward of ``rows`` one-token rows and ``pieces`` of ``tokens``,
        over lanes with ``gaps`` gaps between them."""
        if gaps:
            if not pieces and rows in self.decode_ms:
                self.gap_ms = self._ema(self.gap_ms, max(ms - self.decode_ms[rows], 0.0) / gaps)
        elif not pieces:
            self.decode_ms[rows] = self._ema(self.decode_ms.get(rows), ms)
        elif pieces == 1 and rows in self.decode_ms:
            self.pieces.append((tokens, ms - self.decode_ms[rows]))
        elif pieces == 1 and not rows:  # what a piece costs before one ran beside streams
            self.alone.append((tokens, ms))

    def _ema(self, old: float | None, ms: float) -> float:
        return ms if old is None else (1 - self.ALPHA) * old + self.ALPHA * ms

    def decode_at(self, rows: int) -> float | None:
        """A decode-only turn of ``rows`` rows (of the nearest count measured)."""
        if not self.decode_ms:
            return None
        return self.decode_ms[min(self.decode_ms, key=lambda n: (abs(n - rows), n))]

    def piece_cost(self) -> tuple[float, float] | None:
        """(fixed ms, ms per token) a piece adds to a turn; None before two
        samples. Until two ran beside streams, a piece by itself stands in
        (an overestimate: its forward's own fixed costs are in it)."""
        samples = self.pieces if len(self.pieces) >= 2 else self.alone
        if len(samples) < 2:
            return None
        n, ms = (np.array(v, dtype=np.float64) for v in zip(*samples, strict=True))
        if np.ptp(n) >= MIN_CUT:
            per, fixed = (float(x) for x in np.polyfit(n, ms, 1))
            if per > 0:
                return max(fixed, 0.0), per
        # pieces of one size (or noise): no slope to fit, all of it per token
        return 0.0, max(float(ms.mean() / n.mean()), 0.01)

    def prefill_allowance(
        self, cadence: float, rows: int, gaps: int = 0, drafts: int = 0, spent_ms: float = 0.0
    ) -> int | None:
        """Prompt tokens a turn beside ``rows`` decoding streams (with
        ``drafts`` draft tokens, ``gaps`` gaps between their lanes and the
        prompt's, ``spent_ms`` gone already: admission saving an evicted
        lane, restoring a prompt) may carry to last at most ``cadence`` x a
        decode-only turn of the streams the prompt's will join; None = no
        limit."""
        base, cost = self.decode_at(rows), self.piece_cost()
        if cadence <= 0 or base is None or cost is None:
            return None
        fixed, per = cost
        step = self.decode_at(rows + 1) or base
        room = cadence * step - base - fixed - gaps * (self.gap_ms or 0.0) - drafts * per - spent_ms
        return max(MIN_CUT, int(room / per))  # never starve a prompt


Finish = Callable[[Job, BaseException | None], None]


class Outcomes:
    """Forwards after planning: measured, completed, isolated, or in flight."""

    def __init__(
        self, rt: RuntimeState, stats: SchedulerStats, finish: Finish, active: list[Job]
    ) -> None:
        self.rt = rt
        self.stats = stats
        self.finish = finish  # the scheduler's: fail or end a job, free its sessions
        self.active = active  # the scheduler's running jobs (answers from the chain go to one)
        self.clock = TurnClock()
        self.flying: list[_Flying] = []  # a pipeline stage's forwards down the chain
        self.flying_jobs: set[Job] = set()

    def run(self, steps: list[Step], owners: list[tuple[Job, int]]) -> None:
        """One forward here, measured, its results handed to their jobs."""
        started = time.perf_counter()
        try:
            results = self.rt.forward(steps)
        except EngineFault as exc:
            self.isolate(steps, owners, exc)
            return
        except Fault as exc:
            _log.error("forward_failed", error=str(exc), jobs=len(owners))
            for job, _ in owners:
                self.finish(job, exc)
            return
        except Exception as exc:  # a bug: fail its jobs (``internal``), never re-run them
            _log.exception("forward_crashed", jobs=len(owners))
            for job, _ in owners:
                self.finish(job, exc)
            return
        finally:
            self.record(steps, time.perf_counter() - started)
        done = time.perf_counter()
        self.complete(owners, results)
        self.stats.timing["complete"] += time.perf_counter() - done

    def isolate(self, steps: list[Step], owners: list[tuple[Job, int]], exc: EngineFault) -> None:
        """A forward of several jobs failed in llama.cpp (say, an exhausted KV
        cache). The jobs whose sessions' KV moved fail (the runtime kept their
        positions true, but the job's own progress no longer matches); every
        other job is run again alone, so only the requests that cannot run
        fail and the others go on as if nothing happened. Cached prefix lanes
        give their cells back first (they may be why there was no room)."""
        _log.error("forward_failed", error=str(exc), jobs=len(owners))
        freed = self.rt.free_cached_kv()
        if freed:
            _log.warning("prefix_cache_cleared_for_room", lanes=freed)
        if len(owners) == 1 and not freed:
            self.finish(owners[0][0], exc)
            return
        offset = 0
        for job, count in owners:
            part = steps[offset : offset + count]
            offset += count
            if any(str(step.session.id) in exc.advanced for step in part):
                self.finish(job, exc)
                continue
            started = time.perf_counter()
            try:
                results = self.rt.forward(part)
            except Fault as alone:
                self.finish(job, alone)
                continue
            finally:
                self.record(part, time.perf_counter() - started)
            self.complete([(job, count)], results)

    def record(self, steps: list[Step], seconds: float) -> None:
        pieces = [len(s.tokens) for s in steps if len(s.tokens) > 1 and not s.all_rows]
        self.stats.record_forward(steps, seconds, sum(pieces))
        rows = sum(1 for s in steps if len(s.tokens) == 1)
        if rows + len(pieces) == len(steps):  # no drafts
            gaps = runs({s.session.lane for s in steps}) - 1
            self.clock.record(rows, len(pieces), sum(pieces), seconds * 1000, gaps)

    def complete(self, owners: list[tuple[Job, int]], results: list[StepResult]) -> None:
        offset = 0
        for job, count in owners:
            part = results[offset : offset + count]
            offset += count
            failed = next((r.error for r in part if r.error is not None), None)
            if failed is not None:
                self.finish(job, failed)
                continue
            self._guarded(job, functools.partial(job.advance, self.rt, part))

    def _guarded(self, job: Job, step: Callable[[], bool]) -> None:
        """Run one of ``job``'s steps; finish it when the step says it is
        done, or fail it alone when the step raises (a bug in one job must
        not kill the others)."""
        try:
            finished = step()
        except Fault as exc:
            self.finish(job, exc)
            return
        except Exception as exc:
            _log.exception("job_crashed", op=job.ticket.op)
            self.finish(job, exc)
            return
        if finished:
            self.finish(job, None)

    # -- a pipeline stage: forwards in flight down the chain ----------------------

    @property
    def expecting(self) -> bool:
        """Forwards or other requests are out down the chain (``land`` polls)."""
        return bool(self.flying) or bool(self.rt.asked)

    def aside(self, job: Job) -> bool:
        """The job waits for the chain, neither planned nor reaped: its forward
        is in flight, or a request about its sessions is unanswered."""
        return job in self.flying_jobs or (bool(self.rt.asked) and job.waiting(self.rt))

    def rejoin(self, active: list[Job]) -> bool:
        """True when only decode rows are ready while a forward is in flight:
        they wait to go with the streams in flight instead of forming a second,
        smaller batch (streams out of phase would halve every batch after).
        What overlaps a forward in flight is new work: prompts, batches."""
        if not self.flying:
            return False
        ready = [j for j in active if not self.aside(j)]
        return bool(ready) and all(j.phase == PHASE_DECODE for j in ready)

    def launch(self, steps: list[Step], owners: list[tuple[Job, int]]) -> None:
        """Send the turn's forward down the chain and go on: its jobs sit out
        planning (and reaping) until it lands, other jobs keep running."""
        try:
            flight = self.rt.launch(steps)
        except Fault as exc:
            _log.error("forward_failed", error=str(exc), jobs=len(owners))
            for job, _ in owners:
                self.finish(job, exc)
            return
        if self.flying:
            self.stats.overlapped += 1  # pipelining: this one overlaps a forward in flight
        self.flying.append(_Flying(flight, owners, time.perf_counter()))
        self.flying_jobs.update(job for job, _ in owners)

    def land(self, timeout_ms: int) -> None:
        t0 = time.perf_counter()
        landed = self.rt.land(timeout_ms)
        self.stats.timing["land_wait"] += time.perf_counter() - t0
        for flight in landed:
            if isinstance(flight, Call):
                self.answered(flight)
                continue
            flying = next(f for f in self.flying if f.flight is flight)
            self.flying.remove(flying)
            self.flying_jobs.difference_update(job for job, _ in flying.owners)
            self.record(flight.steps, time.perf_counter() - flying.started)
            if flight.fault is not None:
                _log.error("forward_failed", error=str(flight.fault), jobs=len(flying.owners))
                for job, _ in flying.owners:
                    self.finish(job, flight.fault)
                continue
            done = time.perf_counter()
            self.complete(flying.owners, flight.results)
            self.stats.timing["complete"] += time.perf_counter() - done

    def answered(self, call: Call) -> None:
        """A request down the chain came home: to the running job it is for
        (``Job.awaits``), which replies, goes on, or fails with its fault. One
        nobody waits for any more (a drop as a job ended, an idle session's)
        only logs a failure."""
        job = next((j for j in self.active if j.awaits(call)), None)
        if job is None or job in self.flying_jobs:
            if call.fault is not None:
                _log.warning("chain_answer_unclaimed", op=call.op, error=str(call.fault))
            return
        self._guarded(job, functools.partial(job.landed, self.rt, call))
