"""Stage 0 keeps serving while a request waits on the rest of the chain.

Session ops that must reach the later stages (``drop``, ``export_state``,
``info``, ...) go down the chain without holding stage 0's loop: with the
last stage stopped (SIGSTOP) such a request stays pending while ``ping``
is answered, and once the stage continues (SIGCONT) the request completes
as it always did, every stage consistent (logits compared to one
whole-model worker's, to the bit)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import WAIT_S, start_chain, wait_until
from protocol import Client, SkiffError

PROMPT = "The lighthouse keeper climbed the stairs every evening, and the sea below"
WAIT_MS = int(WAIT_S * 1000)


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, int]]:
    """(stage-0 endpoint, stage-1 endpoint, stage-1 pid): layers 0:9 -> 9:18."""
    tmp = tmp_path_factory.mktemp("chain_async")
    args = ("--lanes", "2", "--ctx", "4096")
    with start_chain(tmp, ["0:9", "9:18"], *args, name="a") as (e0, e1), Client(e1) as last:
        yield e0, e1, int(last.stats()["process"]["pid"])


def _state(pid: int) -> str:
    """The process's state letter (``T``: stopped); read past the command name."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0]


@contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The process stopped (SIGSTOP) for the block; always continued after."""
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(lambda: _state(pid) == "T", what="the stage stopped")
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _decode(client: Client, session: str, token: int, steps: int) -> tuple[list[int], Any]:
    """Greedy tokens from ``token`` on, with every step's logits."""
    out, rows = [token], []
    for _ in range(steps):
        reply = client.decode(session, out[-1], output=["logits"])
        rows.append(np.array(reply.frame.array("logits")[0]))
        out.append(int(reply.result["token"]))
    return out, np.stack(rows)


def _reference(client: Client, session: str, tokens: list[int], steps: int) -> tuple[Any, Any]:
    first = client.prefill_sampled(session, tokens)["token"]
    try:
        return _decode(client, session, first, steps)
    finally:
        client.drop(session)


def test_a_drop_waits_for_a_stopped_stage_while_stage_0_answers_ping(
    client: Client, chain: tuple[str, str, int]
) -> None:
    e0, e1, pid = chain
    tokens = client.tokenize(PROMPT)
    want = _reference(client, "held_full", tokens, 4)
    with Client(e0, timeout_ms=WAIT_MS) as head, Client(e1, timeout_ms=WAIT_MS) as last:
        head.prefill("held", tokens)  # the session is on both stages now
        with stopped(pid):
            drop = head.send("drop", "held")
            info = head.send("info")  # asks the chain too
            ping = head.send("ping")
            first = head.recv_any()
            # stage 0's loop went on while the drop (and info) waited on the chain
            assert first.header["id"] == ping and first.result == {"pong": True}
        assert head.recv(drop).raise_for_error().result == {}
        chain_info = head.recv(info).raise_for_error().result["chain"]
        assert [s["layers"] for s in chain_info] == [[0, 9], [9, 18]]
        # the drop reached the last stage before stage 0 answered it
        with pytest.raises(SkiffError) as err:
            last.drop("held")
        assert err.value.code == "session_not_active"
        # every stage agrees: the name starts afresh and runs exactly
        got = _reference(head, "held", tokens, 4)
    assert got[0] == want[0]
    assert float(np.max(np.abs(got[1] - want[1]))) == 0.0


def test_export_state_waits_for_a_stopped_stage_while_stage_0_answers_ping(
    client: Client, chain: tuple[str, str, int]
) -> None:
    e0, _, pid = chain
    tokens = client.tokenize(PROMPT)
    want = _reference(client, "moving_full", tokens, 6)
    with Client(e0, timeout_ms=WAIT_MS) as head:
        first = head.prefill_sampled("moving", tokens)["token"]
        with stopped(pid):
            export = head.send("export_state", "moving")
            ping = head.send("ping")
            reply = head.recv_any()
            assert reply.header["id"] == ping and reply.result == {"pong": True}
        exported = head.recv(export).raise_for_error()
        assert exported.frame.identities == ("kv_state", "kv_state.1")
        assert len(exported.result["session_state"]["downstream"]) == 1
        head.drop("moving")
        # the gathered state re-imports exactly: decoding goes on as on one worker
        assert head.import_state("moving", exported) == len(tokens)
        try:
            got = _decode(head, "moving", first, 6)
        finally:
            head.drop("moving")
    assert got[0] == want[0]
    assert float(np.max(np.abs(got[1] - want[1]))) == 0.0


def test_a_stopped_stage_does_not_hold_other_sessions_ops_on_stage_0(
    chain: tuple[str, str, int],
) -> None:
    """Two sessions' requests wait on the chain at once; a request on a third
    session that needs only stage 0 (``tokenize``) is answered meanwhile,
    and after SIGCONT each pending request gets its own reply."""
    e0, _, pid = chain
    with Client(e0, timeout_ms=WAIT_MS) as head:
        tokens = head.tokenize(PROMPT)
        head.prefill("one", tokens)
        head.prefill("two", tokens[:5])
        with stopped(pid):
            trim = head.send("trim", "one", {"token_count": 3})
            signal_req = head.send("signal", "two")  # no token sampled yet: the last stage says so
            tok = head.send("tokenize", None, {"text": "sea"})
            reply = head.recv_any()
            assert reply.header["id"] == tok and reply.result["tokens"]
        assert head.recv(trim).raise_for_error().result == {"position": 3}
        refused = head.recv(signal_req)
        assert refused.header["error"]["code"] == "bad_request"
        assert "no sampled token" in refused.header["error"]["message"]
        head.drop("one")
        head.drop("two")
