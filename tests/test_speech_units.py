"""The speech worker's pacing policy, without piper: how text is cut into
chunks (``engine.split_sentences``) and how ``SpeechService`` turns them into
replies (first clause first, one chunk a turn, nothing synthesized after a
cancel is read), driven with a fake engine that records what it is asked.
"""

from __future__ import annotations

import re
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge import Request
from speech.engine import (
    _MIN_CLAUSE_CHARS,
    FIRST_CHUNK_CHARS,
    MAX_CHUNK_CHARS,
    Synthesis,
    split_sentences,
)
from speech.server import SpeechService

# A 200-character reply with clauses, as an assistant would speak it.
TEXT = (
    "Thanks for calling, this is the front desk of the Harbour Hotel. Your table for "
    "four is booked for seven tonight, and we have noted the birthday. If anything "
    "changes, just call us back; we shall help."
)


def test_the_first_chunk_is_the_first_clause() -> None:
    chunks = split_sentences(TEXT)
    assert len(TEXT) == 200
    assert chunks[0] == "Thanks for calling,"
    assert chunks[1] == "this is the front desk of the Harbour Hotel."
    assert " ".join(chunks) == TEXT


@pytest.mark.parametrize(
    ("text", "first"),
    [
        ("Hello world.", "Hello world."),  # one short sentence: whole
        ("Well, I think so, but it is hard to tell.", "Well, I think so,"),  # "Well," too short
        ("Thanks for calling, Bob.", "Thanks for calling, Bob."),  # "Bob." too short to stand
        ("Hi. Then a second sentence follows here.", "Hi."),  # a sentence end is a boundary
        ("Dear all,\n\nThe meeting moved to Friday, at noon.", "Dear all,"),  # so is a blank line
        (
            "Dr. Smith said so, and then he left the room.",
            "Dr. Smith said so,",
        ),  # not a sentence end
        # no clause within the first budget: cut at the last space inside it
        (
            "The quick brown fox jumps over the lazy dog and keeps running through the woods.",
            "The quick brown fox jumps over the lazy dog and",
        ),
    ],
)
def test_first_chunk_cases(text: str, first: str) -> None:
    chunks = split_sentences(text)
    assert chunks[0] == first
    assert " ".join(chunks) == " ".join(text.split())


def test_budgets_double_after_the_first_chunk() -> None:
    chunks = split_sentences("Hi. " + "word " * 120)
    assert [len(c) for c in chunks[:3]] == [3, 99, 199]  # 50 -> 100 -> 200 (cut at spaces)
    assert all(len(c) <= MAX_CHUNK_CHARS for c in chunks)


words = st.lists(
    st.text(alphabet="abcdefghij", min_size=1, max_size=12)
    | st.sampled_from(["a,", "b;", "c.", "d!", "e:", "f?", "Dr.", "g\u2014", "\n\n"]),
    min_size=1,
    max_size=80,
)


@given(words)
def test_chunks_cover_the_text_within_their_budgets(parts: list[str]) -> None:
    text = " ".join(parts)
    chunks = split_sentences(text)
    assert " ".join(chunks) == " ".join(text.split())
    assert all(c and c == c.strip() for c in chunks)
    budget = FIRST_CHUNK_CHARS
    for chunk in chunks:
        if " " in chunk:  # a single word longer than the budget is cut inside it
            assert len(chunk) <= budget
        budget = min(MAX_CHUNK_CHARS, 2 * budget)
    if len(chunks) < 2:
        return
    paragraph = re.match(r"\s*" + re.escape(chunks[0]) + r"\s*\n\s*\n", text)  # ends a sentence
    if chunks[0][-1] in ",;:\u2014" and not paragraph:
        assert len(chunks[0]) >= _MIN_CLAUSE_CHARS  # a first clause is never a tiny one


# -- the service with a fake engine --------------------------------------------------


class FakeVoice:
    name, sample_rate = "joe", 22050

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "sample_rate": self.sample_rate, "language": "en"}


class FakeEngine:
    """Records every chunk it is asked to synthesize; 100 samples a character."""

    voices = {"joe": FakeVoice()}
    default_voice = "joe"

    def __init__(self) -> None:
        self.asked: list[str] = []

    def voice(self, name: str | None) -> FakeVoice:
        return self.voices["joe"]

    def synthesize(self, voice: str | None, text: str, speed: float = 1.0) -> Synthesis:
        self.asked.append(text)
        return Synthesis(np.ones(100 * len(text), dtype=np.int16), phonemes=len(text))


def _request(op: str, req_id: int, args: dict[str, Any]) -> Request:
    return Request(b"peer", req_id, op, None, args, [], time.monotonic(), None)


def _service() -> tuple[SpeechService, FakeEngine]:
    engine = FakeEngine()
    return SpeechService(engine), engine  # type: ignore[arg-type]


def test_the_first_turn_sends_the_first_clause_alone() -> None:
    svc, engine = _service()
    assert (
        svc.handlers["synthesize"](_request("synthesize", 1, {"text": TEXT, "stream": True}))
        is None
    )
    out = svc.turn()
    assert engine.asked == ["Thanks for calling,"]
    (event,) = out
    assert event.header["event"] == "audio" and event.header["sample_rate"] == 22050
    assert event.header["samples"] == 100 * len("Thanks for calling,")
    while svc.has_work():
        out += svc.turn()
    done = out[-1].header
    assert done["done"] and done["phonemes"] == sum(len(c) for c in engine.asked)
    assert done["chunks"] == len(engine.asked) == len(split_sentences(TEXT))
    assert svc.counters.chunks == len(engine.asked)


def test_nothing_is_synthesized_after_a_cancel_is_read() -> None:
    svc, engine = _service()
    svc.handlers["synthesize"](_request("synthesize", 7, {"text": TEXT, "stream": True}))
    svc.turn()  # the first clause
    svc.turn()  # the second chunk
    assert svc.handlers["cancel"](_request("cancel", 8, {"id": 7})) == {"cancelled": True}
    out = svc.turn()
    assert len(engine.asked) == 2  # the cancel, read between two turns, stopped it there
    (reply,) = out
    assert reply.header["ok"] is False and reply.header["error"]["code"] == "cancelled"
    assert not svc.has_work() and svc.counters.cancelled == 1
    assert svc.counters.chunks == 2
