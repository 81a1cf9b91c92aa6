"""skiff-loadtest: the summary maths and arrivals exactly, then one small real run."""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, start_worker, stop_worker
from loadtest import (
    LoadConfig,
    RequestRecord,
    builtin_prompts,
    distribution,
    load_prompts,
    make_text,
    percentile,
    poisson_arrivals,
    run_load,
    summarize,
)
from loadtest.cli import build_parser, config_from_args
from loadtest.report import format_table
from loadtest.stats import timeline

# -- percentiles and distributions ------------------------------------------------


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 99.9, 100])
def test_percentile_matches_numpy_linear(q: float) -> None:
    values = list(np.random.default_rng(7).lognormal(3, 1, size=257))
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


def test_percentile_small_cases() -> None:
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0], 50) == 1.5
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5  # order of input does not matter
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution_scales_and_handles_empty() -> None:
    d = distribution([0.001, 0.002, 0.003, 0.004], scale=1e3)
    assert d["n"] == 4
    assert d["mean"] == pytest.approx(2.5)
    assert d["min"] == pytest.approx(1.0)
    assert d["max"] == pytest.approx(4.0)
    assert d["p50"] == pytest.approx(2.5)
    assert d["p90"] == pytest.approx(3.7)
    assert d["p99"] == pytest.approx(3.97)
    empty = distribution([])
    assert empty["n"] == 0
    assert all(empty[k] is None for k in ("mean", "min", "p50", "p90", "p99", "max"))


# -- Poisson arrivals ---------------------------------------------------------------


def test_poisson_arrivals_are_seeded_and_increasing() -> None:
    a = poisson_arrivals(5.0, n=200, seed=3)
    assert a == poisson_arrivals(5.0, n=200, seed=3)
    assert a != poisson_arrivals(5.0, n=200, seed=4)
    assert len(a) == 200
    assert all(0 < x < y for x, y in itertools.pairwise(a))


def test_poisson_arrivals_have_exponential_gaps() -> None:
    rate = 4.0
    a = np.array(poisson_arrivals(rate, n=20_000, seed=11))
    gaps = np.diff(np.concatenate([[0.0], a]))
    # Exponential: mean = std = 1/rate; P(gap > mean) = 1/e. Seeded, so exact each run.
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() == pytest.approx(1 / rate, rel=0.05)
    assert float((gaps > 1 / rate).mean()) == pytest.approx(np.exp(-1), abs=0.01)


def test_poisson_arrivals_bounds() -> None:
    d = poisson_arrivals(10.0, duration=3.0, seed=1)
    assert d and d[-1] < 3.0
    assert 15 < len(d) < 50  # about rate * duration = 30
    both = poisson_arrivals(10.0, n=5, duration=100.0, seed=1)
    assert len(both) == 5
    assert poisson_arrivals(10.0, n=1000, duration=0.5, seed=1)[-1] < 0.5
    with pytest.raises(ValueError):
        poisson_arrivals(1.0, seed=1)
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, n=3)


# -- the summary ---------------------------------------------------------------------


def _records() -> list[RequestRecord]:
    ok1 = RequestRecord(
        index=0,
        t_send=0.0,
        t_first=0.1,
        t_end=0.45,
        token_times=[0.1, 0.2, 0.3, 0.4],
        n_tokens=4,
        prompt_tokens=10,
        finish_reason="length",
        server_timings={"ttft_ms": 90.0},
    )
    ok2 = RequestRecord(
        index=1,
        t_send=0.5,
        t_first=0.8,
        t_end=1.0,
        token_times=[0.8, 0.9],
        n_tokens=2,
        prompt_tokens=20,
        finish_reason="stop",
        server_timings={"ttft_ms": 250.0},
    )
    failed = RequestRecord(
        index=2, t_send=1.0, t_first=1.5, t_end=1.6, token_times=[1.5], n_tokens=1
    )
    failed.error = "deadline_exceeded"
    busy = RequestRecord(index=3, t_send=1.0, t_end=1.01, error="queue_full")
    return [ok1, ok2, failed, busy]


def test_summarize_counts_and_latencies() -> None:
    s = summarize(_records(), wall_s=2.0, config={"mode": "closed", "concurrency": 2})
    assert s["requests"] == {
        "sent": 4,
        "ok": 2,
        "errors": 2,
        "error_codes": {"deadline_exceeded": 1, "queue_full": 1},
        "finish_reasons": {"length": 1, "stop": 1},
    }
    assert s["tokens"] == {"output": 7, "prompt": 30}
    assert s["throughput"]["output_tok_s"] == pytest.approx(3.5)
    assert s["throughput"]["requests_per_s"] == pytest.approx(1.0)
    # Latencies over completed requests only.
    assert s["ttft_ms"]["n"] == 2
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["e2e_ms"]["max"] == pytest.approx(500.0)
    assert s["e2e_ms"]["min"] == pytest.approx(450.0)
    assert s["itl_ms"]["n"] == 4  # 3 gaps + 1 gap
    assert s["itl_ms"]["mean"] == pytest.approx(100.0)
    assert s["tpot_ms"]["n"] == 2
    assert s["server_timings_ms"]["ttft_ms"]["mean"] == pytest.approx(170.0)
    assert sorted(s["samples"]["ttft_ms"]) == pytest.approx([100.0, 300.0])
    assert s["config"]["concurrency"] == 2
    json.dumps(s)  # JSON-ready


