"""OpenAI-style errors for the HTTP front, and the one map from skiff codes to them.

An HTTP client sees ``{"error": {"message", "type", "param", "code"}}`` with a
status it can act on: 4xx means "change the request", 429 "come back after
``Retry-After`` seconds", 503 "no worker can take it now", 504 "it took too
long". skiff's stable codes (``faults.ErrorCode``) are kept verbatim in
``code`` so a log line or a client can tell ``queue_full`` from
``lanes_busy``; ``type`` carries OpenAI's coarse class. Choosing the status
for a code happens here and nowhere else.
"""

from __future__ import annotations

import math
import re
from typing import Any

from faults import ErrorCode, Fault
from protocol.transport import wire_code

# The code of the upstream's own timeout (no reply came in time): not a skiff code.
TIMEOUT = "timeout"

_BY_CODE: dict[str, tuple[int, str]] = {
    ErrorCode.BAD_REQUEST: (400, "invalid_request_error"),
    ErrorCode.CONTEXT_OVERFLOW: (400, "invalid_request_error"),
    ErrorCode.SESSION_NOT_ACTIVE: (400, "invalid_request_error"),
    ErrorCode.LIMIT_EXCEEDED: (400, "invalid_request_error"),
    ErrorCode.UNSUPPORTED: (400, "invalid_request_error"),
    ErrorCode.PAYLOAD_TOO_LARGE: (413, "invalid_request_error"),
    ErrorCode.LANES_BUSY: (429, "rate_limit_error"),
    ErrorCode.QUEUE_FULL: (429, "rate_limit_error"),
    ErrorCode.UNKNOWN_OP: (501, "not_implemented_error"),
    ErrorCode.WORKER_UNAVAILABLE: (503, "service_unavailable_error"),
    ErrorCode.STAGE_UNAVAILABLE: (503, "service_unavailable_error"),
    ErrorCode.SHUTTING_DOWN: (503, "service_unavailable_error"),
    # only our own cancel (client gone) or a drain ends a request this way
    ErrorCode.CANCELLED: (503, "service_unavailable_error"),
    ErrorCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    TIMEOUT: (504, "timeout_error"),
}

# skiff argument names (as the worker names them in bad_request messages) ->
# the OpenAI request field a client should fix.
_PARAM_OF = {
    "max_tokens": "max_tokens",
    "stop": "stop",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repeat_penalty": "repetition_penalty",
    "logit_bias": "logit_bias",
    "json_schema": "response_format",
    "grammar": "grammar",
    "top_logprobs": "top_logprobs",
    "logprobs": "logprobs",
    "messages": "messages",
    "prompt": "prompt",
    "tokens": "prompt",
    "text": "input",
    "voice": "voice",
    "speed": "speed",
    "format": "response_format",
}
_FIELD = re.compile(r"^(?:chat template|sampling\.)?([a-z_]+)")


class ApiError(Exception):
    """An error answered as OpenAI-style JSON with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}


def bad(message: str, param: str | None = None) -> ApiError:
    """A 400 for a request field (``param``) the client must fix."""
    return ApiError(400, message, param=param, code=ErrorCode.BAD_REQUEST.value)


def not_found(message: str, code: str = "not_found", param: str | None = None) -> ApiError:
    return ApiError(404, message, param=param, code=code)


def unavailable(message: str) -> ApiError:
    """503: the upstream is known not to answer (no request was sent)."""
    return ApiError(
        503, message, type_="service_unavailable_error", code=ErrorCode.WORKER_UNAVAILABLE.value
    )


def from_fault(fault: Fault) -> ApiError:
    """The HTTP error for a skiff fault: an error reply (``transport.fault_of``)
    or the upstream lost (``upstream.py``)."""
    return _from_code(wire_code(fault), fault.message, fault.retry_after_ms)


def timed_out(message: str) -> ApiError:
    """504: the upstream's reply did not come in time."""
    return _from_code(TIMEOUT, message, None)


def _from_code(code: str, message: str, retry_after_ms: int | None) -> ApiError:
    status, type_ = _BY_CODE.get(code, (500, "server_error"))
    if code == ErrorCode.LIMIT_EXCEEDED and retry_after_ms is not None:
        status, type_ = 429, "rate_limit_error"  # a per-client quota, not a bad request
    retry = None
    if status == 429 or (status == 503 and retry_after_ms is not None):
        # whole seconds, at least 1: Retry-After has no fractions
        retry = max(1, math.ceil((retry_after_ms or 1000) / 1000))
    param = None
    if status == 400:
        match = _FIELD.match(message)
        param = _PARAM_OF.get(match.group(1)) if match else None
        if message.startswith("chat template") or message.startswith("messages"):
            param = "messages"
    text = message or code
    if code == TIMEOUT:
        text = f"the upstream did not answer in time ({text})"
    return ApiError(status, text, type_=type_, param=param, code=code, retry_after_s=retry)
