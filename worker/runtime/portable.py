"""Session state that leaves one worker and continues on another.

``export_session`` reads a session's KV cells out of llama.cpp
(``llama_state_seq_get_data``) together with what the session needs beyond
its cells: its tokens and position, a token shown but not yet fed
(``pending``), and its sampler's state when that can be carried (see
``Sampler.portable``). ``import_session`` checks everything against this
worker before touching the cache — the model file's sha256, the cache
layout, token ids, lengths — then loads the cells and verifies that
llama.cpp really holds ``position`` tokens afterwards (its setter returns 0
on failure instead of raising). Any failure leaves the lane cleared and the
session gone, never half-imported.

State is only valid between workers of the same model file and the same
cache layout; the identity the engine reports (``Engine.identity``) is
compared field by field and a mismatch names the field.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from faults import BadRequest, SessionNotActive

from ..engine import EngineError, Sampler, SamplerError
from ..spec import SamplerSpec, spec_to_wire
from .lanes import Session, SessionId
from .state import RuntimeState

STATE_VERSION = 1
_KEYS = {"version", "identity", "tokens", "position", "pending", "last_token", "sampler"}
_INFORMATIVE = {"layout", "sampler_dropped"}
# A pipeline stage's state also lists the states of the stages below it
# (checked by ``ImportStateJob``, which hands them down the chain).
_CHAIN = {"downstream"}


def export_session(rt: RuntimeState, session_id: SessionId) -> tuple[dict[str, Any], np.ndarray]:
    """(meta, kv bytes as a uint8 array) of a session; the session stays
    (a parked one is read from the park: it needs no lane)."""
    parked = rt.park is not None and rt.lanes.get(session_id) is None and session_id in rt.park
    if parked:
        assert rt.park is not None
        session, kv = rt.park.peek(session_id)
    else:
        session = rt.require(session_id)
        rt.check_position(session)
        kv = rt.engine.state_get(session.lane)
    sampler: dict[str, Any] | None = None
    sampler_note: str | None = None
    if session.sampler is not None:
        if session.sampler.portable:
            sampler = {"spec": spec_to_wire(session.sampler.spec), **session.sampler.state()}
        else:
            sampler_note = "mirostat and xtc sampler state is not carried"
    meta: dict[str, Any] = {
        "version": STATE_VERSION,
        "identity": rt.engine.identity(),
        "layout": rt.engine.layout(),
        "tokens": list(session.tokens),
        "position": session.position,
        "pending": list(session.pending),
        "last_token": session.last_token,
        "sampler": sampler,
    }
    if sampler_note:
        meta["sampler_dropped"] = sampler_note
    return meta, kv


def _int_list(value: Any, field: str, n_vocab: int, limit: int, allow_gap: bool) -> list[int]:
    """Token ids (``-1`` marks a position fed as an input embedding)."""
    if not isinstance(value, list) or len(value) > limit:
        raise BadRequest(f"session_state.{field} must be a list of at most {limit} token ids")
    lo = -1 if allow_gap else 0
    for i, t in enumerate(value):
        if type(t) is not int or not lo <= t < n_vocab:
            raise BadRequest(f"session_state.{field}[{i}] is not a token id of this model")
    return list(value)


def check_meta(rt: RuntimeState, meta: Any) -> dict[str, Any]:
    """Validate a saved state's header against this worker; names the field."""
    if not isinstance(meta, dict):
        raise BadRequest("session_state must be a map")
    unknown = sorted(str(k)[:64] for k in set(meta) - _KEYS - _INFORMATIVE - _CHAIN)
    if unknown:
        raise BadRequest(f"session_state.{unknown[0]} is not a known field")
    if meta.get("version") != STATE_VERSION:
        raise BadRequest(f"session_state.version must be {STATE_VERSION}")
    mine = rt.engine.identity()
    theirs = meta.get("identity")
    if not isinstance(theirs, dict):
        raise BadRequest("session_state.identity must be a map")
    for key, value in mine.items():
        if theirs.get(key) != value:
            raise BadRequest(
                f"session_state.identity.{key} is {str(theirs.get(key))[:80]!r}; this worker "
                f"has {value!r}: the state was saved by another model or cache layout"
            )
    n_vocab = rt.engine.n_vocab
    tokens = _int_list(meta.get("tokens"), "tokens", n_vocab, rt.ctx_per_lane, allow_gap=True)
    position = meta.get("position")
    if type(position) is not int or position != len(tokens) or position < 1:
        raise BadRequest("session_state.position must equal the number of tokens (at least 1)")
    pending = _int_list(meta.get("pending", []), "pending", n_vocab, 1, allow_gap=False)
    last = meta.get("last_token")
    if last is not None and (type(last) is not int or not 0 <= last < n_vocab):
        raise BadRequest("session_state.last_token is not a token id of this model")
    sampler = meta.get("sampler")
    if sampler is not None and not isinstance(sampler, dict):
        raise BadRequest("session_state.sampler must be a map or null")
    return {"tokens": tokens, "position": position, "pending": pending, "last_token": last}


