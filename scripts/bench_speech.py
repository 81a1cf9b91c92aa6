"""Benchmark skiff-speech: real-time factor and time to first audio.

Starts a ``skiff-speech`` worker on an ipc endpoint, synthesizes a fixed set
of texts several times (non-streaming for RTF, streaming for time to first
audio), stops it, then synthesizes the same texts in-process with piper
directly (no sockets) as the baseline, and prints skiff/in-process.

RTF = synthesis wall time / audio duration; below 1 is faster than real
time. The target on the 2-core dev/CI machine is RTF <= 0.1.

    .venv/bin/python scripts/bench_speech.py [--reps 3] [--threads N]
"""

from __future__ import annotations

import argparse
import os
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
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="skiff-bench-") as tmp:
        endpoint = f"ipc://{tmp}/speech.sock"
        proc = start_worker(endpoint, args.threads, Path(tmp) / "speech.log")
        try:
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
