"""The HTTP front (``gateway.http.HttpFront``) driven by the official ``openai`` client.

A real worker process (the shared ``worker`` fixture) sits behind the front,
with no gateway between them: streamed and non-streamed completions and chat
must agree token for token at temperature 0, logprobs, stops, JSON schemas,
embeddings, models, health and the 400s and 404s go through the real
protocol. What a healthy worker will not produce on demand is
test_http_errors.py.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from _http_client import CHAT, _client, _raw

from conftest import wait_until
from gateway.openai.http import HttpFront
from protocol import Client

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def front(worker: tuple[str, Path]) -> Iterator[HttpFront]:
    http_front = HttpFront(worker[0])
    http_front.start("127.0.0.1", 0)
    yield http_front
    http_front.stop()


@pytest.fixture(scope="module")
def oai(front: HttpFront) -> openai.OpenAI:
    return _client(front)


# -- completions and chat against the real worker --------------------------------------


def test_completions_stream_equals_non_stream(oai: openai.OpenAI) -> None:
    whole = oai.completions.create(model="skiff", prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(
        oai.completions.create(
            model="skiff",
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert whole.object == "text_completion" and whole.choices[0].text
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    last, usage = chunks[-1].usage, whole.usage
    assert chunks[-1].choices == [] and last is not None and usage is not None  # include_usage
    assert last.completion_tokens == usage.completion_tokens == 12
    assert last.prompt_tokens == usage.prompt_tokens == 6
    assert usage.total_tokens == 18
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_equals_non_stream(oai: openai.OpenAI) -> None:
    whole = oai.chat.completions.create(
        model="skiff", messages=CHAT, max_completion_tokens=10, temperature=0
    )
    chunks = list(
        oai.chat.completions.create(
            model="skiff", messages=CHAT, max_tokens=10, temperature=0, stream=True
        )
    )
    assert whole.choices[0].message.role == "assistant"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content and text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert whole.usage is not None and whole.usage.completion_tokens <= 10


def test_stream_ends_with_done_on_the_wire(front: HttpFront) -> None:
    body = {"model": "skiff", "prompt": PROMPT, "max_tokens": 3, "stream": True}
    conn, resp = _raw(front, "POST", "/v1/completions", body)
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    events = [line for line in resp.read().decode().split("\n\n") if line]
    conn.close()
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"]


def test_completion_logprobs(oai: openai.OpenAI) -> None:
    out = oai.completions.create(
        model="skiff", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert "".join(lp.tokens) == out.choices[0].text
    for chosen, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and logprob <= 0
        assert logprob == max(top.values()) == top[chosen]  # greedy takes the top token
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_chat_logprobs_streamed_and_not(oai: openai.OpenAI) -> None:
    args: dict[str, Any] = {
        "model": "skiff",
        "messages": CHAT,
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = oai.chat.completions.create(**args)
    assert whole.choices[0].logprobs is not None
    content = whole.choices[0].logprobs.content
    assert content and "".join(t.token for t in content) == whole.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.bytes == list(t.token.encode()) for t in content)
    streamed = [
        entry
        for chunk in oai.chat.completions.create(**args, stream=True)
        if chunk.choices and chunk.choices[0].logprobs is not None
        for entry in chunk.choices[0].logprobs.content or []
    ]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]


def test_stop_is_honoured(oai: openai.OpenAI) -> None:
    free = oai.completions.create(model="skiff", prompt=PROMPT, max_tokens=12, temperature=0)
    text = free.choices[0].text
    word = text.split()[2]  # a word the free run reaches
    for stop in (f" {word}", ["zzzz", f" {word}"]):
        cut = oai.completions.create(
            model="skiff", prompt=PROMPT, max_tokens=12, temperature=0, stop=stop
        )
        assert cut.choices[0].text == text[: text.index(f" {word}")]
        assert cut.choices[0].finish_reason == "stop"


def test_json_schema_response_parses(oai: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    out = oai.chat.completions.create(
        model="skiff",
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    value = json.loads(out.choices[0].message.content or "")
    assert set(value) == {"answer"} and value["answer"] in ("yes", "no")
    assert out.choices[0].finish_reason == "stop"
    # json_object constrains to any object, so only the model closes it: a
    # prompt to copy makes that likely (a bare "JSON:" nested forever on one
    # build's rounding and ran out of tokens)
    obj = oai.completions.create(
        model="skiff",
        prompt='Copy this JSON object: {"ok": true}\nCopy: ',
        max_tokens=40,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert obj.choices[0].finish_reason == "stop", obj.choices[0].text
    assert isinstance(json.loads(obj.choices[0].text), dict)


def test_seed_reproduces_a_sampled_run(oai: openai.OpenAI) -> None:
    def run() -> str:
        out = oai.completions.create(
            model="skiff", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=1234
        )
        return out.choices[0].text

    assert run() == run()


def test_client_disconnect_cancels_the_generation(front: HttpFront, worker: Any) -> None:
    # long enough to be running when the client goes, however slowly it goes
    body = {"model": "skiff", "prompt": "Once upon a time", "max_tokens": 1800, "stream": True}
    with Client(worker[0]) as skiff:
        before = skiff.stats()["cancelled"]
        conn, resp = _raw(front, "POST", "/v1/completions", {**body, "temperature": 0})
        assert resp.readline().startswith(b"data: ")  # the stream is running
        conn.close()
        wait_until(lambda: skiff.stats()["cancelled"] != before, what="the generation cancelled")
        stats = skiff.stats()
    assert stats["cancelled"] == before + 1  # not 1800 tokens decoded for nobody


# -- embeddings, models, health ---------------------------------------------------------


def test_embeddings_float_and_base64(oai: openai.OpenAI) -> None:
    out = oai.embeddings.create(model="skiff", input=["hello world", "goodbye"])
    assert [d.index for d in out.data] == [0, 1]
    assert all(len(d.embedding) == 640 for d in out.data)
    assert out.usage.prompt_tokens > 0
    packed = oai.embeddings.create(model="skiff", input="hello world", encoding_format="base64")
    raw = packed.data[0].embedding
    vector = np.frombuffer(base64.b64decode(raw), dtype="<f4")  # type: ignore[arg-type]
    assert vector.shape == (640,)
    assert np.allclose(vector, out.data[0].embedding)


def test_embeddings_are_the_documented_pooling(
    oai: openai.OpenAI, worker: tuple[str, Path]
) -> None:
    with Client(worker[0]) as skiff:
        reply = skiff.call("embed", None, {"text": "hello world", "pooling": "none"})
    hidden = np.asarray(reply.frame.array("hidden"), dtype=np.float64)  # [tokens, n_embd]
    mean = oai.embeddings.create(model="skiff", input="hello world")
    assert mean.model_dump()["pooling"] == "mean"
    assert mean.usage.prompt_tokens == mean.usage.total_tokens == hidden.shape[0]
    assert np.allclose(mean.data[0].embedding, hidden.mean(axis=0), rtol=1e-4, atol=1e-5)
    last = oai.embeddings.create(model="skiff", input="hello world", extra_body={"pooling": "last"})
    assert last.model_dump()["pooling"] == "last"
    assert np.allclose(last.data[0].embedding, hidden[-1], rtol=1e-4, atol=1e-5)
    with pytest.raises(openai.BadRequestError) as err:
        oai.embeddings.create(model="skiff", input="hi", extra_body={"pooling": "cls"})
    assert err.value.body["param"] == "pooling"  # type: ignore[index]


def test_models_list_the_served_name_then_the_real_model(
    oai: openai.OpenAI, worker: tuple[str, Path]
) -> None:
    with Client(worker[0]) as skiff:
        info = skiff.info()
    name = info["model"]["name"]
    models = oai.models.list().data
    assert [m.id for m in models] == ["skiff", name]
    served, real = (m.model_dump() for m in models)
    assert served["context_length"] == served["max_model_len"] == info["n_ctx_per_lane"] == 2048
    assert served["root"] == name and served["skiff"]["model"]["n_embd"] == 640
    assert "path" not in served["skiff"]["model"]
    assert real["context_length"] == 2048 and real["owned_by"] == "skiff"
    assert real["skiff"]["n_ctx_train"] == info["model"]["n_ctx_train"]
    assert oai.models.retrieve("skiff").id == "skiff"
    assert oai.models.retrieve(name).model_dump()["context_length"] == 2048
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4")
    # the real name is a model every worker serves: requests may use it
    out = oai.completions.create(model=name, prompt=PROMPT, max_tokens=2, temperature=0)
    assert out.usage is not None and out.usage.completion_tokens == 2
    with pytest.raises(openai.NotFoundError) as err:
        oai.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert err.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_health_follows_ready(worker: tuple[str, Path]) -> None:
    flag = {"ready": False}
    http_front = HttpFront(worker[0], ready=lambda: flag["ready"])
    http_front.start("127.0.0.1", 0)
    try:
        conn, resp = _raw(http_front, "GET", "/health")
        assert resp.status == 503
        conn.close()
        flag["ready"] = True
        conn, resp = _raw(http_front, "GET", "/health")
        assert resp.status == 200 and json.loads(resp.read()) == {"status": "ok"}
        conn.close()
    finally:
        http_front.stop()


# -- errors --------------------------------------------------------------------------------


def test_bad_requests_are_400_and_unknown_things_404(oai: openai.OpenAI, front: HttpFront) -> None:
    with pytest.raises(openai.BadRequestError) as ours:
        oai.completions.create(model="skiff", prompt="x", max_tokens=2, temperature=3)
    assert ours.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as workers:  # refused by the worker itself
        oai.completions.create(model="skiff", prompt="x", max_tokens=100_000)
    assert workers.value.body["param"] == "max_tokens"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model="skiff", messages=CHAT, n=2)
    with pytest.raises(openai.NotFoundError) as model:
        oai.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert model.value.body["code"] == "model_not_found"  # type: ignore[index]
    conn, resp = _raw(front, "POST", "/v1/nowhere", {})
    assert resp.status == 404 and json.loads(resp.read())["error"]["code"] == "not_found"
    conn.close()
    conn, resp = _raw(front, "GET", "/v1/completions")
    assert resp.status == 405 and resp.getheader("Allow") == "POST"
    assert json.loads(resp.read())["error"]["code"] == "method_not_allowed"
    conn.close()
