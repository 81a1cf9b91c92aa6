"""The generation ops: ``generate`` and ``chat`` (text prompts and tokens).

``read_generation`` reads what a generation asks (stops, ``max_tokens``,
speculative decoding, logprobs, outputs) into a typed ``Generation``
(``requests.py``); ``generate_job`` builds the ``GenerateJob`` / ``ChatJob``
from it, naming its session (the request's, or a fresh ephemeral one) and
its drafter. A request with media gets its decoded items from ``media.py``
and becomes a ``MediaGenerateJob`` on the same ``generate_job``.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from edge import Request
from faults import BadRequest, ShuttingDown, Unsupported
from protocol.envelope import Op

from ..core.chat import ChatJob
from ..core.jobs.generate import GenerateJob
from ..core.jobs.media import MediaGenerateJob
from ..core.media_feed import MediaPrompt
from ..core.speculative import Drafter, PromptLookup
from ..core.suspend import Resume
from ..limits import check
from ..runtime import Ephemeral, SessionId
from .app import App, Handler
from .media import chat_media, check_markers, generate_prompt, projector_of
from .requests import Generation, Speculation
from .sampling import Sampling
from .tools import read_tools
from .validate import (
    OUTPUTS,
    Bool,
    Context,
    Field,
    Int,
    PromptText,
    PromptTokens,
    Stops,
    Str,
    Tokens,
    outputs_of,
    read_fields,
)


@dataclass(frozen=True)
class _Speculative(Field):
    """``speculative``: prompt lookup or the worker's draft model; None: off."""

    nil_ok: bool = True

    def read(self, where: str, value: Any, ctx: Context) -> Speculation:
        if not isinstance(value, dict):
            raise BadRequest(f"{where} must be a map")
        mode = value.get("mode")
        if not isinstance(mode, str) or mode not in _SPECULATION:
            raise BadRequest(f"{where}.mode must be 'prompt_lookup' or 'draft_model'")
        got = read_fields(value, _SPECULATION[mode], ctx, f"{where}.", known="")
        return Speculation(**got)


@dataclass(frozen=True)
class _Utf8Tail(Field):
    """The bytes of a partial UTF-8 character (at most 3)."""

    default: bytes = b""

    def read(self, where: str, value: Any, ctx: Context) -> bytes:
        if not isinstance(value, bytes) or len(value) > 3:
            raise BadRequest(f"{where} must be at most 3 bytes (a partial UTF-8 character)")
        return value


@dataclass(frozen=True)
class _Strings(Field):
    """Non-empty strings (the stops a suspended stream had in force)."""

    default: tuple[str, ...] = ()

    def read(self, where: str, value: Any, ctx: Context) -> tuple[str, ...]:
        if not isinstance(value, list) or len(value) > 256:
            raise BadRequest(f"{where} must be a list of at most 256 strings")
        if not all(isinstance(s, str) and 0 < len(s) <= 4096 for s in value):
            raise BadRequest(f"{where} must hold non-empty strings of at most 4096 characters")
        return tuple(value)


@dataclass(frozen=True)
class _Resume(Field):
    """``resume``: where a stream suspended on another worker stood."""

    nil_ok: bool = True

    def read(self, where: str, value: Any, ctx: Context) -> Resume:
        if not isinstance(value, dict):
            raise BadRequest(f"{where} must be a map (a suspended event's resume)")
        got = read_fields(value, _RESUME, ctx, f"{where}.", known="resume")
        got["stop_tokens"] = tuple(got["stop_tokens"])
        return Resume(**got)


_COUNT = Int(0, lo=0, hi=1 << 31)
_RESUME: Final[dict[str, Field]] = {
    "completion_tokens": _COUNT,
    "prompt_tokens": _COUNT,
    "cached_tokens": _COUNT,
    "held": Str("", max_len=1 << 16),
    "utf8": _Utf8Tail(),
    "drafted": _COUNT,
    "accepted": _COUNT,
    "ephemeral": Bool(False),
    "stop": _Strings(),
    "stop_tokens": Tokens((), max_len=1024, allow_empty=True),
}

