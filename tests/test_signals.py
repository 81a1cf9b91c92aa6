"""Token signals and logprobs: equal to a numpy softmax over the same logits."""

from __future__ import annotations

import numpy as np

from protocol import Client
from worker.runtime.signals import logprobs_of, signal_of, window_summary


def _softmax_log(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


def test_signal_of_matches_numpy_softmax() -> None:
    row = np.random.default_rng(0).normal(size=4096).astype(np.float32) * 3
    sig = signal_of(row, 7)
    logp = _softmax_log(row)
    order = np.argsort(logp)[::-1]
    assert sig.top_token == order[0] and sig.second_token == order[1]
    assert np.isclose(sig.top_logprob, logp[order[0]])
    assert np.isclose(sig.entropy, -(np.exp(logp) * logp).sum())
    assert np.isclose(sig.margin, logp[order[0]] - logp[order[1]])
    assert row[order[0]] == row.max()  # the row is left as it was


def test_logprobs_of_sorted_top_k() -> None:
    row = np.array([0.0, 3.0, 1.0, 2.0], dtype=np.float32)
    out = logprobs_of(row, 2, 3)
    logp = _softmax_log(row)
    assert np.isclose(out["logprob"], logp[2])
    assert [t["token"] for t in out["top_logprobs"]] == [1, 3, 2]


def test_window_summary_counts() -> None:
    row = np.array([0.0, 5.0, 0.0], dtype=np.float32)
    flat = np.zeros(3, dtype=np.float32)
    history = [signal_of(row, 1), signal_of(flat, 1), signal_of(row, 2)]
    out = window_summary(history, 2, high_entropy=1.0)
    assert out["token_count"] == 2 and out["high_entropy_count"] == 1
    assert out["repetition_count"] == 0
    assert window_summary(history, 3)["repetition_count"] == 1
    assert np.isclose(out["max_entropy"], np.log(3))


def test_signal_over_the_socket_equals_numpy(client: Client) -> None:
    tokens = client.tokenize("The capital of France is")
    first = client.prefill_sampled("sig", tokens)["token"]
    reply = client.decode("sig", first, return_logits=True)
    row = reply.frame.array("logits")[0]
    sig = client.call("signal", "sig").result
    logp = _softmax_log(row)
    assert sig["token"] == reply.result["token"] == int(np.argmax(row))
    assert sig["top_token"] == int(np.argmax(row))
    assert np.isclose(sig["top_logprob"], logp.max(), atol=1e-5)
    assert np.isclose(sig["entropy"], -(np.exp(logp) * logp).sum(), atol=1e-4)
    second = np.sort(logp)[-2]
    assert np.isclose(sig["margin"], logp.max() - second, atol=1e-5)
    window = client.call("signal_window", "sig", {"window_tokens": 8}).result
    assert window["token_count"] == 2  # prefill_sampled + decode
    assert window["min_margin"] <= sig["margin"]


def test_generate_logprobs_in_events(client: Client) -> None:
    events = [
        r.header
        for r in client.generate(
            {
                "prompt": "The capital of France is",
                "max_tokens": 4,
                "logprobs": True,
                "top_logprobs": 3,
                "ignore_eos": True,
            }
        )
    ]
    tokens = [e for e in events if e.get("event") == "token"]
    assert len(tokens) == 4
    for e in tokens:
        top = e["top_logprobs"]
        assert len(top) == 3 and top[0]["logprob"] >= top[1]["logprob"] >= top[2]["logprob"]
        assert e["token"] == top[0]["token"]  # greedy
        assert np.isclose(e["logprob"], top[0]["logprob"])
        assert e["logprob"] <= 0
