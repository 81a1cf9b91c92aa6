"""The continuous-batching policy of ``worker.scheduler`` against a fake runtime.

No model and no sockets: ``FakeRuntime`` keeps real ``LanePool`` bookkeeping,
moves positions like ``RuntimeState.forward`` does, samples a token that is a
function of the position, and records every forward so the tests can read
the batch composition and order of each turn.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

from faults import (
    BadRequest,
    Cancelled,
    ContextOverflow,
    DeadlineExceeded,
    EngineFault,
    ErrorCode,
    LanesBusy,
    QueueFull,
    StageUnavailable,
)
from worker.core.jobs.base import PHASE_PREFILL, Event, Failure, Job, Outbox, Output, Result, Ticket
from worker.core.jobs.batch import AtomicBatchJob, BatchEntry
from worker.core.jobs.generate import GenerateJob
from worker.core.jobs.session import DecodeJob, InfoJob, PrefillJob, SessionOpJob
from worker.core.outcomes import TurnClock
from worker.core.scheduler import Scheduler, SchedulerConfig
from worker.runtime import (
    Call,
    Ephemeral,
    Flight,
    LanePool,
    Session,
    SessionId,
    Step,
    StepResult,
)
from worker.runtime.tail import Answer
from worker.spec import SamplerSpec

# -- helpers -------------------------------------------------------------------

J = TypeVar("J", bound=Job)
EOG = 2  # the fake's end-of-generation token; sampled tokens are never this
PEER = b"peer"


def sampled_token(position: int) -> int:
    """The token the fake samples once a session reaches ``position``."""
    return 1000 + position


class FakeEngine:
    n_layer = 4

    def piece(self, token: int) -> bytes:
        return f"<{token}>".encode()

    def is_eog(self, token: int) -> bool:
        return token == EOG

    def tokenize(
        self, text: str, add_special: bool = False, parse_special: bool = False
    ) -> list[int]:
        return ([1] if add_special else []) + [ord(c) for c in text]


@dataclass(frozen=True)
class Row:
    """One step of a recorded forward (a snapshot: Steps hold live sessions)."""

    session: SessionId
    tokens: tuple[int, ...]
    sample: bool
    all_rows: bool


class FakeRuntime:
    """What Scheduler and the jobs call on ``RuntimeState``, without llama.cpp."""

    chained = False  # a whole model: every forward is synchronous

    def __init__(self, n_lanes: int, ctx_per_lane: int = 256) -> None:
        self.engine = FakeEngine()
        self.n_layer = FakeEngine.n_layer
        self.lanes = LanePool(n_lanes)
        self.ctx_per_lane = ctx_per_lane
        self.calls: list[list[Row]] = []  # every forward, in order
        self.fail_next = False  # the next forward raises EngineFault
        self.cannot_fit: SessionId | None = None  # every forward naming it raises EngineFault
        self.advance_on_failure: dict[str, int] = {}  # KV the failed forward moved anyway
        self.step_error: SessionId | None = None  # sampling fails for this session

    park = None  # no parking: lanes are what they are
    pinned: Any = None  # set by the Scheduler
    tail: Any = None  # a whole model: nothing goes down a chain
    asked: dict[int, Call] = {}  # so nothing is ever asked of one

    def owes(self, session_ids: Sequence[SessionId]) -> bool:
        return any(c.session in session_ids for c in self.asked.values())

    def admit(self, session_ids: Sequence[SessionId], ephemeral: bool = False) -> list[Session]:
        return self.lanes.admit(session_ids, ephemeral)

    def known(self, session_id: SessionId) -> Session | None:
        return self.lanes.get(session_id)

    def lanes_for(self, session_ids: Sequence[SessionId]) -> tuple[int, int]:
        return len(self.lanes.missing(session_ids)), self.lanes.free

    def admit_prompt(
        self,
        session_id: SessionId,
        prompt: Sequence[int],
        ephemeral: bool = False,
        reuse: bool = True,
    ) -> tuple[Session, int]:
        known = self.lanes.get(session_id)
        if known is not None:
            return known, 0
        (session,) = self.admit([session_id], ephemeral)
        return session, 0  # no prefix cache here: that is the runtime's business

    def ensure_room(self, session: Session, n_tokens: int) -> None:
        if session.position + n_tokens > self.ctx_per_lane:
            raise ContextOverflow(f"{session.position} + {n_tokens} > {self.ctx_per_lane}")

    def drop(self, session_id: SessionId) -> None:
        self.lanes.release(session_id)

    def free_cached_kv(self) -> int:
        return 0

    def trim(self, session_id: SessionId, token_count: int) -> int:
        session = self.lanes.require(session_id)
        if token_count > session.position:
            raise BadRequest("cannot trim forward")
        session.position = token_count
        session.pending = []
        del session.tokens[token_count:]
        return token_count

    def sample_row(
        self, session: Session, spec: SamplerSpec | None, row: int, top_logprobs: int | None = None
    ) -> int:
        session.last_token = sampled_token(row)
        return session.last_token

    def forward(self, steps: Sequence[Step]) -> list[StepResult]:
        self.calls.append([Row(s.session.id, tuple(s.tokens), s.sample, s.all_rows) for s in steps])
        if self.fail_next:
            self.fail_next = False
            raise EngineFault("injected decode failure", {})
        if any(s.session.id == self.cannot_fit for s in steps):
            raise EngineFault("no KV slot for the batch", self.advance_on_failure)
        for step in steps:
            self.ensure_room(step.session, len(step.tokens))
        results: list[StepResult] = []
        row = 0
        for step in steps:
            session = step.session
            session.position += len(step.tokens)
            session.tokens.extend(step.tokens)
            result = StepResult()
            if step.all_rows:
                result.rows = list(range(row, row + len(step.tokens)))
            elif step.sample:
                if session.id == self.step_error:
                    result.error = BadRequest("sampling: injected")
                else:
                    result.token = sampled_token(session.position)
            row += len(step.tokens)
            results.append(result)
        return results

    # -- what the tests read ---------------------------------------------------

    def sessions_of(self, call: int) -> list[SessionId]:
        return [r.session for r in self.calls[call]]

    def totals(self) -> list[int]:
        return [sum(len(r.tokens) for r in call) for call in self.calls]

    def turns_with_after(self, call: int) -> set[SessionId]:
        """Sessions in any forward from ``call`` on."""
        return {r.session for c in self.calls[call:] for r in c}

    def turns_with(self, session: SessionId) -> list[int]:
        return [i for i, call in enumerate(self.calls) if any(r.session == session for r in call)]


class FakeChainRuntime(FakeRuntime):
    """A pipeline stage: ``launch`` runs the forward but holds its results
    back (the rest of the chain computing) until the test ``deliver``s; trim,
    drop and other requests down the chain (``ask``) stay unanswered until
    the test ``answer``s them."""

    chained = True
    tail = "the rest of the chain"  # not None: a stage (the fake never calls it)

    def __init__(self, n_lanes: int, ctx_per_lane: int = 256) -> None:
        super().__init__(n_lanes, ctx_per_lane)
        self.out: list[Flight] = []  # launched, not landed
        self.home: list[Flight | Call] = []  # delivered, landing at the next poll
        self.land_waits: list[int] = []
        self.asked: dict[int, Call] = {}
        self._tickets = itertools.count(1)

    def ask(self, op: str, session: SessionId | None, send: Any) -> Call:
        call = Call(op, session)
        self.asked[next(self._tickets)] = call
        return call

    def trim(self, session_id: SessionId, token_count: int) -> int:
        position = super().trim(session_id, token_count)
        self.ask("trim", session_id, None)
        return position

    def drop(self, session_id: SessionId) -> None:
        super().drop(session_id)
        self.ask("drop", session_id, None)

    def answer(self, op: str, fault: Exception | None = None, **result: Any) -> Call:
        """The oldest unanswered ``op`` comes home at the next poll."""
        call = next(c for c in self.asked.values() if c.op == op and c not in self.home)
        if fault is not None:
            call.fault = fault  # type: ignore[assignment]
        else:
            call.answer = Answer(dict(result))
        self.home.append(call)
        return call

    def launch(self, steps: Sequence[Step]) -> Flight:
        flight = Flight(list(steps))
        flight.results = self.forward(steps)
        self.out.append(flight)
        return flight

    def deliver(self, index: int = 0, fault: EngineFault | None = None) -> None:
        flight = self.out.pop(index)
        flight.fault = fault
        self.home.append(flight)

    def land(self, timeout_ms: int) -> list[Flight | Call]:
        self.land_waits.append(timeout_ms)
        home, self.home = self.home, []
        self.asked = {t: c for t, c in self.asked.items() if c not in home}
        return home


class Harness:
    """A scheduler over a fake runtime, with job builders and collected outputs."""

    def __init__(
        self,
        lanes: int = 2,
        ctx: int = 256,
        prefill_chunk: int = 128,
        chained: bool = False,
        **cfg: float,
    ) -> None:
        self.rt = (FakeChainRuntime if chained else FakeRuntime)(lanes, ctx)
        self.cfg = SchedulerConfig(prefill_chunk=prefill_chunk, **cfg)  # type: ignore[arg-type]
        self.sched = Scheduler(self.rt, self.cfg)  # type: ignore[arg-type]
        self.chunk = min(prefill_chunk, self.cfg.max_batch_tokens)  # as the service
        self.outbox = Outbox()
        self.outputs: dict[int, list[Output]] = defaultdict(list)
        self._ids = itertools.count(1)

    def ticket(self, op: str, owner: bytes = PEER) -> Ticket:
        return Ticket(owner=owner, id=next(self._ids), op=op, outbox=self.outbox)

    def submit(self, job: J) -> J:
        self.sched.submit(job)
        return job

    def generate(
        self,
        session: str | None = None,
        prompt_len: int = 1,
        max_tokens: int = 3,
        owner: bytes = PEER,
    ) -> GenerateJob:
        """A generation (ephemeral when ``session`` is None), not yet submitted."""
        ticket = self.ticket("generate", owner)
        sid: SessionId = Ephemeral(ticket.id) if session is None else session
        prompt = list(range(10, 10 + prompt_len))
        return GenerateJob(
            ticket,
            sid,
            ephemeral=session is None,
            prompt=prompt,
            max_tokens=max_tokens,
            spec=None,
            stop=[],
            stop_tokens=set(),
            ignore_eos=False,
            stream=True,
            chunk=self.chunk,
        )

    def prefill(self, session: str, n: int, sampled: bool = False) -> PrefillJob:
        tokens = list(range(10, 10 + n))
        return PrefillJob(self.ticket("prefill"), session, tokens, self.chunk, sampled, None)

    def decode(self, session: str, owner: bytes = PEER) -> DecodeJob:
        return DecodeJob(self.ticket("decode", owner), session, 7, None)

    def batch(self, sizes: dict[str, int]) -> AtomicBatchJob:
        """An atomic batch: ``sizes[session]`` tokens per session, last one sampled."""
        entries = [BatchEntry(sid, list(range(10, 10 + n)), True, None) for sid, n in sizes.items()]
        return AtomicBatchJob(self.ticket("iteration"), entries, "iteration")

    def turn(self, n: int = 1) -> None:
        for _ in range(n):
            self.sched.turn()
            for ticket, output in self.outbox.take():
                self.outputs[ticket.id].append(output)

    def run(self, limit: int = 200) -> None:
        """Turn until no work is left (the limit catches a scheduler that stalls)."""
        for _ in range(limit):
            if not self.sched.has_work():
                return
            self.turn()
        raise AssertionError(f"scheduler still has work after {limit} turns")

    def run_chain(self, limit: int = 200) -> None:
        """Like ``run``, landing every launched forward at once."""
        assert isinstance(self.rt, FakeChainRuntime)
        for _ in range(limit):
            if not self.sched.has_work():
                return
            while self.rt.out:
                self.rt.deliver(0)
            self.turn()
        raise AssertionError(f"scheduler still has work after {limit} turns")

    def out(self, job: Job) -> list[Output]:
        return self.outputs[job.ticket.id]

    def result(self, job: Job) -> dict[str, Any]:
        """The data of the job's one successful reply."""
        (only,) = self.out(job)
        assert isinstance(only, Result), only
        return only.data

    def error(self, job: Job) -> BaseException:
        """The error of the job's failure (its last output)."""
        outputs = self.out(job)
        assert outputs, "job produced nothing"
        assert isinstance(outputs[-1], Failure), outputs[-1]
        return outputs[-1].error

    def done(self, job: Job) -> dict[str, Any]:
        """The final ``done`` event of a streaming generation."""
        outputs = self.out(job)
        assert outputs and isinstance(outputs[-1], Event) and outputs[-1].done, outputs
        return outputs[-1].data

    def tokens(self, job: Job) -> list[int]:
        """Token events a streaming generation sent."""
        return [o.data["token"] for o in self.out(job) if isinstance(o, Event) and not o.done]

    def session(self, job: Job) -> SessionId:
        return job.sessions[0]


