"""Hostile values for ``scripts/fuzzcases.py``: scalars, maps, nesting, mutations.

Why a module of its own: these are the bottom layer every case family draws
on (the ``bytes``, ``value`` and ``deep`` cases, the hostile values and the
mutations of ``args`` cases, the keys added to a frame descriptor). They are
plain functions of the run's one random generator, which ``Generator`` owns
and passes in, so every family draws from the same sequence and a seed always
gives the same cases; the few that plant a request id take the run's ``Ids``.
"""

from __future__ import annotations

import copy
import math
import random
import string
from typing import Any

import msgpack

NAN, INF = math.nan, math.inf
EDGE_INTS: tuple[int, ...] = (
    0,
    1,
    -1,
    2,
    2**7,
    2**8,
    2**15,
    2**16,
    2**31 - 1,
    2**31,
    -(2**31),
    2**32 - 1,
)
EDGE_INTS += (2**32, 2**53 + 1, 2**62 - 1, 2**62, 2**63 - 1, -(2**63), 2**64 - 1)
EDGE_FLOATS = (NAN, INF, -INF, 0.0, -0.0, 1e308, -1e308, 5e-324, 0.5, 1.0 + 2**-52, 1e-300)
EDGE_STRS = ("", " ", "\x00", "\u202e", "é", "😀", "\ud7ff", "null", "-1", "ping", "~gen-1")
KEYS = ("v", "id", "op", "session", "args", "deadline_ms", "tokens", "text", "frame", "input")

ARG_NAMES = (
    "tokens",
    "token",
    "text",
    "prompt",
    "sampling",
    "output",
    "return_logits",
    "stream",
    "max_tokens",
    "input",
    "frame",
    "messages",
    "speculative",
    "stop",
    "requests",
    "id",
    "token_count",
    "window_tokens",
    "session_state",
    "steps",
    "pooling",
    "logprobs",
)


class Ids:
    """A run's request ids: each new one unique, the last few kept for ``cancel``."""

    def __init__(self) -> None:
        self.next_id = 1
        self.recent: list[int] = []  # ids a ``cancel`` may name

    def fresh(self) -> int:
        rid = self.next_id
        self.next_id += 1
        self.recent = [*self.recent[-7:], rid]
        return rid


def key(rng: random.Random) -> Any:
    roll = rng.random()
    if roll < 0.5:
        return rng.choice(KEYS)
    if roll < 0.8:
        return text(rng, rng.choice((1, 4, 16, 70)))
    return rng.choice((0, -1, 2**64 - 1, None, True, 1.5, NAN, b"k", b""))


def text(rng: random.Random, n: int) -> str:
    if rng.random() < 0.2:
        return "".join(
            chr(rng.choice((rng.randrange(0x20, 0xD800), rng.randrange(0xE000, 0x110000))))
            for _ in range(n)
        )
    return "".join(rng.choices(string.printable, k=n))


