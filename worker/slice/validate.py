"""Checking a stage slice layer by layer (``skiff-slice --validate``).

The full model and the slice run one prompt, every layer's output
(``l_out-N``) captured, and the first layer whose output differs is named.
The slice is fed the full model's input to layer LO (the rows it would get
from the stage before it), so a slice that starts past layer 0 is checked
on exactly what it computes in a chain. Cutting the slice is ``slicer.py``'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

DEFAULT_PROMPT = "The lighthouse keeper climbed the stairs every evening, and the sea"


def first_difference(
    src: Path, sliced: Path, lo: int, hi: int, text: str = "", threads: int = 1
) -> str | None:
    """The first layer of ``[lo, hi)`` whose output differs between ``src``
    and its slice ``sliced`` (``None`` when every layer is bit-identical).
    Rows do not depend on the thread count (docs/exactness.md): one thread
    is enough for one prompt, and never waits on a busy core's barrier."""
    prompt = text or DEFAULT_PROMPT
    full = layer_outputs(str(src), prompt, None, range(max(0, lo - 1), hi), threads)
    feed = full.get(lo - 1) if lo > 0 else None
    part = layer_outputs(str(sliced), prompt, feed, range(0, hi - lo), threads)
    for k in range(hi - lo):
        a, b = full[lo + k], part[k]
        if a.shape != b.shape or not np.array_equal(a, b):
            diff = float(np.max(np.abs(a - b))) if a.shape == b.shape else float("inf")
            return f"layer {lo + k} (slice layer {k}) differs: max |diff| {diff:.4g}"
    return None


def layer_outputs(
    model_path: str, prompt: str, feed: np.ndarray | None, layers: Iterable[int], threads: int = 1
) -> dict[int, np.ndarray]:
    """Every asked layer's output (``l_out-N``, all rows) for one prompt.

    With ``feed`` (``[tokens, n_embd]``) the model takes those rows as input
    instead of the prompt's tokens (a slice that starts past layer 0). The
    graph stops after the last layer asked, as on a stage: a slice's spare
    block and stand-in head are never computed.
    """
    from ..engine import Engine, EngineConfig, EngineError, Segment  # loads llama.cpp

    config = EngineConfig(
        model_path,
        n_ctx=2048,
        n_seq=1,
        n_threads=threads,
        tap_layers=tuple(layers),
        tap_stop=True,
    )
    engine = Engine(config)
    try:
        tokens = engine.tokenize(prompt)
        if feed is not None:
            segment = Segment(0, [-1] * len(feed), 0, "all", np.ascontiguousarray(feed))
        else:
            segment = Segment(0, tokens, 0, "all")
        status = engine.decode([segment])
        if not status.ok:
            raise EngineError(f"llama_decode: {status.describe()}")
        return engine.take_taps()
    finally:
        engine.close()
