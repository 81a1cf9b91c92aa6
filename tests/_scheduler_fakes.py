"""A fake runtime under ``worker.scheduler``, for the tests of its policy.

No model and no sockets: ``FakeRuntime`` keeps real ``LanePool`` bookkeeping,
moves positions like ``RuntimeState.forward`` does, samples a token that is a
function of the position, and records every forward so the tests can read
the batch composition and order of each turn. ``FakeChainRuntime`` is a
pipeline stage whose forwards and requests down the chain land when the test
says; ``Harness`` is a scheduler over either, with job builders and the
outputs it collected (the test_scheduler_* modules, and test_limits_units).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from faults import BadRequest, ContextOverflow, EngineFault
from worker.core.jobs.base import Event, Failure, Job, Outbox, Output, Result, Ticket
from worker.core.jobs.batch import AtomicBatchJob, BatchEntry
from worker.core.jobs.generate import GenerateJob
from worker.core.jobs.session import DecodeJob, PrefillJob
from worker.core.scheduler import Scheduler, SchedulerConfig
from worker.runtime import Call, Ephemeral, Flight, LanePool, Session, SessionId, Step, StepResult
from worker.runtime.tail import Answer
from worker.spec import SamplerSpec

J = TypeVar("J", bound=Job)
EOG = 2  # the fake's end-of-generation token; sampled tokens are never this
PEER = b"peer"


def sampled_token(position: int) -> int:
    """The token the fake samples once a session reaches ``position``."""
    return 1000 + position


class FakeEngine:
    n_layer = 4
    kv_unified = False  # a KV stream per lane, as the engine's default

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
