"""What the per-op argument makers of ``scripts/fuzzcases.py`` share.

Why a module of its own: ``Target`` (what the makers need to know of the
process under test), ``Run`` (one run's target, random generator, ids,
sessions, and where its valid forwards left each session: the state every
maker takes), the draws several ops make alike (a session, tokens, sampling
settings, extra outputs) and the tables of sampling values, grammars and JSON
schemas those draw from. The makers themselves are in ``_fuzz_ops.py``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from _fuzz_values import INF, Ids


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


@dataclass
class Run:
    """What the makers draw from and move: the target, one run's generator, ids, sessions."""

    target: Target
    rng: random.Random
    ids: Ids
    sessions: tuple[str, ...]
    positions: dict[str, int] = field(default_factory=dict)  # where valid forwards left them


def session(run: Run) -> str:
    return run.rng.choice(run.sessions)


def token(run: Run) -> int:
    rng = run.rng
    return rng.randrange(2, 3000) if rng.random() < 0.9 else rng.randrange(run.target.n_vocab)


def tokens(run: Run, lo: int = 1, hi: int = 12) -> list[int]:
    rng = run.rng
    roll = rng.random()
    if roll < 0.97:
        n = rng.randint(lo, hi)
    else:  # empty, past a lane (refused before any work), or long (a costly forward)
        n = rng.choice((0, 0, run.target.ctx_per_lane + 1, run.target.ctx_per_lane + 1, 300))
    return [token(run) for _ in range(n)]


def sampling(run: Run) -> dict[str, Any] | None:
    rng = run.rng
    if rng.random() < 0.45:
        return None
    out: dict[str, Any] = {}
    for _ in range(rng.randrange(1, 5)):
        key = rng.choices(SAMPLING, SAMPLING_WEIGHTS)[0]  # grammars are rare: they cost
        out[key] = SAMPLING_VALUES[key](rng, run)
    return out


def outputs(run: Run, args: dict[str, Any], rows: int) -> None:
    roll = run.rng.random()
    if roll < 0.08:
        args["output"] = ["hidden"]
    elif roll < 0.1 and rows <= 4:
        args["output"] = ["logits", "hidden"]


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
SAMPLING_VALUES: dict[str, Callable[[Rng, Run], Any]] = {
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
    "logit_bias": lambda r, g: [{"token": token(g), "bias": r.choice((-INF, 5.0, INF, -1e308))}],
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
