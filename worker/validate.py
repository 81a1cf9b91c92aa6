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


_SAMPLING_KEYS = {"temperature", "top_k", "top_p", "min_p", "seed"}


def get_sampling(args: dict[str, Any], name: str = "sampling") -> SamplerSpec | None:
    """``None`` (greedy) when absent; a validated spec otherwise."""
    raw = args.get(name)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise BadRequest(f"{name} must be a map")
    unknown = sorted(set(raw) - _SAMPLING_KEYS)
    if unknown:
        raise BadRequest(f"{name}.{unknown[0]} is not a known sampling field")
    base = SamplerSpec()
    return SamplerSpec(
        temperature=get_float(raw, "temperature", default=base.temperature, lo=0.0, hi=100.0),
        top_k=get_int(raw, "top_k", default=base.top_k, lo=0, hi=1 << 20),
        top_p=get_float(raw, "top_p", default=base.top_p, lo=0.0, hi=1.0),
        min_p=get_float(raw, "min_p", default=base.min_p, lo=0.0, hi=1.0),
        seed=get_int(raw, "seed", default=DEFAULT_SEED, lo=0, hi=0xFFFFFFFF),
    )
