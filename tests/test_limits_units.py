"""Limits on everything a peer controls, without a worker: each has a flag, an
env twin and a default, unusable ones stop the worker at startup, each
validator holds its limit with ``limit_exceeded`` naming field, limit and
flag, and the per-peer counting (``PeerLimits`` in ``worker/core/jobs/base.py``)
holds sessions and generations per peer on the scheduler's fakes
(``_scheduler_fakes``). The same limits end to end: test_limits_socket.py.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from _limits_helpers import _frame, _restore
from _scheduler_fakes import PEER, Harness

from faults import BadRequest, ContextOverflow, LimitExceeded
from protocol import frame_limits, frames
from worker import config
from worker.api.messages import read_messages
from worker.api.sampling import get_sampling
from worker.api.validate import Context, Stops, get_frame, get_prompt_tokens, read_fields
from worker.core.jobs.base import Event
from worker.core.jobs.session import PrefillJob, SessionOpJob
from worker.limits import FIELDS, Limits, flag, invalid

OTHER = b"other"


# -- the limits value and its flags ----------------------------------------------


def test_every_limit_has_a_flag_an_env_twin_and_a_default() -> None:
    defaults = config.parse([]).limits
    assert defaults == Limits()
    assert defaults.resolved(512).max_request_tokens == 512  # 0 = a lane's cells
    assert defaults.resolved(512).max_new_tokens == 512
    for name in FIELDS:
        assert config.parse([flag(name), "7"]).limits.as_dict()[name] == 7
    env = {config.env_name("max-stops"): "3"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        assert config.parse([]).max_stops == 3
    finally:
        _restore(saved)


def test_unusable_limits_stop_the_worker_at_startup() -> None:
    assert invalid(Limits()) is None
    assert invalid(Limits(max_stops=0)) == "--max-stops must be positive"
    assert invalid(Limits(max_request_tokens=-1)) == "--max-request-tokens must be >= 0"
    assert invalid(Limits(max_frame_rank=33)) == "--max-frame-rank must be at most 32"
    with pytest.raises(SystemExit, match="max-logit-bias"):
        config.parse(["--max-logit-bias", "0"])


# -- validators ------------------------------------------------------------------

SMALL = Limits(
    max_request_tokens=4,
    max_new_tokens=8,
    max_stops=2,
    max_stop_chars=3,
    max_grammar_bytes=32,
    max_logit_bias=1,
    max_messages=1,
    max_frame_parts=1,
    max_frame_rank=2,
)


def _limit(match: str) -> Any:
    return pytest.raises(LimitExceeded, match=match)


def test_stop_strings_count_and_length() -> None:
    def get_stops(args: dict[str, object], limits: Limits) -> list[str]:
        return list(read_fields(args, {"stop": Stops()}, Context(limits=limits))["stop"])

    assert get_stops({"stop": ["a", "bcd"]}, SMALL) == ["a", "bcd"]
    with _limit(r"^stop has 3 strings; the limit is 2 \(--max-stops\)$"):
        get_stops({"stop": ["a", "b", "c"]}, SMALL)
    with _limit(r"^stop\[1\] has 4 characters; the limit is 3 \(--max-stop-chars\)$"):
        get_stops({"stop": ["a", "abcd"]}, SMALL)
    for malformed in ("a", [""], [3]):
        with pytest.raises(BadRequest):
            get_stops({"stop": malformed}, SMALL)


def test_grammar_schema_and_logit_bias_sizes() -> None:
    def sampling(**raw: Any) -> Any:
        return get_sampling({"sampling": raw}, limits=SMALL)

    assert sampling(grammar='root ::= "' + "a" * 20 + '"') is not None
    with _limit(r"^sampling\.grammar is 33 bytes; the limit is 32 \(--max-grammar-bytes\)$"):
        sampling(grammar="root ::= " + "x" * 24)
    with _limit(r"sampling\.grammar is 35 bytes"):  # bytes, not characters
        sampling(grammar='root ::= "' + "é" * 12 + '"')
    with _limit(r"^sampling\.json_schema is \d+ bytes; the limit is 32 \(--max-grammar-bytes\)$"):
        sampling(json_schema={"type": "object", "properties": {"name": {"type": "string"}}})
    with _limit(r"^sampling\.logit_bias has 2 entries; the limit is 1 \(--max-logit-bias\)$"):
        sampling(logit_bias=[{"token": 1, "bias": 1}, {"token": 2, "bias": 1}])
    with pytest.raises(BadRequest):  # malformed is still bad_request, under any limit
        sampling(logit_bias=[{"token": -1, "bias": 1}])


def test_request_tokens_then_context_overflow() -> None:
    assert get_prompt_tokens({"tokens": [1] * 4}, "tokens", 100, 16, SMALL.max_request_tokens)
    with _limit(r"^tokens has 5 tokens; the limit is 4 \(--max-request-tokens\)$"):
        get_prompt_tokens({"tokens": [1] * 5}, "tokens", 100, 16, SMALL.max_request_tokens)
    with pytest.raises(ContextOverflow):  # the limit at the lane's cells: overflow, as before
        get_prompt_tokens({"tokens": [1] * 17}, "tokens", 100, 16, 16)


def test_chat_messages_count() -> None:
    one = [{"role": "user", "content": "hi"}]
    assert read_messages(one, 100, SMALL.max_messages) == one
    with _limit(r"^messages has 2 entries; the limit is 1 \(--max-messages\)$"):
        read_messages(one * 2, 100, SMALL.max_messages)


def test_frame_parts_and_rank() -> None:
    two, buffers = _frame(np.zeros(2, np.float32), np.zeros(3, np.float32))
    assert len(frames.parse(two, buffers).parts) == 2  # protocol's defaults
    with pytest.raises(frame_limits.FrameLimitError) as err:
        frames.parse(two, buffers, frame_limits.FrameLimits(parts=1))
    assert (err.value.field, err.value.limit, err.value.code) == (
        "parts",
        "parts",
        "limit_exceeded",
    )
    with _limit(r"^input\.parts: has 2 parts; the limit is 1 \(--max-frame-parts\)$"):
        get_frame({"input": two}, "input", buffers, SMALL)
    cube, buffers = _frame(np.zeros((2, 2, 2), np.float32))
    with _limit(r"^frame\.parts\[0\]\.dims: has 3 dims; the limit is 2 \(--max-frame-rank\)$"):
        get_frame({"frame": cube}, "frame", buffers, SMALL)
    deep, buffers = _frame(np.zeros((1,) * 8, np.float32))
    deep["parts"][0] |= {"dims": [1] * 9, "byte_strides": [4] * 9}  # rank 9: over the default
    with pytest.raises(frame_limits.FrameLimitError):
        frames.parse(deep, buffers)
    assert frames.parse(deep, buffers, frame_limits.FrameLimits(rank=9)).parts[0].dims == (1,) * 9


# -- per-peer counting (the scheduler, on fakes) ----------------------------------------


def _prefill(h: Harness, session: str, owner: bytes = PEER) -> PrefillJob:
    return PrefillJob(h.ticket("prefill", owner), session, [10, 11], h.chunk, False, None)


def _drop(h: Harness, session: str, owner: bytes = PEER) -> SessionOpJob:
    return SessionOpJob(h.ticket("drop", owner), session, "drop")


def test_sessions_per_peer_count_admitted_and_queued_and_come_back() -> None:
    h = Harness(lanes=6, max_sessions_per_peer=2)
    h.submit(_prefill(h, "a1"))
    h.submit(_prefill(h, "a2"))  # queued: counts before it is admitted
    with _limit(r"^sessions: this peer would hold 3, .*\(--max-sessions-per-peer\)$"):
        h.submit(_prefill(h, "a3"))
    h.submit(_prefill(h, "a1"))  # its own session: no new lane, no refusal
    h.submit(_prefill(h, "b1", OTHER))  # another peer counts apart
    h.run()
    assert h.sched.peers.held_by(PEER, h.rt.lanes.sessions) == {"a1", "a2"}
    with pytest.raises(LimitExceeded):
        h.submit(_prefill(h, "a3"))
    h.submit(_drop(h, "a1"))  # drop: the lane and the count come back
    h.run()
    h.submit(_prefill(h, "a3"))
    h.run()
    h.rt.drop("a2")  # what idle expiry (LlmService.housekeeping) does
    h.submit(_prefill(h, "a4"))
    h.run()
    with pytest.raises(LimitExceeded):
        h.submit(_prefill(h, "a5"))
    h.sched.cancel_owner(PEER)  # the peer went away: its sessions stop counting for it
    assert h.sched.peers.held_by(PEER, h.rt.lanes.sessions) == set()
    h.submit(_prefill(h, "a5"))
    h.run()
    assert h.rt.lanes.active == 4  # a3, a4, a5, b1


def test_streams_per_peer_come_back_on_finish_and_cancel() -> None:
    h = Harness(lanes=4, max_streams_per_peer=2)
    first = h.submit(h.generate(max_tokens=3))
    second = h.submit(h.generate(max_tokens=50))
    with _limit(r"^generations: this peer would have 3 queued or running; the limit is 2 "):
        h.submit(h.generate())
    h.submit(h.generate(owner=OTHER))  # another peer counts apart
    h.submit(_prefill(h, "s"))  # not a generation: not counted
    while not any(isinstance(o, Event) and o.done for o in h.out(first)):
        h.turn()
    third = h.submit(h.generate(max_tokens=2))  # the finished one gave its slot back
    with pytest.raises(LimitExceeded):
        h.submit(h.generate())
    assert h.sched.cancel(PEER, second.ticket.id)
    fourth = h.submit(h.generate(max_tokens=2))  # a cancelled one no longer counts
    h.run()
    assert h.done(second)["finish_reason"] == "cancelled"
    assert [h.done(j)["finish_reason"] for j in (third, fourth)] == ["length", "length"]
    assert h.rt.lanes.active == 1  # only the named session "s"; ephemeral lanes are back


def test_peer_lost_gives_streams_back_after_the_reap() -> None:
    h = Harness(lanes=2, max_streams_per_peer=1)
    h.submit(h.generate(max_tokens=50))
    with pytest.raises(LimitExceeded):
        h.submit(h.generate())
    assert h.sched.cancel_owner(PEER) == 1
    h.submit(h.generate(max_tokens=1))
    h.run()
    assert not h.sched.has_work() and h.rt.lanes.active == 0


def test_limits_off_by_default_in_the_scheduler() -> None:
    h = Harness(lanes=8)
    for i in range(4):
        h.submit(_prefill(h, f"s{i}"))
    for _ in range(8):
        h.submit(h.generate())
    h.run()
    assert h.rt.lanes.active == 4


def test_defaults_leave_a_default_worker_as_before() -> None:
    """Without flags the limits are the old constants (stops 16 x 256, grammar
    256 KiB, logit bias 256, messages 4096, frames 64 parts of rank <= 8) and
    the per-lane ones are the lane's cells."""
    d = Limits()
    old = (16, 256, 1 << 18, 256, 4096, 64, 8)
    assert (
        d.max_stops,
        d.max_stop_chars,
        d.max_grammar_bytes,
        d.max_logit_bias,
        d.max_messages,
        d.max_frame_parts,
        d.max_frame_rank,
    ) == old
    assert frame_limits.FrameLimits() == frame_limits.FrameLimits(
        d.max_frame_parts, d.max_frame_rank
    )
