"""Validation of a request's ``sampling`` map into a ``SamplerSpec``.

Split from ``validate.py`` (same rules: every field checked for its type
before use, ``bad_request`` naming it as ``sampling.<field>``). Sizes a peer
chooses — grammar or schema bytes, ``logit_bias`` entries — are held to the
worker's ``Limits`` and going over one is ``limit_exceeded``. No llama.cpp:
grammars are checked through the ``GrammarChecker`` the caller passes in.
"""

from __future__ import annotations

import math
from typing import Any

from faults import BadRequest

from ..limits import Limits, check
from ..spec import (
    DEFAULT_DRY_BREAKERS,
    DEFAULT_SAMPLERS,
    DEFAULT_SEED,
    SAMPLER_NAMES,
    GrammarChecker,
    SamplerSpec,
    canonical_schema,
)
from .validate import get_bool, get_float, get_int, shown

_DEFAULT_LIMITS = Limits()

_SAMPLING_KEYS = {
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "typical_p",
    "top_n_sigma",
    "dynatemp_range",
    "dynatemp_exponent",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
    "penalty_last_n",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "dry_sequence_breakers",
    "xtc_probability",
    "xtc_threshold",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "logit_bias",
    "seed",
    "ignore_eos",
    "samplers",
    "grammar",
    "json_schema",
}
MAX_SCHEMA_DEPTH = 16  # fixed: schemas nest no deeper (the header itself may nest 32)
_MAX_LAST_N = 1 << 20


def _get_breakers(raw: dict[str, Any], key: str) -> tuple[str, ...]:
    value = raw.get(key)
    if value is None:
        return DEFAULT_DRY_BREAKERS
    if not isinstance(value, list) or len(value) > 64:
        raise BadRequest(f"{key} must be a list of at most 64 strings")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not 0 < len(item) <= 64:
            raise BadRequest(f"{key}[{i}] must be a non-empty string of at most 64 characters")
    return tuple(value)


def _get_logit_bias(raw: dict[str, Any], key: str, most: int) -> tuple[tuple[int, float], ...]:
    value = raw.get(key)
    if value is None:
        return ()
    if not isinstance(value, list):
        raise BadRequest(f"{key} must be a list of {{token, bias}} maps")
    check(len(value), most, "max_logit_bias", f"{key} has {{n}} entries")
    out: list[tuple[int, float]] = []
    for i, item in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(item, dict) or set(item) != {"token", "bias"}:
            raise BadRequest(f"{where} must be a map with exactly the keys token and bias")
        token = item["token"]
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < 1 << 31:
            raise BadRequest(f"{where}.token must be a non-negative integer token id")
        bias = item["bias"]
        if isinstance(bias, bool) or not isinstance(bias, int | float) or math.isnan(bias):
            raise BadRequest(f"{where}.bias must be a number (-inf forbids the token)")
        out.append((token, float(bias)))
    return tuple(out)


def _get_samplers(raw: dict[str, Any], key: str) -> tuple[str, ...]:
    value = raw.get(key)
    if value is None:
        return DEFAULT_SAMPLERS
    if not isinstance(value, list) or len(value) > 32:
        raise BadRequest(f"{key} must be a list of at most 32 sampler names")
    for i, item in enumerate(value):
        if item not in SAMPLER_NAMES:
            raise BadRequest(
                f"{key}[{i}] = {shown(item)} is not a sampler; known: {', '.join(SAMPLER_NAMES)}"
            )
    return tuple(value)


def _grammar_bytes(text: str, key: str, most: int) -> None:
    """Hold a grammar (or a schema's JSON text) to ``max_grammar_bytes``
    (UTF-8 bytes: what llama.cpp parses and keeps). A character is at most 4
    bytes, so short text is not encoded to count."""
    if 4 * len(text) > most:
        n = len(text.encode(errors="replace"))
        check(n, most, "max_grammar_bytes", f"{key} is {{n}} bytes")


def _get_grammar(
    raw: dict[str, Any], key: str, grammars: GrammarChecker | None, most: int
) -> str | None:
    if raw.get(key) is None:
        return None
    text = raw[key]
    if not isinstance(text, str):
        raise BadRequest(f"{key} must be a string")
    _grammar_bytes(text, key, most)
    if not text.strip():
        raise BadRequest(f"{key} must not be empty")
    why = grammars.grammar_error(text) if grammars is not None else None
    if why is not None:
        raise BadRequest(f"{key} is not a valid GBNF grammar: {why}")
    return text


