"""Plausible arguments per op for ``scripts/fuzzcases.py`` (the ``args`` cases).

Why a module of its own: one maker per op of a worker, a stage and the
speech worker, each drawing arguments a real client might send (sessions,
tokens, sampling, frames, generation extras), which ``Generator`` then
mostly mutates. The tables of sampling values, grammars, JSON schemas and
generation extras they draw from are here too, as is ``Target``: what the
makers need to know of the process under test.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from _fuzz_frames import Frames
from _fuzz_values import INF

from protocol import frames


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


class Ops(Frames):
    """An ``args_<op>`` maker per op: (session or None, args, buffers)."""

    def __init__(self, target: Target, rng: random.Random) -> None:
        super().__init__(rng)
        self.t = target
        self.positions: dict[str, int] = {}  # where this run's valid forwards left a session
        self.sessions = ("fz-a", "fz-b") if target.name != "stage1" else ("fz1-a", "fz1-b")

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
SAMPLING_VALUES: dict[str, Callable[[Rng, Ops], Any]] = {
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
GENERATE_EXTRAS: dict[str, Callable[[Rng, Ops], Any]] = {
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
