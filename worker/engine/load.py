"""Loading a model: llama.cpp's backend, the model file, and one context.

``Engine(cfg)`` (``model.py``) calls ``open_context`` once and from then on
holds the handles it returns; nothing here runs after construction.

Choices that matter:
- ``swa_full=True``: Gemma 3 uses sliding-window attention; a windowed cache
  forgets old cells, which would make ``trim`` to an early position
  impossible to re-decode exactly. The full cache costs little at 270M.
- ``batch_invariant`` (the default): skiff builds llama.cpp with a small
  patch (``scripts/llama_patch.py``) whose switches, set by ``kernels`` for
  the CPU variant loaded, send every row through kernels that compute it as
  if alone. Upstream a tiled K-quant matmul takes 8+ rows and flash
  attention splits a lone row's KV across threads past 512 cells and tiles
  64+ rows: a row's logits then depended on the batch around it, the
  chunking of its prompt, the thread count and (past the sliding window) on
  how many cells its cache held, so a migrated session drifted. ggml reads
  the switches once per process, so the mode cannot change afterwards.
- ``use_extra_bufts=False`` (``--repack 0``, the default): the CPU "extra
  buffer types" repack weights for GEMM kernels that switch on with batch
  size; off, for the same reason (and the AMX repack faults on this CPU).
- ``kv_unified`` only when lanes may use more than an equal share of the
  cells; otherwise each lane owns exactly ``n_ctx / lanes`` cells.
- ``page_on_demand`` (stages): llama.cpp faults the whole file in at load;
  ``pages.release`` lets go of it so a stage holds only the pages it reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import llama_cpp as ll

from . import kernels, pages
from .tap import LayerTap


class EngineError(RuntimeError):
    """llama.cpp refused an operation (load, context, decode)."""


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    n_ctx: int = 8192
    n_seq: int = 4
    n_ctx_per_seq: int = 0  # 0 = n_ctx // n_seq
    n_batch: int = 512
    n_ubatch: int = 512
    n_threads: int = 2
    repack: bool = False
    batch_invariant: bool = True  # every row computed as if alone (see the module doc)
    kernel_rule: kernels.KernelRule | None = None  # None: the loaded CPU level's measured rule
    swa_full: bool = True  # keep every sliding-window cell (exact trim to any position)
    kv_unified: bool | None = None  # None: unified only when lanes may exceed an equal share
    # a prompt piece's last token joins the decode rows' micro-batch (Engine._decode)
    share_head: bool = True
    tap_layers: tuple[int, ...] = ()  # capture these layers' outputs (pipeline stages)
    tap_stop: bool = False  # and stop the graph after the last of them
    # after loading, keep only the model pages read since (pages.py): a stage
    page_on_demand: bool = False

    @property
    def lane_cells(self) -> int:
        """The cells a lane may use (llama.cpp may give fewer: ``Engine.n_ctx_per_seq``)."""
        return self.n_ctx_per_seq or self.n_ctx // self.n_seq

    @property
    def unified(self) -> bool:
        """Whether the lanes share one KV stream."""
        if self.kv_unified is None:
            return self.lane_cells * self.n_seq > self.n_ctx
        return self.kv_unified


def open_context(cfg: EngineConfig) -> tuple[Any, Any, LayerTap | None]:
    """Start the backend (once per process), load the model and make its
    context: the model and context handles, and the layer tap wired into it."""
    cpu = kernels.start_backend(cfg.batch_invariant, cfg.kernel_rule)
    if cpu["batch_invariant"] != cfg.batch_invariant:
        raise EngineError(
            "batch invariance is fixed once per process; this process already runs with "
            f"batch_invariant={cpu['batch_invariant']}"
        )
    mparams = ll.llama_model_default_params()
    mparams.use_extra_bufts = cfg.repack
    model = ll.llama_model_load_from_file(cfg.model_path.encode(), mparams)
    if not model:
        raise EngineError(f"cannot load model {cfg.model_path}")
    cparams = ll.llama_context_default_params()
    cparams.n_ctx = cfg.n_ctx
    cparams.n_batch = cfg.n_batch
    cparams.n_ubatch = min(cfg.n_ubatch, cfg.n_batch)
    cparams.n_seq_max = cfg.n_seq
    cparams.n_threads = cfg.n_threads
    cparams.n_threads_batch = cfg.n_threads
    cparams.swa_full = cfg.swa_full
    cparams.kv_unified = cfg.unified
    cparams.no_perf = True
    if cfg.batch_invariant:
        # The switches cover flash attention's kernels; without it (what
        # "auto" could choose) KQ would be an F16 matmul that tinyBLAS
        # tiles by batch size, so exact rows need it on.
        cparams.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED
    tap = None
    if cfg.tap_layers:
        tap = LayerTap(cfg.tap_layers, cfg.tap_stop)
        cparams.cb_eval = tap.callback
        cparams.cb_eval_user_data = None
    ctx = ll.llama_init_from_model(model, cparams)
    if not ctx:
        ll.llama_model_free(model)
        raise EngineError("cannot create llama context")
    if cfg.page_on_demand:
        pages.release(cfg.model_path)
    return model, ctx, tap
