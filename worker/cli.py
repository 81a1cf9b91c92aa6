"""``skiff-worker``: parse flags, load the model, serve until SIGINT/SIGTERM
(then drain: see ``edge.EdgeServer.drain``)."""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Sequence

from edge import EdgeConfig, EdgeServer, logs
from edge import metrics as edge_metrics
from edge.memory import freeze_startup_objects, reexec_with_tunables
from edge.signals import drain_on_signals, exit_watchdog
from protocol.sockets import SocketOptions

from . import config
from .chain.setup import StagePlan, plan_stage
from .engine import Engine, EngineConfig
from .engine.media import Projector
from .metrics import WorkerMetrics
from .models import resolve_model
from .runtime import DraftRuntime
from .runtime.draft import DraftModel
from .service import LlmService

# OpenMP threads must not spin long after a forward or at a barrier: a
# worker shares its cores with the socket loop, a neighbouring stage, another
# worker or the speech worker, and libgomp's default (300,000 spins, ~ms)
# starves them (edge/memory.py, docs/deploy.md "Sharing a host" for the
# measurements). An operator's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
SPIN_ENV = {"GOMP_SPINCOUNT": "1000"}


def spin_env() -> dict[str, str]:
    """The OpenMP setting to restart with, unless the operator chose one."""
    return {} if "OMP_WAIT_POLICY" in os.environ else dict(SPIN_ENV)


def build_engine(
    cfg: config.WorkerConfig, model: str | None = None, stage: StagePlan | None = None
) -> Engine:
    """The target engine, or with ``model`` a draft engine with the same lanes;
    with ``stage`` the stage's slice (tapped when it has a next stage)."""
    path = str(stage.model_path) if stage else str(resolve_model(model or cfg.model))
    return Engine(
        EngineConfig(
            model_path=path,
            n_ctx=cfg.ctx,
            n_seq=cfg.lanes,
            n_ctx_per_seq=cfg.n_ctx_per_lane,
            n_batch=cfg.batch,
            n_ubatch=cfg.ubatch,
            n_threads=cfg.n_threads,
            repack=bool(cfg.repack),
            batch_invariant=cfg.kernels == "exact",
            tap_layers=(stage.tap_layer,) if stage and stage.tap_layer is not None else (),
            tap_stop=bool(stage and stage.tap_layer is not None),
            page_on_demand=stage is not None,  # a slice's stand-ins are never read
        )
    )


# The startup check's image size. Gemma 3 resizes every image to its input
# size, so the token count is the same for any size there.
_PROBE_SIDE = 896


def load_projector(cfg: config.WorkerConfig, engine: Engine) -> Projector:
    """``--mmproj`` beside the model, refused at startup when it could not serve:
    an image decoded non-causally must fit one micro-batch (llama.cpp aborts
    the process otherwise), and M-RoPE positions are not modelled here."""
    projector = Projector.load(cfg.mmproj, engine, n_threads=cfg.n_threads)
    try:
        if projector.mrope:
            raise ValueError("--mmproj: M-RoPE projectors (Qwen2-VL style) are not supported")
        if projector.image and projector.non_causal:
            tokens = projector.image_tokens(_PROBE_SIDE, _PROBE_SIDE)
            if tokens > engine.n_ubatch:
                raise ValueError(
                    f"--mmproj: an image is {tokens} tokens, decoded in one micro-batch, "
                    f"but the micro-batch is {engine.n_ubatch}: use --ubatch and --batch "
                    f">= {tokens}"
                )
    except BaseException:
        projector.close()
        raise
    return projector


def edge_config(cfg: config.WorkerConfig) -> EdgeConfig:
    """The edge's settings from the worker's flags."""
    return EdgeConfig(
        bind=cfg.bind,
        max_header_bytes=cfg.max_request_bytes,
        socket=SocketOptions(
            max_message_bytes=cfg.max_message_bytes,
            sndhwm=cfg.send_hwm,
            curve=config.curve_keys(cfg),
        ),
        authorized=cfg.curve_authorized,
    )


def raise_fd_limit() -> None:
    """Every connected peer costs a file descriptor; allow as many as we may."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:  # a real process, not a call from Python
        reexec_with_tunables(spin_env())
    cfg = config.parse(argv)
    raise_fd_limit()
    logs.configure(cfg.log_format, cfg.log_level)
    log = logs.get_logger("skiff.cli")
    draft: DraftModel | None = None
    projector: Projector | None = None
    exporter: edge_metrics.Exporter | None = None
    try:
        if cfg.cpus:  # before llama.cpp starts a thread: they all inherit it
            os.sched_setaffinity(0, config.parse_cpus(cfg.cpus))
        stage = plan_stage(cfg)
        engine = build_engine(cfg, stage=stage)
        engine.digest.prepare()  # sessions move without hashing the model mid-turn
        if cfg.draft_model:
            if stage is not None:
                raise ValueError("--draft-model is not supported on a pipeline stage")
            path = str(resolve_model(cfg.draft_model))
            draft = DraftModel(DraftRuntime(build_engine(cfg, cfg.draft_model), path))
        if cfg.mmproj:
            if stage is not None and not stage.first:
                raise ValueError("--mmproj belongs on stage 0 (it embeds the images)")
            projector = load_projector(cfg, engine)
        service = LlmService(cfg, engine, draft=draft, stage=stage, projector=projector)
        metrics: WorkerMetrics | None = None
        if cfg.metrics_port:
            metrics = WorkerMetrics(edge_metrics.new_registry(), service)
        server = EdgeServer(edge_config(cfg), service, metrics=metrics.edge if metrics else None)
        service.profile.loop = server.timing  # stats' profile shows the loop's parts too
        registry = metrics.registry if metrics is not None else None
        exporter = edge_metrics.start(registry, cfg.metrics_port, cfg.metrics_host)
    except Exception as exc:
        log.error("startup_failed", error=str(exc))
        return 1

    drain_on_signals(server.drain, cfg.drain_timeout_s)
    frozen = freeze_startup_objects()  # a full collection never walks them mid-turn
    log.info(
        "worker_ready",
        endpoint=server.endpoint,
        lanes=service.rt.lanes.n_lanes,
        n_ctx=engine.n_ctx,
        model=engine.cfg.model_path,
        mmproj=projector.path if projector else None,
        metrics_port=exporter.port if exporter else None,
        frozen_objects=frozen,
    )
    try:
        server.serve_forever()
    finally:
        exit_watchdog()
        if exporter is not None:
            exporter.close()
        server.close()
        if projector is not None:
            projector.close()  # it points into the model: before the engine
        if service.rt.park is not None:
            service.rt.park.close()  # spilled files (--park-dir) go with the worker
        engine.close()
        if draft is not None:
            draft.runtime.close()
    log.info("worker_stopped", requests=server.requests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
