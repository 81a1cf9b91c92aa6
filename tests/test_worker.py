"""Behaviour of the worker over a real ipc:// socket on the real model."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np
import pytest

from protocol import Client, SkiffError

PROMPT = "The capital of France is"
ROOT = Path(__file__).resolve().parent.parent


def _greedy(client: Client, session: str, prompt_tokens: list[int], n: int) -> list[int]:
    out = [client.prefill_sampled(session, prompt_tokens)["token"]]
    while len(out) < n:
        out.append(client.decode(session, out[-1])["token"])
    return out


def test_ping_and_info(client: Client) -> None:
    assert client.ping() == {"pong": True}
    info = client.info()
    model = info["model"]
    assert model["n_vocab"] == 262144 and model["n_layer"] == 18 and model["bos"] == 2
    assert {"path", "n_embd", "n_ctx_train", "eos"} <= set(model)
    assert info["lanes"] == 8 and info["n_ctx"] >= 16384 and info["n_batch"] == 512
    assert {
        "ping",
        "prefill",
        "prefill_sampled",
        "decode",
        "decode_batch",
        "trim",
        "align",
        "drop",
        "stats",
        "tokenize",
        "detokenize",
    } <= set(info["ops"])
    assert info["speech"] is False


def test_tokenize_round_trip(client: Client) -> None:
    tokens = client.tokenize(PROMPT)
    assert tokens[0] == 2  # BOS
    assert client.tokenize(PROMPT, add_special=False) == tokens[1:]
    assert client.detokenize(tokens[1:]) == PROMPT


_LLAMA_CHILD = """
import json, sys
import llama_cpp.llama_cpp as low
from llama_cpp import Llama
from worker.engine import kernels

kernels.start_backend(True)  # the worker's switches for this CPU level (exact rows)
default_params = low.llama_model_default_params

def params_without_repack():
    params = default_params()
    params.use_extra_bufts = False  # as the worker (--repack 0)
    return params

low.llama_model_default_params = params_without_repack
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=2, verbose=False, seed=0,
            flash_attn=True, swa_full=True)
