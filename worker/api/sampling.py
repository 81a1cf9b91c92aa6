"""Validation of a request's ``sampling`` map into a ``SamplerSpec``.

One table, ``SAMPLING``, names every field with its rule (the kinds of
``validate.py``), and ``read_fields`` reads a map against it in one pass:
an unknown key or a wrong value is ``bad_request`` naming it as
``sampling.<field>``. Sizes a peer
chooses — grammar or schema bytes, ``logit_bias`` entries — are held to the
worker's ``Limits`` and going over one is ``limit_exceeded``. No llama.cpp:
grammars are checked through the ``GrammarChecker`` the caller passes in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from faults import BadRequest

from ..limits import Limits, exceeded
from ..spec import (
    DEFAULT_DRY_BREAKERS,
    DEFAULT_SAMPLERS,
    DEFAULT_SEED,
    SAMPLER_NAMES,
    GrammarChecker,
    SamplerSpec,
    canonical_schema,
)
from .validate import NO_CONTEXT, Bool, Context, Field, Int, Num, read_fields, shown

MAX_SCHEMA_DEPTH = 16  # fixed: schemas nest no deeper (the header itself may nest 32)


@dataclass(frozen=True)
class Breakers(Field):
    """``dry_sequence_breakers``: at most 64 strings of 1..64 characters."""

    default: tuple[str, ...] = DEFAULT_DRY_BREAKERS
    nil_ok: bool = True

    def read(self, where: str, value: Any, ctx: Context) -> tuple[str, ...]:
        if not isinstance(value, list) or len(value) > 64:
            raise BadRequest(f"{where} must be a list of at most 64 strings")
        for i, item in enumerate(value):
            if not isinstance(item, str) or not 0 < len(item) <= 64:
                raise BadRequest(
                    f"{where}[{i}] must be a non-empty string of at most 64 characters"
                )
        return tuple(value)


@dataclass(frozen=True)
class LogitBias(Field):
    """``logit_bias``: ``{token, bias}`` maps, at most ``max_logit_bias``."""

    default: tuple[tuple[int, float], ...] = ()
    nil_ok: bool = True

    def read(self, where: str, value: Any, ctx: Context) -> tuple[tuple[int, float], ...]:
        if not isinstance(value, list):
            raise BadRequest(f"{where} must be a list of {{token, bias}} maps")
        if len(value) > (most := ctx.limits.max_logit_bias):
            raise exceeded(f"{where} has {len(value)} entries", most, "max_logit_bias")
        out: list[tuple[int, float]] = []
        for i, item in enumerate(value):
            at = f"{where}[{i}]"
            if not isinstance(item, dict) or set(item) != {"token", "bias"}:
                raise BadRequest(f"{at} must be a map with exactly the keys token and bias")
            token = item["token"]
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < 1 << 31:
                raise BadRequest(f"{at}.token must be a non-negative integer token id")
            bias = item["bias"]
            if isinstance(bias, bool) or not isinstance(bias, int | float) or math.isnan(bias):
                raise BadRequest(f"{at}.bias must be a number (-inf forbids the token)")
            out.append((token, float(bias)))
        return tuple(out)


@dataclass(frozen=True)
class Samplers(Field):
    """``samplers``: the chain's order, at most 32 names of ``SAMPLER_NAMES``."""

    default: tuple[str, ...] = DEFAULT_SAMPLERS
    nil_ok: bool = True

    def read(self, where: str, value: Any, ctx: Context) -> tuple[str, ...]:
        if not isinstance(value, list) or len(value) > 32:
            raise BadRequest(f"{where} must be a list of at most 32 sampler names")
        for i, item in enumerate(value):
            if item not in SAMPLER_NAMES:
                raise BadRequest(
                    f"{where}[{i}] = {shown(item)} is not a sampler; "
                    f"known: {', '.join(SAMPLER_NAMES)}"
                )
        return tuple(value)


def _grammar_bytes(text: str, where: str, most: int) -> None:
    """Hold a grammar (or a schema's JSON text) to ``max_grammar_bytes``
    (UTF-8 bytes: what llama.cpp parses and keeps). A character is at most 4
    bytes, so short text is not encoded to count."""
    if 4 * len(text) > most:
        n = len(text.encode(errors="replace"))
        if n > most:
            raise exceeded(f"{where} is {n} bytes", most, "max_grammar_bytes")


@dataclass(frozen=True)
class Grammar(Field):
    """``grammar``: GBNF text, parsed here when the worker has a checker."""

    nil_ok: bool = True

    def read(self, where: str, value: Any, ctx: Context) -> str:
        if not isinstance(value, str):
            raise BadRequest(f"{where} must be a string")
        _grammar_bytes(value, where, ctx.limits.max_grammar_bytes)
        if not value.strip():
            raise BadRequest(f"{where} must not be empty")
        why = ctx.grammars.grammar_error(value) if ctx.grammars is not None else None
        if why is not None:
            raise BadRequest(f"{where} is not a valid GBNF grammar: {why}")
        return value


