"""verify and prompt-lookup speculation: exact acceptance, same output."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from conftest import start_worker, stop_worker
from protocol import Client, SkiffError
from worker.core.speculative import accept, lookup_draft

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
PROMPT = f"Python code:\n{CODE}\nThe same code again:\n"
LOOKUP = {"mode": "prompt_lookup", "max_draft": 8, "ngram": 3}


def test_lookup_draft_proposes_what_followed_the_last_ngram() -> None:
    history = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert lookup_draft(history, 3, 8) == [4, 5, 9, 1, 2, 3]
    assert lookup_draft(history, 3, 2) == [4, 5]
    assert lookup_draft([1, 2, 3], 3, 4) == []
    assert lookup_draft([7, 8, 7, 8], 2, 4) == [7, 8]


def test_accept_stops_at_first_disagreement() -> None:
    calls: list[int] = []
    target = [10, 11, 99, 13]

    def sample(i: int) -> int:
        calls.append(i)
        return target[i]

    assert accept([10, 11, 12], sample, lambda t: False) == [10, 11, 99]
    assert calls == [0, 1, 2]  # nothing sampled past the mismatch
    assert accept([10, 11, 99], lambda i: target[i], lambda t: False) == [10, 11, 99, 13]


def _greedy(client: Client, session: str, prompt: list[int], n: int) -> list[int]:
    out = [client.prefill_sampled(session, prompt)["token"]]
    while len(out) < n:
        out.append(client.decode(session, out[-1])["token"])
    return out


def test_verify_accepts_the_agreeing_prefix_and_trims(client: Client) -> None:
    prompt = client.tokenize("The capital of France is")
    ref = _greedy(client, "ref", prompt, 8)
    t0 = client.prefill_sampled("v", prompt)["token"]
    assert t0 == ref[0]
    wrong = (ref[3] + 1) % 262144
    reply = client.call("verify", "v", {"tokens": [t0, ref[1], ref[2], wrong, ref[4]]}).result
    assert reply["predicted"][:3] == ref[1:4]
    assert len(reply["predicted"]) == 5  # greedy reports every position
    assert reply["accepted"] == 2
    assert reply["position"] == len(prompt) + 3
    # Continuing from the accepted position reproduces the reference exactly.
    cont = [reply["predicted"][2]]
    while len(cont) < 4:
        cont.append(client.decode("v", cont[-1])["token"])
    assert cont == ref[3:7]


def test_verify_without_trim_keeps_the_span(client: Client) -> None:
    t0 = client.prefill_sampled("nt", [2, 818, 5279])["token"]
    reply = client.call("verify", "nt", {"tokens": [t0, 5, 6], "trim": False}).result
    assert reply["position"] == 6


def _tokens(client: Client, args: dict[str, Any]) -> dict[str, Any]:
    return client.call("generate", args={**args, "stream": False}).result


@pytest.mark.parametrize("sampling", [None, {"temperature": 0.7, "seed": 1234}])
def test_speculation_gives_the_same_tokens(client: Client, sampling: dict[str, Any] | None) -> None:
    args: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 48, "ignore_eos": True}
    if sampling:
        args["sampling"] = sampling
    plain = _tokens(client, args)
    spec = _tokens(client, {**args, "speculative": LOOKUP})
    assert spec["speculative"]["drafted"] > 0 and spec["speculative"]["accepted"] > 0
    # Every row of a span scores exactly as in plain decoding (rows are
    # batch-invariant): greedy and seeded outputs are identical.
    assert spec["tokens"] == plain["tokens"]


def test_speculative_stream_reports_counts_and_positions(client: Client) -> None:
    events = [
        r.header
        for r in client.generate(
            {"prompt": PROMPT, "max_tokens": 30, "ignore_eos": True, "speculative": LOOKUP}
        )
    ]
    tokens = [e for e in events if e.get("event") == "token"]
    assert len(tokens) == 30
    positions = [e["position"] for e in tokens]
    assert positions == list(range(positions[0], positions[0] + 30))
    assert events[-1]["speculative"]["drafted"] >= events[-1]["speculative"]["accepted"] > 0


def test_draft_model_mode_is_unsupported_without_a_draft(client: Client) -> None:
    with pytest.raises(SkiffError) as info:
        _tokens(
            client,
            {
                "prompt": "x",
                "max_tokens": 2,
                "speculative": {"mode": "draft_model", "path": "/nope.gguf"},
            },
        )
    assert info.value.code == "unsupported"


@pytest.fixture(scope="module")
def drafted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A worker whose draft model is the target itself: every greedy draft agrees."""
    tmp = tmp_path_factory.mktemp("draft")
    proc, endpoint, _ = start_worker(
        tmp, "--lanes", "2", "--ctx", "2048", "--draft-model", "default", name="draft"
    )
    yield endpoint
    stop_worker(proc)


def test_draft_model_speculation_matches_plain(drafted: str) -> None:
    with Client(drafted) as c:
        assert c.info()["draft_model"].endswith(".gguf")
        args = {"prompt": "The history of the Roman Empire", "max_tokens": 24, "ignore_eos": True}
        plain = _tokens(c, args)
        spec = _tokens(c, {**args, "speculative": {"mode": "draft_model", "max_draft": 4}})
        assert spec["speculative"]["drafted"] > 0
        # Same weights draft and verify: nearly every draft is accepted.
        assert spec["speculative"]["accepted"] >= spec["speculative"]["drafted"] // 2
        assert spec["tokens"] == plain["tokens"]
        with pytest.raises(SkiffError) as info:
            _tokens(c, {**args, "speculative": {"mode": "draft_model", "path": "/other.gguf"}})
        assert info.value.code == "unsupported"
        # A named session keeps drafting correctly across turns and trims.
        c.call(
            "generate",
            "multi",
            {
                "prompt": "One, two,",
                "max_tokens": 6,
                "stream": False,
                "speculative": {"mode": "draft_model"},
            },
        )
        c.trim("multi", 3)
        again = c.call(
            "generate",
            "multi",
            {
                "prompt": " three,",
                "max_tokens": 6,
                "stream": False,
                "speculative": {"mode": "draft_model"},
            },
        ).result
        assert again["usage"]["completion_tokens"] == 6
