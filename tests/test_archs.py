"""Every architecture a user brings (issue 24): llama, qwen2, qwen3, qwen3moe.

``scripts/make_models.py --arch A`` writes a small random-weight model of
each, with its family's tokenizer markers and chat template and no sliding
window (docs/models.md). For each architecture in turn (a module fixture
parametrized over them: one architecture's processes run at a time) three
servers start on its model:

- ``whole``: a worker with the prefix cache, 4 lanes of 1024 cells;
- ``cold``: a worker of another layout without the cache, 2 lanes of 1024
  cells: the reference for cold prefills and the target of migrations;
- ``chain``: a 2-stage chain, layers 0:2 and 2:4, served from stage 0.

Every op runs on each, and every exactness claim is checked by logits (max
abs difference exactly 0.0, under the row rule in force: ``info.cpu``):
batched vs alone, chain vs one worker, migrated vs not, prefix reuse (the
whole prompt again, a shared prefix, an imported session's lane) vs cold.
Without a sliding window no window guard applies: an imported session of
600 tokens (past Gemma 3's 512) trims to any position and its lane is
reused; the same on Gemma 3 is refused (tests/test_exactness_session.py).
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import ROOT, decode_run, greedy_run, start_chain, start_worker, stop_worker
from conftest import tidy_client as tidy
from protocol import Client
from worker.chain.setup import plan_stage
from worker.config import parse
from worker.slice.slicer import ALLOWED_ARCHS
from worker.slice.slicer import main as slice_main

ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe")
STEPS = 4  # greedy decode steps compared per claim
LONG = 600  # past Gemma 3's 512-token window: nothing limits a model without one
TEXT = " ".join(f"Note {i}: the tide reached marker {i * 11 % 37} at noon." for i in range(120))
# The prompt each family's template must render for one user message, with its
# own markers (scripts/make_models.py); written out here, not taken from the
# template, so a template that renders otherwise fails.
RENDERED = {
    "llama": "<bos><|start_header_id|>user<|end_header_id|>\n\nName three colours.<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "qwen": "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
}

Run = tuple[list[int], np.ndarray]  # greedy tokens and every step's logits


@dataclass(frozen=True)
class Arch:
    name: str
    model: str
    whole: str  # endpoints
    cold: str
    chain: str  # stage 0


@pytest.fixture(scope="module", params=ARCHS)
def arch(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Arch]:
    name: str = request.param
    made = subprocess.run(
        [sys.executable, "scripts/make_models.py", "--arch", name, "--print-path"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    model = made.stdout.strip()
    tmp = tmp_path_factory.mktemp(name)
    # One thread: a 4-layer model's rows are too small to share, and two
    # threads' barriers cost ~40x the arithmetic on a busy 2-core machine
    # (a 100-token prefill: 0.95 s vs 0.02 s, measured at load 6).
    model_args = ("--model", model, "--threads", "1")
    small = (*model_args, "--lanes", "2", "--ctx", "2048")
    with contextlib.ExitStack() as stack:
        # No restart at start-up (huge pages, a stage's OpenMP spin count:
        # edge/memory.py): nothing here needs them, and each is a second start.
        with pytest.MonkeyPatch.context() as env, ThreadPoolExecutor(3) as pool:
            env.setenv("SKIFF_NO_REEXEC", "1")
            # started together; each stopped when the module is done
            chain = pool.submit(stack.enter_context, start_chain(tmp, ["0:2", "2:4"], *small))
            whole = pool.submit(
                stack.enter_context,
                _serving(tmp, *model_args, "--lanes", "4", "--ctx", "4096", name="whole"),
            )
            cold = pool.submit(
                stack.enter_context, _serving(tmp, *small, "--prefix-cache", "0", name="cold")
            )
        yield Arch(name, model, whole.result(), cold.result(), chain.result()[0])


@contextlib.contextmanager
def _serving(tmp: Path, *args: str, name: str) -> Iterator[str]:
    proc, endpoint, _ = start_worker(tmp, *args, name=name)
    try:
        yield endpoint
    finally:
        stop_worker(proc)


def _prompt(client: Client, tag: str, n: int) -> list[int]:
    """``n`` tokens led by ``tag``: no two prompts share the 8 leading tokens
    a prefix hit needs unless a test makes them."""
    tokens: list[int] = client.tokenize(f"[{tag}] {TEXT}")
    assert len(tokens) >= n
    return tokens[:n]


def _same(what: str, got: Run, want: Run) -> None:
    """Rows equal to the bit (first: the more telling), then the tokens."""
    assert got[1].shape == want[1].shape, f"{what}: shapes {got[1].shape} != {want[1].shape}"
    diffs = [float(np.max(np.abs(g - w))) for g, w in zip(got[1], want[1], strict=True)]
    assert max(diffs) == 0.0, f"{what}: max |logit difference| per step {diffs}"
    assert got[0] == want[0], f"{what}: tokens {got[0]} != {want[0]}"


def _rows(reply: Any) -> np.ndarray:
    return np.array(reply.frame.array("logits"), dtype=np.float32)


# -- the model and its description ------------------------------------------------------


def test_info_describes_the_model(arch: Arch) -> None:
    with Client(arch.whole) as c:
        info = c.info()
        logits = _rows(c.prefill("finite", _prompt(c, "finite", 20), output=["logits"]))
        c.drop("finite")
    model = info["model"]
    assert model["architecture"] == arch.name
    assert model["sliding_window"] == 0
    assert model["tied_head"] is (arch.name == "qwen3")  # qwen3 ties, as Qwen3 0.6B
    assert model["has_chat_template"] is True and info["chat_template"]["source"] == "model"
    assert model["n_ctx_train"] == 8192 and model["n_layer"] == 4
    assert info["cpu"]["batch_invariant"] is True  # the row rule the claims below hold under
    assert logits.shape == (20, model["n_vocab"]) and np.isfinite(logits).all()
    with Client(arch.chain) as c:
        # stage 0's slice has no output.weight whatever the model: read from the source
        assert c.info()["model"]["tied_head"] is model["tied_head"]


def test_info_describes_gemma(client: Client) -> None:
    info = client.info()
    model = info["model"]
    assert model["architecture"] == "gemma3" and model["sliding_window"] == 512
    assert model["tied_head"] is True  # no output.weight: the head is token_embd
    # the packaged GGUF carries no template: the worker falls back to Gemma's turns
    assert model["has_chat_template"] is False and info["chat_template"]["source"] == "fallback"


def test_a_two_stage_split_validates(arch: Arch, capsys: pytest.CaptureFixture[str]) -> None:
    """``skiff-slice --validate`` on both stages of the chain's split (in
    process: each compares every layer's output of the slice with the model's)."""
    for layers in ("0:2", "2:4"):
        assert slice_main([arch.model, "--validate", layers]) == 0, capsys.readouterr().err
        assert "OK: every layer identical" in capsys.readouterr().out


def test_the_slicer_refuses_an_untested_architecture_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import gguf

    assert set(ARCHS) < set(ALLOWED_ARCHS)
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(2)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    refusal = f"architecture 'gpt2' is not on the tested list {list(ALLOWED_ARCHS)}"
    assert slice_main([str(path), "--layers", "0:1", "-o", str(tmp_path / "out.gguf")]) == 2
    assert refusal in capsys.readouterr().err
    assert not (tmp_path / "out.gguf").exists()
    # a stage refuses to start, before hashing or slicing anything
    with pytest.raises(SystemExit, match=re.escape(f"skiff-worker: {refusal}")):
        plan_stage(parse(["--model", str(path), "--layers", "0:1"]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2.gguf"]


# -- ops ---------------------------------------------------------------------------------


def test_prefill_hidden_rows_are_what_embed_pools(arch: Arch) -> None:
    with tidy(arch.whole) as c:
        tokens = _prompt(c, "embed", 40)
        hidden = np.array(c.prefill("rows", tokens, output=["hidden"]).frame.array("hidden"))
        per_token = np.array(c.embed(tokens=tokens, pooling="none").frame.array("hidden"))
        mean = np.array(c.embed(tokens=tokens, pooling="mean").frame.array("embedding"))
    assert hidden.shape == (40, 128) and np.isfinite(hidden).all()
    np.testing.assert_array_equal(per_token, hidden)  # a throwaway session, the same rows
    np.testing.assert_allclose(mean, hidden.mean(axis=0), rtol=1e-5, atol=1e-6)


def test_batches_equal_each_session_alone(arch: Arch) -> None:
    """Three sessions alone on the cold worker, then together on the whole
    one: an ``iteration_batch`` (two first decodes beside the third's whole
    prompt), then ``decode_batch`` rounds; each fed its own alone tokens."""
    with tidy(arch.whole) as c, tidy(arch.cold) as cold:
        prompts = [_prompt(c, f"batch{i}", n) for i, n in enumerate((30, 57, 90))]
        alone = [greedy_run(cold, "alone", p, STEPS) for p in prompts]
        names = ["b0", "b1", "b2"]
        for name, p, run in zip(names[:2], prompts, alone, strict=False):
            assert c.prefill_sampled(name, p)["token"] == run[0][0]
        first = [
            {"session": n, "tokens": [alone[i][0][0]], "phase": "decode"}
            for i, n in enumerate(names[:2])
        ]
        prefill = {"session": "b2", "tokens": prompts[2], "phase": "prefill", "sample_last": True}
        reply = c.call(
            "iteration_batch", None, {"requests": [*first, prefill], "output": ["logits"]}
        )
        samples = [s["token"] for s in reply.result["samples"]]
        assert samples == [alone[0][0][1], alone[1][0][1], alone[2][0][0]]
        rows: list[list[np.ndarray]] = [[r] for r in _rows(reply)[:2]] + [[]]
        sampled: list[list[int]] = [[alone[i][0][0], samples[i]] for i in range(2)]
        sampled.append([samples[2]])
        while any(len(r) < STEPS for r in rows):
            todo = [i for i in range(3) if len(rows[i]) < STEPS]
            entries = [{"session": names[i], "token": alone[i][0][len(rows[i])]} for i in todo]
            batch = c.decode_batch(entries, output=["logits"])
            for j, i in enumerate(todo):
                rows[i].append(_rows(batch)[j])
                sampled[i].append(int(batch.result["tokens"][j]))
    for i in range(3):
        _same(f"session {i} batched", (sampled[i], np.stack(rows[i])), alone[i])


def test_verify_predicts_plain_decoding(arch: Arch) -> None:
    """Spans of 8 drafts, all right and then the fifth wrong: the predictions
    are plain decoding's greedy tokens and the decode after gives its row."""
    with tidy(arch.whole) as c, tidy(arch.cold) as cold:
        p = _prompt(c, "verify", 50)
        plain = greedy_run(cold, "plain", p, 10)
        t = plain[0]
        assert c.prefill_sampled("v", p)["token"] == t[0]
        for wrong_at in (None, 4):
            drafts = list(t[1:9])
            if wrong_at is not None:
                drafts[wrong_at] = (drafts[wrong_at] + 1) % c.info()["model"]["n_vocab"]
            accepted = 8 if wrong_at is None else wrong_at
            got = c.call("verify", "v", {"tokens": [t[0], *drafts]}).result
            assert got["predicted"][: accepted + 1] == t[1 : accepted + 2]
            assert got["accepted"] == accepted and got["position"] == 50 + 1 + accepted
            after = c.decode("v", got["predicted"][accepted], output=["logits"])
            assert after.result["token"] == t[accepted + 2]
            assert float(np.max(np.abs(_rows(after)[0] - plain[1][accepted + 1]))) == 0.0
            c.trim("v", 50)


