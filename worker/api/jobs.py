"""A typed request becomes its job: ``generation_job``, the one builder.

The handlers (``generate.py``) read a header into a ``Generation`` in one
pass and call this last, so a request flows one way: read (``validate.py``
and the op's table), then built here, its media decoded on the way down
(``media.py``), into the core's job. Building is where the worker comes in:
its draft model (``speculative``), its chat template (rendering, tokens, the
end-of-turn stops), its projector (media), a fresh ephemeral session. Nothing
here reads the header: every value comes typed from the ``Generation``.
"""

from __future__ import annotations

import itertools
from typing import Any

from edge import Request
from faults import BadRequest, Unsupported

from ..core.chat import ChatJob
from ..core.jobs.generate import GenerateJob
from ..core.jobs.media import MediaGenerateJob
from ..core.speculative import AUTO_MAX_DRAFT, AUTO_NGRAM, Drafter, PromptLookup
from ..limits import exceeded
from ..runtime import Ephemeral, SessionId
from .app import App
from .media import media_prompt
from .requests import Generation

_ephemeral_ids = itertools.count(1)


def next_ephemeral() -> Ephemeral:
    """A fresh id for a throwaway session (sessionless generate, embed)."""
    return Ephemeral(next(_ephemeral_ids))


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
    rendered messages, media, or a moved stream's resume.

    What the worker may refuse without decoding anything (the draft model)
    is asked first; media are decoded last, and freed if the job is not made.
    """
    # An ephemeral id is not a string, so no peer can name it (see ``Ephemeral``).
    session: SessionId = gen.session if gen.session is not None else next_ephemeral()
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


def submit(app: App, job: GenerateJob) -> None:
    """Hand a generation to the scheduler; one refused there (a quota) frees
    the media it decoded (a job that runs frees them itself)."""
    try:
        app.submit(job)
    except BaseException:
        if isinstance(job, MediaGenerateJob):
            job.media.close()
        raise
