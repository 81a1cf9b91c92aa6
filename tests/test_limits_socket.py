"""Limits end to end: ONE worker started with small limits (one of them through
its ``SKIFF_*`` twin), every limit checked over the socket: the code, the
message naming field, limit and flag, and that a refused request leaves
nothing behind. The validators alone: test_limits_units.py. The speech
worker's ``--max-chars`` is tested in ``test_speech_worker.py`` (its worker
is already up).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _limits_helpers import _frame, _restore

from conftest import start_worker, stop_worker, tidy_client
from protocol import Client, SkiffError

# -- over the socket: one worker with small limits -----------------------------------

FLAGS = {
    "--max-request-tokens": "64",
    "--max-new-tokens": "32",
    "--max-sessions-per-peer": "2",
    "--max-streams-per-peer": "2",
    "--max-stop-chars": "8",
    "--max-grammar-bytes": "64",
    "--max-logit-bias": "2",
    "--max-messages": "2",
    "--max-frame-parts": "1",
    "--max-frame-rank": "2",
}
ENV = {"SKIFF_MAX_STOPS": "2"}  # one limit through its env twin


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    proc: subprocess.Popen[bytes] | None = None
    try:
        args = [x for pair in FLAGS.items() for x in pair]
        proc, endpoint, _ = start_worker(
            tmp_path_factory.mktemp("limits"), "--lanes", "4", "--ctx", "2048", *args
        )
    finally:
        _restore(saved)
    yield endpoint
    stop_worker(proc)


@pytest.fixture()
def client(small: str) -> Iterator[Client]:
    with tidy_client(small) as c:
        yield c


def _refused(client: Client, op: str, args: dict[str, Any], *, session: str | None = None) -> str:
    with pytest.raises(SkiffError) as err:
        client.call(op, session, args)
    assert err.value.code == "limit_exceeded", err.value.message
    return err.value.message


def test_info_reports_every_limit(client: Client) -> None:
    limits = client.info()["limits"]
    for name, value in FLAGS.items():
        assert limits[name[2:].replace("-", "_")] == int(value)
    assert limits["max_stops"] == 2  # from SKIFF_MAX_STOPS
    assert {"max_request_bytes", "max_message_bytes", "max_queue"} <= set(limits)


def test_request_size_limits_over_the_socket(client: Client) -> None:
    gen = {"max_tokens": 4, "stream": False}
    many = [2] + [1000] * 64  # 65 tokens: fits a lane (512), over --max-request-tokens
    msg = _refused(client, "prefill", {"tokens": many}, session="big")
    assert msg == "tokens has 65 tokens; the limit is 64 (--max-request-tokens)"
    _refused(client, "verify", {"tokens": many}, session="big")
    _refused(client, "embed", {"tokens": many})
    assert "prompt has" in _refused(client, "generate", {**gen, "prompt": "one two " * 60})
    assert "messages render to" in _refused(
        client, "chat", {**gen, "messages": [{"role": "user", "content": "one two " * 60}]}
    )
    msg = _refused(client, "generate", {"prompt": "Hi", "max_tokens": 33})
    assert msg == "max_tokens is 33; the limit is 32 (--max-new-tokens)"
    assert "(--max-stops)" in _refused(
        client, "generate", {**gen, "prompt": "Hi", "stop": list("abc")}
    )
    msg = _refused(client, "generate", {**gen, "prompt": "Hi", "stop": ["123456789"]})
    assert msg == "stop[0] has 9 characters; the limit is 8 (--max-stop-chars)"
    grammar = "root ::= " + " | ".join(['"word"'] * 10)  # 96 bytes
    msg = _refused(client, "generate", {**gen, "prompt": "Hi", "sampling": {"grammar": grammar}})
    assert msg.startswith("sampling.grammar is ") and msg.endswith("(--max-grammar-bytes)")
    bias = [{"token": t, "bias": 1.0} for t in (5, 6, 7)]
    msg = _refused(client, "decode", {"token": 2, "sampling": {"logit_bias": bias}}, session="b")
    assert msg == "sampling.logit_bias has 3 entries; the limit is 2 (--max-logit-bias)"
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 2
    assert "(--max-messages)" in _refused(client, "chat", {**gen, "messages": chat[:3]})
    # just under every limit works
    ok = client.call("generate", None, {**gen, "prompt": "Hi", "stop": ["12345678", "x"]})
    assert ok.header["ok"]
    assert client.stats()["lanes"]["active"] == 0  # nothing refused took a lane


def test_frame_limits_over_the_socket(client: Client) -> None:
    for arrays, msg in [
        ((np.zeros(2, np.float32), np.zeros(2, np.float32)), "frame.parts: has 2 parts"),
        ((np.zeros((2, 2, 2), np.float32),), "frame.parts[0].dims: has 3 dims"),
    ]:
        header, buffers = _frame(*arrays)
        with pytest.raises(SkiffError) as err:
            client.call("echo", None, {"frame": header}, buffers)
        assert err.value.code == "limit_exceeded" and err.value.message.startswith(msg)
    header, buffers = _frame(np.arange(4, dtype=np.float32).reshape(2, 2))
    echoed = client.call("echo", None, {"frame": header}, buffers).frame
    np.testing.assert_array_equal(echoed.array("p0"), np.arange(4).reshape(2, 2))


def test_sessions_per_peer_over_the_socket(client: Client, small: str) -> None:
    client.prefill("a1", [2, 10])
    client.prefill("a2", [2, 10])
    msg = _refused(client, "prefill", {"tokens": [2, 10]}, session="a3")
    assert msg.endswith("the limit is 2 (--max-sessions-per-peer)")
    client.decode("a1", 11)  # its own sessions still work
    with Client(small, timeout_ms=60_000) as other:  # another peer counts apart
        other.prefill("b1", [2, 10])
        other.drop("b1")
    client.drop("a1")  # dropping one lets the next in
    client.prefill("a3", [2, 10])
    for session in ("a2", "a3"):
        client.drop(session)
    assert client.stats()["lanes"]["active"] == 0


def test_streams_per_peer_over_the_socket(client: Client, small: str) -> None:
    args = {"prompt": "Count: 1, 2, 3,", "max_tokens": 12, "ignore_eos": True}
    # Two other peers hold all four lanes (two sessions each, their limit), so
    # this peer's first two generations wait queued: neither can end before
    # the third is judged, however slowly the three arrive.
    with Client(small, timeout_ms=60_000) as h1, Client(small, timeout_ms=60_000) as h2:
        for holder, names in ((h1, ("h1", "h2")), (h2, ("h3", "h4"))):
            for name in names:
                holder.prefill(name, [2, 10])
        first, second, third = (client.send("generate", None, args) for _ in range(3))
        reply = client.recv(third)
        assert reply.header["error"]["code"] == "limit_exceeded"
        assert reply.header["error"]["message"].endswith("the limit is 2 (--max-streams-per-peer)")
        for name in ("h1", "h2"):  # two lanes free: first and second run
            h1.drop(name)
        assert list(client.follow(first))[-1].header["finish_reason"] == "length"
        fourth = client.send("generate", None, {**args, "max_tokens": 2})  # the slot came back
        for rid in (second, fourth):
            assert list(client.follow(rid))[-1].header["finish_reason"] == "length"
        for name in ("h3", "h4"):
            h2.drop(name)
    stats = client.stats()
    assert stats["running"] == 0 and stats["queued"] == 0 and stats["lanes"]["active"] == 0
