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
"""

from __future__ import annotations

import copy
import math
import random
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from protocol import frames, transport

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


@dataclass(frozen=True)
class Target:
    """What the generator needs to know of the process under test (from ``info``)."""

    name: str  # "worker", "speech", "stage0", "stage1"
    ops: tuple[str, ...]
    max_header_bytes: int
    n_vocab: int = 0
    n_embd: int = 0
    ctx_per_lane: int = 0
    lanes: int = 0
    voices: tuple[str, ...] = ()
    state: dict[str, Any] | None = None  # export_state: {"session_state", "frame", "buffers"}


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
        self.positions: dict[str, int] = {}  # where this run's valid forwards left a session
        self.next_id = 1
        self.recent: list[int] = []  # ids a ``cancel`` may name
        self.sessions = ("fz-a", "fz-b") if target.name != "stage1" else ("fz1-a", "fz1-b")
        ops = set(target.ops)
        self.frame_ops = [
            op for op in ("echo", "prefill", "import_state", "forward_frame") if op in ops
        ]
        if target.name == "speech":
            self.frame_ops = []
        self.arg_makers: dict[str, Callable[[], tuple[str | None, dict[str, Any], list[bytes]]]] = {
            op: getattr(self, f"args_{op}") for op in target.ops if hasattr(self, f"args_{op}")
        }

    # -- cases --------------------------------------------------------------

    def case(self, index: int) -> Case:
        rng = self.rng
        if index % self.batch == 0:
            self.positions.clear()
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
            return self._single(kind, "-", [self.random_bytes()])
        if kind == "value":
            value = self.value(4) if rng.random() < 0.3 else self.hostile_map()
            return self._single(kind, "-", [pack(value)])
        positions = dict(self.positions)  # a forward that is mutated does not move them
        if kind == "frame" and self.frame_ops:
            op = rng.choice(self.frame_ops)
            session, args, buffers = self.arg_makers[op]()
            self.positions = positions
            return self._request(kind, op, session, args, self.mutate_buffers(buffers), frame=True)
        session, args, buffers = self.arg_makers[op]()
        if kind == "envelope":
            self.positions = positions
            return self._request(kind, op, session, args, buffers, envelope=True)
        if kind == "deep":
            self.positions = positions
            return self._request(kind, op, session, self.deepen(args), buffers)
        if rng.random() < 0.7:
            self.positions = positions
            args = self.mutate(args, rng.choice((1, 1, 1, 2, 3)))
        return self._request("args", op, session, args, buffers)

    def _regression(self, op: str, args: dict[str, Any]) -> Case:
        session: str | None = None
        buffers: list[bytes] = []
        if op == "echo":  # bf16: its reply could not be rendered
            args["frame"], buffers = self.frame("hidden", [2, 3], "bf16")
        elif op == "forward_frame":  # outputs without sampling: every turn crashed
            session, args, buffers = self.args_forward_frame()
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
        rid = self.fresh_id()
        header: dict[Any, Any] = {"v": 1, "id": rid, "op": op}
        if session is not None:
            header["session"] = session
        if args is not None:
            header["args"] = args
        if rng.random() < 0.15:  # a deadline: most cases pass, some expire, some are refused
            header["deadline_ms"] = rng.choice((1, 5, 50, 2000, 5000))
        if frame:
            self.mutate_frame_in(args)
        if envelope:
            self.mutate_envelope(header)
        raw = pack(header, single_float=rng.random() < 0.1)
        return self._single(kind, op, [raw, *buffers])

    def fresh_id(self) -> int:
        rid = self.next_id
        self.next_id += 1
        self.recent = [*self.recent[-7:], rid]
        return rid

    def mutate_envelope(self, header: dict[Any, Any]) -> None:
        rng = self.rng
        key = rng.choice(("v", "v", "id", "id", "op", "session", "args", "deadline_ms", "extra"))
        roll = rng.random()
        if roll < 0.25 and key in header:
            del header[key]
        elif key == "id" and roll < 0.55:  # another int: negative or past int64, still unique
            n = self.fresh_id()
            header["id"] = rng.choice((-n, 2**63 + n, 2**64 - n, 0 if n == 1 else -n))
        elif key == "op" and roll < 0.6:
            header["op"] = rng.choice(("", "PING", "ping\x00", "x" * 65, "x" * 64, "synthesize"))
        elif key == "session" and roll < 0.6:
            header["session"] = rng.choice(("", "s" * 256, "s" * 257, "~gen-1", "\x00", "é" * 200))
        elif key == "v" and roll < 0.6:
            header["v"] = rng.choice((1.0, True, "1", 2, 0, -1, 2**64 - 1, [1], None))
        elif key == "extra":
            header[self.key()] = self.value(2)
        else:
            header[key] = self.value(2)

    # -- values -------------------------------------------------------------

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

    # -- frames -------------------------------------------------------------

    def frame(
        self, identity: str, dims: Sequence[int], dtype: str = "f32", **kw: Any
    ) -> tuple[dict[str, Any], list[bytes]]:
        """A valid frame header and its buffers (random contents)."""
        np_dtype = frames.DTYPES[dtype]
        count = math.prod(dims)
        raw = np.frombuffer(self.rng.randbytes(count * np_dtype.itemsize), np_dtype)
        if dtype in ("f32", "f16") and self.rng.random() < 0.9:  # mostly finite rows
            raw = np.nan_to_num(raw, posinf=1.0, neginf=-1.0).clip(-10, 10).astype(np_dtype)
        built = frames.make_frame([(identity, raw.reshape(dims), 0, dtype)], **kw)
        out: list[Any] = []
        header = frames.attach(built, out)
        return header, [bytes(b) for b in out]

    def mutate_frame_in(self, args: Any) -> None:
        """Corrupt the frame descriptor the args carry (under frame / input), in place."""
        if not isinstance(args, dict):
            return
        name = "input" if "input" in args else "frame"
        header = args.get(name)
        if not isinstance(header, dict) or self.rng.random() < 0.15:
            return
        rng = self.rng
        parts = header.get("parts")
        if rng.random() < 0.75 and isinstance(parts, list) and parts:
            part = rng.choice(parts)
            fld = rng.choice(PART_FIELDS)
            part[fld] = self.frame_value(fld, part)
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
            header[self.key()] = self.scalar()

    def frame_value(self, fld: str, part: dict[str, Any]) -> Any:
        rng = self.rng
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

    def mutate_buffers(self, buffers: list[bytes]) -> list[bytes]:
        rng = self.rng
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

    def _big(self) -> list[bytes]:
        """A header just past the size cap (``payload_too_large``, id null)."""
        size = self.t.max_header_bytes + self.rng.choice((1, 4096))
        return [pack({"v": 1, "id": self.fresh_id(), "op": "ping", "args": {"pad": b"x" * size}})]

    # -- plausible arguments, per op ------------------------------------------

    def session(self) -> str:
        return self.rng.choice(self.sessions)

    def token(self) -> int:
        rng = self.rng
        return rng.randrange(2, 3000) if rng.random() < 0.9 else rng.randrange(self.t.n_vocab)

    def tokens(self, lo: int = 1, hi: int = 12) -> list[int]:
        rng = self.rng
        roll = rng.random()
        if roll < 0.97:
            n = rng.randint(lo, hi)
        else:  # empty, past a lane (refused before any work), or long (a costly forward)
            n = rng.choice((0, 0, self.t.ctx_per_lane + 1, self.t.ctx_per_lane + 1, 300))
        return [self.token() for _ in range(n)]

    def sampling(self) -> dict[str, Any] | None:
        rng = self.rng
        if rng.random() < 0.45:
            return None
        out: dict[str, Any] = {}
        for _ in range(rng.randrange(1, 5)):
            key = rng.choices(SAMPLING, SAMPLING_WEIGHTS)[0]  # grammars are rare: they cost
            out[key] = SAMPLING_VALUES[key](rng, self)
        return out

    def outputs(self, args: dict[str, Any], rows: int) -> None:
        roll = self.rng.random()
        if roll < 0.08:
            args["output"] = ["hidden"]
        elif roll < 0.1 and rows <= 4:
            args["output"] = ["logits", "hidden"]

    def args_ping(self) -> tuple[str | None, dict[str, Any], list[bytes]]:
        return None, ({} if self.rng.random() < 0.8 else self.hostile_map()), []

    args_info = args_stats = args_ping

    def args_tokenize(self) -> tuple[str | None, dict[str, Any], list[bytes]]:
        rng = self.rng
        text = self.text(rng.randrange(80)) if rng.random() < 0.95 else self.long_text()
        return (
            None,
            {"text": text, "add_special": rng.random() < 0.5, "parse_special": rng.random() < 0.5},
            [],
        )

    def args_detokenize(self) -> tuple[str | None, dict[str, Any], list[bytes]]:
        return None, {"tokens": self.tokens(0, 20)}, []

    def args_prefill(self, sampled: bool = False) -> tuple[str | None, dict[str, Any], list[bytes]]:
        rng = self.rng
        args: dict[str, Any] = {}
        buffers: list[bytes] = []
        if rng.random() < 0.3:
            rows = rng.choice((1, 2, 5))
            args["input"], buffers = self.frame("embd", [rows, self.t.n_embd])
            if rng.random() < 0.3:
                args["input"]["positions"] = list(range(rows))
        else:
            args["tokens"] = self.tokens()
        if sampled and (s := self.sampling()) is not None:
            args["sampling"] = s
        self.outputs(args, 12)
        return self.session(), args, buffers

    def args_prefill_sampled(self) -> tuple[str | None, dict[str, Any], list[bytes]]:
        return self.args_prefill(sampled=True)

    def args_decode(self) -> tuple[str | None, dict[str, Any], list[bytes]]:
        args: dict[str, Any] = {"token": self.token()}
        if (s := self.sampling()) is not None:
            args["sampling"] = s
        self.outputs(args, 1)
        return self.session(), args, []

    def args_decode_batch(self) -> tuple[str | None, dict[str, Any], list[bytes]]:
        names = self.rng.sample(self.sessions, self.rng.randint(1, len(self.sessions)))
        reqs = [{"session": n, "token": self.token()} for n in names]
        if (s := self.sampling()) is not None:
            reqs[0]["sampling"] = s
        return None, {"requests": reqs}, []

    def args_iteration_batch(self) -> tuple[str | None, dict[str, Any], list[bytes]]:
        rng = self.rng
        reqs = []
        for n in rng.sample(self.sessions, rng.randint(1, len(self.sessions))):
            toks = self.tokens(1, 6)
            entry: dict[str, Any] = {"session": n, "tokens": toks}
            if rng.random() < 0.5:
                entry["phase"] = "decode" if len(toks) == 1 else "prefill"
                entry["sample_last"] = rng.random() < 0.5
            if rng.random() < 0.2:
                entry["positions"] = list(range(len(toks)))
            reqs.append(entry)
        return None, {"requests": reqs}, []

    def _generation(self, args: dict[str, Any]) -> dict[str, Any]:
        rng = self.rng
        args["max_tokens"] = rng.choice((1, 2, 3, 4))
        if rng.random() < 0.5:
            args["stream"] = rng.random() < 0.5
        for key, make in GENERATE_EXTRAS.items():
            if rng.random() < 0.12:
                args[key] = make(rng, self)
        if (s := self.sampling()) is not None:
            args["sampling"] = s
        return args

    def args_generate(self) -> tuple[str | None, dict[str, Any], list[bytes]]:
        rng = self.rng
        args: dict[str, Any] = {}
        if rng.random() < 0.6:
            args["prompt"] = self.text(rng.randrange(1, 60))
        else:
            args["tokens"] = self.tokens()
        session = self.session() if rng.random() < 0.4 else None
        return session, self._generation(args), []

    def args_chat(self) -> tuple[str | None, dict[str, Any], list[bytes]]:
        rng = self.rng
        roles = ["system", "user", "assistant", "user"][rng.choice((0, 1)) :]
        n = rng.randint(1, 3)
        msgs = [{"role": r, "content": self.text(rng.randrange(30))} for r in roles[:n]]
        session = self.session() if rng.random() < 0.3 else None
        return session, self._generation({"messages": msgs}), []

    def args_verify(self) -> tuple[str | None, dict[str, Any], list[bytes]]:
        args: dict[str, Any] = {"tokens": self.tokens(1, 9), "trim": self.rng.random() < 0.7}
        if (s := self.sampling()) is not None:
            args["sampling"] = s
        return self.session(), args, []

    def args_trim(self) -> tuple[str | None, dict[str, Any], list[bytes]]:
        return self.session(), {"token_count": self.rng.choice((0, 1, 3, 10, 2000))}, []

    args_align = args_trim

    def args_drop(self) -> tuple[str | None, dict[str, Any], list[bytes]]:
        return self.session(), {}, []

    args_signal = args_export_state = args_drop

    def args_signal_window(self) -> tuple[str | None, dict[str, Any], list[bytes]]:
        return self.session(), {"window_tokens": self.rng.choice((1, 4, 4096))}, []

    def args_cancel(self) -> tuple[str | None, dict[str, Any], list[bytes]]:
        ids = self.recent or [0]
        return None, {"id": self.rng.choice(ids)}, []

    def args_embed(self) -> tuple[str | None, dict[str, Any], list[bytes]]:
        rng = self.rng
        args: dict[str, Any] = {"pooling": rng.choice(("mean", "last", "none"))}
        if rng.random() < 0.5:
            args["text"] = self.text(rng.randrange(1, 40))
        else:
            args["tokens"] = self.tokens()
        return None, args, []

    def args_echo(self) -> tuple[str | None, dict[str, Any], list[bytes]]:
        rng = self.rng
        dtype = rng.choice(list(frames.DTYPES))
        dims = rng.choice(([3], [2, 3], [4, 1, 2], [0, 5], [1]))
        positions = list(range(dims[0])) if rng.random() < 0.3 else None
        header, buffers = self.frame("hidden", dims, dtype, positions=positions)
        return None, {"frame": header}, buffers

    def args_import_state(self) -> tuple[str | None, dict[str, Any], list[bytes]]:
        state = self.t.state
        if state is None:
            return self.session(), {"session_state": {}, "frame": {}}, []
        meta = copy.deepcopy(state["session_state"])
        if self.rng.random() < 0.5:  # an edit deep inside the state itself
            meta = self.mutate(meta, 1)
        header = copy.deepcopy(state["frame"])
        session = self.rng.choice((*self.sessions, "fz-new"))
        return session, {"session_state": meta, "frame": header}, list(state["buffers"])

    def args_forward_frame(self) -> tuple[str | None, dict[str, Any], list[bytes]]:
        rng = self.rng
        names = rng.sample(self.sessions, rng.randint(1, len(self.sessions)))
        steps, rows = [], 0
        for n in names:
            k = rng.choice((1, 1, 2, 4))
            step: dict[str, Any] = {
                "session": n,
                "tokens": [self.token() if rng.random() < 0.8 else -1 for _ in range(k)],
                "position": self.positions.get(n, 0) if rng.random() < 0.85 else rng.choice((0, 4)),
                "sample": rng.random() < 0.7,
                "sampling": self.sampling(),
                "output": rng.choice((None, [], ["hidden"], ["logits"])),
                "capture_all": rng.random() < 0.2,
                "top_logprobs": rng.choice((None, 0, 3)),
            }
            if rng.random() < 0.2:
                step["all_rows"] = True
                step["rule"] = {
                    "checks": [self.token() for _ in range(k)],
                    "until_mismatch": True,
                    "stop_tokens": [1],
                    "stop_eog": True,
                }
            if rng.random() < 0.05:  # a direct return to a head that is not there
                step["origin"] = ["ff" + rng.randbytes(4).hex(), self.fresh_id(), 0, 1]
            steps.append(step)
            self.positions[n] = step["position"] + k  # if it passes: the next one follows on
            rows += k
        dtype = rng.choice(("f32", "f32", "f16"))
        header, buffers = self.frame(
            "hidden", [rows, self.t.n_embd], dtype, positions=list(range(rows))
        )
        return None, {"input": header, "steps": steps}, buffers

    def args_synthesize(self) -> tuple[str | None, dict[str, Any], list[bytes]]:
        rng = self.rng
        args: dict[str, Any] = {
            "text": rng.choice(("Hi.", "Ok", "Yes. No.", self.text(rng.randrange(1, 12))))
        }
        if rng.random() < 0.3:
            args["voice"] = rng.choice((*self.t.voices, "nobody"))
        if rng.random() < 0.3:
            args["format"] = rng.choice(("wav", "pcm_s16le", "mp3"))
        if rng.random() < 0.3:
            args["speed"] = rng.choice((0.25, 1.0, 4.0, 4.01, 0.2))
        if rng.random() < 0.4:
            args["stream"] = rng.random() < 0.5
        if rng.random() < 0.3:
            args["max_seconds"] = rng.choice((0.05, 0.5, 2.0))
        return None, args, []


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

GRAMMARS = (
    'root ::= "yes" | "no"',
    "root ::= [a-z]+",
    "root ::= (",
    "root ::= root",
    'root ::= a\na ::= a "x"',
    'root ::= "a"{0,2000}',
    'root ::= ""',
    "root ::= <[99999999]>",
    'root ::= [^\\x00-\\U0010FFFF] "x"',
    "",
)
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
SCHEMAS: tuple[dict[str, Any], ...] = (
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "string", "pattern": "^(a|b)*$", "maxLength": 3},
    {"$ref": "#/definitions/x", "definitions": {"x": {"$ref": "#/definitions/x"}}},
    {"type": "array", "items": {"type": "number"}, "minItems": 100000},
    {"type": "nonsense"},
    {"anyOf": []},
    {"enum": [1, "a", None, 1.5]},
)
Rng = random.Random
SAMPLING_VALUES: dict[str, Callable[[Rng, Generator], Any]] = {
    "temperature": lambda r, g: r.choice((0.0, 0.7, 1.5, 100.0)),
    "top_k": lambda r, g: r.choice((0, 1, 40, 1 << 20)),
    "top_p": lambda r, g: r.choice((0.0, 0.9, 1.0)),
    "min_p": lambda r, g: r.choice((0.0, 0.05, 1.0)),
    "typical_p": lambda r, g: r.choice((0.5, 1.0)),
    "top_n_sigma": lambda r, g: r.choice((-1.0, 0.5, 100.0)),
    "dynatemp_range": lambda r, g: r.choice((0.0, 0.5)),
    "repeat_penalty": lambda r, g: r.choice((1.0, 1.3, 100.0)),
    "presence_penalty": lambda r, g: r.choice((-100.0, 0.5)),
    "frequency_penalty": lambda r, g: r.choice((0.0, 100.0)),
    "penalty_last_n": lambda r, g: r.choice((-1, 0, 64)),
    "dry_multiplier": lambda r, g: r.choice((0.0, 0.8)),
    "dry_sequence_breakers": lambda r, g: r.choice((["\n"], ["a" * 64], [])),
    "xtc_probability": lambda r, g: r.choice((0.0, 0.5, 1.0)),
    "xtc_threshold": lambda r, g: r.choice((0.1, 0.6)),
    "mirostat": lambda r, g: r.choice((0, 1, 2)),
    "logit_bias": lambda r, g: [{"token": g.token(), "bias": r.choice((-INF, 5.0, INF, -1e308))}],
    "seed": lambda r, g: r.choice((0, 42, 0xFFFFFFFF)),
    "ignore_eos": lambda r, g: r.random() < 0.5,
    "samplers": lambda r, g: r.sample(
        ["penalties", "dry", "top_k", "top_p", "min_p", "xtc", "temperature"], r.randrange(4)
    ),
    "grammar": lambda r, g: r.choice(GRAMMARS),
    "json_schema": lambda r, g: r.choice(SCHEMAS),
}
SAMPLING = list(SAMPLING_VALUES)
SAMPLING_WEIGHTS = [0.15 if k in ("grammar", "json_schema") else 1.0 for k in SAMPLING]
GENERATE_EXTRAS: dict[str, Callable[[Rng, Generator], Any]] = {
    "stop": lambda r, g: r.choice((["\n"], ["a"] * 16, [""], ["x" * 256])),
    "stop_tokens": lambda r, g: [g.token() for _ in range(r.randrange(3))],
    "ignore_eos": lambda r, g: r.random() < 0.5,
    "logprobs": lambda r, g: True,
    "top_logprobs": lambda r, g: r.choice((0, 5, 20)),
    "speculative": lambda r, g: r.choice(
        (
            {"mode": "prompt_lookup", "max_draft": 8, "ngram": 2},
            {"mode": "draft_model"},
            {"mode": "x"},
        )
    ),
}