_MAX_DRAFT = Int(8, lo=1, hi=64)
_SPECULATION: Final[dict[str, dict[str, Field]]] = {
    "prompt_lookup": {"mode": Str(), "max_draft": _MAX_DRAFT, "ngram": Int(3, lo=1, hi=16)},
    "draft_model": {"mode": Str(), "max_draft": _MAX_DRAFT, "path": Str(default=None)},
}

# What ``generate`` and ``chat`` may ask beside their prompt, in the order
# the fields are checked (the first wrong one is the error).
GENERATION: Final[dict[str, Field]] = {
    "prompt": PromptText(),
    "tokens": PromptTokens(),
    **OUTPUTS,
    "speculative": _Speculative(),
    "stop": Stops(),
    "max_tokens": Int(256, lo=1, most="max_new_tokens"),
    "stop_tokens": Tokens((), max_len=256, allow_empty=True),
    "sampling": Sampling(),
    "ignore_eos": Bool(False),
    "stream": Bool(True),
    "logprobs": Bool(False),
    "top_logprobs": Int(0, lo=0, hi=20),
    "resume": _Resume(),
}


def _drafter(app: App, speculation: Speculation | None) -> Drafter | None:
    """The drafter for a generation's ``speculative``, on this worker."""
    if speculation is None:
        return None
    if speculation.mode == "prompt_lookup":
        return PromptLookup(speculation.ngram, speculation.max_draft)
    if app.draft is None:
        raise Unsupported("no draft model is configured on this worker (--draft-model)")
    if speculation.path is not None and speculation.path != app.draft.path:
        raise Unsupported(f"this worker's draft model is {app.draft.path}, not another")
    return app.draft.with_max(speculation.max_draft)


_ephemeral_ids = itertools.count(1)


def next_ephemeral() -> Ephemeral:
    """A fresh id for a throwaway session (sessionless generate, embed)."""
    return Ephemeral(next(_ephemeral_ids))


def read_generation(app: App, req: Request) -> Generation:
    """What ``generate`` and ``chat`` share, read from the header in one
    pass over ``GENERATION``; then the rules that tie two fields together."""
    args = req.args
    got = read_fields(args, GENERATION, app.context)
    outputs = outputs_of(args, got)
    if outputs and got["speculative"] is not None:
        raise Unsupported("output with speculative decoding is not supported; ask one or the other")
    if not got["logprobs"] and "top_logprobs" in args:
        raise BadRequest("top_logprobs needs logprobs: true")
    return Generation(
        session=req.session,
        max_tokens=got["max_tokens"],
        spec=got["sampling"],
        stop=got["stop"],
        stop_tokens=frozenset(got["stop_tokens"]),
        ignore_eos=got["ignore_eos"],
        stream=got["stream"],
        speculation=got["speculative"],
        top_logprobs=got["top_logprobs"] if got["logprobs"] else None,
        outputs=outputs,
        prompt=got["prompt"] if got["prompt"] is not None else got["tokens"],
        resume=got["resume"],
    )


def generate_job(
    app: App,
    req: Request,
    gen: Generation,
    prompt: str | list[int],
    make: Callable[..., GenerateJob] = GenerateJob,
    stop_tokens_extra: Sequence[int] = (),
    stop_extra: Sequence[str] = (),
) -> GenerateJob:
    """The one function that builds a generation's job from its request."""
    # An ephemeral id is not a string, so no peer can name it (see ``Ephemeral``).
    session: SessionId = gen.session if gen.session is not None else next_ephemeral()
    resumed_ephemeral = gen.resume is not None and gen.resume.ephemeral
    return make(
        app.ticket(req),
        session,
        ephemeral=gen.session is None or resumed_ephemeral,
        prompt=prompt,
        max_tokens=gen.max_tokens,
        spec=gen.spec,
        stop=[*gen.stop, *(s for s in stop_extra if s not in gen.stop)],
        stop_tokens={*gen.stop_tokens, *stop_tokens_extra},
        ignore_eos=gen.ignore_eos,
        stream=gen.stream,
        chunk=app.chunk,
        drafter=_drafter(app, gen.speculation),
        top_logprobs=gen.top_logprobs,
        outputs=gen.outputs,
        prompt_limit=app.prompt_limit,
        resume=gen.resume,
    )


