"""The single-session model ops' jobs: prefill, decode, verify, session ops.

``PrefillJob`` feeds a session's tokens (or input embeddings) in pieces
under the turn's budget and may sample the last row; ``DecodeJob`` feeds
one token and samples; ``VerifyJob`` scores a draft in one forward and
keeps the accepted prefix; ``SessionOpJob`` is trim / align / drop /
signal: instant, but in order with the session's other work (on a pipeline
stage it replies once the rest of the chain has answered, without holding
the loop); ``InfoJob`` is ``info`` on a stage with a next stage.
``tensors_of`` makes a job's captured rows its reply's tensors (for the
batch, media and generate jobs too: they import this module, never the
reverse).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from faults import BadRequest, Fault

from ...runtime import Call, RuntimeState, Session, SessionId, Step, StepResult
from ...runtime.signals import session_signals
from ...runtime.steps import RowRule
from ...spec import SamplerSpec
from .base import (
    MAX_LOGIT_ROWS,
    PHASE_ATOMIC,
    PHASE_PREFILL,
    Job,
    Tensors,
    Ticket,
    chunk_bounds,
)

# Tokens a verify job feeds per step once its draft is settled.
_FEED_PIECE = 256


class PrefillJob(Job):
    phase = PHASE_PREFILL

    def __init__(
        self,
        ticket: Ticket,
        session: SessionId,
        tokens: list[int],
        chunk: int,
        sampled: bool,
        spec: SamplerSpec | None,
        outputs: tuple[str, ...] = (),
        embd: np.ndarray | None = None,
        start_position: int | None = None,
    ) -> None:
        super().__init__(ticket, [session])
        self.tokens = tokens  # with ``embd``: placeholders (-1), one per row
        self.chunk = chunk
        self.sampled = sampled
        self.spec = spec
        self.outputs = outputs  # every prompt token's rows, captured piece by piece
        self.embd = embd
        self.start_position = start_position
        self.captured: list[StepResult] = []
        self.position0 = 0
        self.done = 0
        self.inflight = 0
        self.session: Session | None = None

    def start(self, rt: RuntimeState) -> bool:
        # A new session may start on a cached lane already holding a prefix
        # of these tokens; only the rest is prefilled (same KV, same result).
        # Not when every token's rows are asked for, or for embeddings input.
        reuse = not self.outputs and self.embd is None
        self.session, self.done = rt.admit_prompt(
            self.sessions[0], self.tokens, self.ephemeral, reuse=reuse
        )
        if self.start_position is not None and self.start_position != self.session.position:
            raise BadRequest(
                f"positions start at {self.start_position} but session "
                f"{self.sessions[0]!r} is at {self.session.position}"
            )
        self.position0 = self.session.position
        rt.ensure_room(self.session, len(self.tokens) - self.done)
        return False

    def prefill_left(self) -> int:
        return len(self.tokens) - self.done

    def plan(self, rt: RuntimeState, budget: int) -> list[Step]:
        assert self.session is not None
        total = len(self.tokens)
        n = chunk_bounds(self.done, total, self.chunk, budget)
        self.inflight = n
        if n == 0:
            return []
        part = self.tokens[self.done : self.done + n]
        sample = self.sampled and self.done + n == total
        embd = self.embd[self.done : self.done + n] if self.embd is not None else None
        return [
            Step(
                self.session,
                part,
                sample=sample,
                spec=self.spec,
                outputs=self.outputs,
                capture_all=bool(self.outputs),
                embd=embd,
            )
        ]

    def advance(self, rt: RuntimeState, results: list[StepResult]) -> bool:
        assert self.session is not None
        self.done += self.inflight
        if self.outputs:
            self.captured.append(results[0])
        if self.done < len(self.tokens):
            return False
        result: dict[str, Any] = {"position": self.session.position}
        if self.sampled:
            result["token"] = results[0].token
        end = self.session.position
        tensors = tensors_of(rt, self.captured, list(range(self.position0, end)))
        self.ticket.reply(result, tensors)
        return True


class DecodeJob(Job):
    """One token for one session; concurrent ones share a forward."""

    def __init__(
        self,
        ticket: Ticket,
        session: str,
        token: int,
        spec: SamplerSpec | None,
        outputs: tuple[str, ...] = (),
    ) -> None:
        super().__init__(ticket, [session])
        self.token = token
        self.spec = spec
        self.outputs = outputs
        self.session: Session | None = None

    def start(self, rt: RuntimeState) -> bool:
        (self.session,) = rt.admit(self.sessions)
        rt.ensure_room(self.session, 1)
        return False

    def plan(self, rt: RuntimeState, budget: int) -> list[Step]:
        assert self.session is not None
        if budget < 1:
            return []
        return [Step(self.session, [self.token], True, self.spec, self.outputs)]

    def advance(self, rt: RuntimeState, results: list[StepResult]) -> bool:
        assert self.session is not None
        position = self.session.position
        result: dict[str, Any] = {"token": results[0].token, "position": position}
        self.ticket.reply(result, tensors_of(rt, results, [position - 1]))
        return True


class SessionOpJob(Job):
    """trim / align / drop / signal / signal_window: no forward, but ordered
    with the session's other work. On a pipeline stage trim and drop run
    here and go down the chain, and signals are asked of the last stage:
    the reply waits for the chain's answer (and carries its error), the
    loop does not."""

    def __init__(self, ticket: Ticket, session: SessionId, op: str, token_count: int = 0) -> None:
        super().__init__(ticket, [session])
        self.op = op
        self.token_count = token_count

    def start(self, rt: RuntimeState) -> bool:
        sid, reply = self.sessions[0], self.ticket.reply
        data: dict[str, Any]
        if self.op == "trim":
            data = {"position": rt.trim(sid, self.token_count)}
        elif self.op == "align":
            before, after = rt.align(sid, self.token_count)
            data = {"before": before, "after": after}
        elif self.op in ("signal", "signal_window") and rt.tail is not None:
            rt.require(sid)
            op, name, n = self.op, str(sid), self.token_count
            call = rt.ask(op, sid, lambda tail: tail.session_query(op, name, n))
            return self.after_chain(rt, lambda: reply(call.result))
        elif self.op in ("signal", "signal_window"):  # here, where sampling happens
            history = rt.require(sid).signals
            data = session_signals(history, self.op, self.token_count, str(sid))
        else:
            rt.drop(sid)
            data = {}
        return self.after_chain(rt, functools.partial(reply, data))


class InfoJob(Job):
    """``info`` on a stage with a next stage: this stage's part is ready, the
    rest of the chain's is asked down the chain. A job rather than an
    instant answer so the loop goes on while the chain answers (a cached
    copy would be stale or missing after a stage restarts, and the first
    ``info`` would have none); it holds no session and no lane, so a full
    queue does not refuse it. It never fails: ``compose`` (the edge's) puts
    this stage's part and the answer, or why there is none, together."""

    fills_queue = False

    def __init__(
        self, ticket: Ticket, compose: Callable[[dict[str, Any] | Fault], dict[str, Any]]
    ) -> None:
        super().__init__(ticket, [])
        self.compose = compose
        self.call: Call | None = None

    def start(self, rt: RuntimeState) -> bool:
        try:
            self.call = rt.ask("info", None, lambda tail: tail.info())
        except Fault as exc:
            self.ticket.reply(self.compose(exc))
            return True
        return False

    def waiting(self, rt: RuntimeState) -> bool:
        return self.call is not None and not self.call.done

    def awaits(self, call: Call) -> bool:
        return call is self.call

    def landed(self, rt: RuntimeState, call: Call) -> bool:
        self.ticket.reply(self.compose(call.fault if call.fault is not None else call.result))
        return True


class VerifyJob(Job):
    """Score a span ``[t0, d1..dk]`` and keep the agreeing drafts.

    ``predicted[i]`` is the target's token after ``tokens[..i]``. Every row
    scores exactly as plain decoding would (rows are batch-invariant); the
    span goes in pieces of at most ``MAX_LOGIT_ROWS`` rows, one piece a turn,
    so llama.cpp's logits buffer stays small however long the span.
    Greedy verification reports all k+1 predictions; a stateful sampler
    stops at the first disagreement so its RNG and penalty state advance
    exactly as plain decoding would have. Tokens after a disagreement are fed
    without logits when ``trim`` is false (they stay in the KV cache).
    """

    phase = PHASE_ATOMIC
    atomic = True

    def __init__(
        self,
        ticket: Ticket,
        session: str,
        tokens: list[int],
        spec: SamplerSpec | None,
        trim: bool,
    ) -> None:
        super().__init__(ticket, [session])
        self.tokens = tokens
        self.spec = spec
        self.trim = trim
        self.session: Session | None = None
        self.start_position = 0
        self.done = 0  # tokens of the span already in the KV cache
        self.inflight = 0
        self.predicted: list[int] = []
        self.settled = False  # a stateful sampler disagreed: no more sampling

    def start(self, rt: RuntimeState) -> bool:
        (self.session,) = rt.admit(self.sessions)
        rt.ensure_room(self.session, len(self.tokens))
        self.start_position = self.session.position
        return False

    def size(self) -> int:
        left = len(self.tokens) - self.done
        return min(_FEED_PIECE if self.settled else MAX_LOGIT_ROWS, left)

    def plan(self, rt: RuntimeState, budget: int) -> list[Step]:
        assert self.session is not None
        n = self.size()
        if n > budget:
            return []
        self.inflight = n
        part = self.tokens[self.done : self.done + n]
        if self.settled:
            return [Step(self.session, part)]
        # row k predicts the token after part[k]: checked against the span's next
        greedy = self.spec is None or self.spec.greedy
        checks = tuple(self.tokens[self.done + 1 : self.done + n + 1])
        rule = RowRule(checks, until_mismatch=not greedy)
        return [Step(self.session, part, False, self.spec, all_rows=True, rule=rule)]

    def advance(self, rt: RuntimeState, results: list[StepResult]) -> bool:
        session = self.session
        assert session is not None
        first = self.done
        self.done += self.inflight
        if not self.settled:
            self._score(first, results[0].row_tokens)
        if self.done < len(self.tokens) and not (self.settled and self.trim):
            return False
        drafts = self.tokens[1:]
        accepted = 0
        while accepted < len(drafts) and accepted < len(self.predicted):
            if self.predicted[accepted] != drafts[accepted]:
                break
            accepted += 1
        keep = self.start_position + 1 + accepted
        if self.trim and keep < session.position:
            rt.trim(session.id, keep)  # on a stage: the reply waits for the chain's trim
        result = {"predicted": self.predicted, "accepted": accepted, "position": session.position}
        return self.after_chain(rt, functools.partial(self.ticket.reply, result))

    def _score(self, first: int, tokens: list[int] | None) -> None:
        """Predictions after tokens ``first ..`` of the span, sampled from this
        piece's rows by its ``RowRule`` (here, or on a pipeline's last stage)."""
        assert tokens is not None
        drafts = self.tokens[1:]
        greedy = self.spec is None or self.spec.greedy
        for k, token in enumerate(tokens):
            i = first + k  # prediction i is checked against drafts[i]
            self.predicted.append(token)
            if not greedy and (i == len(drafts) or token != drafts[i]):
                self.settled = True
                return


# -- captured rows as a reply's tensors (these jobs, batch, media, generate) ----


def tensors_of(
    rt: RuntimeState, results: Sequence[StepResult], positions: list[int], sequences: int = 1
) -> Tensors | None:
    """The captured rows of ``results`` (in order) as one output's tensors."""
    return tensors_of_rows(results, positions, rt.n_layer, sequences)


def tensors_of_rows(
    results: Sequence[StepResult], positions: list[int], n_layer: int, sequences: int = 1
) -> Tensors | None:
    parts: dict[str, np.ndarray] = {}
    for name in ("hidden", "logits"):
        rows = [getattr(r, name) for r in results if getattr(r, name) is not None]
        if rows:
            parts[name] = rows[0] if len(rows) == 1 else np.concatenate(rows)
    if not parts:
        return None
    return Tensors(parts, positions, sequences, 0, n_layer)
