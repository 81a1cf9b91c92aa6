"""Shared fixtures: one worker process and one in-process engine per session.

Loading the model is the slow part, so behaviour tests share one worker
(real process, real ipc:// socket) and runtime tests share one engine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import zmq
from _exactness import TIMEOUT_MS, Run, _prompt, _run
from zmq.utils.monitor import recv_monitor_message

from protocol import Client, SkiffError, sockets, transport
from worker.models import default_model_path

ROOT = Path(__file__).resolve().parent.parent

T = TypeVar("T")

# How long a test waits for something it cannot hurry (a process starting, a
# reply, a condition another thread or process brings about). Only a hang
# should reach it: on a loaded machine (CI beside other jobs, or under
# scripts/burn_cpu.py) things take many times longer than on an idle one.
WAIT_S = 60.0


def wait_until(
    cond: Callable[[], T],
    timeout_s: float = WAIT_S,
    what: str = "condition",
    interval_s: float = 0.02,
) -> T:
    """Poll ``cond`` until it returns something true, and return that.

    Tests wait for what they can observe, never sleep a guessed time and then
    assert: the bound turns a hang into a failure; it is not a timing claim.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout_s:g} s (last: {value!r})")
        time.sleep(interval_s)


def send_and_get_cut_off(endpoint: str, *messages: list[bytes]) -> None:
    """Send each message on a fresh connection and wait until the server has
    dropped that connection once per message: what a frame over its
    MAXMSGSIZE earns (the DEALER reconnects and sends the next one).

    Returns only when the server has seen every message, so what a test
    checks next (RSS, ``ping``) is checked after the fact, not after a guess.
    """
    opts = sockets.SocketOptions(max_message_bytes=-1, sndhwm=len(messages) + 1)
    sock = sockets.dealer(zmq.Context.instance(), endpoint, opts, connect=False)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        sock.connect(endpoint)
        for frames in messages:
            sock.send_multipart(frames, copy=False)
        for i in range(len(messages)):
            assert monitor.poll(int(WAIT_S * 1000)), (
                f"connection not dropped ({i} of {len(messages)})"
            )
            recv_monitor_message(monitor)
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)


def start_worker(
    tmp: Path, *args: str, name: str = "worker", env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str, Path]:
    """Start ``python -m worker.cli`` on an ipc endpoint (``env`` added to
    this process's environment); wait for ``ping``."""
    endpoint = f"ipc://{tmp}/{name}.sock"
    log_path = tmp / f"{name}.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "worker.cli",
            "--bind",
            endpoint,
            "--log-format",
            "json",
            "--threads",
            "2",
            *args,
        ],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    with Client(endpoint) as client:
        try:
            client.wait_ready(2 * WAIT_S, alive=lambda: proc.poll() is None)
        except SkiffError:
            proc.kill()
            raise RuntimeError(f"worker did not start:\n{log_path.read_text()}") from None
    return proc, endpoint, log_path


@contextmanager
def start_chain(
    tmp: Path, ranges: Sequence[str], *args: str, head: Sequence[str] = (), name: str = "s"
) -> Iterator[list[str]]:
    """A pipeline of stages with these layer ranges (``"0:9", "9:18"``), each
    started with ``args`` (stage 0 also with ``head``), the last first so each
    ``--next`` answers: the endpoints in stage order; all stopped on exit."""
    procs: list[subprocess.Popen[bytes]] = []
    endpoints: list[str] = []
    try:
        for i in reversed(range(len(ranges))):
            more = ["--next", endpoints[0]] if endpoints else []
            if i == 0:
                more += head
            proc, endpoint, _ = start_worker(
                tmp, *args, "--layers", ranges[i], *more, name=f"{name}{i}"
            )
            procs.append(proc)
            endpoints.insert(0, endpoint)
        yield endpoints
    finally:
        for proc in reversed(procs):  # stage 0 first: nothing new goes down the chain
            stop_worker(proc)


@contextmanager
def tidy_client(endpoint: str, timeout_ms: int = 60_000) -> Iterator[Client]:
    """A client whose test leaves no named session behind (lanes are shared)."""
    with Client(endpoint, timeout_ms=timeout_ms) as c:
        yield c
        for entry in c.stats()["sessions"]:
            if not entry.get("ephemeral"):
                c.drop(entry["session"])


def spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """``python -m ARGS`` from the repository, JSON logs appended to ``log``."""
    return subprocess.Popen(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "SKIFF_LOG_FORMAT": "json"},
    )


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every process, wait for each (bounded), kill what is left."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            p.kill()


