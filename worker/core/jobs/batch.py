"""Atomic batch jobs: several sessions in one forward, all or nothing.

``decode_batch`` and ``iteration_batch`` name many sessions at once; every
entry is admitted and checked before anything runs, and the whole batch goes
into one forward (``PHASE_ATOMIC``) or waits for a turn with room for all of
it. Kept apart from ``session.py`` (the single-session jobs: prefill,
decode, session ops, verify) because its admission and its reply span many
sessions, which no other job's do.
"""

from __future__ import annotations

from typing import Any

from faults import BadRequest, ContextOverflow, LanesBusy

from ...runtime import RuntimeState, Session, Step, StepResult
from ...spec import SamplerSpec
from .base import PHASE_ATOMIC, Job, Ticket
from .session import tensors_of


class BatchEntry:
    """One session's part of an atomic batch (decode_batch / iteration_batch)."""

    __slots__ = ("sample", "session_id", "spec", "tokens")

    def __init__(
        self, session_id: str, tokens: list[int], sample: bool, spec: SamplerSpec | None
    ) -> None:
        self.session_id = session_id
        self.tokens = tokens
        self.sample = sample
        self.spec = spec


class AtomicBatchJob(Job):
    """Several sessions in ONE forward; all admitted before anything runs.

    ``decode_batch`` is the special case of one token per session with a
    sample each; ``iteration_batch`` mixes prefill and decode entries.
    """

    phase = PHASE_ATOMIC
    atomic = True

    def __init__(
        self,
        ticket: Ticket,
        entries: list[BatchEntry],
        label: str,
        outputs: tuple[str, ...] = (),
        start_positions: dict[int, int] | None = None,
    ) -> None:
        super().__init__(ticket, [e.session_id for e in entries])
        self.entries = entries
        self.label = label
        self.outputs = outputs
        self.start_positions = start_positions or {}
        self.bound: list[Session] = []

    def start(self, rt: RuntimeState) -> bool:
        need, room = rt.lanes_for(self.sessions)
        if need > room:
            raise LanesBusy(
                f"{self.label} requires {need} new sessions but only "
                f"{room} execution lanes are available"
            )
        # Check every precondition before admitting anyone, so a refused
        # request leaves no half-admitted sessions behind.
        for index, entry in enumerate(self.entries):
            known = rt.known(entry.session_id)
            position = known.position if known else 0
            want = self.start_positions.get(index)
            if want is not None and want != position:
                raise BadRequest(
                    f"requests[{index}].positions start at {want} but session "
                    f"{entry.session_id!r} is at {position}"
                )
            if position + len(entry.tokens) > rt.ctx_per_lane:
                raise ContextOverflow(
                    f"requests[{index}] would take session {entry.session_id!r} past "
                    f"its {rt.ctx_per_lane} context cells"
                )
        self.bound = rt.admit(self.sessions)
        return False

    def size(self) -> int:
        return sum(len(e.tokens) for e in self.entries)

    def plan(self, rt: RuntimeState, budget: int) -> list[Step]:
        if self.size() > budget:
            return []
        return [
            Step(s, e.tokens, e.sample, e.spec, self.outputs if e.sample else ())
            for s, e in zip(self.bound, self.entries, strict=True)
        ]

    def advance(self, rt: RuntimeState, results: list[StepResult]) -> bool:
        # One output row per sampled entry, in request order.
        positions = [
            s.position - 1 for s, e in zip(self.bound, self.entries, strict=True) if e.sample
        ]
        tensors = tensors_of(rt, results, positions, len(self.entries))
        if self.label == "decode_batch":
            result: dict[str, Any] = {"tokens": [r.token for r in results]}
        else:
            result = {
                "samples": [
                    {"request_index": i, "token": r.token}
                    for i, r in enumerate(results)
                    if r.token is not None
                ],
                "positions": [s.position for s in self.bound],
            }
        self.ticket.reply(result, tensors)
        return True
