"""The scheduler of a pipeline stage (on ``FakeChainRuntime``): forwards in
flight down the chain within the stage's credit, pipeline groups, and session
ops and other requests that wait for the chain's answer.
"""

from __future__ import annotations

from typing import Any

import pytest
from _scheduler_fakes import PEER, FakeChainRuntime, Harness

from faults import EngineFault, QueueFull, StageUnavailable
from worker.core.jobs.base import Job, Ticket
from worker.core.jobs.session import InfoJob, SessionOpJob
from worker.core.scheduler import SchedulerConfig
from worker.runtime import Step, StepResult

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
