"""Build (once) and install a llama-cpp-python wheel that is safe on this CPU.

Why: a default native build of llama-cpp-python 0.3.36 enables AMX on CPUs
that advertise it, and ``ggml_backend_amx_mul_mat`` faults on this machine.
We build with ``GGML_NATIVE=OFF`` and switch on, one by one, the x86 SIMD
extensions /proc/cpuinfo reports (AVX2, AVX-512, VNNI, BF16 ...), never AMX.
That keeps native-class speed and also makes llama-cpp-python's own
high-level ``Llama`` and server safe (the benchmarks use them).

The source is the package index's sdist with ``llama_patch.EDITS`` applied:
one runtime switch (``GGML_CPU_BATCH_INVARIANT=1``, which the worker sets)
that makes every row's result independent of the batch around it.

The wheel is cached under ``$SKIFF_CACHE_DIR/wheels/<key>/`` (default
``~/.cache/skiff``) where the key hashes the version and flags, so a fresh
clone on the same machine reinstalls in seconds and a flag change rebuilds.
pip's own wheel cache is bypassed because it ignores CMAKE_ARGS.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_patch

VERSION = "0.3.36"
# cpuinfo flag -> ggml CMake option
_FLAGS = [
    ("avx", "GGML_AVX"),
    ("avx2", "GGML_AVX2"),
    ("fma", "GGML_FMA"),
    ("f16c", "GGML_F16C"),
    ("bmi2", "GGML_BMI2"),
    ("avx512f", "GGML_AVX512"),
    ("avx512vbmi", "GGML_AVX512_VBMI"),
    ("avx512_vnni", "GGML_AVX512_VNNI"),
    ("avx512_bf16", "GGML_AVX512_BF16"),
    ("avx_vnni", "GGML_AVX_VNNI"),
]


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    match = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    return set(match.group(1).split()) if match else set()


def cmake_args() -> str:
    flags = cpu_flags()
    args = [
        "-DGGML_NATIVE=OFF",
        "-DGGML_AMX_TILE=OFF",
        "-DGGML_AMX_INT8=OFF",
        "-DGGML_AMX_BF16=OFF",
    ]
    args += [f"-D{opt}={'ON' if flag in flags else 'OFF'}" for flag, opt in _FLAGS]
    return " ".join(args)


def cache_dir() -> Path:
    return Path(os.environ.get("SKIFF_CACHE_DIR", Path.home() / ".cache" / "skiff"))


def build(wheel_dir: Path, args: str) -> Path:
    from tqdm import tqdm

    wheel_dir.mkdir(parents=True, exist_ok=True)
    log_path = wheel_dir / "build.log"
    print(
        f"skiff: building llama-cpp-python {VERSION} for this CPU (once; 4-10 min)\n"
        f"       CMAKE_ARGS={args}\n       log: {log_path}",
        file=sys.stderr,
    )
    env = {**os.environ, "CMAKE_ARGS": args}
    with (
        log_path.open("w") as log,
        tempfile.TemporaryDirectory() as tmp,
        tqdm(total=100, unit="%", desc="llama.cpp build", file=sys.stderr) as bar,
    ):
        src = llama_patch.patched_sdist(VERSION, Path(tmp), log)
        cmd = [
            sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-cache-dir",
            "-w", str(wheel_dir), str(src),
        ]  # fmt: skip
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            m = re.search(r"\[\s*(\d+)%\]", line)
            if m and int(m.group(1)) > bar.n:
                bar.update(int(m.group(1)) - bar.n)
        if proc.wait() != 0:
            sys.exit(f"skiff: llama-cpp-python build failed; see {log_path}")
    wheels = sorted(wheel_dir.glob("llama_cpp_python-*.whl"))
    if not wheels:
        sys.exit(f"skiff: build produced no wheel; see {log_path}")
    return wheels[-1]


def pip_install(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *args], check=True)


def main() -> None:
    args = cmake_args()
    key = hashlib.sha256(f"{VERSION} {args} {llama_patch.fingerprint()}".encode()).hexdigest()[:12]
    marker = Path(sys.prefix) / f".skiff-llama-{key}"
    if marker.exists():
        return
    wheel_dir = cache_dir() / "wheels" / key
    wheels = sorted(wheel_dir.glob("llama_cpp_python-*.whl"))
    wheel = wheels[-1] if wheels else build(wheel_dir, args)
    pip_install("--no-deps", "--force-reinstall", str(wheel))
    # llama-cpp-python's runtime dependencies (the wheel went in without them).
    pip_install("typing-extensions", "numpy", "diskcache", "jinja2")
    for old in Path(sys.prefix).glob(".skiff-llama-*"):
        old.unlink()
    marker.touch()


if __name__ == "__main__":
    main()
