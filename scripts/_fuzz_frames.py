"""Tensor frames for ``scripts/fuzzcases.py``: valid ones, then corrupted.

Why a module of its own: the ``frame`` case family is its own world, a
frame descriptor (dims, strides, offsets, nbytes, buffer index, token axis,
...) and the buffers it points into, each corrupted in ways a frame parser
must refuse. Plain functions of the run's random generator, like the values
of ``_fuzz_values.py`` (whose keys and scalars they also plant in a
descriptor).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
from _fuzz_values import EDGE_INTS, key, scalar

from protocol import frames

PART_FIELDS = (
    "dims",
    "dims",
    "byte_strides",
    "byte_strides",
    "offset",
    "offset",
    "nbytes",
    "buffer",
    "token_axis",
    "dtype",
    "identity",
)
FRAME_FIELDS = (
    "version",
    "producer_stage",
    "layer_start",
    "layer_end",
    "token_count",
    "sequence_count",
    "positions",
    "parts",
)


def frame(
    rng: random.Random, identity: str, dims: Sequence[int], dtype: str = "f32", **kw: Any
) -> tuple[dict[str, Any], list[bytes]]:
    """A valid frame header and its buffers (random contents)."""
    np_dtype = frames.DTYPES[dtype]
    count = math.prod(dims)
    raw = np.frombuffer(rng.randbytes(count * np_dtype.itemsize), np_dtype)
    if dtype in ("f32", "f16") and rng.random() < 0.9:  # mostly finite rows
        raw = np.nan_to_num(raw, posinf=1.0, neginf=-1.0).clip(-10, 10).astype(np_dtype)
    built = frames.make_frame([(identity, raw.reshape(dims), 0, dtype)], **kw)
    out: list[Any] = []
    header = frames.attach(built, out)
    return header, [bytes(b) for b in out]


def mutate_frame_in(rng: random.Random, args: Any) -> None:
    """Corrupt the frame descriptor the args carry (under frame / input), in place."""
    if not isinstance(args, dict):
        return
    name = "input" if "input" in args else "frame"
    header = args.get(name)
    if not isinstance(header, dict) or rng.random() < 0.15:
        return
    parts = header.get("parts")
    if rng.random() < 0.75 and isinstance(parts, list) and parts:
        part = rng.choice(parts)
        fld = rng.choice(PART_FIELDS)
        part[fld] = frame_value(rng, fld, part)
    else:
        fld = rng.choice(FRAME_FIELDS)
        if fld == "positions":
            n = header.get("token_count", 1)
            n = n if isinstance(n, int) and 0 <= n < 5000 else 1
            header["positions"] = rng.choice(
                ([rng.choice(EDGE_INTS)] * n, list(range(n, 0, -1)), list(range(n + 1)), "x")
            )
        elif fld == "parts":
            header["parts"] = rng.choice(
                ([], parts * 2 if parts else [], [None], parts * 65 if parts else [])
            )
        else:
            header[fld] = rng.choice((*EDGE_INTS, -5, True, 1.0, None, "1"))
    if rng.random() < 0.2:
        header[key(rng)] = scalar(rng)


def frame_value(rng: random.Random, fld: str, part: dict[str, Any]) -> Any:
    raw_dims = part.get("dims")
    dims: list[Any] = raw_dims if isinstance(raw_dims, list) else [1]
    rank = len(dims)
    if fld == "dims":
        return rng.choice(
            (
                [],
                [0] * rank,
                [2**62] * rank,
                [2**31, 2**31],
                [1] * 9,
                [-1] * rank,
                [*dims[:-1], dims[-1] + 1] if dims else [1],
                list(reversed(dims)),
                [2**64 - 1],
                [3, 0, 2**62],
                [*dims, 1],
            )
        )
    if fld == "byte_strides":
        raw_strides = part.get("byte_strides")
        strides: list[Any] = raw_strides if isinstance(raw_strides, list) else [4]
        return rng.choice(
            (
                [0] * rank,
                [-4] * rank,
                [2**62] * rank,
                [1] * rank,
                list(reversed(strides)),
                [s * 2 for s in strides if isinstance(s, int)],
                [2**63 - 1] * rank,
                strides[:-1],
                [],
            )
        )
    if fld == "offset":
        return rng.choice((1, 3, 2**62 - 1, 2**63, -1, 1 << 20, 4096))
    if fld == "nbytes":
        raw = part.get("nbytes")
        n = raw if isinstance(raw, int) else 0
        return rng.choice((n + 1, n - 1, 0, 2**62, -1, n * 2))
    if fld == "buffer":
        return rng.choice((1, 2, -1, 2**62, 7, None))
    if fld == "token_axis":
        return rng.choice((-2, -1, rank, rank + 1, 1, 2**62, True))
    if fld == "dtype":
        return rng.choice(("f64", "F32", "", "bf16", "u8", "i32", "f16", 3))
    return rng.choice(("", "x" * 65, "kv_state.9", "hidden", "embd", 0, None))


def mutate_buffers(rng: random.Random, buffers: list[bytes]) -> list[bytes]:
    if not buffers or rng.random() < 0.4:
        return buffers
    out = list(buffers)
    i = rng.randrange(len(out))
    roll = rng.random()
    if roll < 0.3:
        out[i] = out[i][: rng.randrange(len(out[i]) + 1)]  # truncated
    elif roll < 0.5:
        out[i] += rng.randbytes(rng.choice((1, 3, 4096)))  # longer than described
    elif roll < 0.65:
        out.append(out[i])  # duplicated
    elif roll < 0.75:
        out = []  # missing
    elif roll < 0.85:
        out[i] = b""
    else:
        out[i] = out[i] + bytes(rng.choice((1 << 20, 3 << 20)))  # oversized
    return out
