"""One streamed ``POST /v1/completions`` against an OpenAI-compatible front.

The HTTP twin of ``runner.one_request``: the same ``RequestRecord`` (first
token, every token's arrival, usage, finish reason), so a run against the
gateway's HTTP front and one against its ZeroMQ front report alike. Tokens
are counted from the server-sent chunks (one per generated token on skiff's
front) and corrected by the final ``usage`` chunk (``include_usage``).
``ignore_eos`` is sent as the extension field vLLM and skiff accept.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from .prompts import Prompt
from .stats import RequestRecord

_CLIENT_SLACK_S = 5.0
_STATUS_CODES = {
    400: "bad_request",
    404: "not_found",
    429: "queue_full",
    503: "worker_unavailable",
    504: "deadline_exceeded",
}


def completion_body(
    prompt: Prompt,
    max_tokens: int,
    ignore_eos: bool,
    sampling: dict[str, Any] | None,
    model: str = "skiff",
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt if isinstance(prompt, str) else list(prompt),
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if sampling:
        body["temperature"] = sampling.get("temperature", 0.0)
        if "seed" in sampling:
            body["seed"] = sampling["seed"]
    return body


async def one_http_request(
    http: aiohttp.ClientSession,
    body: dict[str, Any],
    index: int,
    endpoint: str,
    t0: float,
    timeout_ms: int,
) -> RequestRecord:
    """Send one streamed completion to ``endpoint`` (the front's base URL)."""
    rec = RequestRecord(index=index, endpoint=endpoint, t_send=time.perf_counter() - t0)
    guard = timeout_ms / 1e3 + _CLIENT_SLACK_S if timeout_ms else None
    url = endpoint.rstrip("/") + "/v1/completions"
    try:
        async with asyncio.timeout(guard), http.post(url, json=body) as resp:
            if resp.status != 200:
                rec.error = _STATUS_CODES.get(resp.status, f"http_{resp.status}")
            else:
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    _absorb_chunk(rec, json.loads(data), time.perf_counter() - t0)
    except TimeoutError:
        rec.error = "timeout"
    except Exception:  # a client-side failure must not end the whole run
        rec.error = "client_error"
    rec.t_end = time.perf_counter() - t0
    return rec


def _absorb_chunk(rec: RequestRecord, chunk: dict[str, Any], now: float) -> None:
    if "error" in chunk:
        err = chunk["error"] or {}
        rec.error = str(err.get("code") or err.get("type") or "error")
        return
    choices = chunk.get("choices") or []
    for choice in choices:
        if choice.get("text"):
            if rec.t_first is None:
                rec.t_first = now
            rec.token_times.append(now)
            rec.n_tokens += 1
        if choice.get("finish_reason") is not None:
            rec.finish_reason = str(choice["finish_reason"])
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("prompt_tokens"), int):
            rec.prompt_tokens = usage["prompt_tokens"]
        completion = usage.get("completion_tokens")
        if isinstance(completion, int) and completion >= rec.n_tokens:
            # tokens whose text was still an incomplete UTF-8 sequence came
            # in a later chunk: count them, timed with the chunk that held them
            extra = completion - rec.n_tokens
            rec.token_times.extend([rec.token_times[-1] if rec.token_times else now] * extra)
            rec.n_tokens = completion
