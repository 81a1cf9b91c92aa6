"""The rows-at-once attention (``GGML_CPU_FA_ROWS``, scripts/llama_fa_rows.cpp).

The worker's exactness suites run under it already (it is the rule at every
AVX2 + FMA level); these tests make sure they mean something: that the
switch really takes another kernel than the one-row loop, and that the
kernel computes a row the same way whether it shares a tile of rows (a
prompt piece) or runs alone (decode), on both sides of Gemma 3's 512-token
sliding window.

ggml reads its switches once per process, so each rule runs in a child of
its own: a 560-token prompt, then 16 more tokens in one forward and the same
16 one at a time, logits hashed row by row. By logits, bit for bit.
"""

from __future__ import annotations

import _rule_child
import pytest

from worker.engine import kernels


def _rows(rule: kernels.KernelRule) -> dict[str, object]:
    return _rule_child.spans(rule, (120, 560), (16,))  # inside the sliding window, and past it


@pytest.fixture(scope="module")
def runs() -> tuple[dict[str, object], dict[str, object]]:
    return _rows(kernels.FA_ROWS), _rows(kernels.TILED_DOT)


@pytest.mark.parametrize("n", ["120/16", "560/16"])
def test_a_row_in_a_tile_of_rows_equals_the_row_alone(
    runs: tuple[dict[str, object], dict[str, object]], n: str
) -> None:
    got = runs[0][n]
    assert isinstance(got, dict)
    assert got["span"] == got["single"]


def test_the_switch_takes_another_kernel_than_the_one_row_loop(
    runs: tuple[dict[str, object], dict[str, object]],
) -> None:
    """Without this the test above could pass with the switch ignored (a
    build without the patch); a level without the kernel (no AVX2 + FMA +
    F16C) keeps the one-row loop, and nothing may differ there."""
    rows, one_row = runs
    for n in ("120/16", "560/16"):
        a, b = rows[n], one_row[n]
        assert isinstance(a, dict) and isinstance(b, dict)
        if kernels.rule_for(str(rows["level"])).fa_rows:
            assert set(a["single"]).isdisjoint(b["single"])
        else:
            assert a == b
