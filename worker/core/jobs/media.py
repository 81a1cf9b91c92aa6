"""Media prompts as jobs: ``prefill_media``, and ``generate`` / ``chat`` with media.

The prompt phase of each is a ``media_feed.MediaFeed``: text runs as
ordinary prefill steps, each media item as one step of input embeddings.
Gemma 3 attends both ways inside an image, and llama.cpp switches attention
to non-causal for a whole micro-batch: other sessions' rows in that batch
would see their own future. So while its next piece is a media item a job
asks for a turn alone (``wants_exclusive``): its media step is that turn's
only work and running streams wait one turn. That is the cost of media: one
exclusive turn per item (encode + one decode of its tokens).

Every check that can fail runs before the session is admitted or touched
(marker count, decoding and pixel budget at the edge; micro-batch size,
room and limits here). A ``prefill_media`` that fails or is cancelled
part-way is trimmed back to where it started.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

from faults import Cancelled, ContextOverflow, Fault, LanesBusy

from ...limits import check
from ...runtime import RuntimeState, Session, SessionId, Step, StepResult
from ...spec import SamplerSpec
from ..media_feed import MediaFeed, MediaPrompt, feed_for
from .base import PHASE_PREFILL, Job, Ticket
from .generate import GenerateJob
from .session import tensors_of


def _admission(rt: RuntimeState, sid: SessionId) -> tuple[Session | None, list[int]]:
    """The session if it exists (and its pending token), refusing at once
    when a new one could not get a lane: nothing is tokenized for nothing."""
    known = rt.known(sid)
    need, room = rt.lanes_for([sid])
    if need > room:
        raise LanesBusy("no free lane for a new session")
    return known, list(known.pending) if known is not None else []


class MediaPrefillJob(Job):
    """``prefill_media``: a media prompt into one session, then a sampled token.

    A named session's pending token (shown by a ``generate``, not yet fed)
    goes first, as a ``generate`` would feed it.
    """

    phase = PHASE_PREFILL

    def __init__(
        self,
        ticket: Ticket,
        session: SessionId,
        prompt: MediaPrompt,
        chunk: int,
        spec: SamplerSpec | None,
        outputs: tuple[str, ...] = (),
        prompt_limit: int = 0,
    ) -> None:
        super().__init__(ticket, [session])
        self.prompt = prompt
        self.chunk = chunk
        self.spec = spec
        self.outputs = outputs  # "hidden" of every prefilled position
        self.prompt_limit = prompt_limit  # --max-request-tokens; 0 = the lane's cells
        self.feed: MediaFeed | None = None
        self.session: Session | None = None
        self.position0 = 0
        self.pending: list[int] = []

    def start(self, rt: RuntimeState) -> bool:
        sid = self.sessions[0]
        known, self.pending = _admission(rt, sid)
        position = known.position if known is not None else 0
        chunks = self.prompt.tokenize(fresh=position == 0 and not self.pending)
        self.feed = feed_for(self.prompt, chunks, self.chunk, rt.engine.n_ubatch, self.pending)
        total = self.feed.total
        if self.prompt_limit:
            check(total, self.prompt_limit, "max_request_tokens", "media prompt has {n} tokens")
        if position + total > rt.ctx_per_lane:
            raise ContextOverflow(
                f"media prompt needs {total} positions; session {str(sid)!r} at {position} "
                f"has {rt.ctx_per_lane - position} of its {rt.ctx_per_lane} cells left"
            )
        (self.session,) = rt.admit([sid])
        self.position0 = self.session.position
        self.session.pending = []
        return False

    def wants_exclusive(self) -> bool:
        return self.feed is not None and self.feed.wants_exclusive()

    def plan(self, rt: RuntimeState, budget: int) -> list[Step]:
        assert self.feed is not None and self.session is not None
        outputs, capture = self.outputs, bool(self.outputs)
        return self.feed.plan(self.session, budget, self.spec, outputs, capture)

    def advance(self, rt: RuntimeState, results: list[StepResult]) -> bool:
        feed, session = self.feed, self.session
        assert feed is not None and session is not None
        last = feed.advance(results, capture=bool(self.outputs))
        if not feed.done:
            return False
        result: dict[str, Any] = {
            "token": last.token,
            "position": session.position,
            "token_count": feed.total,
            "media_tokens": feed.media_tokens,
        }
        positions = list(range(self.position0, session.position))
        self.ticket.reply(result, tensors_of(rt, feed.captured, positions))
        return True

    def _rollback(self, rt: RuntimeState) -> None:
        """Leave the session as it was before this job (a failure part-way)."""
        session = self.session
        if session is None or rt.lanes.get(session.id) is not session:
            return
        with contextlib.suppress(Fault):
            if session.position > self.position0:
                rt.trim(session.id, self.position0)
            session.pending = self.pending

    def fail(self, rt: RuntimeState, exc: BaseException) -> None:
        self._rollback(rt)
        self._close()
        super().fail(rt, exc)

    def on_cancel(self, rt: RuntimeState) -> None:
        self._rollback(rt)
        self.ticket.fail(Cancelled("request cancelled"))

    def release(self, rt: RuntimeState) -> None:
        self._close()
        super().release(rt)

    def _close(self) -> None:
        self.prompt.close()
        if self.feed is not None:
            self.feed.close()


class MediaGenerateJob(GenerateJob):
    """``generate`` / ``chat`` whose prompt carries media: the prompt phase is
    a ``MediaFeed`` (the last step samples the first token with the request's
    spec); decoding then goes on as for any generation.

    For ``chat`` (``chat=True``) a turn on a session that holds a
    conversation drops the rendered BOS and feeds ``closer`` first, as
    ``ChatJob`` does.
    """

    def __init__(
        self,
        *args: Any,
        media: MediaPrompt,
        chat: bool = False,
        closer: Sequence[int] = (),
        bos: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.media = media
        self.chat = chat
        self.closer = list(closer)
        self.bos = bos
        self.feed: MediaFeed | None = None

    def start(self, rt: RuntimeState) -> bool:
        (sid,) = self.sessions
        known, pending = _admission(rt, sid)
        fresh = known is None or (known.position == 0 and not pending)
        prefix = pending + (self.closer if self.chat and not fresh else [])
        chunks = self.media.tokenize(fresh)  # a chat's prompt says add_special=False
        drop_bos = self.bos if self.chat and not fresh else None
        self.feed = feed_for(self.media, chunks, self.chunk, rt.engine.n_ubatch, prefix, drop_bos)
        if self.prompt_limit:
            what = "prompt has {n} tokens"
            check(self.feed.total, self.prompt_limit, "max_request_tokens", what)
        (self.session,) = rt.admit([sid], self.ephemeral)
        rt.ensure_room(self.session, self.feed.total)
        self.tokens = self.feed.tokens
        self.session.pending = []
        self.t_start = time.monotonic()
        self.n_layer = rt.n_layer
        return False

    def wants_exclusive(self) -> bool:
        return self.next_token is None and self.feed is not None and self.feed.wants_exclusive()

    def plan(self, rt: RuntimeState, budget: int) -> list[Step]:
        feed, session = self.feed, self.session
        assert feed is not None and session is not None
        if feed.done:
            return super().plan(rt, budget)
        return feed.plan(session, budget, self.spec, self.outputs, False, self.top_logprobs)

    def advance(self, rt: RuntimeState, results: list[StepResult]) -> bool:
        feed, session = self.feed, self.session
        assert feed is not None and session is not None
        if feed.done:
            return super().advance(rt, results)
        first = feed.advance(results)
        if not feed.done:
            return False
        self.done = len(self.tokens)
        self.t_first = time.monotonic()
        assert first.token is not None
        self._row = first if self.outputs else None
        return self._take_all(rt, [first.token], session.position, [first.logprobs])

    def suspendable(self) -> bool:
        """Once decoding (the media are in the KV cache); a media prompt half
        fed cannot go on elsewhere, and a queued one carries its media only
        in the request (the gateway does not move those)."""
        return self.next_token is not None and super().suspendable()

    def fail(self, rt: RuntimeState, exc: BaseException) -> None:
        self._close()
        super().fail(rt, exc)

    def release(self, rt: RuntimeState) -> None:
        self._close()
        super().release(rt)

    def _close(self) -> None:
        self.media.close()
        if self.feed is not None:
            self.feed.close()
