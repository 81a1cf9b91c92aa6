"""skiff-slice --balance: the split of a model into stages from measured costs."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker.slice.balance import Costs, best_cuts, measure, report
from worker.slice.slicer import main as slice_main


def test_equal_layers_split_evenly() -> None:
    split = best_cuts(Costs(4, (1.0, 1.0, 1.0, 1.0), 0.0), 2)
    assert split.cuts == (0, 2, 4) and split.stage_ms == (2.0, 2.0) and split.bound == 2.0


def test_a_heavy_head_pulls_every_layer_but_one_to_the_first_stage() -> None:
    """Gemma 3 270M's shape: 18 layers of ~1 ms, a head of ~42 ms."""
    split = best_cuts(Costs(4, (1.0,) * 18, 42.0), 2)
    assert split.cuts == (0, 17, 18)
    assert split.ranges() == ["0:17", "17:18"]
    assert split.bound == pytest.approx(60.0 / 43.0)


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
