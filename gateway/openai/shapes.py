"""OpenAI request bodies -> skiff ``generate`` / ``chat`` arguments.

Every field a client sends is either translated exactly, refused with a 400
naming it (so a client never silently gets something other than it asked
for), or ignored because it cannot change the output (``user``,
``metadata``, ``store``...). Ranges are OpenAI's, not llama.cpp's: a request
that works here works against OpenAI and vice versa.

Sampling follows OpenAI's semantics, not llama.cpp's defaults: an absent
``temperature`` / ``top_p`` is 1 (OpenAI's default), and llama.cpp's extra
truncation (``top_k`` 40, ``min_p`` 0.05) is off unless asked for with the
vLLM-style extensions ``top_k`` / ``min_p``. OpenAI penalties count every
generated token, so they run with ``penalty_last_n = -1`` (skiff's history
holds only sampled tokens, as OpenAI's does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .errors import bad, not_found
from .images import check_images, image_part
from .tools import ToolPlan, past_calls, plan_tools

SEED_MODULUS = 0xFFFFFFFF  # skiff seeds are [0, 2^32 - 1); 2^32 - 1 means "random"
MAX_TOP_LOGPROBS = 20
MAX_STOPS = 16
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions

# Fields that change nothing we produce: accepted and ignored.
# (Anything else unknown is ignored too; these are listed for readers.)
IGNORED = ("user", "metadata", "store", "service_tier", "prediction", "reasoning_effort")


@dataclass
class GenPlan:
    """What one completion request asks of skiff, and how to shape the answer."""

    op: str  # "generate" or "chat"
    args: dict[str, Any]
    stream: bool
    include_usage: bool
    top_logprobs: int | None  # None: no logprobs; else how many alternatives per token
    chat: bool
    tools: ToolPlan | None = None  # chat with tools: how to ask and how to read the answer


def _opt_number(body: dict[str, Any], name: str, lo: float, hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad(f"{name} must be a number", name)
    if math.isnan(value) or not lo <= value <= hi:
        raise bad(f"{name} must be between {lo:g} and {hi:g}", name)
    return float(value)


def _opt_int(body: dict[str, Any], name: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"{name} must be an integer", name)
    if value < lo or (hi is not None and value > hi):
        span = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise bad(f"{name} must be {span}", name)
    return value


def _opt_bool(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise bad(f"{name} must be a boolean", name)
    return value


def _refuse(body: dict[str, Any], name: str, allowed: tuple[Any, ...], why: str) -> None:
    """400 when ``name`` is present with a value other than ``allowed`` (or null)."""
    value = body.get(name)
    if value is not None and value not in allowed:
        raise bad(f"{name} is not supported: {why}", name)


def check_model(body: dict[str, Any], model_name: str) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model is required (a string)", "model")
    if model != model_name:
        raise not_found(
            f"The model '{model[:128]}' does not exist; this server serves '{model_name}'",
            code="model_not_found",
            param="model",
        )


def _stops(body: dict[str, Any]) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop must be a non-empty string or a list of non-empty strings", "stop")
    if len(stops) > MAX_STOPS:
        raise bad(f"stop has {len(stops)} entries; at most {MAX_STOPS} are supported", "stop")
    return list(stops)


def _logit_bias(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, dict):
        raise bad("logit_bias must be a map of token id -> bias", "logit_bias")
    out: list[dict[str, Any]] = []
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad(f"logit_bias key {str(key)[:32]!r} is not a token id", "logit_bias") from None
        ok = isinstance(bias, int | float) and not isinstance(bias, bool)
        if not ok or math.isnan(bias) or not -100 <= bias <= 100:
            raise bad("logit_bias values must be numbers between -100 and 100", "logit_bias")
        out.append({"token": token, "bias": float(bias)})
    return out


def _response_format(body: dict[str, Any], sampling: dict[str, Any]) -> None:
    """``response_format`` -> a skiff ``json_schema`` (grammar-constrained sampling)."""
    fmt = body.get("response_format")
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return
    if kind == "json_object":
        sampling["json_schema"] = {"type": "object"}
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise bad("response_format.json_schema must be an object", "response_format")
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise bad("response_format.json_schema.schema must be an object", "response_format")
        sampling["json_schema"] = schema
    else:
        raise bad(
            "response_format.type must be 'text', 'json_object' or 'json_schema'",
            "response_format",
        )
    if "grammar" in sampling:
        raise bad("give response_format or grammar, not both", "response_format")


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The skiff ``sampling`` map for OpenAI's sampling fields (always present)."""
    temperature = _opt_number(body, "temperature", 0.0, 2.0)
    top_p = _opt_number(body, "top_p", 0.0, 1.0)
    sampling: dict[str, Any] = {
        "temperature": 1.0 if temperature is None else temperature,
        "top_p": 1.0 if top_p is None else top_p,
        "top_k": _opt_int(body, "top_k", 0, 1 << 20) or 0,
        "min_p": _opt_number(body, "min_p", 0.0, 1.0) or 0.0,
    }
    penalised = False
    for name in ("presence_penalty", "frequency_penalty"):
        value = _opt_number(body, name, -2.0, 2.0)
        if value:
            sampling[name] = value
            penalised = True
    repetition = _opt_number(body, "repetition_penalty", 0.0, 100.0)
    if repetition is not None:
        if repetition <= 0:
            raise bad("repetition_penalty must be > 0", "repetition_penalty")
        sampling["repeat_penalty"] = repetition
        penalised = penalised or repetition != 1.0
    if penalised:
        sampling["penalty_last_n"] = -1  # every generated token, as OpenAI counts them
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise bad("seed must be an integer", "seed")
        sampling["seed"] = seed % SEED_MODULUS  # never the "random" sentinel
    if body.get("logit_bias") is not None:
        sampling["logit_bias"] = _logit_bias(body["logit_bias"])
    grammar = body.get("grammar")  # llama-server's extension
    if grammar is not None:
        if not isinstance(grammar, str) or not grammar.strip():
            raise bad("grammar must be a non-empty GBNF string", "grammar")
        sampling["grammar"] = grammar
    _response_format(body, sampling)
    return sampling


