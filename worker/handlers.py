"""One handler per op, in one dispatch table.

A handler turns an edge ``Request`` (envelope already checked) into typed
values — ``bad_request`` naming the field, ``context_overflow`` for tokens
that cannot fit a session — then either answers at once (ping, info, stats,
tokenize, detokenize, cancel: the returned map is the result) or builds a
job and submits it to the scheduler (returns None; the job answers through
its ticket). Handlers never touch the socket or llama.cpp beyond the
engine's tokenizer.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from edge import Request
from faults import BadRequest, ContextOverflow, SessionNotActive, Unsupported
from protocol.envelope import Op

from .chat import ChatTemplate
from .config import WorkerConfig
from .engine import Engine
from .engine.media import Projector
from .generate import ChatJob, GenerateJob
from .jobs import (
    AtomicBatchJob,
    BatchEntry,
    DecodeJob,
    Job,
    PrefillJob,
    SessionOpJob,
    VerifyJob,
)
from .limits import Limits, check
from .runtime import Ephemeral, RuntimeState, SessionId
from .scheduler import Scheduler
from .spec import GrammarChecker, SamplerSpec
from .speculative import Drafter, DraftModel, PromptLookup
from .ticket import Ticket
from .validate import (
    check_logit_rows,
    check_request_tokens,
    check_session,
    check_token,
    get_bool,
    get_frame,
    get_int,
    get_messages,
    get_outputs,
    get_prompt_tokens,
    get_session,
    get_stops,
    get_str,
    get_tokens,
)
from .validate_sampling import get_sampling


class App(Protocol):
    """What handlers use of the worker (``service.LlmService`` provides it)."""

    cfg: WorkerConfig
    engine: Engine
    n_vocab: int
    grammars: GrammarChecker | None
    rt: RuntimeState
    sched: Scheduler
    chat: ChatTemplate
    draft: DraftModel | None
    chunk: int
    limits: Limits  # resolved: per-lane limits are numbers of cells
    projector: Projector | None  # --mmproj (media_handlers.py); None: text only

    def ticket(self, req: Request) -> Ticket: ...

    def submit(self, job: Job) -> None: ...

    def info(self) -> dict[str, Any]: ...

    def stats(self) -> dict[str, Any]: ...


Handler = Callable[[App, Request], dict[str, Any] | None]


def h_ping(app: App, req: Request) -> dict[str, Any] | None:
    return {"pong": True}


def h_info(app: App, req: Request) -> dict[str, Any] | None:
    return app.info()


def h_stats(app: App, req: Request) -> dict[str, Any] | None:
    return app.stats()


def h_tokenize(app: App, req: Request) -> dict[str, Any] | None:
    args = req.args
    parse_special = get_bool(args, "parse_special", False)
    # llama.cpp's special-token parsing is quadratic in the specials it finds
    # (measured: 1 MiB of "<start_of_turn>", 10 s with the loop blocked), so
    # such text is held to what a prompt may be; plain text to 1 MiB (linear).
    limit = app.rt.ctx_per_lane * 64 if parse_special else 1 << 20
    text = get_str(args, "text", max_len=limit)
    tokens = app.engine.tokenize(text, get_bool(args, "add_special", True), parse_special)
    return {"tokens": tokens}


def h_detokenize(app: App, req: Request) -> dict[str, Any] | None:
    tokens = get_tokens(req.args, "tokens", app.n_vocab, max_len=1 << 20, allow_empty=True)
    return {"text": app.engine.detokenize(tokens)}


def _sampling(app: App, args: dict[str, Any]) -> SamplerSpec | None:
    return get_sampling(args, grammars=app.grammars, limits=app.limits)


def _tokens(app: App, args: dict[str, Any], name: str = "tokens") -> list[int]:
    """Tokens bound for a session: ``--max-request-tokens``, then the lane's cells."""
    return get_prompt_tokens(
        args, name, app.n_vocab, app.rt.ctx_per_lane, app.limits.max_request_tokens
    )


def _prefill(app: App, req: Request, sampled: bool) -> None:
    args = req.args
    session = get_session(req.session)
    outputs = get_outputs(args)
    embd: np.ndarray | None = None
    start: int | None = None
    if "input" in args:
        if "tokens" in args:
            raise BadRequest("give tokens or input, not both")
        embd, start = _embd_input(app, req)
        tokens = [-1] * len(embd)  # no token ids: the session's history marks the gap
    else:
        tokens = _tokens(app, args)
    check_logit_rows(outputs, len(tokens))
    spec = _sampling(app, args) if sampled else None
    app.submit(
        PrefillJob(app.ticket(req), session, tokens, app.chunk, sampled, spec, outputs, embd, start)
    )


