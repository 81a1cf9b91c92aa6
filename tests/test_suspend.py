"""A running stream suspended between two tokens goes on elsewhere, exactly.

The worker half of moving a stream: ``suspend`` ends it with a ``suspended``
event carrying ``resume``; the session is exported (with its sampler
state), imported under another name (here on the same worker: rows do not
depend on the lane), and a ``generate`` with ``resume`` continues it. The
tokens, text and usage must equal those of a stream that never moved.
"""

from __future__ import annotations

from typing import Any

import pytest

from protocol import Client, SkiffError

PROMPT = "The history of the lighthouse keepers of the northern coast begins"
SEEDED = {"temperature": 0.9, "top_k": 40, "seed": 77}
MAX = 24


def _args(sampling: dict[str, Any] | None, stop: list[str] | None = None) -> dict[str, Any]:
    args: dict[str, Any] = {"prompt": PROMPT, "max_tokens": MAX, "ignore_eos": True}
    if sampling is not None:
        args["sampling"] = sampling
    if stop:
        args["stop"] = stop
    return args


def _summary(events: list[dict[str, Any]]) -> tuple[list[int], str, dict[str, Any]]:
    tokens = [e["token"] for e in events if e.get("event") == "token"]
    text = "".join(e.get("text", "") for e in events)
    done = [e for e in events if e.get("event") == "done"]
    assert len(done) == 1
    usage = dict(done[0]["usage"])
    usage.pop("cached_tokens")  # the prefix cache may serve one run and not the other
    return tokens, text, usage


def _moved(
    client: Client, args: dict[str, Any], session: str | None, after: int, op: str = "generate"
) -> Any:
    """Stream ``args``; suspend after ``after`` tokens; move the session to a
    new name; resume there (as a ``generate``, whatever the op was, as a
    gateway does). Returns the events the client would have seen."""
    req = client.send(op, session, {**args, "stream": True})
    seen: list[dict[str, Any]] = []
    while sum(1 for e in seen if e.get("event") == "token") < after:
        seen.append(client.recv(req).raise_for_error().header)
    assert client.call("suspend", args={"id": req}).result == {"suspended": True}
    while True:
        header = client.recv(req).raise_for_error().header
        if header.get("event") == "suspended":
            suspended = header
            break
        seen.append(header)  # tokens already on their way when suspend arrived
    source = suspended.get("session", session)
    assert source is not None
    exported = client.export_state(source)
    target = f"{source}-moved"
    client.import_state(target, exported)
    client.drop(source)
    resumed = {k: v for k, v in args.items() if k not in ("prompt", "messages")}
    resumed["resume"] = suspended["resume"]
    rest = [r.header for r in client.generate(resumed, session=target)]
    if not suspended["resume"].get("ephemeral"):
        client.drop(target)
    else:
        assert target not in {s["session"] for s in client.stats()["sessions"]}
    return [e for e in seen + rest if e.get("event") != "suspended"]


@pytest.mark.parametrize("sampling", [None, SEEDED], ids=["greedy", "seeded"])
def test_a_suspended_stream_continues_as_if_it_never_moved(
    client: Client, sampling: dict[str, Any] | None
) -> None:
    args = _args(sampling)
    reference = _summary([r.header for r in client.generate(args, session="ref")])
    client.drop("ref")
    moved = _summary(_moved(client, args, "mv", after=9))
    assert moved == reference


def test_a_chat_stream_keeps_its_end_of_turn_stop(client: Client) -> None:
    """A chat moves on as a ``generate``; the template's stops travel in
    ``resume``, so it still ends at the end of its turn."""
    args = {
        "messages": [{"role": "user", "content": "Name three colours, briefly."}],
        "max_tokens": 48,
        "sampling": SEEDED,
    }
    reference = _summary([r.header for r in client.stream("chat", "cref", args)])
    client.drop("cref")
    assert _summary(_moved(client, args, "cmv", after=3, op="chat")) == reference


def test_a_sessionless_stream_moves_too(client: Client) -> None:
    args = _args(SEEDED)
    reference = _summary([r.header for r in client.generate(args)])
    assert _summary(_moved(client, args, None, after=5)) == reference


def test_text_held_back_for_a_stop_string_travels(client: Client) -> None:
    """A stop string that never matches holds text back while its start is
    showing; wherever the suspend lands, the moved stream shows the same
    text (that the held text travels is checked deterministically in
    test_generate_units.py)."""
    plain = [r.header for r in client.generate(_args(None), session="ref2")]
    client.drop("ref2")
    words = [e["text"] for e in plain if e.get("event") == "token"]
    k = next(i for i, w in enumerate(words) if i > 2 and len(w.strip()) > 2)
    args = _args(None, stop=[words[k] + "\x00never"])  # words[k] shows, then is held
    reference = [r.header for r in client.generate(args, session="ref3")]
    client.drop("ref3")
    assert [e.get("text") for e in reference if e.get("event") == "token"][k] == ""
    moved = _moved(client, args, "mvh", after=k + 1)
    assert _summary(moved) == _summary(reference)


def test_suspend_of_a_finished_or_unknown_stream_says_false(client: Client) -> None:
    assert client.call("suspend", args={"id": 999_999}).result == {"suspended": False}
    with pytest.raises(SkiffError, match="resume"):
        client.call("generate", "x", {"prompt": "a", "resume": {}})
