"""Which layers of a model use a sliding window, and what that forbids a slice.

Gemma 3 derives a layer's kind from its index (dense when ``(il + 1) % 6 ==
0``), so a slice writes the pattern out explicitly (``slicer.py``), and a
slice must keep at least one sliding-window layer (``range_problem``).
"""

from __future__ import annotations

_SWA_PATTERN_EVERY = {"gemma3": 6}  # dense layer when (il + 1) % n == 0


def swa_pattern(arch: str, lo: int, hi: int) -> list[bool] | None:
    """The sliding-window flag of source layers ``lo .. hi-1`` (None: no SWA)."""
    every = _SWA_PATTERN_EVERY.get(arch)
    if every is None:
        return None
    return [(il + 1) % every != 0 for il in range(lo, hi)]


def range_problem(arch: str, lo: int, hi: int) -> str | None:
    """Why llama.cpp could not load a slice of layers ``lo .. hi-1``, or None.

    A Gemma 3 model is built with a sliding-window KV cache beside the dense
    one, and llama.cpp asserts (aborting the process) that a model of that
    architecture has at least one sliding-window layer: a slice of dense
    layers only (e.g. ``17:18``: layer 17 is dense) cannot be loaded."""
    pattern = swa_pattern(arch, lo, hi)
    if pattern is not None and not any(pattern):
        return (
            f"layers {lo}:{hi} of a {arch} model are all dense (every {_SWA_PATTERN_EVERY[arch]}th "
            "layer is): llama.cpp needs at least one sliding-window layer in a slice"
        )
    return None
