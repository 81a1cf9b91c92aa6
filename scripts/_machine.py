"""The machine a figure was measured on: the CPU's SIMD flags, for every benchmark.

Why one helper: the rule is to print the CPU flags beside every figure
(kernels, and which of them are exact, differ between AVX2 and AVX-512
hosts), and the benchmarks should name them the same way.
"""

from __future__ import annotations

from pathlib import Path


def cpu_flags() -> str:
    """The first CPU's avx*/amx* flags, plus fma and f16c, sorted ('' off Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    wanted = {f for f in flags.split() if f.startswith(("avx", "amx")) or f in ("fma", "f16c")}
    return " ".join(sorted(wanted))
