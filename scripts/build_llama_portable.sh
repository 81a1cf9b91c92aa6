#!/usr/bin/env bash
# Build a llama-cpp-python wheel that runs on ANY x86-64 host (the container
# image), beside the tuned one scripts/build_llama.py makes for local installs.
#
# Why not the tuned build: it switches on every SIMD extension the *build*
# host reports (AVX-512 here), so an image built here dies with SIGILL on an
# older CPU. Why not a plain baseline: SSE-only ggml is several times slower on
# the AVX2/AVX-512 machines that will actually run it. So we use llama.cpp's
# runtime CPU-variant dispatch: GGML_BACKEND_DL=ON + GGML_CPU_ALL_VARIANTS=ON
# builds the CPU backend once per x86 level (x64, sse42, sandybridge, haswell,
# skylakex, icelake, zen4, alderlake, ...) as libggml-cpu-<variant>.so, and
# llama_backend_init() loads the best one the running CPU supports (each
# variant scores itself with cpuid; an unsupported one scores 0).
#
# The variants are installed to BACKEND_DIR, an absolute path compiled in as
# GGML_BACKEND_DIR (ggml's loader searches it first); the image keeps them
# there. The sapphirerapids variant is deleted: it is the only one with AMX,
# and ggml's AMX matmul faults on the AMX hosts we have seen (the same reason
# scripts/build_llama.py never enables AMX). SPR hosts then pick zen4
# (AVX-512 VBMI/VNNI/BF16), their fastest non-AMX match.
#
# The source is the same patched sdist as the tuned build's
# (scripts/llama_patch.py: the switches the worker sets for exact rows).
#
# usage: scripts/build_llama_portable.sh WHEEL_DIR BACKEND_DIR
#   PYTHON (default python3) runs pip; the version is build_llama.py's VERSION.
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: $0 WHEEL_DIR BACKEND_DIR" >&2
  exit 2
fi
wheel_dir=$1
backend_dir=$2
case $backend_dir in
  /*) ;;
  *) echo "$0: BACKEND_DIR must be absolute (it is compiled into libggml)" >&2; exit 2 ;;
esac
here=$(cd "$(dirname "$0")" && pwd)
version=$(sed -n 's/^VERSION = "\(.*\)"$/\1/p' "$here/build_llama.py")
if [ -z "$version" ]; then
  echo "$0: no VERSION in $here/build_llama.py" >&2
  exit 1
fi
PYTHON=${PYTHON:-python3}
mkdir -p "$wheel_dir" "$backend_dir"
export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DGGML_BACKEND_DIR=$backend_dir"
echo "skiff: building portable llama-cpp-python $version; CMAKE_ARGS=$CMAKE_ARGS" >&2
src_dir=$(mktemp -d)
trap 'rm -rf "$src_dir"' EXIT
src=$("$PYTHON" "$here/llama_patch.py" "$version" "$src_dir" | tail -n 1)
"$PYTHON" -m pip wheel --no-deps --no-cache-dir -w "$wheel_dir" "$src"
rm -f "$backend_dir/libggml-cpu-sapphirerapids.so"
# The baseline variant must be there, or a pre-AVX host would have no CPU backend.
for variant in x64 haswell; do
  if [ ! -f "$backend_dir/libggml-cpu-$variant.so" ]; then
    echo "$0: $backend_dir/libggml-cpu-$variant.so was not built" >&2
    exit 1
  fi
done
ls "$backend_dir" >&2
