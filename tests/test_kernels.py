"""``engine/kernels.py``: each CPU variant is placed at its level and given
the rule the exactness matrix measured for it (docs/exactness.md)."""

from __future__ import annotations

from worker.engine import kernels

BASE = ["LLAMAFILE", "OPENMP", "REPACK"]
SSE = [*BASE, "SSE3", "SSSE3"]
AVX2 = [*SSE, "AVX", "AVX2", "BMI2", "F16C", "FMA"]

# the features each portable variant reported (scripts/exactness_matrix.py --json)
FEATURES = {
    "x64": BASE,
    "sse42": SSE,
    "sandybridge": [*SSE, "AVX"],
    "ivybridge": [*SSE, "AVX", "F16C"],
    "piledriver": [*SSE, "AVX", "F16C", "FMA"],
    "haswell": AVX2,
    "alderlake": [*AVX2, "AVX_VNNI"],
    "skylakex": [*AVX2, "AVX512"],
    "cannonlake": [*AVX2, "AVX512", "AVX512_VBMI"],
    "cascadelake": [*AVX2, "AVX512", "AVX512_VNNI"],
    "icelake": [*AVX2, "AVX512", "AVX512_VBMI", "AVX512_VNNI"],
    "cooperlake": [*AVX2, "AVX512", "AVX512_BF16", "AVX512_VNNI"],
    "zen4": [*AVX2, "AVX512", "AVX512_BF16", "AVX512_VBMI", "AVX512_VNNI"],
}


def test_every_variant_is_placed_at_its_own_level() -> None:
    assert {name: kernels.level_of(f) for name, f in FEATURES.items()} == {
        name: name for name in FEATURES
    }


def test_avx_only_levels_and_unmeasured_ones_get_the_strict_rule() -> None:
    for level in ("sandybridge", "ivybridge", "piledriver", "alderlake", "some-new-level"):
        assert kernels.rule_for(level) == kernels.STRICT
        assert not kernels.rule_for(level).llamafile
    for level in ("x64", "sse42", "haswell", "skylakex", "icelake", "zen4"):
        assert kernels.rule_for(level).llamafile
    for level in FEATURES:
        rule = kernels.rule_for(level)
        assert rule.fa_one_row and not rule.tiled_mm and not rule.tiled_mm_force


def test_the_tiled_dot_rule_only_where_the_matrix_measured_it() -> None:
    """The tiled K-quant matmul comes back (from 8 rows) only with the dots
    that compute fewer rows as it does, and only at levels with AVX2 + FMA
    where every claim was measured exact with it (docs/exactness.md)."""
    assert {lvl for lvl in FEATURES if kernels.rule_for(lvl).tiled_dot} == {
        "haswell",
        "skylakex",
        "cannonlake",
        "cascadelake",
        "icelake",
        "cooperlake",
        "zen4",
    }
    assert {lvl for lvl in FEATURES if kernels.rule_for(lvl).fa_rows} == {
        lvl for lvl in FEATURES if kernels.rule_for(lvl).tiled_dot
    }
    env = kernels.FA_ROWS.env()
    assert env["GGML_CPU_FA_ROWS"] == "1" and env["GGML_CPU_FA_ONE_ROW"] == "1"
    assert kernels.TILED_DOT.env()["GGML_CPU_FA_ROWS"] == "0"
    env = kernels.TILED_DOT.env()
    assert env["GGML_CPU_TILED_MM"] == "1" and env["GGML_CPU_TILED_DOT"] == "1"
    assert env["GGML_CPU_TILED_MM_FORCE"] == "0" and env["GGML_CPU_FA_ONE_ROW"] == "1"
    assert kernels.TINYBLAS.env()["GGML_CPU_TILED_MM"] == "0"
    # the wide Q8_0 kernel where it compiles (AVX-512 BW + VNNI) and was measured
    assert {lvl for lvl in FEATURES if kernels.rule_for(lvl).q8_gemm} == {
        "cascadelake",
        "icelake",
        "cooperlake",
        "zen4",
    }
    assert kernels.Q8_GEMM.env()["GGML_CPU_Q8_GEMM"] == "1"
    assert kernels.FA_ROWS.env()["GGML_CPU_Q8_GEMM"] == "0"


def test_info_reports_the_rule_in_force() -> None:
    described = kernels.describe("portable", FEATURES["ivybridge"], invariant=True)
    assert described["level"] == "ivybridge" and described["rule"]["llamafile"] is False
    upstream = kernels.describe("tuned", FEATURES["zen4"], invariant=False)
    assert upstream["rule"] == {
        "fa_one_row": False,
        "tiled_mm": True,
        "tiled_mm_force": False,
        "llamafile": True,
        "tiled_dot": False,
        "fa_rows": False,
        "q8_gemm": False,
    }