def test_summarize_of_nothing() -> None:
    s = summarize([], wall_s=0.0)
    assert s["requests"]["sent"] == 0
    assert s["throughput"]["output_tok_s"] == 0.0
    assert s["ttft_ms"]["p50"] is None
    assert "TTFT" in format_table(s)


def test_cancelled_finish_counts_as_error() -> None:
    from loadtest.runner import _absorb_final

    rec = RequestRecord(index=0)
    _absorb_final(rec, {"done": True, "finish_reason": "cancelled", "usage": {}})
    assert rec.error == "cancelled"
    rec = RequestRecord(index=1)
    final = {"result": {"finish_reason": "length", "usage": {"prompt_tokens": 3}}}
    _absorb_final(rec, final)
    assert rec.ok and rec.prompt_tokens == 3 and rec.finish_reason == "length"


def test_timeline_bins_hold_every_token() -> None:
    recs = _records()
    tl = timeline(recs, wall_s=2.0, bin_s=0.5)
    assert tl["t_s"] == [0.0, 0.5, 1.0, 1.5]
    counts = [v * tl["bin_s"] for v in tl["output_tok_s"]]
    assert counts == pytest.approx([4, 2, 0, 1])


def test_format_table_lists_figures() -> None:
    text = format_table(summarize(_records(), wall_s=2.0, config={"mode": "closed"}))
    for word in ("TTFT", "ITL", "E2E", "p99", "3.5 output tok/s", "deadline_exceeded=1"):
        assert word in text


# -- prompts and configuration ----------------------------------------------------


def test_builtin_prompts_are_deterministic_and_varied() -> None:
    a = builtin_prompts()
    assert a == builtin_prompts()
    lengths = [len(p.split()) for p in a[:4]]
    assert lengths == sorted(lengths) and lengths[0] < 15 and lengths[-1] > 300
    assert len(set(a)) == len(a)
    assert make_text(50, seed=1) == make_text(50, seed=1) != make_text(50, seed=2)
    assert len(make_text(50, seed=1).split()) == 50


def test_load_prompts_lines_and_jsonl(tmp_path: Path) -> None:
    plain = tmp_path / "p.txt"
    plain.write_text("first prompt\n\nsecond one\n")
    assert load_prompts(plain) == ["first prompt", "second one"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a b"}\n{"tokens": [2, 3]}\n')
    assert load_prompts(jsonl) == ["a b", [2, 3]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="prompt"):
        load_prompts(bad)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(ValueError):
        load_prompts(empty)


def test_config_validation_and_cli_defaults() -> None:
    with pytest.raises(ValueError):
        LoadConfig(endpoints=["x"], concurrency=2, rate=1.0, requests=1).validate()
    with pytest.raises(ValueError):
        LoadConfig(endpoints=["x"], concurrency=2).validate()  # unbounded
    with pytest.raises(ValueError):
        LoadConfig(endpoints=[], concurrency=2, requests=1).validate()
    cfg = config_from_args(build_parser().parse_args([]))
    assert cfg.concurrency == 1 and cfg.requests == 100 and cfg.rate is None
    cfg = config_from_args(
        build_parser().parse_args(
            ["--endpoint", "ipc://a", "--endpoint", "ipc://b", "--rate", "2", "--duration", "5"]
        )
    )
    assert cfg.endpoints == ["ipc://a", "ipc://b"]
    assert cfg.rate == 2.0 and cfg.concurrency is None and cfg.requests is None
    cfg.validate()


# -- one small real run ---------------------------------------------------------------


@pytest.fixture(scope="module")
def lt_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("loadtest")
    proc, endpoint, _log = start_worker(tmp, "--lanes", "4", "--ctx", "4096", name="lt")
    yield endpoint
    stop_worker(proc)


def test_closed_loop_run_in_process(lt_worker: str) -> None:
    s = run_load(endpoints=[lt_worker], concurrency=2, requests=6, max_tokens=8, ignore_eos=True)
    assert s["requests"]["sent"] == 6
    assert s["requests"]["ok"] == 6
    assert s["requests"]["errors"] == 0
    assert s["tokens"]["output"] == 48
    assert s["requests"]["finish_reasons"] == {"length": 6}
    assert s["ttft_ms"]["n"] == 6 and s["e2e_ms"]["n"] == 6
    assert s["itl_ms"]["n"] == 6 * 7
    assert s["tokens"]["prompt"] > 0
    assert s["throughput"]["output_tok_s"] > 0


def test_cli_writes_json_and_plot(lt_worker: str, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"prompt": make_text(n, seed=n)}) for n in (5, 20, 40)) + "\n"
    )
    out_json = tmp_path / "out.json"
    out_png = tmp_path / "out.png"
    plot = importlib.util.find_spec("matplotlib") is not None
    cmd = [
        sys.executable,
        "-m",
        "loadtest.cli",
        "--endpoint",
        lt_worker,
        "--concurrency",
        "2",
        "--requests",
        "6",
        "--max-tokens",
        "8",
        "--ignore-eos",
        "--prompts",
        str(prompts),
        "--json",
        str(out_json),
        *(["--plot", str(out_png)] if plot else []),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TTFT" in done.stdout and "errors by code: none" in done.stdout
    s = json.loads(out_json.read_text())
    assert s["requests"]["ok"] == 6 and s["requests"]["errors"] == 0
    assert s["tokens"]["output"] == 48
    assert s["config"]["concurrency"] == 2
    assert len(s["samples"]["e2e_ms"]) == 6
    if plot:
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
