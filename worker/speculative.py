"""Speculative decoding helpers: n-gram prompt lookup and draft acceptance.

Prompt lookup drafts tokens from the session's own history: find the most
recent earlier occurrence of the last ``ngram`` tokens and propose what
followed it. It needs no extra model and shines on edits of given text.

Acceptance is exact: the target samples position by position and a draft
token is kept only while it equals what the target itself produced, so the
output is the output without speculation (up to batch-shape numerics).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .engine import Engine, Segment, greedy_token
from .runtime import Session


def lookup_draft(history: Sequence[int], ngram: int, max_draft: int) -> list[int]:
    """Tokens that followed the latest earlier match of the last n-gram."""
    n = len(history)
    if max_draft <= 0 or n <= ngram:
        return []
    key = list(history[n - ngram :])
    for start in range(n - ngram - 1, -1, -1):
        if list(history[start : start + ngram]) == key:
            follow = history[start + ngram : start + ngram + max_draft]
            return list(follow)
    return []


def accept(
    drafts: Sequence[int], sample: Callable[[int], int], stop: Callable[[int], bool]
) -> list[int]:
    """Sample position by position while the drafts agree.

    ``sample(i)`` gives the target's token after the span's first ``i + 1``
    tokens. Returns the target's tokens: every matching draft plus the first
    token where the target disagrees (or the bonus token after all drafts).
    Sampling stops at the first mismatch or stop token so a stateful sampler
    (RNG, penalties) consumes exactly what non-speculative decoding would.
    """
    out: list[int] = []
    for i in range(len(drafts) + 1):
        token = sample(i)
        out.append(token)
        if i == len(drafts) or token != drafts[i] or stop(token):
            break
    return out


class Drafter(Protocol):
    """Proposes up to ``limit`` tokens to follow ``next_token`` in ``session``."""

    def draft(self, session: Session, next_token: int, limit: int) -> list[int]: ...


@dataclass(frozen=True)
class PromptLookup:
    ngram: int = 3
    max_draft: int = 8

    def draft(self, session: Session, next_token: int, limit: int) -> list[int]:
        history = [*session.tokens, next_token]
        return lookup_draft(history, self.ngram, min(self.max_draft, limit))


@dataclass
class DraftModel:
    """Greedy drafts from a second model whose lanes mirror the target's.

    The draft engine keeps, per lane, the tokens its KV cache holds. Before
    drafting it keeps the longest prefix shared with the session (so trims,
    drops and lane reuse need no bookkeeping elsewhere), feeds the rest, then
    decodes ``k - 1`` more single tokens greedily.
    """

    engine: Engine
    path: str
    max_draft: int = 8
    lanes: dict[int, list[int]] = field(default_factory=dict)

    def with_max(self, max_draft: int) -> DraftModel:
        return DraftModel(self.engine, self.path, max_draft, self.lanes)

    def draft(self, session: Session, next_token: int, limit: int) -> list[int]:
        k = min(self.max_draft, limit)
        if k <= 0:
            return []
        lane = session.lane
        have = self.lanes.setdefault(lane, [])
        want = [*session.tokens, next_token]
        common = 0
        for a, b in zip(have, want, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(want) - 1)  # feed at least one token for logits
        self.engine.seq_rm(lane, common, -1)
        del have[common:]
        feed = want[common:]
        step = self.engine.n_batch
        for start in range(0, len(feed), step):
            chunk = feed[start : start + step]
            if not self._feed(lane, have, chunk):
                return []
        drafts: list[int] = []
        token = greedy_token(self.engine, self.engine.output_index(0))
        while True:
            drafts.append(token)
            if len(drafts) == k or not self._feed(lane, have, [token]):
                return drafts
            token = greedy_token(self.engine, self.engine.output_index(0))

    def _feed(self, lane: int, have: list[int], tokens: list[int]) -> bool:
        status = self.engine.decode([Segment(lane, tokens, len(have), "last")])
        if not status.ok:  # the draft is only advice: start this lane afresh
            self.engine.seq_clear(lane)
            have.clear()
            return False
        have.extend(tokens)
        return True
