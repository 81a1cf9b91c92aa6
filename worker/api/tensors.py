"""Handlers of the ops whose requests or answers are tensors.

``embed``, ``export_state`` / ``import_state`` (session state), ``echo``
(frame path checks) and ``forward_frame`` (stage to stage). Same rules as
``handlers``: validate into typed values at the edge, then submit a job.
``TENSOR_HANDLERS`` is one part of the op table (``ops.py``).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import numpy as np

from edge import Request
from faults import BadRequest, ContextOverflow
from protocol.transport import Op

from ..core.jobs.base import Tensors
from ..core.jobs.tensors import (
    POOLINGS,
    EmbedJob,
    ExportStateJob,
    ImportStateJob,
    StageForwardJob,
    StageStep,
)
from ..limits import Limits
from ..runtime import Ephemeral, Origin, wire
from ..runtime.steps import RowRule
from ..spec import SamplerSpec
from .app import App, Handler
from .handlers import session_entries
from .sampling import get_sampling
from .validate import (
    check_request_tokens,
    get_bool,
    get_frame,
    get_int,
    get_outputs,
    get_prompt_tokens,
    get_session,
    get_str,
)


def h_embed(app: App, req: Request) -> dict[str, Any] | None:
    args = req.args
    has_text, has_tokens = "text" in args, "tokens" in args
    if has_text == has_tokens:
        raise BadRequest("give exactly one of text or tokens")
    limit, most = app.rt.ctx_per_lane, app.limits.max_request_tokens
    if has_text:
        text = get_str(args, "text", max_len=limit * 64)
        tokens = app.engine.tokenize(text, add_special=True)
        if not tokens:
            raise ContextOverflow(f"text is {len(tokens)} tokens; 1..{limit} fit a session")
        check_request_tokens(len(tokens), "text", limit, most)
    else:
        tokens = get_prompt_tokens(args, "tokens", app.n_vocab, limit, most)
    pooling = args.get("pooling", "mean")
    if pooling not in POOLINGS:
        raise BadRequest(f"pooling must be one of {list(POOLINGS)}")
    if req.session is not None:
        raise BadRequest("embed is stateless: give no session")
    session = Ephemeral.fresh()
    app.submit(EmbedJob(app.ticket(req), session, tokens, app.chunk, pooling))
    return None


def h_export_state(app: App, req: Request) -> dict[str, Any] | None:
    session = get_session(req.session)
    if app.rt.known(session) is None and not app.sched.knows_session(session):
        raise app.rt.not_active(session)
    app.submit(ExportStateJob(app.ticket(req), [session]))
    return None


def h_import_state(app: App, req: Request) -> dict[str, Any] | None:
    args = req.args
    session = get_session(req.session)
    meta = args.get("session_state")
    if not isinstance(meta, dict):
        raise BadRequest("session_state must be a map (export_state's result)")
    frame = get_frame(args, "frame", req.buffers, app.limits)
    names = ("kv_state", *(f"kv_state.{i + 1}" for i in range(len(frame.identities) - 1)))
    if frame.identities != names or any(p.dtype != "u8" for p in frame.parts):
        raise BadRequest(
            "frame must carry u8 parts 'kv_state' (and 'kv_state.1', ... for the stages "
            "below, in order)"
        )
    kv = frame.array("kv_state").reshape(-1)
    below = [frame.array(name).reshape(-1) for name in names[1:]]
    raw = meta.get("sampler")
    spec = None
    if isinstance(raw, dict):
        spec = get_sampling(
            {"session_state.sampler.spec": raw.get("spec")},
            "session_state.sampler.spec",
            grammars=app.grammars,
            limits=app.limits,
        )
    app.submit(ImportStateJob(app.ticket(req), session, meta, kv, spec, below))
    return None


def h_echo(app: App, req: Request) -> dict[str, Any] | None:
    """Send a request's frame back (frame-path checks and benchmarks)."""
    frame = get_frame(req.args, "frame", req.buffers, app.limits)
    tensors = Tensors(
        frame.arrays(),
        list(frame.positions) if frame.positions is not None else None,
        frame.sequence_count,
        frame.layer_start,
        frame.layer_end,
        axes={p.identity: p.token_axis for p in frame.parts},
        token_count=frame.token_count,
        producer_stage=frame.producer_stage,
    )
    app.ticket(req).reply({}, tensors)
    return None


