"""Sampling the rows of a scored span (``verify``, speculative decoding).

A span ``[t0, d1..dk]`` is scored in one forward; row ``i`` gives the
model's token after the span's first ``i + 1`` tokens. ``accept`` is the one
rule for walking those rows: sample in order and stop at the first row that
disagrees with its draft, or samples a stop token, so a stateful sampler
(RNG, penalties, grammar) consumes exactly what plain decoding would have.

The rule runs where the logits are: in this process for a whole model, on
the last stage of a pipeline otherwise (a ``RowRule`` travels with the
step), and the job reads the outcome from ``StepResult.row_tokens`` either
way, so both paths sample the same rows the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


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

    def to_wire(self) -> dict[str, Any]:
        return {
            "checks": list(self.checks),
            "until_mismatch": self.until_mismatch,
            "stop_tokens": list(self.stop_tokens),
            "stop_eog": self.stop_eog,
        }


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
