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
