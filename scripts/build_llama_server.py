"""Build (once) llama.cpp's own ``llama-server`` and ``llama-batched-bench``.

The honest baseline for skiff is the C++ server users would otherwise run,
built from the very llama.cpp that llama-cpp-python 0.3.36 vendors, with the
same CMake flags as skiff's wheel (``build_llama.cmake_args``: no native
tuning, every SIMD extension the CPU reports, never AMX). The sdist comes from
the package index like any package; nothing else is fetched. Binaries are
cached under ``$SKIFF_CACHE_DIR/llama-server/<key>/`` (default
``~/.cache/skiff``), keyed by version and flags, so a second run only prints
the path. ``bench_serving.py`` uses this build by default when it exists.

    .venv/bin/python scripts/build_llama_server.py          # prints the bin dir
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from build_llama import VERSION, cache_dir, cmake_args

TARGETS = ("llama-server", "llama-batched-bench")


def bin_dir() -> Path:
    key = hashlib.sha256(f"{VERSION} {cmake_args()} server".encode()).hexdigest()[:12]
    return cache_dir() / "llama-server" / key


def built() -> Path | None:
    """The cached ``llama-server`` binary, or None when it has not been built."""
    path = bin_dir() / "llama-server"
    return path if path.is_file() else None


def build() -> Path:
    out = bin_dir()
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "build.log"
    print(f"skiff: building llama-server {VERSION} (~10 min); log: {log_path}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp, log_path.open("w") as log:
        tmpdir = Path(tmp)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "-d", str(tmpdir), f"llama-cpp-python=={VERSION}"],
            check=True, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        (sdist,) = tmpdir.glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(tmpdir, filter="data")
        (src,) = [p for p in tmpdir.glob("llama_cpp_python-*/vendor/llama.cpp") if p.is_dir()]
        build_dir = tmpdir / "build"
        configure = [
            "cmake", "-S", str(src), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
            "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON",
            "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DBUILD_SHARED_LIBS=OFF",
            *cmake_args().split(),
        ]  # fmt: skip
        subprocess.run(configure, check=True, stdout=log, stderr=subprocess.STDOUT)
        subprocess.run(
            ["cmake", "--build", str(build_dir), "-j2", "--target", *TARGETS],
            check=True, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        for target in TARGETS:
            (binary,) = build_dir.glob(f"bin/{target}")
            shutil.copy2(binary, out / target)
    return out / "llama-server"


def main() -> None:
    server = built() or build()
    print(server.parent)


if __name__ == "__main__":
    main()
