"""Tools on ``/v1/chat/completions`` with the official ``openai`` client.

The shared worker (Gemma 3 270M base: its template has no tool support, so
the worker writes its tool preamble) sits behind the HTTP front. A base
model this small only makes well-formed calls when the grammar forces them,
so forced calls (a named function, ``required``) are checked for content:
the call parses and its arguments validate against the function's schema,
streamed and not alike. ``auto`` and ``none`` are checked end to end for
shape; reading calls out of free text is tested on fixed texts in
``test_tools_units.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from gateway.openai.http import HttpFront

PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[ChatCompletionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast for a city",
            "parameters": PARAMETERS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]
ASK: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the weather in Paris, in celsius?"}
]
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def oai(worker: tuple[str, Path]) -> Iterator[openai.OpenAI]:
    front = HttpFront(worker[0])
    front.start("127.0.0.1", 0)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{front.port}/v1", api_key="x", max_retries=0)
    front.stop()


def _streamed(chunks: list[Any]) -> tuple[str, dict[int, dict[str, str]], str | None]:
    """A stream's content, its calls by index ({id, name, arguments}) and finish."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            if call.id is not None:  # only in a call's first chunk, with its name
                assert call.function is not None and call.function.name and not entry["id"]
                entry["id"], entry["name"] = call.id, call.function.name
            if call.function is not None and call.function.arguments:
                assert entry["id"], "arguments before the call's first chunk"
                entry["arguments"] += call.function.arguments
        finish = choice.finish_reason or finish
    return content, calls, finish


def test_forced_named_call_streamed_and_not(oai: openai.OpenAI) -> None:
    kw: Any = {"model": "skiff", "messages": ASK, "tools": TOOLS, "tool_choice": NAMED}
    whole = oai.chat.completions.create(**kw, temperature=0, max_tokens=60)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.tool_calls is not None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, PARAMETERS)
    chunks = list(oai.chat.completions.create(**kw, temperature=0, max_tokens=60, stream=True))
    content, calls, finish = _streamed(chunks)
    assert content == "" and finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert calls[0]["arguments"] == call.function.arguments  # same tokens, same text
    pieces = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(pieces) > 2  # the arguments arrive in pieces, not at the end


def test_required_picks_one_of_the_functions(oai: openai.OpenAI) -> None:
    whole = oai.chat.completions.create(
        model="skiff",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=60,
    )
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_none_and_auto_answer_with_the_right_shapes(oai: openai.OpenAI) -> None:
    plain = oai.chat.completions.create(model="skiff", messages=ASK, temperature=0, max_tokens=8)
    none = oai.chat.completions.create(
        model="skiff", messages=ASK, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=8
    )
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content == plain.choices[0].message.content  # no tools in it
    assert none.usage is not None and plain.usage is not None
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    auto = oai.chat.completions.create(
        model="skiff", messages=ASK, tools=TOOLS, temperature=0, max_tokens=12
    )
    assert auto.usage is not None and auto.usage.prompt_tokens > plain.usage.prompt_tokens + 50
    message = auto.choices[0].message
    if message.tool_calls:  # a base model may or may not call: either shape is whole
        assert auto.choices[0].finish_reason in ("tool_calls", "length")
        assert message.tool_calls[0].function.name in ("get_weather", "get_time")
    else:
        assert isinstance(message.content, str) and auto.choices[0].finish_reason in (
            "stop",
            "length",
        )
    chunks = list(
        oai.chat.completions.create(
            model="skiff", messages=ASK, tools=TOOLS, temperature=0, max_tokens=12, stream=True
        )
    )
    content, calls, _ = _streamed(chunks)
    assert content == (message.content or "")
    assert [c["name"] for c in calls.values()] == [
        c.function.name for c in message.tool_calls or []
    ]


def test_round_trip_call_result_answer(oai: openai.OpenAI) -> None:
    call = {
        "id": "call_abc123",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    history: list[ChatCompletionMessageParam] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},  # type: ignore[list-item]
        {"role": "tool", "tool_call_id": "call_abc123", "content": '{"temperature": 18}'},
    ]
    asked = oai.chat.completions.create(
        model="skiff", messages=ASK, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=1
    )
    answer = oai.chat.completions.create(
        model="skiff",
        messages=history,
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=8,
    )
    assert answer.choices[0].message.tool_calls is None
    assert isinstance(answer.choices[0].message.content, str)
    assert answer.usage is not None and asked.usage is not None
    # the call and its result are in the prompt (as text: Gemma's template has no tools)
    assert answer.usage.prompt_tokens > asked.usage.prompt_tokens + 20
    with_tools = oai.chat.completions.create(
        model="skiff", messages=history, tools=TOOLS, temperature=0, max_tokens=8
    )
    assert with_tools.usage is not None
    assert with_tools.usage.prompt_tokens > answer.usage.prompt_tokens + 50  # + the preamble


def test_bad_tools_are_openai_400s(oai: openai.OpenAI) -> None:
    bad: list[dict[str, Any]] = [
        {"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {
                            "type": "object",
                            "properties": {"x": {"type": "array", "minItems": 10**9}},
                        },
                    },
                }
            ],
            "tool_choice": "required",
        },  # the worker refuses the forced call's schema: still named as tools
    ]
    for body in bad:
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model="skiff", messages=ASK, max_tokens=4, **body)
        error = err.value.body
        assert isinstance(error, dict) and error["type"] == "invalid_request_error"
        assert error["param"] in ("tools", "tool_choice") and error["message"], error
