"""Where to cut a model into pipeline stages: from each layer's measured cost.

A split by layers pays only as far as its stages are equal: a pipeline runs
at the pace of its slowest stage. Layers of one model cost about the same,
but the head does not: the last stage also runs the output norm and the
head (``n_vocab`` rows), which in the packaged Gemma 3 270M (262,144 rows,
tied to the embedding) costs more than all 18 layers together. So the cut
is chosen from measurements, not from the layer count.

``measure`` decodes one token in each of ``rows`` lanes (a decode step of
that batch size, after a short prompt per lane) with the layer tap reading
every layer's output and stamping the time: layer ``k`` costs the time from
the read of layer ``k - 1`` (or the start, for layer 0: it includes the
token embedding) to its own; the head is the rest of the decode. Reading
each layer adds a sync point per layer, a small and even overhead. The
median over ``repeats`` decodes is kept.

``best_cuts`` then splits ``[layer costs..., head]`` into ``stages``
contiguous parts (the head always in the last) minimising the largest part:
the split a pipeline of that many stages runs fastest on, and the bound on
its gain, total / largest part, before hops and smaller batches.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import numpy as np

from .swa import range_problem


@dataclass(frozen=True)
class Costs:
    """Milliseconds per decode step of ``rows`` rows: per layer, and the head."""

    rows: int
    layers: tuple[float, ...]
    head: float
    arch: str = ""  # the model's architecture: which ranges a slice may hold

    def loadable(self, lo: int, hi: int) -> bool:
        """Whether llama.cpp can load a slice of layers ``lo .. hi-1``."""
        return range_problem(self.arch, lo, hi) is None

    @property
    def total(self) -> float:
        return sum(self.layers) + self.head


@dataclass(frozen=True)
class Split:
    """Stage boundaries (stage i holds layers ``cuts[i]:cuts[i + 1]``), the
    cost of each stage, and the bound on a pipeline's gain over one worker."""

    cuts: tuple[int, ...]
    stage_ms: tuple[float, ...]

    @property
    def bound(self) -> float:
        return sum(self.stage_ms) / max(self.stage_ms)

    def ranges(self) -> list[str]:
        return [f"{lo}:{hi}" for lo, hi in zip(self.cuts, self.cuts[1:], strict=False)]


def best_cuts(
    costs: Costs, stages: int, allowed: Callable[[int, int], bool] | None = None
) -> Split:
    """The contiguous split into ``stages`` (each at least one layer, the head
    with the last) whose most expensive stage is cheapest; ``allowed(lo, hi)``
    may rule ranges out (a Gemma 3 slice of dense layers only cannot load)."""
    n = len(costs.layers)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} layers into {stages} stages")
    prefix = np.concatenate([[0.0], np.cumsum(costs.layers)])

    def part(lo: int, hi: int) -> float:
        if allowed is not None and not allowed(lo, hi):
            return float("inf")
        return float(prefix[hi] - prefix[lo]) + (costs.head if hi == n else 0.0)

    @cache
    def solve(lo: int, left: int) -> tuple[float, tuple[int, ...]]:
        """(largest part, cut points after lo) for layers lo: split in ``left`` parts."""
        if left == 1:
            return part(lo, n), ()
        best: tuple[float, tuple[int, ...]] = (float("inf"), ())
        for hi in range(lo + 1, n - left + 2):
            rest, cuts = solve(hi, left - 1)
            worst = max(part(lo, hi), rest)
            if worst < best[0]:
                best = (worst, (hi, *cuts))
        return best

    worst, inner = solve(0, stages)
    if worst == float("inf"):
        raise ValueError(f"no split of {n} layers into {stages} stages can be loaded")
    cuts = (0, *inner, n)
    stage_ms = tuple(part(lo, hi) for lo, hi in itertools.pairwise(cuts))
    return Split(cuts, stage_ms)


def measure(model_path: str, rows: int = 4, repeats: int = 12, threads: int = 1) -> Costs:
    """Each layer's and the head's cost in a decode step of ``rows`` rows."""
    from ..engine import Engine, EngineConfig, EngineError, Segment  # loads llama.cpp

    probe = Engine(EngineConfig(model_path, n_ctx=256, n_seq=1, n_threads=threads))
    n_layer = probe.n_layer
    probe.close()
    engine = Engine(
        EngineConfig(
            model_path,
            n_ctx=256 * rows,
            n_seq=rows,
            n_threads=threads,
            tap_layers=tuple(range(n_layer)),
        )
    )
    try:
        assert engine.tap is not None
        prompt = engine.tokenize("The lighthouse keeper climbed the stairs every evening")[:12]
        for lane in range(rows):
            status = engine.decode([Segment(lane, prompt, 0, "last")])
            if not status.ok:
                raise EngineError(f"llama_decode: {status.describe()}")
        samples: list[list[float]] = []
        for step in range(repeats + 2):
            position = len(prompt) + step
            batch = [Segment(lane, [prompt[step % len(prompt)]], position) for lane in range(rows)]
            start = time.perf_counter()
            status = engine.decode(batch)
            end = time.perf_counter()
            if not status.ok:
                raise EngineError(f"llama_decode: {status.describe()}")
            marks = [engine.tap.read_at[k] for k in range(n_layer)]
            edges = [start, *marks, end]
            samples.append([b - a for a, b in itertools.pairwise(edges)])
        kept = samples[2:]  # the first decodes warm caches and graphs up
        medians = [statistics.median(s[i] for s in kept) * 1e3 for i in range(n_layer + 1)]
        arch = str(engine.metadata("general.architecture") or "")
        return Costs(rows, tuple(medians[:n_layer]), medians[n_layer], arch)
    finally:
        engine.close()


def report(costs: Costs, stages: int) -> str:
    """The table ``skiff-slice --balance`` prints."""
    split = best_cuts(costs, stages, costs.loadable)
    lines = [
        f"decode step of {costs.rows} rows: {costs.total:.2f} ms "
        f"(layers {sum(costs.layers):.2f} ms, head {costs.head:.2f} ms = "
        f"{costs.head / costs.total:.0%})",
        "per layer ms: " + " ".join(f"{c:.2f}" for c in costs.layers),
        f"best split into {stages}: --layers {' | '.join(split.ranges())}",
        "stage ms: " + " | ".join(f"{c:.2f}" for c in split.stage_ms),
        f"pipeline bound (total / slowest stage, before hops and smaller batches): "
        f"{split.bound:.2f}x",
    ]
    return "\n".join(lines)
