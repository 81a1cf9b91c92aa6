"""The speech worker's ROUTER loop: one thread, one synthesis at a time.

Each loop turn drains every waiting request without blocking (ping, info,
stats and cancel are answered on the spot; synthesize is validated and
queued), then synthesizes at most one sentence chunk of the running job. So
ping and cancel wait at most one chunk, never a whole text.

Cancellation: ``cancel {"id": N}`` answers ``{"cancelled": true}`` when
request N of the same peer was queued or running; that request then ends
with an ``ok: false`` reply of code ``cancelled`` (after any audio events it
already sent) and no ``done`` event. A stream therefore ends with either a
``done: true`` event or an error reply.

Queueing: at most ``max_queue`` synthesize requests wait (one more may be
running); beyond that the reply is ``queue_full`` with ``retry_after_ms``
estimated from the work ahead.
"""

from __future__ import annotations

import errno
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from protocol import codec
from protocol.envelope import VERSION, ErrorCode, error_reply, event_reply, ok_reply
from worker import logs

from . import FORMATS, audio
from .engine import MAX_CHUNK_CHARS, MAX_SPEED, MIN_SPEED, Engine, split_sentences

log = logs.get_logger("skiff.speech")

IDLE_POLL_MS = 100
MAX_DRAIN = 1000  # requests read per turn, so a flood cannot starve synthesis
_SYNTH_ARGS = frozenset({"text", "voice", "format", "speed", "stream", "max_seconds"})


