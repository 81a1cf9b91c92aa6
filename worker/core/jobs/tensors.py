"""Jobs whose answers are tensors: ``embed``, ``export_state``, ``import_state``.

``embed`` is a prefill of a throwaway (ephemeral) session with hidden-state
output on every row, pooled here. The state jobs are session ops: ordered
with the session's other work, and instant (no forward): they move a
session's KV cells out of or into llama.cpp (``runtime.portable``); on a
pipeline stage they reply once the stages below have answered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from faults import BadRequest, LanesBusy

from ...runtime import Call, Origin, RuntimeState, Session, SessionId, Step, StepResult, wire
from ...runtime.portable import export_session, import_session
from ...runtime.steps import RowRule
from ...runtime.tail import Answer
from ...spec import SamplerSpec
from .base import PHASE_ATOMIC, Job, Tensors, Ticket
from .session import PrefillJob

POOLINGS = ("none", "mean", "last")


class EmbedJob(PrefillJob):
    """Final hidden states of a prompt, per token or pooled to one vector."""

    ephemeral = True
    waits_for_lane = True

    def __init__(
        self, ticket: Ticket, session: SessionId, tokens: list[int], chunk: int, pooling: str
    ) -> None:
        super().__init__(ticket, session, tokens, chunk, False, None, outputs=("hidden",))
        self.pooling = pooling

    def advance(self, rt: RuntimeState, results: list[StepResult]) -> bool:
        self.done += self.inflight
        self.captured.append(results[0])
        if self.done < len(self.tokens):
            return False
        rows = [r.hidden for r in self.captured if r.hidden is not None]
        hidden = rows[0] if len(rows) == 1 else np.concatenate(rows)
        n_layer = rt.n_layer
        result: dict[str, Any] = {"tokens": len(self.tokens), "pooling": self.pooling}
        if self.pooling == "none":
            positions = list(range(len(self.tokens)))
            tensors = Tensors({"hidden": hidden}, positions, 1, 0, n_layer)
        else:
            vector = hidden.mean(axis=0, dtype=np.float32) if self.pooling == "mean" else hidden[-1]
            tensors = Tensors(
                {"embedding": np.ascontiguousarray(vector, dtype=np.float32)},
                None,
                1,
                0,
                n_layer,
                axes={"embedding": -1},
                token_count=len(self.tokens),
            )
        self.ticket.reply(result, tensors)
        return True


class ExportStateJob(Job):
    """The session's KV cells and what it needs to continue (it stays here).

    A pipeline stage exports its own cells and asks the next stage for its
    own (recursively): ``kv_state`` is this stage's, ``kv_state.N`` the N-th
    stage below, and ``session_state.downstream`` their metadata in order
    (the sampler travels in the last stage's, where sampling happens). The
    request goes down the chain without holding the loop; the job holds the
    session until the answer lands, so every stage's part is of one moment.
    """

    def start(self, rt: RuntimeState) -> bool:
        sid = self.sessions[0]
        meta, kv = export_session(rt, sid)
        if rt.tail is None:
            self._reply(rt, meta, kv, None)
            return True
        name = str(sid)
        call = rt.ask("export_state", sid, lambda tail: tail.export_state(name))
        return self.after_chain(rt, lambda: self._reply(rt, meta, kv, call.answer))

    def _reply(
        self, rt: RuntimeState, meta: dict[str, Any], kv: np.ndarray, below: Answer | None
    ) -> None:
        parts = {"kv_state": kv}
        if below is not None:
            meta["downstream"] = below.states
            parts |= {f"kv_state.{i + 1}": part for i, part in enumerate(below.kvs)}
        tensors = Tensors(
            parts,
            None,
            1,
            0,
            rt.n_layer,
            axes={name: -1 for name in parts},
            token_count=int(meta["position"]),
        )
        self.ticket.reply({"session_state": meta}, tensors)


class ImportStateJob(Job):
    """A new session made from a saved state (``export_state`` elsewhere).

    On a pipeline stage the stages below get their parts down the chain
    (without holding the loop) and the reply waits for them; if any
    refuses, the session is dropped here too: no half-made session."""

    def __init__(
        self,
        ticket: Ticket,
        session: SessionId,
        meta: dict[str, Any],
        kv: np.ndarray,
        sampler_spec: SamplerSpec | None,
        below: list[np.ndarray] | None = None,
    ) -> None:
        super().__init__(ticket, [session])
        self.meta = meta
        self.kv = kv
        self.sampler_spec = sampler_spec
        self.below = below or []  # the KV states of the stages below (a pipeline)

    def start(self, rt: RuntimeState) -> bool:
        downstream = self.meta.get("downstream") or []
        if not isinstance(downstream, list) or not all(isinstance(m, dict) for m in downstream):
            # a peer's value: anything else failed deep in the link as ``internal``
            raise BadRequest("session_state.downstream must be a list of session states (maps)")
        if (rt.tail is not None) != bool(downstream) or len(downstream) != len(self.below):
            raise BadRequest(
                "session_state.downstream must hold one state per stage below this one "
                f"(the state has {len(downstream)}, this chain needs "
                f"{'at least 1' if rt.tail is not None else 0})"
            )
        sid = self.sessions[0]
        session = import_session(rt, sid, self.meta, self.kv, self.sampler_spec)
        self.kv = np.empty(0, dtype=np.uint8)  # release the request's buffer
        if rt.tail is not None:
            name, below = str(sid), self.below
            try:
                rt.ask("import_state", sid, lambda tail: tail.import_state(name, downstream, below))
            except BaseException:
                rt.drop(sid)  # the stages below cannot take it: leave no half-made session
                raise
            finally:
                self.below = []
        return self.after_chain(rt, lambda: self.ticket.reply({"position": session.position}))

    def landed(self, rt: RuntimeState, call: Call) -> bool:
        if call.fault is not None and rt.lanes.get(self.sessions[0]) is not None:
            rt.drop(self.sessions[0])  # the stages below refused it: no half-made session
        return super().landed(rt, call)


@dataclass(slots=True)
class StageStep:
    """One step of a ``forward_frame`` request, validated by the handler."""

    session: str
    tokens: list[int]
    position: int
    sample: bool
    spec: SamplerSpec | None
    outputs: tuple[str, ...]
    capture_all: bool
    top_logprobs: int | None
    rows: np.ndarray
    all_rows: bool = False
    rule: RowRule | None = None
    origin: Origin | None = None
    non_causal: bool = False  # an image's rows (stage 0 with --mmproj)


class StageForwardJob(Job):
    """The rest of the model for rows an upstream stage computed (``forward_frame``).

    Every step's session is admitted (made on first use) and must stand at
    the step's position; all of it runs in one forward, fed as input rows.
    Sampling happens here when this stage holds the last layer (or further
    down, transparently, when it has a next stage of its own).
    """

    phase = PHASE_ATOMIC
    atomic = True

    def __init__(self, ticket: Ticket, steps: list[StageStep]) -> None:
        super().__init__(ticket, [s.session for s in steps])
        self.steps = steps
        self.bound: list[Session] = []

    def start(self, rt: RuntimeState) -> bool:
        missing = rt.lanes.missing(self.sessions)
        if len(missing) > rt.lanes.free:
            raise LanesBusy(
                f"forward_frame needs {len(missing)} new sessions, {rt.lanes.free} lanes free"
            )
        for i, step in enumerate(self.steps):
            known = rt.lanes.get(step.session)
            position = known.position if known else 0
            if position != step.position:
                raise BadRequest(
                    f"steps[{i}]: session {step.session!r} is at {position} on this stage, "
                    f"not {step.position} (a stage restarted? drop and prefill again)"
                )
        self.bound = rt.admit(self.sessions)
        for session, step in zip(self.bound, self.steps, strict=True):
            rt.ensure_room(session, len(step.tokens))
        return False

    def size(self) -> int:
        return sum(len(s.tokens) for s in self.steps)

    def plan(self, rt: RuntimeState, budget: int) -> list[Step]:
        if self.size() > budget:
            return []
        return [
            Step(
                session,
                s.tokens,
                s.sample,
                s.spec,
                s.outputs,
                top_logprobs=s.top_logprobs,
                capture_all=s.capture_all,
                embd=s.rows,
                all_rows=s.all_rows,
                rule=s.rule,
                origin=s.origin,
                non_causal=s.non_causal,
            )
            for session, s in zip(self.bound, self.steps, strict=True)
        ]

    def advance(self, rt: RuntimeState, results: list[StepResult]) -> bool:
        """Answer the caller; steps with an ``origin`` are answered to the head
        stage directly by the last stage (the caller gets an acknowledgement
        for them), so sampled tokens skip the stages in between."""
        items: list[dict[str, Any]] = []
        parts: dict[str, list[np.ndarray]] = {}
        direct: dict[tuple[bytes, int], list[tuple[int, StepResult]]] = {}
        for step, result in zip(self.steps, results, strict=True):
            origin = step.origin
            if origin is None:
                items.append(wire.result_out(result, parts))
                continue
            if rt.tail is None:
                key = (origin.peer, origin.request)
                direct.setdefault(key, []).append((origin.index, result))
            items.append(dict(wire.DIRECT))
        for (peer, request), group in direct.items():
            group.sort(key=lambda pair: pair[0])
            mine: dict[str, list[np.ndarray]] = {}
            answer = [wire.result_out(result, mine) for _, result in group]
            head = Ticket(owner=peer, id=request, op="forward_frame", outbox=self.ticket.outbox)
            head.reply({"results": answer}, _tensors(mine, len(group), rt.n_layer))
        self.ticket.reply({"results": items}, _tensors(parts, len(results), rt.n_layer))
        return True


def _tensors(parts: dict[str, list[np.ndarray]], steps: int, n_layer: int) -> Tensors | None:
    if not parts:
        return None
    joined = {k: np.concatenate(v) for k, v in parts.items()}
    return Tensors(joined, None, steps, 0, n_layer)
