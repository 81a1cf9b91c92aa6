# One image for both workers. scripts/install builds llama-cpp-python for the
# build host's CPU without AMX (see scripts/build_llama.py).
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ cmake make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY . /app
RUN scripts/install && .venv/bin/python -c "from worker.models import default_model_path as p; p()"
ENV PATH=/app/.venv/bin:$PATH SKIFF_LOG_FORMAT=json
EXPOSE 5555 5565
CMD ["skiff-worker", "--bind", "tcp://0.0.0.0:5555"]
