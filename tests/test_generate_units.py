"""GenerateJob's text handling on a stub engine: UTF-8 safety and stop strings."""

from __future__ import annotations

from typing import Any

from worker.core.jobs.base import Event, Outbox, Result, Ticket
from worker.core.jobs.generate import GenerateJob
from worker.runtime import Session


class _Engine:
    def __init__(self, pieces: dict[int, bytes]) -> None:
        self.pieces = pieces

    def piece(self, token: int) -> bytes:
        return self.pieces[token]

    def is_eog(self, token: int) -> bool:
        return token == 1


class _Rt:
    ctx_per_lane = 1000

    def __init__(self, pieces: dict[int, bytes]) -> None:
        self.engine = _Engine(pieces)

    def owes(self, session_ids: object) -> bool:
        return False  # a whole model: nothing is ever down a chain


def _job(stop: list[str], max_tokens: int = 50, resume: Any = None) -> tuple[GenerateJob, _Sent]:
    outbox = Outbox()
    sent = _Sent(outbox)
    ticket = Ticket(b"p", 1, "generate", outbox)
    job = GenerateJob(
        ticket, "s", False, [5], max_tokens, None, stop, set(), False, True, 256, resume=resume
    )
    job.session = Session("s", 0, position=1)
    job.tokens = [5]
    return job, sent


class _Sent:
    """The outputs a job wrote, read like the list of headers it used to send."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox
        self.items: list[dict[str, Any]] = []

    def _sync(self) -> list[dict[str, Any]]:
        for _, out in self.outbox.take():
            assert isinstance(out, Event | Result)
            self.items.append(out.data)
        return self.items

    def __iter__(self) -> Any:
        return iter(self._sync())

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self._sync()[i]


def _run(job: GenerateJob, rt: _Rt, tokens: list[int]) -> None:
    for tok in tokens:
        assert job.session is not None
        if job._take_all(rt, [tok], job.session.position):  # type: ignore[arg-type]
            return
        job.session.position += 1


def test_multibyte_character_split_across_tokens_is_never_split_in_text() -> None:
    euro = "€".encode()  # 3 bytes
    rt = _Rt({10: b"price ", 11: euro[:1], 12: euro[1:], 13: b"5"})
    job, sent = _job([], max_tokens=4)
    _run(job, rt, [10, 11, 12, 13])
    texts = [h["text"] for h in sent if h.get("event") == "token"]
    assert texts == ["price ", "", "€", "5"]
    assert sent[-1]["done"] and sent[-1]["finish_reason"] == "length"


def test_stop_string_across_tokens_is_cut_and_prefix_held_back() -> None:
    rt = _Rt({20: b"Hello wo", 21: b"rld and", 22: b" more"})
    job, sent = _job(["world"])
    _run(job, rt, [20, 21, 22])
    texts = [h["text"] for h in sent if h.get("event") == "token"]
    # "wo" could start "world": held back, then dropped with the stop string.
    assert texts == ["Hello ", ""]
    assert sent[-1]["finish_reason"] == "stop"


def test_held_prefix_that_was_not_a_stop_is_released_at_the_end() -> None:
    rt = _Rt({30: b"say wo", 31: b"w"})
    job, sent = _job(["world"], max_tokens=2)
    _run(job, rt, [30, 31])
    events = [h for h in sent if h.get("event") == "token"]
    shown = "".join(h["text"] for h in events) + sent[-1]["text"]
    assert shown == "say wow"
    assert sent[-1]["finish_reason"] == "length"


def test_eos_ends_with_stop_and_is_not_shown() -> None:
    rt = _Rt({40: b"fin"})
    job, sent = _job([])
    _run(job, rt, [40, 1])
    assert [h["token"] for h in sent if h.get("event") == "token"] == [40]
    assert sent[-1]["finish_reason"] == "stop"
    assert sent[-1]["usage"]["completion_tokens"] == 1


class _RenamingRt(_Rt):
    def rename(self, old: Any, new: str) -> Session:
        raise AssertionError("a named session keeps its name")


def _suspend_and_resume(
    pieces: dict[int, bytes], stop: list[str], before: list[int], after: list[int], max_tokens: int
) -> list[dict[str, Any]]:
    """Run ``before``, suspend, resume a new job from the event, run ``after``;
    the headers a client sees (the ``suspended`` event is the gateway's)."""
    from worker.core.suspend import Resume

    rt = _RenamingRt(pieces)
    job, sent = _job(stop, max_tokens)
    _run(job, rt, before)
    job.on_suspend(rt)  # type: ignore[arg-type]
    (suspended,) = [h for h in sent if h.get("event") == "suspended"]
    assert job.session is not None and job.session.pending == [before[-1]]
    resumed, sent2 = _job(stop, max_tokens, Resume(**suspended["resume"]))
    resumed.session = Session("s", 0, position=job.session.position)
    resumed.tokens = [before[-1]]
    _run(resumed, rt, after)
    return [h for h in sent if h.get("event") != "suspended"] + list(sent2)


def test_held_text_and_a_partial_character_travel_with_a_suspended_stream() -> None:
    euro = "€".encode()
    pieces = {50: b"say wo", 51: euro[:1], 52: euro[1:] + b"w", 53: b"!"}
    tokens = [50, 51, 52, 53]
    whole, sent = _job(["world"], max_tokens=4)
    _run(whole, _Rt(pieces), tokens)
    reference = list(sent)
    for cut in (1, 2, 3):  # after "wo" is held; after half a character; both
        moved = _suspend_and_resume(pieces, ["world"], tokens[:cut], tokens[cut:], 4)
        assert [h.get("text") for h in moved] == [h.get("text") for h in reference]
        assert moved[-1]["usage"] == reference[-1]["usage"]
        assert moved[-1]["finish_reason"] == "length"
