"""Which CPU kernels a process computes with, and the rule that makes rows exact.

skiff's exactness promise (a row's logits do not depend on the batch around
it, the chunking of its prompt, the thread count or where its KV cells sit)
rests on ggml taking the same arithmetic for one row as for many. Upstream
it does not: flash attention splits a lone row's KV across threads past 512
cells and tiles 64+ query rows; a tiled K-quant matmul takes 8+ rows; on some
x86 levels tinyBLAS may round differently from ``vec_dot``. The vendored
llama.cpp is patched (``scripts/llama_patch.py``) with switches, environment
variables ggml reads once, at its first use of each path:

- ``GGML_CPU_FA_ONE_ROW=1``: the one-row flash-attention loop for every row
  (always on: nothing else is exact past 512 cells or across a migration);
- ``GGML_CPU_TILED_MM=0``: no tiled K-quant matmul (upstream's own switch);
- ``GGML_CPU_TILED_DOT=1``: the tiled K-quant matmul from 8 rows, and below
  8 rows dots that compute a row exactly as it does (AVX2 + FMA levels);
- ``GGML_CPU_LLAMAFILE=0``: no tinyBLAS, where the variant needs it;
- ``GGML_CPU_FA_ROWS=1`` (with the one-row switch): attention for several
  query rows at once, each row computed as if alone (F16 KV cache, AVX2 +
  FMA + F16C; any other layer keeps the one-row loop);
- ``GGML_CPU_Q8_GEMM=1``: Q8_0 / Q5_0 matmuls of any row count (a decode
  step's few, a prompt's hundreds in blocks of 32), two dots per 512-bit
  register, weights prefetched, in tinyBLAS's and ``vec_dot``'s own numbers
  (AVX-512 BW + VL + VNNI builds; elsewhere a no-op).

The rule per x86 level comes from ``scripts/exactness_matrix.py`` (every
claim, each variant this host can run; docs/exactness.md). A level not
measured gets the strictest rule. ``apply`` runs after the backend is
loaded (it names the variant) and before the first forward.
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import asdict, dataclass
from typing import Any

import llama_cpp as ll


@dataclass(frozen=True)
class KernelRule:
    """The switches that make one x86 level's rows batch-invariant."""

    fa_one_row: bool = True
    tiled_mm: bool = False
    tiled_mm_force: bool = False  # the tiled K-quant matmul for every row count, one included
    llamafile: bool = False
    # the tiled K-quant matmul from 8 rows and, below, dots in its numerics
    # (scripts/llama_tiled_dot.cpp); a type without such a dot takes vec_dot
    tiled_dot: bool = False
    # with fa_one_row: several query rows at once where the layer allows
    # (scripts/llama_fa_rows.cpp), each row still computed as if alone
    fa_rows: bool = False
    # Q8_0 / Q5_0 matmuls in the wide kernel (scripts/llama_q8_gemm.cpp): the same
    # numbers as tinyBLAS / vec_dot, decode ~1.4-1.9x and prefill ~1.25x faster (Gemma 3 270M)
    q8_gemm: bool = False

    def env(self) -> dict[str, str]:
        return {
            "GGML_CPU_FA_ONE_ROW": "1" if self.fa_one_row else "0",
            "GGML_CPU_TILED_MM": "1"
            if any((self.tiled_mm, self.tiled_mm_force, self.tiled_dot))
            else "0",
            "GGML_CPU_TILED_MM_FORCE": "1" if self.tiled_mm_force else "0",
            "GGML_CPU_TILED_DOT": "1" if self.tiled_dot else "0",
            "GGML_CPU_LLAMAFILE": "1" if self.llamafile else "0",
            "GGML_CPU_FA_ROWS": "1" if self.fa_rows else "0",
            "GGML_CPU_Q8_GEMM": "1" if self.q8_gemm else "0",
        }


STRICT = KernelRule()
TINYBLAS = KernelRule(llamafile=True)
# tinyBLAS kept, and the tiled K-quant matmul back for 8+ rows: below 8 rows
# the patched ggml computes Q4_K / Q6_K rows with dots in the tiled kernel's
# own numerics, so a row is computed the same way at any batch size (prefill
# 1.1-1.25x the vec_dot rule, decode level at 8+ rows and a few % below that
# at fewer; docs/exactness.md).
TILED_DOT = KernelRule(llamafile=True, tiled_dot=True)
# ... and attention rows at once (scripts/llama_fa_rows.cpp): a row's scores,
# its exact max, and its fp32 sums over its own unmasked cells in cell order,
# the same in any tile of rows; prefill ~1.4x the one-row loop, and past
# upstream's tiled attention (docs/exactness.md).
FA_ROWS = KernelRule(llamafile=True, tiled_dot=True, fa_rows=True)
# ... and Q8_0 / Q5_0 matmuls of any row count in the wide kernel
# (scripts/llama_q8_gemm.cpp), which computes every element with tinyBLAS's
# steps in their order (and so vec_dot's, which tinyBLAS matches at these
# levels): the same numbers, decode steps ~1.4-1.9x and prompts ~1.25x faster
# on the default model. Compiled for AVX-512 BW + VL + VNNI only.
Q8_GEMM = KernelRule(llamafile=True, tiled_dot=True, fa_rows=True, q8_gemm=True)
# Measured by scripts/exactness_matrix.py (docs/exactness.md). Every claim
# holds with tinyBLAS on at these levels (it computes Q8_0 / Q5_0 elements as
# vec_dot does), so it stays on; at the AVX-only levels tinyBLAS rounds
# differently (a 16-row span 0.6-1.0 logits off), so they need STRICT. A
# level not listed (alderlake: AVX-VNNI, not runnable on the hosts measured)
# gets STRICT until the matrix has run on it. TILED_DOT needs AVX2 + FMA and
# is given where the matrix has run with it, with the rows-at-once attention
# (FA_ROWS), measured exact at the same levels; Q8_GEMM where the wide Q8_0
# kernel compiles (AVX-512 VNNI), measured exact there.
_MEASURED: dict[str, KernelRule] = {
    **dict.fromkeys(("x64", "sse42"), TINYBLAS),
    **dict.fromkeys(("haswell", "skylakex", "cannonlake"), FA_ROWS),
    **dict.fromkeys(("cascadelake", "icelake", "cooperlake", "zen4"), Q8_GEMM),
    **dict.fromkeys(("sandybridge", "ivybridge", "piledriver"), STRICT),
}
UPSTREAM = KernelRule(fa_one_row=False, tiled_mm=True, llamafile=True)

