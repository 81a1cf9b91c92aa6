"""Benchmark skiff-speech: real-time factor and time to first audio.

Starts a ``skiff-speech`` worker on an ipc endpoint, synthesizes a fixed set
of texts several times (non-streaming for RTF, streaming for time to first
audio), stops it, then synthesizes the same texts in-process with piper
directly (no sockets) as the baseline, and prints skiff/in-process.

RTF = synthesis wall time / audio duration; below 1 is faster than real
time. The target on the 2-core dev/CI machine is RTF <= 0.1.

``--http`` measures time to first audio instead, for one 200-character text
(the first clause is its first chunk), over every path in the same run:
ZeroMQ straight to the worker, ZeroMQ through ``skiff-gateway``, and the
gateway's HTTP front (``/v1/audio/speech``, raw ``stream_format: audio`` and
``sse``), each the p50 of ``--reps`` runs, interleaved so drift hits them
alike. Target: <= 300 ms over HTTP on 2 cores.

    .venv/bin/python scripts/bench_speech.py [--reps 3] [--threads N] [--http]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from protocol import Client, SkiffError  # noqa: E402
from speech.engine import (  # noqa: E402
    default_threads,
    load_piper_voice,
    packaged_voice_path,
)

TARGET_RTF = 0.1
TARGET_TTFA_MS = 300.0
TTFA_TEXT = (  # 200 characters, clauses and sentences, as an assistant would speak
    "Thanks for calling, this is the front desk of the Harbour Hotel. Your table for "
    "four is booked for seven tonight, and we have noted the birthday. If anything "
    "changes, just call us back; we shall help."
)
TEXTS = [
    "Hello world.",
    "The quick brown fox jumps over the lazy dog.",
    "The sun rose over the quiet harbor. Fishing boats drifted out past the pier. "
    "Gulls followed them, calling loudly. By noon the water was calm and bright. "
    "Everyone agreed it was a perfect day.",
    "Speech synthesis turns written text into audio that a listener can follow. "
    "A good system keeps the rhythm of natural speech, pauses at commas and full stops, "
    "and raises its pitch at the end of a question. Is that not remarkable? "
    "Modern neural voices run comfortably faster than real time on an ordinary laptop, "
    "which makes them practical for assistants, screen readers and announcements. "
    "This paragraph is long enough to show how the cost grows with the length of the input.",
]


@dataclass
class Runs:
    """Wall time, audio seconds and first-audio time of each synthesis."""

    wall: list[float] = field(default_factory=list)
    audio: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)

    def add(self, wall: float, audio_s: float, first: float | None = None) -> None:
        self.wall.append(wall)
        self.audio.append(audio_s)
        if first is not None:
            self.first.append(first)

    @property
    def rtf_p50(self) -> float:
        return statistics.median(w / a for w, a in zip(self.wall, self.audio, strict=True))

    @property
    def rtf_overall(self) -> float:
        return sum(self.wall) / sum(self.audio)

    @property
    def ttfa_p50_ms(self) -> float:
        return 1000 * statistics.median(self.first) if self.first else float("nan")


def start_worker(endpoint: str, threads: int, log_path: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "speech.cli", "--bind", endpoint]
    cmd += ["--threads", str(threads), "--log-format", "json", "--log-level", "warning"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + 120
    with Client(endpoint, timeout_ms=500) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"worker exited {proc.returncode}: {log_path.read_text()}")
            try:
                client.ping()
                return proc
            except SkiffError:
                continue
    proc.kill()
    raise SystemExit("worker did not answer ping")


def bench_worker(endpoint: str, reps: int) -> tuple[Runs, Runs]:
    """Non-streaming runs (RTF) and streaming runs (TTFA) over the socket."""
    whole, streamed = Runs(), Runs()
    with Client(endpoint, timeout_ms=120_000) as client:
        client.call("synthesize", args={"text": "Warm up.", "format": "pcm_s16le"})
        for _ in range(reps):
            for text in TEXTS:
                t0 = time.perf_counter()
                reply = client.call("synthesize", args={"text": text, "format": "pcm_s16le"})
                wall = time.perf_counter() - t0
                whole.add(wall, reply.result["sample_count"] / reply.result["sample_rate"])

                t0 = time.perf_counter()
                first: float | None = None
                for event in client.stream("synthesize", args={"text": text, "stream": True}):
                    if first is None and event.header.get("event") == "audio":
                        first = time.perf_counter() - t0
                wall = time.perf_counter() - t0
                done = event.header
                streamed.add(wall, done["sample_count"] / done["sample_rate"], first)
    return whole, streamed


def zmq_first_audio(client: Client, text: str) -> float:
    """Seconds from sending a streamed synthesize to its first audio event
    (the stream is then read to its end)."""
    t0 = time.perf_counter()
    first: float | None = None
    for event in client.stream("synthesize", args={"text": text, "stream": True}):
        if first is None and event.header.get("event") == "audio":
            first = time.perf_counter() - t0
    assert first is not None, "no audio event"
    return first


def http_first_audio(port: int, text: str, sse: bool) -> float:
    """Seconds from sending ``POST /v1/audio/speech`` to its first audio bytes
    (a ``speech.audio.delta`` event with ``sse``); the body is then read out."""
    body = {"model": "tts-1", "voice": "alloy", "input": text, "response_format": "pcm"}
    body["stream_format"] = "sse" if sse else "audio"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        t0 = time.perf_counter()
        conn.request(
            "POST", "/v1/audio/speech", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        if resp.status != 200:
            raise SystemExit(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        if sse:
            while b"speech.audio.delta" not in resp.readline():
                pass
        else:
            resp.read1(65536)
        first = time.perf_counter() - t0
        resp.read()
        return first
    finally:
        conn.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_gateway(speech_ep: str, tmp: Path, port: int) -> tuple[subprocess.Popen[bytes], str]:
    """``skiff-gateway`` over the one speech worker, with its HTTP front on ``port``."""
    endpoint = f"ipc://{tmp}/gateway.sock"
    cmd = [sys.executable, "-m", "gateway.cli", "--bind", endpoint, "--speech", speech_ep]
    cmd += ["--http", f"127.0.0.1:{port}", "--log-format", "json", "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with (tmp / "gateway.log").open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + 60
    with Client(endpoint, timeout_ms=500) as gw:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(
                    f"gateway exited {proc.returncode}: {(tmp / 'gateway.log').read_text()}"
                )
            try:
                workers = gw.call("gateway_status").result["workers"]
                if any(w["kind"] == "speech" and w["up"] for w in workers):
                    return proc, endpoint
            except SkiffError:
                pass
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("the gateway did not see the speech worker up")


def bench_http(speech_ep: str, tmp: Path, reps: int) -> dict[str, list[float]]:
    """Time to first audio of ``TTFA_TEXT`` on each path, ``reps`` interleaved runs."""
    port = free_port()
    proc, gateway_ep = start_gateway(speech_ep, tmp, port)
    runs: dict[str, list[float]] = {
        "ZeroMQ, straight to the speech worker": [],
        "ZeroMQ, through the gateway": [],
        "HTTP raw (stream_format audio)": [],
        "HTTP SSE (stream_format sse)": [],
    }
    paths = list(runs.values())
    try:
        with (
            Client(speech_ep, timeout_ms=120_000) as direct,
            Client(gateway_ep, timeout_ms=120_000) as via,
        ):
            zmq_first_audio(direct, "Warm up.")
            http_first_audio(port, "Warm up.", sse=True)
            for _ in range(reps):
                paths[0].append(zmq_first_audio(direct, TTFA_TEXT))
                paths[1].append(zmq_first_audio(via, TTFA_TEXT))
                paths[2].append(http_first_audio(port, TTFA_TEXT, sse=False))
                paths[3].append(http_first_audio(port, TTFA_TEXT, sse=True))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return runs


def print_http(runs: dict[str, list[float]], reps: int, threads: int) -> None:
    print(
        f"time to first audio, {len(TTFA_TEXT)}-character text, p50 of {reps} runs, "
        f"threads={threads}, {os.cpu_count()} cores (target <= {TARGET_TTFA_MS:.0f} ms over HTTP)"
    )
    for label, seconds in runs.items():
        p50 = 1000 * statistics.median(seconds)
        verdict = ""
        if label.startswith("HTTP"):
            verdict = "  ok" if p50 <= TARGET_TTFA_MS else "  OVER TARGET"
        print(f"  {label:<40} {p50:7.1f} ms{verdict}")


def piper_runs(voice: Any, reps: int) -> Runs:
    """The same texts through piper's own sentence iterator, in-process."""
    runs = Runs()
    rate = int(voice.config.sample_rate)
    list(voice.synthesize("Warm up."))
    for _ in range(reps):
        for text in TEXTS:
            t0 = time.perf_counter()
            first: float | None = None
            samples = 0
            for chunk in voice.synthesize(text):
                samples += len(chunk.audio_int16_array)
                if first is None:
                    first = time.perf_counter() - t0
            runs.add(time.perf_counter() - t0, samples / rate, first)
    return runs


