"""skiff replies -> OpenAI response bodies and stream chunks.

One ``Shaper`` per request builds every object the client sees, so the id,
``created`` and ``model`` agree across all chunks of a stream. skiff's
``done`` event carries the finish reason and the usage counts; the held-back
tail of a stream (text kept in case it began a stop string) arrives in it
too and is sent as one last content chunk.

Logprobs: skiff reports token ids with natural-log probabilities of the raw
distribution; OpenAI wants token *texts*. Texts come from ``detokenize`` of
each token alone (so a token holding half a UTF-8 character shows U+FFFD and
its ``bytes`` are those of U+FFFD, not the raw half). JSON has no infinity, so
a non-finite logprob is reported as -9999.0, OpenAI's own floor.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence
from typing import Any

from .shapes import GenPlan
from .toolcalls import CallArgs, CallScanner, CallStart, Content, Event, collect

LOGPROB_FLOOR = -9999.0


def finish_reason(reason: Any) -> str:
    """skiff ``length`` stays ``length``; ``stop`` (and anything else) is ``stop``."""
    return "length" if reason == "length" else "stop"


def usage(raw: Any) -> dict[str, Any]:
    raw = raw if isinstance(raw, dict) else {}
    prompt = int(raw.get("prompt_tokens", 0))
    completion = int(raw.get("completion_tokens", 0))
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": int(raw.get("cached_tokens", 0))},
    }


def _lp(value: Any) -> float:
    number = float(value) if isinstance(value, int | float) else LOGPROB_FLOOR
    return number if math.isfinite(number) else LOGPROB_FLOOR


def tokens_of(tokens: Sequence[int], infos: Sequence[dict[str, Any]]) -> set[int]:
    """Every token id whose text the logprobs of these tokens name."""
    ids = set(tokens)
    for info in infos:
        ids.update(int(alt["token"]) for alt in info.get("top_logprobs", ()))
    return ids


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


class Shaper:
    """Builds the response objects of one request."""

    def __init__(self, plan: GenPlan, model: str) -> None:
        self.plan = plan
        self.model = model
        self.id = f"{'chatcmpl' if plan.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.offset = 0  # completions logprobs: text_offset of the next token
        # With tools, generated text goes through the call reader first.
        tools = plan.tools
        self.scanner = CallScanner(tools.names) if tools is not None else None

    # -- logprobs ------------------------------------------------------------------

    def logprobs(
        self, tokens: Sequence[int], infos: Sequence[dict[str, Any]], texts: dict[int, str]
    ) -> dict[str, Any]:
        """The ``logprobs`` object of a choice for these tokens (in order)."""
        if self.plan.chat:
            content = [
                {
                    "token": texts.get(token, ""),
                    "logprob": _lp(info.get("logprob")),
                    "bytes": _bytes(texts.get(token, "")),
                    "top_logprobs": [
                        {
                            "token": texts.get(int(alt["token"]), ""),
                            "logprob": _lp(alt.get("logprob")),
                            "bytes": _bytes(texts.get(int(alt["token"]), "")),
                        }
                        for alt in info.get("top_logprobs", ())
                    ],
                }
                for token, info in zip(tokens, infos, strict=True)
            ]
            return {"content": content, "refusal": None}
        out: dict[str, Any] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for token, info in zip(tokens, infos, strict=True):
            text = texts.get(token, "")
            out["tokens"].append(text)
            out["token_logprobs"].append(_lp(info.get("logprob")))
            out["top_logprobs"].append(
                {
                    texts.get(int(alt["token"]), ""): _lp(alt.get("logprob"))
                    for alt in info.get("top_logprobs", ())
                }
            )
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    # -- whole responses -------------------------------------------------------------

    def full(self, result: dict[str, Any], logprobs: dict[str, Any] | None) -> dict[str, Any]:
        """The non-streamed response for skiff's ``stream: false`` result."""
        text = str(result.get("text", ""))
        reason = finish_reason(result.get("finish_reason"))
        choice: dict[str, Any]
        if self.plan.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
            if self.scanner is not None:
                content, calls = collect(self.scanner.feed(text) + self.scanner.finish())
                if calls:
                    message["content"] = content if content.strip() else None
                    message["tool_calls"] = calls
                    reason = self.finish(reason)
            choice = {
                "index": 0,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": reason,
            }
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
            kind = "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(result.get("usage")),
            "system_fingerprint": None,
        }

    # -- stream chunks ---------------------------------------------------------------

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.plan.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "system_fingerprint": None,
        }
        if self.plan.include_usage:
            chunk["usage"] = None  # OpenAI: null on every chunk but the last
        return chunk

    def role_chunk(self) -> dict[str, Any]:
        """Chat streams open with the assistant role and empty content."""
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._chunk([choice])

    def text_chunk(
        self, text: str, logprobs: dict[str, Any] | None = None, finish: str | None = None
    ) -> dict[str, Any]:
        choice: dict[str, Any]
        if self.plan.chat:
            delta = {"content": text} if text or finish is None else {}
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return self._chunk([choice])

    def finish(self, reason: str) -> str:
        """``tool_calls`` for an answer that made calls and ended by itself."""
        made = self.scanner is not None and self.scanner.calls > 0
        return "tool_calls" if made and reason == "stop" else reason

    def text_chunks(self, text: str, *, end: bool = False) -> list[dict[str, Any]]:
        """Chat stream chunks for generated text: content as it comes, or,
        with tools, content and ``delta.tool_calls`` as the reader finds them
        (``end``: the stream is over, what it held back goes out)."""
        if self.scanner is None:
            return [self.text_chunk(text)] if text else []
        events = self.scanner.feed(text) if text else []
        if end:
            events += self.scanner.finish()
        return [self._event_chunk(e) for e in events]

    def _event_chunk(self, event: Event) -> dict[str, Any]:
        if isinstance(event, Content):
            return self.text_chunk(event.text)
        call: dict[str, Any]
        if isinstance(event, CallStart):
            fn = {"name": event.name, "arguments": ""}
            call = {"index": event.index, "id": event.id, "type": "function", "function": fn}
        else:
            assert isinstance(event, CallArgs)
            call = {"index": event.index, "function": {"arguments": event.text}}
        choice = {
            "index": 0,
            "delta": {"tool_calls": [call]},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._chunk([choice])

    def usage_chunk(self, raw: Any) -> dict[str, Any]:
        """``stream_options.include_usage``: the last chunk, no choices, the usage."""
        chunk = self._chunk([])
        chunk["usage"] = usage(raw)
        return chunk
