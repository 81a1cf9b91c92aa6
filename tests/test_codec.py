"""Pure unit tests of the wire codec, envelope and tensor frames."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from protocol import codec, envelope, frames


def test_header_round_trip() -> None:
    header = envelope.request(7, "decode", "s1", {"token": 5}, deadline_ms=100)
    assert codec.decode(codec.encode(header)) == header


@pytest.mark.parametrize("raw", [b"\xc1", b"", b"\x92\x01", msgpack.packb([1, 2])])
def test_non_map_or_garbage_is_codec_error(raw: bytes) -> None:
    with pytest.raises(codec.CodecError):
        codec.decode(raw)


def test_oversized_header_is_refused_before_parsing() -> None:
    raw = codec.encode({"v": 1, "blob": b"x" * 2048})
    with pytest.raises(codec.HeaderTooLarge):
        codec.decode(raw, max_bytes=1024)


def test_error_reply_shape() -> None:
    reply = envelope.error_reply(3, envelope.ErrorCode.QUEUE_FULL, "full", retry_after_ms=50)
    assert reply == {
        "v": 1,
        "id": 3,
        "ok": False,
        "error": {"code": "queue_full", "message": "full", "retry_after_ms": 50},
    }


def test_tensor_frame_is_zero_copy_both_ways() -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    buffers: list[object] = []
    desc = frames.attach(array, buffers)
    assert desc == {"buffer": 0, "dtype": "float32", "shape": [3, 4], "nbytes": 48}
    out = frames.view(desc, buffers)
    np.testing.assert_array_equal(out, array)
    assert np.shares_memory(out, array)


def test_tensor_frame_rejects_size_mismatch() -> None:
    with pytest.raises(frames.FrameError):
        frames.view({"buffer": 0, "dtype": "float32", "shape": [5]}, [b"\x00" * 8])
    with pytest.raises(frames.FrameError):
        frames.view({"buffer": 3, "dtype": "float32", "shape": [1]}, [b"\x00" * 4])
