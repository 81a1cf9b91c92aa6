"""Jobs: what one request asks of the scheduler.

A job names the sessions it needs, is started when those sessions are free
(per-session FIFO order), contributes ``Step``s to the turn's single forward
through ``plan``, and consumes the results in ``advance``. Ops that touch no
model (trim, align, drop) are instant jobs: they finish in ``start``, still
in order with the session's other work.

Phases order a turn's batch: decode tokens first (running streams never
wait behind a prompt), then atomic batches, then prefill chunks.

The atomic batch jobs (``BatchEntry``, ``AtomicBatchJob``: many sessions in
one forward) are in ``batch_jobs.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from faults import BadRequest, Cancelled

from ...runtime import RuntimeState, Session, SessionId, Step, StepResult
from ...runtime.rows import RowRule
from ...spec import SamplerSpec
from ..ticket import Tensors, Ticket

# Tokens a settled verify feeds (no logits) per turn.
_FEED_PIECE = 256
# Most rows of logits one step asks for (a verify piece, a speculative span).
# Not for exactness (every row scores as if alone at any batch size): the
# logits buffer llama.cpp keeps grows to the most rows ever asked and never
# shrinks, n_vocab x 4 B a row (1 MiB for Gemma 3), so spans go in pieces.
MAX_LOGIT_ROWS = 7

PHASE_DECODE = 0
PHASE_ATOMIC = 1
PHASE_PREFILL = 2


class Job:
    """Base job. Subclasses set ``sessions`` and override the hooks."""

    phase = PHASE_DECODE
    atomic = False  # all of plan() must go in one forward
    waits_for_lane = False  # queue (rather than lanes_busy) when no lane
    ephemeral = False  # sessions are created for this job and dropped after
    generation = False  # a generate/chat: counts against --max-streams-per-peer

    def __init__(self, ticket: Ticket, sessions: Sequence[SessionId]) -> None:
        self.ticket = ticket
        self.sessions = tuple(sessions)
        self.cancelled = False

    def start(self, rt: RuntimeState) -> bool:
        """Admit sessions and check preconditions. True = already finished."""
        rt.admit(self.sessions, ephemeral=self.ephemeral)
        return False

    def size(self) -> int:
        """Tokens this job wants in the next forward (atomic jobs only)."""
        return 0

    def wants_exclusive(self) -> bool:
        """True when the next ``plan`` must be the only work of its forward
        (media decoded with non-causal attention): the scheduler gives the
        job a turn of its own."""
        return False

    def plan(self, rt: RuntimeState, budget: int) -> list[Step]:
        return []

    def advance(self, rt: RuntimeState, results: list[StepResult]) -> bool:
        """Consume this turn's results. True = finished (reply sent)."""
        return True

    def fail(self, rt: RuntimeState, exc: BaseException) -> None:
        self.ticket.fail(exc)

    def on_cancel(self, rt: RuntimeState) -> None:
        self.ticket.fail(Cancelled("request cancelled"))

    def release(self, rt: RuntimeState) -> None:
        """Called once when the job leaves the scheduler, however it ended."""
        if self.ephemeral:
            for sid in self.sessions:
                if rt.lanes.get(sid) is not None:
                    rt.drop(sid)


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


# The smallest piece a turn cuts from a prompt (less is not worth a row).
MIN_CUT = 16


def chunk_bounds(done: int, total: int, chunk: int, budget: int) -> int:
    """How many prompt tokens to take now (0 = wait for a later turn).

    Up to ``chunk`` tokens (``--prefill-chunk``); a piece larger than the
    turn's ``budget`` is cut to it, unless that would leave less than
    ``MIN_CUT`` (then it waits). Where a prompt is cut does not matter for its
    numbers: every row is computed as if alone (``engine.kernels``), so a
    prompt prefilled in any pieces, or after a reused prefix, has the KV cells
    and logits of a cold prefill in one piece.
    """
    n = min(total - done, chunk)
    if n <= budget:
        return n
    return budget if budget >= MIN_CUT else 0


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
    with the session's other work."""

    def __init__(self, ticket: Ticket, session: SessionId, op: str, token_count: int = 0) -> None:
        super().__init__(ticket, [session])
        self.op = op
        self.token_count = token_count

    def start(self, rt: RuntimeState) -> bool:
        sid = self.sessions[0]
        if self.op == "trim":
            self.ticket.reply({"position": rt.trim(sid, self.token_count)})
        elif self.op == "align":
            before, after = rt.align(sid, self.token_count)
            self.ticket.reply({"before": before, "after": after})
        elif self.op in ("signal", "signal_window"):
            self.ticket.reply(rt.signals(sid, self.op, self.token_count))
        else:
            rt.drop(sid)
            self.ticket.reply({})
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
            rt.trim(session.id, keep)
        self.ticket.reply(
            {"predicted": self.predicted, "accepted": accepted, "position": session.position}
        )
        return True

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
