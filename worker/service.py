"""The LLM worker as an edge service: op table, turns, and rendering outputs.

This is the worker's side of the edge line. It owns the runtime, the
scheduler and the outbox; the shared ``EdgeServer`` calls it. After each
scheduler turn it takes the jobs' typed outputs from the outbox and renders
them as wire messages: results and events as headers, tensors as one
frame (``protocol.frames``: its map under ``"frame"`` in the result, raw
buffers as extra ZeroMQ frames, no copy), failures as error replies with
their class's code.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Mapping
from typing import Any

from structlog import get_logger

from edge import Handler, Outgoing, Request, failure_header, logs
from edge import process as process_stats
from faults import Internal, Unsupported
from protocol import frames
from protocol.envelope import VERSION, event_reply, ok_reply

from .api.ops import OPS
from .api.validate import Context
from .chain.setup import StagePlan, link_for
from .config import WorkerConfig, park_bytes
from .core.chat import ChatTemplate
from .core.jobs.base import MAX_SPAN_ROWS, Event, Failure, Job, Outbox, Output, Tensors, Ticket
from .core.scheduler import Scheduler, SchedulerConfig
from .core.speculative import DraftModel
from .engine import Engine, LlamaGrammars
from .engine.media import Projector
from .handoff import Handoff
from .models import resolve_model
from .profile import Profile
from .runtime import RuntimeState
from .runtime.park import Park
from .runtime.report import runtime_stats
from .slice.ggufmeta import tied_head
from .spec import GrammarChecker

_log = get_logger("skiff.worker")


def _park(cfg: WorkerConfig) -> Park | None:
    """The park of ``--park-bytes`` / ``--park-dir``; None when parking is off."""
    limit = park_bytes(cfg)
    return Park(limit, cfg.park_dir or None) if limit > 0 or cfg.park_dir else None


class LlmService:
    """One model, its lanes, its scheduler; answers through the edge."""

    def __init__(
        self,
        cfg: WorkerConfig,
        engine: Engine,
        draft: DraftModel | None = None,
        stage: StagePlan | None = None,
        projector: Projector | None = None,
    ) -> None:
        self.cfg = cfg
        self.projector = projector  # --mmproj: media in prefill_media / generate / chat
        self.engine = engine
        self.draft = draft  # speculative.mode = "draft_model"
        self.stage = stage  # a pipeline stage (``--layers``), or None for the whole model
        self.link = link_for(stage) if stage else None
        self.n_vocab = engine.n_vocab
        self.grammars: GrammarChecker | None = LlamaGrammars()
        self.rt = RuntimeState(
            engine,
            # A prefix hit on a stage would need every later stage of the chain
            # to hold the same prefix in the same lane: stages keep no cache.
            0 if stage else cfg.prefix_cache,
            tail=self.link,
            tap_layer=stage.tap_layer if stage else None,
            n_layer=stage.n_layer if stage else None,
            park=_park(cfg) if not stage else None,
        )
        self.chat = ChatTemplate.load(cfg.chat_template, engine)
        self.tied_head = tied_head(resolve_model(cfg.model))
        # Every limit on what a peer controls; per-lane ones resolved to cells.
        self.limits = cfg.limits.resolved(self.rt.ctx_per_lane)
        # what the field rules of api/validate.py need of this worker
        self.context = Context(self.limits, self.n_vocab, self.grammars, self.rt.ctx_per_lane)
        most = self.limits.max_request_tokens
        self.prompt_limit = most if most < self.rt.ctx_per_lane else 0  # api.app.App
        # Keep room for a full row of decodes beside a prefill piece, so a
        # prompt never waits on running streams (nor they on it).
        self.chunk = max(1, min(cfg.prefill_chunk, cfg.budget - cfg.lanes))
        self.speculate_streams = cfg.speculate_streams if cfg.speculate == "auto" else None
        self.span_rows = max(2, min(MAX_SPAN_ROWS, cfg.send_hwm // 2))  # api.app.App
        self.sched = Scheduler(
            self.rt,
            SchedulerConfig(
                max_batch_tokens=cfg.budget,
                max_queue=cfg.max_queue,
                admission_timeout_ms=cfg.admission_timeout_ms,
                cadence=cfg.cadence,
                chain_credit=cfg.chain_credit,
                pipeline_groups=cfg.pipeline_groups,
                prefill_chunk=cfg.prefill_chunk,
                max_sessions_per_peer=self.limits.max_sessions_per_peer,
                max_streams_per_peer=self.limits.max_streams_per_peer,
            ),
        )
        self.outbox = Outbox()
        self._handlers: dict[str, Handler] = {
            op: functools.partial(fn, self) if allowed(op, stage) else _refuse(op, stage)
            for op, fn in OPS.items()
        }
        self.requests = 0
        self.draining = False  # SIGTERM: finishing accepted work, refusing new
        self.profile = Profile()  # stats' profile: where the loop's and turns' time goes
        self.hand = Handoff(self._held_sessions)  # SIGTERM: sessions to a claimer

    # -- what handlers use ---------------------------------------------------

    def ticket(self, req: Request) -> Ticket:
        self.requests += 1
        if isinstance(req.session, str):
            self.hand.named(req.session, req.peer)
        return Ticket(
            owner=req.peer,
            id=req.id,
            op=req.op,
            outbox=self.outbox,
            session=req.session,
            deadline=req.deadline,
            received=req.received,
        )

    def submit(self, job: Job) -> None:
        self.sched.submit(job)

    # -- the edge's Service protocol -------------------------------------------

    @property
    def handlers(self) -> Mapping[str, Handler]:
        return self._handlers

    def has_work(self) -> bool:
        return self.sched.has_work() or len(self.outbox) > 0 or bool(self.hand.notices)

    def turn(self) -> list[Outgoing]:
        if self.sched.has_work():
            self.sched.turn()
        notices, self.hand.notices = self.hand.notices, []
        t0 = time.perf_counter()
        out = notices + [render_or_fail(t, output) for t, output in self.outbox.take()]
        self.profile.render_s += time.perf_counter() - t0
        return out

    def peer_lost(self, peer: bytes, reason: str) -> int:
        return self.sched.cancel_owner(peer)

    @property
    def drain_ops(self) -> frozenset[str]:
        # A stage past the first serves the head's accepted work: it keeps
        # answering the chain. Stage 0 and whole-model workers let sessions
        # be moved away (export_state) or let go (drop).
        if self.stage is not None and not self.stage.first:
            return frozenset(_DOWNSTREAM_OPS)
        return _DRAIN_OPS

    def begin_drain(self) -> None:
        """SIGTERM: tell the peers that named the sessions held here that this
        worker is leaving (``leaving``, a message without an id), so a gateway
        can move them and their streams before it goes."""
        self.draining = True
        peers, sessions = self.hand.leaving()
        if peers:
            _log.info("leaving_announced", peers=peers, sessions=sessions)

    def handoff(self, done: bool) -> list[str]:
        """A peer takes this worker's sessions (``done``: it has taken what it
        could); the named sessions still held."""
        return self.hand.claim(done)

    def _held_sessions(self) -> list[str]:
        parked = self.rt.park.sessions() if self.rt.park is not None else []
        return [
            str(s.id) for s in [*self.rt.lanes.sessions.values(), *parked] if isinstance(s.id, str)
        ]

    def idle(self) -> bool:
        """No accepted work left, and no session waiting to be handed over
        (``handoff.py``; the drain timeout bounds the wait)."""
        return not self.has_work() and not self.hand.waiting()

    def cancel_all(self, reason: str) -> int:
        _log.warning("cancel_all", reason=reason)
        self.hand.give_up()
        return self.sched.cancel_all()

    def housekeeping(self, now: float) -> None:
        """Drop named sessions nobody used for ``session_idle_s`` (gone peers' lanes)."""
        parked = self.rt.park.sessions() if self.rt.park is not None else []
        for session in [*self.rt.lanes.sessions.values(), *parked]:
            idle = now - session.last_used
            if idle > self.cfg.session_idle_s and not self.sched.knows_session(session.id):
                self.rt.drop(session.id)
                _log.info("session_expired", session=str(session.id), idle_s=round(idle, 1))
        self.hand.forget_gone()

    # -- cheap ops ---------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        e = self.engine
        return {
            "model": {
                "path": e.cfg.model_path,
                "name": e.metadata("general.name"),
                "n_vocab": e.n_vocab,
                "n_embd": e.n_embd,
                "n_layer": self.rt.n_layer,
                "architecture": e.metadata("general.architecture"),
                "n_ctx_train": e.n_ctx_train,
                "sliding_window": e.n_swa,  # 0: no layer uses a sliding window
                "tied_head": self.tied_head,
                "has_chat_template": e.metadata("tokenizer.chat_template") is not None,
                "bos": e.bos,
                "eos": e.eos,
            },
            "lanes": self.rt.lanes.n_lanes,
            "n_ctx": e.n_ctx,
            "n_ctx_per_lane": self.rt.ctx_per_lane,
            # lanes share one KV cache (--ctx-per-lane above ctx / lanes): a
            # session's cells then depend on its neighbours (docs/exactness.md)
            "kv_unified": e.kv_unified,
            "n_batch": e.n_batch,
            "threads": self.cfg.n_threads,
            "cpus": sorted(os.sched_getaffinity(0)),  # the cores it may run on (--cpus)
            # how long idle OpenMP threads spin (None: libgomp's default)
            "omp_spincount": os.environ.get("GOMP_SPINCOUNT"),
            "max_batch_tokens": self.cfg.budget,
            "prefill_chunk": self.cfg.prefill_chunk,
            "ops": sorted(self._handlers),
            "chat_template": self.chat.info(),
            "speech": False,
            "draft_model": self.draft.path if self.draft else None,
            # prompt lookup for generations that ask for no speculation
            "speculate": {"mode": self.cfg.speculate, "max_streams": self.cfg.speculate_streams},
            "media": self.projector.info() if self.projector else None,
            # the CPU kernels this worker computes with and the exactness rule in force
            "cpu": e.cpu,
            "limits": {
                "max_message_bytes": self.cfg.max_message_bytes,
                "max_request_bytes": self.cfg.max_request_bytes,
                "max_queue": self.cfg.max_queue,
                **self.limits.as_dict(),
                "park_bytes": self.rt.park.limit if self.rt.park is not None else 0,
            },
            "protocol": VERSION,
            **(self.chain_info() or {}),
        }

    def chain_info(self) -> dict[str, Any] | None:
        """This stage, as the first entry of its ``chain``; a stage with a
        next stage answers ``info`` through a job that asks the rest of the
        chain (``api.handlers.h_info``), so the loop never waits for it."""
        if self.stage is None:
            return None
        mine = {**self.stage.info(), "bind": self.cfg.bind}
        if self.link is not None and self.link.head:
            # where sampled tokens come home from (3+ stages; set on the first forward)
            mine["direct_return"] = self.link.direct_endpoint
        return {"stage": mine, "chain": [mine]}

    def stats(self) -> dict[str, Any]:
        out = runtime_stats(self.rt)
        out.update(self.sched.stats.snapshot())
        out["running"] = len(self.sched.active)
        out["queued"] = len(self.sched.pending)
        out["requests"] = self.requests
        out["draining"] = self.draining
        out["process"] = process_stats.snapshot()  # RSS, Python objects: leaks vs settling
        out["profile"] = self.profile.snapshot(self.rt, self.sched.stats)
        return out


# Ops a draining worker still serves (besides ping/info/stats/cancel): they
# move or release sessions it holds, so a gateway can take them elsewhere.
# ``generate`` only with ``resume`` (a stream whose move failed goes on here):
# its handler refuses the rest with ``shutting_down``.
_DRAIN_OPS = frozenset({"export_state", "drop", "suspend", "handoff", "generate"})

# Ops a stage that is not the first serves (its peer is the previous stage).
_DOWNSTREAM_OPS = {
    "export_state",
    "import_state",
    "signal",
    "signal_window",
    "ping",
    "info",
    "stats",
    "forward_frame",
    "trim",
    "align",
    "drop",
    "cancel",
    "tokenize",
    "detokenize",
}
# Ops the head of a chain cannot serve: they need this process's logits or all the KV.
# signal / signal_window are asked of the last stage (where the logits are);
# verify and speculative rows are sampled there (runtime.steps.RowRule);
# export_state / import_state gather every stage's cells.
_NOT_ON_CHAIN: set[str] = set()


def allowed(op: str, stage: StagePlan | None) -> bool:
    if stage is None or (stage.first and not stage.next):
        return op != "forward_frame"
    if not stage.first:
        return op in _DOWNSTREAM_OPS
    return op not in _NOT_ON_CHAIN and op != "forward_frame"


def _refuse(op: str, stage: StagePlan | None) -> Handler:
    def handler(req: Request) -> dict[str, Any] | None:
        if stage is None or stage.first:
            where = "a whole-model worker" if stage is None else "the head of a pipeline"
            raise Unsupported(f"{op} is not served by {where}")
        raise Unsupported(
            f"{op} is not served by a pipeline stage holding layers "
            f"{stage.layers[0]}:{stage.layers[1]}; send it to stage 0"
        )

    return handler


def to_frame(t: Tensors) -> frames.Frame:
    """A core ``Tensors`` as a wire frame (no copy of contiguous arrays).

    A uint16 array is bf16 bits (numpy has no bfloat16; the wire never
    carries uint16 otherwise), so ``echo`` sends a bf16 part back as bf16.
    """
    return frames.make_frame(
        [
            (name, array, t.axes.get(name, 0), *(("bf16",) if array.dtype == "<u2" else ()))
            for name, array in t.parts.items()
        ],
        producer_stage=t.producer_stage,
        layer_start=t.layer_start,
        layer_end=t.layer_end,
        positions=t.positions,
        sequence_count=t.sequence_count,
        token_count=t.token_count,
    )


def render_or_fail(ticket: Ticket, output: Output) -> Outgoing:
    """``render``, or the request's ``internal`` error when its output cannot
    be rendered: one bad output must not take the turn's other replies with it."""
    try:
        return render(ticket, output)
    except Exception as exc:
        _log.exception("render_failed", op=ticket.op)
        assert isinstance(ticket.owner, bytes)
        error = Internal(f"the reply could not be rendered: {type(exc).__name__}: {exc}")
        return Outgoing(ticket.owner, failure_header(ticket.id, error, ticket.op))


def render(ticket: Ticket, output: Output) -> Outgoing:
    """One typed output as a wire message (arrays become tensor frames)."""
    peer = ticket.owner
    assert isinstance(peer, bytes)  # the edge made the ticket from a peer id
    if isinstance(output, Failure):
        # Only a failure logs; bind the request keys for that line alone
        # (not on every streamed token).
        logs.bind_request(ticket.id, ticket.op, ticket.session)
        try:
            return Outgoing(peer, failure_header(ticket.id, output.error, ticket.op))
        finally:
            logs.clear_request()
    buffers: list[Any] = []
    data = dict(output.data)
    if output.tensors is not None:
        data["frame"] = frames.attach(to_frame(output.tensors), buffers)
    if isinstance(output, Event):
        return Outgoing(peer, event_reply(ticket.id, data), buffers)
    header = ok_reply(ticket.id, data)
    if output.done:
        header["done"] = True
    return Outgoing(peer, header, buffers)


__all__ = ["LlmService", "render"]
