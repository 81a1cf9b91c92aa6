"""The ``generate`` job: prompt prefill, then one token per scheduler turn.

A generation waits in the admission queue for a lane (``waits_for_lane``),
prefills its prompt in chunks (final chunk whole, so the first token does
not depend on load), then contributes one decode token to every forward
until a stop condition. Each token is streamed as an event whose ``text`` is
a UTF-8-safe delta: an incremental decoder holds back partial characters,
and text that could be the start of a stop string is held back until it is
known not to be one.

The last sampled token is not in the KV cache when generation ends (it was
never fed back). For a named session we remember it as ``pending`` and feed
it in front of the next ``generate`` prompt, so multi-turn continuation sees
exactly the text it was shown.

A running stream can move to another worker (``suspend``, a gateway's
drain): between two turns the job ends with a ``suspended`` event whose
``resume`` (``core/suspend.py``) a ``generate`` on the other worker goes on
from, with the session exported; rows are computed as if alone, so the
tokens equal those of a run that never moved.
"""

from __future__ import annotations

import codecs
import functools
import time
from typing import Any

from faults import BadRequest

from ...limits import check
from ...runtime import RuntimeState, Session, SessionId, Step, StepResult
from ...runtime.steps import Drafter, RowRule
from ...spec import SamplerSpec
from ..suspend import Resume, moved_name
from .base import (
    MAX_LOGIT_ROWS,
    MAX_SPAN_ROWS,
    PHASE_DECODE,
    PHASE_PREFILL,
    Job,
    Ticket,
    chunk_bounds,
)
from .session import tensors_of_rows


