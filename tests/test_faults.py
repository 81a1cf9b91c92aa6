"""Faults a worker survives (issue 13): clients that misbehave, llama.cpp
failing inside a batch, and the graceful drain on SIGTERM.

One worker for the module (4 lanes over a unified KV cache of 1024 cells, a
lane allowed 512: three long sessions cannot all fit, so llama.cpp really
fails) and a send queue of 8 messages per peer (a client that stops reading
is cut off after a few 1 MiB logits events). Every test ends with the lanes
back in the pool, checked in ``stats``. The last test drains this worker
with SIGTERM; a second, short-lived worker checks the drain timeout.
"""

from __future__ import annotations

import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq

from conftest import WAIT_S, start_worker, stop_worker, wait_until
from protocol import Client, SkiffError
from protocol.transport import encode, request

ARGS = (
    *("--lanes", "4", "--ctx", "1024", "--ctx-per-lane", "512"),
    *("--prefill-chunk", "256", "--send-hwm", "8", "--drain-timeout-s", "120"),
)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def worker(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    proc, endpoint, _ = start_worker(tmp_path_factory.mktemp("faults"), *ARGS)
    yield proc, endpoint
    stop_worker(proc)


WAIT_MS = int(WAIT_S * 1000)


def _stats(endpoint: str) -> dict[str, Any]:
    with Client(endpoint, timeout_ms=WAIT_MS) as c:
        return c.stats()


def _idle(endpoint: str) -> bool:
    s = _stats(endpoint)
    return s["running"] == 0 and s["queued"] == 0 and s["lanes"]["active"] == 0


def _stream(
    endpoint: str, args: dict[str, Any], out: dict[str, Any], session: str | None = None
) -> None:
    """Follow one streaming generate; ``out`` gets its events and end."""
    out["events"] = 0
    try:
        with Client(endpoint, timeout_ms=WAIT_MS) as c:
            rid = c.send("generate", session, {**args, "stream": True})
            for reply in c.follow(rid):
                out["events"] += 1
                out["last"] = reply.header
    except SkiffError as exc:
        out["error"] = exc


def _start_stream(
    endpoint: str, args: dict[str, Any], session: str | None = None
) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}
    t = threading.Thread(target=_stream, args=(endpoint, args, out, session), daemon=True)
    t.start()
    wait_until(lambda: out.get("events", 0) >= 2 or "error" in out, what="stream started")
    return t, out


def _ended(t: threading.Thread) -> None:
    t.join(WAIT_S)
    assert not t.is_alive(), "the stream did not end"


LONG = {"prompt": "Count from one to a thousand:", "ignore_eos": True}


# -- client faults -------------------------------------------------------------


def test_a_client_gone_mid_stream_has_its_work_cancelled(worker: Any) -> None:
    _, ep = worker
    before = _stats(ep)["cancelled"]
    c = Client(ep, timeout_ms=WAIT_MS)
    rid = c.send("generate", None, {**LONG, "max_tokens": 480, "stream": True})
    for _ in range(3):
        c.recv(rid).raise_for_error()
    c.close()  # gone without a cancel
    wait_until(lambda: _idle(ep), what="lane returned")
    assert _stats(ep)["cancelled"] == before + 1


def test_a_client_that_never_reads_is_cut_off_and_others_go_on(worker: Any) -> None:
    proc, ep = worker
    rss_before = psutil.Process(proc.pid).memory_info().rss
    ctx = zmq.Context.instance()
    sleeper = ctx.socket(zmq.DEALER)
    sleeper.setsockopt(zmq.RCVHWM, 1)
    sleeper.setsockopt(zmq.RCVBUF, 4096)
    sleeper.setsockopt(zmq.LINGER, 0)
    sleeper.connect(ep)
    # every event carries a 1 MiB logits row: unbounded, 400 of them would be 400 MiB
    args = {**LONG, "max_tokens": 400, "stream": True, "output": ["logits"]}
    sleeper.send(encode(request(1, "generate", None, args)))
    other: dict[str, Any] = {}
    _stream(ep, {**LONG, "max_tokens": 24}, other)
    assert "error" not in other and other["last"]["finish_reason"] == "length"
    wait_until(lambda: _idle(ep), what="the sleeper's work cancelled")
    grown = psutil.Process(proc.pid).memory_info().rss - rss_before
    assert grown < 200 << 20, f"RSS grew {grown >> 20} MiB"
    sleeper.close()


