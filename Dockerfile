# syntax=docker/dockerfile:1
# One image for every skiff process: skiff-worker (default), skiff-speech,
# skiff-gateway. It must run on ANY x86-64 host, so llama.cpp is NOT built the
# way scripts/install builds it for a developer's own CPU (scripts/build_llama.py
# turns on every SIMD extension the build host has, e.g. AVX-512: SIGILL on an
# older CPU). scripts/build_llama_portable.sh builds llama.cpp's CPU backend
# once per x86 level and lets llama_backend_init() pick the best one the
# running CPU supports (GGML_BACKEND_DL + GGML_CPU_ALL_VARIANTS). The model is
# not in the image: compose's model-init service / the Kubernetes init
# container write it to a volume from the pip package the image carries.
# See docs/deploy.md.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc g++ cmake ninja-build \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/skiff/venv
ENV PATH=/opt/skiff/venv/bin:$PATH
WORKDIR /src
# The llama.cpp layer depends only on these two files, so source edits do not
# rebuild it (it is the slow one: every CPU variant is compiled).
COPY scripts/build_llama.py scripts/llama_patch.py scripts/llama_tiled_dot.cpp scripts/llama_fa_rows.cpp scripts/llama_q8_gemm.cpp scripts/build_llama_portable.sh scripts/
ARG BUILD_JOBS=
RUN CMAKE_BUILD_PARALLEL_LEVEL=${BUILD_JOBS:-$(nproc)} PYTHON=/opt/skiff/venv/bin/python \
        scripts/build_llama_portable.sh /tmp/wheels /opt/skiff/ggml \
    && pip install --no-deps /tmp/wheels/llama_cpp_python-*.whl \
    && pip install typing-extensions numpy diskcache jinja2 \
    && rm -rf /tmp/wheels
COPY pyproject.toml README.md ./
COPY faults faults
COPY protocol protocol
COPY edge edge
COPY worker worker
COPY speech speech
COPY loadtest loadtest
COPY gateway gateway
# The pinned llama-cpp-python is already there, so pip keeps the portable build.
RUN pip install ".[speech]"

FROM ${PYTHON_IMAGE} AS runtime
# libgomp1: ggml's CPU backends use OpenMP (gcc brought it in the build stage).
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --user-group --create-home --home-dir /home/skiff skiff \
    && mkdir -p /var/lib/skiff/models \
    && chown -R skiff:skiff /var/lib/skiff
# Same base image and same path as in the build stage, so the venv works as is.
COPY --from=build /opt/skiff /opt/skiff
ENV PATH=/opt/skiff/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    SKIFF_CACHE_DIR=/var/lib/skiff \
    SKIFF_LOG_FORMAT=json \
    SKIFF_SPEECH_LOG_FORMAT=json
# Fail the build, not the first request, if no CPU variant loads here. Ask
# through libllama's handle: llama_cpp._ggml loads a second copy of libggml
# (the wheel holds libggml.so and libggml.so.0 as two files) whose registry
# never sees the backends libllama loaded.
RUN python -c "import llama_cpp as ll; ll.llama_backend_init(); lib = ll.llama_cpp._lib; \
assert lib.ggml_backend_dev_count() > 0, 'no ggml CPU backend loaded'"
USER skiff
WORKDIR /home/skiff
# No VOLUME line (it would give the gateway and speech worker anonymous volumes);
# a fresh named volume mounted at /var/lib/skiff copies this directory's owner.
EXPOSE 5550 5555 5565 8000 9100
CMD ["skiff-worker", "--bind", "tcp://0.0.0.0:5555"]
