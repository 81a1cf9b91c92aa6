"""One handler per op, in one dispatch table.

A handler validates its arguments (``bad_request`` naming the field), then
either answers at once (ping, info, stats, tokenize, detokenize, cancel) or
builds a job and submits it to the scheduler. Handlers never touch the
socket or llama.cpp directly beyond the engine's tokenizer.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from protocol.envelope import Op

from .chat import ChatJob, get_messages
from .context import RequestCtx
from .generate import GenerateJob
from .jobs import AtomicBatchJob, BatchEntry, DecodeJob, PrefillJob, SessionOpJob, VerifyJob
from .runtime import SessionNotActive, Unsupported
from .speculative import Drafter, PromptLookup
from .validate import (
    BadRequest,
    args_map,
    check_token,
    get_bool,
    get_int,
    get_sampling,
    get_session,
    get_str,
    get_tokens,
)

if TYPE_CHECKING:
    from .server import Server

Handler = Callable[["Server", RequestCtx, dict[str, Any], list[Any]], None]


def h_ping(srv: Server, ctx: RequestCtx, header: dict[str, Any], buffers: list[Any]) -> None:
    ctx.reply({"pong": True})


def h_info(srv: Server, ctx: RequestCtx, header: dict[str, Any], buffers: list[Any]) -> None:
    ctx.reply(srv.info())


def h_stats(srv: Server, ctx: RequestCtx, header: dict[str, Any], buffers: list[Any]) -> None:
    ctx.reply(srv.stats())


def h_tokenize(srv: Server, ctx: RequestCtx, header: dict[str, Any], buffers: list[Any]) -> None:
    args = args_map(header)
    text = get_str(args, "text")
    tokens = srv.engine.tokenize(
        text, get_bool(args, "add_special", True), get_bool(args, "parse_special", False)
    )
    ctx.reply({"tokens": tokens})


def h_detokenize(srv: Server, ctx: RequestCtx, header: dict[str, Any], buffers: list[Any]) -> None:
    args = args_map(header)
    tokens = get_tokens(args, "tokens", srv.engine.n_vocab, max_len=1 << 20, allow_empty=True)
    ctx.reply({"text": srv.engine.detokenize(tokens)})


def _prefill(srv: Server, ctx: RequestCtx, header: dict[str, Any], sampled: bool) -> None:
    args = args_map(header)
    session = get_session(header)
    tokens = get_tokens(args, "tokens", srv.engine.n_vocab, max_len=srv.rt.ctx_per_lane)
    spec = get_sampling(args) if sampled else None
    chunk = min(srv.cfg.prefill_chunk, srv.cfg.budget)
    srv.sched.submit(PrefillJob(ctx, session, tokens, chunk, sampled, spec))


def h_prefill(srv: Server, ctx: RequestCtx, header: dict[str, Any], buffers: list[Any]) -> None:
    _prefill(srv, ctx, header, sampled=False)


def h_prefill_sampled(
    srv: Server, ctx: RequestCtx, header: dict[str, Any], buffers: list[Any]
) -> None:
    _prefill(srv, ctx, header, sampled=True)


def h_decode(srv: Server, ctx: RequestCtx, header: dict[str, Any], buffers: list[Any]) -> None:
    args = args_map(header)
    session = get_session(header)
    token = check_token(args.get("token"), srv.engine.n_vocab, "token")
    spec = get_sampling(args)
    keep = get_bool(args, "return_logits", False)
    srv.sched.submit(DecodeJob(ctx, session, token, spec, keep))


def _entries_list(args: dict[str, Any], srv: Server) -> list[dict[str, Any]]:
    requests = args.get("requests")
    if not isinstance(requests, list) or not requests:
        raise BadRequest("requests must be a non-empty list")
    if len(requests) > srv.rt.lanes.n_lanes:
        raise BadRequest(
            f"requests has {len(requests)} entries; there are {srv.rt.lanes.n_lanes} lanes"
        )
    seen: set[str] = set()
    for i, req in enumerate(requests):
        if not isinstance(req, dict):
            raise BadRequest(f"requests[{i}] must be a map")
        sid = req.get("session")
        if not isinstance(sid, str) or not 0 < len(sid) <= 256:
            raise BadRequest(f"requests[{i}].session must be a non-empty string")
        if sid in seen:
            raise BadRequest(f"requests[{i}].session {sid!r} appears twice")
        seen.add(sid)
    return requests


def h_verify(srv: Server, ctx: RequestCtx, header: dict[str, Any], buffers: list[Any]) -> None:
    args = args_map(header)
    session = get_session(header)
    tokens = get_tokens(args, "tokens", srv.engine.n_vocab, max_len=srv.cfg.budget)
    job = VerifyJob(ctx, session, tokens, get_sampling(args), get_bool(args, "trim", True))
    srv.sched.submit(job)


def _speculative(srv: Server, args: dict[str, Any]) -> Drafter | None:
    """The drafter a generation asked for, or None when speculation is off."""
    raw = args.get("speculative")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise BadRequest("speculative must be a map")
    mode = raw.get("mode")
    known = (
        {"mode", "max_draft", "ngram"} if mode == "prompt_lookup" else {"mode", "max_draft", "path"}
    )
    if mode not in ("prompt_lookup", "draft_model"):
        raise BadRequest("speculative.mode must be 'prompt_lookup' or 'draft_model'")
    unknown = sorted(set(raw) - known)
    if unknown:
        raise BadRequest(f"speculative.{unknown[0]} is not a known field")
    max_draft = get_int(raw, "max_draft", default=8, lo=1, hi=64)
    if mode == "prompt_lookup":
        return PromptLookup(get_int(raw, "ngram", default=3, lo=1, hi=16), max_draft)
    if srv.draft is None:
        raise Unsupported("no draft model is configured on this worker (--draft-model)")
    path = raw.get("path")
    if path is not None and path != srv.draft.path:
        raise Unsupported(f"this worker's draft model is {srv.draft.path}, not {path}")
    return srv.draft.with_max(max_draft)


def _logprobs(args: dict[str, Any]) -> int | None:
    """How many top logprobs a token event carries; None = no logprobs."""
    if not get_bool(args, "logprobs", False):
        if "top_logprobs" in args:
            raise BadRequest("top_logprobs needs logprobs: true")
        return None
    return get_int(args, "top_logprobs", default=0, lo=0, hi=20)


def h_decode_batch(
    srv: Server, ctx: RequestCtx, header: dict[str, Any], buffers: list[Any]
) -> None:
    args = args_map(header)
    entries = [
        BatchEntry(
            req["session"],
            [check_token(req.get("token"), srv.engine.n_vocab, f"requests[{i}].token")],
            True,
            get_sampling(req),
        )
        for i, req in enumerate(_entries_list(args, srv))
    ]
    keep = get_bool(args, "return_logits", False)
    srv.sched.submit(AtomicBatchJob(ctx, entries, "decode_batch", return_logits=keep))


def h_iteration_batch(
    srv: Server, ctx: RequestCtx, header: dict[str, Any], buffers: list[Any]
) -> None:
    args = args_map(header)
    entries: list[BatchEntry] = []
    starts: dict[int, int] = {}
    for i, req in enumerate(_entries_list(args, srv)):
        tokens = get_tokens(req, "tokens", srv.engine.n_vocab, max_len=srv.cfg.budget)
        phase = req.get("phase", "decode" if len(tokens) == 1 else "prefill")
        if phase not in ("prefill", "decode"):
            raise BadRequest(f"requests[{i}].phase must be 'prefill' or 'decode'")
        if phase == "decode" and len(tokens) != 1:
            raise BadRequest(f"requests[{i}] is a decode entry and must carry one token")
        positions = req.get("positions")
        if positions is not None:
            ok = isinstance(positions, list) and len(positions) == len(tokens)
            ok = ok and all(isinstance(p, int) and not isinstance(p, bool) for p in positions)
            ok = ok and all(b - a == 1 for a, b in itertools.pairwise(positions))
            if not ok:
                raise BadRequest(f"requests[{i}].positions must be consecutive, one per token")
            starts[i] = positions[0]
        sample = get_bool(req, "sample_last", phase == "decode")
        entries.append(BatchEntry(req["session"], tokens, sample, get_sampling(req)))
    total = sum(len(e.tokens) for e in entries)
    if total > srv.cfg.budget:
        raise BadRequest(f"iteration carries {total} tokens; one forward takes {srv.cfg.budget}")
    srv.sched.submit(AtomicBatchJob(ctx, entries, "iteration", start_positions=starts))


_ephemeral_ids = itertools.count(1)


def _generate_session(header: dict[str, Any]) -> tuple[str, bool]:
    """(session id, named): a named session, or a fresh ephemeral one."""
    named = header.get("session") is not None
    return (get_session(header) if named else f"~gen-{next(_ephemeral_ids)}"), named


def _generate_job(
    srv: Server,
    ctx: RequestCtx,
    args: dict[str, Any],
    session: tuple[str, bool],
    prompt: str | list[int],
    make: Callable[..., GenerateJob] = GenerateJob,
    stop_tokens_extra: Sequence[int] = (),
    stop_extra: Sequence[str] = (),
) -> GenerateJob:
    """The generation job ``generate`` and ``chat`` share, from the common args."""
    limit = srv.rt.ctx_per_lane
    stop = args.get("stop", [])
    if (
        not isinstance(stop, list)
        or len(stop) > 16
        or not all(isinstance(s, str) and 0 < len(s) <= 256 for s in stop)
    ):
        raise BadRequest("stop must be a list of at most 16 non-empty strings")
    stop_tokens = (
        get_tokens(args, "stop_tokens", srv.engine.n_vocab, max_len=256, allow_empty=True)
        if "stop_tokens" in args
        else []
    )
    return make(
        ctx,
        session[0],
        ephemeral=not session[1],
        prompt=prompt,
        max_tokens=get_int(args, "max_tokens", default=256, lo=1, hi=limit),
        spec=get_sampling(args),
        stop=[*stop, *(s for s in stop_extra if s not in stop)],
        stop_tokens={*stop_tokens, *stop_tokens_extra},
        ignore_eos=get_bool(args, "ignore_eos", False),
        stream=get_bool(args, "stream", True),
        chunk=min(srv.cfg.prefill_chunk, srv.cfg.budget),
        drafter=_speculative(srv, args),
        top_logprobs=_logprobs(args),
    )


def h_generate(srv: Server, ctx: RequestCtx, header: dict[str, Any], buffers: list[Any]) -> None:
    args = args_map(header)
    session = _generate_session(header)
    has_prompt, has_tokens = "prompt" in args, "tokens" in args
    if has_prompt == has_tokens:
        raise BadRequest("give exactly one of prompt or tokens")
    limit = srv.rt.ctx_per_lane
    prompt: str | list[int] = (
        get_str(args, "prompt", max_len=limit * 64)
        if has_prompt
        else get_tokens(args, "tokens", srv.engine.n_vocab, max_len=limit)
    )
    srv.sched.submit(_generate_job(srv, ctx, args, session, prompt))


def h_chat(srv: Server, ctx: RequestCtx, header: dict[str, Any], buffers: list[Any]) -> None:
    args = args_map(header)
    session = _generate_session(header)
    if "prompt" in args or "tokens" in args:
        raise BadRequest("chat takes messages, not prompt or tokens")
    messages = get_messages(args, max_chars=srv.rt.ctx_per_lane * 64)
    template = srv.chat
    tokens = template.prompt_tokens(srv.engine, messages)
    if not tokens:
        raise BadRequest("messages render to an empty prompt")
    end = [template.end_of_turn] if template.end_of_turn else []
    make = functools.partial(ChatJob, template=template)
    job = _generate_job(srv, ctx, args, session, tokens, make, template.stop_tokens, end)
    srv.sched.submit(job)


def _session_op(srv: Server, ctx: RequestCtx, header: dict[str, Any], op: str) -> None:
    session = get_session(header)
    count = 0
    if op in ("trim", "align"):
        count = get_int(args_map(header), "token_count", lo=0)
    elif op == "signal_window":
        count = get_int(args_map(header), "window_tokens", lo=1, hi=4096)
    if srv.rt.lanes.get(session) is None and not srv.sched.knows_session(session):
        raise SessionNotActive(f"session {session!r} is not active")
    srv.sched.submit(SessionOpJob(ctx, session, op, count))


def h_trim(srv: Server, ctx: RequestCtx, header: dict[str, Any], buffers: list[Any]) -> None:
    _session_op(srv, ctx, header, "trim")


def h_align(srv: Server, ctx: RequestCtx, header: dict[str, Any], buffers: list[Any]) -> None:
    _session_op(srv, ctx, header, "align")


def h_drop(srv: Server, ctx: RequestCtx, header: dict[str, Any], buffers: list[Any]) -> None:
    _session_op(srv, ctx, header, "drop")


def h_signal(srv: Server, ctx: RequestCtx, header: dict[str, Any], buffers: list[Any]) -> None:
    _session_op(srv, ctx, header, "signal")


def h_signal_window(
    srv: Server, ctx: RequestCtx, header: dict[str, Any], buffers: list[Any]
) -> None:
    _session_op(srv, ctx, header, "signal_window")


def h_cancel(srv: Server, ctx: RequestCtx, header: dict[str, Any], buffers: list[Any]) -> None:
    target = get_int(args_map(header), "id")
    ctx.reply({"cancelled": srv.sched.cancel(ctx.peer, target)})


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
