"""The tiled-dot rule (``GGML_CPU_TILED_DOT``, scripts/llama_tiled_dot.cpp):
ggml's tiled K-quant matmul takes 8+ rows and the patched dots take fewer,
so the batched exactness tests only mean something if the two really are
different kernels that compute a row the same way.

ggml reads its switches once per process, so each rule runs in a child of
its own on the default model (Q4_K and Q6_K weights): 8 tokens of one
session in one forward (the tiled kernel) and the same 8 one at a time (the
dots), logits hashed row by row. By logits, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import _rule_child
import pytest

from worker.engine import kernels


def _rows(rule: kernels.KernelRule) -> dict[str, list[str]]:
    out = _rule_child.spans(rule, (120,), (8,))
    return {**out["120/8"], "level": out["level"]}


Rows = dict[str, list[str]]


@dataclass(frozen=True)
class Runs:
    """The rows under the tiled-dot switch, ``vec_dot``'s, and (where the
    host's level has the dots) the tiled kernel's forced onto every row; a
    level without AVX2 + FMA has no dots, and there the switch must fall back
    to ``vec_dot`` for every row (docs/exactness.md)."""

    tiled_dot: Rows
    vec_dot: Rows
    tiled_everywhere: Rows | None  # None: this level has no dots


@pytest.fixture(scope="module")
def runs() -> Runs:
    tiled_dot = _rows(kernels.TILED_DOT)
    dots = kernels.rule_for(str(tiled_dot["level"])).tiled_dot
    forced = kernels.KernelRule(llamafile=True, tiled_mm_force=True)
    return Runs(tiled_dot, _rows(kernels.TINYBLAS), _rows(forced) if dots else None)


def test_rows_in_a_span_of_eight_equal_rows_one_at_a_time(runs: Runs) -> None:
    got = runs.tiled_dot
    assert got["span"] == got["single"]


def test_the_dots_compute_as_the_tiled_kernel_does_at_one_row(runs: Runs) -> None:
    if runs.tiled_everywhere is None:  # no dots: the switch leaves every row to vec_dot
        assert runs.tiled_dot["single"] == runs.vec_dot["single"]
        assert runs.tiled_dot["span"] == runs.vec_dot["span"]
        return
    assert runs.tiled_dot["single"] == runs.tiled_everywhere["single"]
    assert runs.tiled_dot["span"] == runs.tiled_everywhere["span"]


def test_the_switch_takes_another_kernel_than_vec_dot(runs: Runs) -> None:
    """Without this the two tests above could pass with the switch ignored
    (a build without the patch, or the tiled kernel never taken); where the
    level has no dots, the fallback is vec_dot's kernel, as the test above
    shows, and nothing else may differ."""
    if runs.tiled_everywhere is None:
        assert runs.tiled_dot == runs.vec_dot
        return
    assert set(runs.tiled_dot["single"]).isdisjoint(runs.vec_dot["single"])