# -- admission -----------------------------------------------------------------


def test_jobs_start_in_submit_order() -> None:
    h = Harness(lanes=3)
    jobs = [h.submit(h.generate()) for _ in range(3)]
    h.turn()
    assert h.sched.active == jobs
    assert [h.rt.lanes.require(h.session(j)).lane for j in jobs] == [0, 1, 2]


def test_waiting_generations_take_the_lane_in_submit_order() -> None:
    h = Harness(lanes=1)
    jobs = [h.submit(h.generate(max_tokens=3)) for _ in range(3)]
    h.run()
    spans = [h.rt.turns_with(h.session(j)) for j in jobs]
    # one at a time, in order: each starts after the previous one's last forward
    assert all(spans)
    assert spans[0][-1] < spans[1][0] and spans[1][-1] < spans[2][0]
    assert [h.done(j)["finish_reason"] for j in jobs] == ["length"] * 3


def test_second_job_on_a_busy_session_waits_for_the_first() -> None:
    h = Harness(lanes=2, max_batch_tokens=64, prefill_chunk=4)
    long = h.submit(h.prefill("s", 12))  # three chunks, three turns
    queued = h.submit(h.decode("s"))
    other = h.submit(h.decode("t"))
    h.turn()
    assert h.rt.sessions_of(0) == ["t", "s"]  # another session's decode is not held back
    assert h.result(other)["position"] == 1
    assert h.out(queued) == []
    h.turn(2)
    assert h.out(queued) == []  # the prefill ended this turn; the decode starts next
    assert h.result(long) == {"position": 12}
    h.turn()
    assert h.rt.calls[3] == [Row("s", (7,), True, False)]
    assert h.result(queued) == {"token": sampled_token(13), "position": 13}


