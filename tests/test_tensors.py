"""Tensors on the wire against a real worker: outputs, embed, embeddings
input, echo, and session state export / import / migration."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import start_worker, stop_worker
from protocol import Client, SkiffError, frames

PROMPT = "The lighthouse keeper climbed the stairs every evening, and"


def _decode_n(
    client: Client, session: str, token: int, n: int, sampling: dict[str, Any] | None = None
) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        token = int(client.decode(session, token, sampling)["token"])
        out.append(token)
    return out


def _long_prompt(client: Client, n: int) -> list[int]:
    """``n`` tokens of varied text (the model must see more than its window)."""
    text = " ".join(
        f"Entry {i}: the {w} sailed past harbour {i * 7 % 31} at dawn."
        for i, w in enumerate(["ship", "boat", "ferry", "barge", "yacht", "raft"] * 40)
    )
    tokens = list(client.tokenize(text))
    assert len(tokens) >= n
    return tokens[:n]


# -- outputs -----------------------------------------------------------------------


def test_decode_outputs_hidden_and_logits(client: Client) -> None:
    tokens = client.tokenize(PROMPT)
    first = client.prefill_sampled("out", tokens)["token"]
    reply = client.decode("out", first, output=["hidden", "logits"])
    frame = reply.frame
    info = client.info()
    assert frame.identities == ("hidden", "logits")
    hidden, logits = frame.array("hidden"), frame.array("logits")
    assert hidden.shape == (1, info["model"]["n_embd"]) and hidden.dtype == np.float32
    assert logits.shape == (1, info["model"]["n_vocab"])
    assert int(np.argmax(logits[0])) == reply.result["token"]
    assert frame.positions == (len(tokens),)
    assert (frame.layer_start, frame.layer_end) == (0, info["model"]["n_layer"])
    assert np.isfinite(hidden).all() and np.linalg.norm(hidden) > 0


def test_prefill_output_every_row_and_limit(client: Client) -> None:
    tokens = client.tokenize(PROMPT)
    frame = client.prefill("rows", tokens, output=["hidden"]).frame
    assert frame.array("hidden").shape[0] == len(tokens)
    assert frame.positions == tuple(range(len(tokens)))
    # the last row equals what a decode-style output of that row gives: the
    # pooled "last" embedding of the same prompt
    last = client.embed(tokens=tokens, pooling="last").frame.array("embedding")
    np.testing.assert_allclose(frame.array("hidden")[-1], last, rtol=0, atol=1e-3)
    with pytest.raises(SkiffError) as err:
        client.prefill("rows2", list(range(100, 200)), output=["logits"])
    assert err.value.code == "bad_request" and "64" in err.value.message


def test_generate_stream_carries_a_frame_per_token(client: Client) -> None:
    events = list(
        client.stream("generate", None, {"prompt": PROMPT, "max_tokens": 4, "output": ["logits"]})
    )
    tokens = [e for e in events if e.header.get("event") == "token"]
    assert len(tokens) == 4
    for event in tokens:
        logits = event.frame.array("logits")
        assert logits.shape[0] == 1
        assert int(np.argmax(logits[0])) == event.header["token"]
        assert event.frame.positions == (event.header["position"] - 1,)


def test_embed_poolings_agree(client: Client) -> None:
    per_token = client.embed(text=PROMPT, pooling="none").frame
    hidden = np.array(per_token.array("hidden"))
    mean = client.embed(text=PROMPT, pooling="mean").frame.array("embedding")
    last = client.embed(tokens=client.tokenize(PROMPT), pooling="last").frame.array("embedding")
    assert hidden.shape == (len(client.tokenize(PROMPT)), client.info()["model"]["n_embd"])
    np.testing.assert_allclose(mean, hidden.mean(axis=0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(last, hidden[-1], rtol=0, atol=1e-5)
    with pytest.raises(SkiffError) as err:
        client.call("embed", "named", {"text": "x"})
    assert err.value.code == "bad_request"


# -- embeddings input ---------------------------------------------------------------


def _token_embeddings(model_path: str, tokens: list[int], n_embd: int) -> np.ndarray:
    """Rows of the GGUF's token embedding table, scaled as Gemma 3 scales
    token inputs (by sqrt(n_embd), in f32, as llama.cpp's graph does)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(model_path)
    table = next(t for t in reader.tensors if t.name == "token_embd.weight")
    rows = dequantize(np.asarray(table.data)[tokens], table.tensor_type)
    return (rows.astype(np.float32) * np.float32(np.sqrt(n_embd))).reshape(len(tokens), n_embd)


def test_embeddings_input_matches_token_input(client: Client, model_path: str) -> None:
    tokens = client.tokenize(PROMPT)
    n_embd = client.info()["model"]["n_embd"]
    embd = _token_embeddings(model_path, tokens, n_embd)
    by_tokens = client.prefill("by_tok", tokens, output=["logits"]).frame.array("logits")
    by_embd = client.prefill_embd("by_embd", embd, output=["logits"]).frame.array("logits")
    assert by_embd.shape == by_tokens.shape
    # Measured 0.0 (11- and 200-token prompts): llama.cpp dequantises the
    # same rows and scales by the same f32 sqrt(n_embd), so the rows that
    # reach layer 0 are bit-identical; the tolerance is therefore zero.
    np.testing.assert_array_equal(by_embd, by_tokens)
    assert int(np.argmax(by_embd[-1])) == int(np.argmax(by_tokens[-1]))
    # the sessions continue alike
    nxt = int(np.argmax(by_tokens[-1]))
    assert _decode_n(client, "by_tok", nxt, 4) == _decode_n(client, "by_embd", nxt, 4)


def test_embeddings_input_is_validated(client: Client) -> None:
    bad = np.zeros((3, 7), dtype=np.float32)
    with pytest.raises(SkiffError) as err:
        client.prefill_embd("bad_embd", bad)
    assert err.value.code == "bad_request" and "input.embd" in err.value.message
    n_embd = client.info()["model"]["n_embd"]
    nan = np.full((2, n_embd), np.nan, dtype=np.float32)
    with pytest.raises(SkiffError) as err:
        client.prefill_embd("bad_embd", nan)
    assert err.value.code == "bad_request" and "NaN" in err.value.message


# -- echo --------------------------------------------------------------------------


def test_echo_round_trips_a_frame(client: Client) -> None:
    hidden = np.arange(24, dtype=np.float32).reshape(4, 6)
    ids = np.arange(4, dtype=np.int32)
    frame = frames.make_frame(
        [("hidden", hidden, 0), ("ids", ids, 0)],
        producer_stage=2,
        layer_start=3,
        layer_end=9,
        positions=[10, 11, 12, 13],
    )
    back = client.echo(frame).frame
    np.testing.assert_array_equal(back.array("hidden"), hidden)
    np.testing.assert_array_equal(back.array("ids"), ids)
    assert (back.producer_stage, back.layer_start, back.layer_end) == (2, 3, 9)
    assert back.positions == (10, 11, 12, 13)


def test_malformed_frame_is_refused_naming_the_field(client: Client) -> None:
    frame = frames.make_frame([("hidden", np.zeros((2, 3), np.float32), 0)])
    buffers: list[Any] = []
    header = frames.attach(frame, buffers)
    header["parts"][0]["nbytes"] = 999
    with pytest.raises(SkiffError) as err:
        client.call("echo", None, {"frame": header}, buffers)
    assert err.value.code == "bad_request" and "nbytes" in err.value.message
    assert client.ping()["pong"]


# -- session state -----------------------------------------------------------------


def test_export_import_past_the_window_continues_identically(client: Client) -> None:
    tokens = _long_prompt(client, 700)  # past Gemma 3's 512-token sliding window
    first = client.prefill_sampled("orig", tokens)["token"]
    last = _decode_n(client, "orig", first, 8)[-1]
    exported = client.export_state("orig")
    meta = exported.result["session_state"]
    assert meta["position"] == 708 and len(meta["tokens"]) == 708
    assert len(meta["identity"]["model_sha256"]) == 64
    kv = exported.frame.array("kv_state")
    assert kv.dtype == np.uint8 and kv.nbytes > 0
    assert client.import_state("copy", exported) == 708
    assert _decode_n(client, "copy", last, 16) == _decode_n(client, "orig", last, 16)
    # llama.cpp restores only the last window of sliding-window cells: a
    # trim within reach re-decodes exactly; one below it is refused, not wrong
    assert client.trim("copy", 716) == 716 and client.trim("orig", 716) == 716
    again = client.decode("copy", 42)["token"]
    assert again == client.decode("orig", 42)["token"]
    with pytest.raises(SkiffError) as err:
        client.trim("copy", 300)
    assert err.value.code == "bad_request" and "sliding-window" in err.value.message
    assert client.trim("copy", 0) == 0


def test_import_refuses_bad_state_and_leaves_no_session(client: Client) -> None:
    tokens = client.tokenize(PROMPT)
    client.prefill("src", tokens)
    exported = client.export_state("src")
    before = client.stats()["lanes"]
    meta = dict(exported.result["session_state"])
    identity = dict(meta["identity"])
    identity["model_sha256"] = "0" * 64
    cases: list[tuple[dict[str, Any], list[Any], str]] = [
        ({**meta, "identity": identity}, exported.buffers, "model_sha256"),
        ({**meta, "position": meta["position"] + 1}, exported.buffers, "position"),
        ({**meta, "tokens": [-5, *meta["tokens"][1:]]}, exported.buffers, "tokens"),
    ]
    kv = bytes(exported.buffers[0])
    truncated = frames.make_frame([("kv_state", np.frombuffer(kv[: len(kv) // 2], np.uint8), -1)])
    for sess_meta, buffers, field in cases:
        with pytest.raises(SkiffError) as err:
            client.call(
                "import_state",
                "dst",
                {"session_state": sess_meta, "frame": exported.result["frame"]},
                buffers,
            )
        assert err.value.code == "bad_request" and field in err.value.message
    bufs: list[Any] = []
    header = frames.attach(truncated, bufs)
    with pytest.raises(SkiffError) as err:
        client.call("import_state", "dst", {"session_state": meta, "frame": header}, bufs)
    assert err.value.code == "bad_request"
    assert all(s["session"] != "dst" for s in client.stats()["sessions"])
    assert client.stats()["lanes"]["active"] == before["active"]
    # the lane a refused import used is clean: a new session there starts at 0
    assert client.prefill("dst", tokens) == len(tokens)


@pytest.fixture(scope="module")
def second_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Another worker with the shared worker's cache layout (2048 cells a lane)."""
    tmp: Path = tmp_path_factory.mktemp("second")
    proc, endpoint, _ = start_worker(tmp, "--lanes", "2", "--ctx", "4096", name="b")
    yield endpoint
    stop_worker(proc)


def test_migrate_greedy_session_between_workers(client: Client, second_worker: str) -> None:
    tokens = _long_prompt(client, 720)
    first = client.prefill_sampled("mig", tokens)["token"]
    last = _decode_n(client, "mig", first, 8)[-1]
    client.import_state("mig_copy", client.export_state("mig"))  # stays on A
    with Client(second_worker, timeout_ms=60_000) as b:
        assert client.migrate("mig", b) == 728
        assert all(s["session"] != "mig" for s in client.stats()["sessions"])
        on_b = _decode_n(b, "mig", last, 16)
        b.drop("mig")
    assert on_b == _decode_n(client, "mig_copy", last, 16)


def test_migrate_seeded_sampled_session(client: Client, second_worker: str) -> None:
    sampling = {"temperature": 0.9, "seed": 1234, "repeat_penalty": 1.2, "top_k": 60}
    tokens = client.tokenize(PROMPT)
    first = client.prefill_sampled("smp", tokens, sampling)["token"]
    last = _decode_n(client, "smp", first, 8, sampling)[-1]
    exported = client.export_state("smp")
    assert exported.result["session_state"]["sampler"]["runs"] >= 8
    with Client(second_worker, timeout_ms=60_000) as b:
        b.import_state("smp", exported)
        on_b = _decode_n(b, "smp", last, 16, sampling)
        b.drop("smp")
    on_a = _decode_n(client, "smp", last, 16, sampling)
    assert on_b == on_a
    assert len(set(on_a)) > 3  # really sampled, not a greedy rut


def test_import_across_lane_counts_and_refusal_when_it_cannot_fit(
    client: Client, tmp_path: Path
) -> None:
    tokens = _long_prompt(client, 600)
    first = client.prefill_sampled("lay", tokens)["token"]
    exported = client.export_state("lay")
    assert exported.result["session_state"]["layout"]["kv_streams"] == 8
    # 3 lanes of 1024 cells: a 600-token session loads (3 KV streams, not 8)
    proc, endpoint, _ = start_worker(tmp_path, "--lanes", "3", "--ctx", "3072", name="c")
    try:
        with Client(endpoint, timeout_ms=60_000) as c:
            assert c.import_state("lay", exported) == 600
            assert _decode_n(c, "lay", first, 6) == _decode_n(client, "lay", first, 6)
            client.prefill("lay2", _long_prompt(client, 1500))
            with pytest.raises(SkiffError) as err:
                c.import_state("lay2", client.export_state("lay2"))
            assert err.value.code == "bad_request" and "tokens" in err.value.message
            assert c.stats()["lanes"]["active"] == 1
    finally:
        stop_worker(proc)


def test_batch_ops_return_one_row_per_sampled_entry(client: Client) -> None:
    a, b = client.tokenize(PROMPT), client.tokenize("Once upon a time")
    ta = client.prefill_sampled("ba", a)["token"]
    tb = client.prefill_sampled("bb", b)["token"]
    reply = client.decode_batch(
        [{"session": "ba", "token": ta}, {"session": "bb", "token": tb}], output=["hidden"]
    )
    frame = reply.frame
    assert frame.array("hidden").shape == (2, client.info()["model"]["n_embd"])
    assert frame.sequence_count == 2 and frame.positions == (len(a), len(b))
    reply = client.call(
        "iteration_batch",
        None,
        {
            "requests": [
                {"session": "ba", "tokens": [reply.result["tokens"][0]]},
                {"session": "bb", "tokens": [5, 6, 7], "phase": "prefill"},
            ],
            "output": ["logits"],
        },
    )
    logits = reply.frame.array("logits")
    assert logits.shape[0] == 1  # only the decode entry samples
    assert int(np.argmax(logits[0])) == reply.result["samples"][0]["token"]