def h_forward_frame(app: App, req: Request) -> dict[str, Any] | None:
    """Stage to stage: run this stage's layers over an upstream stage's rows
    (the step fields: ``runtime/wire.py``; each checked here)."""
    args = req.args
    frame = get_frame(args, "input", req.buffers, app.limits)
    n_embd = app.engine.n_embd
    if frame.identities != ("hidden",):
        raise BadRequest("input must carry exactly one part, identity 'hidden'")
    part = frame.part("hidden")
    shape_ok = len(part.dims) == 2 and part.dims[1] == n_embd and part.token_axis == 0
    if part.dtype not in ("f32", "f16") or not shape_ok:
        raise BadRequest(f"input.hidden must be f32 or f16 [tokens, {n_embd}], token_axis 0")
    rows = frame.array("hidden")
    if part.dtype == "f16":
        rows = rows.astype(np.float32)  # the engine takes f32 rows
    steps: list[StageStep] = []
    row = 0
    for i, entry in enumerate(session_entries(app, args, "steps")):
        sid = entry["session"]
        unknown = sorted(str(k) for k in set(entry) - wire.STEP_FIELDS)
        if unknown:
            raise BadRequest(f"steps[{i}].{unknown[0][:64]} is not a forward_frame step field")
        tokens = entry.get("tokens")
        if (
            not isinstance(tokens, list)
            or not tokens
            or not all(type(t) is int and -1 <= t < app.n_vocab for t in tokens)
        ):
            raise BadRequest(f"steps[{i}].tokens must be token ids (-1: fed as embeddings)")
        position = get_int(entry, "position", lo=0, hi=app.rt.ctx_per_lane)
        top = entry.get("top_logprobs")
        if top is not None and (type(top) is not int or not 0 <= top <= 20):
            raise BadRequest(f"steps[{i}].top_logprobs must be 0..20 or null")
        outputs = get_outputs({"output": entry.get("output") or None})
        spec = _stage_spec(app, entry)
        n = len(tokens)
        steps.append(
            StageStep(
                sid,
                tokens,
                position,
                get_bool(entry, "sample", False),
                spec,
                outputs,
                get_bool(entry, "capture_all", False),
                top,
                rows[row : row + n],
                get_bool(entry, "all_rows", False),
                _row_rule(app, entry.get("rule"), i, n),
                _origin(entry.get("origin"), i),
                get_bool(entry, "non_causal", False),
            )
        )
        row += n
    if row != len(rows):
        raise BadRequest(f"steps carry {row} tokens but input.hidden has {len(rows)} rows")
    if row > app.cfg.budget:
        raise BadRequest(f"forward_frame carries {row} rows; one forward takes {app.cfg.budget}")
    app.submit(StageForwardJob(app.ticket(req), steps))
    return None


# A stream's sampling map comes with every forward of it down the chain; a
# stage checks it (and parses its grammar) once, then reuses the spec.
# Keyed by the checker and limits too: a map valid under one worker's limits
# may not be under another's (tests run several in one process).
_STAGE_SPECS: OrderedDict[tuple[int, Limits, str], SamplerSpec | None] = OrderedDict()
_STAGE_SPECS_MAX = 256


def _stage_spec(app: App, entry: dict[str, Any]) -> SamplerSpec | None:
    raw = entry.get("sampling")
    if raw is None:
        return None
    try:
        key = (id(app.grammars), app.limits, json.dumps(raw, sort_keys=True))
    except (TypeError, ValueError):  # not JSON-like: checked (and refused) below
        return get_sampling(entry, "sampling", grammars=app.grammars, limits=app.limits)
    if key in _STAGE_SPECS:
        _STAGE_SPECS.move_to_end(key)
        return _STAGE_SPECS[key]
    spec = get_sampling(entry, "sampling", grammars=app.grammars, limits=app.limits)
    _STAGE_SPECS[key] = spec
    if len(_STAGE_SPECS) > _STAGE_SPECS_MAX:
        _STAGE_SPECS.popitem(last=False)
    return spec


def _row_rule(app: App, raw: Any, i: int, n: int) -> RowRule | None:
    """A step's ``rule``: how the stage holding the logits samples its rows."""
    if raw is None:
        return None
    where = f"steps[{i}].rule"
    if not isinstance(raw, dict) or set(raw) != wire.rule_fields():
        raise BadRequest(f"{where} must be a map of checks, until_mismatch, stop_tokens, stop_eog")
    lists = {}
    for key in ("checks", "stop_tokens"):
        value = raw[key]
        if not isinstance(value, list) or not all(
            type(t) is int and 0 <= t < app.n_vocab for t in value
        ):
            raise BadRequest(f"{where}.{key} must be a list of token ids")
        lists[key] = tuple(value)
    if len(lists["checks"]) > n:
        raise BadRequest(f"{where}.checks has more tokens than the step's {n} rows")
    return RowRule(
        lists["checks"],
        until_mismatch=_flag(raw, "until_mismatch", where),
        stop_tokens=lists["stop_tokens"],
        stop_eog=_flag(raw, "stop_eog", where),
    )


def _origin(raw: Any, i: int) -> Origin | None:
    """A step's ``origin``: [head peer id (hex), request id, index, count]."""
    if raw is None:
        return None
    ok = (
        isinstance(raw, list)
        and len(raw) == 4
        and isinstance(raw[0], str)
        and 0 < len(raw[0]) <= 64
        and all(type(v) is int and 0 <= v < 1 << 62 for v in raw[1:])
        and raw[2] < raw[3]
    )
    try:
        peer = bytes.fromhex(raw[0]) if ok else b""
    except ValueError:
        ok = False
    if not ok:
        raise BadRequest(f"steps[{i}].origin must be [peer hex, request, index, count]")
    return Origin(peer, raw[1], raw[2], raw[3])


def _flag(raw: dict[str, Any], key: str, where: str) -> bool:
    value = raw[key]
    if type(value) is not bool:
        raise BadRequest(f"{where}.{key} must be a boolean")
    return value


TENSOR_HANDLERS: dict[str, Handler] = {
    Op.EMBED: h_embed,
    Op.EXPORT_STATE: h_export_state,
    Op.IMPORT_STATE: h_import_state,
    Op.ECHO: h_echo,
    Op.FORWARD_FRAME: h_forward_frame,
}
