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
from collections.abc import Mapping
from typing import Any

from structlog import get_logger

from edge import Handler, Outgoing, Request, failure_header, logs
from protocol import frames
from protocol.envelope import VERSION, event_reply, ok_reply

from .chat import ChatTemplate
from .config import WorkerConfig
from .engine import Engine, LlamaGrammars
from .handlers import HANDLERS
from .jobs import Job
from .runtime import RuntimeState
from .scheduler import Scheduler, SchedulerConfig
from .spec import GrammarChecker
from .speculative import DraftModel
from .ticket import Event, Failure, Outbox, Output, Tensors, Ticket

_log = get_logger("skiff.worker")


class LlmService:
    """One model, its lanes, its scheduler; answers through the edge."""

    def __init__(self, cfg: WorkerConfig, engine: Engine, draft: DraftModel | None = None) -> None:
        self.cfg = cfg
        self.engine = engine
        self.draft = draft  # speculative.mode = "draft_model"
        self.n_vocab = engine.n_vocab
        self.grammars: GrammarChecker | None = LlamaGrammars()
        self.rt = RuntimeState(engine, cfg.prefix_cache, cfg.prefix_reuse)
        self.chat = ChatTemplate.load(cfg.chat_template, engine)
        # A prefill piece is taken whole or waits; keep room for a full row of
        # decodes beside it so a prompt can never wait on running streams.
        self.chunk = max(1, min(cfg.prefill_chunk, cfg.budget - cfg.lanes))
        self.sched = Scheduler(
            self.rt,
            SchedulerConfig(
                max_batch_tokens=cfg.budget,
                max_queue=cfg.max_queue,
                admission_timeout_ms=cfg.admission_timeout_ms,
                cadence=cfg.cadence,
            ),
        )
        self.outbox = Outbox()
        self._handlers: dict[str, Handler] = {
            op: functools.partial(fn, self) for op, fn in HANDLERS.items()
        }
        self.requests = 0

    # -- what handlers use ---------------------------------------------------

    def ticket(self, req: Request) -> Ticket:
        self.requests += 1
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
        return self.sched.has_work() or len(self.outbox) > 0

    def turn(self) -> list[Outgoing]:
        if self.sched.has_work():
            self.sched.turn()
        return [render(ticket, output) for ticket, output in self.outbox.take()]

    def peer_lost(self, peer: bytes, reason: str) -> int:
        return self.sched.cancel_owner(peer)

    def housekeeping(self, now: float) -> None:
        """Drop named sessions nobody used for ``session_idle_s`` (gone peers' lanes)."""
        for session in list(self.rt.lanes.sessions.values()):
            idle = now - session.last_used
            if idle > self.cfg.session_idle_s and not self.sched.knows_session(session.id):
                self.rt.drop(session.id)
                _log.info("session_expired", session=str(session.id), idle_s=round(idle, 1))

    # -- cheap ops ---------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        e = self.engine
        return {
            "model": {
                "path": e.cfg.model_path,
                "name": e.metadata("general.name"),
                "n_vocab": e.n_vocab,
                "n_embd": e.n_embd,
                "n_layer": e.n_layer,
                "n_ctx_train": e.n_ctx_train,
                "bos": e.bos,
                "eos": e.eos,
            },
            "lanes": self.rt.lanes.n_lanes,
            "n_ctx": e.n_ctx,
            "n_ctx_per_lane": self.rt.ctx_per_lane,
            "n_batch": e.n_batch,
            "max_batch_tokens": self.cfg.budget,
            "prefill_chunk": self.cfg.prefill_chunk,
            "ops": sorted(self._handlers),
            "chat_template": self.chat.info(),
            "speech": False,
            "draft_model": self.draft.path if self.draft else None,
            "limits": {
                "max_message_bytes": self.cfg.max_message_bytes,
                "max_request_bytes": self.cfg.max_request_bytes,
                "max_queue": self.cfg.max_queue,
            },
            "protocol": VERSION,
        }

    def stats(self) -> dict[str, Any]:
        out = self.rt.stats()
        out.update(self.sched.stats.snapshot())
        out["running"] = len(self.sched.active)
        out["queued"] = len(self.sched.pending)
        out["requests"] = self.requests
        return out


def to_frame(t: Tensors) -> frames.Frame:
    """A core ``Tensors`` as a wire frame (no copy of contiguous arrays)."""
    return frames.make_frame(
        [(name, array, t.axes.get(name, 0)) for name, array in t.parts.items()],
        producer_stage=t.producer_stage,
        layer_start=t.layer_start,
        layer_end=t.layer_end,
        positions=t.positions,
        sequence_count=t.sequence_count,
        token_count=t.token_count,
    )


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
