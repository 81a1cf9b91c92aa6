"""Exclusive turns (on the fakes of ``_scheduler_fakes``): a step that must be
the only work of its forward (media decoded with non-causal attention), and
jobs whose plan fails, which fail alone.
"""

from __future__ import annotations

import itertools
from typing import Any

from _scheduler_fakes import Harness

from faults import BadRequest
from worker.core.jobs.base import PHASE_PREFILL, Job, Ticket
from worker.runtime import Session, Step, StepResult

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