def _embd_input(app: App, req: Request) -> tuple[np.ndarray, int | None]:
    """``input``: a frame with one ``embd`` part ``[tokens, n_embd]`` f32."""
    frame = get_frame(req.args, "input", req.buffers, app.limits)
    if frame.identities != ("embd",):
        raise BadRequest("input must carry exactly one part, identity 'embd'")
    part = frame.part("embd")
    n_embd = app.engine.n_embd
    if part.dtype != "f32" or len(part.dims) != 2 or part.dims[1] != n_embd or part.token_axis != 0:
        raise BadRequest(f"input.embd must be f32 [tokens, {n_embd}] with token_axis 0")
    rows = part.dims[0]
    check_request_tokens(rows, "input.embd", app.rt.ctx_per_lane, app.limits.max_request_tokens)
    if not 0 < rows <= app.rt.ctx_per_lane:
        raise BadRequest(f"input.embd must have 1..{app.rt.ctx_per_lane} rows")
    array = frame.array("embd")
    if not np.isfinite(array).all():
        raise BadRequest("input.embd holds a NaN or infinity")
    positions = frame.positions
    if positions is not None and any(b - a != 1 for a, b in itertools.pairwise(positions)):
        raise BadRequest("input.positions must be consecutive")
    return array, (positions[0] if positions else None)


def h_prefill(app: App, req: Request) -> dict[str, Any] | None:
    _prefill(app, req, sampled=False)
    return None


def h_prefill_sampled(app: App, req: Request) -> dict[str, Any] | None:
    _prefill(app, req, sampled=True)
    return None


def h_decode(app: App, req: Request) -> dict[str, Any] | None:
    args = req.args
    session = get_session(req.session)
    token = check_token(args.get("token"), app.n_vocab, "token")
    outputs = get_outputs(args)
    app.submit(DecodeJob(app.ticket(req), session, token, _sampling(app, args), outputs))
    return None


def session_entries(app: App, args: dict[str, Any], key: str = "requests") -> list[dict[str, Any]]:
    """``args[key]``: a non-empty list of maps, one per distinct session, at
    most one per lane (multi-session ops: batches, ``forward_frame``)."""
    entries = args.get(key)
    if not isinstance(entries, list) or not entries:
        raise BadRequest(f"{key} must be a non-empty list")
    if len(entries) > app.rt.lanes.n_lanes:
        raise BadRequest(
            f"{key} has {len(entries)} entries; there are {app.rt.lanes.n_lanes} lanes"
        )
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise BadRequest(f"{key}[{i}] must be a map")
        sid = check_session(entry.get("session"), f"{key}[{i}].session")
        if sid in seen:
            raise BadRequest(f"{key}[{i}].session {sid!r} appears twice")
        seen.add(sid)
    return entries


def h_verify(app: App, req: Request) -> dict[str, Any] | None:
    args = req.args
    session = get_session(req.session)
    tokens = _tokens(app, args)
    trim = get_bool(args, "trim", True)
    app.submit(VerifyJob(app.ticket(req), session, tokens, _sampling(app, args), trim))
    return None


def _speculative(app: App, args: dict[str, Any]) -> Drafter | None:
    """The drafter a generation asked for, or None when speculation is off."""
    raw = args.get("speculative")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise BadRequest("speculative must be a map")
    mode = raw.get("mode")
    if mode not in ("prompt_lookup", "draft_model"):
        raise BadRequest("speculative.mode must be 'prompt_lookup' or 'draft_model'")
    known = (
        {"mode", "max_draft", "ngram"} if mode == "prompt_lookup" else {"mode", "max_draft", "path"}
    )
    unknown = sorted(str(k) for k in set(raw) - known)
    if unknown:
        raise BadRequest(f"speculative.{unknown[0][:64]} is not a known field")
    max_draft = get_int(raw, "max_draft", default=8, lo=1, hi=64)
    if mode == "prompt_lookup":
        return PromptLookup(get_int(raw, "ngram", default=3, lo=1, hi=16), max_draft)
    if app.draft is None:
        raise Unsupported("no draft model is configured on this worker (--draft-model)")
    path = raw.get("path")
    if path is not None and path != app.draft.path:
        raise Unsupported(f"this worker's draft model is {app.draft.path}, not another")
    return app.draft.with_max(max_draft)


