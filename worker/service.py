"""The LLM worker as an edge service: op -> typed request -> job, turns, and
rendering outputs.

This is the worker's side of the edge line. It owns the runtime, the
scheduler and the outbox; the shared ``EdgeServer`` calls it. A ``generate``
or ``chat`` header is read by its op's reader (``api/generate.py``) into a
``Generation``, and ``generation_job`` here, the one builder, makes its job
(where the worker comes in: its draft model, chat template, projector, a
fresh ephemeral session). After each scheduler turn the service takes the
jobs' typed outputs from the outbox and renders them as wire messages:
results and events as headers, tensors as one frame (``protocol.frames``:
its map under ``"frame"`` in the result, raw buffers as extra ZeroMQ
frames, no copy), failures as error replies with their class's code.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from typing import Any

from structlog import get_logger

from edge import Handler, Outgoing, Request, bind_request, clear_request, failure_header
from faults import BadRequest, Internal, Unsupported
from protocol import frames
from protocol.transport import event_reply, ok_reply

from .api.app import App
from .api.generate import GENERATIONS, Reader
from .api.media import media_prompt
from .api.ops import DOWNSTREAM_OPS, DRAIN_OPS, OPS, allowed, refuse
from .api.requests import Generation
from .api.validate import Context
from .chain.setup import StagePlan, link_for
from .config import WorkerConfig, park_bytes, prompt_ram_bytes
from .core.chat import ChatJob, ChatTemplate
from .core.jobs.base import MAX_SPAN_ROWS, Event, Failure, Job, Outbox, Output, Tensors, Ticket
from .core.jobs.generate import GenerateJob
from .core.jobs.media import MediaGenerateJob
from .core.scheduler import Scheduler, SchedulerConfig
from .describe import worker_info, worker_stats
from .engine import Engine, LlamaGrammars
from .engine.media import Projector
from .handoff import Handoff
from .limits import exceeded
from .models import resolve_model
from .profile import Profile
from .runtime import Ephemeral, RuntimeState, SessionId
from .runtime.draft import DraftModel
from .runtime.park import Park
from .runtime.prefix import PromptRam
from .runtime.steps import AUTO_MAX_DRAFT, AUTO_NGRAM, Drafter, PromptLookup
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
            prompt_ram=PromptRam(limit) if (limit := prompt_ram_bytes(cfg)) > 0 else None,
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
            op: functools.partial(fn if allowed(op, stage) else refuse(op, stage), self)
            for op, fn in OPS.items()
        }
        for op, read in GENERATIONS.items():  # header -> Generation -> its job, here
            self._handlers[op] = (
                functools.partial(self._generation, read)
                if allowed(op, stage)
                else functools.partial(refuse(op, stage), self)
            )
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

    def _generation(self, read: Reader, req: Request) -> None:
        """A ``generate`` / ``chat``: read, built, submitted. A job refused at
        submission (a quota) frees the media it decoded; a job that runs
        frees them itself."""
        job = generation_job(self, req, read(self, req))
        try:
            self.submit(job)
        except BaseException:
            if isinstance(job, MediaGenerateJob):
                job.media.close()
            raise

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
            return DOWNSTREAM_OPS
        return DRAIN_OPS

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

    # -- cheap ops: assembled in describe.py ---------------------------------

    def info(self) -> dict[str, Any]:
        return worker_info(self)

    def stats(self) -> dict[str, Any]:
        return worker_stats(self)


def _drafter(app: App, gen: Generation) -> Drafter | None:
    """The drafter for a generation's ``speculative``, on this worker.

    Asked for none, the worker's ``--speculate auto`` drafts by prompt lookup
    while few streams decode (``PromptLookup.max_streams``): the output is
    the same to the bit either way, only sooner. Not with ``outputs``, which
    speculation does not serve.
    """
    speculation = gen.speculation
    if speculation is None:
        if app.speculate_streams is None or gen.outputs:
            return None
        return PromptLookup(AUTO_NGRAM, AUTO_MAX_DRAFT, max_streams=app.speculate_streams)
    if speculation.mode == "off":
        return None
    if speculation.mode == "prompt_lookup":
        return PromptLookup(speculation.ngram, speculation.max_draft)
    if app.draft is None:
        raise Unsupported("no draft model is configured on this worker (--draft-model)")
    if speculation.path is not None and speculation.path != app.draft.path:
        raise Unsupported(f"this worker's draft model is {app.draft.path}, not another")
    return app.draft.with_max(speculation.max_draft)


def generation_job(app: App, req: Request, gen: Generation) -> GenerateJob:
    """The job of a ``generate`` or ``chat``: text or tokens, a chat's
    rendered messages, media, or a moved stream's resume; the one builder.

    What the worker may refuse without decoding anything (the draft model)
    is asked first; media are decoded last, and freed if the job is not made.
    """
    # An ephemeral id is not a string, so no peer can name it (see ``Ephemeral``).
    session: SessionId = gen.session if gen.session is not None else Ephemeral.fresh()
    resumed_ephemeral = gen.resume is not None and gen.resume.ephemeral
    stop_extra: list[str] = []
    stop_tokens_extra: list[int] = []
    if gen.resume is not None:  # the stops in force where it ran (a chat's end of turn)
        stop_extra, stop_tokens_extra = list(gen.resume.stop), list(gen.resume.stop_tokens)
    template = app.chat
    if gen.messages is not None:  # a chat: its template's end of turn stops it too
        stop_extra = [template.end_of_turn] if template.end_of_turn else []
        stop_tokens_extra = template.stop_tokens
    kw: dict[str, Any] = {
        "ephemeral": gen.session is None or resumed_ephemeral,
        "max_tokens": gen.max_tokens,
        "spec": gen.spec,
        "stop": [*gen.stop, *(s for s in stop_extra if s not in gen.stop)],
        "stop_tokens": {*gen.stop_tokens, *stop_tokens_extra},
        "ignore_eos": gen.ignore_eos,
        "stream": gen.stream,
        "chunk": app.chunk,
        "drafter": _drafter(app, gen),
        "top_logprobs": gen.top_logprobs,
        "outputs": gen.outputs,
        "prompt_limit": app.prompt_limit,
        "resume": gen.resume,
        "span_rows": app.span_rows,
    }
    ticket = app.ticket(req)
    if gen.messages is None:  # generate: its prompt, or a moved stream's pending tokens
        prompt = gen.prompt if gen.resume is None else []
        assert prompt is not None
        if not gen.media:
            return GenerateJob(ticket, session, prompt=prompt, **kw)
        assert isinstance(prompt, str)
        text, where = prompt, "prompt"
    elif not gen.media:  # chat: the rendered messages' tokens
        tokens = template.prompt_tokens(app.engine, gen.messages, gen.tools)
        if not tokens:
            raise BadRequest("messages render to an empty prompt")
        cells, most = app.rt.ctx_per_lane, app.limits.max_request_tokens
        if most < cells and len(tokens) > most:  # over the cells: context_overflow, at start
            raise exceeded(f"messages render to {len(tokens)} tokens", most, "max_request_tokens")
        closer, bos = template.closer_tokens, template.bos
        return ChatJob(ticket, session, prompt=tokens, closer=closer, bos=bos, **kw)
    else:  # chat with media: the rendered text holds the markers
        text, where = template.render(gen.messages, tools=gen.tools), "the rendered chat"
    chat = gen.messages is not None  # rendered text: no BOS of its own, special tokens parsed
    media = media_prompt(app, text, gen.media, where, False if chat else None, chat)
    try:
        return MediaGenerateJob(
            ticket,
            session,
            prompt=text,
            media=media,
            chat=chat,
            closer=template.closer_tokens if chat else (),
            bos=template.bos if chat else None,
            **kw,
        )
    except BaseException:
        media.close()
        raise


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
        bind_request(ticket.id, ticket.op, ticket.session)
        try:
            return Outgoing(peer, failure_header(ticket.id, output.error, ticket.op))
        finally:
            clear_request()
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


__all__ = ["LlmService", "generation_job", "render"]
