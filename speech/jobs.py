"""A synthesize request as the speech worker runs it: its arguments checked into a ``Job``.

``Job.from_request`` is the edge-side check (``bad_request`` naming the
field, ``limit_exceeded`` for text over ``--max-chars``); the ``Job`` then
carries the request from the queue through each sentence chunk to its last
reply (``speech/server.py``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from edge import Request
from faults import BadRequest, LimitExceeded

from . import FORMATS, audio
from .engine import MAX_SPEED, MIN_SPEED, Engine

_SYNTH_ARGS = frozenset({"text", "voice", "format", "speed", "stream", "max_seconds"})


@dataclass
class Job:
    """A synthesize request from admission to its last reply."""

    peer: bytes
    req_id: int
    text: str
    voice: str
    fmt: str
    speed: float
    stream: bool
    max_seconds: float | None
    received: float
    chunks: list[str] = field(default_factory=list)
    next_chunk: int = 0
    seq: int = 0
    samples: int = 0
    phonemes: int = 0
    parts: list[audio.Samples] = field(default_factory=list)
    started: float | None = None
    first_audio: float | None = None
    cancelled: bool = False

    @classmethod
    def from_request(cls, req: Request, engine: Engine, max_chars: int) -> Job:
        """Check synthesize args at the edge: ``bad_request`` naming the field,
        ``limit_exceeded`` for text over ``--max-chars``."""
        args = req.args
        unknown = sorted(repr(k)[:64] for k in args if k not in _SYNTH_ARGS)
        if unknown:
            raise BadRequest(f"unknown arguments {unknown[:8]}")
        text = args.get("text")
        if not isinstance(text, str) or not text.strip():
            raise BadRequest("text must be a non-empty string")
        if len(text) > max_chars:  # a configured limit, not a malformed request
            raise LimitExceeded(
                f"text has {len(text)} characters; the limit is {max_chars} (--max-chars)"
            )
        if "\x00" in text:  # espeak takes C strings: a NUL raised ValueError mid-synthesis
            raise BadRequest("text must not contain NUL characters")
        voice = args.get("voice", engine.default_voice)
        if not isinstance(voice, str) or voice not in engine.voices:
            raise BadRequest(f"unknown voice; known: {list(engine.voices)}")
        fmt = args.get("format", "wav")
        if not isinstance(fmt, str) or fmt not in FORMATS:
            raise BadRequest(f"unsupported format; supported: {list(FORMATS)}")
        speed = _number(args.get("speed", 1.0), "speed")
        if not MIN_SPEED <= speed <= MAX_SPEED:
            raise BadRequest(f"speed must be in [{MIN_SPEED}, {MAX_SPEED}]")
        stream = args.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("stream must be a boolean")
        max_seconds = args.get("max_seconds")
        if max_seconds is not None:
            max_seconds = _number(max_seconds, "max_seconds")
            if max_seconds <= 0:
                raise BadRequest("max_seconds must be positive")
        return cls(
            peer=req.peer,
            req_id=req.id,
            text=text,
            voice=str(voice),
            fmt=str(fmt),
            speed=speed,
            stream=stream,
            max_seconds=max_seconds,
            received=time.monotonic(),
        )

    @property
    def key(self) -> tuple[bytes, int]:
        return (self.peer, self.req_id)

    def chars_left(self) -> int:
        if self.started is None:
            return len(self.text)
        return sum(len(c) for c in self.chunks[self.next_chunk :])


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRequest(f"{name} must be a finite number")
    return float(value)