def _common(body: dict[str, Any], max_tokens: int | None) -> tuple[dict[str, Any], bool, bool]:
    """Arguments both endpoints share: (skiff args, stream, include_usage)."""
    _refuse(body, "n", (1,), "one choice per request")
    stream = bool(_opt_bool(body, "stream"))
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad("stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(options, dict):
            raise bad("stream_options must be an object", "stream_options")
        include_usage = bool(_opt_bool(options, "include_usage"))
    args: dict[str, Any] = {"stream": stream, "sampling": _sampling(body)}
    if max_tokens is not None:
        args["max_tokens"] = max_tokens
    stops = _stops(body)
    if stops:
        args["stop"] = stops
    if _opt_bool(body, "ignore_eos"):  # vLLM's extension
        args["ignore_eos"] = True
    return args, stream, include_usage


def _with_logprobs(args: dict[str, Any], top: int | None) -> int | None:
    if top is not None:
        args["logprobs"] = True
        args["top_logprobs"] = top
    return top


def _prompt(body: dict[str, Any]) -> dict[str, Any]:
    """``prompt``: a string or one token list (a batch of one is unwrapped)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return {"tokens": prompt}
    if isinstance(prompt, list) and len(prompt) > 1:
        raise bad("prompt: one prompt per request is supported (send several requests)", "prompt")
    raise bad("prompt must be a string or a list of token ids", "prompt")


def plan_completion(body: dict[str, Any], model_name: str) -> GenPlan:
    """``POST /v1/completions`` -> skiff ``generate``."""
    check_model(body, model_name)
    _refuse(body, "echo", (False,), "the prompt is not echoed")
    _refuse(body, "best_of", (1,), "one candidate per request")
    _refuse(body, "suffix", ("",), "no insertion (fill-in-the-middle) mode")
    max_tokens = _opt_int(body, "max_tokens", 1)
    args, stream, include_usage = _common(
        body, COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    )
    args.update(_prompt(body))
    top = _with_logprobs(args, _opt_int(body, "logprobs", 0, MAX_TOP_LOGPROBS))
    return GenPlan("generate", args, stream, include_usage, top, chat=False)


def _content(value: Any, i: int) -> str | list[dict[str, Any]]:
    """A message's content: a string, text parts joined, or (with an image)
    the parts themselves, checked (``images.py``), for the worker to splice."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts: list[str] = []
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(value):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                parts.append(image_part(part, where))
                continue
            if kind != "text":
                raise bad(f"{where}: only text and image_url parts are supported", "messages")
            text = part.get("text")
            if not isinstance(text, str):
                raise bad(f"{where}.text must be a string", "messages")
            texts.append(text)
            parts.append({"type": "text", "text": text})
        if len(parts) > len(texts):
            return parts
        return "\n".join(texts)
    raise bad(f"messages[{i}].content must be a string or a list of content parts", "messages")


_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


def _message(msg: dict[str, Any], i: int) -> dict[str, Any]:
    raw = msg.get("role")
    role = _ROLES.get(raw) if isinstance(raw, str) else None
    if role is None:
        raise bad(f"messages[{i}].role must be one of {', '.join(_ROLES)}", "messages")
    if msg.get("function_call") is not None:
        raise bad(f"messages[{i}].function_call is deprecated: use tool_calls", "messages")
    out: dict[str, Any] = {"role": role}
    calls = msg.get("tool_calls")
    if calls:
        if role != "assistant":
            raise bad(f"messages[{i}].tool_calls: only assistant messages carry them", "messages")
        out["tool_calls"] = past_calls(calls, i)
    if role == "tool":
        call_id = msg.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad(f"messages[{i}].tool_call_id is required for a tool message", "messages")
        out["tool_call_id"] = call_id
    content = msg.get("content")
    out["content"] = "" if content is None and calls else _content(content, i)
    if role != "user" and isinstance(out["content"], list):
        raise bad(f"messages[{i}]: images are only supported in user messages", "messages")
    return out


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise bad(f"messages[{i}] must be an object", "messages")
        out.append(_message(msg, i))
    check_images(out)
    return out


def plan_chat(body: dict[str, Any], model_name: str, default_max_tokens: int | None) -> GenPlan:
    """``POST /v1/chat/completions`` -> skiff ``chat`` (the worker's template)."""
    check_model(body, model_name)
    tools = plan_tools(body)
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise bad("modalities: only ['text'] is supported", "modalities")
    _refuse(body, "audio", (), "text output only")
    _refuse(body, "web_search_options", (), "no web search")
    max_tokens = _opt_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", 1)
    args, stream, include_usage = _common(
        body, default_max_tokens if max_tokens is None else max_tokens
    )
    args["messages"] = _messages(body)
    top = _opt_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if _opt_bool(body, "logprobs"):
        if tools is not None:
            raise bad("logprobs is not supported together with tools", "logprobs")
        top = _with_logprobs(args, top or 0)
    elif top is not None:
        raise bad("top_logprobs requires logprobs to be true", "top_logprobs")
    if tools is not None:
        args["tools"] = tools.tools
        if tools.schema is not None:
            sampling = args["sampling"]
            if "json_schema" in sampling or "grammar" in sampling:
                raise bad(
                    "a forced tool call cannot also take response_format or grammar", "tool_choice"
                )
            sampling["json_schema"] = tools.schema
    return GenPlan("chat", args, stream, include_usage, top, chat=True, tools=tools)
