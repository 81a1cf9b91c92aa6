"""The wide Q8_0 / Q5_0 matmul (``GGML_CPU_Q8_GEMM``, scripts/llama_q8_gemm.cpp).

The kernel promises tinyBLAS's (and ``vec_dot``'s) numbers, bit for bit, only
faster; Gemma 3 270M's head is Q8_0 and most of its projections Q5_0, so
every logit of every decode passes through it. These tests hold it to that:
the same prompt (hundreds of columns: the kernel's blocks of 32), then spans
of 5, 16 and 40 rows (odd and even column pairs; 40 is two blocks, the second
short) and the same tokens one at a time, on both sides of the 512-token sliding
window, under the rule with the kernel and under the rule without it;
logits hashed row by row. Each rule runs in a child of its own (ggml reads
its switches once per process). The kernel's call counter tells a live
switch from an ignored one, since the logits cannot.
"""

from __future__ import annotations

import _rule_child
import pytest

from worker.engine import kernels

_CASES = [f"{n}/{k}" for n in (120, 560) for k in (5, 16, 40)]


@pytest.fixture(scope="module")
def runs() -> tuple[dict[str, object], dict[str, object]]:
    lengths, widths = (120, 560), (5, 16, 40)  # inside the sliding window, and past it
    return (
        _rule_child.spans(kernels.Q8_GEMM, lengths, widths),
        _rule_child.spans(kernels.FA_ROWS, lengths, widths),
    )


@pytest.mark.parametrize("case", _CASES)
def test_a_row_in_a_span_equals_the_row_alone(
    runs: tuple[dict[str, object], dict[str, object]], case: str
) -> None:
    got = runs[0][case]
    assert isinstance(got, dict)
    assert got["span"] == got["single"]


@pytest.mark.parametrize("case", _CASES)
def test_the_kernel_computes_tinyblas_and_vec_dot_numbers(
    runs: tuple[dict[str, object], dict[str, object]], case: str
) -> None:
    """Without the switch a span's head goes through tinyBLAS and a lone
    row's through vec_dot: the kernel must give both the same bits."""
    wide, plain = runs
    assert wide[case] == plain[case]


def test_the_switch_is_live_where_the_rule_takes_it(
    runs: tuple[dict[str, object], dict[str, object]],
) -> None:
    """The comparison above means something only if the kernel ran: it must
    at every level whose rule has it (AVX-512 VNNI), and nowhere else."""
    wide, plain = runs
    assert plain["q8_calls"] == 0
    if kernels.rule_for(str(wide["level"])).q8_gemm:
        calls = wide["q8_calls"]
        assert isinstance(calls, int) and calls > 0
    else:
        assert wide["q8_calls"] == 0
