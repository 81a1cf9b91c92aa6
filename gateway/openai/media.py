"""``/v1/embeddings`` (skiff ``embed``) and ``/v1/audio/speech`` (``synthesize``).

Embeddings are mean-pooled final hidden states, as skiff's ``embed`` gives
them (not normalised: cosine similarity does not care, dot products do).
``encoding_format: base64`` is the little-endian float32 bytes, as OpenAI
sends it. A list input runs as concurrent ``embed`` requests, a few at a
time, so one large batch cannot fill the worker's admission queue by itself.

Speech maps to the speech worker: ``wav`` is one non-streamed ``synthesize``
(a complete RIFF file); ``pcm`` streams raw s16le mono sentence by sentence
as the worker produces it (the lowest time to first audio), with the sample
rate in ``X-Sample-Rate`` because raw PCM does not carry it. OpenAI's stock
voice names (``alloy``...) select the worker's default voice; a worker voice
name selects that voice.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
from aiohttp import web

from edge.logs import get_logger

from .errors import ApiError, bad
from .shapes import check_model
from .upstream import Upstream

log = get_logger("gateway.http")

EMBED_CONCURRENCY = 4
MAX_EMBED_INPUTS = 2048
OPENAI_VOICES = frozenset(
    [
        "alloy",
        "ash",
        "ballad",
        "coral",
        "echo",
        "fable",
        "onyx",
        "nova",
        "sage",
        "shimmer",
        "verse",
        "marin",
        "cedar",
    ]
)
SPEECH_FORMATS = {"wav": ("wav", "audio/wav"), "pcm": ("pcm_s16le", "audio/pcm")}


def _embed_inputs(value: Any) -> list[dict[str, Any]]:
    """``input``: a string, strings, a token list, or token lists -> embed args."""
    if isinstance(value, str):
        return [{"text": value}]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            items: list[dict[str, Any]] = [{"text": v} for v in value]
        elif all(type(v) is int for v in value):
            items = [{"tokens": value}]
        elif all(isinstance(v, list) and v and all(type(t) is int for t in v) for v in value):
            items = [{"tokens": v} for v in value]
        else:
            raise bad("input must be a string, a list of strings, or token lists", "input")
        if len(items) > MAX_EMBED_INPUTS:
            raise bad(f"input has more than {MAX_EMBED_INPUTS} entries", "input")
        return items
    raise bad("input must be a non-empty string or list", "input")


async def embeddings(up: Upstream, body: dict[str, Any], model_name: str) -> dict[str, Any]:
    check_model(body, model_name)
    items = _embed_inputs(body.get("input"))
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise bad("encoding_format must be 'float' or 'base64'", "encoding_format")
    dimensions = body.get("dimensions")
    up.check_up()
    gate = asyncio.Semaphore(EMBED_CONCURRENCY)

    async def one(args: dict[str, Any]) -> tuple[np.ndarray[Any, Any], int]:
        async with gate:
            reply = await up.call("embed", {**args, "pooling": "mean"})
        vector = np.asarray(reply.frame.array("embedding"), dtype="<f4")
        return vector, int(reply.result.get("tokens", 0))

    results = await asyncio.gather(*(one(args) for args in items))
    if dimensions is not None and any(v.shape[0] != dimensions for v, _ in results):
        raise bad(
            f"dimensions: this model's embeddings have {results[0][0].shape[0]}", "dimensions"
        )
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": base64.b64encode(vector.tobytes()).decode("ascii")
            if encoding == "base64"
            else vector.astype(float).tolist(),
        }
        for i, (vector, _) in enumerate(results)
    ]
    tokens = sum(n for _, n in results)
    return {
        "object": "list",
        "data": data,
        "model": model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def speech_args(body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(synthesize args, OpenAI response_format) for a ``/v1/audio/speech`` body."""
    if not isinstance(body.get("model"), str):
        raise bad("model is required (a string)", "model")
    text = body.get("input")
    if not isinstance(text, str) or not text.strip():
        raise bad("input must be a non-empty string", "input")
    args: dict[str, Any] = {"text": text}
    voice = body.get("voice")
    if isinstance(voice, dict):  # {"id": ...}: a custom voice reference
        voice = voice.get("id")
    if not isinstance(voice, str) or not voice:
        raise bad("voice is required (a string)", "voice")
    if voice not in OPENAI_VOICES:
        args["voice"] = voice  # the worker answers bad_request for a name it lacks
    fmt = body.get("response_format") or "wav"
    if fmt not in SPEECH_FORMATS:
        raise bad(
            f"response_format {str(fmt)[:16]!r} is not supported; use 'wav' or 'pcm'",
            "response_format",
        )
    speed = body.get("speed")
    if speed is not None:
        if isinstance(speed, bool) or not isinstance(speed, int | float):
            raise bad("speed must be a number", "speed")
        if not 0.25 <= speed <= 4.0:
            raise bad("speed must be between 0.25 and 4.0", "speed")
        args["speed"] = float(speed)
    if body.get("stream_format") not in (None, "audio"):
        raise bad("stream_format: only 'audio' is supported", "stream_format")
    args["format"] = SPEECH_FORMATS[fmt][0]
    return args, fmt


class Speech:
    """The speech endpoint over one upstream (the speech worker or the gateway)."""

    def __init__(self, up: Upstream) -> None:
        self.up = up
        self._rates: dict[str, int] = {}  # voice -> sample rate, from ``info``
        self._default_rate = 0

    async def _rate(self, voice: str | None) -> int:
        if not self._default_rate:
            info = (await self.up.call("info")).result
            self._default_rate = int(info.get("sample_rate", 0))
            details = info.get("voice_details") or []
            self._rates = {str(d["name"]): int(d["sample_rate"]) for d in details}
            default = info.get("default_voice")
            if isinstance(default, str) and default in self._rates:
                self._default_rate = self._rates[default]
        return self._rates.get(voice or "", self._default_rate)

    async def handle(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        args, fmt = speech_args(body)
        self.up.check_up()
        if fmt == "wav":
            reply = await self.up.call("synthesize", args)
            audio = reply.buffers[0] if reply.buffers else memoryview(b"")
            return web.Response(body=audio, content_type="audio/wav")
        rate = await self._rate(args.get("voice"))
        pending = self.up.open("synthesize", {**args, "stream": True})
        try:
            reply = await self.up.next(pending)  # errors still become an HTTP status
            headers = {"Content-Type": "audio/pcm", "X-Sample-Rate": str(rate)}
            response = web.StreamResponse(headers=headers)
            await response.prepare(request)
            try:
                while True:
                    for buffer in reply.buffers:
                        await response.write(buffer)
                    if reply.done:
                        break
                    reply = await self.up.next(pending)
            except ApiError as exc:
                # Too late for a status, and raw PCM has no error frame: cut the
                # connection so the client sees a truncated body, not a short clip.
                log.warning("speech_stream_error", code=exc.code, message=exc.message)
                if request.transport is not None:
                    request.transport.close()
                return response
            await response.write_eof()
            return response
        finally:
            self.up.release(pending)
