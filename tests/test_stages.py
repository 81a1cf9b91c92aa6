"""Pipeline stages: one model split by layers across worker processes.

A chain's results must equal one whole-model worker's to the last bit
(logits compared, not only tokens: a wrong sliding-window layout can keep
greedy tokens while moving logits by several units)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import WAIT_S, greedy_run, start_chain, start_worker, stop_worker, wait_until
from protocol import Client, SkiffError
from worker.slice.slicer import slice_model, validate

PROMPT = "The lighthouse keeper climbed the stairs every evening, and the sea below"


def _long_prompt(client: Client, n: int) -> list[int]:
    text = " ".join(f"Note {i}: the tide reached marker {i * 11 % 37} at noon." for i in range(300))
    tokens: list[int] = client.tokenize(text)
    return tokens[:n]


@pytest.fixture(scope="module")
def chain2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    """(stage-0 endpoint, stage-1 endpoint, tmp): layers 0:9 -> 9:18."""
    tmp = tmp_path_factory.mktemp("chain2")
    with start_chain(tmp, ["0:9", "9:18"], "--lanes", "8", "--ctx", "16384") as (e0, e1):
        yield e0, e1, tmp


@pytest.mark.parametrize("n_tokens", [20, 700])
def test_two_stages_equal_one_worker_to_the_bit(
    client: Client, chain2: tuple[str, str, Path], n_tokens: int
) -> None:
    tokens = _long_prompt(client, n_tokens) if n_tokens > 100 else client.tokenize(PROMPT)[:20]
    want_tokens, want_logits = greedy_run(client, f"full{n_tokens}", tokens, 16)
    with Client(chain2[0], timeout_ms=120_000) as head:
        got_tokens, got_logits = greedy_run(head, f"chain{n_tokens}", tokens, 16)
    assert got_tokens == want_tokens
    assert float(np.max(np.abs(got_logits - want_logits))) == 0.0


def test_chain_info_and_stage_refusals(chain2: tuple[str, str, Path]) -> None:
    with Client(chain2[0]) as head, Client(chain2[1]) as tail:
        info = head.info()
        assert [s["layers"] for s in info["chain"]] == [[0, 9], [9, 18]]
        assert tail.ping()["pong"] and tail.info()["stage"]["last"]
        with pytest.raises(SkiffError) as err:
            tail.prefill("x", [2, 3, 4])
        assert err.value.code == "unsupported" and "stage 0" in err.value.message
        with pytest.raises(SkiffError) as err:
            head.call("forward_frame", None, {})
        assert err.value.code == "unsupported"


def _batched(client: Client, tag: str, prompts: list[list[int]], steps: int) -> tuple[Any, ...]:
    """Eight sessions prefilled, then ``steps`` decode_batch rounds of all
    eight (8 rows: llama.cpp's tiled kernels) with their logits."""
    names = [f"{tag}{i}" for i in range(len(prompts))]
    last = [client.prefill_sampled(n, p)["token"] for n, p in zip(names, prompts, strict=True)]
    tokens, logits = [list(last)], []
    for _ in range(steps):
        reply = client.decode_batch(
            [{"session": n, "token": t} for n, t in zip(names, last, strict=True)],
            output=["logits"],
        )
        last = list(reply.result["tokens"])
        tokens.append(last)
        logits.append(np.array(reply.frame.array("logits")))
    for n in names:
        client.drop(n)
    return tokens, np.stack(logits)


def test_eight_sessions_batched_through_a_chain_match_one_worker(
    client: Client, chain2: tuple[str, str, Path]
) -> None:
    """A fresh worker as the reference: a batch's split into llama.cpp
    micro-batches (and so its kernels) depends on which lanes the sessions
    hold, and the shared worker's lanes are in whatever order earlier tests
    left them."""
    words = ["sea", "hill", "river", "wood", "lake", "road", "bay", "field"]
    prompts = [client.tokenize(f"Story {i}: a village by the {w}") for i, w in enumerate(words)]
    proc, endpoint, _ = start_worker(
        chain2[2], "--lanes", "8", "--ctx", "16384", "--prefix-cache", "0", name="fresh"
    )
    try:
        with Client(endpoint, timeout_ms=120_000) as fresh:
            want_tokens, want_logits = _batched(fresh, "fullb", prompts, 8)
    finally:
        stop_worker(proc)
    with Client(chain2[0], timeout_ms=120_000) as head:
        got_tokens, got_logits = _batched(head, "chainb", prompts, 8)
    assert got_tokens == want_tokens
    assert float(np.max(np.abs(got_logits - want_logits))) == 0.0


def test_pipeline_groups_take_turns_down_the_chain_and_stay_exact(
    client: Client, tmp_path: Path
) -> None:
    """``--pipeline-groups 2``: four greedy streams (one past the sliding
    window) split into two groups that
    overlap down the chain; each stream's tokens and logits equal the same
    generation alone on one worker (batch invariance: a row does not depend
    on which rows share its forward)."""
    prompts = [client.tokenize(f"Letter {i}: dear friend by the {w},") for i, w in
               enumerate(["sea", "hill", "river"])]  # fmt: skip
    prompts.append(_long_prompt(client, 600))  # past the 512-token sliding window
    args: dict[str, Any] = {"max_tokens": 12, "ignore_eos": True, "output": ["logits"]}

    def stream(c: Client, ids: list[int]) -> list[tuple[list[int], np.ndarray]]:
        out = []
        for i in ids:
            events = [e for e in c.follow(i) if e.header.get("event") == "token"]
            rows = np.stack([np.array(e.frame.array("logits")).reshape(-1) for e in events])
            out.append(([int(e.header["token"]) for e in events], rows))
        return out

    want = [stream(client, [client.send("generate", None, {**args, "tokens": p})])[0]
            for p in prompts]  # fmt: skip
    common = ("--lanes", "4", "--ctx", "4096")
    groups = ("--pipeline-groups", "2")
    with (
        start_chain(tmp_path, ["0:9", "9:18"], *common, head=groups, name="g") as (e0, _),
        Client(e0, timeout_ms=120_000) as head,
    ):
        ids = [head.send("generate", None, {**args, "tokens": p}) for p in prompts]
        got = stream(head, ids)
        overlapped = head.stats()["overlapped_forwards"]
    assert overlapped > 0  # the groups were down the chain at once
    for (want_tokens, want_rows), (got_tokens, got_rows) in zip(want, got, strict=True):
        assert got_tokens == want_tokens
        assert float(np.max(np.abs(got_rows - want_rows))) == 0.0


def _signals(client: Client, session: str, tokens: list[int], steps: int) -> list[Any]:
    """Every step's ``signal`` and the final ``signal_window`` of a greedy run."""
    out = [client.prefill_sampled(session, tokens)["token"]]
    seen = [client.call("signal", session).result]
    for _ in range(steps):
        out.append(int(client.decode(session, out[-1])["token"]))
        seen.append(client.call("signal", session).result)
    seen.append(client.call("signal_window", session, {"window_tokens": 4}).result)
    client.drop(session)
    return seen


def test_signals_come_from_the_last_stage_and_equal_one_worker(
    client: Client, chain2: tuple[str, str, Path]
) -> None:
    tokens = client.tokenize(PROMPT)
    want = _signals(client, "sig_full", tokens, 6)
    with Client(chain2[0], timeout_ms=120_000) as head:
        assert _signals(head, "sig_chain", tokens, 6) == want
        with pytest.raises(SkiffError) as err:
            head.call("signal", "nobody")
        assert err.value.code == "session_not_active"


def _verify(client: Client, session: str, prompt: list[int], sampling: Any) -> list[Any]:
    """Greedy reference, then verify spans (right, wrong, past the 7-row piece)."""
    t0 = client.prefill_sampled(session, prompt)["token"]
    ref = [t0]
    for _ in range(10):
        ref.append(client.decode(session, ref[-1])["token"])
    client.trim(session, len(prompt))
    args: dict[str, Any] = {} if sampling is None else {"sampling": sampling}
    wrong = (ref[3] + 1) % 262144
    out = [
        client.call("verify", session, {"tokens": [t0, *ref[1:3], wrong, ref[4]], **args}).result,
        client.call("verify", session, {"tokens": ref[3:11], "trim": False, **args}).result,
    ]
    client.drop(session)
    return out


SAMPLED = {"temperature": 0.8, "seed": 7}


def test_verify_and_speculation_through_a_chain_equal_one_worker(
    client: Client, chain2: tuple[str, str, Path]
) -> None:
    """verify's rows (and a speculative step's) are sampled on the last
    stage by the same rule a whole worker uses, so the replies match."""
    prompt = client.tokenize(PROMPT)
    spec = {"mode": "prompt_lookup", "max_draft": 6, "ngram": 2}
    text = "one two three four, one two three four, one two three four, one two"
    gen: dict[str, Any] = {"prompt": text, "max_tokens": 24, "speculative": spec, "stream": False}
    with Client(chain2[0], timeout_ms=120_000) as head:
        for sampling in (None, SAMPLED):
            assert _verify(head, "vc", prompt, sampling) == _verify(client, "vf", prompt, sampling)
        got = head.call("generate", None, gen).result
    want = client.call("generate", None, gen).result
    assert got["tokens"] == want["tokens"]
    assert got["speculative"]["accepted"] == want["speculative"]["accepted"] > 0


def test_a_session_moves_between_chains_and_continues_exactly(
    client: Client, chain2: tuple[str, str, Path]
) -> None:
    """export_state gathers every stage's cells (and the last stage's
    sampler); import_state on another chain of the same split rebuilds the
    session on each stage, and decoding on continues as on one worker. A
    whole-model state does not load into a chain."""
    tokens = _long_prompt(client, 600)  # past the 512-token window
    want, _ = greedy_run(client, "mig_full", tokens, 6)
    args = ("--lanes", "2", "--ctx", "4096")
    tmp = chain2[2]
    p1, e1, _ = start_worker(tmp, *args, "--layers", "9:18", name="m1")
    p0, e0, _ = start_worker(tmp, *args, "--layers", "0:9", "--next", e1, name="m0")
    try:
        with Client(chain2[0], timeout_ms=120_000) as a, Client(e0, timeout_ms=120_000) as b:
            first = a.prefill_sampled("mig", tokens)["token"]
            second = a.decode("mig", first)["token"]
            exported = a.export_state("mig")
            assert exported.frame.identities == ("kv_state", "kv_state.1")
            b.import_state("mig", exported)
            a.drop("mig")
            out = [first, second]
            for _ in range(5):
                out.append(b.decode("mig", out[-1])["token"])
            assert out == want
            b.drop("mig")
            client.prefill("whole", tokens[:20])
            with pytest.raises(SkiffError) as err:
                b.import_state("whole", client.export_state("whole"))
            assert err.value.code == "bad_request"
            client.drop("whole")
            assert b.stats()["lanes"]["active"] == 0
    finally:
        stop_worker(p0)
        stop_worker(p1)


def test_three_stages_are_exact(client: Client, tmp_path: Path) -> None:
    args = ("--lanes", "2", "--ctx", "4096")
    with start_chain(tmp_path, ["0:6", "6:12", "12:18"], *args, name="t") as (e0, _, e2):
        tokens = client.tokenize(PROMPT)
        want = greedy_run(client, "three_full", tokens, 8)
        with Client(e0, timeout_ms=120_000) as head:
            got = greedy_run(head, "three", tokens, 8)
            # asked through the middle stage, answered by the last
            got_signals = _signals(head, "three_sig", tokens, 3)
            # sampled tokens came home straight from the last stage
            assert head.info()["stage"]["direct_return"] == e2
        assert got[0] == want[0]
        assert float(np.max(np.abs(got[1] - want[1]))) == 0.0
        assert got_signals == _signals(client, "three_sig_full", tokens, 3)


def test_validate_catches_a_slice_without_the_window_fix(model_path: str, tmp_path: Path) -> None:
    src = Path(model_path)
    broken = slice_model(src, 9, 18, tmp_path / "broken.gguf", fix_swa=False)
    why = validate(src, 9, 18, broken)
    assert why is not None and "layer" in why
    fixed = slice_model(src, 9, 18, tmp_path / "fixed.gguf")
    assert validate(src, 9, 18, fixed) is None


def test_killing_the_last_stage_ends_streams_with_stage_unavailable(tmp_path: Path) -> None:
    args = ("--lanes", "2", "--ctx", "4096")
    p1, e1, _ = start_worker(tmp_path, *args, "--layers", "9:18", name="k1")
    p0, e0, _ = start_worker(tmp_path, *args, "--layers", "0:9", "--next", e1, name="k0")
    try:
        with Client(e0, timeout_ms=int(WAIT_S * 1000)) as head:
            events: list[Any] = []
            req = head.send(
                "generate", None, {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
            )
            events.append(head.recv(req))  # first token: the chain works
            p1.kill()
            while True:
                reply = head.recv(req)
                if not reply.header.get("ok") or reply.done:
                    break
            assert reply.header["error"]["code"] == "stage_unavailable"
            # told by the dropped connection ("went away" while a forward was out,
            # "not connected" at the next send), not by a forward timing out
            why = reply.header["error"]["message"]
            assert "went away" in why or "is not connected" in why, why
            assert head.ping()["pong"]
            with pytest.raises(SkiffError) as err:
                head.call("generate", None, {"prompt": "x", "max_tokens": 2, "stream": False})
            assert err.value.code == "stage_unavailable"
            # the stage comes back: new chain work runs again
            p1, e1b, _ = start_worker(tmp_path, *args, "--layers", "9:18", name="k1")
            assert e1b == e1

            def generated() -> list[int] | None:
                try:
                    args = {"prompt": PROMPT, "max_tokens": 3, "stream": False}
                    tokens: list[int] = head.call("generate", None, args).result["tokens"]
                    return tokens
                except SkiffError as exc:
                    if exc.code != "stage_unavailable":
                        raise
                    return None

            assert wait_until(generated, what="the chain working again")
    finally:
        stop_worker(p0)
        stop_worker(p1)