def test_job_behind_a_waiting_generate_on_its_session_waits_too() -> None:
    h = Harness(lanes=1)
    h.submit(h.generate(max_tokens=3))  # holds the only lane for three turns
    waiting = h.submit(h.generate(session="n", max_tokens=2))
    behind = h.submit(h.decode("n"))  # needs no lane of its own once "n" exists
    h.turn()
    assert list(h.sched.pending) == [waiting, behind]
    assert h.out(behind) == []
    h.run()
    assert h.done(waiting)["finish_reason"] == "length"
    assert h.rt.turns_with("n") == [3, 4, 5]
    assert h.result(behind)["position"] == 3


def test_decode_on_a_new_session_without_a_free_lane_fails_lanes_busy() -> None:
    h = Harness(lanes=1)
    running = h.submit(h.generate(max_tokens=10))
    h.turn()
    refused = h.submit(h.decode("new"))
    h.turn()
    err = h.error(refused)
    assert isinstance(err, LanesBusy) and err.code == ErrorCode.LANES_BUSY
    assert h.rt.lanes.get("new") is None
    assert h.rt.turns_with("new") == []
    assert h.sched.active == [running]
    assert h.sched.stats.rejected == 1


def test_atomic_batch_needing_more_lanes_than_free_admits_nothing() -> None:
    h = Harness(lanes=3)
    h.rt.admit(["held"])
    refused = h.submit(h.batch({"held": 1, "a": 1, "b": 1, "c": 1}))  # 3 new, 2 free
    h.turn()
    err = h.error(refused)
    assert isinstance(err, LanesBusy) and err.code == ErrorCode.LANES_BUSY
    assert sorted(map(str, h.rt.lanes.sessions)) == ["held"]
    assert h.rt.lanes.free == 2
    assert h.rt.calls == []
    assert not h.sched.has_work()


def test_generate_waits_for_a_lane_instead_of_failing() -> None:
    h = Harness(lanes=1)
    first = h.submit(h.generate(max_tokens=3))
    second = h.submit(h.generate(max_tokens=2))
    h.turn(3)  # first: prefill + two decodes, then it ends and frees the lane
    assert h.done(first)["finish_reason"] == "length"
    assert h.out(second) == []
    assert list(h.sched.pending) == [second]
    assert h.rt.turns_with(h.session(second)) == []
    h.run()
    assert h.rt.turns_with(h.session(second)) == [3, 4]
    assert h.done(second)["finish_reason"] == "length"
    assert h.tokens(second) == [sampled_token(1), sampled_token(2)]


def test_lane_freed_during_admission_goes_to_the_earlier_waiting_generate() -> None:
    """A waiting generate is first in line for a lane; a later request must not
    take a lane that frees in the same admission pass (here by ``drop``)."""
    h = Harness(lanes=1)
    h.rt.admit(["idle"])  # an idle named session holds the only lane
    waiting = h.submit(h.generate())
    h.turn()
    assert list(h.sched.pending) == [waiting]
    h.submit(SessionOpJob(h.ticket("drop"), "idle", "drop"))
    later = h.submit(h.generate())
    h.run()
    assert h.rt.lanes.get("idle") is None
    first_turns = [h.rt.turns_with(h.session(j))[0] for j in (waiting, later)]
    assert first_turns[0] < first_turns[1], first_turns


# -- queue bound ---------------------------------------------------------------


def test_submit_refuses_when_queue_is_full_counting_free_lanes() -> None:
    h = Harness(lanes=2, max_queue=1)
    for _ in range(3):  # max_queue + 2 free lanes
        h.submit(h.generate(max_tokens=50))
    with pytest.raises(QueueFull) as caught:
        h.submit(h.generate())
    assert caught.value.code == ErrorCode.QUEUE_FULL
    assert isinstance(caught.value.retry_after_ms, int) and caught.value.retry_after_ms > 0
    assert len(h.sched.pending) == 3
    h.turn()  # two start and hold both lanes; one still waits
    assert len(h.sched.pending) == 1
    with pytest.raises(QueueFull):
        h.submit(h.generate())  # 1 waiting >= max_queue + 0 free lanes
    assert h.sched.stats.rejected == 2


# -- token budget --------------------------------------------------------------


def test_no_forward_exceeds_the_token_budget() -> None:
    h = Harness(lanes=8, max_batch_tokens=16, prefill_chunk=8)
    jobs: list[Job] = [
        h.generate(prompt_len=20, max_tokens=4),
        h.generate(prompt_len=13, max_tokens=4),
        h.prefill("p", 30),
        h.batch({"x": 5, "y": 5}),
        h.decode("d"),
        h.generate(prompt_len=9, max_tokens=6),
        h.batch({"z": 7}),
    ]
    for job in jobs:
        h.submit(job)
    h.run()
    assert all(job.ticket.finished for job in jobs)
    assert not any(isinstance(o, Failure) for job in jobs for o in h.out(job))
    # the budget was binding: the atomic z (7) did not fit beside d, x and y (11)
    assert h.rt.sessions_of(0) == ["d", "x", "y"] and "z" in h.rt.sessions_of(1)
    assert all(total <= 16 for total in h.rt.totals())
    assert all(len(row.tokens) <= 8 for call in h.rt.calls for row in call)