def _logprobs(args: dict[str, Any]) -> int | None:
    """How many top logprobs a token event carries; None = no logprobs."""
    if not get_bool(args, "logprobs", False):
        if "top_logprobs" in args:
            raise BadRequest("top_logprobs needs logprobs: true")
        return None
    return get_int(args, "top_logprobs", default=0, lo=0, hi=20)


def h_decode_batch(app: App, req: Request) -> dict[str, Any] | None:
    args = req.args
    entries = [
        BatchEntry(
            entry["session"],
            [check_token(entry.get("token"), app.n_vocab, f"requests[{i}].token")],
            True,
            _sampling(app, entry),
        )
        for i, entry in enumerate(session_entries(app, args))
    ]
    outputs = get_outputs(args)
    app.submit(AtomicBatchJob(app.ticket(req), entries, "decode_batch", outputs=outputs))
    return None


def h_iteration_batch(app: App, req: Request) -> dict[str, Any] | None:
    args = req.args
    budget = app.cfg.budget
    entries: list[BatchEntry] = []
    starts: dict[int, int] = {}
    for i, entry in enumerate(session_entries(app, args)):
        tokens = get_tokens(entry, "tokens", app.n_vocab, max_len=budget)
        phase = entry.get("phase", "decode" if len(tokens) == 1 else "prefill")
        if phase not in ("prefill", "decode"):
            raise BadRequest(f"requests[{i}].phase must be 'prefill' or 'decode'")
        if phase == "decode" and len(tokens) != 1:
            raise BadRequest(f"requests[{i}] is a decode entry and must carry one token")
        positions = entry.get("positions")
        if positions is not None:
            ok = isinstance(positions, list) and len(positions) == len(tokens)
            ok = ok and all(type(p) is int for p in positions)
            ok = ok and all(b - a == 1 for a, b in itertools.pairwise(positions))
            if not ok:
                raise BadRequest(f"requests[{i}].positions must be consecutive, one per token")
            starts[i] = positions[0]
        sample = get_bool(entry, "sample_last", phase == "decode")
        entries.append(BatchEntry(entry["session"], tokens, sample, _sampling(app, entry)))
    total = sum(len(e.tokens) for e in entries)
    if total > budget:
        raise BadRequest(f"iteration carries {total} tokens; one forward takes {budget}")
    outputs = get_outputs(args)
    job = AtomicBatchJob(app.ticket(req), entries, "iteration", outputs, start_positions=starts)
    app.submit(job)
    return None


_ephemeral_ids = itertools.count(1)


def next_ephemeral() -> Ephemeral:
    """A fresh id for a throwaway session (sessionless generate, embed)."""
    return Ephemeral(next(_ephemeral_ids))


def _generate_session(req: Request) -> tuple[SessionId, bool]:
    """(session id, named): the request's session, or a fresh ephemeral one.

    An ephemeral id is not a string, so no peer can name it (see ``Ephemeral``).
    """
    if req.session is not None:
        return req.session, True
    return Ephemeral(next(_ephemeral_ids)), False


def generate_job(
    app: App,
    req: Request,
    prompt: str | list[int],
    make: Callable[..., GenerateJob] = GenerateJob,
    stop_tokens_extra: Sequence[int] = (),
    stop_extra: Sequence[str] = (),
) -> GenerateJob:
    """The generation job ``generate`` and ``chat`` share, from the common args."""
    args = req.args
    session, named = _generate_session(req)
    limits = app.limits
    outputs = get_outputs(args)
    drafter = _speculative(app, args)
    if outputs and drafter is not None:
        raise Unsupported("output with speculative decoding is not supported; ask one or the other")
    stop = get_stops(args, limits)
    max_tokens = get_int(args, "max_tokens", default=256, lo=1)
    check(max_tokens, limits.max_new_tokens, "max_new_tokens", f"max_tokens is {max_tokens}")
    # A text prompt is tokenized when the job starts and held to the limit then;
    # 0: only the lane's cells bound it (context_overflow).
    most = limits.max_request_tokens
    prompt_limit = most if most < app.rt.ctx_per_lane else 0
    stop_tokens = (
        get_tokens(args, "stop_tokens", app.n_vocab, max_len=256, allow_empty=True)
        if "stop_tokens" in args
        else []
    )
    return make(
        app.ticket(req),
        session,
        ephemeral=not named,
        prompt=prompt,
        max_tokens=max_tokens,
        spec=_sampling(app, args),
        stop=[*stop, *(s for s in stop_extra if s not in stop)],
        stop_tokens={*stop_tokens, *stop_tokens_extra},
        ignore_eos=get_bool(args, "ignore_eos", False),
        stream=get_bool(args, "stream", True),
        chunk=app.chunk,
        drafter=drafter,
        top_logprobs=_logprobs(args),
        outputs=outputs,
        prompt_limit=prompt_limit,
    )