def timed(label: str, fn: Callable[[], Runs]) -> Runs:
    print(f"... {label}", file=sys.stderr, flush=True)
    return fn()


def line(label: str, runs: Runs) -> str:
    ttfa = f"{runs.ttfa_p50_ms:6.1f} ms" if runs.first else "     -   "
    return (
        f"{label:<44} RTF p50 {runs.rtf_p50:.3f}  overall {runs.rtf_overall:.3f}  "
        f"TTFA p50 {ttfa}  ({len(runs.wall)} runs, {sum(runs.audio):.1f} s audio)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="passes over the texts (default 3)")
    parser.add_argument(
        "--threads", type=int, default=default_threads(), help="onnxruntime threads"
    )
    parser.add_argument(
        "--skip-piper-defaults",
        action="store_true",
        help="skip the extra baseline with PiperVoice.load's default onnxruntime options",
    )
    parser.add_argument(
        "--http",
        action="store_true",
        help="time to first audio over ZeroMQ and the gateway's HTTP front instead",
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="skiff-bench-") as tmp:
        endpoint = f"ipc://{tmp}/speech.sock"
        proc = start_worker(endpoint, args.threads, Path(tmp) / "speech.log")
        try:
            if args.http:
                print("... time to first audio: ZeroMQ and HTTP", file=sys.stderr, flush=True)
                print_http(bench_http(endpoint, Path(tmp), args.reps), args.reps, args.threads)
                return 0
            print("... skiff-speech over the socket", file=sys.stderr, flush=True)
            whole, streamed = bench_worker(endpoint, args.reps)
        finally:
            proc.terminate()
            proc.wait(timeout=30)

    model = packaged_voice_path()
    same = load_piper_voice(model, args.threads)
    inproc = timed("in-process piper", lambda: piper_runs(same, args.reps))
    defaults: Runs | None = None
    if not args.skip_piper_defaults:
        from piper import PiperVoice

        stock = PiperVoice.load(model)
        defaults = timed("in-process piper, stock options", lambda: piper_runs(stock, args.reps))

    print(
        f"skiff-speech bench: voice {model.name}, {len(TEXTS)} texts x {args.reps} reps, "
        f"threads={args.threads}, {os.cpu_count()} cores"
    )
    print(line("skiff non-streaming (socket)", whole))
    print(line("skiff streaming (socket)", streamed))
    print(line("in-process piper (same ORT options)", inproc))
    if defaults is not None:
        print(line("in-process piper (PiperVoice.load defaults)", defaults))
    print(f"ratio skiff/in-process: RTF {whole.rtf_overall / inproc.rtf_overall:.2f}x, ", end="")
    print(f"TTFA {streamed.ttfa_p50_ms / inproc.ttfa_p50_ms:.2f}x")
    print(f"TTFA p50 = {streamed.ttfa_p50_ms:.1f} ms (streaming, client-side)")
    verdict = "ok" if whole.rtf_overall <= TARGET_RTF else "OVER TARGET"
    print(f"RTF = {whole.rtf_overall:.3f} (target <= {TARGET_RTF})  {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