def _get_json_schema(
    raw: dict[str, Any], key: str, grammars: GrammarChecker | None, most: int
) -> str | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadRequest(f"{key} must be a map (a JSON schema)")
    if nesting(value) > MAX_SCHEMA_DEPTH:
        raise BadRequest(f"{key} nests deeper than {MAX_SCHEMA_DEPTH} levels")
    try:
        text = canonical_schema(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise BadRequest(f"{key} is not JSON-serialisable: {type(exc).__name__}") from None
    _grammar_bytes(text, key, most)
    why = grammars.schema_error(text) if grammars is not None else None
    if why is not None:
        raise BadRequest(f"{key}: {why}")
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


def get_sampling(
    args: dict[str, Any],
    name: str = "sampling",
    grammars: GrammarChecker | None = None,
    limits: Limits = _DEFAULT_LIMITS,
) -> SamplerSpec | None:
    """``None`` (greedy) when absent; a validated spec otherwise.

    Every field is checked here and named in the error as ``sampling.<field>``;
    the grammar (or the schema's grammar) is parsed too. Only ``<token>``
    references in a grammar and ``logit_bias`` tokens beyond the vocabulary
    are left to the chain build (``SamplerError``). Without ``grammars`` the
    grammar is only parsed when the chain is built (still ``bad_request``).
    A grammar or schema over ``limits.max_grammar_bytes``, or more
    ``logit_bias`` entries than ``limits.max_logit_bias``, is ``limit_exceeded``.
    """
    raw = args.get(name)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise BadRequest(f"{name} must be a map")
    unknown = sorted(str(k) for k in raw if k not in _SAMPLING_KEYS)
    if unknown:
        raise BadRequest(f"{name}.{unknown[0][:64]} is not a known sampling field")
    # prefixed keys make every helper's message name the field as sampling.<field>
    p = {f"{name}.{k}": v for k, v in raw.items()}
    b = SamplerSpec()

    def num(key: str, default: float, lo: float, hi: float) -> float:
        return get_float(p, f"{name}.{key}", default=default, lo=lo, hi=hi)

    def integer(key: str, default: int, lo: int, hi: int) -> int:
        return get_int(p, f"{name}.{key}", default=default, lo=lo, hi=hi)

    repeat_penalty = num("repeat_penalty", b.repeat_penalty, 0.0, 100.0)
    if repeat_penalty <= 0.0:
        raise BadRequest(f"{name}.repeat_penalty must be > 0 (1.0 disables it)")
    most = limits.max_grammar_bytes
    grammar = _get_grammar(p, f"{name}.grammar", grammars, most)
    json_schema = _get_json_schema(p, f"{name}.json_schema", grammars, most)
    if grammar is not None and json_schema is not None:
        raise BadRequest(f"{name}.grammar and {name}.json_schema cannot both be given")
    return SamplerSpec(
        temperature=num("temperature", b.temperature, 0.0, 100.0),
        top_k=integer("top_k", b.top_k, 0, 1 << 20),
        top_p=num("top_p", b.top_p, 0.0, 1.0),
        min_p=num("min_p", b.min_p, 0.0, 1.0),
        seed=integer("seed", DEFAULT_SEED, 0, 0xFFFFFFFF),
        typical_p=num("typical_p", b.typical_p, 0.0, 1.0),
        top_n_sigma=num("top_n_sigma", b.top_n_sigma, -1.0, 100.0),
        dynatemp_range=num("dynatemp_range", b.dynatemp_range, 0.0, 100.0),
        dynatemp_exponent=num("dynatemp_exponent", b.dynatemp_exponent, 0.0, 100.0),
        repeat_penalty=repeat_penalty,
        presence_penalty=num("presence_penalty", b.presence_penalty, -100.0, 100.0),
        frequency_penalty=num("frequency_penalty", b.frequency_penalty, -100.0, 100.0),
        penalty_last_n=integer("penalty_last_n", b.penalty_last_n, -1, _MAX_LAST_N),
        dry_multiplier=num("dry_multiplier", b.dry_multiplier, 0.0, 100.0),
        dry_base=num("dry_base", b.dry_base, 1.0, 100.0),
        dry_allowed_length=integer("dry_allowed_length", b.dry_allowed_length, 0, _MAX_LAST_N),
        dry_penalty_last_n=integer("dry_penalty_last_n", b.dry_penalty_last_n, -1, _MAX_LAST_N),
        dry_sequence_breakers=_get_breakers(p, f"{name}.dry_sequence_breakers"),
        xtc_probability=num("xtc_probability", b.xtc_probability, 0.0, 1.0),
        xtc_threshold=num("xtc_threshold", b.xtc_threshold, 0.0, 1.0),
        mirostat=integer("mirostat", b.mirostat, 0, 2),
        mirostat_tau=num("mirostat_tau", b.mirostat_tau, 0.0, 100.0),
        mirostat_eta=num("mirostat_eta", b.mirostat_eta, 0.0, 1.0),
        logit_bias=_get_logit_bias(p, f"{name}.logit_bias", limits.max_logit_bias),
        ignore_eos=get_bool(p, f"{name}.ignore_eos", False),
        samplers=_get_samplers(p, f"{name}.samplers"),
        grammar=grammar,
        json_schema=json_schema,
    )
