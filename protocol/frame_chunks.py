"""A tensor frame in token chunks: slice one without copying, combine chunks into one.

``slice_frame`` cuts tokens ``[start, end)`` out of every part that has a
token axis and keeps the rest whole; the result is a frame over the same
memory (byte strides and an offset, ``protocol/frames.py``), held to the
same checks as any other. ``combine_frames`` is its inverse: chunks of one
logical frame joined along the token axis into fresh buffers, refusing
chunks that disagree on anything but their token length.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Final

import numpy as np

from .frame_limits import FrameError
from .frames import Frame, Part, PartSpec, make_frame, recheck

# Header fields every chunk of one logical frame carries unchanged.
_SHARED: Final = ("producer_stage", "layer_start", "layer_end", "sequence_count")


def slice_frame(frame: Frame, start: int, end: int) -> Frame:
    """Tokens ``[start, end)`` of every part with a token axis, over the same memory.

    Parts without a token axis (e.g. per-sequence state) are kept whole.
    """
    valid = all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end))
    if not valid or not 0 <= start <= end <= frame.token_count:
        raise FrameError("token_range", f"[{start}, {end}) is not within [0, {frame.token_count}]")
    parts = []
    for p in frame.parts:
        if p.token_axis < 0:
            parts.append(p)
            continue
        dims = list(p.dims)
        dims[p.token_axis] = end - start
        nbytes = math.prod(dims) * p.itemsize
        # An empty part keeps its old (known in-bounds) offset: start * stride
        # could point past the end of the buffer when nothing is left.
        offset = p.offset + start * p.byte_strides[p.token_axis] if nbytes else p.offset
        parts.append(replace(p, dims=tuple(dims), offset=offset, nbytes=nbytes))
    positions = None if frame.positions is None else frame.positions[start:end]
    return recheck(replace(frame, token_count=end - start, positions=positions, parts=tuple(parts)))


def combine_frames(frames: Sequence[Frame]) -> Frame:
    """Concatenate frames along the token axis into fresh buffers (one per part).

    The frames must be chunks of one logical frame: same stage, layers and
    sequence count, and the same parts differing only in their token length.
    """
    if not frames:
        raise FrameError("frames", "nothing to combine")
    first = frames[0]
    for other in frames[1:]:
        for name in ("version", *_SHARED):
            a, b = getattr(first, name), getattr(other, name)
            if a != b:
                raise FrameError(name, f"frames disagree: {a} vs {b}")
        if other.identities != first.identities:
            raise FrameError("parts", f"frames disagree: {first.identities} vs {other.identities}")
        if (first.positions is None) != (other.positions is None):
            raise FrameError("positions", "present in some frames but not all")
        for i, (a_part, b_part) in enumerate(zip(first.parts, other.parts, strict=True)):
            _check_combinable(first, a_part, other, b_part, f"parts[{i}]")
    specs: list[PartSpec] = []
    for p in first.parts:
        if p.token_axis < 0:
            arr = first.array(p.identity).copy()
        else:
            arr = np.concatenate([f.array(p.identity) for f in frames], axis=p.token_axis)
        specs.append((p.identity, arr, p.token_axis, p.dtype))
    positions = None if first.positions is None else [x for f in frames for x in f.positions or ()]
    shared = {name: getattr(first, name) for name in _SHARED}
    return make_frame(
        specs, positions=positions, token_count=sum(f.token_count for f in frames), **shared
    )


def _check_combinable(first: Frame, a: Part, other: Frame, b: Part, where: str) -> None:
    if a.dtype != b.dtype:
        raise FrameError(f"{where}.dtype", f"frames disagree: {a.dtype} vs {b.dtype}")
    if len(a.dims) != len(b.dims):
        raise FrameError(f"{where}.dims", f"ranks disagree: {len(a.dims)} vs {len(b.dims)}")
    if a.token_axis != b.token_axis:
        raise FrameError(f"{where}.token_axis", f"disagree: {a.token_axis} vs {b.token_axis}")
    if any(
        x != y for k, (x, y) in enumerate(zip(a.dims, b.dims, strict=True)) if k != a.token_axis
    ):
        raise FrameError(f"{where}.dims", f"non-token dims disagree: {a.dims} vs {b.dims}")
    if a.token_axis < 0 and first.array(a.identity).tobytes() != other.array(b.identity).tobytes():
        raise FrameError(where, "has no token axis, so it must be identical in every frame")
