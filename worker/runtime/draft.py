"""The draft runtime: a second, smaller engine that proposes speculative tokens.

It is a runtime of its own, beside ``RuntimeState`` and never through it: the
draft engine has its own context whose lanes mirror the target's lane
numbers, and nothing it does touches the target's KV cache or positions.
Per lane it remembers the tokens its cache holds. Before drafting it keeps
the longest prefix shared with the session's history (so trims, drops and
lane reuse need no bookkeeping elsewhere), feeds the rest, then decodes
greedily one token at a time.

A draft is only advice: the target verifies every token, so any failure
here clears the lane and yields no draft rather than an error.

``DraftModel`` is the drafter a generation holds (a ``steps.Drafter``, as
prompt lookup is): the worker's one ``DraftRuntime`` with a request's
``max_draft``. It proposes nothing for a session holding media or input
embeddings, which the draft model never saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..engine import Engine, Segment
from .lanes import Session


class DraftRuntime:
    def __init__(self, engine: Engine, path: str) -> None:
        self.engine = engine
        self.path = path
        self._lanes: dict[int, list[int]] = {}
        self.forwards = 0

    def draft(self, lane: int, history: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` greedy tokens to follow ``history`` (which ends in the next token)."""
        if k <= 0 or not history:
            return []
        have = self._lanes.setdefault(lane, [])
        common = 0
        for a, b in zip(have, history, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(history) - 1)  # feed at least one token for logits
        self.engine.seq_rm(lane, common, -1)
        del have[common:]
        feed = list(history[common:])
        step = self.engine.n_batch
        for start in range(0, len(feed), step):
            if not self._feed(lane, have, feed[start : start + step]):
                return []
        drafts: list[int] = []
        token = self.engine.greedy(self.engine.output_index(0))
        while True:
            drafts.append(token)
            if len(drafts) == k or not self._feed(lane, have, [token]):
                return drafts
            token = self.engine.greedy(self.engine.output_index(0))

    def _feed(self, lane: int, have: list[int], tokens: list[int]) -> bool:
        status = self.engine.decode([Segment(lane, tokens, len(have), "last")])
        self.forwards += 1
        if not status.ok:
            self.engine.seq_clear(lane)
            have.clear()
            return False
        have.extend(tokens)
        return True

    def close(self) -> None:
        self.engine.close()


@dataclass(frozen=True)
class DraftModel:
    """Greedy drafts from the draft runtime (a second, smaller model)."""

    runtime: DraftRuntime
    max_draft: int = 8

    @property
    def path(self) -> str:
        return self.runtime.path

    def with_max(self, max_draft: int) -> DraftModel:
        return DraftModel(self.runtime, max_draft)

    def draft(self, session: Session, next_token: int, limit: int, streams: int = 1) -> list[int]:
        if session.tokens and min(session.tokens) < 0:
            # The draft model never saw the session's media (or embeddings
            # input): it has nothing sound to propose, and -1 is no token.
            return []
        k = min(self.max_draft, limit)
        return self.runtime.draft(session.lane, [*session.tokens, next_token], k)
