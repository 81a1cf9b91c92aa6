"""Where a worker's time goes: the edge loop's parts and a turn's.

Why: whether a worker keeps up with its engine is a question of where a
turn's time goes besides ``llama_decode``. Every part keeps a running sum
of seconds since start (a ``time.perf_counter`` pair each, ~0.1 us), and
``stats`` reports them as ``profile``; two snapshots a run apart give the
per-turn table (``scripts/bench_serving.py`` at its highest concurrency,
``scripts/bench_stages.py --pinned`` per stage).

- ``loop`` (``EdgeServer.timing``): ``poll`` (waiting for messages: idle),
  ``receive`` (receiving, decoding and handling requests), ``turn`` (the
  service's turns), ``send`` (replies out), ``housekeeping``.
- ``turn``, inside the loop's ``turn``: ``decode`` (llama_decode), ``fill``
  (the batch), ``rows`` (logits, sampling, outputs), ``complete`` (jobs
  advancing: stop checks, signals, stream events), ``plan`` (reap, admit,
  plan), ``render`` (typed results to reply headers), and on a stage
  ``launch`` (its own forward and the send down the chain; ``decode`` is
  part of it) and ``land_wait`` (blocked for the chain's answers).
"""

from __future__ import annotations

import time
from typing import Any

from .core.outcomes import SchedulerStats
from .runtime import RuntimeState


class Profile:
    def __init__(self) -> None:
        self.loop: dict[str, float] | None = None  # EdgeServer.timing, set by the process main
        self.render_s = 0.0
        self.started = time.perf_counter()

    def snapshot(self, rt: RuntimeState, stats: SchedulerStats) -> dict[str, Any]:
        parts = {**rt.engine.timing, "rows": rt.rows_s, **stats.timing, "render": self.render_s}
        return {
            "wall_s": round(time.perf_counter() - self.started, 6),
            "forwards": stats.forwards,
            "loop": {k: round(v, 6) for k, v in (self.loop or {}).items()},
            "turn": {k: round(v, 6) for k, v in parts.items()},
        }
