"""The processes ``scripts/fuzz.py`` starts when it is given no ``--endpoint``.

Why a module of its own: starting what a target needs (an LLM worker, the
speech worker, a two-stage chain) on ``ipc://`` in the work directory with
its address space capped, waiting until it answers, reading its log for
crashes it caught, and stopping it is apart from the fuzzing itself.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import zmq
from _fuzz_conn import Conn, Tally

ROOT = Path(__file__).resolve().parent.parent

# Log events that mean an exception got past the code meant to turn it into a fault.
CRASH_EVENTS = {"unexpected_error", "render_failed", "reply_unencodable", "send_failed"}
# Address space per started process: a request that makes a worker allocate
# without bound must fail there, not make the kernel's OOM killer pick
# processes on a shared machine (one such request asked for 24 GB).
MEMORY_LIMIT = 8 << 30


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


class Proc:
    """A process under test, on ``ipc://`` in the work directory, logging there."""

    def __init__(self, name: str, cmd: list[str], tmp: Path) -> None:
        self.name = name
        self.endpoint = f"ipc://{tmp}/{name}.sock"
        self.log = tmp / f"{name}.log"
        full = [sys.executable, "-m", *cmd, "--bind", self.endpoint, "--log-format", "json"]
        with self.log.open("wb") as out:
            self.popen = subprocess.Popen(
                full, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_limit_memory
            )

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_ready(self, ctx: zmq.Context[Any], timeout_s: float = 300) -> None:
        end = time.monotonic() + timeout_s
        probe = Conn(ctx, self.endpoint, Tally(), 1.0)
        try:
            while time.monotonic() < end and self.alive():
                if "header" in probe.call("ping", timeout_s=1.0):
                    return
        finally:
            probe.close()
        self.stop()
        raise SystemExit(f"{self.name} did not start:\n{self.tail()}")

    def crashes_logged(self) -> list[str]:
        """Exceptions the process caught and logged (a turn, a handler, a job
        that crashed): answered or not, each is a bug the replies may hide."""
        found = []
        if self.log.exists():
            with self.log.open(errors="replace") as lines:
                for line in lines:
                    if '"error"' not in line:
                        continue
                    try:
                        entry = json.loads(line)
                    except ValueError:
                        continue  # llama.cpp's own stderr lines
                    event = str(entry.get("event"))
                    if event.endswith("_crashed") or event in CRASH_EVENTS:
                        found.append(f"{self.name}: {event}: {str(entry.get('exception'))[-300:]}")
        return found

    def tail(self) -> str:
        """The log's last lines, refusals left out (they are the fuzzer's doing)."""
        if not self.log.exists():
            return ""
        lines = self.log.read_text(errors="replace").splitlines()
        return "\n".join([x for x in lines if '"request_failed"' not in x][-20:])[-4000:]

    def stop(self) -> None:
        if self.alive():
            self.popen.terminate()
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


# One compute thread: on a shared 2-core box two OpenMP threads spin against
# the fuzzer and each other (measured: a 4-token generate 0.36 s vs 5 s under
# load). A short admission timeout: a generation waiting for a lane is answered
# ``deadline_exceeded`` soon instead of holding the window.
WORKER = ["worker.cli", "--lanes", "4", "--ctx", "4096", "--threads", "1"]
WORKER += ["--admission-timeout-ms", "1000"]


def spawn(target: str, tmp: Path) -> list[Proc]:
    """Start what a target needs (not waiting); the one(s) to fuzz first.

    Every target's processes start at once, so model loads overlap: a stage
    head does not need its next stage until a forward (it connects lazily).
    """
    if target == "worker":
        return [Proc("worker", WORKER, tmp)]
    if target == "speech":
        return [Proc("speech", ["speech.cli", "--threads", "1"], tmp)]
    tail = Proc("stage1", [*WORKER, "--layers", "9:18"], tmp)
    return [Proc("stage0", [*WORKER, "--layers", "0:9", "--next", tail.endpoint], tmp), tail]
