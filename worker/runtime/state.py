"""RuntimeState: sessions <-> lanes, positions, and one forward at a time.

Every model call goes through ``forward(steps)``: one ``llama_decode`` over
steps of several sessions, then sampling, then position bookkeeping. The
invariant kept after every op is that a session's tracked position equals
the engine's (``pos_max + 1``); a mismatch raises ``PositionMismatch``
naming both figures instead of being papered over.

When a forward fails part-way, llama.cpp keeps the ubatches that completed.
We read each involved lane's real position back and move exactly the
sessions that advanced (their token history is cut to match), then raise
``EngineFault`` saying which ones moved.

Output rows (samples, logprobs, tensors) are read by ``self.rows``
(``steps.RowReader``); the prefix cache's policy is in ``prefix.py``.

With a ``Park`` (``park.py``, ``--park-bytes``) lanes are a cache over
sessions: ``admit`` parks the least recently used idle session when a new
one needs its lane (after the prefix cache's lanes, which are cheaper to
lose), and restores a parked session into a lane when it is named again.
"Idle" is the scheduler's word: ``pinned`` (set by the ``Scheduler``) says
which sessions a running job holds (by default all: nothing is parked).
Only named sessions park, and the park is entered only for them or when
the lanes are short.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from faults import BadRequest, ContextOverflow, EngineFault, PositionMismatch, SessionNotActive

from ..engine import Engine, Segment
from . import chain, prefix
from .chain import Call, Flight
from .lanes import LanePool, Session, SessionId
from .park import Park, make_room, move_cells, parkable, restore
from .prefix import MIN_PREFIX_REUSE, PrefixStats, PromptRam, window_holds
from .steps import RowReader, Step, StepResult, group_steps, output_rows
from .tail import Tail

__all__ = ["RuntimeState"]


class RuntimeState:
    def __init__(
        self,
        engine: Engine,
        prefix_cache: int = 0,
        tail: Tail | None = None,
        tap_layer: int | None = None,
        n_layer: int | None = None,
        park: Park | None = None,
        prompt_ram: PromptRam | None = None,
    ) -> None:
        if (tail is None) != (tap_layer is None):
            raise ValueError("a stage with a next stage needs a layer tap, and only it")
        self.engine = engine
        self.rows = RowReader(engine)
        # Layers of the whole model (a pipeline stage's engine holds a slice):
        # outputs are after all of them, whichever stage computed them.
        self.n_layer = n_layer or engine.n_layer
        # A pipeline stage without the model's last layer: the rest of the
        # model is ``tail``; this engine's output is layer ``tap_layer``.
        self.tail = tail
        self.tap_layer = tap_layer
        self.flights: dict[int, Flight] = {}  # tail ticket -> its forward in flight
        self.asked: dict[int, Call] = {}  # tail ticket -> a session op, query, ... in flight
        if tail is not None:
            prefix_cache = 0  # a reused lane would need the same prefix downstream
            park = None  # a stage's cells are one part of a session spread down the chain
            prompt_ram = None
        self.park = park
        self.prompt_ram = prompt_ram  # evicted cached lanes' cells (prefix.py)
        self.pinned: Callable[[SessionId], bool] = lambda _sid: True  # the Scheduler's busy
        self.lanes = LanePool(engine.n_seq, prefix_cache)
        self.ctx_per_lane = engine.n_ctx_per_seq
        self.tokens_evaluated = 0
        self.forwards = 0
        self.moves = 0  # sessions moved to close a gap between a forward's lanes
        self.rows_s = 0.0  # seconds turning forwards into rows: logits, samples (profile)
        self.prefix = PrefixStats()
        self.started = time.monotonic()

    # -- admission and lifecycle ------------------------------------------

    def admit(self, session_ids: Sequence[SessionId], ephemeral: bool = False) -> list[Session]:
        """Every named session in a lane, or ``LanesBusy`` and none: new ones
        take free lanes (parking idle sessions for room), parked ones are
        restored."""
        ids = list(session_ids)
        for sid in ids:
            if self.was_evicted(sid):  # never a fresh session in its place
                raise self.not_active(sid)
        if self.park is not None and len(self.lanes.missing(ids)) > self.lanes.free:
            make_room(self, ids)
        sessions = self.lanes.admit(ids, ephemeral)
        self._clear_evicted()
        if self.park is not None:
            sessions = [restore(self, s) if self._parked(s.id) else s for s in sessions]
        return sessions

    def _park_of(self, session_id: SessionId) -> Park | None:
        """The park, if the session could be in it: only named sessions park
        (``park.parkable``), so an ephemeral id is not even looked for."""
        return self.park if isinstance(session_id, str) else None

    def _parked(self, session_id: SessionId) -> bool:
        park = self._park_of(session_id)
        return park is not None and session_id in park

    def lanes_for(self, session_ids: Sequence[SessionId]) -> tuple[int, int]:
        """(lanes the sessions need, lanes they could get): free lanes plus,
        with a park, the idle sessions' that parking would give."""
        ids = list(session_ids)
        room = self.lanes.free + (len(parkable(self, ids)) if self.park is not None else 0)
        return len(self.lanes.missing(ids)), room

    def rename(self, old: SessionId, new: str) -> Session:
        """Give a session in a lane a name (a suspended sessionless stream's)."""
        if new in self.lanes.sessions or self.known(new) is not None:
            raise BadRequest(f"session {new!r} exists")
        session = self.lanes.sessions.pop(old)
        session.id = new
        self.lanes.sessions[new] = session
        return session

    def known(self, session_id: SessionId) -> Session | None:
        """A session this worker holds, in a lane or parked (left where it is)."""
        session, park = self.lanes.get(session_id), self._park_of(session_id)
        return park.get(session_id) if session is None and park is not None else session

    def require(self, session_id: SessionId) -> Session:
        """A session in a lane (restored first when parked), else ``SessionNotActive``."""
        session = self.lanes.get(session_id)
        if session is not None:
            return session
        if self._parked(session_id):
            (session,) = self.admit([session_id])
            return session
        raise self.not_active(session_id)

    def was_evicted(self, session_id: SessionId) -> bool:
        """Parked, then evicted past ``--park-bytes``: named, it is refused until dropped."""
        park = self._park_of(session_id)
        return park is not None and park.was_evicted(session_id)

    def not_active(self, session_id: SessionId) -> SessionNotActive:
        """The error for naming a session this worker does not hold."""
        if self.was_evicted(session_id):
            return SessionNotActive(
                f"session {str(session_id)!r} was evicted from the park (--park-bytes "
                "is full and there is no --park-dir); its state is gone: drop it to start "
                "it again"
            )
        return SessionNotActive(f"session {str(session_id)!r} is not active")

    def admit_prompt(
        self,
        session_id: SessionId,
        prompt: Sequence[int],
        ephemeral: bool = False,
        reuse: bool = True,
    ) -> tuple[Session, int]:
        """Admit a session that is about to prefill ``prompt``; reuse a cached prefix.

        Returns the session and how many prompt tokens its KV already holds
        (its position); the caller prefills the rest. A session that exists
        already is returned as it is, with 0.

        Every shared token but the last is kept (the last is computed again
        for its logits), as llama-server does; unlike there, the result is
        bit-identical to a cold prefill, because every row is computed as if
        alone (``engine.kernels``): the reused cells and the rows computed
        after them do not depend on the batches that made them.
        """
        known = self.lanes.get(session_id)
        if known is not None:
            return known, 0
        if self._parked(session_id):
            (restored,) = self.admit([session_id])
            return restored, 0
        cached = reuse and self.lanes.cached > 0
        match = self.lanes.best_prefix(prompt, len(prompt) - 1) if cached else None
        common = match[1] if match is not None else 0
        ram = self.prompt_ram
        if reuse and ram is not None and ram.entries:
            kept = ram.best(prompt, len(prompt) - 1)
            if kept is not None and kept[1] > common and kept[1] >= MIN_PREFIX_REUSE:
                return prefix.admit_from_ram(self, session_id, prompt, ephemeral, kept)
        if match is None or common < MIN_PREFIX_REUSE:
            self.prefix.misses += 1
            (session,) = self.admit([session_id], ephemeral)
            return session, 0
        lane = match[0]
        if not window_holds(self.engine, lane, common):
            self.prefix.refused_window += 1
            self.prefix.misses += 1
            (session,) = self.admit([session_id], ephemeral)
            return session, 0
        (session,) = self.lanes.admit([session_id], ephemeral, prefer=lane)
        self._clear_evicted()
        return prefix.reused(self, session, prompt, common, self.engine.seq_rm(lane, common, -1))

    def _clear_evicted(self) -> None:
        for lane in self.lanes.take_evicted():
            held = self.lanes.evicted_tokens.pop(lane, None)
            if self.prompt_ram is not None and held:
                prefix.keep_evicted(self, lane, held)  # to host memory before the lane is cleared
            self.engine.seq_clear(lane)
            self.prefix.evictions += 1

    def free_cached_kv(self) -> int:
        """Clear every prefix-cache lane's cells; how many lanes. Called when
        llama.cpp found no KV slot: in a unified cache idle cached lanes hold
        cells that live sessions need."""
        count = self.lanes.evict_cached()
        self._clear_evicted()
        return count

    def drop(self, session_id: SessionId) -> None:
        """End a session. Its lane keeps its KV for the prefix cache when the
        session's tokens provably match the engine's cells; otherwise it is cleared."""
        park = self._park_of(session_id)
        parked = park.drop(session_id) if park is not None else None
        if park is not None and park.forget_eviction(session_id):
            return  # dropping an evicted session ends it: the name is free again
        if parked is not None:
            if parked.sampler is not None:
                parked.sampler.free()
            return
        session = self.lanes.get(session_id)
        if session is None:
            raise self.not_active(session_id)
        if session.sampler is not None:
            session.sampler.free()
        keep = bool(session.tokens) and self.lanes.cache_limit > 0 and self._consistent(session)
        if not keep:
            self.engine.seq_clear(session.lane)
        self.lanes.release(session_id, keep)
        self._clear_evicted()
        if self.tail is not None and session.position > 0:
            name = str(session_id)
            self.ask("drop", session_id, lambda tail: tail.session_op("drop", name))

    def _consistent(self, session: Session) -> bool:
        return len(session.tokens) == session.position == self.engine.pos_max(session.lane) + 1

    def trim(self, session_id: SessionId, token_count: int) -> int:
        """Drop KV at and beyond ``token_count``; the session ends there."""
        session = self.require(session_id)
        if token_count > session.position:
            raise BadRequest(
                f"cannot trim session {str(session_id)!r} at {session.position} "
                f"forward to {token_count}"
            )
        if not window_holds(self.engine, session.lane, token_count):
            floor = self.engine.pos_min(session.lane) + self.engine.n_swa
            raise BadRequest(
                f"session {str(session_id)!r} holds sliding-window cells only from position "
                f"{self.engine.pos_min(session.lane)} (it was imported, or the cache keeps only "
                f"the window): trim to 0 or to at least {floor}"
            )
        if not self.engine.seq_rm(session.lane, token_count, -1):
            raise EngineFault(f"llama.cpp refused to trim lane {session.lane}", {})
        session.position = token_count
        session.pending = []
        del session.tokens[token_count:]
        self.check_position(session)
        if self.tail is not None:
            name = str(session_id)
            self.ask("trim", session_id, lambda tail: tail.session_op("trim", name, token_count))
        return session.position

    def align(self, session_id: SessionId, token_count: int) -> tuple[int | None, int | None]:
        """Trim only when the session is ahead of ``token_count``."""
        session = self.require(session_id)
        before = session.position
        if before <= token_count:
            return None, None
        return before, self.trim(session_id, token_count)

    def check_position(self, session: Session) -> None:
        engine_pos = self.engine.pos_max(session.lane) + 1
        if engine_pos != session.position:
            raise PositionMismatch(
                f"session {str(session.id)!r} on lane {session.lane}: tracked position "
                f"{session.position} != engine position {engine_pos}"
            )

    def ensure_room(self, session: Session, n_tokens: int) -> None:
        if session.position + n_tokens > self.ctx_per_lane:
            raise ContextOverflow(
                f"session {str(session.id)!r} at {session.position} + {n_tokens} tokens exceeds "
                f"its {self.ctx_per_lane} context cells"
            )

    # -- the forward -------------------------------------------------------

    def forward(self, steps: Sequence[Step]) -> list[StepResult]:
        """Run the steps' forward and sample what they ask.

        One ``llama_decode`` in the common case; steps of different
        ``Step.group``s (input embeddings, hidden-state output) run in one
        decode per group, each sampled before the next decode overwrites
        the logits.
        """
        # a stage's scheduler launches its forwards down the chain instead
        assert self.tail is None, "a chained runtime runs launch / land, not forward"
        # a gap between the lanes costs a pass over the weights (LanePool.gap_move)
        piece = any(len(s.tokens) > 1 and not s.all_rows for s in steps)
        lanes = {s.session.lane for s in steps}
        if not self.engine.kv_unified and (due := self.lanes.gap_move(lanes, piece)):
            self._move(*due)
        for step in steps:
            self.ensure_room(step.session, len(step.tokens))
        groups = group_steps(steps)
        results: list[StepResult] = [StepResult() for _ in steps]
        for (_, hidden, non_causal), indices in groups.items():
            part = [steps[i] for i in indices]
            outcome = self._forward_group(part, hidden, non_causal)
            for i, result in zip(indices, outcome, strict=True):
                results[i] = result
        return results

    def _move(self, session: Session, lane: int) -> None:
        """Move a session and its cells to ``lane`` (``park.move_cells``)."""
        src = self.lanes.move(session.id, lane)
        self._clear_evicted()  # a cached lane's prompt is kept (PromptRam) first
        if move_cells(self.engine, session, src):
            self.moves += 1
        else:
            self.lanes.move(session.id, src)  # it stays where it was

    # -- forwards through a pipeline chain, asynchronously (runtime/chain.py) --

    @property
    def chained(self) -> bool:
        """True when forwards can go out asynchronously (``launch`` / ``land``)."""
        return self.tail is not None

    def launch(self, steps: Sequence[Step]) -> Flight:
        return chain.launch(self, steps)

    def land(self, timeout_ms: int) -> list[Flight | Call]:
        return chain.land(self, timeout_ms)

    def ask(self, op: str, session: SessionId | None, send: Callable[[Tail], int]) -> Call:
        """A request down the chain, sent without waiting (``chain.ask``)."""
        return chain.ask(self, op, session, send)

    def owes(self, session_ids: Sequence[SessionId]) -> bool:
        """True while a request down the chain about one of these sessions is
        unanswered (the jobs holding them wait for it)."""
        return bool(self.asked) and any(c.session in session_ids for c in self.asked.values())

    def _forward_group(
        self, steps: Sequence[Step], hidden: bool, non_causal: bool = False
    ) -> list[StepResult]:
        segments = [
            Segment(s.session.lane, s.tokens, s.session.position, output_rows(s), s.embd)
            for s in steps
        ]
        if non_causal and sum(len(s) for s in segments) > self.engine.n_ubatch:
            # llama.cpp would abort the process; jobs check this before admission
            raise BadRequest(
                f"media of {sum(len(s) for s in segments)} tokens does not fit one "
                f"micro-batch ({self.engine.n_ubatch}, --ubatch)"
            )
        self.engine.set_hidden(hidden)
        status = self.engine.decode(segments, causal=not non_causal)
        self.forwards += 1
        if not status.ok:
            self.reconcile_after_failure(steps, status.describe())
        # Account for every step first: sampling one may fail (a grammar with
        # no allowed token) and must not leave the others' positions behind.
        for step in steps:
            session = step.session
            session.position += len(step.tokens)
            session.tokens.extend(step.tokens)
            session.last_used = time.monotonic()
            self.tokens_evaluated += len(step.tokens)
        results: list[StepResult] = []
        t0 = time.perf_counter()
        for index, step in enumerate(steps):
            result = StepResult()
            try:
                self.rows.fill(index, step, result)
            except BadRequest as exc:
                result.error = exc
            results.append(result)
        self.rows_s += time.perf_counter() - t0  # reading logits, sampling, outputs
        for step in steps:
            self.check_position(step.session)
        return results

    def reconcile_after_failure(self, steps: Sequence[Step], why: str) -> None:
        advanced: dict[str, int] = {}
        for step in steps:
            session = step.session
            engine_pos = self.engine.pos_max(session.lane) + 1
            if engine_pos == session.position:
                continue
            lo, hi = session.position, session.position + len(step.tokens)
            if not lo <= engine_pos <= hi:
                raise PositionMismatch(
                    f"after a failed decode, lane {session.lane} is at {engine_pos}, "
                    f"outside the step's span {lo}..{hi}"
                )
            session.tokens.extend(step.tokens[: engine_pos - lo])
            session.position = engine_pos
            advanced[str(session.id)] = engine_pos
            self.tokens_evaluated += engine_pos - lo
        raise EngineFault(f"llama_decode failed: {why}", advanced)