def stop_worker(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="session")
def model_path() -> str:
    return str(default_model_path())


@pytest.fixture(scope="session")
def worker_process(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    """(process, endpoint, log path) of the shared worker: 8 lanes x 2048 cells."""
    tmp = tmp_path_factory.mktemp("worker")
    proc, endpoint, log_path = start_worker(tmp, "--lanes", "8", "--ctx", "16384")
    yield proc, endpoint, log_path
    stop_worker(proc)


@pytest.fixture(scope="session")
def worker(
    worker_process: tuple[subprocess.Popen[bytes], str, Path],
) -> tuple[str, Path]:
    """(endpoint, log path) of the shared worker."""
    return worker_process[1], worker_process[2]


@pytest.fixture(scope="session")
def unparked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A worker without a park (4 lanes x 256 cells): a lane is a hard limit
    there, for the tests of what happens when none is free (lanes_busy)."""
    tmp = tmp_path_factory.mktemp("unparked")
    proc, endpoint, _ = start_worker(
        tmp, "--lanes", "4", "--ctx", "1024", "--park-bytes", "0", name="unparked"
    )
    yield endpoint
    stop_worker(proc)


@pytest.fixture()
def unparked_client(unparked: str) -> Iterator[Client]:
    with tidy_client(unparked) as c:
        yield c


@pytest.fixture()
def client(worker: tuple[str, Path]) -> Iterator[Client]:
    """A client whose test leaves no session behind (lanes are shared)."""
    with tidy_client(worker[0]) as c:
        yield c


@pytest.fixture(scope="session")
def reference(worker: tuple[str, Path]) -> Iterator[Callable[[int], Run]]:
    """The run of the ``n``-token prompt on the shared worker, a session that
    never moves, exported right after its prefill. Its prompt is unique, so
    it is a cold prefill; its lane stays cached there afterwards.

    The exactness modules' memo (test_exactness_session, _workers): one for
    the session, as a second run of the same prompt would not be cold."""
    runs: dict[int, Run] = {}
    with Client(worker[0], timeout_ms=TIMEOUT_MS) as c:

        def get(n: int) -> Run:
            if n not in runs:
                tag = f"ref-{n}"
                hits = c.stats()["prefix_cache"]["hits"]
                runs[n] = _run(c, tag, _prompt(c, tag, n), export=True)
                assert c.stats()["prefix_cache"]["hits"] == hits, f"reference {n} was not cold"
            return runs[n]

        yield get


def greedy_run(
    client: Client, session: str, tokens: list[int], steps: int
) -> tuple[list[int], np.ndarray]:
    """Prefill ``tokens`` into ``session``, decode ``steps`` greedy tokens,
    drop it: the tokens and every step's logits (exactness compares them)."""
    first = int(client.prefill_sampled(session, tokens)["token"])
    out, rows = decode_run(client, session, first, steps)
    client.drop(session)
    return out, rows


def decode_run(
    client: Client, session: str, first: int, steps: int
) -> tuple[list[int], np.ndarray]:
    """Decode ``steps`` greedy tokens after ``first`` (the token a prefill
    sampled, not yet fed): ``first`` and the tokens, and every step's logits."""
    out, rows = [first], []
    for _ in range(steps):
        reply = client.decode(session, out[-1], output=["logits"])
        rows.append(np.array(reply.frame.array("logits")[0]))
        out.append(int(reply.result["token"]))
    return out, np.stack(rows)


class FakeUpstream:
    """A ROUTER answering ``ping`` and scripting replies to everything else."""

    def __init__(self, endpoint: str, script: Callable[[dict[str, Any]], list[dict[str, Any]]]):
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.bind(endpoint)
        self.script = script
        self.ops: list[str] = []
        self.running = True
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.running:
            if not self.sock.poll(50):
                continue
            peer, raw = self.sock.recv_multipart()[:2]
            req = transport.decode(raw)
            self.ops.append(req["op"])
            base = {"v": 1, "id": req["id"]}
            replies: list[dict[str, Any]] = [{"ok": True, "result": {"pong": True}}]
            if req["op"] != "ping":
                replies = self.script(req)
            for reply in replies:
                buffers: list[bytes] = reply.pop("_buffers", [])  # raw frames after the header
                self.sock.send_multipart([peer, transport.encode({**base, **reply}), *buffers])

    def close(self) -> None:
        if self.running:
            self.running = False
            self.thread.join()
            self.sock.close(linger=0)
