"""A forward's steps: what jobs hand the runtime, and what its rows give back.

A ``Step`` is part of one forward (tokens appended to a session, what to
sample or copy out), a ``StepResult`` what it got. ``RowRule`` and
``accept`` are the one rule for walking the rows of a scored span
(``verify``, speculative decoding): row ``i`` gives the model's token after
the span's first ``i + 1`` tokens; sample in order and stop at the first row
that disagrees with its draft, or samples a stop token, so a stateful
sampler (RNG, penalties, grammar) consumes exactly what plain decoding
would have. The rule runs where the logits are: in this process for a whole
model, on the last stage of a pipeline otherwise (a ``RowRule`` travels
with the step), and the job reads the outcome from ``StepResult.row_tokens``
either way.

``RowReader`` (held by ``RuntimeState`` as ``rows``) reads llama.cpp's
output rows after a decode: ``sample_row`` (greedy or the session's sampler
chain, confidence signals, logprobs), ``sampler_for`` (one chain per
session, rebuilt when its parameters change), and a step's result
(``fill``): its sampled token, its rows walked by a ``RowRule``, or the
logits / hidden states it asked for. It only reads the engine's rows and
the session's sampler: it moves no position.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from faults import BadRequest

from ..engine import Engine, OutputMode, Sampler, SamplerError
from ..spec import SamplerSpec
from .lanes import Session
from .signals import logprobs_of, signal_of


@dataclass(frozen=True)
class RowRule:
    """How to sample an ``all_rows`` step's rows.

    Row ``k``'s token is checked against ``checks[k]``; the row after the
    last check is the bonus row. With ``until_mismatch`` false every row is
    sampled (greedy ``verify`` reports every prediction).
    """

    checks: tuple[int, ...]
    until_mismatch: bool = True
    stop_tokens: tuple[int, ...] = ()
    stop_eog: bool = False


def accept(
    drafts: Sequence[int],
    sample: Callable[[int], int],
    stop: Callable[[int], bool],
    rows: int | None = None,
) -> list[int]:
    """Sample position by position while the drafts agree.

    ``sample(i)`` gives the target's token after the span's first ``i + 1``
    tokens. Returns the target's tokens: every matching draft plus the first
    token where the target disagrees (or the bonus token after all drafts).
    ``rows`` (default ``len(drafts) + 1``) bounds the rows there are: a piece
    of a longer span may end before its bonus row.
    """
    out: list[int] = []
    for i in range(len(drafts) + 1 if rows is None else rows):
        token = sample(i)
        out.append(token)
        if i == len(drafts) or token != drafts[i] or stop(token):
            break
    return out


@dataclass(frozen=True)
class Origin:
    """Where a pipeline step's result goes when not back along the chain: the
    head stage's direct connection to the last stage (``peer``), the head's
    request ``request``, and the step's ``index`` among its ``count`` steps.
    Opaque to the runtime; the last stage answers it directly."""

    peer: bytes
    request: int
    index: int
    count: int


@dataclass
class Step:
    """Part of one forward: ``tokens`` appended to ``session``.

    ``sample`` asks for a token sampled after the last one (with ``spec``,
    or greedy when ``spec`` is None). ``outputs`` ("hidden", "logits")
    copies those tensors out for the sampled row, or for every row of the
    step with ``capture_all``. ``embd`` (``[n, n_embd]`` f32) feeds input
    embeddings instead of token ids; ``tokens`` then holds n placeholders.
    """

    session: Session
    tokens: Sequence[int]
    sample: bool = False
    spec: SamplerSpec | None = None
    outputs: tuple[str, ...] = ()
    all_rows: bool = False  # logits for every token (verify, speculation)
    top_logprobs: int | None = None  # logprobs of the sampled token (+ top k)
    capture_all: bool = False  # ``outputs`` for every token of the step
    embd: np.ndarray | None = None
    rule: RowRule | None = None  # ``all_rows``: sample the rows by this rule (``row_tokens``)
    origin: Origin | None = None  # a pipeline step answered directly to the head stage
    # ``embd`` rows decoded with bidirectional attention (an image's tokens):
    # llama.cpp switches that per context, so the step runs in a forward alone.
    non_causal: bool = False

    @property
    def wants_hidden(self) -> bool:
        return "hidden" in self.outputs

    @property
    def group(self) -> tuple[bool, bool, bool]:
        """Steps of one group share a ``llama_decode``: token ids and input
        embeddings cannot share a batch, hidden-state output makes every
        row of its batch an output row (kept away from other steps' batches),
        and non-causal attention applies to the whole batch."""
        return (self.embd is not None, self.wants_hidden, self.non_causal)


@dataclass
class StepResult:
    token: int | None = None
    logits: np.ndarray | None = None  # [rows, n_vocab] copies (``outputs``)
    hidden: np.ndarray | None = None  # [rows, n_embd] copies (``outputs``)
    rows: list[int] | None = None  # batch rows of every token (``all_rows``)
    logprobs: dict[str, Any] | None = None
    error: BadRequest | None = None  # this step's sampling failed
    row_tokens: list[int] | None = None  # ``rule``: the rows' sampled tokens, in order
    row_logprobs: list[dict[str, Any] | None] | None = None  # per row token (top_logprobs)


def group_steps(steps: Sequence[Step]) -> dict[tuple[bool, bool, bool], list[int]]:
    """Step indices by ``Step.group``: the steps that can share a ``llama_decode``."""
    groups: dict[tuple[bool, bool, bool], list[int]] = {}
    for index, step in enumerate(steps):
        groups.setdefault(step.group, []).append(index)
    return groups


class RowReader:
    """Sampling and capturing a forward's rows."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def fill(self, index: int, step: Step, result: StepResult) -> None:
        """Step ``index`` of the last forward: its token or rows, then its tensors."""
        self._sample_step(index, step, result)
        if step.outputs:
            self._capture(index, step, result)

    def sample_row(
        self, session: Session, spec: SamplerSpec | None, row: int, top_logprobs: int | None = None
    ) -> int:
        """Sample from one row of the last forward with the session's sampler.

        Named sessions record the token's confidence signals; ``top_logprobs``
        (when not None) leaves the token's logprobs in ``session.last_logprobs``.
        """
        if spec is None or spec.greedy:
            token = self.engine.greedy(row)
        else:
            try:
                token = self.sampler_for(session, spec).sample(row)
            except SamplerError as exc:
                raise BadRequest(f"sampling: {exc}") from exc
        session.last_token = token
        if not session.ephemeral or top_logprobs is not None:
            logits = self.engine.logits_row(row)
            if not session.ephemeral:
                session.signals.append(signal_of(logits, token))
            if top_logprobs is not None:
                session.last_logprobs = logprobs_of(logits, token, top_logprobs)
        return token

    def sampler_for(self, session: Session, spec: SamplerSpec) -> Sampler:
        """The session's chain, rebuilt only when its parameters change."""
        if session.sampler is None or session.sampler.spec != spec:
            if session.sampler is not None:
                session.sampler.free()
                session.sampler = None
            try:
                session.sampler = Sampler(self.engine, spec)
            except SamplerError as exc:
                raise BadRequest(f"sampling: {exc}") from exc
        sampler: Sampler = session.sampler
        return sampler

    def _capture(self, index: int, step: Step, result: StepResult) -> None:
        """Copy the asked tensors of the step's output rows out of llama.cpp."""
        n = len(step.tokens)
        rows = (
            [self.engine.output_index(index, k) for k in range(n)]
            if step.capture_all
            else [self.engine.output_index(index)]
        )
        if "logits" in step.outputs:
            result.logits = np.stack([self.engine.logits_row(r) for r in rows])
        if "hidden" in step.outputs:
            result.hidden = np.stack([self.engine.hidden_row(r) for r in rows])

    def _sample_step(self, index: int, step: Step, result: StepResult) -> None:
        """Fill one step's result: its rows (``all_rows``) or its sampled token."""
        session = step.session
        if step.all_rows:
            result.rows = [self.engine.output_index(index, k) for k in range(len(step.tokens))]
            if step.rule is not None:
                self._sample_rows(step, result, result.rows)
        elif step.sample:
            row = self.engine.output_index(index)
            result.token = self.sample_row(session, step.spec, row, step.top_logprobs)
            if step.top_logprobs is not None:
                result.logprobs = session.last_logprobs

    def _sample_rows(self, step: Step, result: StepResult, rows: list[int]) -> None:
        """Walk an ``all_rows`` step's rows by its ``RowRule`` (see ``accept``)."""
        rule = step.rule
        assert rule is not None
        session = step.session
        infos: list[dict[str, Any] | None] = []

        def sample(k: int) -> int:
            token = self.sample_row(session, step.spec, rows[k], step.top_logprobs)
            infos.append(session.last_logprobs if step.top_logprobs is not None else None)
            return token

        def stop(token: int) -> bool:
            return token in rule.stop_tokens or (rule.stop_eog and self.engine.is_eog(token))

        if rule.until_mismatch:
            result.row_tokens = accept(rule.checks, sample, stop, rows=len(rows))
        else:
            result.row_tokens = [sample(k) for k in range(len(rows))]
        result.row_logprobs = infos


def output_rows(step: Step) -> OutputMode:
    """The rows llama.cpp outputs for a step. Outputs asked without sampling
    (a stage's ``forward_frame``) still need the last row: ``RowReader`` reads
    it, and without it every turn crashed and re-ran the step to the lane's end."""
    if step.all_rows or step.capture_all:
        return "all"
    return "last" if step.sample or step.outputs else "none"
