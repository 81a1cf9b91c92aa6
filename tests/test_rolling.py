"""A rolling restart behind the gateway loses nothing.

Two workers (8 lanes each, parking on) behind ``skiff-gateway``; 16 named
sessions open and 8 streams running (half named, half sessionless; greedy
and seeded). SIGTERM one worker: it tells the gateway it is leaving, the
gateway suspends its streams between two tokens, moves every session (and
each stream's) to the other worker and resumes the streams there; the
worker exits 0 and is started again; then the same for the other. Every
stream must end normally with exactly the tokens of a run that never moved,
and every named session must continue as it would have.
"""

from __future__ import annotations

import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import WAIT_S, spawn, stop_all, wait_until
from protocol import Client, SkiffError

ROOT = Path(__file__).resolve().parent.parent
WAIT_MS = int(WAIT_S * 1000)
WORKER_ARGS = ("--lanes", "8", "--ctx", "4096", "--threads", "1")
SEEDED = {"temperature": 0.8, "top_k": 40, "seed": 5}
STREAM_TOKENS = 200
SESSIONS = 16

pytestmark = pytest.mark.timeout(600)


class Pair:
    """Two workers and a gateway, as processes on loopback."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.endpoints = [f"ipc://{tmp}/r{i}.sock" for i in (1, 2)]
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        for ep in self.endpoints:
            self.start_worker(ep)
        self.gateway_ep = f"ipc://{tmp}/gw.sock"
        args = ["gateway.cli", "--bind", self.gateway_ep]
        for ep in self.endpoints:
            args += ["--worker", ep]
        self.gateway = spawn(args, tmp / "gateway.log")
        self.wait_all_up()

    def start_worker(self, ep: str) -> None:
        name = ep.rsplit("/", 1)[-1]
        self.workers[ep] = spawn(
            ["worker.cli", "--bind", ep, *WORKER_ARGS], self.tmp / f"{name}.log"
        )
        with Client(ep) as c:
            c.wait_ready(2 * WAIT_S, alive=lambda: self.workers[ep].poll() is None)

    def status(self) -> dict[str, Any]:
        with Client(self.gateway_ep, timeout_ms=WAIT_MS) as c:
            result: dict[str, Any] = c.call("gateway_status").result
            return result

    def wait_all_up(self) -> None:
        def up() -> bool:
            workers = self.status()["workers"]
            return all(w["up"] and not w["draining"] for w in workers)

        wait_until(up, what="both workers up and taking work")

    def restart(self, ep: str) -> None:
        """SIGTERM ``ep``, wait for it to hand everything over and exit 0, start it again."""
        self.workers[ep].send_signal(signal.SIGTERM)
        assert self.workers[ep].wait(WAIT_S * 2) == 0
        self.start_worker(ep)
        self.wait_all_up()

    def close(self) -> None:
        stop_all([self.gateway, *self.workers.values()])


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    p = Pair(tmp_path_factory.mktemp("rolling"))
    yield p
    p.close()


def _stream_args(i: int) -> dict[str, Any]:
    args: dict[str, Any] = {
        "prompt": f"Story {i}: the keeper of lighthouse number {i} wrote in the log that",
        "max_tokens": STREAM_TOKENS,
        "ignore_eos": True,
        "stop": ["never-in-this-text"],
    }
    if i % 2:
        args["sampling"] = {**SEEDED, "seed": 100 + i}
    return args


def _follow(endpoint: str, args: dict[str, Any], session: str | None, out: dict[str, Any]) -> None:
    """One stream to its end: its events, or the error that ended it."""
    events: list[dict[str, Any]] = []
    out["events"] = events
    with Client(endpoint, timeout_ms=WAIT_MS) as c:
        try:
            for reply in c.generate(args, session=session):
                events.append(reply.header)
        except SkiffError as exc:
            out["error"] = f"{exc.code}: {exc.message}"


def _started(
    endpoint: str, args: dict[str, Any], session: str | None
) -> tuple[threading.Thread, dict[str, Any]]:
    """One stream followed on a thread of its own."""
    out: dict[str, Any] = {}
    t = threading.Thread(target=_follow, args=(endpoint, args, session, out))
    t.start()
    return t, out


def _running(
    gw: str, streams: list[tuple[dict[str, Any], str | None]]
) -> list[tuple[threading.Thread, dict[str, Any]]]:
    """Streams followed on threads (args, session), once each has 3 tokens."""
    runs = [_started(gw, args, session) for args, session in streams]
    for _, out in runs:
        wait_until(
            lambda out=out: len(_tokens(out.get("events", []))) >= 3,  # type: ignore[misc]
            what="every stream running",
        )
    return runs


def _ended(runs: list[tuple[threading.Thread, dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """Each followed stream's events, once every one ended without an error
    and with exactly one ``done``."""
    for t, _ in runs:
        t.join(WAIT_S * 4)
        assert not t.is_alive(), "a stream did not end"
    for i, (_, out) in enumerate(runs):
        assert "error" not in out, f"stream {i}: {out['error']}"
        assert sum(1 for e in out["events"] if e.get("done")) == 1, f"stream {i}"
    return [out["events"] for _, out in runs]


def _tokens(events: list[dict[str, Any]]) -> list[int]:
    return [e["token"] for e in events if e.get("event") == "token"]


def _text(events: list[dict[str, Any]]) -> str:
    return "".join(e.get("text", "") for e in events)


def _session_prompt(i: int) -> str:
    return f"Conversation {i}: a question about tides, harbours and the number {i * 7}."


def test_a_rolling_restart_moves_streams_and_sessions_exactly(pair: Pair) -> None:
    gw = pair.gateway_ep
    # References: every stream and every session continuation, never moved.
    # The reference streams run together: each row is computed as if alone
    # (batch invariance), so running them side by side changes no token.
    ref_streams = _ended(
        [_started(gw, _stream_args(i), f"ref-st{i}" if i < 4 else None) for i in range(8)]
    )
    ref_sessions = []
    with Client(gw, timeout_ms=WAIT_MS) as c:
        for i in range(SESSIONS):
            c.call("generate", f"ref-s{i}", {"prompt": _session_prompt(i), "max_tokens": 1})
            cont = {"tokens": [9], "max_tokens": 8, "ignore_eos": True, "stream": False}
            ref_sessions.append(c.call("generate", f"ref-s{i}", cont).result["tokens"])
        for i in range(SESSIONS):
            c.drop(f"ref-s{i}")
        for i in range(4):
            c.drop(f"ref-st{i}")

        # The load: 16 open sessions, 8 streams running.
        for i in range(SESSIONS):
            c.call("generate", f"s{i}", {"prompt": _session_prompt(i), "max_tokens": 1})
    runs = _running(gw, [(_stream_args(i), f"st{i}" if i < 4 else None) for i in range(8)])
    moved_before = pair.status().get("streams_moved", 0)

    # The rolling restart.
    first, second = pair.endpoints
    pair.restart(first)
    pair.restart(second)

    for i, events in enumerate(_ended(runs)):
        assert [e for e in events if e.get("event") == "done"][-1]["finish_reason"] == "length"
        assert _tokens(events) == _tokens(ref_streams[i]), f"stream {i} differs"
        assert _text(events) == _text(ref_streams[i])
    assert pair.status().get("streams_moved", 0) > moved_before

    with Client(gw, timeout_ms=WAIT_MS) as c:
        for i in range(SESSIONS):
            cont = {"tokens": [9], "max_tokens": 8, "ignore_eos": True, "stream": False}
            got = c.call("generate", f"s{i}", cont).result["tokens"]
            assert got == ref_sessions[i], f"session s{i} continues differently"
            c.drop(f"s{i}")
        for i in range(4):
            c.drop(f"st{i}")


def test_a_worker_holding_only_sessionless_streams_hands_them_over(pair: Pair) -> None:
    """No named session on the leaving worker, so no peer to tell ``leaving``:
    the gateway sees it draining in its ``stats`` and moves its streams all
    the same (they do not run on to the drain timeout and get cancelled)."""
    gw = pair.gateway_ep
    assert not any(w["sessions"] for w in pair.status()["workers"])
    refs = _ended([_started(gw, _stream_args(20 + i), None) for i in range(2)])
    runs = _running(gw, [(_stream_args(20 + i), None) for i in range(2)])
    holder = next(w["endpoint"] for w in pair.status()["workers"] if w["in_flight"])
    moved_before = pair.status().get("streams_moved", 0)
    pair.restart(holder)
    for i, events in enumerate(_ended(runs)):
        assert _tokens(events) == _tokens(refs[i]), f"stream {i} differs"
    assert pair.status().get("streams_moved", 0) > moved_before, "no stream was moved"