out = []
for tokens, n in json.loads(sys.stdin.read()):
    got = []
    for tok in llm.generate(tokens, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                            repeat_penalty=1.0, reset=True):
        got.append(int(tok))
        if len(got) == n:
            break
    out.append(got)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def llama_greedy(model_path: str) -> Callable[[list[list[int]], int], list[list[int]]]:
    """Greedy tokens from llama-cpp-python's high-level ``Llama``, same weights,
    in a child process with the worker's kernel switches (ggml reads them once
    per process): with every row batch-invariant, its one-batch prefill and
    its decode compute what the worker's do, so the tokens must be the same."""

    def run(prompts: list[list[int]], n: int) -> list[list[int]]:
        proc = subprocess.run(
            [sys.executable, "-c", _LLAMA_CHILD, model_path],
            input=json.dumps([[p, n] for p in prompts]),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
            cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        out: list[list[int]] = json.loads(proc.stdout.strip().splitlines()[-1])
        return out

    return run


GREEDY_PROMPTS = ["Once upon a time, in a small village,", "The quick brown fox", PROMPT]


def test_greedy_matches_llama_cpp_high_level(
    client: Client, llama_greedy: Callable[[list[list[int]], int], list[list[int]]]
) -> None:
    """skiff's prefill_sampled + 16 decodes against llama-cpp-python's own
    generate loop: the same 17 tokens for every prompt."""
    prompts = [client.tokenize(p) for p in GREEDY_PROMPTS]
    ours = []
    for i, tokens in enumerate(prompts):
        ours.append(_greedy(client, f"parity{i}", tokens, 17))
        client.drop(f"parity{i}")
    assert ours == llama_greedy(prompts, 17)


def test_decode_batch_agrees_with_sequential_decode(client: Client) -> None:
    prompts = [PROMPT, "Once upon a time", "def fibonacci(n):", "The quick brown fox"]
    firsts = []
    for i, text in enumerate(prompts):
        toks = client.tokenize(text)
        firsts.append(client.prefill_sampled(f"seq{i}", toks)["token"])
        assert client.prefill_sampled(f"bat{i}", toks)["token"] == firsts[-1]
    sequential = []
    for i in range(4):
        reply = client.decode(f"seq{i}", firsts[i], return_logits=True)
        sequential.append(reply.frame.array("logits")[0].copy())
    reply = client.decode_batch(
        [{"session": f"bat{i}", "token": firsts[i]} for i in range(4)], return_logits=True
    )
    batched = reply.frame.array("logits")
    assert batched.shape == (4, 262144)
    for i in range(4):
        assert int(np.argmax(batched[i])) == int(np.argmax(sequential[i]))
        assert reply.result["tokens"][i] == int(np.argmax(sequential[i]))
        # Logits span ~40 units here; batch shape only changes fp32 accumulation
        # order over the same Q8-quantised activations, so 0.05 (~0.1% of the
        # span, far below the top-2 margins we see) separates noise from bugs.
        assert float(np.max(np.abs(batched[i] - sequential[i]))) <= 0.05


def test_decode_batch_is_all_or_nothing(unparked_client: Client) -> None:
    client = unparked_client  # no park: a lane is a hard limit
    for i in range(2):
        client.prefill(f"hold{i}", [2, 100])
    requests = [{"session": f"new{i}", "token": 2} for i in range(3)]
    with pytest.raises(SkiffError) as info:
        client.decode_batch(requests)
    assert info.value.code == "lanes_busy"
    names = {s["session"] for s in client.stats()["sessions"]}
    assert not any(n.startswith("new") for n in names)
    with pytest.raises(SkiffError) as dup:
        client.decode_batch([{"session": "x", "token": 2}, {"session": "x", "token": 3}])
    assert dup.value.code == "bad_request"


def test_a_batch_beyond_the_free_lanes_parks_idle_sessions(client: Client) -> None:
    """With a park (the default), idle sessions make room: the batch runs, and
    the parked sessions go on where they were."""
    for i in range(6):
        client.prefill(f"hold{i}", [2, 100])
    parks = client.stats()["park"]["parks"]
    tokens = client.decode_batch([{"session": f"new{i}", "token": 2} for i in range(3)])
    assert len(tokens) == 3
    assert client.stats()["park"]["parks"] > parks
    for i in range(6):
        assert client.decode(f"hold{i}", 5)["position"] == 3


def test_trim_then_redecode_reproduces_the_continuation(client: Client) -> None:
    prompt = client.tokenize("In 1905, Albert Einstein published")
    out = _greedy(client, "trim", prompt, 12)
    p = len(prompt)
    assert client.stats()["sessions"][0]["position"] == p + 11
    assert client.trim("trim", p + 4) == p + 4
    again = [out[4]]
    while len(again) < 8:
        again.append(client.decode("trim", again[-1])["token"])
    assert again == out[4:12]


def test_align_reports_before_and_after(client: Client) -> None:
    client.prefill("al", [2, 10, 11, 12, 13])
    assert client.align("al", 9) == {"before": None, "after": None}
    assert client.align("al", 2) == {"before": 5, "after": 2}
    assert client.stats()["sessions"][0]["position"] == 2


def test_long_prompt_prefill_positions(client: Client) -> None:
    tokens = client.tokenize("word " * 700)
    assert client.prefill("long", tokens) == len(tokens)
    with pytest.raises(SkiffError) as info:
        client.prefill("long", tokens + tokens)
    assert info.value.code == "context_overflow"
    assert client.stats()["sessions"][0]["position"] == len(tokens)


def _error_code(client: Client, frames_: list[bytes]) -> tuple[object, str]:
    client.send_raw(frames_)
    reply = client.recv_any(30_000)
    assert reply.header["ok"] is False
    return reply.header["id"], reply.header["error"]["code"]


def _req(op: object, **extra: object) -> bytes:
    header = {"v": 1, "id": 99, "op": op, **extra}
    return msgpack.packb(header)


def test_bad_input_in_a_row_then_ping(client: Client, worker: tuple[str, Path]) -> None:
    cases: list[tuple[list[bytes], str]] = [
        ([b"\xc1\xff not msgpack"], "bad_request"),
        ([msgpack.packb([1, 2, 3])], "bad_request"),
        ([msgpack.packb({"v": 1, "id": 99})], "bad_request"),
        ([_req("no_such_op")], "unknown_op"),
        ([msgpack.packb({"v": 2, "id": 99, "op": "ping"})], "unsupported_version"),
        ([_req("decode", session="s", args={"token": "x"})], "bad_request"),
        ([_req("decode", session="s", args={"token": -1})], "bad_request"),
        ([_req("decode", session="s", args={"token": 262144})], "bad_request"),
        ([_req("decode", session="s", args={"token": True})], "bad_request"),
        (
            [_req("prefill", session="s", args={"tokens": [200_000] * 2_000_000})],
            "payload_too_large",
        ),
        ([_req("prefill", session="s", args={"tokens": "abc"})], "bad_request"),
        ([_req("prefill", args={"tokens": [1]})], "bad_request"),
        ([_req("trim", session="ghost", args={"token_count": 0})], "session_not_active"),
        ([_req("trim", session="ghost", args={"token_count": -4})], "bad_request"),
        ([_req("decode_batch", args={"requests": "no"})], "bad_request"),
    ]
    for frames_, code in cases:
        rid, got = _error_code(client, frames_)
        assert got == code, (frames_[0][:40], got)
        if code == "bad_request" and frames_[0].startswith(b"\xc1"):
            assert rid is None
    assert client.ping() == {"pong": True}
    # The failure of a trim is logged with request id, op and session.
    lines = [json.loads(x) for x in worker[1].read_text().splitlines() if x.startswith("{")]
    failed = [x for x in lines if x.get("event") == "request_failed" and x.get("op") == "trim"]
    assert failed and failed[-1]["request_id"] == 99 and failed[-1]["session"] == "ghost"
    assert failed[-1]["code"] in {"session_not_active", "bad_request"}


def test_stats_counts_lanes_and_tokens(client: Client) -> None:
    before = client.stats()["tokens_evaluated"]
    client.prefill("st", [2, 5, 6])
    stats = client.stats()
    assert stats["tokens_evaluated"] == before + 3
    assert stats["lanes"]["total"] == 8
    assert stats["lanes"]["active"] + stats["lanes"]["idle"] == 8
    assert {"lane", "session", "position"} <= set(stats["sessions"][0])
    assert stats["uptime_s"] > 0
    assert client.drop("st") == {}
    assert client.stats()["lanes"]["active"] == stats["lanes"]["active"] - 1


def test_stats_profile_says_where_the_time_went(client: Client) -> None:
    """``profile``: seconds per part of the loop and of the turns, summing up."""
    before = client.stats()["profile"]
    client.prefill("prof", [2, 5, 6, 7])
    client.decode("prof", 9)
    after = client.stats()["profile"]
    client.drop("prof")
    turn = {k: after["turn"][k] - before["turn"][k] for k in after["turn"]}
    loop = {k: after["loop"][k] - before["loop"][k] for k in after["loop"]}
    assert after["forwards"] >= before["forwards"] + 2
    assert turn["decode"] > 0 and turn["fill"] > 0 and turn["rows"] > 0 and turn["plan"] > 0
    assert loop["turn"] > 0 and loop["receive"] > 0 and loop["send"] > 0
    # the turn's parts happen inside the loop's turns, and the loop inside the wall clock
    inside = turn["decode"] + turn["fill"] + turn["rows"] + turn["plan"] + turn["render"]
    assert inside <= loop["turn"]
    # Every part counted by a snapshot ended before it, and began after the
    # clock started. (Between two snapshots no such bound holds: a part is
    # counted when it ends, so the difference holds the whole of the part the
    # first snapshot was taken in.)
    assert sum(after["loop"].values()) <= after["wall_s"]
