"""Turning ``--layers`` / ``--next`` into a stage: its sliced model, its tap, its link.

A stage holding layers ``[LO, HI)``:
- without ``--next`` it must hold the model's last layer; it loads the slice
  ``[LO, HI)`` and samples;
- with ``--next`` its slice adds block ``HI`` (a stand-in) and the stage taps
  the output of layer ``HI - 1`` (slice numbering ``HI - LO - 1``), stopping
  the graph there: the extra block only keeps the tapped one from being the
  graph's last (whose rows llama.cpp trims to the rows asked for logits).

Slices are cut once and cached beside the source model (``slicer.cached_slice``)
and hold only what the stage reads (the embedding on the first, the head on
the last; stand-ins elsewhere); the engine then lets go of the pages llama.cpp
faulted in at load (``page_on_demand``), so a stage's resident model pages are
the ones it reads.
A stage's KV cache is laid out as a whole worker's (one stream per lane
unless ``--ctx-per-lane`` asks for more than an equal share), so a session's
cells sit in the same order and its attention sums match bit for bit; the
engine maps the tap's rows back to batch order (``engine/tap.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.sockets import Curve

from ..config import WorkerConfig, curve_keys
from ..models import resolve_model
from ..slice.slicer import SliceError, cached_slice, check_arch, model_info, parse_range
from ..slice.swa import range_problem
from .link import StageLink


@dataclass(frozen=True)
class StagePlan:
    layers: tuple[int, int]
    n_layer: int  # of the whole model
    model_path: Path  # the slice this stage loads (stage_parts: what it holds)
    tap_layer: int | None  # slice-numbered layer handed to the next stage
    next: str
    frame_dtype: str = "f32"
    curve: Curve | None = None  # CURVE on: own pair, server_key = the next stage's key

    @property
    def first(self) -> bool:
        return self.layers[0] == 0

    def info(self) -> dict[str, Any]:
        return {
            "layers": list(self.layers),
            "n_layer": self.n_layer,
            "next": self.next or None,
            "first": self.first,
            "last": not self.next,
            "frame_dtype": self.frame_dtype,
            "slice": self.model_path.name,
            # the head dials the last stage directly (3+ stages) with this key
            **({"curve_key": self.curve.public_key.decode()} if self.curve else {}),
        }


def plan_stage(cfg: WorkerConfig) -> StagePlan | None:
    """The stage ``cfg`` asks for (None: a whole-model worker)."""
    if not cfg.layers:
        if cfg.next:
            raise SystemExit("skiff-worker: --next needs --layers")
        return None
    source = resolve_model(cfg.model)
    try:
        lo, hi = parse_range(cfg.layers)
        arch, n_layer = model_info(source)
        check_arch(arch)  # before hashing and slicing the file
        if not 0 <= lo < hi <= n_layer:
            raise SliceError(f"--layers {lo}:{hi} is not a range of the model's {n_layer} layers")
        problem = range_problem(arch, lo, hi)
        if problem is not None:
            raise SliceError(problem)
        if cfg.next and hi == n_layer:
            raise SliceError("the stage holding the last layer samples: it takes no --next")
        if not cfg.next and hi != n_layer:
            raise SliceError(f"a stage without --next must hold the last layer ({n_layer})")
        path = cached_slice(source, lo, hi)
    except SliceError as exc:
        raise SystemExit(f"skiff-worker: {exc}") from None
    tap = hi - lo - 1 if cfg.next else None
    return StagePlan((lo, hi), n_layer, path, tap, cfg.next, cfg.frame_dtype, curve_keys(cfg))


def link_for(plan: StagePlan) -> StageLink | None:
    if not plan.next:
        return None
    return StageLink(plan.next, frame_dtype=plan.frame_dtype, head=plan.first, curve=plan.curve)
