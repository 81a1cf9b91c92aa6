"""One forward of a pipeline stage that does not hold the model's last layer.

The stage runs its own layers over the steps' tokens (or input rows), its
engine's layer tap capturing the output of its last layer for every row and
stopping the graph there; the rows go to the ``Tail`` (the next stage),
which runs the rest, samples with the sessions' samplers (they live where
the logits are) and returns tokens and any asked outputs. Positions and
token histories are then accounted here exactly as for a local forward.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from faults import BadRequest, EngineFault

from ..engine import Engine, Segment
from ..spec import spec_to_wire
from .lanes import Session
from .steps import Step, StepResult
from .tail import Tail, TailStep


class ChainHost(Protocol):
    """What a chained forward uses of ``RuntimeState`` (kept apart so this
    module and ``state`` do not import each other)."""

    engine: Engine
    tail: Tail | None
    tap_layer: int | None
    forwards: int
    tokens_evaluated: int

    def reconcile_after_failure(self, steps: Sequence[Step], why: str) -> None: ...

    def check_position(self, session: Session) -> None: ...


def forward_chain(rt: ChainHost, steps: Sequence[Step]) -> list[StepResult]:
    assert rt.tail is not None and rt.tap_layer is not None
    segments = [
        Segment(s.session.lane, s.tokens, s.session.position, "none", s.embd) for s in steps
    ]
    rt.engine.set_hidden(False)
    status = rt.engine.decode(segments)
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
    replies = rt.tail.forward(requests, np.ascontiguousarray(hidden, dtype=np.float32))
    results: list[StepResult] = []
    for step, reply in zip(steps, replies, strict=True):
        result = StepResult(token=reply.token, logprobs=reply.logprobs)
        if reply.error is not None:
            result.error = BadRequest(reply.error)
        result.logits = reply.parts.get("logits")
        result.hidden = reply.parts.get("hidden")
        if reply.token is not None:
            step.session.last_token = reply.token
        results.append(result)
    for step in steps:
        rt.check_position(step.session)
    return results