def test_cancel_naming_another_clients_request_is_ignored(worker: Any) -> None:
    _, ep = worker
    with Client(ep, timeout_ms=WAIT_MS) as owner, Client(ep, timeout_ms=WAIT_MS) as other:
        rid = owner.send("generate", None, {**LONG, "max_tokens": 12, "stream": True})
        owner.recv(rid).raise_for_error()
        assert other.call("cancel", None, {"id": rid}).result == {"cancelled": False}
        last = None
        for reply in owner.follow(rid):
            last = reply.header
        assert last is not None and last["finish_reason"] == "length"
    wait_until(lambda: _idle(ep), what="idle")


# -- engine faults ---------------------------------------------------------------


def test_an_exhausted_kv_cache_fails_only_the_request_that_does_not_fit(worker: Any) -> None:
    """llama.cpp itself refuses (no KV slot): the stream beside it goes on and
    every session's position stays what the engine holds."""
    _, ep = worker
    with Client(ep, timeout_ms=WAIT_MS) as c:
        text = "The quick brown fox jumps over the lazy dog, again and again. " * 30
        toks = c.tokenize(text)[:400]
        assert len(toks) == 400
        assert c.prefill("a", toks) == 400
        assert c.prefill("b", toks) == 400
        t, stream = _start_stream(ep, {"prompt": " and", "max_tokens": 60, "ignore_eos": True})
        with pytest.raises(SkiffError) as err:
            c.prefill("c", toks[:300])  # its first chunk: 400 + 400 + 256 > 1024 cells
        assert err.value.code == "internal" and "KV" in err.value.message
        _ended(t)
        assert "error" not in stream and stream["last"]["finish_reason"] == "length"
        sessions = {s["session"]: s["position"] for s in c.stats()["sessions"]}
        assert sessions == {"a": 400, "b": 400, "c": 0}  # nothing of c landed
        # the worker keeps serving: the sessions go on from where they are
        c.drop("b")
        assert c.prefill("c", toks[:300]) == 300
        assert c.decode("a", toks[0])["position"] == 401
        for s in ("a", "c"):
            c.drop(s)
    wait_until(lambda: _idle(ep), what="idle")


# -- graceful drain -----------------------------------------------------------------


def test_sigterm_finishes_accepted_streams_refuses_new_work_and_exits_0(worker: Any) -> None:
    """Three accepted streams run to their end after SIGTERM. The checks of the
    draining worker need it alive, so it is kept so by accepted work that
    cannot end before the test lets it: a generation queued for a lane while
    named sessions hold all four (the streams' own, and ``hold``)."""
    proc, ep = worker
    streams = [_start_stream(ep, {**LONG, "max_tokens": 48}, session=f"drain{i}") for i in range(3)]
    with Client(ep, timeout_ms=WAIT_MS) as c:
        c.prefill("hold", [2, 3])
        kept = {"prompt": "kept", "max_tokens": 2, "ignore_eos": True, "stream": False}
        keeper = c.send("generate", None, kept)
        wait_until(lambda: c.stats()["queued"] == 1, what="the keeper queued for a lane")
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: c.stats()["draining"], what="draining")
        with pytest.raises(SkiffError) as err:
            c.call("generate", None, {"prompt": "late", "max_tokens": 2, "stream": False})
        assert err.value.code == "shutting_down" and (err.value.retry_after_ms or 0) > 0
        assert c.ping()["pong"]
        assert c.drop("hold") == {}  # served while draining: the keeper gets its lane
        assert c.recv(keeper).raise_for_error().result["usage"]["completion_tokens"] == 2
    for t, out in streams:
        _ended(t)
        assert "error" not in out, out
        assert out["last"]["finish_reason"] == "length" and out["events"] == 49
    assert proc.wait(WAIT_S) == 0


def test_the_drain_timeout_cancels_the_rest_with_a_final_event(tmp_path: Path) -> None:
    proc, ep, log = start_worker(
        tmp_path, "--lanes", "2", "--ctx", "4096", "--drain-timeout-s", "1"
    )
    try:
        t, out = _start_stream(ep, {**LONG, "max_tokens": 2000})
        proc.send_signal(signal.SIGTERM)
        _ended(t)
        assert "error" not in out, out
        assert out["last"]["done"] and out["last"]["finish_reason"] == "cancelled"
        assert proc.wait(WAIT_S) == 0
        assert "drain_timeout" in log.read_text()
    finally:
        stop_worker(proc)
