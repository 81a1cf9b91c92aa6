"""The model-level ops' handlers: tokenize, prefill, decode, batches, verify, sessions.

A handler turns an edge ``Request`` (envelope already checked) into typed
values — ``bad_request`` naming the field, ``context_overflow`` for tokens
that cannot fit a session — then either answers at once (ping, info, stats,
tokenize, detokenize, cancel: the returned map is the result) or builds a
job and submits it to the scheduler (returns None; the job answers through
its ticket). ``info`` on a stage with a next stage is a job too: the rest
of the chain answers in a later turn. Handlers never touch the socket or llama.cpp beyond the
engine's tokenizer.

``prefill_media`` reads its header in one pass over ``PREFILL_MEDIA`` and
asks ``media.py`` for the decoded prompt. The generation ops (``generate``,
``chat``) are in ``generate.py`` (one handler each, with or without media); the ``App``
protocol, the ``Handler`` type and the shared readers in ``app.py``;
``ops.py`` joins the tables into the service's one op table.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import numpy as np

from edge import Request
from faults import BadRequest, Fault
from protocol.transport import Op

from ..core.jobs.batch import AtomicBatchJob, BatchEntry
from ..core.jobs.media import MediaPrefillJob
from ..core.jobs.session import (
    DecodeJob,
    InfoJob,
    PrefillJob,
    SessionOpJob,
    VerifyJob,
)
from .app import App, Handler, _sampling, _tokens
from .media import MediaItems, media_prompt, projector_of
from .sampling import Sampling
from .validate import (
    OUTPUTS,
    Bool,
    Field,
    Str,
    check_logit_rows,
    check_request_tokens,
    check_session,
    check_token,
    get_bool,
    get_frame,
    get_int,
    get_outputs,
    get_session,
    get_str,
    get_tokens,
    outputs_of,
    read_fields,
)


def h_ping(app: App, req: Request) -> dict[str, Any] | None:
    return {"pong": True}


def h_info(app: App, req: Request) -> dict[str, Any] | None:
    """This worker's ``info``; a stage with a next stage asks the rest of the
    chain for theirs in an ``InfoJob`` (answered in a later turn: the loop
    does not wait for the chain)."""
    here = app.info()
    if app.rt.tail is None:
        return here
    app.submit(InfoJob(app.ticket(req), functools.partial(_with_rest, here)))
    return None


def _with_rest(here: dict[str, Any], rest: dict[str, Any] | Fault) -> dict[str, Any]:
    """``info`` of a stage with the stages after it appended to its ``chain``
    (what the next stage reported), or an entry saying why they are missing."""
    chain = list(here.get("chain") or [])
    if isinstance(rest, Fault):
        stage = here.get("stage") or {}
        chain.append({"endpoint": stage.get("next"), "error": rest.message})
    else:
        more = rest.get("chain") or []
        chain.extend(more if isinstance(more, list) else [])
    return {**here, "chain": chain}


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


# ``prefill_media``'s fields; its prompt is held to a lane's characters.
PREFILL_MEDIA: dict[str, Field] = {
    **OUTPUTS,
    "sampling": Sampling(),
    "add_special": Bool(None, nil_ok=True),  # None: BOS when the session is empty
    "parse_special": Bool(False),
    "media": MediaItems(),
}


def h_prefill_media(app: App, req: Request) -> dict[str, Any] | None:
    """``prefill_media``: a text prompt with one marker per media item into a
    session, then a sampled token (``output`` may only be ``["hidden"]``)."""
    projector_of(app)  # no projector: unsupported, whatever else is wrong
    session = get_session(req.session)
    table = {"prompt": Str(max_len=app.rt.ctx_per_lane * 64), **PREFILL_MEDIA}
    got = read_fields(req.args, table, app.context.carrying(req.buffers, ""))
    outputs = outputs_of(req.args, got)
    if "logits" in outputs:
        raise BadRequest("prefill_media output may only be ['hidden'] (the sampled token is given)")
    prompt = media_prompt(
        app, got["prompt"], got["media"], "prompt", got["add_special"], got["parse_special"]
    )
    try:
        spec, limit = got["sampling"], app.prompt_limit
        app.submit(
            MediaPrefillJob(app.ticket(req), session, prompt, app.chunk, spec, outputs, limit)
        )
    except BaseException:
        prompt.close()
        raise
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


def _session_op(app: App, req: Request, op: str) -> None:
    session = get_session(req.session)
    count = 0
    if op in ("trim", "align"):
        count = get_int(req.args, "token_count", lo=0)
    elif op == "signal_window":
        count = get_int(req.args, "window_tokens", lo=1, hi=4096)
    evicted_drop = op == "drop" and app.rt.was_evicted(session)  # frees the name
    if app.rt.known(session) is None and not app.sched.knows_session(session) and not evicted_drop:
        raise app.rt.not_active(session)
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


def h_suspend(app: App, req: Request) -> dict[str, Any] | None:
    """``suspend``: one of this peer's streams stops between two tokens with a
    ``suspended`` event carrying ``resume`` (a gateway moving it)."""
    target = get_int(req.args, "id")
    return {"suspended": app.sched.suspend(req.peer, target)}


def h_handoff(app: App, req: Request) -> dict[str, Any] | None:
    """``handoff``: a peer told ``leaving`` takes this worker's sessions (the
    drain waits for them); ``done: true`` when it has taken what it could."""
    return {"sessions": app.handoff(get_bool(req.args, "done", False))}


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
    Op.PREFILL_MEDIA: h_prefill_media,
    Op.DECODE: h_decode,
    Op.DECODE_BATCH: h_decode_batch,
    Op.ITERATION_BATCH: h_iteration_batch,
    Op.TRIM: h_trim,
    Op.ALIGN: h_align,
    Op.DROP: h_drop,
    Op.CANCEL: h_cancel,
    Op.SUSPEND: h_suspend,
    Op.HANDOFF: h_handoff,
    Op.VERIFY: h_verify,
    Op.SIGNAL: h_signal,
    Op.SIGNAL_WINDOW: h_signal_window,
}
