"""A pipeline stage that does not hold the model's last layer: its forwards
and its other requests down the chain.

The stage runs its own layers over the steps' tokens (or input rows), its
engine's layer tap capturing the output of its last layer for every row and
stopping the graph there; the rows go to the ``Tail`` (the next stage),
which runs the rest, samples with the sessions' samplers (they live where
the logits are) and returns tokens and any asked outputs. Positions and
token histories are then accounted here exactly as for a local forward.

Session ops, queries, state moves and ``info`` go down the chain the same
way (``ask``): sent at once, kept as a ``Call`` until their answer lands
with the forwards (``land``), so no turn waits on the network. Their order
needs no waiting: one connection delivers them in order and every stage
runs a session's requests in arrival order; the scheduler keeps a job whose
sessions have a ``Call`` out of its forwards until the answer lands, so a
failure downstream still fails the job that caused it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from faults import BadRequest, EngineFault, Fault, StageUnavailable

from ..engine import Engine, Segment
from ..spec import spec_to_wire
from .lanes import Session, SessionId
from .steps import Step, StepResult, group_steps
from .tail import Answer, Landed, Tail, TailResult, TailStep


class ChainHost(Protocol):
    """What a chained forward uses of ``RuntimeState`` (kept apart so this
    module and ``state`` do not import each other)."""

    engine: Engine
    tail: Tail | None
    tap_layer: int | None
    forwards: int
    tokens_evaluated: int
    flights: dict[int, Flight]  # tail ticket -> its forward in flight
    asked: dict[int, Call]  # tail ticket -> another request down the chain

    def reconcile_after_failure(self, steps: Sequence[Step], why: str) -> None: ...

    def check_position(self, session: Session) -> None: ...

    def ensure_room(self, session: Session, n_tokens: int) -> None: ...


def launch_chain(rt: ChainHost, steps: Sequence[Step]) -> int:
    """Run this stage's layers over the steps and send the rows on; returns
    the tail's ticket. The sessions' positions move now (the local cells
    hold the steps), so the next forward can be planned before this one
    comes home; ``land_chain`` finishes the steps when it does."""
    assert rt.tail is not None and rt.tap_layer is not None
    segments = [
        Segment(s.session.lane, s.tokens, s.session.position, "none", s.embd) for s in steps
    ]
    rt.engine.set_hidden(False)
    # An image's rows (stage 0 with --mmproj) attend both ways here and on
    # every later stage; group_steps keeps them in a forward of their own.
    non_causal = any(s.non_causal for s in steps)
    status = rt.engine.decode(segments, causal=not non_causal)
    rt.forwards += 1
    if not status.ok:
        rt.reconcile_after_failure(steps, status.describe())
    taps = rt.engine.take_taps()
    hidden = taps.get(rt.tap_layer)
    total = sum(len(s.tokens) for s in steps)
    if hidden is None or hidden.shape[0] != total:
        rows = None if hidden is None else hidden.shape[0]
        raise EngineFault(f"the layer tap captured {rows} rows for {total} tokens", {})
    requests = [
        TailStep(
            session=str(s.session.id),
            tokens=[int(t) for t in s.tokens],
            position=s.session.position,
            sample=s.sample,
            sampling=spec_to_wire(s.spec) if s.spec is not None and not s.spec.greedy else None,
            outputs=s.outputs,
            capture_all=s.capture_all,
            top_logprobs=s.top_logprobs,
            all_rows=s.all_rows,
            rule=s.rule,
            origin=s.origin,
            non_causal=s.non_causal,
        )
        for s in steps
    ]
    # The local cells hold the steps now: account for them before asking
    # downstream, so a failure there leaves this stage consistent with itself.
    for step in steps:
        session = step.session
        session.position += len(step.tokens)
        session.tokens.extend(step.tokens)
        session.last_used = time.monotonic()
        rt.tokens_evaluated += len(step.tokens)
    for step in steps:
        rt.check_position(step.session)
    return rt.tail.send(requests, np.ascontiguousarray(hidden, dtype=np.float32))


def land_chain(
    rt: ChainHost, steps: Sequence[Step], replies: Sequence[TailResult]
) -> list[StepResult]:
    """The steps' results from what the rest of the chain sent back."""
    results: list[StepResult] = []
    for step, reply in zip(steps, replies, strict=True):
        result = StepResult(token=reply.token, logprobs=reply.logprobs)
        result.row_tokens, result.row_logprobs = reply.row_tokens, reply.row_logprobs
        if reply.row_tokens:
            step.session.last_token = reply.row_tokens[-1]
        if reply.error is not None:
            result.error = BadRequest(reply.error)
        result.logits = reply.parts.get("logits")
        result.hidden = reply.parts.get("hidden")
        if reply.token is not None:
            step.session.last_token = reply.token
        results.append(result)
    return results