def h_generate(app: App, req: Request) -> dict[str, Any] | None:
    """``generate``: a text prompt or tokens; with ``media``, a text prompt
    holding one marker per item."""
    args = req.args
    has_prompt, has_tokens = "prompt" in args, "tokens" in args
    if app.draining and "resume" not in args:  # a moved stream may come back here
        raise ShuttingDown(
            "this process is shutting down and takes no new work; retry elsewhere or later",
            retry_after_ms=1000,
        )
    if "resume" in args:  # the session's pending tokens are the prompt
        if has_prompt or has_tokens or "media" in args or req.session is None:
            raise BadRequest("a generate with resume names its session and takes no prompt")
        gen = read_generation(app, req)
        assert gen.resume is not None
        extra = gen.resume  # the stops in force where it ran (a chat's end of turn)
        job = generate_job(
            app, req, gen, [], stop_tokens_extra=extra.stop_tokens, stop_extra=extra.stop
        )
        app.submit(job)
        return None
    if "media" in args:
        projector_of(app)  # no projector: unsupported, whatever else is wrong
        if not has_prompt or has_tokens:
            raise BadRequest("generate with media takes a text prompt (with markers), not tokens")
        gen = read_generation(app, req)
        text = gen.prompt
        assert isinstance(text, str)
        media = generate_prompt(app, req, text)
        _submit(app, media, lambda: generate_job(app, req, gen, text, _media_job(media)))
        return None
    if has_prompt == has_tokens:
        raise BadRequest("give exactly one of prompt or tokens")
    gen = read_generation(app, req)
    assert gen.prompt is not None
    app.submit(generate_job(app, req, gen, gen.prompt))
    return None


def h_chat(app: App, req: Request) -> dict[str, Any] | None:
    """``chat``: messages rendered by the chat template (with ``tools``: the
    template's tool support or a preamble, ``core/tools.py``); media as
    ``image_url`` parts, or as ``media`` with markers in the text."""
    args = req.args
    if "prompt" in args or "tokens" in args:
        raise BadRequest("chat takes messages, not prompt or tokens")
    gen = read_generation(app, req)  # before any media is decoded (and must be freed)
    tools = read_tools(args)
    messages, media = chat_media(app, req)
    template = app.chat
    end = [template.end_of_turn] if template.end_of_turn else []
    if media is not None:

        def build() -> GenerateJob:
            assert media is not None
            media.text = template.render(messages, tools=tools)
            check_markers(media.projector, media.text, len(media.bitmaps), "the rendered chat")
            make = _media_job(media, chat=True, closer=template.closer_tokens, bos=template.bos)
            return generate_job(app, req, gen, media.text, make, template.stop_tokens, end)

        _submit(app, media, build)
        return None
    cells, most = app.rt.ctx_per_lane, app.limits.max_request_tokens
    tokens = template.prompt_tokens(app.engine, messages, tools)
    if not tokens:
        raise BadRequest("messages render to an empty prompt")
    if most < cells:  # more than the cells is context_overflow when the job starts
        check(len(tokens), most, "max_request_tokens", "messages render to {n} tokens")
    make = functools.partial(ChatJob, closer=template.closer_tokens, bos=template.bos)
    app.submit(generate_job(app, req, gen, tokens, make, template.stop_tokens, end))
    return None


def _media_job(media: MediaPrompt, **kw: Any) -> Callable[..., GenerateJob]:
    return functools.partial(MediaGenerateJob, media=media, **kw)


def _submit(app: App, media: MediaPrompt, build: Callable[[], GenerateJob]) -> None:
    """Build and submit a media generation; its decoded media are freed if
    that fails (a job that exists owns them)."""
    try:
        app.submit(build())
    except BaseException:
        media.close()
        raise


GENERATE_HANDLERS: dict[str, Handler] = {
    Op.GENERATE: h_generate,
    Op.CHAT: h_chat,
}