def test_long_prefill_is_split_into_chunks_across_turns() -> None:
    h = Harness(lanes=1, max_batch_tokens=64, prefill_chunk=4)
    job = h.submit(h.prefill("s", 10, sampled=True))
    h.turn(2)
    assert h.out(job) == []
    h.turn()
    assert [[len(r.tokens) for r in call] for call in h.rt.calls] == [[4], [4], [2]]
    assert [r.sample for call in h.rt.calls for r in call] == [False, False, True]
    assert h.result(job) == {"position": 10, "token": sampled_token(10)}


def test_prefill_pieces_fit_beside_decodes_and_are_not_cut_into_crumbs() -> None:
    # 2 decode rows + a 3-token piece fill a budget of 5.
    h = Harness(lanes=3, max_batch_tokens=5, prefill_chunk=3)
    streams = [h.submit(h.generate(max_tokens=10)) for _ in range(2)]
    h.turn()  # both prompts (1 token each); both streams now decode every turn
    h.submit(h.prefill("p", 12))
    h.turn(4)
    for call in h.rt.calls[1:]:
        assert [len(r.tokens) for r in call] == [1, 1, 3]
    assert all(h.tokens(s) for s in streams)
    # A piece larger than the room left would be cut below MIN_CUT: it waits.
    h = Harness(lanes=3, max_batch_tokens=5, prefill_chunk=4)
    for _ in range(2):
        h.submit(h.generate(max_tokens=10))
    h.turn()
    h.submit(h.prefill("p", 12))
    h.turn(2)
    assert all([len(r.tokens) for r in call] == [1, 1] for call in h.rt.calls[1:])


# -- batch order ---------------------------------------------------------------


def test_decode_rows_come_first_in_lane_order_every_turn() -> None:
    h = Harness(lanes=4, max_batch_tokens=64, prefill_chunk=8)
    h.rt.admit(["c", "b", "a"])  # lanes 0, 1, 2: lane order is c, b, a
    for sid in ("a", "b", "c"):  # submit (and active) order is a, b, c
        h.submit(h.generate(session=sid, max_tokens=6))
    h.turn()
    h.submit(h.prefill("p", 100))
    h.turn(4)
    for call in h.rt.calls[1:]:
        assert [r.session for r in call] == ["c", "b", "a", "p"]


class _Recording:
    """A drafter that drafts nothing and remembers the ``streams`` it was told."""

    def __init__(self) -> None:
        self.streams: list[int] = []

    def draft(self, session: Session, next_token: int, limit: int, streams: int = 1) -> list[int]:
        self.streams.append(streams)
        return []


def test_a_drafter_is_told_how_many_streams_its_forward_decodes() -> None:
    h = Harness(lanes=4, max_batch_tokens=64)
    drafters = [_Recording() for _ in range(3)]
    for i, drafter in enumerate(drafters):
        job = h.generate(session=f"s{i}", max_tokens=3 + 2 * i)
        job.drafter = drafter
        h.submit(job)
    h.run()
    # each decode turn: as many streams as are decoding (3, then 2, then 1)
    assert drafters[0].streams == [3, 3]
    assert drafters[1].streams == [3, 3, 2, 2]
    assert drafters[2].streams == [3, 3, 2, 2, 1, 1]


def test_a_turn_batches_decode_then_atomic_then_prefill() -> None:
    h = Harness(lanes=4, max_batch_tokens=64)
    h.rt.admit(["pre", "atom"])  # lanes 0 and 1, ahead of the stream's lane 2
    stream = h.submit(h.generate(max_tokens=10))
    h.turn()
    h.submit(h.prefill("pre", 3))
    atomic = h.submit(h.batch({"atom": 2}))
    h.submit(h.decode("dec"))  # lane 3, after everyone in lane order
    h.turn()
    assert h.rt.sessions_of(1) == [h.session(stream), "dec", "atom", "pre"]
    assert h.result(atomic)["positions"] == [2]


def test_the_prompt_closest_to_done_is_prefilled_first() -> None:
    """Shortest remaining prompt first: equal prompts go one after the other
    (the first started is closer to done), a shorter one overtakes both."""
    h = Harness(lanes=3, max_batch_tokens=64, prefill_chunk=4)
    h.submit(h.prefill("p1", 12))
    h.submit(h.prefill("p2", 12))
    h.turn(2)
    h.submit(h.prefill("short", 2))  # 2 left: fewer than p1's 4
    h.turn(5)
    order = [s for i in range(7) for s in h.rt.sessions_of(i)]
    assert order == ["p1", "p1", "short", "p1", "p2", "p2", "p2"], order


def test_while_prompts_wait_a_turn_carries_one_piece_beside_the_streams() -> None:
    """Each turn finishes the next prompt (and starts its stream) instead of
    carrying every prompt a little further; streams decode every turn."""
    h = Harness(lanes=6, max_batch_tokens=64, prefill_chunk=8)
    for _ in range(2):
        h.submit(h.generate(max_tokens=50))
    h.turn()  # two streams decode from now on
    gens = [h.submit(h.generate(prompt_len=8, max_tokens=50)) for _ in range(3)]
    h.turn(3)
    for i, gen in enumerate(gens, start=1):
        prefill = [r for r in h.rt.calls[i] if len(r.tokens) > 1]
        assert [len(r.tokens) for r in prefill] == [8]  # one prompt a turn ...
        assert h.tokens(gen)  # ... whose first token is out at once
        assert len(h.rt.calls[i]) == 2 + (i - 1) + 1  # beside every stream started so far


