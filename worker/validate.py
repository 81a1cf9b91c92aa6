"""Argument validation at the edge: every bad input becomes ``bad_request``.

Each helper names the offending field in its message so a client can fix
its request without reading our source. msgpack gives us plain Python
values; note that ``bool`` is an ``int`` subclass and must be refused where
an integer is expected. A value is checked for its type before anything
else touches it (a peer may send any nesting of maps and lists).

This module imports neither the engine nor llama.cpp: grammars are checked
through the ``GrammarChecker`` the caller passes in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from faults import BadRequest, ContextOverflow
from protocol import frames
from protocol.envelope import MAX_SESSION_CHARS

from .spec import (
    DEFAULT_DRY_BREAKERS,
    DEFAULT_SAMPLERS,
    DEFAULT_SEED,
    MAX_LOGIT_BIAS,
    SAMPLER_NAMES,
    GrammarChecker,
    SamplerSpec,
    canonical_schema,
)

MAX_MESSAGES = 4096


def shown(value: Any, limit: int = 64) -> str:
    """A peer's value as it may appear in an error message: repr, cut short."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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


def get_session(session: str | None) -> str:
    """The request's session, which this op requires (the edge checked its type)."""
    if session is None:
        raise BadRequest("session is required")
    return session


def check_session(value: Any, where: str = "session") -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_SESSION_CHARS:
        raise BadRequest(
            f"{where} must be a non-empty string of at most {MAX_SESSION_CHARS} characters"
        )
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
        raise BadRequest(f"{name} has {len(value)} tokens; at most {max_len} are allowed")
    return [check_token(t, n_vocab, f"{name}[{i}]") for i, t in enumerate(value)]


def get_prompt_tokens(args: dict[str, Any], name: str, n_vocab: int, cells: int) -> list[int]:
    """Tokens bound for a session's KV cache: more than ``cells`` is ``context_overflow``."""
    value = args.get(name)
    if isinstance(value, list) and len(value) > cells:
        raise ContextOverflow(
            f"{name} has {len(value)} tokens; a session holds at most {cells} (context_overflow)"
        )
    return get_tokens(args, name, n_vocab, max_len=cells)


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
MAX_SCHEMA_DEPTH = 16
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
                f"{key}[{i}] = {shown(item)} is not a sampler; known: {', '.join(SAMPLER_NAMES)}"
            )
    return tuple(value)


def _get_grammar(raw: dict[str, Any], key: str, check: GrammarChecker | None) -> str | None:
    if raw.get(key) is None:
        return None
    text = get_str(raw, key, max_len=_MAX_GRAMMAR_CHARS)
    if not text.strip():
        raise BadRequest(f"{key} must not be empty")
    why = check.grammar_error(text) if check is not None else None
    if why is not None:
        raise BadRequest(f"{key} is not a valid GBNF grammar: {why}")
    return text


def _get_json_schema(raw: dict[str, Any], key: str, check: GrammarChecker | None) -> str | None:
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
    if len(text) > _MAX_GRAMMAR_CHARS:
        raise BadRequest(f"{key} is longer than {_MAX_GRAMMAR_CHARS} characters")
    why = check.schema_error(text) if check is not None else None
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
    args: dict[str, Any], name: str = "sampling", grammars: GrammarChecker | None = None
) -> SamplerSpec | None:
    """``None`` (greedy) when absent; a validated spec otherwise.

    Every field is checked here and named in the error as ``sampling.<field>``;
    the grammar (or the schema's grammar) is parsed too. Only ``<token>``
    references in a grammar and ``logit_bias`` tokens beyond the vocabulary
    are left to the chain build (``SamplerError``). Without ``grammars`` the
    grammar is only parsed when the chain is built (still ``bad_request``).
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
    grammar = _get_grammar(p, f"{name}.grammar", grammars)
    json_schema = _get_json_schema(p, f"{name}.json_schema", grammars)
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


def get_messages(args: dict[str, Any], max_chars: int) -> list[dict[str, str]]:
    """Validate ``messages``: a non-empty list of ``{"role", "content"}`` strings."""
    messages = args.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    if len(messages) > MAX_MESSAGES:
        raise BadRequest(f"messages has more than {MAX_MESSAGES} entries")
    out: list[dict[str, str]] = []
    total = 0
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise BadRequest(f"messages[{i}] must be a map")
        role, content = msg.get("role"), msg.get("content")
        if not isinstance(role, str) or not 0 < len(role) <= 64:
            raise BadRequest(f"messages[{i}].role must be a non-empty string")
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string")
        total += len(content)
        if total > max_chars:
            raise BadRequest(f"messages are longer than {max_chars} characters")
        out.append({"role": role, "content": content})
    return out


OUTPUT_NAMES = ("hidden", "logits")
# Rows of logits one reply may carry (each is n_vocab floats: 1 MiB here).
MAX_LOGIT_ROWS = 64


def get_outputs(args: dict[str, Any]) -> tuple[str, ...]:
    """``output``: which tensors a step returns (``return_logits`` = ["logits"])."""
    value = args.get("output")
    if value is None:
        return ("logits",) if get_bool(args, "return_logits", False) else ()
    if "return_logits" in args:
        raise BadRequest("give output or return_logits, not both")
    if (
        not isinstance(value, list)
        or not all(isinstance(v, str) for v in value)
        or len(set(value)) != len(value)
        or not set(value) <= set(OUTPUT_NAMES)
    ):
        raise BadRequest(f"output must be a list of distinct names from {list(OUTPUT_NAMES)}")
    return tuple(v for v in OUTPUT_NAMES if v in value)


def check_logit_rows(outputs: tuple[str, ...], rows: int) -> None:
    if "logits" in outputs and rows > MAX_LOGIT_ROWS:
        raise BadRequest(
            f"output logits for {rows} rows exceeds {MAX_LOGIT_ROWS} per reply "
            "(ask for hidden, or send fewer tokens)"
        )


def get_frame(args: dict[str, Any], name: str, buffers: Sequence[Any]) -> frames.Frame:
    """A tensor frame the request carries under ``name`` (fully validated)."""
    if name not in args:
        raise BadRequest(f"{name} is required (a tensor frame)")
    try:
        return frames.parse(args[name], buffers)
    except frames.FrameError as exc:
        # the message names the field as frame.<field>; name it where it was
        raise BadRequest(exc.message.replace("frame.", f"{name}.", 1)) from None
