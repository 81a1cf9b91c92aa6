"""A forward's steps: what jobs hand the runtime, what its rows give back,
and the drafts a generation proposes for its rows to verify.

A ``Step`` is part of one forward (tokens appended to a session, what to
sample or copy out), a ``StepResult`` what it got. ``RowRule`` and
``accept`` are the one rule for walking the rows of a scored span
(``verify``, speculative decoding): row ``i`` gives the model's token after
the span's first ``i + 1`` tokens; sample in order and stop at the first row
that disagrees with its draft, or samples a stop token, so a stateful
sampler (RNG, penalties, grammar) consumes exactly what plain decoding
would have. The rule runs where the logits are (here, or on the last stage
of a pipeline: a ``RowRule`` travels with the step); the job reads the
outcome from ``StepResult.row_tokens`` either way.

Drafts are proposed beside the rule that verifies them: a ``Drafter``
proposes what follows a session's next token, from its own history
(``PromptLookup``: no extra model, it shines on edits of given text) or a
smaller model (``draft.DraftModel``). A draft token is kept only while it
equals what the target itself sampled: the output is the output without.

``RowReader`` (``RuntimeState.rows``) reads llama.cpp's output rows after
a decode (samples, signals, logprobs, the rows a ``RowRule`` walks, logits
or hidden states asked for), with one sampler chain per session; it moves
no position.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

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


# -- proposing drafts (``accept`` above verifies them) ---------------------------


class Drafter(Protocol):
    """Proposes up to ``limit`` tokens to follow ``next_token`` in ``session``;
    ``streams`` (how many decode in the forward being planned) lets it decline
    when extra rows would not pay (``PromptLookup``'s automatic mode)."""

    def draft(
        self, session: Session, next_token: int, limit: int, streams: int = 1
    ) -> list[int]: ...


class NgramIndex:
    """Prompt lookup's drafts without rescanning the history on every token.

    A draft is what followed the latest earlier occurrence of the history's
    last ``ngram`` tokens. Negative ids mark positions without a token
    (media, embeddings input): they neither match nor are drafted, so a
    draft stops where one begins.

    Every start of an ``ngram`` that has a token after it is indexed once,
    as the history grows; each key keeps its starts in order, so the latest
    earlier match is the last. A job's own rejected drafts are cut from the
    session between two calls: the history is compared with the indexed
    copy over its last ``slack`` tokens only (nothing older can change while
    the job holds the session), and the starts past the first difference are
    dropped. The drafts equal a full rescan's (``lookup_draft`` in
    ``tests/test_speculative.py``).
    """

    def __init__(self, ngram: int, slack: int = 64) -> None:
        self.ngram = ngram
        self.slack = slack
        self.seen: list[int] = []
        self.starts: dict[tuple[int, ...], list[int]] = {}
        self.indexed = 0  # starts 0 .. indexed-1 are in ``starts``

    def draft(self, history: Sequence[int], max_draft: int) -> list[int]:
        self._sync(history)
        n, size = self.ngram, len(history)
        if max_draft <= 0 or size <= n:
            return []
        key = tuple(history[size - n :])
        if min(key) < 0:
            return []
        starts = self.starts.get(key)
        if not starts:
            return []
        follow = self.seen[starts[-1] + n : starts[-1] + n + max_draft]
        cut = next((i for i, t in enumerate(follow) if t < 0), len(follow))
        return follow[:cut]

    def _sync(self, history: Sequence[int]) -> None:
        seen, n = self.seen, self.ngram
        k = max(0, len(seen) - self.slack)
        end = min(len(seen), len(history))
        while k < end and seen[k] == history[k]:
            k += 1
        if k < len(seen):  # cut at k: drop every start whose n-gram or follower reaches it
            keep = max(0, k - n)
            for s in range(self.indexed - 1, keep - 1, -1):
                self.starts[tuple(seen[s : s + n])].pop()
            self.indexed = min(self.indexed, keep)
            del seen[k:]
        seen.extend(history[len(seen) :])
        for s in range(self.indexed, len(seen) - n):
            self.starts.setdefault(tuple(seen[s : s + n]), []).append(s)
        self.indexed = max(self.indexed, len(seen) - n)


# The worker's own drafts (--speculate auto), measured with
# scripts/bench_speculate.py: a 5-token key finds fewer false matches than 3
# in prose. Drafts stay short because a span's forward is a gap in the
# stream: every row of it is scored with the whole head, ~0.35 of a plain
# step each (measured, bench_vs_llama_server.py at c=1: the longest gap was
# 8x the median step with drafts of up to 32, 3.5x with 8, 2.9x with 5),
# and inter-token p99 is held to 3x the step. Long drafts did win more on
# text quoted at length (up to ~20% there); a request can still ask for
# them (``speculative.max_draft``).
AUTO_NGRAM = 5
AUTO_MAX_DRAFT = 4


class PromptLookup:
    """Drafts from the session's own history (``NgramIndex``), per job.

    Asked for (``speculative: {"mode": "prompt_lookup"}``) it always drafts
    what it finds. Turned on by the worker (``--speculate auto``,
    ``max_streams`` set) it drafts only while at most ``max_streams``
    jobs share the forward (a prompt piece counts), where extra rows cost
    little, and sizes its drafts by what the target kept: a draft kept whole
    doubles the next (from 4 up to ``max_draft``), one kept in part sets it
    to what was kept plus one, and after a draft of which nothing was kept
    it rests for 1, 2, 4, ... up to 16 tokens. Every row of a span is scored with the whole
    head, so a long draft pays only where text repeats at length (quoting,
    loops), and text that does not repeat costs next to nothing.
    """

    def __init__(self, ngram: int = 3, max_draft: int = 8, max_streams: int | None = None) -> None:
        if max_streams is not None:
            max_streams = max(1, max_streams)
        self.ngram = ngram
        self.max_draft = max_draft
        self.max_streams = max_streams
        self.index = NgramIndex(ngram, slack=max(64, 2 * max_draft + 4))
        self.size = min(4, max_draft)  # the next draft's length (automatic mode)
        self.rest = 0  # tokens to go without drafting (automatic mode)
        self.misses = 0  # drafts in a row of which nothing was accepted
        self.last: tuple[int, list[int]] | None = None  # (where it starts, the draft)

    def draft(self, session: Session, next_token: int, limit: int, streams: int = 1) -> list[int]:
        if self.max_streams is not None and (streams > self.max_streams or limit <= 0):
            self.last = None  # crowded: no copy of the history, nothing to learn from
            return []
        history = [*session.tokens, next_token]
        if self.max_streams is None:
            return self.index.draft(history, min(self.max_draft, limit))
        self._learn(history)
        if self.rest > 0:
            self.rest -= 1
            return []
        drafted = self.index.draft(history, min(self.size, limit))
        self.last = (len(history), drafted) if drafted else None
        return drafted

    def _learn(self, history: list[int]) -> None:
        """How much of the last draft the target kept: the next draft's
        length, and a rest after a miss."""
        if self.last is None:
            return
        start, drafted = self.last
        self.last = None
        kept = 0
        for mine, theirs in zip(drafted, history[start : start + len(drafted)], strict=False):
            if mine != theirs:
                break
            kept += 1
        if kept == len(drafted):
            self.size = min(2 * self.size, self.max_draft)
        else:
            self.size = max(1, min(kept + 1, self.max_draft))
        if kept:
            self.misses = 0
            return
        self.misses += 1
        self.rest = min(1 << (self.misses - 1), 16)