class GenerateJob(Job):
    waits_for_lane = True
    generation = True

    def __init__(
        self,
        ticket: Ticket,
        session: SessionId,
        ephemeral: bool,
        prompt: str | list[int],
        max_tokens: int,
        spec: SamplerSpec | None,
        stop: list[str],
        stop_tokens: set[int],
        ignore_eos: bool,
        stream: bool,
        chunk: int,
        drafter: Drafter | None = None,
        top_logprobs: int | None = None,
        outputs: tuple[str, ...] = (),
        prompt_limit: int = 0,
        resume: Resume | None = None,
        span_rows: int = MAX_SPAN_ROWS,
    ) -> None:
        super().__init__(ticket, [session])
        self.resume = resume  # continuing a stream suspended on another worker
        # most rows (so token events) of one speculative span: a burst of
        # accepted drafts must stay under the peer's send queue (--send-hwm)
        self.span_rows = span_rows
        # most tokens a text prompt may become (--max-request-tokens); 0 = no
        # limit but the lane's. Token prompts are held to it by the handler.
        self.prompt_limit = prompt_limit
        self.phase = PHASE_PREFILL  # PHASE_DECODE once the first token is out
        self.ephemeral = ephemeral
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.spec = spec
        self.stop = stop
        self.stop_tokens = stop_tokens
        self.ignore_eos = ignore_eos
        self.stream = stream
        self.chunk = chunk
        self.session: Session | None = None
        self.tokens: list[int] = []  # prompt tokens to prefill
        self.cached = 0  # of them, already in a reused lane's KV (prefix cache)
        self.done = 0
        self.inflight = 0
        self.next_token: int | None = None  # sampled, not yet in the KV cache
        self.completion: list[int] = []
        self.text_parts: list[str] = []
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""  # decoded text not yet emitted (possible stop prefix)
        self.t_start = 0.0
        self.t_first = 0.0
        self.drafter = drafter  # speculative decoding (prompt lookup or draft model)
        self.top_logprobs = top_logprobs  # None = no logprobs in token events
        self.drafts: list[int] = []
        self._info: dict[str, Any] | None = None  # logprobs of the token being shown
        self.logprobs: list[dict[str, Any]] = []
        self.drafted = 0
        self.accepted = 0
        self.outputs = outputs  # tensors of the row each token was sampled from
        self._row: StepResult | None = None  # that row's captured tensors
        self.rows: list[StepResult] = []  # every shown token's, for stream: false
        self.row_positions: list[int] = []
        self.n_layer = 0
        self.shown = resume.completion_tokens if resume else 0  # before this job
        if resume is not None:
            self._held = resume.held
            self._utf8.setstate((resume.utf8, 0))
            self.drafted, self.accepted = resume.drafted, resume.accepted

    # -- lifecycle -------------------------------------------------------------

    def start(self, rt: RuntimeState) -> bool:
        (sid,) = self.sessions
        known = rt.known(sid)  # in a lane or parked: a continuation either way
        if isinstance(self.prompt, str):
            fresh = known is None or (known.position == 0 and not known.pending)
            prompt = rt.engine.tokenize(self.prompt, add_special=fresh, parse_special=False)
            if self.prompt_limit:
                what = "prompt has {n} tokens"
                check(len(prompt), self.prompt_limit, "max_request_tokens", what)
        else:
            prompt = list(self.prompt)
        pending = known.pending if known is not None else []
        self.tokens = pending + prompt
        if not self.tokens:
            raise BadRequest("prompt is empty")
        # A new session may start on a cached lane that holds a prefix of the
        # prompt (an earlier turn of the same chat, a shared system prompt).
        self.session, self.cached = rt.admit_prompt(sid, self.tokens, self.ephemeral)
        if self.ephemeral:  # a moved sessionless stream's imported session, too
            self.session.ephemeral = True
        self.done = self.cached
        rt.ensure_room(self.session, len(self.tokens) - self.done)
        self.session.pending = []
        self.t_start = time.monotonic()
        self.n_layer = rt.n_layer
        return False

    def prefill_left(self) -> int:
        return len(self.tokens) - self.done

    def plan(self, rt: RuntimeState, budget: int) -> list[Step]:
        session = self.session
        assert session is not None
        if self.next_token is not None:
            if budget < 1:
                return []
            self.drafts = self._draft(rt, budget)  # sized to fit the budget
            span = [self.next_token, *self.drafts]
            rule = (
                RowRule(
                    tuple(self.drafts),
                    stop_tokens=tuple(sorted(self.stop_tokens)),
                    stop_eog=not self.ignore_eos,
                )
                if self.drafts
                else None
            )
            return [
                Step(
                    session,
                    span,
                    True,
                    self.spec,
                    all_rows=bool(self.drafts),
                    top_logprobs=self.top_logprobs,
                    outputs=self.outputs,
                    rule=rule,
                )
            ]
        total = len(self.tokens)
        n = chunk_bounds(self.done, total, self.chunk, budget)
        self.inflight = n
        if n == 0:
            return []
        last = self.done + n == total
        part = self.tokens[self.done : self.done + n]
        return [
            Step(
                session,
                part,
                last,
                self.spec,
                top_logprobs=self.top_logprobs,
                outputs=self.outputs if last else (),
            )
        ]

    def _draft(self, rt: RuntimeState, budget: int) -> list[int]:
        if self.drafter is None or self.session is None or self.next_token is None:
            return []
        # Every row of a span scores exactly as plain decoding would (rows
        # are batch-invariant), so speculation never changes the output; the
        # span is capped only to keep llama.cpp's logits buffer small.
        room = min(
            min(self.span_rows, max(MAX_LOGIT_ROWS, MAX_SPAN_ROWS // max(1, self.streams))) - 1,
            budget - 1,
            rt.ctx_per_lane - self.session.position - 1,
            self.max_tokens - self.shown - len(self.completion) - 1,
        )
        return self.drafter.draft(self.session, self.next_token, room, self.streams)

    def advance(self, rt: RuntimeState, results: list[StepResult]) -> bool:
        session = self.session
        assert session is not None
        if self.next_token is None:
            self.done += self.inflight
            if self.done < len(self.tokens):
                return False
            self.t_first = time.monotonic()
        if not self.drafts:
            token = results[0].token
            assert token is not None
            self._row = results[0] if self.outputs else None
            return self._take_all(rt, [token], session.position, [results[0].logprobs])
        # Speculative step: the span [next, d1..dk] is in the KV cache, its
        # rows sampled by the step's RowRule (here or on a pipeline's last stage).
        tokens, infos = results[0].row_tokens, results[0].row_logprobs
        assert tokens is not None and infos is not None
        start = session.position - len(self.drafts) - 1
        self.drafted += len(self.drafts)
        self.accepted += len(tokens) - 1
        if start + len(tokens) < session.position:
            rt.trim(session.id, start + len(tokens))  # drop the rejected drafts
        self.drafts = []
        return self._take_all(rt, tokens, start + 1, infos)

    def _take_all(
        self,
        rt: RuntimeState,
        tokens: list[int],
        first_position: int,
        infos: list[dict[str, Any] | None] | None = None,
    ) -> bool:
        """Emit sampled tokens in order; on a stop, cut the KV cache to match."""
        assert self.session is not None
        for j, token in enumerate(tokens):
            self._info = infos[j] if infos else None
            reason = self._take(rt, token, first_position + j)
            if reason is not None:
                if self.session.position > first_position + j:
                    rt.trim(self.session.id, first_position + j)  # a stage: answered later
                return self.after_chain(rt, functools.partial(self._finish, rt, reason))
        return False

    # -- one sampled token -----------------------------------------------------------

    def _take(self, rt: RuntimeState, token: int, position: int) -> str | None:
        """Show one sampled token; return a finish reason when generation ends."""
        assert self.session is not None
        self.next_token = None  # the token before this one is in the KV cache now
        if token in self.stop_tokens or (not self.ignore_eos and rt.engine.is_eog(token)):
            return "stop"
        self.completion.append(token)
        self.next_token = token
        self.phase = PHASE_DECODE
        self._held += self._utf8.decode(rt.engine.piece(token))
        cut = self._stop_index(self._held)
        if cut is not None:
            self._emit(token, self._held[:cut], position)
            self._held = ""
            return "stop"
        keep = self._partial_stop_len(self._held)
        delta, self._held = (
            self._held[: len(self._held) - keep],
            self._held[len(self._held) - keep :],
        )
        self._emit(token, delta, position)
        if self.shown + len(self.completion) >= self.max_tokens or position + 1 > rt.ctx_per_lane:
            return "length"
        return None

    def _stop_index(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that begins a stop string."""
        best = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if stop.startswith(text[-k:]):
                    best = k
                    break
        return best

    def _emit(self, token: int, delta: str, position: int) -> None:
        self.text_parts.append(delta)
        if self._info is not None:
            self.logprobs.append(self._info)
        row = self._row
        self._row = None
        if row is not None and not self.stream:
            self.rows.append(row)
            self.row_positions.append(position - 1)
        if self.stream:
            event = {"event": "token", "token": token, "text": delta, "position": position}
            if self._info is not None:
                event.update(self._info)
            tensors = None
            if row is not None:
                tensors = tensors_of_rows([row], [position - 1], self.n_layer)
            self.ticket.event(event, tensors)

    # -- endings ------------------------------------------------------------------

    def _finish(self, rt: RuntimeState, reason: str) -> None:
        # Text held back as a possible stop-string prefix was not one after all.
        tail = "" if reason == "stop" else self._held + self._utf8.decode(b"", final=True)
        self._held = ""
        self.text_parts.append(tail)
        if self.session is not None and not self.ephemeral and self.next_token is not None:
            # The last shown token never reached the KV cache; the next turn feeds it.
            self.session.pending = [self.next_token]
        now = time.monotonic()
        started = self.t_start or now  # never started: it queued until now
        first = self.t_first or now
        summary: dict[str, Any] = {
            "finish_reason": reason,
            "usage": self._usage(),
            "timings": {
                "queue_ms": round((started - self.ticket.received) * 1000, 3),
                "prefill_ms": round((first - started) * 1000, 3),
                "ttft_ms": round((first - self.ticket.received) * 1000, 3),
                "decode_ms": round((now - first) * 1000, 3),
            },
        }
        if self.drafter is not None:
            summary["speculative"] = {"drafted": self.drafted, "accepted": self.accepted}
        if self.stream:
            self.ticket.event({"event": "done", "done": True, "text": tail, **summary})
        else:
            result = {"text": "".join(self.text_parts), "tokens": self.completion, **summary}
            if self.top_logprobs is not None:
                result["logprobs"] = self.logprobs
            tensors = None
            if self.rows:
                tensors = tensors_of_rows(self.rows, self.row_positions, self.n_layer)
            self.ticket.reply_done(result, tensors)

    def on_cancel(self, rt: RuntimeState) -> None:
        self._finish(rt, "cancelled")

    def _usage(self) -> dict[str, int]:
        r = self.resume  # a moved stream counts as if it had never moved
        prompt = r.prompt_tokens if r else len(self.tokens)
        cached = r.cached_tokens if r else self.cached
        completion = self.shown + len(self.completion)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": cached}

    # -- moving to another worker ---------------------------------------------------

    def suspendable(self) -> bool:
        """A stream whose sampler state can travel (mirostat / xtc cannot)."""
        sampler = self.session.sampler if self.session is not None else None
        return self.stream and (sampler is None or bool(sampler.portable))

    def on_suspend(self, rt: RuntimeState) -> None:
        """End here, between two turns: what was not fed yet (the shown
        token, or the prompt's rest) becomes the session's ``pending``, and
        the final event says how to go on. A sessionless stream's session
        gets a name first, so that it can be exported like any other."""
        session = self.session
        assert session is not None
        if self.next_token is not None:
            session.pending = [self.next_token]
        else:
            session.pending = self.tokens[self.done :]
        resume = {
            **self._usage(),  # completion_tokens, prompt_tokens, cached_tokens
            "held": self._held,
            "utf8": self._utf8.getstate()[0],
            "drafted": self.drafted,
            "accepted": self.accepted,
            "stop": list(self.stop),
            "stop_tokens": sorted(self.stop_tokens),
        }
        event: dict[str, Any] = {"event": "suspended", "done": True, "resume": resume}
        if self.ephemeral:
            name = moved_name()
            rt.rename(session.id, name)
            self.sessions = (name,)
            self.ephemeral = False  # kept for export, not dropped on release
            resume["ephemeral"] = True
            event["session"] = name
        self.ticket.event(event)
