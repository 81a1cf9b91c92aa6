"""The ``chat`` op: template rendering (pure), stop at end of turn, the flag."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from conftest import start_worker, stop_worker
from edge import Request
from faults import BadRequest
from protocol import Client, SkiffError
from worker.api.generate import read_chat
from worker.api.messages import read_messages
from worker.api.validate import Context
from worker.core.chat import FALLBACK_TEMPLATE, ChatJob, ChatTemplate
from worker.limits import Limits
from worker.service import generation_job

SPECIAL = {"<eos>": 1, "<bos>": 2, "<start_of_turn>": 105, "<end_of_turn>": 106}


class FakeVocab:
    """Gemma's special ids; any other character is one token (1000 + code point)."""

    bos, eos, n_vocab = 2, 1, 300_000

    def __init__(self, chat_template: str | None = None) -> None:
        self.chat_template = chat_template

    def metadata(self, key: str) -> str | None:
        return self.chat_template if key == "tokenizer.chat_template" else None

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        out = [self.bos] if add_special else []
        pattern = "(" + "|".join(re.escape(s) for s in SPECIAL) + ")"
        for part in re.split(pattern, text) if parse_special else [text]:
            out += [SPECIAL[part]] if part in SPECIAL else [1000 + ord(c) for c in part]
        return out

    def is_eog(self, token: int) -> bool:
        return token in (1, 106)


CONVO = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there "},
]
GEMMA_CONVO = "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\n"


def fallback() -> ChatTemplate:
    return ChatTemplate.load("", FakeVocab())


# -- rendering (no model) -----------------------------------------------------------


def test_fallback_renders_gemma_turns() -> None:
    tpl = fallback()
    assert (tpl.source, tpl.name, tpl.bos_token, tpl.eos_token) == (
        "fallback",
        "gemma-turn",
        "<bos>",
        "<eos>",
    )
    assert tpl.render(CONVO) == GEMMA_CONVO
    turns = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    assert tpl.render(turns, add_generation_prompt=False) == (
        "<bos><start_of_turn>user\na<end_of_turn>\n<start_of_turn>model\nb<end_of_turn>\n"
        "<start_of_turn>user\nc<end_of_turn>\n"
    )
    assert tpl.closer == "<end_of_turn>\n" and tpl.end_of_turn == "<end_of_turn>"
    assert tpl.stop_tokens == [106] and tpl.closer_tokens == [106, 1000 + ord("\n")]
    # Special markers become their tokens, and BOS is not doubled.
    tokens = tpl.prompt_tokens(FakeVocab(), CONVO)
    assert tokens[:2] == [2, 105] and tokens.count(2) == 1 and tokens.count(105) == 2
    assert tpl.info() == {
        "source": "fallback",
        "name": "gemma-turn",
        "end_of_turn": "<end_of_turn>",
        "tools": "preamble",  # no tool support in the template: the worker's preamble
    }


def test_model_template_wins_over_fallback_and_flag_over_both(tmp_path: Path) -> None:
    own = "{% for m in messages %}<start_of_turn>{{ m.content }}<eos>{% endfor %}"
    tpl = ChatTemplate.load("", FakeVocab(own))
    assert tpl.source == "model" and tpl.name == "tokenizer.chat_template"
    assert tpl.render([{"role": "user", "content": "x"}]) == "<start_of_turn>x<eos>"
    assert tpl.end_of_turn == "<eos>" and tpl.stop_tokens == [1]  # the model's EOG token

    path = tmp_path / "t.jinja"
    path.write_text(
        "{{ bos_token }}{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n"
        "{% endfor %}{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
    )
    tpl = ChatTemplate.load(str(path), FakeVocab(own))
    assert (tpl.source, tpl.name) == ("flag", str(path))
    assert tpl.render([{"role": "user", "content": "x"}]) == "<bos>[USER] x\n[ASSISTANT] "
    # Its end of turn ("\n" stripped) is no single token: no stop token, and no error.
    assert tpl.closer == "\n" and tpl.end_of_turn == "" and tpl.stop_tokens == []