def test_signals_describe_the_row(arch: Arch) -> None:
    with tidy(arch.whole) as c:
        first = c.prefill_sampled("sig", _prompt(c, "signal", 30))["token"]
        tokens, rows = decode_run(c, "sig", first, 3)
        sig = c.call("signal", "sig").result
        window = c.call("signal_window", "sig", {"window_tokens": 4}).result
    logp = rows[-1].astype(np.float64) - np.logaddexp.reduce(rows[-1].astype(np.float64))
    top2 = np.argsort(logp)[::-1][:2]
    assert sig["token"] == tokens[-1] == sig["top_token"] == int(top2[0])
    assert sig["second_token"] == int(top2[1])
    assert sig["entropy"] == pytest.approx(float(-(np.exp(logp) * logp).sum()), rel=1e-4)
    assert sig["margin"] == pytest.approx(float(logp[top2[0]] - logp[top2[1]]), rel=1e-4)
    assert window["token_count"] == 4  # the prefill's sampled token and three decodes


def test_generate_and_chat_with_the_models_template(arch: Arch) -> None:
    family = "llama" if arch.name == "llama" else "qwen"
    messages = [{"role": "user", "content": "Name three colours."}]
    with Client(arch.whole) as c, tidy(arch.cold) as cold:
        rendered = c.tokenize(RENDERED[family], add_special=False, parse_special=True)
        marker = "<|eot_id|>" if family == "llama" else "<|im_start|>"
        assert len(c.tokenize(marker, add_special=False, parse_special=True)) == 1
        reference = greedy_run(cold, "ref", rendered, 5)[0]
        args: dict[str, Any] = {"max_tokens": 6, "ignore_eos": True}
        chat = c.chat(messages, **args)
        assert chat["usage"]["prompt_tokens"] == len(rendered) and chat["tokens"] == reference
        events = list(c.generate({**args, "tokens": rendered}))
        streamed = [e.header["token"] for e in events if e.header.get("event") == "token"]
        assert streamed == reference and events[-1].header["done"] is True
        # the template's end of turn is the model's stop: forced, it ends the turn
        eos = c.info()["model"]["eos"]
        forced = c.chat(
            messages, max_tokens=6, sampling={"logit_bias": [{"token": eos, "bias": 1e4}]}
        )
        assert forced["finish_reason"] == "stop" and forced["tokens"] == []


