"""Pure maths of a load test: per-request records, percentiles, arrivals, summary.

Nothing here does I/O, so the figures can be unit-tested exactly. Times in a
``RequestRecord`` are seconds since the start of the run; every latency in a
summary is in milliseconds.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

QUANTILES = (50.0, 90.0, 99.0)


@dataclass
class RequestRecord:
    """What the client saw of one request."""

    index: int
    endpoint: str = ""
    t_send: float = 0.0
    t_first: float | None = None  # first token event arrived
    t_end: float = 0.0  # final reply (or error) arrived
    token_times: list[float] = field(default_factory=list)
    n_tokens: int = 0  # completion tokens received
    prompt_tokens: int | None = None  # from the final reply's usage
    finish_reason: str | None = None
    error: str | None = None  # error code; None for a completed stream
    server_timings: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_send

    @property
    def e2e_s(self) -> float:
        return self.t_end - self.t_send

    def gaps_s(self) -> list[float]:
        """Inter-token gaps: the time between consecutive token events."""
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear interpolation between ranks.

    Same definition as ``numpy.percentile``'s default: for sorted ``v`` of
    length ``n`` the rank is ``q/100 * (n-1)``. Raises on an empty sequence.
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} is outside [0, 100]")
    s = sorted(values)
    rank = q / 100.0 * (len(s) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (rank - lo)


def distribution(values: Sequence[float], scale: float = 1.0) -> dict[str, float | int | None]:
    """``n``, ``mean``, ``min``, ``p50``, ``p90``, ``p99``, ``max`` of ``values * scale``.

    An empty sequence gives ``n = 0`` and ``None`` for every figure.
    """
    out: dict[str, float | int | None] = {"n": len(values)}
    keys = ["mean", "min", *(f"p{q:g}" for q in QUANTILES), "max"]
    if not values:
        out.update({k: None for k in keys})
        return out
    scaled = [v * scale for v in values]
    out["mean"] = sum(scaled) / len(scaled)
    out["min"] = min(scaled)
    for q in QUANTILES:
        out[f"p{q:g}"] = percentile(scaled, q)
    out["max"] = max(scaled)
    return out


def poisson_arrivals(
    rate: float, n: int | None = None, duration: float | None = None, seed: int = 0
) -> list[float]:
    """Arrival times (s from 0) of a Poisson process of ``rate`` per second.

    Inter-arrival gaps are exponential with mean ``1 / rate``, from a seeded
    numpy generator, so the schedule is reproducible. Stops after ``n``
    arrivals and/or before ``duration``; at least one bound is required.
    """
    if rate <= 0:
        raise ValueError("rate must be positive")
    if n is None and duration is None:
        raise ValueError("poisson_arrivals needs n and/or duration")
    rng = np.random.default_rng(seed)
    out: list[float] = []
    t = 0.0
    while n is None or len(out) < n:
        t += float(rng.exponential(1.0 / rate))
        if duration is not None and t >= duration:
            break
        out.append(t)
    return out


def timeline(
    records: Sequence[RequestRecord], wall_s: float, bin_s: float | None = None
) -> dict[str, Any]:
    """Output tokens per second in consecutive time bins over the run."""
    if bin_s is None:
        bin_s = max(0.25, round(wall_s / 50, 2))
    n_bins = max(1, math.ceil(wall_s / bin_s)) if wall_s > 0 else 1
    counts = [0] * n_bins
    for rec in records:
        for t in rec.token_times:
            counts[min(n_bins - 1, max(0, int(t / bin_s)))] += 1
    return {
        "bin_s": bin_s,
        "t_s": [round(i * bin_s, 6) for i in range(n_bins)],
        "output_tok_s": [c / bin_s for c in counts],
    }


def summarize(
    records: Sequence[RequestRecord], wall_s: float, config: dict[str, Any] | None = None
) -> dict[str, Any]:
    """All figures of a run as one JSON-ready dict.

    Latency figures are over completed requests only; token and throughput
    counts include every token received (also from requests that failed
    part-way). ``wall_s`` is the run's duration, start to last reply.
    """
    ok = [r for r in records if r.ok]
    warm = int((config or {}).get("concurrency") or 0)
    errors = Counter(r.error for r in records if r.error is not None)
    finish = Counter(r.finish_reason for r in ok if r.finish_reason is not None)
    out_tokens = sum(r.n_tokens for r in records)
    ttft = [t for r in ok if (t := r.ttft_s) is not None]
    e2e = [r.e2e_s for r in ok]
    gaps = [g for r in ok for g in r.gaps_s()]
    tpot = [
        (r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1)
        for r in ok
        if len(r.token_times) > 1
    ]
    server: dict[str, Any] = {}
    for key in sorted({k for r in ok for k in r.server_timings}):
        server[key] = distribution([r.server_timings[key] for r in ok if key in r.server_timings])
    rate = 1.0 / wall_s if wall_s > 0 else 0.0
    return {
        "config": dict(config or {}),
        "duration_s": wall_s,
        "requests": {
            "sent": len(records),
            "ok": len(ok),
            "errors": sum(errors.values()),
            "error_codes": dict(sorted(errors.items())),
            "finish_reasons": dict(sorted(finish.items())),
        },
        "tokens": {
            "output": out_tokens,
            "prompt": sum(r.prompt_tokens or 0 for r in records),
        },
        "throughput": {
            "output_tok_s": out_tokens * rate,
            "requests_per_s": len(ok) * rate,
        },
        "ttft_ms": distribution(ttft, 1e3),
        # Closed loop: the first `concurrency` requests all start at t=0 and
        # share the first prefills; later ones arrive staggered (steady state).
        "ttft_steady_ms": distribution(
            [t for r in ok if r.index >= warm and (t := r.ttft_s) is not None], 1e3
        ),
        "itl_ms": distribution(gaps, 1e3),
        "tpot_ms": distribution(tpot, 1e3),
        "e2e_ms": distribution(e2e, 1e3),
        "server_timings_ms": server,
        "timeline": timeline(records, wall_s),
        "samples": {
            "ttft_ms": [t * 1e3 for t in ttft],
            "e2e_ms": [t * 1e3 for t in e2e],
        },
    }