def test_template_errors_are_bad_requests() -> None:
    tpl = fallback()
    with pytest.raises(BadRequest, match="roles must alternate"):
        tpl.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    raising = ChatTemplate("{{ raise_exception('no tools here') }}")
    with pytest.raises(BadRequest, match="no tools here"):
        raising.render(CONVO)
    sandboxed = ChatTemplate("{{ messages.append(1) }}")  # immutable sandbox
    with pytest.raises(BadRequest, match="chat template"):
        sandboxed.render(CONVO)
    broken = ChatTemplate("{{ messages[0].content + 1 }}")
    with pytest.raises(BadRequest, match="chat template failed"):
        broken.render(CONVO)


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        (None, "messages must be"),
        ([], "messages must be"),
        ("hi", "messages must be"),
        ([["user", "hi"]], r"messages\[0\] must be a map"),
        ([{"content": "hi"}], r"messages\[0\].role"),
        ([{"role": "", "content": "hi"}], r"messages\[0\].role"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": 3}], r"\[1\].content"),
    ],
)
def test_messages_validation(messages: Any, field: str) -> None:
    with pytest.raises(BadRequest, match=field):
        read_messages(messages, max_chars=1000)


def test_chat_job_gets_the_end_of_turn_stop() -> None:
    vocab = FakeVocab()
    app = SimpleNamespace(
        engine=vocab,
        n_vocab=1000,
        grammars=None,
        draft=None,
        chat=ChatTemplate.load("", vocab),
        rt=SimpleNamespace(ctx_per_lane=2048),
        limits=Limits().resolved(2048),
        context=Context(Limits().resolved(2048), n_vocab=1000),
        prompt_limit=0,
        projector=None,
        speculate_streams=2,
        span_rows=33,
        draining=False,
        chunk=256,
        ticket=lambda req: SimpleNamespace(id=req.id),
    )

    def request(args: dict[str, Any]) -> Request:
        return Request(b"p", 1, "chat", None, args, [], 0.0, None)

    args = {"messages": CONVO, "stop": ["x"], "stop_tokens": [7]}
    req = request(args)
    job = generation_job(app, req, read_chat(app, req))
    assert isinstance(job, ChatJob) and job.ephemeral
    assert job.stop_tokens == {7, 106} and job.stop == ["x", "<end_of_turn>"]
    assert job.prompt == vocab.tokenize(GEMMA_CONVO, False, True)
    with pytest.raises(BadRequest, match="not prompt"):
        read_chat(app, request({"messages": CONVO, "prompt": "x"}))


# -- over the socket ------------------------------------------------------------------


def rendered_ids(client: Client, messages: list[dict[str, str]]) -> list[int]:
    text = ChatTemplate(FALLBACK_TEMPLATE, bos_token="<bos>").render(messages)
    ids: list[int] = client.tokenize(text, add_special=False, parse_special=True)
    return ids


def test_info_names_the_fallback(client: Client) -> None:
    info = client.info()
    assert "chat" in info["ops"]
    assert info["chat_template"] == {
        "source": "fallback",
        "name": "gemma-turn",
        "end_of_turn": "<end_of_turn>",
        "tools": "preamble",
    }


def test_chat_generates_from_the_rendered_prompt(client: Client) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.call("chat", args={"messages": messages, "max_tokens": 40, "stream": False})
    result = reply.result
    assert reply.header["done"] is True
    assert result["finish_reason"] in ("stop", "length")
    assert isinstance(result["text"], str) and result["tokens"]
    ids = rendered_ids(client, messages)
    assert ids[0] == client.info()["model"]["bos"] and ids.count(ids[0]) == 1
    assert result["usage"]["prompt_tokens"] == len(ids)
    (eot,) = client.tokenize("<end_of_turn>", add_special=False, parse_special=True)
    assert eot not in result["tokens"]
    # Same prompt through generate: the same greedy tokens, up to the end of turn.
    plain = client.call(
        "generate", args={"tokens": ids, "max_tokens": 40, "stream": False, "ignore_eos": True}
    ).result["tokens"]
    cut = plain.index(eot) if eot in plain else len(plain)
    assert result["tokens"] == plain[:cut]