# (level, the ggml features it needs), best first: how a CPU backend (a tuned
# build's, or the variant a portable build loaded) is placed among the levels.
_LEVELS: list[tuple[str, set[str]]] = [
    ("zen4", {"AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16"}),
    ("cooperlake", {"AVX512", "AVX512_VNNI", "AVX512_BF16"}),
    ("icelake", {"AVX512", "AVX512_VBMI", "AVX512_VNNI"}),
    ("cascadelake", {"AVX512", "AVX512_VNNI"}),
    ("cannonlake", {"AVX512", "AVX512_VBMI"}),
    ("skylakex", {"AVX512"}),
    ("alderlake", {"AVX2", "AVX_VNNI"}),
    ("haswell", {"AVX2", "FMA", "F16C"}),
    ("piledriver", {"AVX", "FMA", "F16C"}),
    ("ivybridge", {"AVX", "F16C"}),
    ("sandybridge", {"AVX"}),
    # ggml names no SSE4.2 feature: its sse42 variant reports SSE3 / SSSE3, x64 neither
    ("sse42", {"SSSE3"}),
]


def level_of(features: list[str]) -> str:
    """The x86 level a CPU backend's features place it at."""
    have = set(features)
    for level, needs in _LEVELS:
        if needs <= have:
            return level
    return "x64"


def rule_for(level: str) -> KernelRule:
    return _MEASURED.get(level, STRICT)


def apply(rule: KernelRule) -> None:
    """Set the switches (before the first forward: ggml reads each once)."""
    os.environ.update(rule.env())


def describe(
    variant: str, features: list[str], invariant: bool, rule: KernelRule | None = None
) -> dict[str, Any]:
    """What ``info`` reports: variant, level, features, and the rule in force
    (``rule`` overrides the level's, for the exactness matrix)."""
    level = level_of(features)
    if rule is None:
        rule = rule_for(level) if invariant else UPSTREAM
    return {
        "variant": variant,
        "level": level,
        "features": features,
        "batch_invariant": invariant,
        "rule": asdict(rule),
    }


_backend: dict[str, Any] = {}  # what the process's backend was started with


def start_backend(batch_invariant: bool, rule: KernelRule | None = None) -> dict[str, Any]:
    """Start llama.cpp's backend once per process, with the switches of the
    CPU variant it loaded; the process's ``describe`` (a later call with
    another ``batch_invariant`` gets the first one's: the caller refuses)."""
    if not _backend:
        ll.llama_backend_init()
        # Silence llama.cpp's own stderr chatter; we log what matters ourselves.
        ll.llama_log_set(_NULL_LOG, ctypes.c_void_p(0))
        text = ll.llama_print_system_info().decode("utf-8", "replace")
        features = sorted(set(re.findall(r"([A-Z0-9_]+) = 1", text)))
        # A tuned build links one CPU backend; a portable one (GGML_BACKEND_DL)
        # loaded the best of its per-level variants, which the features name.
        lib_dir = os.path.join(os.path.dirname(ll.__file__), "lib")
        build = "tuned" if os.path.exists(os.path.join(lib_dir, "libggml-cpu.so")) else "portable"
        cpu = describe(build, features, batch_invariant, rule)
        # ggml reads the switches at its first forward, which has not happened yet.
        apply(KernelRule(**cpu["rule"]))
        _backend["cpu"] = cpu
    return backend_cpu()


def backend_cpu() -> dict[str, Any]:
    """The CPU variant and ggml features this process computes with."""
    return dict(_backend["cpu"])


def q8_gemm_calls() -> int | None:
    """Matmuls the wide Q8_0 kernel (``GGML_CPU_Q8_GEMM``) has taken in this
    process; None when the loaded CPU backend has no such kernel (a build
    without the patch). Tests and the exactness matrix read it to tell a
    live switch from an ignored one: the kernel's numbers are tinyBLAS's, so
    the logits alone cannot."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libggml-cpu" in line}
    for path in sorted(paths):
        try:
            fn = ctypes.CDLL(path).ggml_cpu_q8_gemm_calls
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int64
        return int(fn())
    return None


@ll.llama_log_callback  # type: ignore[untyped-decorator]
def _NULL_LOG(level: int, text: bytes, user_data: Any) -> None:
    return None
