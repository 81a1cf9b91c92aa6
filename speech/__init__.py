"""skiff-speech: an offline text-to-speech worker behind the skiff envelope.

Piper voices (the packaged ``joe`` voice by default) turn text into 16-bit
mono PCM. The worker is its own process with its own ROUTER socket so a slow
synthesis never competes with the LLM worker for its event loop, and several
speech workers can run side by side on different endpoints.
"""

from __future__ import annotations

DEFAULT_BIND = "tcp://127.0.0.1:5565"
FORMATS = ("wav", "pcm_s16le")

__all__ = ["DEFAULT_BIND", "FORMATS"]
