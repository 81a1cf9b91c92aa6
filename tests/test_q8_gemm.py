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

_CHILD = """
import hashlib, json, sys
sys.path.insert(0, {root!r})
from worker.engine import Engine, EngineConfig, Segment, kernels
from worker.models import default_model_path

rule = kernels.KernelRule(**json.loads(sys.argv[1]))
cfg = EngineConfig(str(default_model_path()), n_ctx=2048, n_seq=2, n_threads=2, kernel_rule=rule)
e = Engine(cfg)
toks = e.tokenize(open({readme!r}).read() * 4)
h = lambda row: hashlib.sha256(row.tobytes()).hexdigest()
out = {{"level": kernels.backend_cpu()["level"]}}
for n in (120, 560):  # inside the sliding window, and past it
    e.seq_clear(0)
    for at in range(0, n, 512):
        assert e.decode([Segment(0, toks[at : min(at + 512, n)], at, "none")]).ok
    for k in (5, 16, 40):
        assert e.decode([Segment(0, toks[n : n + k], n, "all")]).ok
        span = [h(e.logits_row(e.output_index(0, i))) for i in range(k)]
        e.seq_rm(0, n, -1)
        single = []
        for i in range(k):
            assert e.decode([Segment(0, [toks[n + i]], n + i, "last")]).ok
            single.append(h(e.logits_row(e.output_index(0))))
        e.seq_rm(0, n, -1)
        out[f"{{n}}/{{k}}"] = {{"span": span, "single": single}}
out["calls"] = kernels.q8_gemm_calls()
print(json.dumps(out))
"""

_CASES = [f"{n}/{k}" for n in (120, 560) for k in (5, 16, 40)]


@pytest.fixture(scope="module")
def runs() -> tuple[dict[str, object], dict[str, object]]:
    return _rule_child.run(_CHILD, kernels.Q8_GEMM), _rule_child.run(_CHILD, kernels.FA_ROWS)


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
    assert plain["calls"] == 0
    if kernels.rule_for(str(wide["level"])).q8_gemm:
        calls = wide["calls"]
        assert isinstance(calls, int) and calls > 0
    else:
        assert wide["calls"] == 0
