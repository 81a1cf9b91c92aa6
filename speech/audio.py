"""PCM helpers: int16 samples to wire buffers and WAV files.

Kept apart from the engine so clients, tests and benches can pack and parse
audio without importing piper or onnxruntime.
"""

from __future__ import annotations

import io
import wave
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

Samples = npt.NDArray[np.int16]

SAMPLE_WIDTH = 2  # bytes per sample: PCM s16le
CHANNELS = 1


def as_s16le(samples: Samples) -> Samples:
    """Return ``samples`` as a C-contiguous little-endian int16 array.

    The wire format is little-endian whatever the host; on x86 and ARM this is
    the array itself (no copy), so it can leave as a zero-copy frame.
    """
    arr = np.ascontiguousarray(samples, dtype=np.int16)
    if arr.dtype.byteorder == ">":
        arr = arr.astype("<i2")
    return arr


def pcm_buffer(samples: Samples) -> memoryview:
    """A byte view over the samples, suitable for ``send(copy=False)``."""
    return as_s16le(samples).data.cast("B")


def concat(parts: Sequence[Samples]) -> Samples:
    """Join chunks; an empty list gives an empty array rather than an error."""
    if not parts:
        return np.zeros(0, dtype=np.int16)
    return np.concatenate(parts).astype(np.int16, copy=False)


def wav_bytes(samples: Samples, sample_rate: int) -> bytes:
    """Pack mono s16le samples into a complete RIFF/WAVE file in memory.

    The stdlib ``wave`` writer is used so the header is exactly what every
    WAV reader (including ``wave`` itself) expects.
    """
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(CHANNELS)
        wav.setsampwidth(SAMPLE_WIDTH)
        wav.setframerate(sample_rate)
        wav.writeframes(pcm_buffer(samples))
    return out.getvalue()


def duration_ms(sample_count: int, sample_rate: int) -> float:
    return 1000.0 * sample_count / sample_rate if sample_rate else 0.0
