"""What ``info`` and ``stats`` answer: the worker described from its parts.

Both are assembled from every part of a worker (engine, runtime, scheduler,
config, chain position), read and never changed, so they live apart from
the service that owns those parts: the service's ``info()`` / ``stats()``
hand themselves here. ``Described`` names what is read, so the report
cannot reach for more than it shows.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Protocol

from edge import process as process_stats
from protocol.transport import VERSION

from .chain.link import StageLink
from .chain.setup import StagePlan
from .config import WorkerConfig
from .core.chat import ChatTemplate
from .core.scheduler import Scheduler
from .engine import Engine
from .engine.media import Projector
from .limits import Limits
from .profile import Profile
from .runtime import RuntimeState
from .runtime.report import runtime_stats


class Described(Protocol):
    """What ``info`` and ``stats`` read of a worker (``LlmService`` is one)."""

    cfg: WorkerConfig
    engine: Engine
    rt: RuntimeState
    sched: Scheduler
    chat: ChatTemplate
    limits: Limits
    tied_head: bool | None
    projector: Projector | None
    stage: StagePlan | None
    link: StageLink | None
    requests: int
    draining: bool
    profile: Profile

    @property
    def handlers(self) -> Mapping[str, Any]: ...

    @property
    def draft(self) -> _Draft | None: ...


class _Draft(Protocol):
    """A configured draft model (``--draft-model``), by its path."""

    @property
    def path(self) -> str: ...


def worker_info(w: Described) -> dict[str, Any]:
    """``info``: the model, lanes, limits, kernels and chain position."""
    e = w.engine
    return {
        "model": {
            "path": e.cfg.model_path,
            "name": e.metadata("general.name"),
            "n_vocab": e.n_vocab,
            "n_embd": e.n_embd,
            "n_layer": w.rt.n_layer,
            "architecture": e.metadata("general.architecture"),
            "n_ctx_train": e.n_ctx_train,
            "sliding_window": e.n_swa,  # 0: no layer uses a sliding window
            "tied_head": w.tied_head,
            "has_chat_template": e.metadata("tokenizer.chat_template") is not None,
            "bos": e.bos,
            "eos": e.eos,
        },
        "lanes": w.rt.lanes.n_lanes,
        "n_ctx": e.n_ctx,
        "n_ctx_per_lane": w.rt.ctx_per_lane,
        # lanes share one KV cache (--ctx-per-lane above ctx / lanes): a
        # session's cells then depend on its neighbours (docs/exactness.md)
        "kv_unified": e.kv_unified,
        "n_batch": e.n_batch,
        "threads": w.cfg.n_threads,
        "cpus": sorted(os.sched_getaffinity(0)),  # the cores it may run on (--cpus)
        # how long idle OpenMP threads spin (None: libgomp's default)
        "omp_spincount": os.environ.get("GOMP_SPINCOUNT"),
        "max_batch_tokens": w.cfg.budget,
        "prefill_chunk": w.cfg.prefill_chunk,
        "ops": sorted(w.handlers),
        "chat_template": w.chat.info(),
        "speech": False,
        "draft_model": w.draft.path if w.draft else None,
        # prompt lookup for generations that ask for no speculation
        "speculate": {"mode": w.cfg.speculate, "max_streams": w.cfg.speculate_streams},
        "media": w.projector.info() if w.projector else None,
        # the CPU kernels this worker computes with and the exactness rule in force
        "cpu": e.cpu,
        "limits": {
            "max_message_bytes": w.cfg.max_message_bytes,
            "max_request_bytes": w.cfg.max_request_bytes,
            "max_queue": w.cfg.max_queue,
            **w.limits.as_dict(),
            "park_bytes": w.rt.park.limit if w.rt.park is not None else 0,
        },
        "protocol": VERSION,
        **(chain_info(w) or {}),
    }


def chain_info(w: Described) -> dict[str, Any] | None:
    """This stage, as the first entry of its ``chain``; a stage with a next
    stage answers ``info`` through a job that asks the rest of the chain
    (``api.handlers.h_info``), so the loop never waits for it."""
    if w.stage is None:
        return None
    mine = {**w.stage.info(), "bind": w.cfg.bind}
    if w.link is not None and w.link.head:
        # where sampled tokens come home from (3+ stages; set on the first forward)
        mine["direct_return"] = w.link.direct_endpoint
    return {"stage": mine, "chain": [mine]}


def worker_stats(w: Described) -> dict[str, Any]:
    """``stats``: the runtime's and scheduler's counters, the process, the profile."""
    out = runtime_stats(w.rt)
    out.update(w.sched.stats.snapshot())
    out["running"] = len(w.sched.active)
    out["queued"] = len(w.sched.pending)
    out["requests"] = w.requests
    out["draining"] = w.draining
    out["process"] = process_stats.snapshot()  # RSS, Python objects: leaks vs settling
    out["profile"] = w.profile.snapshot(w.rt, w.sched.stats)
    return out