@dataclass(frozen=True)
class JsonSchema(Field):
    """``json_schema``: a map, kept as its canonical JSON text."""

    nil_ok: bool = True

    def read(self, where: str, value: Any, ctx: Context) -> str:
        if not isinstance(value, dict):
            raise BadRequest(f"{where} must be a map (a JSON schema)")
        if nesting(value) > MAX_SCHEMA_DEPTH:
            raise BadRequest(f"{where} nests deeper than {MAX_SCHEMA_DEPTH} levels")
        try:
            text = canonical_schema(value)
        except (TypeError, ValueError, RecursionError) as exc:
            raise BadRequest(f"{where} is not JSON-serialisable: {type(exc).__name__}") from None
        _grammar_bytes(text, where, ctx.limits.max_grammar_bytes)
        why = ctx.grammars.schema_error(text) if ctx.grammars is not None else None
        if why is not None:
            raise BadRequest(f"{where}: {why}")
        return text


def nesting(value: Any) -> int:
    """How deep maps and lists nest in ``value`` (a scalar is 0), without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        depth += 1
        deepest = max(deepest, depth)
        stack.extend((child, depth) for child in children if isinstance(child, dict | list | tuple))
    return deepest


_B = SamplerSpec()
_LAST_N = 1 << 20  # the longest penalty / DRY look-back
# Every field of a sampling map: its rule and default (``SamplerSpec``'s).
SAMPLING: Final[Mapping[str, Field]] = {
    "temperature": Num(_B.temperature, 0.0, 100.0),
    "top_k": Int(_B.top_k, 0, 1 << 20),
    "top_p": Num(_B.top_p, 0.0, 1.0),
    "min_p": Num(_B.min_p, 0.0, 1.0),
    "seed": Int(DEFAULT_SEED, 0, 0xFFFFFFFF),
    "typical_p": Num(_B.typical_p, 0.0, 1.0),
    "top_n_sigma": Num(_B.top_n_sigma, -1.0, 100.0),
    "dynatemp_range": Num(_B.dynatemp_range, 0.0, 100.0),
    "dynatemp_exponent": Num(_B.dynatemp_exponent, 0.0, 100.0),
    "repeat_penalty": Num(_B.repeat_penalty, 0.0, 100.0),
    "presence_penalty": Num(_B.presence_penalty, -100.0, 100.0),
    "frequency_penalty": Num(_B.frequency_penalty, -100.0, 100.0),
    "penalty_last_n": Int(_B.penalty_last_n, -1, _LAST_N),
    "dry_multiplier": Num(_B.dry_multiplier, 0.0, 100.0),
    "dry_base": Num(_B.dry_base, 1.0, 100.0),
    "dry_allowed_length": Int(_B.dry_allowed_length, 0, _LAST_N),
    "dry_penalty_last_n": Int(_B.dry_penalty_last_n, -1, _LAST_N),
    "dry_sequence_breakers": Breakers(),
    "xtc_probability": Num(_B.xtc_probability, 0.0, 1.0),
    "xtc_threshold": Num(_B.xtc_threshold, 0.0, 1.0),
    "mirostat": Int(_B.mirostat, 0, 2),
    "mirostat_tau": Num(_B.mirostat_tau, 0.0, 100.0),
    "mirostat_eta": Num(_B.mirostat_eta, 0.0, 1.0),
    "logit_bias": LogitBias(),
    "ignore_eos": Bool(False),
    "samplers": Samplers(),
    "grammar": Grammar(),
    "json_schema": JsonSchema(),
}


@dataclass(frozen=True)
class Sampling(Field):
    """A ``sampling`` map as a field of a request's table: ``None`` (greedy)
    when absent; otherwise every field read against ``SAMPLING``.

    Only ``<token>`` references in a grammar and ``logit_bias`` tokens beyond
    the vocabulary are left to the chain build (``SamplerError``). Without a
    grammar checker in the context the grammar is only parsed when the chain
    is built (still ``bad_request``).
    """

    nil_ok: bool = True

    def read(self, where: str, value: Any, ctx: Context) -> SamplerSpec:
        if not isinstance(value, dict):
            raise BadRequest(f"{where} must be a map")
        got = read_fields(value, SAMPLING, ctx, f"{where}.", known="sampling")
        if got["repeat_penalty"] <= 0.0:
            raise BadRequest(f"{where}.repeat_penalty must be > 0 (1.0 disables it)")
        if got["grammar"] is not None and got["json_schema"] is not None:
            raise BadRequest(f"{where}.grammar and {where}.json_schema cannot both be given")
        return SamplerSpec(**got)


def get_sampling(
    args: dict[str, Any],
    name: str = "sampling",
    grammars: GrammarChecker | None = None,
    limits: Limits = NO_CONTEXT.limits,
) -> SamplerSpec | None:
    """``args[name]`` read as a sampling map (a table of one ``Sampling``)."""
    ctx = Context(limits=limits, grammars=grammars)
    spec: SamplerSpec | None = read_fields(args, {name: Sampling()}, ctx)[name]
    return spec
