"""msgpack codec for the header frame.

A message is ``[header, *buffers]``: the header is one msgpack map, buffers
are raw bytes the header refers to by index. Only the header goes through
msgpack; buffers are passed through untouched so large tensors are never
copied in Python.
"""

from __future__ import annotations

from typing import Any

import msgpack

# Default cap on one header frame. Token lists live in the header, so this
# also bounds the largest prompt a peer can send (~800k tokens at 5 B each).
DEFAULT_MAX_HEADER_BYTES = 4 * 1024 * 1024

# Deepest nesting of maps and lists a header may have. Real headers nest 5
# or 6 levels (header > args > sampling > json_schema > ...); a bound keeps
# recursive code anywhere downstream (repr, json, grammar converters) safe.
MAX_DEPTH = 32


class CodecError(ValueError):
    """The header frame is not a msgpack map we can read."""


class HeaderTooLarge(CodecError):
    """The header frame is larger than the receiver allows."""


class TooDeep(CodecError):
    """Maps and lists nest deeper than ``MAX_DEPTH``.

    ``req_id`` is the header's own integer ``id`` when it has one, so the
    refusal can still be matched to its request.
    """

    def __init__(self, message: str, req_id: int | None) -> None:
        super().__init__(message)
        self.req_id = req_id


def encode(header: dict[str, Any]) -> bytes:
    """Pack one header map."""
    packed: bytes = msgpack.packb(header, use_bin_type=True)
    return packed


def decode(
    raw: bytes | memoryview, max_bytes: int = DEFAULT_MAX_HEADER_BYTES, max_depth: int = MAX_DEPTH
) -> dict[str, Any]:
    """Unpack one header map, refusing anything that is not a map.

    Raises ``HeaderTooLarge`` before parsing when the frame is over
    ``max_bytes`` so a hostile peer cannot make us build huge objects, and
    ``TooDeep`` when containers nest deeper than ``max_depth``.
    """
    if len(raw) > max_bytes:
        raise HeaderTooLarge(f"header is {len(raw)} bytes; the limit is {max_bytes}")
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as exc:
        raise CodecError(f"header is not valid msgpack: {exc}") from exc
    except Exception as exc:  # msgpack raises a few odd types on garbage
        raise CodecError(f"header is not valid msgpack: {type(exc).__name__}") from exc
    if not isinstance(obj, dict):
        raise CodecError(f"header must be a map, got {type(obj).__name__}")
    if _deeper_than(obj, max_depth):
        raw_id = obj.get("id")
        req_id = raw_id if type(raw_id) is int else None
        raise TooDeep(f"header nests maps and lists deeper than {max_depth} levels", req_id)
    return obj


def _deeper_than(obj: Any, limit: int) -> bool:
    """True when containers nest past ``limit`` (iterative: no recursion to exhaust).

    Only containers are pushed; a long flat list (a prompt's tokens) costs
    one C-level scan per list.
    """
    stack: list[tuple[Any, int]] = [(obj, 1)]
    containers = (dict, list)
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        nested = [c for c in children if isinstance(c, containers)]
        if nested:
            if depth >= limit:
                return True
            stack.extend((c, depth + 1) for c in nested)
    return False
