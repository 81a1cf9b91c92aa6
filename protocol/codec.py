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


class CodecError(ValueError):
    """The header frame is not a msgpack map we can read."""


class HeaderTooLarge(CodecError):
    """The header frame is larger than the receiver allows."""


def encode(header: dict[str, Any]) -> bytes:
    """Pack one header map."""
    packed: bytes = msgpack.packb(header, use_bin_type=True)
    return packed


def decode(raw: bytes | memoryview, max_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> dict[str, Any]:
    """Unpack one header map, refusing anything that is not a map.

    Raises ``HeaderTooLarge`` before parsing when the frame is over
    ``max_bytes`` so a hostile peer cannot make us build huge objects.
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
    return obj
