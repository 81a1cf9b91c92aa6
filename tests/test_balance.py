"""skiff-slice --balance: the split of a model into stages from measured costs."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import ROOT, WAIT_S
from worker.slice.balance import Costs, best_cuts, measure, report
from worker.slice.slicer import main as slice_main
from worker.slice.swa import range_problem


def test_equal_layers_split_evenly() -> None:
    split = best_cuts(Costs(4, (1.0, 1.0, 1.0, 1.0), 0.0), 2)
    assert split.cuts == (0, 2, 4) and split.stage_ms == (2.0, 2.0) and split.bound == 2.0


def test_a_heavy_head_pulls_every_layer_but_one_to_the_first_stage() -> None:
    """Gemma 3 270M's shape: 18 layers of ~1 ms, a head of ~42 ms."""
    split = best_cuts(Costs(4, (1.0,) * 18, 42.0), 2)
    assert split.cuts == (0, 17, 18)
    assert split.ranges() == ["0:17", "17:18"]
    assert split.bound == pytest.approx(60.0 / 43.0)


def test_a_gemma3_split_never_leaves_a_stage_of_dense_layers_only() -> None:
    """llama.cpp aborts on a Gemma 3 slice without a sliding-window layer:
    with the head's weight, the best loadable cut is 16, not 17 (layer 17 is
    dense), and a stage start refuses 17:18 by name instead of crashing."""
    costs = Costs(4, (1.0,) * 18, 42.0, "gemma3")
    assert not costs.loadable(17, 18) and costs.loadable(16, 18)
    assert best_cuts(costs, 2, costs.loadable).cuts == (0, 16, 18)
    assert best_cuts(Costs(4, (1.0,) * 18, 42.0, "llama"), 2, None).cuts == (0, 17, 18)
    problem = range_problem("gemma3", 17, 18)
    assert problem is not None and "sliding-window" in problem
    assert range_problem("llama", 17, 18) is None


def test_a_stage_of_dense_layers_only_is_refused_at_startup(tmp_path: Path) -> None:
    bind = "ipc://" + str(tmp_path / "x")
    argv = [sys.executable, "-m", "worker.cli", "--layers", "17:18", "--bind", bind]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S)
    assert proc.returncode != 0 and "sliding-window" in proc.stderr + proc.stdout


def test_more_stages_than_layers_is_refused() -> None:
    with pytest.raises(ValueError):
        best_cuts(Costs(1, (1.0, 2.0), 1.0), 3)


@given(
    st.lists(st.floats(0.01, 10.0), min_size=1, max_size=8),
    st.floats(0.0, 20.0),
    st.integers(1, 4),
)
def test_the_split_is_the_best_of_every_contiguous_split(
    layers: list[float], head: float, stages: int
) -> None:
    if stages > len(layers):
        return
    costs = Costs(1, tuple(layers), head)
    split = best_cuts(costs, stages)
    n = len(layers)

    def worst(cuts: tuple[int, ...]) -> float:
        pairs = itertools.pairwise(cuts)
        return max(sum(layers[lo:hi]) + (head if hi == n else 0.0) for lo, hi in pairs)

    brute = min(worst((0, *inner, n)) for inner in itertools.combinations(range(1, n), stages - 1))
    assert max(split.stage_ms) == pytest.approx(brute)
    assert split.cuts[0] == 0 and split.cuts[-1] == n
    assert all(lo < hi for lo, hi in zip(split.cuts, split.cuts[1:], strict=False))
    assert sum(split.stage_ms) == pytest.approx(costs.total)


def test_measure_reads_every_layer_and_the_head(model_path: str) -> None:
    """On the real model: one cost per layer and one for the head, all
    measured (positive), and a report naming a split llama.cpp can load."""
    costs = measure(model_path, rows=2, repeats=2)
    assert len(costs.layers) == 18
    assert all(c > 0 for c in costs.layers) and costs.head > 0
    text = report(costs, 3)
    assert "best split into 3: --layers 0:" in text and ":18" in text


def test_the_cli_prints_the_split(model_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert slice_main([model_path, "--balance", "2", "--rows", "1"]) == 0
    out = capsys.readouterr().out
    assert "best split into 2" in out and "pipeline bound" in out
