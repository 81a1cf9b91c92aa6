"""What the HTTP front's tests share (test_http_openai, test_http_errors): the
official ``openai`` client and a raw ``http.client`` request against an
``HttpFront``, and a chat request.
"""

from __future__ import annotations

import http.client
import json
from typing import Any

import openai
from openai.types.chat import ChatCompletionMessageParam

from conftest import WAIT_S
from gateway.openai.http import HttpFront

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name three colours."}]


def _client(front: HttpFront) -> openai.OpenAI:
    # max_retries=0: the client would otherwise retry 429/503 by itself
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{front.port}/v1", api_key="unused", max_retries=0
    )


def _raw(
    front: HttpFront, method: str, path: str, body: Any = None
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=WAIT_S)
    data = None if body is None else json.dumps(body)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()