@dataclass
class Flight:
    """One scheduler forward on its way through the chain.

    A forward of several ``Step.group``s is one chain request per group;
    the flight lands when all of them have, with ``results`` (in the order
    of ``steps``) or the first ``fault``.
    """

    steps: list[Step]
    parts: dict[int, list[int]] = field(default_factory=dict)  # ticket -> step indices
    outcomes: dict[int, Landed] = field(default_factory=dict)
    results: list[StepResult] = field(default_factory=list)
    fault: Fault | None = None

    @property
    def complete(self) -> bool:
        return len(self.outcomes) == len(self.parts)

    def finish(self, rt: ChainHost) -> None:
        faults = [o for o in self.outcomes.values() if isinstance(o, Fault)]
        if faults:
            self.fault = faults[0]
            return
        results: list[StepResult] = [StepResult() for _ in self.steps]
        for ticket, indices in self.parts.items():
            replies = self.outcomes[ticket]
            assert not isinstance(replies, Fault)
            part = [self.steps[i] for i in indices]
            for i, result in zip(indices, land_chain(rt, part, replies), strict=True):
                results[i] = result
        self.results = results


@dataclass(eq=False)
class Call:
    """A request down the chain that is not a forward (``trim``, ``drop``,
    ``signal``, ``export_state``, ``import_state``, ``info``), from the send
    until its ``answer`` or ``fault`` lands."""

    op: str
    session: SessionId | None  # the session it is about (None: ``info``)
    answer: Answer | None = None
    fault: Fault | None = None

    @property
    def done(self) -> bool:
        return self.answer is not None or self.fault is not None

    @property
    def result(self) -> dict[str, Any]:
        return self.answer.result if self.answer is not None else {}


def ask(rt: ChainHost, op: str, session: SessionId | None, send: Callable[[Tail], int]) -> Call:
    """Send a request down the chain (``send`` does, on the tail) without
    waiting; the ``Call`` lands through ``land``. ``send`` raising (the next
    stage not connected) leaves nothing outstanding."""
    assert rt.tail is not None
    ticket = send(rt.tail)
    call = Call(op, session)
    rt.asked[ticket] = call
    return call


def launch(rt: ChainHost, steps: Sequence[Step]) -> Flight:
    """Run this stage's layers over ``steps`` and send them down the chain
    without waiting; ``land`` returns the flight when it comes home."""
    assert rt.tail is not None
    for step in steps:
        rt.ensure_room(step.session, len(step.tokens))
    flight = Flight(list(steps))
    try:
        for indices in group_steps(steps).values():
            ticket = launch_chain(rt, [steps[i] for i in indices])
            flight.parts[ticket] = indices
            rt.flights[ticket] = flight
    except BaseException:
        for ticket in flight.parts:
            rt.flights.pop(ticket, None)
        raise
    return flight


def land(rt: ChainHost, timeout_ms: int) -> list[Flight | Call]:
    """Flights (``results`` or ``fault`` set) and calls (``answer`` or
    ``fault``) that came home, waiting up to ``timeout_ms`` for the first
    when none has."""
    if rt.tail is None or not (rt.flights or rt.asked):
        return []
    done: list[Flight | Call] = []
    for ticket, outcome in rt.tail.poll(timeout_ms).items():
        call = rt.asked.pop(ticket, None)
        if call is not None:
            if isinstance(outcome, Fault):
                call.fault = outcome
            elif isinstance(outcome, Answer):
                call.answer = outcome
            else:
                call.fault = StageUnavailable(f"the next stage answered {call.op} as a forward")
            done.append(call)
            continue
        flight = rt.flights.pop(ticket, None)
        if flight is None:
            continue  # a part of a flight whose launch failed
        if isinstance(outcome, Answer):
            outcome = StageUnavailable("the next stage answered a forward as another request")
        flight.outcomes[ticket] = outcome
        if flight.complete:
            flight.finish(rt)
            done.append(flight)
    return done
