"""verify and prompt-lookup speculation: exact acceptance, same output."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import start_worker, stop_worker
from protocol import Client, SkiffError
from worker.runtime import Session
from worker.runtime.steps import NgramIndex, PromptLookup, accept

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
PROMPT = f"Python code:\n{CODE}\nThe same code again:\n"
LOOKUP = {"mode": "prompt_lookup", "max_draft": 8, "ngram": 3}
OFF = {"mode": "off"}


def lookup_draft(history: Sequence[int], ngram: int, max_draft: int) -> list[int]:
    """Prompt lookup by a full rescan: what ``NgramIndex`` must draft.

    The tokens that followed the latest earlier match of the last n-gram;
    negative ids (positions without a token) neither match nor are drafted.
    """
    n = len(history)
    if max_draft <= 0 or n <= ngram:
        return []
    key = list(history[n - ngram :])
    if min(key) < 0:
        return []
    for start in range(n - ngram - 1, -1, -1):
        if list(history[start : start + ngram]) == key:
            follow = list(history[start + ngram : start + ngram + max_draft])
            cut = next((i for i, t in enumerate(follow) if t < 0), len(follow))
            return follow[:cut]
    return []


def test_prompt_lookup_proposes_what_followed_the_last_ngram() -> None:
    history = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    for ngram, max_draft, want in ((3, 8, [4, 5, 9, 1, 2, 3]), (3, 2, [4, 5])):
        assert lookup_draft(history, ngram, max_draft) == want
        assert NgramIndex(ngram).draft(history, max_draft) == want
    for history, ngram, want in (([1, 2, 3], 3, []), ([7, 8, 7, 8], 2, [7, 8])):
        assert lookup_draft(history, ngram, 4) == want
        assert NgramIndex(ngram).draft(history, 4) == want


# A history that grows by a few tokens and loses a few (rejected drafts) per call.
_EDITS = st.lists(
    st.tuples(st.integers(0, 6), st.lists(st.integers(-1, 3), max_size=9)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(start=st.lists(st.integers(-1, 3), max_size=30), edits=_EDITS, ngram=st.integers(1, 4))
def test_the_ngram_index_drafts_what_a_rescan_drafts(
    start: list[int], edits: list[tuple[int, list[int]]], ngram: int
) -> None:
    index = NgramIndex(ngram, slack=16)
    history = list(start)
    for cut, grow in edits:
        del history[max(0, len(history) - cut) :]
        history.extend(grow)
        for max_draft in (8, 2):
            assert index.draft(history, max_draft) == lookup_draft(history, ngram, max_draft)


def _session(tokens: list[int]) -> Session:
    session = Session("s", 0)
    session.tokens = tokens
    return session


def test_automatic_lookup_drafts_only_while_few_streams_decode() -> None:
    lookup = PromptLookup(ngram=2, max_draft=4, max_streams=2)
    session = _session([5, 6, 7, 8, 9, 5])
    assert lookup.draft(session, 6, 8, streams=3) == []  # crowded: extra rows cost
    assert lookup.draft(session, 6, 8, streams=2) == [7, 8, 9, 5]
    asked = PromptLookup(ngram=2, max_draft=4)  # asked for: drafts whatever the load
    assert asked.draft(session, 6, 8, streams=8) == [7, 8, 9, 5]


def _drafts(lookup: PromptLookup, calls: int, keep: bool) -> list[bool]:
    """Whether each call drafted, the target keeping or refusing every draft."""
    tokens, drafted, out = [5, 6, 6, 5], [5], []
    for _ in range(calls):
        # the token after the last draft's start: its first token, or another
        nxt = drafted[0] if keep else (6 if drafted == [5] else 5)
        got = lookup.draft(_session(list(tokens)), nxt, 8)
        out.append(bool(got))
        tokens.append(nxt)
        drafted = got or drafted
    return out


def test_automatic_lookup_rests_longer_after_each_refused_draft() -> None:
    auto = PromptLookup(ngram=1, max_draft=1, max_streams=1)
    T, F = True, False
    assert _drafts(auto, 11, keep=False) == [T, F, T, F, F, T, F, F, F, F, T]
    kept = PromptLookup(ngram=1, max_draft=1, max_streams=1)
    assert _drafts(kept, 6, keep=True) == [T] * 6  # a kept draft: no rest
    asked = PromptLookup(ngram=1, max_draft=1)  # asked for: never rests
    assert _drafts(asked, 6, keep=False) == [T] * 6


def test_automatic_drafts_grow_while_kept_whole_and_shrink_to_what_was_kept() -> None:
    cycle = list(range(1, 21))
    lookup = PromptLookup(ngram=2, max_draft=16, max_streams=1)
    tokens = cycle * 3
    sizes = []
    for keep_all in (True, True, True, True, False):
        nxt = tokens[-20]  # what followed the same place one cycle back
        drafted = lookup.draft(_session(list(tokens)), nxt, 32)
        sizes.append(len(drafted))
        kept = drafted if keep_all else drafted[:2]
        tokens += [nxt, *kept, 99 if not keep_all else tokens[len(tokens) - 19 + len(kept)]]
    assert sizes == [4, 8, 16, 16, 16]
    lookup.draft(_session(list(tokens)), tokens[-20], 32)
    assert lookup.size == 3  # 2 of the last draft kept: the next is 3 long


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
    plain = _tokens(client, {**args, "speculative": OFF})
    assert "speculative" not in plain  # asked for none: nothing drafted
    spec = _tokens(client, {**args, "speculative": LOOKUP})
    assert spec["speculative"]["drafted"] > 0 and spec["speculative"]["accepted"] > 0
    auto = _tokens(client, args)  # asked nothing: the worker's --speculate auto, one stream
    assert auto["speculative"]["drafted"] > 0 and auto["speculative"]["accepted"] > 0
    # Every row of a span scores exactly as in plain decoding (rows are
    # batch-invariant): greedy and seeded outputs are identical.
    assert spec["tokens"] == plain["tokens"] == auto["tokens"]


def test_automatic_speculation_leaves_the_cells_plain_decoding_leaves(client: Client) -> None:
    """Past the 512-token window: a session generated with the worker's own
    drafts (the refused ones trimmed away) and one generated plainly score
    the next token with equal logits, to the bit."""
    prompt = client.tokenize(PROMPT * 16)
    assert len(prompt) > 560
    args: dict[str, Any] = {"tokens": prompt, "max_tokens": 40, "ignore_eos": True}
    plain = client.call("generate", "plain", {**args, "speculative": OFF, "stream": False})
    auto = client.call("generate", "auto", {**args, "stream": False})
    assert auto.result["speculative"]["accepted"] > 0
    assert auto.result["tokens"] == plain.result["tokens"]
    last = plain.result["tokens"][-1]
    a = client.decode("auto", last, return_logits=True)
    b = client.decode("plain", last, return_logits=True)
    assert a.result["position"] == b.result["position"] == len(prompt) + 40
    diff = np.abs(a.frame.array("logits") - b.frame.array("logits")).max()
    assert diff == 0.0


def test_outputs_turn_the_automatic_drafts_off(client: Client) -> None:
    reply = _tokens(client, {"prompt": PROMPT, "max_tokens": 4, "output": ["logits"]})
    assert "speculative" not in reply and len(reply["tokens"]) == 4
    with pytest.raises(SkiffError) as info:
        _tokens(
            client, {"prompt": "x", "max_tokens": 2, "output": ["logits"], "speculative": LOOKUP}
        )
    assert info.value.code == "unsupported"


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
