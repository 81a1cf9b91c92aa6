"""Error statuses of the HTTP front that a healthy worker will not produce on
demand (429, 503, 504, an error in the middle of a stream, an upstream lost
or never there) come from a scripted fake upstream: a ZeroMQ ROUTER that
answers the way a worker or the gateway would. Then the translation units:
OpenAI fields to skiff arguments, skiff codes to HTTP statuses.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import openai
import pytest
import zmq
from _http_client import CHAT, _client, _raw

from conftest import WAIT_S, FakeUpstream, wait_until
from gateway.openai.errors import ApiError, from_fault
from gateway.openai.http import HttpFront
from gateway.openai.shapes import plan_chat, plan_completion
from protocol.transport import error_reply, fault_of

# -- errors from a scripted upstream ---------------------------------------------------------


def _fail(code: str, retry_ms: int | None = None) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": f"scripted {code}"}
    if retry_ms is not None:
        error["retry_after_ms"] = retry_ms
    return {"ok": False, "error": error}


def _scripted(req: dict[str, Any]) -> list[dict[str, Any]]:
    prompt = req["args"].get("prompt", "")
    if prompt == "hang":
        return []  # never answered: the test takes the upstream away instead
    if prompt == "midway":
        token = {"ok": True, "event": "token", "token": 5, "text": "Hi", "position": 3}
        return [token, _fail("internal")]
    codes = {"queue": ("queue_full", 1500), "busy": ("lanes_busy", None)}
    codes |= {"late": ("deadline_exceeded", None), "gone": ("worker_unavailable", None)}
    return [_fail(*codes[prompt])]


def test_status_mapping_with_a_fake_upstream(tmp_path: Path) -> None:
    fake = FakeUpstream(f"ipc://{tmp_path}/fake.sock", _scripted)
    http_front = HttpFront(fake.sock.getsockopt_string(zmq.LAST_ENDPOINT))
    http_front.start("127.0.0.1", 0)
    oai = _client(http_front)
    try:
        with pytest.raises(openai.RateLimitError) as full:
            oai.completions.create(model="skiff", prompt="queue", max_tokens=2)
        assert full.value.response.headers["Retry-After"] == "2"  # 1500 ms, rounded up
        assert full.value.body["code"] == "queue_full"  # type: ignore[index]
        with pytest.raises(openai.RateLimitError) as busy:
            oai.completions.create(model="skiff", prompt="busy", max_tokens=2, stream=True)
        assert busy.value.response.headers["Retry-After"] == "1"
        for prompt, status in (("late", 504), ("gone", 503)):
            with pytest.raises(openai.APIStatusError) as err:
                oai.completions.create(model="skiff", prompt=prompt, max_tokens=2)
            assert err.value.status_code == status
        stream = oai.completions.create(model="skiff", prompt="midway", max_tokens=2, stream=True)
        with pytest.raises(openai.APIError, match="scripted internal"):
            for _chunk in stream:
                pass
    finally:
        http_front.stop()
        fake.close()


def test_lost_upstream_ends_requests_in_flight_with_503(tmp_path: Path) -> None:
    fake = FakeUpstream(f"ipc://{tmp_path}/fake.sock", _scripted)
    http_front = HttpFront(fake.sock.getsockopt_string(zmq.LAST_ENDPOINT))
    http_front.start("127.0.0.1", 0)
    failure: list[openai.APIStatusError] = []

    def ask() -> None:
        try:
            _client(http_front).completions.create(model="skiff", prompt="hang", max_tokens=2)
        except openai.APIStatusError as exc:
            failure.append(exc)

    asker = threading.Thread(target=ask)
    asker.start()
    try:
        wait_until(lambda: "generate" in fake.ops, what="the request reached the upstream")
        fake.close()  # the upstream process goes away with the request unanswered
        asker.join(WAIT_S)
        assert not asker.is_alive() and [e.status_code for e in failure] == [503]
        assert failure[0].body["code"] == "worker_unavailable"  # type: ignore[index]
    finally:
        http_front.stop()


def test_dead_upstream_is_503_not_a_hang(tmp_path: Path) -> None:
    nobody = f"ipc://{tmp_path}/nobody.sock"
    http_front = HttpFront(nobody, health_interval_s=0.1, down_after_s=0.5)
    http_front.start("127.0.0.1", 0)
    try:
        with pytest.raises(openai.InternalServerError) as err:  # in flight when marked down
            _client(http_front).completions.create(model="skiff", prompt="x", max_tokens=2)
        assert err.value.status_code == 503
        conn, resp = _raw(http_front, "GET", "/health")
        assert resp.status == 503
        conn.close()
    finally:
        http_front.stop()


# -- translation units ------------------------------------------------------------------------


def test_openai_fields_map_to_skiff_args() -> None:
    plan = plan_completion(
        {
            "model": "m",
            "prompt": ["only one"],
            "max_tokens": 5,
            "top_p": 0.5,
            "seed": -1,
            "stop": "END",
            "presence_penalty": 0.5,
            "logit_bias": {"7": -100},
            "logprobs": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        "m",
    )
    assert plan.op == "generate" and plan.stream and plan.include_usage
    assert plan.args["prompt"] == "only one" and plan.args["stop"] == ["END"]
    assert plan.args["logprobs"] is True and plan.args["top_logprobs"] == 2
    sampling = plan.args["sampling"]
    assert sampling["temperature"] == 1.0 and sampling["top_p"] == 0.5  # OpenAI's defaults
    assert sampling["top_k"] == 0 and sampling["min_p"] == 0.0  # no llama.cpp truncation
    assert sampling["seed"] == 0xFFFFFFFE  # -1 mod (2^32 - 1): never the random sentinel
    assert sampling["penalty_last_n"] == -1 and sampling["presence_penalty"] == 0.5
    assert sampling["logit_bias"] == [{"token": 7, "bias": -100.0}]
    chat = plan_chat(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            ],
            "response_format": {"type": "json_object"},
        },
        "m",
        1024,
    )
    assert chat.args["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert chat.args["max_tokens"] == 1024 and chat.top_logprobs is None
    assert chat.args["sampling"]["json_schema"] == {"type": "object"}
    for body in ({"tools": [{"type": "function"}]}, {"top_logprobs": 2}, {"n": 3}):
        with pytest.raises(ApiError) as err:
            plan_chat({"model": "m", "messages": CHAT, **body}, "m", None)
        assert err.value.status == 400 and err.value.param in body


@pytest.mark.parametrize(
    ("code", "retry_ms", "status", "retry_after"),
    [
        ("limit_exceeded", None, 400, None),  # a request over a size limit: fix the request
        ("limit_exceeded", 1000, 429, "1"),  # a per-client quota: come back later
        ("shutting_down", 2500, 503, "3"),  # a draining process: retry elsewhere or later
        ("queue_full", 200, 429, "1"),
    ],
)
def test_skiff_codes_map_to_http_status_and_retry_after(
    code: str, retry_ms: int | None, status: int, retry_after: str | None
) -> None:
    err = from_fault(fault_of(error_reply(1, code, "x", retry_ms)))
    assert err.status == status
    assert err.headers().get("Retry-After") == retry_after
