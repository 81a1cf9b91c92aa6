"""``/v1/embeddings`` (skiff ``embed``) and ``/v1/audio/speech`` (``synthesize``).

Embeddings are the mean of the prompt's final hidden states (skiff's
``embed`` with ``pooling: mean``; ``pooling: "last"``, a skiff extension,
takes the last token's instead, as decoder-only embedding models are
trained), not normalised: cosine similarity does not care, dot products do.
The response names the pooling it used (``pooling``, beside OpenAI's fields).
``encoding_format: base64`` is the little-endian float32 bytes, as OpenAI
sends it. A list input runs as concurrent ``embed`` requests, a few at a
time, so one large batch cannot fill the worker's admission queue by itself.

Speech maps to a streamed ``synthesize`` on the speech worker (``Speech``):
``pcm`` is raw s16le mono, ``wav`` the same behind a streaming WAV header;
either is written as the worker makes it (first clause first), raw or as
server-sent ``speech.audio.delta`` events (``stream_format: sse``), with the
sample rate in ``X-Sample-Rate`` because raw PCM does not carry it. OpenAI's
stock voice names (``alloy``...) select the worker's default voice; a worker
voice name selects that voice.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiohttp import web

from edge.logs import get_logger

from .errors import ApiError, bad
from .shapes import check_model
from .upstream import Upstream

log = get_logger("gateway.http")

EMBED_CONCURRENCY = 4
POOLINGS = ("mean", "last")  # skiff embed poolings that give one vector per input
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
SPEECH_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm"}  # response_format -> Content-Type
UNKNOWN_SIZE = 0xFFFFFFFF


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
    pooling = body.get("pooling") or "mean"
    if pooling not in POOLINGS:
        raise bad("pooling must be 'mean' or 'last'", "pooling")
    up.check_up()
    gate = asyncio.Semaphore(EMBED_CONCURRENCY)

    async def one(args: dict[str, Any]) -> tuple[np.ndarray[Any, Any], int]:
        async with gate:
            reply = await up.call("embed", {**args, "pooling": pooling})
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
        "pooling": pooling,
    }


@dataclass(frozen=True)
class SpeechPlan:
    """What one ``/v1/audio/speech`` body asks: streamed ``synthesize`` args,
    the OpenAI ``response_format`` and whether the stream is server-sent events."""

    args: dict[str, Any]
    fmt: str  # "wav" or "pcm"
    sse: bool


def speech_plan(body: dict[str, Any]) -> SpeechPlan:
    """Check a ``/v1/audio/speech`` body (400 naming the field) into a plan."""
    if not isinstance(body.get("model"), str):
        raise bad("model is required (a string)", "model")
    text = body.get("input")
    if not isinstance(text, str) or not text.strip():
        raise bad("input must be a non-empty string", "input")
    args: dict[str, Any] = {"text": text, "stream": True}
    voice = body.get("voice")
    if isinstance(voice, dict):  # {"id": ...}: a custom voice reference
        voice = voice.get("id")
    if not isinstance(voice, str) or not voice:
        raise bad("voice is required (a string)", "voice")
    if voice not in OPENAI_VOICES:
        args["voice"] = voice  # the worker answers bad_request for a name it lacks
    fmt = body.get("response_format") or "wav"
    if fmt not in SPEECH_TYPES:
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
    stream_format = body.get("stream_format") or "audio"
    if stream_format not in ("audio", "sse"):
        raise bad("stream_format must be 'audio' or 'sse'", "stream_format")
    return SpeechPlan(args, str(fmt), stream_format == "sse")


def wav_stream_header(rate: int) -> bytes:
    """A RIFF/WAVE header for mono s16le of unknown length: both sizes are
    0xFFFFFFFF, as OpenAI streams WAV (readers stop at the end of the data)."""
    return struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        *(b"RIFF", UNKNOWN_SIZE, b"WAVE", b"fmt ", 16, 1, 1, rate, 2 * rate, 2, 16),
        *(b"data", UNKNOWN_SIZE),
    )


def speech_usage(done: dict[str, Any]) -> dict[str, int]:
    """``speech.audio.done``'s usage. Piper's input tokens are the phoneme ids
    its voice model read; it writes samples directly, so no output tokens."""
    phonemes = int(done.get("phonemes", 0) or 0)
    return {"input_tokens": phonemes, "output_tokens": 0, "total_tokens": phonemes}


def _event(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


class Speech:
    """The speech endpoint over one upstream (the speech worker or the gateway).

    Every request is a streamed ``synthesize``: the worker sends the first
    clause's audio as soon as it is made, and each chunk is written to the
    client as it arrives, raw (``stream_format: audio``, chunked transfer) or
    as ``speech.audio.delta`` events (``sse``). The first reply is awaited
    before the status line, so a refusal keeps its HTTP status. The sample
    rate comes with the first audio event. A client that goes away cancels
    the synthesis (``Upstream.release``): the worker stops before its next chunk.
    """

    def __init__(self, up: Upstream) -> None:
        self.up = up

    async def handle(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        plan = speech_plan(body)
        self.up.check_up()
        pending = self.up.open("synthesize", plan.args)
        try:
            reply = await self.up.next(pending)  # errors still become an HTTP status
            rate = int(reply.header.get("sample_rate") or 0)
            kind = "text/event-stream" if plan.sse else SPEECH_TYPES[plan.fmt]
            headers = {"Content-Type": kind, "X-Sample-Rate": str(rate)}
            if plan.sse:
                headers["Cache-Control"] = "no-cache"
            response = web.StreamResponse(headers=headers)
            await response.prepare(request)
            head = wav_stream_header(rate) if plan.fmt == "wav" else b""
            try:
                while True:
                    for buffer in reply.buffers:
                        data = head + bytes(buffer) if head else buffer
                        head = b""
                        await response.write(_delta(data) if plan.sse else data)
                    if reply.done:
                        break
                    reply = await self.up.next(pending)
            except ApiError as exc:
                log.warning("speech_stream_error", code=exc.code, message=exc.message)
                if plan.sse:  # too late for a status: an error event, then the end
                    await response.write(_event({"type": "error", **exc.body()}))
                    await response.write_eof()
                # Raw audio has no error frame: cut the connection so the client
                # sees a truncated body, not a short clip.
                elif request.transport is not None:
                    request.transport.close()
                return response
            if head:  # no audio at all (nothing to speak): still a WAV stream
                await response.write(_delta(head) if plan.sse else head)
            if plan.sse:
                done = {"type": "speech.audio.done", "usage": speech_usage(reply.header)}
                await response.write(_event(done))
            await response.write_eof()
            return response
        finally:
            self.up.release(pending)


def _delta(data: bytes | memoryview) -> bytes:
    audio = base64.b64encode(data).decode("ascii")
    return _event({"type": "speech.audio.delta", "audio": audio})