def long_text(rng: random.Random) -> str:
    n = rng.choice((300, 5000, 70_000, 300_000))
    return rng.choice(("a", "ab ", "é", "😀", "<start_of_turn>")) * (n // 3)


def scalar(rng: random.Random) -> Any:
    pick = rng.randrange(9)
    if pick == 0:
        return None
    if pick == 1:
        return rng.random() < 0.5
    if pick == 2:
        return rng.choice(EDGE_INTS)
    if pick == 3:
        return rng.randrange(-(2**63), 2**64)
    if pick == 4:
        return rng.choice(EDGE_FLOATS)
    if pick == 5:
        return rng.choice(EDGE_STRS) if rng.random() < 0.5 else text(rng, rng.randrange(64))
    if pick == 6:
        return rng.randbytes(rng.randrange(32))
    if pick == 7:
        return long_text(rng) if rng.random() < 0.2 else text(rng, rng.randrange(300))
    ext = rng.choice(
        (msgpack.ExtType(rng.randrange(128), rng.randbytes(3)), msgpack.Timestamp(1, 2))
    )
    return ext


def value(rng: random.Random, depth: int) -> Any:
    if depth <= 0 or rng.random() < 0.6:
        return scalar(rng)
    n = rng.choice((0, 1, 2, 3, 5))
    if rng.random() < 0.5:
        return [value(rng, depth - 1) for _ in range(n)]
    return {key(rng): value(rng, depth - 1) for _ in range(n)}


def hostile_map(rng: random.Random, ids: Ids) -> dict[Any, Any]:
    """A map that looks like a header: some real keys, random values."""
    out: dict[Any, Any] = {}
    for _ in range(rng.randrange(7)):
        out[key(rng)] = value(rng, 3)
    if "id" in out:
        out["id"] = ids.fresh() if rng.random() < 0.7 else value(rng, 1)
    return out


def random_bytes(rng: random.Random) -> bytes:
    n = rng.choice((0, 1, 2, 5, 16, 64, 300, 5000))
    raw = rng.randbytes(n)
    if raw and rng.random() < 0.5:  # starts like a map, so the parser goes further
        raw = bytes([rng.choice((0x80, 0x81, 0x85, 0x8F, 0xDE, 0xDF))]) + raw
    return raw


def nest(rng: random.Random, depth: int, leaf: Any) -> Any:
    for _ in range(depth):
        leaf = [leaf] if rng.random() < 0.5 else {"k": leaf}
    return leaf


def deepen(rng: random.Random, args: dict[str, Any]) -> Any:
    depth = rng.choice((29, 30, 31, 32, 33, 40, 200))
    where = rng.choice((*args, "extra")) if args else "extra"
    out = dict(args)
    out[where] = nest(rng, depth, scalar(rng))
    return out


def hostile(rng: random.Random, ids: Ids) -> Any:
    """A value meant to break a validator: wrong type, edge number, long, deep."""
    roll = rng.random()
    if roll < 0.55:
        return scalar(rng)
    if roll < 0.75:
        return value(rng, 3)
    if roll < 0.85:
        return [rng.choice(EDGE_INTS) for _ in range(rng.choice((1, 3, 70)))]
    if roll < 0.95:
        return [hostile_map(rng, ids) for _ in range(rng.randrange(1, 4))]
    return nest(rng, rng.choice((10, 28)), scalar(rng))


# -- mutation -----------------------------------------------------------------


def _slots(obj: Any) -> list[tuple[Any, Any]]:
    """Every (container, key) under ``obj``: the places a mutation may hit."""
    out: list[tuple[Any, Any]] = []
    stack = [obj]
    while stack:
        item = stack.pop()
        children = item.items() if isinstance(item, dict) else enumerate(item)
        for k, v in children:
            out.append((item, k))
            if isinstance(v, dict | list) and len(out) < 2000:
                stack.append(v)
    return out


def mutate(rng: random.Random, ids: Ids, args: dict[str, Any], n: int) -> dict[str, Any]:
    """``n`` edits anywhere in a copy of ``args``: made hostile, removed, grown, wrapped."""
    args = copy.deepcopy(args)
    for _ in range(n):
        slots = _slots(args)
        if not slots or rng.random() < 0.12:
            args[key(rng) if rng.random() < 0.5 else rng.choice(ARG_NAMES)] = hostile(rng, ids)
            continue
        parent, where = rng.choice(slots)
        roll = rng.random()
        if roll < 0.6:
            parent[where] = hostile(rng, ids)
        elif roll < 0.75:
            del parent[where]
        elif roll < 0.85 and isinstance(parent, list):
            parent.extend(copy.deepcopy(parent[: rng.randrange(1, 4)]) * rng.choice((1, 40)))
        elif roll < 0.95:
            parent[where] = [parent[where]] if rng.random() < 0.5 else {"x": parent[where]}
        else:
            parent[where] = nest(rng, 30, parent[where])
    return args
