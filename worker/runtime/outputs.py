"""What a forward's output rows become: sampled tokens, logprobs, tensors.

``RowReader`` (held by ``RuntimeState`` as ``rows``) reads llama.cpp's
output rows after a decode: ``sample_row`` (greedy or the session's sampler
chain, confidence signals, logprobs), ``sampler_for`` (one chain per
session, rebuilt when its parameters change), and a step's result
(``fill``): its sampled token, its rows walked by a ``RowRule``, or the
logits / hidden states it asked for. It only reads the engine's rows and
the session's sampler: it moves no position.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from faults import BadRequest

from ..engine import Engine, OutputMode, Sampler, SamplerError
from ..spec import SamplerSpec
from .lanes import Session
from .rows import accept
from .signals import logprobs_of, signal_of
from .steps import Step, StepResult


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
        """Walk an ``all_rows`` step's rows by its ``RowRule`` (see ``runtime.rows``)."""
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
