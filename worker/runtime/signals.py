"""Per-token confidence signals and log-probabilities from a logits row.

All figures are over the model's raw distribution (softmax of the logits,
before any sampler in the chain), in natural-log units, so they describe
what the model believed, not what the sampler did with it.

The row has 262k entries; everything here is a few vectorised passes
(max, exp, sum, two argmax), about a millisecond, which is why only named
sessions (``signal``/``signal_window``) and requests that ask for
``logprobs`` pay for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from faults import BadRequest

HIGH_ENTROPY_NATS = 3.0


@dataclass(frozen=True)
class TokenSignal:
    token: int
    entropy: float
    top_token: int
    top_logprob: float
    second_token: int
    second_logprob: float

    @property
    def margin(self) -> float:
        return self.top_logprob - self.second_logprob

    def as_dict(self) -> dict[str, Any]:
        return {
            "token": self.token,
            "entropy": self.entropy,
            "top_token": self.top_token,
            "top_logprob": self.top_logprob,
            "second_token": self.second_token,
            "second_logprob": self.second_logprob,
            "margin": self.margin,
        }


def _log_z(row: np.ndarray) -> tuple[float, np.ndarray]:
    peak = float(row.max())
    shifted = np.exp(row - peak, dtype=np.float64)
    return peak + float(np.log(shifted.sum())), shifted


def signal_of(row: np.ndarray, token: int) -> TokenSignal:
    """Entropy and top-2 of the distribution the sampled ``token`` came from."""
    log_z, shifted = _log_z(row)
    probs = shifted / shifted.sum()
    logp = row.astype(np.float64) - log_z
    entropy = float(-(probs * logp).sum())
    top = int(np.argmax(row))
    saved = row[top]
    masked = row.copy() if not row.flags.writeable else row
    masked[top] = -np.inf
    second = int(np.argmax(masked))
    masked[top] = saved
    return TokenSignal(token, entropy, top, float(logp[top]), second, float(logp[second]))


def logprobs_of(row: np.ndarray, token: int, top_k: int) -> dict[str, Any]:
    """The sampled token's logprob and the ``top_k`` most likely tokens."""
    log_z, _ = _log_z(row)
    out: dict[str, Any] = {"logprob": float(row[token]) - log_z}
    if top_k > 0:
        idx = np.argpartition(row, -top_k)[-top_k:]
        idx = idx[np.argsort(row[idx])[::-1]]
        out["top_logprobs"] = [{"token": int(i), "logprob": float(row[i]) - log_z} for i in idx]
    return out


def window_summary(
    history: Sequence[TokenSignal], window: int, high_entropy: float = HIGH_ENTROPY_NATS
) -> dict[str, Any]:
    """Aggregates over the last ``window`` sampled tokens of a session."""
    recent = list(history)[-window:] if window > 0 else []
    if not recent:
        return {
            "token_count": 0,
            "mean_entropy": None,
            "max_entropy": None,
            "mean_margin": None,
            "min_margin": None,
            "high_entropy_count": 0,
            "repetition_count": 0,
        }
    entropies = [s.entropy for s in recent]
    margins = [s.margin for s in recent]
    seen: set[int] = set()
    repeats = 0
    for s in recent:
        repeats += s.token in seen
        seen.add(s.token)
    return {
        "token_count": len(recent),
        "mean_entropy": float(np.mean(entropies)),
        "max_entropy": float(np.max(entropies)),
        "mean_margin": float(np.mean(margins)),
        "min_margin": float(np.min(margins)),
        "high_entropy_count": sum(1 for e in entropies if e > high_entropy),
        "repetition_count": repeats,
    }


def session_signals(
    history: Sequence[TokenSignal], op: str, window_tokens: int, name: str
) -> dict[str, Any]:
    """``signal`` (the last sampled token's of session ``name``) or ``signal_window``."""
    if op == "signal_window":
        return window_summary(history, window_tokens)
    if not history:
        raise BadRequest(f"session {name!r} has no sampled token yet")
    return history[-1].as_dict()
