"""Scheduler counters for ``stats``: admissions, throughput, batch shapes.

Throughput is a sliding 10 s window of (time, prefill tokens, decode tokens)
per forward; occupancy is a histogram of tokens per forward in power-of-two
buckets. Everything is bounded: the window drops old entries, the histogram
has fixed buckets.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

WINDOW_S = 10.0
_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)

# Told of every forward: (steps, tokens, seconds). Metrics export hooks in here.
ForwardObserver = Callable[[int, int, float], None]


class _StepLike(Protocol):
    @property
    def tokens(self) -> Sequence[int]: ...

    @property
    def sample(self) -> bool: ...


class SchedulerStats:
    def __init__(self) -> None:
        self.admitted = 0
        self.rejected = 0
        self.cancelled = 0
        self.expired = 0
        self.forwards = 0
        self.decode_steps = 0
        self.coalesced_steps = 0
        self.occupancy = [0] * len(_BUCKETS)
        self._window: deque[tuple[float, int, int]] = deque()
        self._turn_s_total = 0.0
        self._recent_forwards: deque[float] = deque(maxlen=1024)
        self._queue_wait_s = 0.0
        self._queue_waits = 0
        self.observer: ForwardObserver | None = None

    def record_forward(self, steps: Sequence[_StepLike], seconds: float) -> None:
        decode = sum(1 for s in steps if len(s.tokens) == 1 and s.sample)
        total = sum(len(s.tokens) for s in steps)
        self.forwards += 1
        self._turn_s_total += seconds
        self._recent_forwards.append(seconds)
        self.decode_steps += decode
        if decode > 1:
            self.coalesced_steps += decode
        for i, edge in enumerate(_BUCKETS):
            if total <= edge or i == len(_BUCKETS) - 1:
                self.occupancy[i] += 1
                break
        now = time.monotonic()
        self._window.append((now, total - decode, decode))
        while self._window and now - self._window[0][0] > WINDOW_S:
            self._window.popleft()
        if self.observer is not None:
            self.observer(len(steps), total, seconds)

    def record_queue_wait(self, seconds: float) -> None:
        self._queue_wait_s += seconds
        self._queue_waits += 1

    def mean_turn_ms(self) -> float:
        return 1000 * self._turn_s_total / self.forwards if self.forwards else 50.0

    def _forward_percentiles(self) -> dict[str, float]:
        """p50/p99/max of the last 1024 forwards: how long a ping may wait."""
        if not self._recent_forwards:
            return {"p50": 0.0, "p99": 0.0, "max": 0.0}
        ordered = sorted(self._recent_forwards)

        def pick(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

        return {
            "p50": round(pick(0.5) * 1000, 3),
            "p99": round(pick(0.99) * 1000, 3),
            "max": round(ordered[-1] * 1000, 3),
        }

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        recent = [w for w in self._window if now - w[0] <= WINDOW_S]
        span = max(1e-3, min(WINDOW_S, now - recent[0][0])) if recent else WINDOW_S
        return {
            "admitted": self.admitted,
            "rejected": self.rejected,
            "cancelled": self.cancelled,
            "expired": self.expired,
            "forwards": self.forwards,
            "mean_forward_ms": round(self.mean_turn_ms(), 3),
            "forward_ms": self._forward_percentiles(),
            "mean_queue_ms": round(1000 * self._queue_wait_s / max(1, self._queue_waits), 3),
            "tokens_per_s": {
                "prefill": round(sum(w[1] for w in recent) / span, 2),
                "decode": round(sum(w[2] for w in recent) / span, 2),
            },
            "decode_coalescing_rate": round(self.coalesced_steps / max(1, self.decode_steps), 4),
            "decode_steps": self.decode_steps,
            "coalesced_decode_steps": self.coalesced_steps,
            "batch_occupancy": {str(b): n for b, n in zip(_BUCKETS, self.occupancy, strict=True)},
        }