def _restore_sampler(rt: RuntimeState, session: Session, raw: dict[str, Any], spec: Any) -> None:
    fed = _int_list(raw.get("fed", []), "sampler.fed", rt.engine.n_vocab, 1 << 20, False)
    gfed = _int_list(
        raw.get("grammar_fed", []), "sampler.grammar_fed", rt.engine.n_vocab, 1 << 20, False
    )
    runs = raw.get("runs")
    if type(runs) is not int or not 0 <= runs <= 1 << 24:
        raise BadRequest("session_state.sampler.runs must be a non-negative integer")
    try:
        sampler = Sampler(rt.engine, spec)
    except SamplerError as exc:
        raise BadRequest(f"session_state.sampler: {exc}") from exc
    try:
        sampler.restore(fed, gfed, runs)
    except SamplerError as exc:
        sampler.free()
        raise BadRequest(f"session_state.sampler: {exc}") from exc
    session.sampler = sampler


def _fill(
    rt: RuntimeState,
    session: Session,
    meta: Any,
    fields: dict[str, Any],
    sampler_spec: SamplerSpec | None,
) -> None:
    """What an imported session holds beside its cells: tokens, position, the
    pending token, and its sampler (restored when the state carries one)."""
    session.tokens = fields["tokens"]
    session.position = fields["position"]
    session.pending = fields["pending"]
    session.last_token = fields["last_token"]
    raw = meta.get("sampler")
    if raw is not None and sampler_spec is not None:
        _restore_sampler(rt, session, raw, sampler_spec)


def _import_parked(
    rt: RuntimeState,
    session_id: SessionId,
    meta: Any,
    fields: dict[str, Any],
    kv: np.ndarray,
    sampler_spec: SamplerSpec | None,
) -> Session:
    """Every lane is held by running work: the imported session goes straight
    to the park (llama.cpp sees its cells when it is first named; a state it
    refuses then fails that request and ends the session)."""
    assert rt.park is not None
    if not rt.park.fits(kv.nbytes):
        raise BadRequest("the kv_state is larger than this worker's whole park (--park-bytes)")
    session = Session(session_id, -1)
    _fill(rt, session, meta, fields, sampler_spec)
    rt.park.put(session, np.array(kv, dtype=np.uint8, copy=True))
    return session


def import_session(
    rt: RuntimeState,
    session_id: SessionId,
    meta: Any,
    kv: np.ndarray,
    sampler_spec: SamplerSpec | None = None,
) -> Session:
    """Load a saved state into a new session ``session_id`` (see the module doc).

    ``sampler_spec`` is the saved sampler's spec, already validated by the
    edge from ``meta["sampler"]["spec"]``.
    """
    fields = check_meta(rt, meta)
    if rt.known(session_id) is not None:
        raise BadRequest(f"session {str(session_id)!r} exists on this worker; drop it first")
    if kv.ndim != 1 or kv.nbytes == 0:
        raise BadRequest("the kv_state part must be a non-empty byte vector")
    need, room = rt.lanes_for([session_id])
    if rt.park is not None and need > room:
        return _import_parked(rt, session_id, meta, fields, kv, sampler_spec)
    (session,) = rt.admit([session_id])
    try:
        if rt.engine.pos_max(session.lane) >= 0:  # a cached lane's cells: not ours
            rt.engine.seq_clear(session.lane)
        try:
            loaded = rt.engine.state_set(session.lane, kv)
        except EngineError as exc:
            raise BadRequest(f"kv_state: {exc}") from None
        if not loaded:
            raise BadRequest(
                "llama.cpp refused the kv_state (corrupt, or the session does not fit a lane)"
            )
        held = rt.engine.pos_max(session.lane) + 1
        if held != fields["position"] or (
            rt.engine.n_swa == 0 and rt.engine.pos_min(session.lane) > 0
        ):
            raise BadRequest(
                f"the kv_state holds positions up to {held}, the header says {fields['position']}"
            )
        _fill(rt, session, meta, fields, sampler_spec)
        rt.check_position(session)
    except BaseException:
        rt.engine.seq_clear(session.lane)
        session.tokens = []
        session.position = 0
        with contextlib.suppress(SessionNotActive):
            rt.drop(session_id)
        raise
    return session
