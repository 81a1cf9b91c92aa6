"""Case generator for ``scripts/fuzz.py``: hostile messages for every op, by seed.

A case is one or more ZeroMQ messages (``[header, *buffers]``) and, for
each, the id its final reply must carry (``None``: an id-less error). The
generator never looks at replies, so a seed always gives the same cases:
a failure found once is found again.

What it makes, per message (weights in ``Generator.KINDS``):

- ``bytes``: random bytes (often not msgpack; the reply has ``id: null``);
- ``value``: a random msgpack value, map or not, with random keys;
- ``envelope``: a valid request whose ``v`` / ``id`` / ``op`` / ``session``
  / ``args`` / ``deadline_ms`` is replaced by a hostile value or removed;
- ``args``: a valid header for one of the target's ops with plausible
  arguments, then (mostly) a few mutations anywhere in them: a value made
  hostile (huge integers, NaN/inf, long strings, bytes, deep nesting, a
  wrong type), a key removed or added, a list grown or emptied;
- ``frame``: an op that carries a tensor frame, whose descriptor (dims,
  strides, offsets, nbytes, buffer index, token axis, ...) or buffers
  (truncated, duplicated, oversized, missing) are corrupted;
- ``deep``: nesting just under and past the 32-level cap, anywhere;
- ``big``: a header past the target's size cap;
- ``dup``: one of the above sent twice (two final replies with one id).

Ids are unique per run (mutated ids are unique too), so replies match by id.

The pieces are plain functions in modules beside this one, each taking the
run's random generator (and the run's ids or ``Run`` where they need them):
``_fuzz_values.py`` (hostile values, mutations, ``Ids``), ``_fuzz_frames.py``
(tensor frames and their corruptions), ``_fuzz_draws.py`` (``Target``,
``Run`` and the draws several ops share) and ``_fuzz_ops.py`` (plausible
arguments per op). ``Generator`` here owns the generator, the ids and the
``Run``, and turns what they make into cases.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
from _fuzz_draws import Run, Target
from _fuzz_frames import frame, mutate_buffers, mutate_frame_in
from _fuzz_ops import MAKERS, Made, args_forward_frame
from _fuzz_values import Ids, deepen, hostile_map, key, mutate, random_bytes, value

from protocol import transport


@dataclass
class Message:
    """One message and the id of its final reply (``None``: the reply has ``id: null``)."""

    frames: list[bytes]
    reply_id: int | None


@dataclass
class Case:
    kind: str
    op: str
    messages: list[Message] = field(default_factory=list)


def reply_id(header: bytes, max_bytes: int) -> int | None:
    """The id the edge answers a header with (mirrors ``EdgeServer._handle``)."""
    if len(header) > max_bytes:
        return None
    try:
        decoded = transport.decode(header, max_bytes=max_bytes)
    except transport.TooDeep as exc:
        return exc.req_id
    except transport.CodecError:
        return None
    raw = decoded.get("id")
    return raw if type(raw) is int else None


def pack(obj: Any, single_float: bool = False) -> bytes:
    """msgpack bytes; ``single_float`` sends floats as float32 where they fit."""
    try:
        packed: bytes = msgpack.packb(obj, use_bin_type=True, use_single_float=single_float)
    except OverflowError:  # 1e308 has no float32
        packed = msgpack.packb(obj, use_bin_type=True)
    return packed


class Generator:
    """Deterministic cases for one target: ``case(i)`` for i = 0, 1, 2, ..."""

    KINDS = {"args": 58, "frame": 14, "envelope": 10, "bytes": 5, "value": 5, "deep": 4, "dup": 3}

    def __init__(self, target: Target, seed: int, batch: int = 100) -> None:
        self.t = target
        self.rng = random.Random(f"{seed}:{target.name}")
        self.batch = batch  # the runner drops every session between batches
        self.ids = Ids()
        sessions = ("fz-a", "fz-b") if target.name != "stage1" else ("fz1-a", "fz1-b")
        self.run = Run(target, self.rng, self.ids, sessions)
        ops = set(target.ops)
        self.frame_ops = [
            op for op in ("echo", "prefill", "import_state", "forward_frame") if op in ops
        ]
        if target.name == "speech":
            self.frame_ops = []
        self.arg_makers: dict[str, Callable[[Run], Made]] = {
            op: MAKERS[op] for op in target.ops if op in MAKERS
        }

    # -- cases --------------------------------------------------------------

    def case(self, index: int) -> Case:
        rng = self.rng
        if index % self.batch == 0:
            self.run.positions.clear()
        if index % 2000 == 1999:  # a rare, costly one: a header over the size cap
            return self._single("big", "-", self._big())
        known = [r for r in REGRESSIONS if r[0] in self.arg_makers]
        if index % 100 == 50 and known:  # every known crasher, in every run of 500+
            op, args = known[(index // 100) % len(known)]
            return self._regression(op, copy.deepcopy(args))
        kind = rng.choices(list(self.KINDS), weights=list(self.KINDS.values()))[0]
        if kind == "dup":
            inner = self.case(index)
            inner.kind, first = "dup:" + inner.kind, inner.messages[0]
            inner.messages.append(Message(list(first.frames), first.reply_id))
            return inner
        op = rng.choice(list(self.arg_makers))
        if kind == "bytes":
            return self._single(kind, "-", [random_bytes(rng)])
        if kind == "value":
            made = value(rng, 4) if rng.random() < 0.3 else hostile_map(rng, self.ids)
            return self._single(kind, "-", [pack(made)])
        positions = dict(self.run.positions)  # a forward that is mutated does not move them
        if kind == "frame" and self.frame_ops:
            op = rng.choice(self.frame_ops)
            session, args, buffers = self.arg_makers[op](self.run)
            self.run.positions = positions
            return self._request(kind, op, session, args, mutate_buffers(rng, buffers), frame=True)
        session, args, buffers = self.arg_makers[op](self.run)
        if kind == "envelope":
            self.run.positions = positions
            return self._request(kind, op, session, args, buffers, envelope=True)
        if kind == "deep":
            self.run.positions = positions
            return self._request(kind, op, session, deepen(rng, args), buffers)
        if rng.random() < 0.7:
            self.run.positions = positions
            args = mutate(rng, self.ids, args, rng.choice((1, 1, 1, 2, 3)))
        return self._request("args", op, session, args, buffers)

    def _regression(self, op: str, args: dict[str, Any]) -> Case:
        session: str | None = None
        buffers: list[bytes] = []
        if op == "echo":  # bf16: its reply could not be rendered
            args["frame"], buffers = frame(self.rng, "hidden", [2, 3], "bf16")
        elif op == "forward_frame":  # outputs without sampling: every turn crashed
            session, args, buffers = args_forward_frame(self.run)
            for step in args["steps"]:
                step.update(sample=False, output=["logits"], all_rows=False, capture_all=False)
                step.pop("rule", None)
        return self._request("regression", op, session, args, buffers)

    def _single(self, kind: str, op: str, frames_: list[bytes]) -> Case:
        rid = reply_id(frames_[0], self.t.max_header_bytes)
        return Case(kind, op, [Message(frames_, rid)])

    def _request(
        self,
        kind: str,
        op: str,
        session: str | None,
        args: Any,
        buffers: list[bytes],
        *,
        envelope: bool = False,
        frame: bool = False,
    ) -> Case:
        rng = self.rng
        rid = self.ids.fresh()
        header: dict[Any, Any] = {"v": 1, "id": rid, "op": op}
        if session is not None:
            header["session"] = session
        if args is not None:
            header["args"] = args
        if rng.random() < 0.15:  # a deadline: most cases pass, some expire, some are refused
            header["deadline_ms"] = rng.choice((1, 5, 50, 2000, 5000))
        if frame:
            mutate_frame_in(rng, args)
        if envelope:
            self.mutate_envelope(header)
        raw = pack(header, single_float=rng.random() < 0.1)
        return self._single(kind, op, [raw, *buffers])

    def mutate_envelope(self, header: dict[Any, Any]) -> None:
        rng = self.rng
        slot = rng.choice(("v", "v", "id", "id", "op", "session", "args", "deadline_ms", "extra"))
        roll = rng.random()
        if roll < 0.25 and slot in header:
            del header[slot]
        elif slot == "id" and roll < 0.55:  # another int: negative or past int64, still unique
            n = self.ids.fresh()
            header["id"] = rng.choice((-n, 2**63 + n, 2**64 - n, 0 if n == 1 else -n))
        elif slot == "op" and roll < 0.6:
            header["op"] = rng.choice(("", "PING", "ping\x00", "x" * 65, "x" * 64, "synthesize"))
        elif slot == "session" and roll < 0.6:
            header["session"] = rng.choice(("", "s" * 256, "s" * 257, "~gen-1", "\x00", "é" * 200))
        elif slot == "v" and roll < 0.6:
            header["v"] = rng.choice((1.0, True, "1", 2, 0, -1, 2**64 - 1, [1], None))
        elif slot == "extra":
            header[key(rng)] = value(rng, 2)
        else:
            header[slot] = value(rng, 2)

    def _big(self) -> list[bytes]:
        """A header just past the size cap (``payload_too_large``, id null)."""
        size = self.t.max_header_bytes + self.rng.choice((1, 4096))
        return [pack({"v": 1, "id": self.ids.fresh(), "op": "ping", "args": {"pad": b"x" * size}})]


# Requests that once took a worker down or stalled it; ``case`` sends one of
# them every 100 cases, in turn. (op, args)
REGRESSIONS: tuple[tuple[str, dict[str, Any]], ...] = (
    # the JSON-schema converter wrote 1e9 items out: 24 GB, the worker OOM-killed
    (
        "generate",
        {"prompt": "a", "sampling": {"json_schema": {"type": "array", "minItems": 10**9}}},
    ),
    # 100,000 nested groups in the converted grammar: llama.cpp's parser overflowed the stack
    (
        "generate",
        {"tokens": [2], "sampling": {"json_schema": {"type": "string", "maxLength": 10**5}}},
    ),
    # a 40 KB grammar of 20,000 nested groups: the same segfault
    (
        "generate",
        {"prompt": "a", "sampling": {"grammar": "root ::= " + "(" * 20000 + '"x"' + ")" * 20000}},
    ),
    # 1 MiB of special tokens: ~10 s of quadratic tokenizing with the loop blocked
    ("tokenize", {"text": "<start_of_turn>" * 69000, "parse_special": True}),
    # a bf16 frame echoed: its reply failed to render and the turn's other replies were lost
    ("echo", {}),
    # a NUL in speech text reached espeak, which takes C strings: ValueError, ``internal``
    ("synthesize", {"text": "Hi\x00there."}),
    # a stage asked for logits of rows it did not sample: every turn crashed and re-ran the
    # forward, moving the session to the end of its lane (the frame is made per run)
    ("forward_frame", {}),
)
