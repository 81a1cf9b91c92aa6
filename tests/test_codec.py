"""Pure unit tests of the wire codec, envelope and tensor frames."""

from __future__ import annotations

import msgpack
import pytest

from protocol import transport


def test_header_round_trip() -> None:
    header = transport.request(7, "decode", "s1", {"token": 5}, deadline_ms=100)
    assert transport.decode(transport.encode(header)) == header


@pytest.mark.parametrize("raw", [b"\xc1", b"", b"\x92\x01", msgpack.packb([1, 2])])
def test_non_map_or_garbage_is_codec_error(raw: bytes) -> None:
    with pytest.raises(transport.CodecError):
        transport.decode(raw)


def test_oversized_header_is_refused_before_parsing() -> None:
    raw = transport.encode({"v": 1, "blob": b"x" * 2048})
    with pytest.raises(transport.HeaderTooLarge):
        transport.decode(raw, max_bytes=1024)


def test_error_reply_shape() -> None:
    reply = transport.error_reply(3, transport.ErrorCode.QUEUE_FULL, "full", retry_after_ms=50)
    assert reply == {
        "v": 1,
        "id": 3,
        "ok": False,
        "error": {"code": "queue_full", "message": "full", "retry_after_ms": 50},
    }