class RequestError(Exception):
    """A request failed with a stable wire code; the worker goes on."""

    code = ErrorCode.INTERNAL

    def __init__(self, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_ms = retry_after_ms


class BadRequest(RequestError):
    code = ErrorCode.BAD_REQUEST


class UnknownOp(RequestError):
    code = ErrorCode.UNKNOWN_OP


class UnsupportedVersion(RequestError):
    code = ErrorCode.UNSUPPORTED_VERSION


class PayloadTooLarge(RequestError):
    code = ErrorCode.PAYLOAD_TOO_LARGE


class QueueFull(RequestError):
    code = ErrorCode.QUEUE_FULL


class LimitExceeded(RequestError):
    code = ErrorCode.LIMIT_EXCEEDED


class Cancelled(RequestError):
    code = ErrorCode.CANCELLED


@dataclass
class Request:
    """One decoded request and the peer it came from."""

    peer: bytes
    req_id: int | None
    op: str
    args: dict[str, Any]


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
    parts: list[audio.Samples] = field(default_factory=list)
    started: float | None = None
    first_audio: float | None = None
    cancelled: bool = False

    @property
    def key(self) -> tuple[bytes, int]:
        return (self.peer, self.req_id)

    def chars_left(self) -> int:
        if self.started is None:
            return len(self.text)
        return sum(len(c) for c in self.chunks[self.next_chunk :])


@dataclass
class Counters:
    completed: int = 0
    cancelled: int = 0
    rejected: int = 0
    errors: int = 0
    dropped: int = 0
    requests: int = 0
    audio_seconds: float = 0.0
    synth_seconds: float = 0.0


Handler = Callable[[Request], dict[str, Any] | None]


class SpeechServer:
    """Owns the ROUTER socket, the job queue and the engine."""

    def __init__(
        self,
        engine: Engine,
        bind: str,
        max_chars: int = 5000,
        max_queue: int = 16,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.engine = engine
        self.max_chars = max_chars
        self.max_queue = max_queue
        self.max_header_bytes = 64 * 1024 + 4 * max_chars
        self.sock: zmq.Socket[Any] = (context or zmq.Context.instance()).socket(zmq.ROUTER)
        # Mandatory routing makes a send to a vanished peer raise, so we can
        # drop its job instead of synthesizing audio nobody will read.
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(bind)
        self.endpoint = bind
        self.queue: deque[Job] = deque()
        self.current: Job | None = None
        self.jobs: dict[tuple[bytes, int], Job] = {}
        self.counters = Counters()
        self.started = time.monotonic()
        self.ms_per_char = 5.0  # EWMA of synthesis cost, for retry_after_ms
        self._stopping = False
        self.handlers: dict[str, Handler] = {
            "ping": self._ping,
            "info": self._info,
            "stats": self._stats,
            "cancel": self._cancel,
            "synthesize": self._synthesize,
        }

    # -- loop ---------------------------------------------------------------

    def serve_forever(self) -> None:
        """Run turns until ``stop``; pending jobs then end as ``cancelled``."""
        log.info("speech worker ready", endpoint=self.endpoint, voices=list(self.engine.voices))
        try:
            while not self._stopping:
                self.turn()
        finally:
            self._shutdown()

    def stop(self) -> None:
        """Ask the loop to exit after the current turn (signal-safe)."""
        self._stopping = True

    def turn(self) -> None:
        """Drain the socket, then synthesize at most one chunk."""
        idle = self.current is None and not self.queue
        if self.sock.poll(IDLE_POLL_MS if idle else 0, zmq.POLLIN):
            self._drain()
        self._reap_cancelled()
        if self.current is not None or self.queue:
            self._step()

    def _drain(self) -> None:
        for _ in range(MAX_DRAIN):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(frames)

    # -- requests -----------------------------------------------------------

    def _handle(self, frames: Sequence[zmq.Frame]) -> None:
        """Decode, dispatch and answer one request; never raises."""
        peer = frames[0].bytes
        req_id: int | None = None
        op: Any = None
        self.counters.requests += 1
        try:
            if len(frames) < 2:
                raise BadRequest("message has no header frame")
            try:
                header = codec.decode(frames[1].buffer, max_bytes=self.max_header_bytes)
            except codec.HeaderTooLarge as exc:
                raise PayloadTooLarge(str(exc)) from exc
            except codec.CodecError as exc:
                raise BadRequest(str(exc)) from exc
            raw_id = header.get("id")
            req_id = raw_id if isinstance(raw_id, int) and not isinstance(raw_id, bool) else None
            op = header.get("op")
            logs.bind_request(req_id, op, None)
            if header.get("v") != VERSION:
                raise UnsupportedVersion(
                    f"version {header.get('v')!r}; this worker speaks {VERSION}"
                )
            handler = self.handlers.get(op) if isinstance(op, str) else None
            if handler is None:
                raise UnknownOp(f"unknown op {op!r}; known: {sorted(self.handlers)}")
            args = header.get("args") or {}
            if not isinstance(args, dict):
                raise BadRequest("args must be a map")
            result = handler(Request(peer, req_id, op, args))
            if result is not None:
                self._send(peer, ok_reply(req_id, result))
        except RequestError as exc:
            self._fail(peer, req_id, exc)
        except Exception as exc:
            log.exception("request failed")
            self._fail(peer, req_id, RequestError(f"{type(exc).__name__}: {exc}"))
        finally:
            logs.clear_request()

    def _ping(self, req: Request) -> dict[str, Any]:
        return {"pong": True}

    def _info(self, req: Request) -> dict[str, Any]:
        default = self.engine.voice(None)
        return {
            "worker": "speech",
            "voices": list(self.engine.voices),
            "default_voice": default.name,
            "voice_details": [v.describe() for v in self.engine.voices.values()],
            "sample_rate": default.sample_rate,
            "formats": list(FORMATS),
            "max_chars": self.max_chars,
            "max_queue": self.max_queue,
            "max_chunk_chars": MAX_CHUNK_CHARS,
            "speed_range": [MIN_SPEED, MAX_SPEED],
        }

    def _stats(self, req: Request) -> dict[str, Any]:
        c = self.counters
        return {
            "queued": len(self.queue),
            "running": self.current is not None,
            "completed": c.completed,
            "cancelled": c.cancelled,
            "rejected": c.rejected,
            "errors": c.errors,
            "dropped": c.dropped,
            "requests": c.requests,
            "audio_seconds": round(c.audio_seconds, 3),
            "synth_seconds": round(c.synth_seconds, 3),
            "rtf": round(c.synth_seconds / c.audio_seconds, 4) if c.audio_seconds else None,
            "uptime_s": round(time.monotonic() - self.started, 3),
        }

    def _cancel(self, req: Request) -> dict[str, Any]:
        target = req.args.get("id")
        if not isinstance(target, int) or isinstance(target, bool):
            raise BadRequest("cancel needs args.id, the integer id of your request")
        job = self.jobs.get((req.peer, target))
        if job is None or job.cancelled:
            return {"cancelled": False}
        job.cancelled = True  # ended by the next turn, before any further chunk
        return {"cancelled": True}

    def _synthesize(self, req: Request) -> None:
        job = self._validate(req)
        if job.key in self.jobs:
            raise BadRequest(f"request id {req.req_id} is already in flight")
        if len(self.queue) >= self.max_queue:
            self.counters.rejected += 1
            raise QueueFull(f"{len(self.queue)} requests already queued", self._retry_after_ms())
        self.queue.append(job)
        self.jobs[job.key] = job
        log.debug("synthesis queued", queued=len(self.queue), chars=len(job.text))
        return None

    def _validate(self, req: Request) -> Job:
        """Check synthesize args at the edge; every failure is ``bad_request``."""
        args = req.args
        req_id = req.req_id
        if req_id is None:
            raise BadRequest("synthesize needs an integer request id")
        unknown = set(args) - _SYNTH_ARGS
        if unknown:
            raise BadRequest(f"unknown arguments {sorted(unknown)}")
        text = args.get("text")
        if not isinstance(text, str) or not text.strip():
            raise BadRequest("text must be a non-empty string")
        if len(text) > self.max_chars:
            raise BadRequest(f"text is {len(text)} chars; the limit is {self.max_chars}")
        voice = args.get("voice", self.engine.default_voice)
        if voice not in self.engine.voices:
            raise BadRequest(f"unknown voice {voice!r}; known: {list(self.engine.voices)}")
        fmt = args.get("format", "wav")
        if fmt not in FORMATS:
            raise BadRequest(f"unsupported format {fmt!r}; supported: {list(FORMATS)}")
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
        return Job(
            peer=req.peer,
            req_id=req_id,
            text=text,
            voice=str(voice),
            fmt=str(fmt),
            speed=speed,
            stream=stream,
            max_seconds=max_seconds,
            received=time.monotonic(),
        )

    def _retry_after_ms(self) -> int:
        chars = sum(j.chars_left() for j in self.queue)
        if self.current is not None:
            chars += self.current.chars_left()
        return max(50, int(chars * self.ms_per_char / max(1, len(self.queue))))

    # -- synthesis ----------------------------------------------------------

    def _reap_cancelled(self) -> None:
        """End queued jobs whose cancel arrived; they never reach the engine."""
        if any(j.cancelled for j in self.queue):
            for job in [j for j in self.queue if j.cancelled]:
                self.queue.remove(job)
                self._end(job, Cancelled("cancelled before it started"))

    def _step(self) -> None:
        """Advance the running job by one chunk (starting the next if idle)."""
        job = self.current
        if job is None:
            job = self.current = self.queue.popleft()
            job.started = time.monotonic()
            job.chunks = split_sentences(job.text)
        logs.bind_request(job.req_id, "synthesize", None)
        try:
            if job.cancelled:
                self._end(job, Cancelled("cancelled"))
                return
            if job.next_chunk < len(job.chunks):
                self._synth_chunk(job)
            if self.current is job and job.next_chunk >= len(job.chunks):
                self._complete(job)
        except RequestError as exc:
            self._end(job, exc)
        except Exception as exc:
            log.exception("synthesis failed")
            self._end(job, RequestError(f"{type(exc).__name__}: {exc}"))
        finally:
            logs.clear_request()

    def _synth_chunk(self, job: Job) -> None:
        chunk = job.chunks[job.next_chunk]
        t0 = time.monotonic()
        samples = self.engine.synthesize(job.voice, chunk, job.speed)
        elapsed = time.monotonic() - t0
        job.next_chunk += 1
        rate = self.engine.voice(job.voice).sample_rate
        self.counters.synth_seconds += elapsed
        self.counters.audio_seconds += len(samples) / rate
        self.ms_per_char = 0.8 * self.ms_per_char + 0.2 * (1000 * elapsed / max(1, len(chunk)))
        if job.max_seconds is not None and job.samples + len(samples) > job.max_seconds * rate:
            raise LimitExceeded(f"audio would exceed max_seconds={job.max_seconds}")
        if not len(samples):
            return
        job.samples += len(samples)
        if job.first_audio is None:
            job.first_audio = time.monotonic()
        if not job.stream:
            job.parts.append(samples)
            return
        event = {"event": "audio", "seq": job.seq, "samples": len(samples)}
        job.seq += 1
        if not self._send(job.peer, event_reply(job.req_id, event), [audio.pcm_buffer(samples)]):
            self._drop(job)

    def _complete(self, job: Job) -> None:
        now = time.monotonic()
        rate = self.engine.voice(job.voice).sample_rate
        first = job.first_audio or now
        result: dict[str, Any] = {
            "voice": job.voice,
            "format": "pcm_s16le" if job.stream else job.fmt,
            "sample_rate": rate,
            "sample_count": job.samples,
            "duration_ms": round(audio.duration_ms(job.samples, rate), 1),
            "chunks": len(job.chunks),
            "timings": {
                "queue_ms": round(1000 * ((job.started or now) - job.received), 1),
                "first_audio_ms": round(1000 * (first - job.received), 1),
                "total_ms": round(1000 * (now - job.received), 1),
            },
        }
        samples = audio.concat(job.parts)
        self._finish(job)
        self.counters.completed += 1
        log.info(
            "synthesis done",
            chars=len(job.text),
            chunks=len(job.chunks),
            duration_ms=result["duration_ms"],
            **result["timings"],
        )
        if job.stream:
            self._send(job.peer, event_reply(job.req_id, {"event": "done", "done": True, **result}))
            return
        wav = job.fmt == "wav"
        buffer = memoryview(audio.wav_bytes(samples, rate)) if wav else audio.pcm_buffer(samples)
        result["bytes"] = buffer.nbytes
        self._send(job.peer, ok_reply(job.req_id, result), [buffer])

    def _end(self, job: Job, exc: RequestError) -> None:
        """End a queued or running job with an error reply."""
        self._finish(job)
        log.info("synthesis ended", code=str(exc.code), reason=exc.message)
        self._fail(job.peer, job.req_id, exc)

    def _drop(self, job: Job) -> None:
        """The peer is gone: stop work for it without replying."""
        self._finish(job)
        self.counters.dropped += 1
        log.warning("peer gone; synthesis dropped")

    def _finish(self, job: Job) -> None:
        self.jobs.pop(job.key, None)
        job.parts = []
        if self.current is job:
            self.current = None

    def _shutdown(self) -> None:
        pending = ([self.current] if self.current else []) + list(self.queue)
        self.queue.clear()
        for job in pending:
            self._end(job, Cancelled("worker shutting down"))
        self.sock.close(linger=0)
        log.info("speech worker stopped")

    # -- replies ------------------------------------------------------------

    def _fail(self, peer: bytes, req_id: int | None, exc: RequestError) -> None:
        if exc.code == ErrorCode.CANCELLED:
            self.counters.cancelled += 1
        elif exc.code != ErrorCode.QUEUE_FULL:
            self.counters.errors += 1
        log.debug("error reply", code=str(exc.code), reason=exc.message)
        self._send(peer, error_reply(req_id, exc.code, exc.message, exc.retry_after_ms))

    def _send(self, peer: bytes, header: dict[str, Any], buffers: Sequence[Any] = ()) -> bool:
        """Send one reply; False when the peer has disconnected."""
        try:
            self.sock.send_multipart([peer, codec.encode(header), *buffers], copy=False)
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                log.error("send failed", error=str(exc))
            return False
        return True


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRequest(f"{name} must be a finite number")
    return float(value)