def test_chat_streams_like_generate(client: Client) -> None:
    messages = [{"role": "user", "content": "Count to three."}]
    events = list(client.stream("chat", args={"messages": messages, "max_tokens": 5}))
    assert events[-1].header["done"] is True
    assert events[-1].header["finish_reason"] in ("stop", "length")
    assert all(e.header["event"] == "token" for e in events[:-1])


def test_chat_continues_a_session(client: Client) -> None:
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]
    r1 = client.chat(first, session="chat-s", max_tokens=4)
    assert r1["usage"]["prompt_tokens"] == len(rendered_ids(client, first))
    second = [{"role": "user", "content": "And again."}]
    r2 = client.chat(second, session="chat-s", max_tokens=4)
    # The previous turn's last shown token (if it ran out of tokens), the closer
    # "<end_of_turn>\n", then the new turn without its BOS.
    closer = client.tokenize("<end_of_turn>\n", add_special=False, parse_special=True)
    pending = 1 if r1["finish_reason"] == "length" else 0
    expected = pending + len(closer) + len(rendered_ids(client, second)) - 1
    assert r2["usage"]["prompt_tokens"] == expected
    # Every token fed: prompts and completions, less each turn's last shown token
    # when it ran out of tokens (that one is fed by the next turn's prompt).
    (entry,) = [s for s in client.stats()["sessions"] if s["session"] == "chat-s"]
    fed = sum(
        r["usage"]["prompt_tokens"]
        + r["usage"]["completion_tokens"]
        - (r["finish_reason"] == "length")
        for r in (r1, r2)
    )
    assert entry["position"] == fed


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ({}, "messages must be"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": 1, "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "x"}], "prompt": "x"}, "not prompt"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "roles must alternate"),
    ],
)
def test_bad_chat_requests(client: Client, args: dict[str, Any], needle: str) -> None:
    with pytest.raises(SkiffError) as err:
        client.call("chat", args={**args, "stream": False})
    assert err.value.code == "bad_request" and needle in err.value.message


PLAIN = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\nEND\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def test_flag_template_is_used_and_stops_at_its_end_of_turn(tmp_path: Path) -> None:
    path = tmp_path / "plain.jinja"
    path.write_text(PLAIN)
    proc, endpoint, _ = start_worker(
        tmp_path, "--lanes", "1", "--ctx", "1024", "--chat-template", str(path), name="chat"
    )
    try:
        with Client(endpoint, timeout_ms=60_000) as client:
            info = client.info()["chat_template"]
            assert info == {
                "source": "flag",
                "name": str(path),
                "end_of_turn": "END",
                "tools": "preamble",
            }
            # Few-shot turns the model copies, so it ends its own turn with END.
            messages = [
                {"role": "user", "content": "Say hi."},
                {"role": "assistant", "content": "Hi!"},
                {"role": "user", "content": "Say bye."},
                {"role": "assistant", "content": "Bye!"},
                {"role": "user", "content": "Say yes."},
            ]
            text = ChatTemplate(PLAIN).render(messages)
            ids = client.tokenize(text, add_special=False, parse_special=True)
            (end,) = client.tokenize("END", add_special=False, parse_special=True)
            result = client.chat(messages, max_tokens=20)
            assert result["usage"]["prompt_tokens"] == len(ids)
            assert result["finish_reason"] == "stop" and end not in result["tokens"]
            plain = client.call(
                "generate", args={"tokens": ids, "max_tokens": 20, "stream": False}
            ).result["tokens"]
            assert end in plain and result["tokens"] == plain[: plain.index(end)]
    finally:
        stop_worker(proc)