def prompt_chars(app: App, args: dict[str, Any]) -> str:
    """A text prompt; one so long no tokenization could fit a session overflows
    (its tokens are held to ``--max-request-tokens`` when the job starts)."""
    limit = app.rt.ctx_per_lane * 64
    value = args.get("prompt")
    if isinstance(value, str) and len(value) > limit:
        raise ContextOverflow(
            f"prompt has {len(value)} characters; no tokenization of that fits "
            f"{app.rt.ctx_per_lane} cells"
        )
    return get_str(args, "prompt", max_len=limit)


def h_generate(app: App, req: Request) -> dict[str, Any] | None:
    args = req.args
    has_prompt, has_tokens = "prompt" in args, "tokens" in args
    if has_prompt == has_tokens:
        raise BadRequest("give exactly one of prompt or tokens")
    prompt: str | list[int] = prompt_chars(app, args) if has_prompt else _tokens(app, args)
    app.submit(generate_job(app, req, prompt))
    return None


def h_chat(app: App, req: Request) -> dict[str, Any] | None:
    args = req.args
    if "prompt" in args or "tokens" in args:
        raise BadRequest("chat takes messages, not prompt or tokens")
    cells, most = app.rt.ctx_per_lane, app.limits.max_request_tokens
    messages = get_messages(args, max_chars=cells * 64, most=app.limits.max_messages)
    template = app.chat
    tokens = template.prompt_tokens(app.engine, messages)
    if not tokens:
        raise BadRequest("messages render to an empty prompt")
    if most < cells:  # more than the cells is context_overflow when the job starts
        check(len(tokens), most, "max_request_tokens", "messages render to {n} tokens")
    end = [template.end_of_turn] if template.end_of_turn else []
    make = functools.partial(ChatJob, closer=template.closer_tokens, bos=template.bos)
    app.submit(generate_job(app, req, tokens, make, template.stop_tokens, end))
    return None


def _session_op(app: App, req: Request, op: str) -> None:
    session = get_session(req.session)
    count = 0
    if op in ("trim", "align"):
        count = get_int(req.args, "token_count", lo=0)
    elif op == "signal_window":
        count = get_int(req.args, "window_tokens", lo=1, hi=4096)
    if app.rt.lanes.get(session) is None and not app.sched.knows_session(session):
        raise SessionNotActive(f"session {session!r} is not active")
    app.submit(SessionOpJob(app.ticket(req), session, op, count))


def h_trim(app: App, req: Request) -> dict[str, Any] | None:
    _session_op(app, req, "trim")
    return None


def h_align(app: App, req: Request) -> dict[str, Any] | None:
    _session_op(app, req, "align")
    return None


def h_drop(app: App, req: Request) -> dict[str, Any] | None:
    _session_op(app, req, "drop")
    return None


def h_signal(app: App, req: Request) -> dict[str, Any] | None:
    _session_op(app, req, "signal")
    return None


def h_signal_window(app: App, req: Request) -> dict[str, Any] | None:
    _session_op(app, req, "signal_window")
    return None


def h_cancel(app: App, req: Request) -> dict[str, Any] | None:
    target = get_int(req.args, "id")
    return {"cancelled": app.sched.cancel(req.peer, target)}


HANDLERS: dict[str, Handler] = {
    Op.PING: h_ping,
    Op.INFO: h_info,
    Op.STATS: h_stats,
    Op.TOKENIZE: h_tokenize,
    Op.DETOKENIZE: h_detokenize,
    Op.PREFILL: h_prefill,
    Op.PREFILL_SAMPLED: h_prefill_sampled,
    Op.DECODE: h_decode,
    Op.DECODE_BATCH: h_decode_batch,
    Op.ITERATION_BATCH: h_iteration_batch,
    Op.TRIM: h_trim,
    Op.ALIGN: h_align,
    Op.DROP: h_drop,
    Op.GENERATE: h_generate,
    Op.CHAT: h_chat,
    Op.CANCEL: h_cancel,
    Op.VERIFY: h_verify,
    Op.SIGNAL: h_signal,
    Op.SIGNAL_WINDOW: h_signal_window,
}