def test_a_prompt_that_waited_long_goes_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long prompt is not starved by short ones arriving all the time."""
    from worker.core import scheduler as sched_mod

    h = Harness(lanes=4, max_batch_tokens=64, prefill_chunk=4)
    long = h.submit(h.prefill("long", 40))
    h.turn()
    h.submit(h.prefill("s1", 4))
    h.turn()
    assert h.rt.sessions_of(1) == ["s1"]  # shorter first while the long one is young
    monkeypatch.setattr(sched_mod, "PREFILL_AGE_S", 0.0)
    h.submit(h.prefill("s2", 4))
    h.turn()
    assert h.rt.sessions_of(2) == ["long"]  # it has waited: it goes first
    assert not h.out(long)


# -- boost ---------------------------------------------------------------------


def test_atomic_batch_that_did_not_fit_goes_first_next_turn() -> None:
    h = Harness(lanes=2, max_batch_tokens=4)
    first = h.submit(h.batch({"a": 3}))
    starved = h.submit(h.batch({"b": 2}))  # 2 > the 1 token left this turn
    h.turn()
    assert h.rt.sessions_of(0) == ["a"]
    assert h.out(starved) == []
    again = h.submit(h.batch({"a": 3}))  # lane 0 would go before lane 1 by lane order
    h.turn()
    assert h.rt.sessions_of(1) == ["b"]  # and "a" (3) no longer fits behind it
    assert h.result(starved)["positions"] == [2]
    h.turn()
    assert h.rt.sessions_of(2) == ["a"]
    assert h.result(first)["positions"] == [3]
    assert h.result(again)["positions"] == [6]


def test_atomic_batch_goes_first_next_turn_after_budget_ran_out() -> None:
    """A batch skipped because the budget was used up exactly did not fit
    either: it must go first next turn, or a client pipelining full-budget
    batches on a lower lane starves it."""
    h = Harness(lanes=2, max_batch_tokens=4)
    h.submit(h.batch({"a": 4}))
    starved = h.submit(h.batch({"b": 1}))
    h.turn()
    assert h.rt.sessions_of(0) == ["a"]
    h.submit(h.batch({"a": 4}))
    h.turn()
    assert h.rt.sessions_of(1)[0] == "b"
    assert h.result(starved)["positions"] == [1]


def test_boosted_atomic_batch_goes_before_decode_rows() -> None:
    h = Harness(lanes=3, max_batch_tokens=4)
    stream = h.submit(h.generate(max_tokens=20))
    h.turn()
    h.submit(h.batch({"x": 2}))  # 1 + 2 fits
    starved = h.submit(h.batch({"y": 2}))  # 1 token left: does not fit
    h.turn()
    assert h.rt.sessions_of(1) == [h.session(stream), "x"]
    h.turn()
    assert h.rt.sessions_of(2) == ["y", h.session(stream)]
    assert h.result(starved)["positions"] == [2]


# -- cancel --------------------------------------------------------------------


def test_cancel_queued_job_fails_cancelled_and_never_runs() -> None:
    h = Harness(lanes=1)
    h.submit(h.generate(max_tokens=10))
    queued = h.submit(h.generate())
    h.turn()
    assert h.sched.cancel(PEER, queued.ticket.id)
    assert not h.sched.cancel(PEER, 999)
    h.turn()
    err = h.error(queued)
    assert isinstance(err, Cancelled) and err.code == ErrorCode.CANCELLED
    assert len(h.out(queued)) == 1
    assert queued not in h.sched.pending
    h.run()
    assert h.rt.turns_with(h.session(queued)) == []
    assert h.sched.stats.cancelled == 1


def test_cancel_running_generate_ends_stream_with_cancelled_done() -> None:
    h = Harness(lanes=2)
    job = h.submit(h.generate(max_tokens=50))
    other = h.submit(h.generate(max_tokens=50))
    h.turn(3)
    assert len(h.tokens(job)) == 3
    assert h.sched.cancel(PEER, job.ticket.id)
    h.turn()
    done = h.done(job)
    assert done["finish_reason"] == "cancelled"
    assert done["usage"]["completion_tokens"] == 3
    assert h.rt.sessions_of(3) == [h.session(other)]  # no row for the cancelled one
    assert h.sched.active == [other]
    assert h.rt.lanes.get(h.session(job)) is None


def test_cancel_owner_cancels_every_job_of_that_owner() -> None:
    h = Harness(lanes=2)
    running = h.submit(h.generate(max_tokens=50, owner=b"gone"))
    kept = h.submit(h.generate(max_tokens=5, owner=b"stays"))
    queued = h.submit(h.generate(owner=b"gone"))
    h.turn()
    assert h.sched.cancel_owner(b"gone") == 2
    h.turn()
    assert h.done(running)["finish_reason"] == "cancelled"
    assert isinstance(h.error(queued), Cancelled)
    assert h.sched.active == [kept]
    assert not h.sched.pending
    h.run()
    assert h.done(kept)["finish_reason"] == "length"
    assert h.rt.turns_with(h.session(queued)) == []


# -- deadlines -----------------------------------------------------------------


def test_expired_deadline_ends_queued_and_running_jobs() -> None:
    h = Harness(lanes=1)
    running = h.submit(h.generate(max_tokens=50))
    queued = h.submit(h.generate())
    queued.ticket.deadline = time.monotonic() + 3600
    h.turn(2)
    assert list(h.sched.pending) == [queued]
    running.ticket.deadline = time.monotonic() - 1
    queued.ticket.deadline = time.monotonic() - 1
    forwards = len(h.rt.calls)
    h.turn()
    assert isinstance(h.error(running), DeadlineExceeded)
    err = h.error(queued)
    assert isinstance(err, DeadlineExceeded) and err.code == ErrorCode.DEADLINE_EXCEEDED
    assert len(h.rt.calls) == forwards  # nothing ran for either
    assert not h.sched.has_work()
    assert h.rt.lanes.free == 1
    assert h.sched.stats.expired == 2


def test_admission_timeout_applies_to_jobs_waiting_for_a_lane() -> None:
    # The scheduler reads the real clock: jobs "waited" by moving their receipt
    # an hour back, and ``fresh`` has ten minutes before it would expire, so a
    # slow machine between its submit and the turn changes nothing.
    h = Harness(lanes=1, admission_timeout_ms=600_000)
    running = h.submit(h.generate(session="s", max_tokens=50))
    h.turn()
    running.ticket.received -= 3600  # running: admission is over for it
    late = h.submit(h.generate())
    late.ticket.received -= 3600
    fresh = h.submit(h.generate())
    behind = h.submit(h.decode("s"))  # waits for its session, not for a lane
    behind.ticket.received -= 3600
    h.turn()
    err = h.error(late)
    assert isinstance(err, DeadlineExceeded)
    assert h.out(fresh) == [] and h.out(behind) == []
    assert list(h.sched.pending) == [fresh, behind]
    assert h.sched.active == [running]
    assert h.rt.turns_with(h.session(late)) == []


# -- failures ------------------------------------------------------------------


def test_a_batch_that_fails_once_is_retried_job_by_job_and_nobody_fails() -> None:
    h = Harness(lanes=3, max_batch_tokens=4)
    stream = h.submit(h.generate(max_tokens=50))
    h.turn()
    in_turn = h.submit(h.batch({"x": 2}))
    left_out = h.submit(h.batch({"y": 2}))  # 1 + 2 + 2 > 4: not in this turn
    h.rt.fail_next = True
    h.turn()
    assert h.rt.sessions_of(1) == [h.session(stream), "x"]  # failed, nothing moved
    assert h.rt.sessions_of(2) == [h.session(stream)]  # then each job alone
    assert h.rt.sessions_of(3) == ["x"]
    assert h.result(in_turn)["positions"] == [2]
    assert h.out(left_out) == []
    h.turn()
    assert set(h.rt.sessions_of(4)) == {h.session(stream), "y"}
    assert h.result(left_out)["positions"] == [2]
    h.run()
    assert h.done(stream)["finish_reason"] == "length"


def test_a_failed_batch_is_retried_job_by_job_so_only_the_culprit_fails() -> None:
    h = Harness(lanes=4, max_batch_tokens=8)
    stream = h.submit(h.generate(max_tokens=6))
    h.turn()
    culprit = h.submit(h.batch({"x": 3}))
    bystander = h.submit(h.batch({"y": 2}))
    h.rt.cannot_fit = "x"
    h.turn()
    # one forward of all three failed; then each job ran alone
    assert h.rt.sessions_of(1) == [h.session(stream), "x", "y"]
    assert h.rt.sessions_of(2) == [h.session(stream)]
    assert h.rt.sessions_of(3) == ["x"]
    assert h.rt.sessions_of(4) == ["y"]
    assert isinstance(h.error(culprit), EngineFault)
    assert h.result(bystander)["positions"] == [2]
    h.run()
    assert h.done(stream)["finish_reason"] == "length"
    assert h.rt.lanes.get("y") is not None and h.rt.lanes.get("y").position == 2


def test_a_job_whose_kv_moved_in_a_failed_batch_fails_with_it() -> None:
    h = Harness(lanes=3, max_batch_tokens=8)
    moved = h.submit(h.batch({"m": 2}))
    culprit = h.submit(h.batch({"x": 3}))
    h.rt.cannot_fit = "x"
    h.rt.advance_on_failure = {"m": 2}
    h.turn()
    assert isinstance(h.error(moved), EngineFault)  # its progress is the runtime's now
    assert isinstance(h.error(culprit), EngineFault)
    assert h.rt.sessions_of(1) == ["x"]  # only the culprit was tried alone


def test_sampling_error_of_one_step_fails_only_its_job() -> None:
    h = Harness(lanes=2)
    bad = h.submit(h.decode("bad"))
    good = h.submit(h.decode("good"))
    h.rt.step_error = "bad"
    h.turn()
    assert h.rt.sessions_of(0) == ["bad", "good"]
    assert isinstance(h.error(bad), BadRequest)
    assert h.result(good) == {"token": sampled_token(1), "position": 1}
    assert not h.sched.has_work()


def test_scheduler_keeps_working_after_a_failed_forward() -> None:
    h = Harness(lanes=1)
    h.rt.fail_next = True
    broken = h.submit(h.generate(max_tokens=3))
    h.turn()
    assert isinstance(h.error(broken), EngineFault)
    later = h.submit(h.generate(max_tokens=3))
    h.run()
    assert h.done(later)["finish_reason"] == "length"
    assert h.rt.lanes.free == 1


# -- ephemeral sessions --------------------------------------------------------


def test_ephemeral_session_is_dropped_when_its_job_ends() -> None:
    h = Harness(lanes=3)
    finishes = h.submit(h.generate(max_tokens=2))
    cancelled = h.submit(h.generate(max_tokens=50))
    named = h.submit(h.generate(session="keep", max_tokens=2))
    h.turn()
    assert h.rt.lanes.free == 0
    h.sched.cancel(PEER, cancelled.ticket.id)
    h.run()
    assert h.done(finishes)["finish_reason"] == "length"
    assert h.done(cancelled)["finish_reason"] == "cancelled"
    assert h.done(named)["finish_reason"] == "length"
    assert [str(s) for s in h.rt.lanes.sessions] == ["keep"]  # a named session stays
    assert h.rt.lanes.require("keep").pending == [sampled_token(2)]
    assert h.rt.lanes.free == 2


def test_ephemeral_session_is_dropped_when_start_fails() -> None:
    h = Harness(lanes=1, ctx=8)
    too_long = h.submit(h.generate(prompt_len=9))
    h.turn()
    assert isinstance(h.error(too_long), ContextOverflow)
    assert h.rt.lanes.free == 1
    assert h.rt.calls == []


# -- cadence: turns budgeted by time -------------------------------------------------


def test_turn_clock_learns_decode_and_prefill_costs() -> None:
    clock = TurnClock()
    assert clock.prefill_allowance(2.5) is None  # nothing measured yet: no time limit
    clock.record(decode_rows=8, prefill_tokens=0, ms=80.0)
    clock.record(decode_rows=8, prefill_tokens=30, ms=200.0)  # 30 tokens added 120 ms
    assert clock.decode_ms == 80.0 and clock.prefill_ms_per_token == 4.0
    assert clock.prefill_allowance(2.5) == 30  # (2.5 - 1) x 80 ms / 4 ms
    assert clock.prefill_allowance(0) is None  # cadence off
    clock.prefill_ms_per_token = 1000.0
    assert clock.prefill_allowance(2.5) == 16  # never below MIN_CUT: prompts always progress


def test_prefill_is_cut_to_the_time_left_while_streams_decode() -> None:
    h = Harness(lanes=3, max_batch_tokens=512, prefill_chunk=256, cadence=2.5)
    h.submit(h.generate(max_tokens=50))
    h.turn()  # the stream is decoding from now on
    h.sched.outcomes.clock.decode_ms, h.sched.outcomes.clock.prefill_ms_per_token = 80.0, 4.0
    h.sched.outcomes.clock.record = lambda *a: None  # type: ignore[method-assign]  # keep the costs fixed
    h.submit(h.prefill("p", 100))
    h.turn(3)
    sizes = [[len(r.tokens) for r in call] for call in h.rt.calls[1:4]]
    assert sizes == [[1, 30], [1, 30], [1, 30]]
    # Without streams, the prompt's piece is taken whole.
    h = Harness(lanes=3, max_batch_tokens=512, prefill_chunk=256, cadence=2.5)
    h.sched.outcomes.clock.decode_ms, h.sched.outcomes.clock.prefill_ms_per_token = 80.0, 4.0
    h.submit(h.prefill("p", 100))
    h.turn()
    assert [len(r.tokens) for r in h.rt.calls[0]] == [100]


# -- a pipeline stage: forwards in flight down the chain ------------------------


def chain_harness(
    lanes: int = 3, credit: int = 2, groups: int = 1
) -> tuple[Harness, FakeChainRuntime]:
    h = Harness(lanes=lanes, chained=True, chain_credit=credit, pipeline_groups=groups)
    assert isinstance(h.rt, FakeChainRuntime)
    return h, h.rt


def test_stage_launches_other_jobs_while_a_forward_is_down_the_chain() -> None:
    h, rt = chain_harness()
    a = h.submit(h.generate(max_tokens=5))
    h.turn()
    b = h.submit(h.generate(max_tokens=5))
    h.turn()
    # a is in flight: the second launch holds b alone instead of waiting for a
    assert [h.rt.sessions_of(i) for i in range(2)] == [[h.session(a)], [h.session(b)]]
    assert h.tokens(a) == [] and h.tokens(b) == []
    rt.deliver(0)
    h.turn()  # a lands: its first token goes out ...
    assert len(h.tokens(a)) == 1 and h.tokens(b) == []
    assert len(rt.calls) == 2  # ... and its decode waits to rejoin b, still in flight
    rt.deliver(0)
    h.turn()
    # one batch again: streams never drift into two half-size batches
    assert h.rt.sessions_of(2) == [h.session(a), h.session(b)]
    assert len(h.tokens(b)) == 1


def test_pipeline_groups_split_the_streams_into_groups_that_take_turns() -> None:
    """Stages on separate hosts: with 2 groups, 8 streams travel as two
    forwards of 4 that alternate, so each stage computes while the other does."""
    h, rt = chain_harness(lanes=8, groups=2)
    jobs = [h.submit(h.generate(max_tokens=6)) for _ in range(8)]
    h.turn()  # the prompts start together: one launch
    assert len(rt.out) == 1 and len(rt.calls[0]) == 8
    rt.deliver(0)
    h.turn()  # home: every stream decodes; the first group goes ...
    h.turn()  # ... and the second right behind it, while the first is down the chain
    assert [len(c) for c in rt.calls[1:]] == [4, 4]
    first, second = (set(rt.sessions_of(i)) for i in (1, 2))
    assert not first & second
    for _ in range(8):  # steady state: whichever lands goes out again, alone
        rt.deliver(0)
        h.turn()
        assert len(rt.out) == 2 and set(rt.sessions_of(len(rt.calls) - 1)) in (first, second)
    assert all(len(h.tokens(j)) >= 4 for j in jobs)


def test_pipeline_groups_take_what_is_there_and_never_exceed_their_credit() -> None:
    h, rt = chain_harness(lanes=4, credit=1, groups=2)  # the credit is at least the groups
    one = h.submit(h.generate(max_tokens=4))
    h.turn()
    rt.deliver(0)
    h.turn()
    assert len(rt.calls[-1]) == 1  # one stream cannot be split: it goes alone
    others = [h.submit(h.generate(max_tokens=4)) for _ in range(2)]
    h.turn()  # new prompts overlap the stream in flight: credit 2, not 1
    assert len(rt.out) == 2
    h.turn()
    assert len(rt.out) == 2 and rt.land_waits[-1] > 0  # out of credit: it waits
    assert h.tokens(one) and not any(h.tokens(j) for j in others)


def test_stage_never_has_more_forwards_in_flight_than_its_credit() -> None:
    h, rt = chain_harness(credit=2)
    jobs = [h.submit(h.generate(max_tokens=5)) for _ in range(3)]
    h.turn()  # all three start together: one launch
    assert len(rt.out) == 1 and len(rt.calls[0]) == 3
    h.turn()  # every job is in flight: nothing to launch, the stage waits
    assert len(rt.out) == 1 and rt.land_waits[-1] > 0
    h2, rt2 = chain_harness(credit=2)
    for _ in range(3):
        h2.submit(h2.generate(max_tokens=5))
        h2.turn()
    assert len(rt2.out) == 2  # the third waits for credit
    assert rt2.land_waits[-1] > 0
    rt2.deliver(0)
    h2.turn()
    assert len(rt2.out) == 2 and not any(h.out(j) for j in jobs)


def test_a_failed_flight_fails_its_jobs_only() -> None:
    h, rt = chain_harness()
    a = h.submit(h.generate(max_tokens=5))
    h.turn()
    b = h.submit(h.generate(max_tokens=5))
    h.turn()
    rt.deliver(0, EngineFault("next stage: gone", {}))
    h.turn()
    assert isinstance(h.error(a), EngineFault)
    assert h.out(b) == [] and h.sched.active == [b]
    rt.deliver(0)
    h.run_chain()
    assert len(h.tokens(b)) == 5 and h.done(b)["finish_reason"] == "length"


def test_cancel_of_a_job_in_flight_waits_for_its_forward_to_land() -> None:
    h, rt = chain_harness()
    job = h.submit(h.generate(max_tokens=50))
    h.turn()
    assert h.sched.cancel(PEER, job.ticket.id)
    h.turn()
    assert h.out(job) == [] and h.sched.active == [job]  # its rows are still downstream
    rt.deliver(0)
    h.turn()
    assert h.done(job)["finish_reason"] == "cancelled"
    assert not h.sched.has_work() and rt.out == []


# -- a pipeline stage: session ops and other requests down the chain -------------------


def test_a_drop_waits_for_the_chain_while_other_sessions_run_and_its_own_queue_up() -> None:
    h, rt = chain_harness()
    h.submit(h.prefill("s", 4))
    h.run_chain()
    drop = h.submit(SessionOpJob(h.ticket("drop"), "s", "drop"))
    h.turn()
    assert h.out(drop) == [] and "s" not in rt.lanes.sessions  # dropped here, asked below
    again = h.submit(h.prefill("s", 3))  # the same session: waits behind the drop
    other = h.submit(h.generate("g", max_tokens=2))
    for _ in range(6):
        while rt.out:
            rt.deliver(0)
        h.turn()
    assert len(h.tokens(other)) == 2  # another session ran its whole stream meanwhile
    assert h.out(drop) == [] and h.out(again) == []
    assert "s" not in rt.turns_with_after(1)
    rt.answer("drop")
    h.run_chain()
    assert h.result(drop) == {} and h.result(again)["position"] == 3


def test_a_failed_answer_fails_its_job_with_the_chains_error() -> None:
    h, rt = chain_harness()
    h.submit(h.prefill("s", 4))
    h.run_chain()
    trim = h.submit(SessionOpJob(h.ticket("trim"), "s", "trim", 2))
    h.turn()
    rt.answer("trim", StageUnavailable("the next stage did not answer trim"))
    h.turn()
    assert isinstance(h.error(trim), StageUnavailable)
    assert not h.sched.has_work() and rt.lanes.get("s") is not None  # trimmed here, as before


def test_a_job_waiting_for_the_chain_is_reaped_only_once_its_answer_lands() -> None:
    h, rt = chain_harness()
    h.submit(h.prefill("s", 4))
    h.run_chain()
    trim = h.submit(SessionOpJob(h.ticket("trim"), "s", "trim", 2))
    h.turn()
    assert h.sched.cancel(PEER, trim.ticket.id)
    h.turn(3)
    assert h.out(trim) == [] and h.sched.active == [trim]  # the trim is down the chain
    rt.answer("trim")
    h.turn()
    assert h.result(trim) == {"position": 2}  # it happened: the reply says so
    assert not h.sched.has_work()


class TrimmingJob(Job):
    """Feeds ``n`` tokens one a turn, trimming the session back by one after
    the second (as speculative decoding drops rejected drafts)."""

    def __init__(self, ticket: Ticket, session: str, n: int) -> None:
        super().__init__(ticket, [session])
        self.left, self.session_ = n, None

    def start(self, rt: Any) -> bool:
        (self.session_,) = rt.admit(self.sessions)
        return False

    def plan(self, rt: Any, budget: int) -> list[Step]:
        return [Step(self.session_, [5, 6])]

    def advance(self, rt: Any, results: list[StepResult]) -> bool:
        rt.trim(self.sessions[0], self.session_.position - 1)
        self.left -= 1
        if self.left:
            return False
        return self.after_chain(rt, lambda: self.ticket.reply({"at": self.session_.position}))


def test_a_running_job_sits_out_planning_until_its_trim_lands() -> None:
    h, rt = chain_harness()
    job = h.submit(TrimmingJob(h.ticket("generate"), "t", 2))
    h.turn()
    rt.deliver(0)
    h.turn()  # lands: the job trims, which goes down the chain ...
    h.turn(2)
    assert rt.turns_with("t") == [0]  # ... and no forward of it goes before the answer
    rt.answer("trim")
    h.turn()
    assert rt.turns_with("t") == [0, 1]
    rt.deliver(0)
    h.turn()
    assert h.out(job) == []  # the last trim is still down the chain: no reply yet
    rt.answer("trim")
    h.turn()
    assert h.result(job) == {"at": 2}


def test_info_is_a_job_a_full_queue_does_not_refuse() -> None:
    h, rt = chain_harness(lanes=1)
    h.cfg = SchedulerConfig(max_queue=0)
    h.sched.cfg = h.cfg
    h.submit(h.generate("busy", max_tokens=5))
    with pytest.raises(QueueFull):
        h.submit(h.generate("more", max_tokens=5))

    def compose(rest: Any) -> dict[str, Any]:
        return {"rest": rest}

    info = h.submit(InfoJob(h.ticket("info"), compose))
    h.turn()
    assert h.out(info) == []
    rt.answer("info", chain=[{"layers": [9, 18]}])
    h.turn()
    assert h.result(info) == {"rest": {"chain": [{"layers": [9, 18]}]}}


# -- exclusive turns (media decoded with non-causal attention) -------------------------


class ExclusiveJob(Job):
    """``n`` steps that must each be the only work of their forward (as a
    media item is: llama.cpp's non-causal attention covers the whole batch)."""

    phase = PHASE_PREFILL

    def __init__(self, ticket: Ticket, session: str, n: int = 2) -> None:
        super().__init__(ticket, [session])
        self.left = n
        self.session: Session | None = None

    def start(self, rt: Any) -> bool:
        (self.session,) = rt.admit(self.sessions)
        return False

    def wants_exclusive(self) -> bool:
        return self.left > 0

    def plan(self, rt: Any, budget: int) -> list[Step]:
        assert self.session is not None
        return [Step(self.session, [5, 5, 5])]

    def advance(self, rt: Any, results: list[StepResult]) -> bool:
        self.left -= 1
        if self.left:
            return False
        self.ticket.reply({})
        return True


def test_an_exclusive_step_runs_alone_and_streams_keep_every_other_turn() -> None:
    h = Harness(lanes=4, prefill_chunk=32)
    g = h.submit(h.generate("g", max_tokens=8))
    p = h.submit(h.prefill("p", 200))
    h.turn(2)
    x = h.submit(ExclusiveJob(h.ticket("prefill_media"), "x"))
    y = h.submit(ExclusiveJob(h.ticket("prefill_media"), "y", n=1))
    h.run()
    alone = [t for t in range(len(h.rt.calls)) if set(h.rt.sessions_of(t)) & {"x", "y"}]
    assert len(alone) == 3
    assert all(len(h.rt.sessions_of(t)) == 1 for t in alone)  # nothing else in their forward
    assert all(b - a == 2 for a, b in itertools.pairwise(alone))  # an ordinary turn between
    assert h.result(x) == h.result(y) == {}
    assert len(h.tokens(g)) == 8 and h.result(p)["position"] == 200


def test_an_exclusive_job_that_fails_to_plan_fails_alone() -> None:
    class Broken(ExclusiveJob):
        def plan(self, rt: Any, budget: int) -> list[Step]:
            raise BadRequest("the projector could not encode")

    h = Harness(lanes=2)
    g = h.submit(h.generate("g", max_tokens=3))
    b = h.submit(Broken(h.ticket("prefill_media"), "b"))
    h.run()
    assert isinstance(h.error(b), BadRequest)
    assert len(h.tokens(g)) == 3


def test_a_job_whose_plan_raises_fails_alone_and_the_loop_goes_on() -> None:
    h = Harness(lanes=2)
    broken = h.submit(h.decode("bad"))
    good = h.submit(h.decode("good"))

    def explode(rt: Any, budget: int) -> list[Step]:
        raise RuntimeError("a bug in plan")

    broken.plan = explode  # type: ignore[method-assign]
    h.turn()
    assert isinstance(h.error(broken), RuntimeError)
    assert h.result(good)["position"] == 1
    assert not h.sched.has_work()
