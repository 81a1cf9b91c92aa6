"""The vendored llama.cpp source skiff builds, with one small patch.

Why a patch: skiff promises that a row's logits do not depend on the batch
around it (how many lanes share the forward, how a prompt is cut into
chunks, how many threads run it, where its KV cells sit). ggml's CPU backend
can break that in three places, each a speed path that switches on with the
shape of the batch:

- the tiled K-quant matmul (``ggml_compute_forward_mul_mat_tiled``) takes
  Q4_K/Q6_K matmuls of 8 or more rows: the old "7-row rule" (upstream's own
  ``GGML_CPU_TILED_MM=0`` turns it off; no patch needed).
- llamafile's tinyBLAS (``llamafile_sgemm``) takes Q8_0/Q5_0 matmuls of 2 or
  more rows; one row takes ggml's ``vec_dot``. Measured bit-identical on
  AVX2 and AVX-512 for those types, so it stays on; its F16/F32 kernels are
  not (the engine keeps flash attention on, so KQ never goes there).
- flash attention splits the KV across threads for one query row of one
  stream once the KV holds 512 cells (``use_split_kv_path``), and tiles 64 or
  more query rows (``ggml_compute_forward_flash_attn_ext_tiled``): a lone
  decode past 512 cells, a restored session (fewer cells) and a batched row
  all reduce in different orders. This is what made a migrated session past
  the 512-token sliding window continue with other logits.

The patch adds five switches, environment variables read once per process
(upstream already has ``GGML_CPU_TILED_MM=0`` / ``GGML_CPU_TILED_MM_FORCE=1``
for the tiled K-quant matmul):

- ``GGML_CPU_FA_ONE_ROW=1`` sends every query row through the one-row
  flash-attention loop, which walks the live cells in order and skips masked
  ones (so it is blind to the batch, the thread count, gaps, padding and the
  cache's cell count);
- ``GGML_CPU_LLAMAFILE=0`` turns tinyBLAS off for a CPU variant where it
  rounds differently from ``vec_dot``;
- ``GGML_CPU_TILED_DOT=1`` keeps the tiled K-quant matmul for 8+ rows (it is
  worth ~1.2x to prefill) and computes Q4_K / Q6_K rows below 8 with dots
  that reproduce its arithmetic (``llama_tiled_dot.cpp``: exact integer
  subblock sums, then its float steps in its order), so a row comes out the
  same at any batch size. A type without such a dot is refused by the tiled
  kernel and takes ``vec_dot`` at every row count, as under
  ``GGML_CPU_TILED_MM=0``. AVX2 + FMA only; elsewhere the switch is the same
  as ``GGML_CPU_TILED_MM=0``.

- ``GGML_CPU_Q8_GEMM=1`` takes Q8_0 and Q5_0 matmuls of any row count with
  ``llama_q8_gemm.cpp`` (columns in blocks of 32) (AVX-512 BW + VL + VNNI): two dots per 512-bit
  register and the next weights prefetched, each element computed with
  tinyBLAS's (and ``vec_dot``'s) steps in their order, so the numbers are
  theirs, bit for bit; Gemma 3 270M's Q8_0 head and Q5_0 projections are
  most of a decode step. Other builds and types keep tinyBLAS / ``vec_dot``.

- ``GGML_CPU_FA_ROWS=1`` (with ``GGML_CPU_FA_ONE_ROW=1``) computes attention
  for several query rows at once where the layer allows (F16 K/V, no
  softcap or sinks, AVX2 + FMA + F16C; ``llama_fa_rows.cpp``): each row's
  scores, their exact max, and its fp32 sums over its own unmasked cells in
  cell order, so a row's bits do not depend on the rows beside it; the
  rows share each K and V load. Elsewhere the one-row loop runs, as before.

Which switches a CPU variant needs is measured by
``scripts/exactness_matrix.py``; the worker sets what the variant it loaded
needs (``worker/engine/kernels.py``). Unset, the build behaves exactly like
upstream. Each edit must match the
source exactly once or the build stops: a new llama.cpp version cannot skip
one silently.

One edit is not about kernels: ``LLAMA_STATE_SEQ_FLAGS_ALL_CELLS`` (4), a
flag for ``llama_state_seq_get_data_ext``. Upstream's sequence state leaves
out the cells a sliding window masks (enough to go on from the end, so a
608-token lane of Gemma 3 comes back with ``pos_min`` 96); with the flag
every cell is written, so a prompt kept in host memory
(``worker/runtime/prefix.py``) can be loaded and trimmed back to any
shorter prefix. Only that save asks for it; park, export and migration
save what upstream does.

The sdist comes from the package index like any package (``pip download``);
no other source is fetched.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import IO, Any

FA_ONE_ROW = "GGML_CPU_FA_ONE_ROW"  # 1: flash attention always takes the one-row kernel
LLAMAFILE = "GGML_CPU_LLAMAFILE"  # 0: no tinyBLAS, ggml's vec_dot for every matmul

_HELPER = f"""
// skiff: switches for batch-invariant rows, read once (see skiff's scripts/llama_patch.py)
static inline bool ggml_cpu_skiff_flag(const char * name, int * cached, int unset) {{
    if (*cached < 0) {{
        const char * env = getenv(name);
        *cached = env == NULL ? unset : atoi(env) != 0;
    }}
    return *cached == 1;
}}
static inline bool ggml_cpu_fa_one_row(void) {{
    static int cached = -1;
    return ggml_cpu_skiff_flag("{FA_ONE_ROW}", &cached, 0);
}}
static inline bool ggml_cpu_llamafile(void) {{
    static int cached = -1;
    return ggml_cpu_skiff_flag("{LLAMAFILE}", &cached, 1);
}}
"""

_TILED_DOT = (Path(__file__).resolve().parent / "llama_tiled_dot.cpp").read_text()
_FA_ROWS = (Path(__file__).resolve().parent / "llama_fa_rows.cpp").read_text()
_Q8_GEMM = (Path(__file__).resolve().parent / "llama_q8_gemm.cpp").read_text()


def _vec_dot_edit(gap: str) -> tuple[str, str, str]:
    """The edit that lets the tiled dots replace ``vec_dot`` in a line
    declared with ``gap`` between the type and ``const``."""
    head = f"    ggml_vec_dot_t{gap}const vec_dot      = "
    return (
        "ggml/src/ggml-cpu/ggml-cpu.c",
        f"{head}type_traits_cpu[type].vec_dot;\n",
        f"{head}ggml_tiled_vec_dot(type) ? ggml_tiled_vec_dot(type)\n"
        f"{' ' * (len(head) + 21)}: type_traits_cpu[type].vec_dot;\n",
    )


# (file under vendor/llama.cpp, exact text, replacement)
EDITS: list[tuple[str, str, str]] = [
    (
        "ggml/src/ggml-cpu/ggml-cpu-impl.h",
        "    // use reference implementation\n    bool use_ref;\n};\n",
        "    // use reference implementation\n    bool use_ref;\n};\n" + _HELPER,
    ),
    (
        "ggml/src/ggml-cpu/ggml-cpu.c",
        "    if (src1_cont) {\n        for (int64_t i13 = 0; i13 < ne13; i13++)",
        "    if (src1_cont && ggml_cpu_llamafile()) {\n"
        "        for (int64_t i13 = 0; i13 < ne13; i13++)",
    ),
    (
        "ggml/src/ggml-cpu/ggml-cpu.c",
        "    if (src1->type != vec_dot_type) {\n        const void* wdata =",
        "    if (src1->type != vec_dot_type && ggml_cpu_llamafile()) {\n"
        "        const void* wdata =",
    ),
    (
        "ggml/src/ggml-cpu/ops.cpp",
        "    const bool use_ref = params->use_ref;\n",
        "    const bool use_ref = params->use_ref || ggml_cpu_fa_one_row();\n",
    ),
    # GGML_CPU_TILED_DOT=1: K-quant dots in the tiled kernel's numerics below 8 rows
    # (llama_tiled_dot.cpp), the tiled kernel from 8 rows; a type without such a dot
    # is refused by the tiled kernel, so vec_dot computes it at every row count.
    (
        "ggml/src/ggml-cpu/tiled/tiled.h",
        '#ifdef __cplusplus\nextern "C" {\n#endif\n',
        '#include "ggml-cpu.h"\n\n#ifdef __cplusplus\nextern "C" {\n#endif\n\n'
        "// skiff: with GGML_CPU_TILED_DOT=1, the vec_dot computing a row of TYPE exactly as the\n"
        "// tiled kernel does, or NULL (the switch off, the type not covered)\n"
        "ggml_vec_dot_t ggml_tiled_vec_dot(enum ggml_type type);\n",
    ),
    (
        "ggml/src/ggml-cpu/tiled/tiled.cpp",
        "// GGML_CPU_TILED_MM: master switch, on by default.",
        _TILED_DOT + "\n// GGML_CPU_TILED_MM: master switch, on by default.",
    ),
    (
        "ggml/src/ggml-cpu/tiled/tiled.cpp",
        "    if (src0->extra != NULL) {\n        return false;\n    }\n",
        "    if (src0->extra != NULL) {\n        return false;\n    }\n"
        "    if (ggml_cpu_tiled_dot() && ggml_tiled_vec_dot(src0->type) == NULL) {\n"
        "        return false;\n    }\n",
    ),
    # mul_mat's and mul_mat_id's choice of vec_dot (two spellings of one line)
    *(_vec_dot_edit(gap) for gap in (" ", "    ")),
    # GGML_CPU_FA_ROWS=1 (with GGML_CPU_FA_ONE_ROW=1): the rows-at-once batch-invariant
    # attention (llama_fa_rows.cpp) where it covers the layer, else the one-row loop
    (
        "ggml/src/ggml-cpu/ops.cpp",
        "static void ggml_compute_forward_flash_attn_ext_f16(\n",
        _FA_ROWS + "\nstatic void ggml_compute_forward_flash_attn_ext_f16(\n",
    ),
    (
        "ggml/src/ggml-cpu/ops.cpp",
        "        bool use_tiled = !use_ref &&\n",
        "        const bool use_rows = use_ref && ggml_cpu_fa_rows()"
        " && ggml_fa_rows_supported(dst);\n"
        "        bool use_tiled = !use_ref &&\n",
    ),
    (
        "ggml/src/ggml-cpu/ops.cpp",
        "                ggml_compute_forward_flash_attn_ext_tiled(params, dst, ir0, ir1);\n"
        "            } else {\n",
        "                ggml_compute_forward_flash_attn_ext_tiled(params, dst, ir0, ir1);\n"
        "            } else if (use_rows) {\n"
        "                ggml_fa_rows(params, dst, ir0, ir1);\n"
        "            } else {\n",
    ),
    # GGML_CPU_Q8_GEMM=1: Q8_0 / Q5_0 x Q8_0 matmuls of any row count in tinyBLAS's numbers,
    # wider (llama_q8_gemm.cpp), before tinyBLAS's own n < 2 refusal: one row goes there too
    (
        "ggml/src/ggml-cpu/llamafile/sgemm.cpp",
        "/**\n * Performs optimized matrix multiplication on CPU.\n",
        _Q8_GEMM + "\n/**\n * Performs optimized matrix multiplication on CPU.\n",
    ),
    (
        "ggml/src/ggml-cpu/llamafile/sgemm.cpp",
        "    // only enable sgemm for prompt processing\n",
        "    if (Btype == GGML_TYPE_Q8_0 && Ctype == GGML_TYPE_F32 &&\n"
        "        ggml_q8_gemm(m, n, k, A, lda, B, ldb, (float *)C, ldc, Atype, params->ith,\n"
        "                     params->nth))\n"
        "        return true;\n\n"
        "    // only enable sgemm for prompt processing\n",
    ),
    # LLAMA_STATE_SEQ_FLAGS_ALL_CELLS: a sequence's saved state keeps its sliding-window
    # cells past the window too (a cache with swa_full holds them), so a prompt cell
    # saved to host memory can be loaded and trimmed back to any shorter prefix
    (
        "include/llama.h",
        "#define LLAMA_STATE_SEQ_FLAGS_ON_DEVICE 2\n",
        "#define LLAMA_STATE_SEQ_FLAGS_ON_DEVICE 2\n\n"
        "// skiff: every cell of the sequence, those a sliding window masks too\n"
        "#define LLAMA_STATE_SEQ_FLAGS_ALL_CELLS 4\n",
    ),
    (
        "src/llama-kv-cache.cpp",
        "            // check the cell is not SWA-masked\n"
        "            if (add_cell && seq_id != -1) {\n",
        "            // check the cell is not SWA-masked\n"
        "            if (add_cell && seq_id != -1 && !(flags & "
        "LLAMA_STATE_SEQ_FLAGS_ALL_CELLS)) {\n",
    ),
]


def fingerprint() -> str:
    """Changes whenever an edit does (part of the wheel cache key)."""
    return hashlib.sha256(repr(EDITS).encode()).hexdigest()[:12]


def apply(llama_dir: Path) -> None:
    """Apply every edit to the vendored llama.cpp at ``llama_dir``, or raise."""
    for rel, old, new in EDITS:
        path = llama_dir / rel
        text = path.read_text()
        if text.count(old) != 1:
            raise SystemExit(
                f"skiff: patch does not fit {rel} ({text.count(old)} matches for {old[:60]!r}); "
                "the vendored llama.cpp changed: review scripts/llama_patch.py"
            )
        path.write_text(text.replace(old, new))


def patched_sdist(version: str, workdir: Path, log: IO[Any] | None = None) -> Path:
    """Download, unpack and patch llama-cpp-python ``version``; its source dir."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         "-d", str(workdir), f"llama-cpp-python=={version}"],
        check=True, stdout=log, stderr=subprocess.STDOUT if log is not None else None,
    )  # fmt: skip
    (sdist,) = workdir.glob("llama_cpp_python-*.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(workdir, filter="data")
    (src,) = [p for p in workdir.glob("llama_cpp_python-*") if p.is_dir()]
    apply(src / "vendor" / "llama.cpp")
    return src


if __name__ == "__main__":
    # usage: llama_patch.py VERSION WORKDIR  -> prints the patched source dir
    print(patched_sdist(sys.argv[1], Path(sys.argv[2])))
