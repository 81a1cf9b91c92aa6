"""Speculative decoding helpers: n-gram prompt lookup and draft acceptance.

Prompt lookup drafts tokens from the session's own history: find the most
recent earlier occurrence of the last ``ngram`` tokens and propose what
followed it. It needs no extra model and shines on edits of given text.

Acceptance is exact: the target samples position by position and a draft
token is kept only while it equals what the target itself produced, so the
output is the output without speculation (up to batch-shape numerics). The
rule itself (``accept``) lives in ``runtime.steps``, where the rows are
sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "AUTO_MAX_DRAFT",
    "AUTO_NGRAM",
    "DraftModel",
    "Drafter",
    "NgramIndex",
    "PromptLookup",
    "accept",
    "lookup_draft",
]

from ..runtime import DraftRuntime, Session
from ..runtime.steps import accept


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
    """Proposes up to ``limit`` tokens to follow ``next_token`` in ``session``.

    ``streams`` is how many streams decode in the forward being planned: a
    drafter may decline when extra rows would not pay (``PromptLookup``'s
    automatic mode).
    """

    def draft(
        self, session: Session, next_token: int, limit: int, streams: int = 1
    ) -> list[int]: ...


class NgramIndex:
    """``lookup_draft`` without rescanning the history on every token.

    Every start of an ``ngram`` that has a token after it is indexed once,
    as the history grows; each key keeps its starts in order, so the latest
    earlier match is the last. A job's own rejected drafts are cut from the
    session between two calls: the history is compared with the indexed
    copy over its last ``slack`` tokens only (nothing older can change while
    the job holds the session), and the starts past the first difference are
    dropped. The drafts equal ``lookup_draft``'s (``tests/test_speculative.py``).
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
# in prose, and drafts of up to 32 (a job shares them with the forward's
# other streams: ``MAX_SPAN_ROWS``) let quoting and repetition pay at length.
AUTO_NGRAM = 5
AUTO_MAX_DRAFT = 32


class PromptLookup:
    """Drafts from the session's own history (``NgramIndex``), per job.

    Asked for (``speculative: {"mode": "prompt_lookup"}``) it always drafts
    what it finds. Turned on by the worker (``--speculate auto``,
    ``max_streams`` set) it drafts only while at most ``max_streams``
    streams decode in the forward, where extra rows cost little, and sizes
    its drafts by what the target kept: a draft kept whole doubles the next
    (from 4 up to ``max_draft``), one kept in part sets it to what was kept
    plus one, and after a draft of which nothing was kept it rests for 1, 2,
    4, ... up to 16 tokens. Every row of a span is scored with the whole
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
