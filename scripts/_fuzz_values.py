"""Hostile values for ``scripts/fuzzcases.py``: scalars, maps, nesting, mutations.

Why a module of its own: these are the bottom layer every case family draws
on (the ``bytes``, ``value`` and ``deep`` cases, the hostile values and the
mutations of ``args`` cases, the keys added to a frame descriptor). ``Values``
holds the run's one random generator and its id counter, so everything built
on it (``Frames``, ``Ops``, ``Generator``) draws from the same sequence and a
seed always gives the same cases.
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


class Values:
    """Random hostile values from one seeded generator; ids unique per run."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.next_id = 1
        self.recent: list[int] = []  # ids a ``cancel`` may name

    def fresh_id(self) -> int:
        rid = self.next_id
        self.next_id += 1
        self.recent = [*self.recent[-7:], rid]
        return rid

    def key(self) -> Any:
        rng = self.rng
        roll = rng.random()
        if roll < 0.5:
            return rng.choice(KEYS)
        if roll < 0.8:
            return self.text(rng.choice((1, 4, 16, 70)))
        return rng.choice((0, -1, 2**64 - 1, None, True, 1.5, NAN, b"k", b""))

    def text(self, n: int) -> str:
        rng = self.rng
        if rng.random() < 0.2:
            return "".join(
                chr(rng.choice((rng.randrange(0x20, 0xD800), rng.randrange(0xE000, 0x110000))))
                for _ in range(n)
            )
        return "".join(rng.choices(string.printable, k=n))

    def long_text(self) -> str:
        n = self.rng.choice((300, 5000, 70_000, 300_000))
        return self.rng.choice(("a", "ab ", "é", "😀", "<start_of_turn>")) * (n // 3)

    def scalar(self) -> Any:
        rng = self.rng
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
            return rng.choice(EDGE_STRS) if rng.random() < 0.5 else self.text(rng.randrange(64))
        if pick == 6:
            return rng.randbytes(rng.randrange(32))
        if pick == 7:
            return self.long_text() if rng.random() < 0.2 else self.text(rng.randrange(300))
        ext = rng.choice(
            (msgpack.ExtType(rng.randrange(128), rng.randbytes(3)), msgpack.Timestamp(1, 2))
        )
        return ext

    def value(self, depth: int) -> Any:
        rng = self.rng
        if depth <= 0 or rng.random() < 0.6:
            return self.scalar()
        n = rng.choice((0, 1, 2, 3, 5))
        if rng.random() < 0.5:
            return [self.value(depth - 1) for _ in range(n)]
        return {self.key(): self.value(depth - 1) for _ in range(n)}

    def hostile_map(self) -> dict[Any, Any]:
        """A map that looks like a header: some real keys, random values."""
        out: dict[Any, Any] = {}
        for _ in range(self.rng.randrange(7)):
            out[self.key()] = self.value(3)
        if "id" in out:
            out["id"] = self.fresh_id() if self.rng.random() < 0.7 else self.value(1)
        return out

    def random_bytes(self) -> bytes:
        rng = self.rng
        n = rng.choice((0, 1, 2, 5, 16, 64, 300, 5000))
        raw = rng.randbytes(n)
        if raw and rng.random() < 0.5:  # starts like a map, so the parser goes further
            raw = bytes([rng.choice((0x80, 0x81, 0x85, 0x8F, 0xDE, 0xDF))]) + raw
        return raw

    def nest(self, depth: int, leaf: Any) -> Any:
        for _ in range(depth):
            leaf = [leaf] if self.rng.random() < 0.5 else {"k": leaf}
        return leaf

    def deepen(self, args: dict[str, Any]) -> Any:
        depth = self.rng.choice((29, 30, 31, 32, 33, 40, 200))
        key = self.rng.choice((*args, "extra")) if args else "extra"
        out = dict(args)
        out[key] = self.nest(depth, self.scalar())
        return out

    def hostile(self) -> Any:
        """A value meant to break a validator: wrong type, edge number, long, deep."""
        rng = self.rng
        roll = rng.random()
        if roll < 0.55:
            return self.scalar()
        if roll < 0.75:
            return self.value(3)
        if roll < 0.85:
            return [rng.choice(EDGE_INTS) for _ in range(rng.choice((1, 3, 70)))]
        if roll < 0.95:
            return [self.hostile_map() for _ in range(rng.randrange(1, 4))]
        return self.nest(rng.choice((10, 28)), self.scalar())

    # -- mutation -------------------------------------------------------------

    def _slots(self, obj: Any) -> list[tuple[Any, Any]]:
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

    def mutate(self, args: dict[str, Any], n: int) -> dict[str, Any]:
        args = copy.deepcopy(args)
        rng = self.rng
        for _ in range(n):
            slots = self._slots(args)
            if not slots or rng.random() < 0.12:
                args[self.key() if rng.random() < 0.5 else rng.choice(ARG_NAMES)] = self.hostile()
                continue
            parent, key = rng.choice(slots)
            roll = rng.random()
            if roll < 0.6:
                parent[key] = self.hostile()
            elif roll < 0.75:
                del parent[key]
            elif roll < 0.85 and isinstance(parent, list):
                parent.extend(copy.deepcopy(parent[: rng.randrange(1, 4)]) * rng.choice((1, 40)))
            elif roll < 0.95:
                parent[key] = [parent[key]] if rng.random() < 0.5 else {"x": parent[key]}
            else:
                parent[key] = self.nest(30, parent[key])
        return args
