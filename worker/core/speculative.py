"""Speculative decoding helpers: n-gram prompt lookup and draft acceptance.

Prompt lookup drafts tokens from the session's own history: find the most
recent earlier occurrence of the last ``ngram`` tokens and propose what
followed it. It needs no extra model and shines on edits of given text.

Acceptance is exact: the target samples position by position and a draft
token is kept only while it equals what the target itself produced, so the
output is the output without speculation (up to batch-shape numerics). The
rule itself (``accept``) lives in ``runtime.rows``, where the rows are
sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["DraftModel", "Drafter", "PromptLookup", "accept", "lookup_draft"]

from ..runtime import DraftRuntime, Session
from ..runtime.rows import accept


def lookup_draft(history: Sequence[int], ngram: int, max_draft: int) -> list[int]:
    """Tokens that followed the latest earlier match of the last n-gram.

    Negative ids mark positions without a token (media, embeddings input):
    they neither match nor are drafted, so a draft stops where one begins.
    """
    n = len(history)
    if max_draft <= 0 or n <= ngram:
        return []
    key = list(history[n - ngram :])
    if min(key) < 0:
        return []
    for start in range(n - ngram - 1, -1, -1):
        if list(history[start : start + ngram]) == key:
            follow = list(history[start + ngram : start + ngram + max_draft])
            cut = next((i for i, t in enumerate(follow) if t < 0), len(follow))
            return follow[:cut]
    return []


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

    def draft(self, session: Session, next_token: int, limit: int) -> list[int]:
        if session.tokens and min(session.tokens) < 0:
            # The draft model never saw the session's media (or embeddings
            # input): it has nothing sound to propose, and -1 is no token.
            return []
        k = min(self.max_draft, limit)
        return self.runtime.draft(session.lane, [*session.tokens, next_token], k)
