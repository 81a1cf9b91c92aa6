"""The speech worker as an edge service: one synthesis chunk per turn.

It runs on the same ``EdgeServer`` as the LLM worker. Each pass drains every
waiting request without blocking (ping, info, stats and cancel are answered
on the spot; synthesize is checked into a ``Job``, ``speech/jobs.py``, and
queued), then synthesizes at most one chunk of the running job (the first
clause first: ``engine.split_sentences``) and sends its audio at the end of
that turn. So ping and cancel wait at most one chunk, never a whole text,
and a client hears the first clause while the rest is being made.

Cancellation: ``cancel {"id": N}`` answers ``{"cancelled": true}`` when
request N of the same peer was queued or running; that request then ends
with an ``ok: false`` reply of code ``cancelled`` (after any audio events it
already sent) and no ``done`` event. A stream therefore ends with either a
``done: true`` event or an error reply.

A peer that vanished or stopped reading (its send queue is full) is
reported by the edge after the turn's sends; all its jobs, queued or
running, are dropped without a reply, so a client that never reads cannot
make the worker synthesize (or block) for it.

Queueing: at most ``max_queue`` synthesize requests wait (one more may be
running); beyond that the reply is ``queue_full`` with ``retry_after_ms``
estimated from the work ahead.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from structlog import get_logger

from edge import Handler, Outgoing, Request, bind_request, clear_request, failure_header
from edge import process as process_stats
from faults import BadRequest, Cancelled, Fault, LimitExceeded, QueueFull
from protocol.transport import Op, event_reply, ok_reply

from . import FORMATS, audio
from .engine import MAX_CHUNK_CHARS, MAX_SPEED, MIN_SPEED, Engine, split_sentences
from .jobs import Job

log = get_logger("skiff.speech")


@dataclass
class Counters:
    completed: int = 0
    cancelled: int = 0
    rejected: int = 0
    errors: int = 0
    dropped: int = 0
    requests: int = 0
    chunks: int = 0
    audio_seconds: float = 0.0
    synth_seconds: float = 0.0


class SpeechService:
    """Owns the job queue and the engine; the edge owns the socket."""

    def __init__(self, engine: Engine, max_chars: int = 5000, max_queue: int = 16) -> None:
        self.engine = engine
        self.max_chars = max_chars
        self.max_queue = max_queue
        self.max_header_bytes = 64 * 1024 + 4 * max_chars
        self.queue: deque[Job] = deque()
        self.current: Job | None = None
        self.jobs: dict[tuple[bytes, int], Job] = {}
        self.counters = Counters()
        self.started = time.monotonic()
        self.draining = False  # SIGTERM: finishing accepted work, refusing new
        self.ms_per_char = 5.0  # EWMA of synthesis cost, for retry_after_ms
        self._out: list[Outgoing] = []
        table: dict[str, Handler] = {
            Op.PING: self._ping,
            Op.INFO: self._info,
            Op.STATS: self._stats,
            Op.CANCEL: self._cancel,
            Op.SYNTHESIZE: self._synthesize,
        }
        self._handlers = {op: self._counted(fn) for op, fn in table.items()}

    def _counted(self, fn: Handler) -> Handler:
        """A handler that counts requests, and failed ones, for ``stats``."""

        def handle(req: Request) -> dict[str, Any] | None:
            self.counters.requests += 1
            try:
                return fn(req)
            except QueueFull:
                raise
            except Exception:
                self.counters.errors += 1
                raise

        return handle

    # -- the edge's Service protocol -------------------------------------------

    @property
    def handlers(self) -> Mapping[str, Handler]:
        return self._handlers

    def has_work(self) -> bool:
        return self.current is not None or bool(self.queue) or bool(self._out)

    def turn(self) -> list[Outgoing]:
        """End cancelled queued jobs, then synthesize at most one chunk."""
        self._reap_cancelled()
        if self.current is not None or self.queue:
            self._step()
        out, self._out = self._out, []
        return out

    def peer_lost(self, peer: bytes, reason: str) -> int:
        """Drop every job of a peer that vanished or stopped reading, unanswered."""
        lost = [j for j in self.jobs.values() if j.peer == peer]
        for job in lost:
            if job in self.queue:
                self.queue.remove(job)
            self._finish(job)
            self.counters.dropped += 1
        return len(lost)

    def housekeeping(self, now: float) -> None:
        return None

    @property
    def drain_ops(self) -> frozenset[str]:
        return frozenset()

    def begin_drain(self) -> None:
        self.draining = True

    def idle(self) -> bool:
        return not self.has_work()

    def cancel_all(self, reason: str) -> int:
        """End queued and running jobs as ``cancelled``; the next turn sends the replies."""
        pending = ([self.current] if self.current else []) + list(self.queue)
        self.queue.clear()
        for job in pending:
            self._end(job, Cancelled(reason))
        return len(pending)

    def shutdown(self) -> list[Outgoing]:
        """End queued and running jobs as ``cancelled``; the replies to send."""
        self.cancel_all("worker shutting down")
        out, self._out = self._out, []
        return out

    # -- requests -----------------------------------------------------------

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
            "chunks": c.chunks,
            "audio_seconds": round(c.audio_seconds, 3),
            "synth_seconds": round(c.synth_seconds, 3),
            "rtf": round(c.synth_seconds / c.audio_seconds, 4) if c.audio_seconds else None,
            "uptime_s": round(time.monotonic() - self.started, 3),
            "draining": self.draining,
            "process": process_stats.snapshot(),  # RSS, Python objects (edge/process.py)
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

    def _synthesize(self, req: Request) -> dict[str, Any] | None:
        job = Job.from_request(req, self.engine, self.max_chars)
        if job.key in self.jobs:
            raise BadRequest(f"request id {req.id} is already in flight")
        if len(self.queue) >= self.max_queue:
            self.counters.rejected += 1
            raise QueueFull(f"{len(self.queue)} requests already queued", self._retry_after_ms())
        self.queue.append(job)
        self.jobs[job.key] = job
        log.debug("synthesis queued", queued=len(self.queue), chars=len(job.text))
        return None

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
        bind_request(job.req_id, "synthesize", None)
        try:
            if job.cancelled:
                self._end(job, Cancelled("cancelled"))
                return
            if job.next_chunk < len(job.chunks):
                self._synth_chunk(job)
            if self.current is job and job.next_chunk >= len(job.chunks):
                self._complete(job)
        except Exception as exc:  # a Fault carries its code; anything else is internal
            if not isinstance(exc, Fault):
                log.exception("synthesis failed")
            self._end(job, exc)
        finally:
            clear_request()

    def _synth_chunk(self, job: Job) -> None:
        chunk = job.chunks[job.next_chunk]
        t0 = time.monotonic()
        made = self.engine.synthesize(job.voice, chunk, job.speed)
        samples = made.samples
        elapsed = time.monotonic() - t0
        job.next_chunk += 1
        job.phonemes += made.phonemes
        self.counters.chunks += 1
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
        event = {"event": "audio", "seq": job.seq, "samples": len(samples), "sample_rate": rate}
        job.seq += 1
        self._send(job.peer, event_reply(job.req_id, event), [audio.pcm_buffer(samples)])

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
            "phonemes": job.phonemes,
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

    def _end(self, job: Job, exc: BaseException) -> None:
        """End a queued or running job with an error reply."""
        self._finish(job)
        if isinstance(exc, Cancelled):
            self.counters.cancelled += 1
        else:
            self.counters.errors += 1
        log.info("synthesis ended", error=f"{type(exc).__name__}: {exc}")
        self._out.append(Outgoing(job.peer, failure_header(job.req_id, exc, "synthesize")))

    def _finish(self, job: Job) -> None:
        self.jobs.pop(job.key, None)
        job.parts = []
        if self.current is job:
            self.current = None

    def _send(self, peer: bytes, header: dict[str, Any], buffers: list[Any] | None = None) -> None:
        self._out.append(Outgoing(peer, header, buffers or []))
