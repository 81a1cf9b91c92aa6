"""Argument validation at the edge: every bad input becomes ``bad_request``.

Each helper names the offending field in its message so a client can fix
its request without reading our source. msgpack gives us plain Python
values; note that ``bool`` is an ``int`` subclass and must be refused where
an integer is expected.
"""

from __future__ import annotations

import math
from typing import Any

from .engine import DEFAULT_SEED, SamplerSpec
from .engine.sampling import (
    DEFAULT_DRY_BREAKERS,
    DEFAULT_SAMPLERS,
    MAX_LOGIT_BIAS,
    SAMPLER_NAMES,
    SamplerError,
    canonical_schema,
    check_grammar,
    schema_to_grammar,
)
from .runtime import InvalidArgument


class BadRequest(InvalidArgument):
    """The request does not follow the protocol."""


def args_map(header: dict[str, Any]) -> dict[str, Any]:
    args = header.get("args", {})
    if args is None:
        return {}
    if not isinstance(args, dict):
        raise BadRequest("args must be a map")
    return args


def get_int(
    args: dict[str, Any],
    name: str,
    *,
    default: int | None = None,
    lo: int | None = None,
    hi: int | None = None,
) -> int:
    value = args.get(name, default)
    if value is None:
        raise BadRequest(f"{name} is required")
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer")
    if lo is not None and value < lo:
        raise BadRequest(f"{name} must be >= {lo}")
    if hi is not None and value > hi:
        raise BadRequest(f"{name} must be <= {hi}")
    return value


def get_float(args: dict[str, Any], name: str, *, default: float, lo: float, hi: float) -> float:
    value = args.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"{name} must be a number")
    value = float(value)
    if math.isnan(value) or not lo <= value <= hi:
        raise BadRequest(f"{name} must be within [{lo}, {hi}]")
    return value


def get_bool(args: dict[str, Any], name: str, default: bool) -> bool:
    value = args.get(name, default)
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be a boolean")
    return value


def get_str(args: dict[str, Any], name: str, *, max_len: int = 1 << 20) -> str:
    value = args.get(name)
    if not isinstance(value, str):
        raise BadRequest(f"{name} must be a string")
    if len(value) > max_len:
        raise BadRequest(f"{name} is longer than {max_len} characters")
    return value


def get_session(header: dict[str, Any]) -> str:
    value = header.get("session")
    if not isinstance(value, str) or not 0 < len(value) <= 256:
        raise BadRequest("session must be a non-empty string of at most 256 characters")
    return value


def check_token(value: Any, n_vocab: int, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{where} must be an integer token id")
    if not 0 <= value < n_vocab:
        raise BadRequest(f"{where} = {value} is outside the vocabulary [0, {n_vocab})")
    return value


def get_tokens(
    args: dict[str, Any], name: str, n_vocab: int, *, max_len: int, allow_empty: bool = False
) -> list[int]:
    value = args.get(name)
    if not isinstance(value, list):
        raise BadRequest(f"{name} must be a list of token ids")
    if not value and not allow_empty:
        raise BadRequest(f"{name} must not be empty")
    if len(value) > max_len:
        raise BadRequest(f"{name} has {len(value)} tokens; at most {max_len} fit")
    return [check_token(t, n_vocab, f"{name}[{i}]") for i, t in enumerate(value)]


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
_MAX_GRAMMAR_CHARS = 1 << 18
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


def _get_logit_bias(raw: dict[str, Any], key: str) -> tuple[tuple[int, float], ...]:
    value = raw.get(key)
    if value is None:
        return ()
    if not isinstance(value, list):
        raise BadRequest(f"{key} must be a list of {{token, bias}} maps")
    if len(value) > MAX_LOGIT_BIAS:
        raise BadRequest(f"{key} has {len(value)} entries; at most {MAX_LOGIT_BIAS} are allowed")
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
                f"{key}[{i}] = {item!r} is not a sampler; known: {', '.join(SAMPLER_NAMES)}"
            )
    return tuple(value)


def _get_grammar(raw: dict[str, Any], key: str) -> str | None:
    if raw.get(key) is None:
        return None
    text = get_str(raw, key, max_len=_MAX_GRAMMAR_CHARS)
    if not text.strip():
        raise BadRequest(f"{key} must not be empty")
    why = check_grammar(text)
    if why is not None:
        raise BadRequest(f"{key} is not a valid GBNF grammar: {why}")
    return text


def _get_json_schema(raw: dict[str, Any], key: str) -> str | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadRequest(f"{key} must be a map (a JSON schema)")
    try:
        text = canonical_schema(value)
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"{key} is not JSON-serialisable: {exc}") from None
    if len(text) > _MAX_GRAMMAR_CHARS:
        raise BadRequest(f"{key} is longer than {_MAX_GRAMMAR_CHARS} characters")
    try:
        grammar = schema_to_grammar(text)
    except SamplerError as exc:
        raise BadRequest(f"{key}: {exc}") from None
    why = check_grammar(grammar)
    if why is not None:
        raise BadRequest(f"{key} gives an invalid grammar: {why}")
    return text


def get_sampling(args: dict[str, Any], name: str = "sampling") -> SamplerSpec | None:
    """``None`` (greedy) when absent; a validated spec otherwise.

    Every field is checked here and named in the error as ``sampling.<field>``;
    the grammar (or the schema's grammar) is parsed too. Only ``<token>``
    references in a grammar and ``logit_bias`` tokens beyond the vocabulary
    are left to the chain build (``SamplerError``).
    """
    raw = args.get(name)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise BadRequest(f"{name} must be a map")
    unknown = sorted(set(raw) - _SAMPLING_KEYS)
    if unknown:
        raise BadRequest(f"{name}.{unknown[0]} is not a known sampling field")
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
    grammar = _get_grammar(p, f"{name}.grammar")
    json_schema = _get_json_schema(p, f"{name}.json_schema")
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
        logit_bias=_get_logit_bias(p, f"{name}.logit_bias"),
        ignore_eos=get_bool(p, f"{name}.ignore_eos", False),
        samplers=_get_samplers(p, f"{name}.samplers"),
        grammar=grammar,
        json_schema=json_schema,
    )