# -- exactness ---------------------------------------------------------------------------


def test_a_chain_equals_one_worker(arch: Arch) -> None:
    with Client(arch.chain) as chain, tidy(arch.cold) as cold:
        p = _prompt(cold, "chain", 100)
        _same("chain", greedy_run(chain, "c", p, STEPS), greedy_run(cold, "c", p, STEPS))


def test_a_migrated_session_continues_and_trims_anywhere(arch: Arch) -> None:
    """Moved past where Gemma 3's window would floor a trim (its imported
    state holds only the last 512 windowed cells): here every cell travels."""
    with tidy(arch.whole) as w, tidy(arch.cold) as cold:
        p = _prompt(w, "migrate", LONG)
        reference = greedy_run(cold, "ref", p, STEPS)
        first = w.prefill_sampled("m", p)["token"]
        assert w.migrate("m", to=cold) == LONG
        _same("migrated", decode_run(cold, "m", first, STEPS), reference)
        assert cold.trim("m", 8) == 8
        assert cold.prefill_sampled("m", p[8:])["token"] == first
        _same("trimmed to 8 and re-prefilled", decode_run(cold, "m", first, STEPS), reference)


def test_prefix_reuse_equals_a_cold_prefill(arch: Arch) -> None:
    """The whole prompt again (all but its last token reused), a prompt that
    shares 60 tokens, and the lane of an imported 600-token session (no window
    guard refuses it): each equal to a cold prefill to the bit."""
    with tidy(arch.whole) as w, tidy(arch.cold) as cold:
        p = _prompt(w, "reuse", 100)
        q = p[:60] + w.tokenize(" A different ending, then more text.", add_special=False)
        r = _prompt(w, "imported", LONG)
        cold_p, cold_q, cold_r = (greedy_run(cold, "cold", x, STEPS) for x in (p, q, r))
        cold.prefill("exp", r)
        w.import_state("imp", cold.export_state("exp"))
        w.drop("imp")  # its lane keeps the imported cells and tokens
        before = w.stats()["prefix_cache"]
        _same("first prefill", greedy_run(w, "w1", p, STEPS), cold_p)
        _same("exact reuse", greedy_run(w, "w2", p, STEPS), cold_p)
        _same("shared prefix", greedy_run(w, "w3", q, STEPS), cold_q)
        _same("imported lane", greedy_run(w, "w4", r, STEPS), cold_r)
        after = w.stats()["prefix_cache"]
    assert after["hits"] - before["hits"] == 3
    assert after["reused_tokens"] - before["reused_tokens"] == 99 + 60 + LONG - 1
    assert after["refused_window"] == before["refused_window"]
