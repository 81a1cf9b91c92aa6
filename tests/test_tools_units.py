"""Tools without a model: reading calls out of text, the request's tool plan,
the worker's rendering of tools and tool turns, and their validation."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from faults import BadRequest
from gateway.openai.errors import ApiError
from gateway.openai.shapes import plan_chat
from gateway.openai.toolcalls import CallArgs, CallScanner, CallStart, Content, Event, collect
from gateway.openai.tools import plan_tools
from worker.api.messages import read_messages, read_tools
from worker.core.chat import FALLBACK_TEMPLATE, ChatTemplate
from worker.core.tools import PREAMBLE

NAMES = frozenset({"get_weather", "add"})
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


def scan(text: str, cuts: Sequence[int] = ()) -> list[Event]:
    """Feed ``text`` in pieces cut at ``cuts``; every event, in order."""
    scanner = CallScanner(NAMES)
    events: list[Event] = []
    start = 0
    for cut in [*sorted({min(max(c, 0), len(text)) for c in cuts}), len(text)]:
        events += scanner.feed(text[start:cut])
        start = cut
    return events + scanner.finish()


def merged(events: list[Event]) -> list[tuple[Any, ...]]:
    """Events with adjacent pieces of one kind joined and call ids left out."""
    out: list[tuple[Any, ...]] = []
    for e in events:
        if isinstance(e, CallStart):
            out.append(("call", e.index, e.name))
        elif (
            out
            and out[-1][0] == type(e).__name__
            and (isinstance(e, Content) or out[-1][1] == e.index)
        ):
            last = out.pop()
            out.append((*last[:-1], last[-1] + e.text))
        elif isinstance(e, Content):
            out.append(("Content", e.text))
        else:
            out.append(("CallArgs", e.index, e.text))
    return out


# -- reading calls --------------------------------------------------------------------


def test_plain_text_is_content_unchanged() -> None:
    for text in ("", "  Hello {there}", "{not a call}", '{"answer": 1}', "a <tool_ b", " \n"):
        content, calls = collect(scan(text))
        assert (content, calls) == (text, []), text


def test_tool_call_blocks_become_calls() -> None:
    text = (
        "Let me look.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name":"add","arguments":{"a":[1,{"b":"}\\""}]}}</tool_call>'
    )
    content, calls = collect(scan(text))
    assert content == "Let me look.\n"
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert json.loads(calls[1]["function"]["arguments"]) == {"a": [1, {"b": '}"'}]}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert calls[0]["id"] != calls[1]["id"]


def test_a_bare_call_object_and_its_spellings() -> None:
    for key in ("arguments", "parameters"):
        text = f' {{ "name" : "add", "{key}" : {{"x": 1}} }} '
        content, calls = collect(scan(text))
        assert content == "" and json.loads(calls[0]["function"]["arguments"]) == {"x": 1}


def test_what_is_not_a_call_stays_text() -> None:
    for text in (
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not a given function
        '<tool_call>{"arguments": {}, "name": "add"}</tool_call>',  # name must come first
        '<tool_call>{"name": "add", "arguments": 3}</tool_call>',  # arguments not an object
        'Sure: {"name": "add", "arguments": {}}',  # a bare object only as the whole answer
    ):
        content, calls = collect(scan(text))
        assert (content, calls) == (text, []), text


def test_space_around_calls_is_not_content_but_is_kept_in_text() -> None:
    call = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    for cuts in ([], [1], [2, 5], [3, 40]):
        events = scan(f" \n{call}\n \n{call} \n", cuts)
        assert not any(isinstance(e, Content) for e in events)  # streamed: no stray chunks
        assert len(collect(events)[1]) == 2
    assert collect(scan(" \n<tool_call>hello", [1, 4])) == (" \n<tool_call>hello", [])


def test_arguments_cut_short_stay_cut() -> None:
    content, calls = collect(scan('{"name": "add", "arguments": {"a": "lo'))
    assert content == "" and calls[0]["function"]["arguments"] == '{"a": "lo'


def test_streamed_events_name_first_then_argument_pieces() -> None:
    scanner = CallScanner(NAMES)
    assert scanner.feed('{"name": "ad') == []  # held: it may still be a call
    start = scanner.feed('d", "arguments": {"a"')
    assert isinstance(start[0], CallStart) and start[0].name == "add"
    assert [e.text for e in start[1:] if isinstance(e, CallArgs)] == ["{", '"a"']
    assert [e.text for e in scanner.feed(": 1}}")] == [": 1}"]  # its own } is not an argument
    assert scanner.finish() == [] and scanner.calls == 1


_PIECES = st.sampled_from(
    [
        '{"name": "add", "arguments": ',
        "<tool_call>",
        "</tool_call>",
        "{",
        "}",
        '"',
        "\\",
        " ",
        "x",
        "\n",
        "[",
        "]",
    ]
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(_PIECES | st.text(max_size=4), max_size=12), st.lists(st.integers(0, 200), max_size=6)
)
def test_any_text_reads_the_same_whatever_its_chunks(pieces: list[str], cuts: list[int]) -> None:
    text = "".join(pieces)
    whole, chunked = scan(text), scan(text, cuts)
    assert merged(chunked) == merged(whole)
    content, calls = collect(whole)
    if not calls:
        assert content == text  # nothing is lost or invented


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(st.text(max_size=5), _JSON, max_size=4),
    st.booleans(),
    st.sampled_from(["", " ", "\n"]),
    st.lists(st.integers(0, 120), max_size=5),
)
def test_a_call_reads_back_its_arguments(
    args: dict[str, Any], block: bool, ws: str, cuts: list[int]
) -> None:
    call = json.dumps({"name": "get_weather", "arguments": args}, separators=(",", ws + ":"))
    text = f"<tool_call>{ws}{call}{ws}</tool_call>" if block else f"{ws}{call}{ws}"
    content, calls = collect(scan(text, cuts))
    assert content == "" and len(calls) == 1
    assert json.loads(calls[0]["function"]["arguments"]) == args


# -- the request's tool plan ------------------------------------------------------------


def test_tool_choice_plans() -> None:
    body: dict[str, Any] = {"tools": [WEATHER, ADD]}
    auto = plan_tools(body)
    assert auto is not None and auto.schema is None and auto.names == NAMES
    assert plan_tools({**body, "tool_choice": "none"}) is None
    assert plan_tools({"messages": []}) is None
    named = plan_tools({**body, "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert named is not None and named.names == {"add"}
    assert named.schema is not None and named.schema["properties"]["name"] == {"const": "add"}
    assert named.schema["properties"]["arguments"] == {"type": "object"}
    required = plan_tools({**body, "tool_choice": "required"})
    assert required is not None and required.schema is not None
    assert [s["properties"]["name"]["const"] for s in required.schema["anyOf"]] == [
        "get_weather",
        "add",
    ]
    assert (
        required.schema["anyOf"][0]["properties"]["arguments"] == WEATHER["function"]["parameters"]
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": []}, "tools"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"functions": [WEATHER["function"]]}, "functions"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        ({"tools": [WEATHER], "logprobs": True}, "logprobs"),
    ],
)
def test_bad_tools_are_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as err:
        plan_chat(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}, "m", None
        )
    assert err.value.status == 400 and err.value.param == param


def test_chat_plan_carries_tools_turns_and_the_forced_schema() -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    plan = plan_chat(
        {"model": "m", "messages": messages, "tools": [WEATHER], "tool_choice": "required"},
        "m",
        None,
    )
    assert plan.args["tools"] == [WEATHER]
    assert plan.args["messages"][1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": messages[1]["tool_calls"],
    }
    assert plan.args["messages"][2] == {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}
    assert plan.args["sampling"]["json_schema"]["properties"]["name"] == {"const": "get_weather"}
    with pytest.raises(ApiError):  # a tool result must say which call it answers
        plan_chat({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "m", None)


# -- the worker's rendering -------------------------------------------------------------


class Vocab:
    bos, eos = 2, 1

    def metadata(self, key: str) -> str | None:
        return None

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        return [ord(c) for c in text]

    def is_eog(self, token: int) -> bool:
        return token == 1


ROUND_TRIP: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "a", "content": "18 C"},
    {"role": "tool", "tool_call_id": "b", "content": "sunny"},
]


def test_a_template_without_tools_gets_the_preamble_and_text_turns() -> None:
    tpl = ChatTemplate(FALLBACK_TEMPLATE, bos_token="<bos>")
    assert not tpl.tool_aware and tpl.info()["tools"] == "preamble"
    text = tpl.render(ROUND_TRIP, tools=[WEATHER])
    functions = json.dumps([WEATHER["function"]])
    head = PREAMBLE.format(functions=functions)
    assert text.startswith(f"<bos><start_of_turn>user\n{head}\n\nWeather in Paris?<end_of_turn>\n")
    assert (
        "<start_of_turn>model\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><end_of_turn>\n'
    ) in text
    assert (
        "<start_of_turn>user\n<tool_response>\n18 C\n</tool_response>\n"
        "<tool_response>\nsunny\n</tool_response><end_of_turn>\n<start_of_turn>model\n"
    ) in text
    plain = [{"role": "user", "content": "hi"}]
    assert tpl.render(plain, tools=None) == tpl.render(plain)  # no tools: nothing added


TOOL_TEMPLATE = (
    "{% if tools %}TOOLS={{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}:"
    "{% for c in m.tool_calls or [] %}"
    "CALL {{ c.function.name }} {{ c.function.arguments.city }};{% endfor %}"
    "{{ m.content }}\n{% endfor %}"
)


def test_a_template_with_tools_renders_them_itself() -> None:
    tpl = ChatTemplate(TOOL_TEMPLATE, source="model")
    assert tpl.tool_aware and tpl.info()["tools"] == "template"
    text = tpl.render(ROUND_TRIP, tools=[WEATHER])
    assert text.startswith("TOOLS=" + json.dumps([WEATHER], ensure_ascii=False) + "\n")
    assert "assistant:CALL get_weather Paris;\n" in text  # arguments given as an object
    assert "tool:18 C\ntool:sunny\n" in text
    assert not tpl.render(ROUND_TRIP).startswith("TOOLS")


def test_worker_validates_tools_and_tool_turns() -> None:
    assert read_tools(None) is None and read_tools([]) is None
    assert read_tools([WEATHER]) == [WEATHER]
    for bad in (
        [{"type": "function"}],
        [{"type": "function", "function": {"name": ""}}],
        "x",
        [ADD, ADD],
    ):
        with pytest.raises(BadRequest, match="tools"):
            read_tools(bad)
    got = read_messages(ROUND_TRIP, max_chars=10_000)
    assert got[1]["tool_calls"] == ROUND_TRIP[1]["tool_calls"] and got[2]["tool_call_id"] == "a"
    for bad_msg in (
        {"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "f", "arguments": 3}}],
        },
        {"role": "assistant", "content": None},
    ):
        with pytest.raises(BadRequest, match=r"messages\[0\]"):
            read_messages([bad_msg], max_chars=10_000)
