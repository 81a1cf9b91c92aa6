"""Chat templates: messages -> prompt tokens through a Jinja chat template.

The template comes from ``--chat-template FILE``, else the model's GGUF
``tokenizer.chat_template``, else the Gemma-turn fallback below (the packaged
Gemma 3 270M ships none). It renders in a sandboxed, immutable Jinja
environment with the names HF templates expect (``messages``,
``add_generation_prompt``, ``bos_token``, ``eos_token``, ``raise_exception``);
any error while rendering is the client's ``bad_request``.

The rendered text is tokenized with ``add_special=False`` and
``parse_special=True``: the template writes BOS and the turn markers itself,
and they become their special tokens. Generation stops at the template's
end-of-turn token, found once at load by rendering a probe conversation and
reading what the template writes after an assistant message (the "closer",
e.g. ``<end_of_turn>\\n``).

Tools (``tools`` and tool turns in the messages) go to the template when it
reads ``tools``, else they become a system preamble and text turns
(``tools.py``); ``info.chat_template.tools`` says which.

Multi-turn on a named session: the client sends only the new messages. The
model's previous turn ended at its end-of-turn token, which never reached the
KV cache, so a turn on a non-empty session first feeds the closer, and drops
the BOS the template put at the start.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, Protocol

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from faults import BadRequest

from ..runtime import RuntimeState
from .jobs.generate import GenerateJob
from .tools import as_text, for_template, has_tool_turns, uses_tools

FALLBACK_NAME = "gemma-turn"

# Gemma's turn format (as in Gemma 3's own template): BOS, system text folded
# into the first user turn, roles alternating user/model, generation prompt.
FALLBACK_TEMPLATE = """\
{{- bos_token -}}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{- raise_exception('Conversation roles must alternate user/assistant/...') -}}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{- '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') -}}
    {{- message['content'] | trim -}}
    {{- '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<start_of_turn>model\n' -}}
{%- endif -%}
"""

_PROBE = "skiffprobe7f3a"  # an assistant message's text, to find the closer
_BOS_SPELLINGS = ("<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>", "<|endoftext|>")
_EOS_SPELLINGS = ("<eos>", "</s>", "<|end_of_text|>", "<|endoftext|>", "<|eot_id|>", "<|im_end|>")


class ChatTemplateError(ValueError):
    """The template could not be loaded or compiled (a startup error)."""


class Vocab(Protocol):
    """What chat needs of the engine (a fake in unit tests)."""

    bos: int
    eos: int

    def metadata(self, key: str) -> str | None: ...

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = False
    ) -> list[int]: ...

    def is_eog(self, token: int) -> bool: ...


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return time.strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@dataclass
class ChatTemplate:
    text: str
    source: str = "fallback"  # "flag" | "model" | "fallback"
    name: str = FALLBACK_NAME
    bos_token: str = ""
    eos_token: str = ""
    # Filled by ``bind`` from the engine's vocabulary:
    stop_tokens: list[int] = field(default_factory=list)
    closer_tokens: list[int] = field(default_factory=list)
    bos: int | None = None

    def __post_init__(self) -> None:
        env = _environment()
        try:
            self._template = env.from_string(self.text)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template {self.name}: {exc}") from exc
        self.tool_aware = uses_tools(env, self.text)  # else tools become a preamble
        self.closer = self._find_closer()

    # -- loading ---------------------------------------------------------------

    @classmethod
    def load(cls, path: str, engine: Vocab) -> ChatTemplate:
        """``--chat-template`` file, else the model's template, else the fallback."""
        if path:
            try:
                text, source, name = Path(path).read_text("utf-8"), "flag", path
            except OSError as exc:
                raise ChatTemplateError(f"--chat-template {path}: {exc}") from exc
        elif own := engine.metadata("tokenizer.chat_template"):
            text, source, name = own, "model", "tokenizer.chat_template"
        else:
            text, source, name = FALLBACK_TEMPLATE, "fallback", FALLBACK_NAME
        tpl = cls(
            text,
            source,
            name,
            bos_token=_spelling(engine, engine.bos, _BOS_SPELLINGS),
            eos_token=_spelling(engine, engine.eos, _EOS_SPELLINGS),
        )
        tpl.bind(engine)
        return tpl

    def bind(self, engine: Vocab) -> None:
        """Token ids of the end of turn and of the closer, in this vocabulary."""
        self.bos = engine.bos
        self.closer_tokens = engine.tokenize(self.closer, False, True) if self.closer else []
        stops: list[int] = []
        if self.end_of_turn:
            ids = engine.tokenize(self.end_of_turn, False, True)
            if len(ids) == 1:
                stops.append(ids[0])
        if self.source == "model":
            # The model's own template: its closer's end-of-generation tokens too.
            stops += [t for t in self.closer_tokens if engine.is_eog(t)]
        self.stop_tokens = sorted(set(stops))

    def _find_closer(self) -> str:
        """What the template writes after an assistant message's text."""
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
        try:
            text = self.render(probe, add_generation_prompt=False)
        except BadRequest:
            return ""
        at = text.rfind(_PROBE)
        return text[at + len(_PROBE) :] if at >= 0 else ""

    @property
    def end_of_turn(self) -> str:
        """The end-of-turn marker (the closer without its whitespace)."""
        return self.closer.strip()

    def info(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "name": self.name,
            "end_of_turn": self.end_of_turn or None,
            "tools": "template" if self.tool_aware else "preamble",
        }

    # -- rendering -------------------------------------------------------------

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text; ``tools`` (and tool turns in ``messages``) go to
        the template when it renders them, else become text (``tools.py``)."""
        context: dict[str, Any] = {}
        if self.tool_aware:
            if tools:
                context["tools"] = tools
            messages = for_template(messages)
        elif tools or has_tool_turns(messages):
            messages = as_text(messages, tools)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **context,
            )
        except jinja2.TemplateError as exc:
            raise BadRequest(f"chat template: {exc.message or exc}") from exc
        except Exception as exc:  # the template's own logic failed on these messages
            raise BadRequest(f"chat template failed: {type(exc).__name__}: {exc}") from exc

    def prompt_tokens(
        self,
        engine: Vocab,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Render and tokenize: special markers become their tokens, BOS is not doubled."""
        text = self.render(messages, tools=tools)
        return engine.tokenize(text, add_special=False, parse_special=True)


def _spelling(engine: Vocab, token: int, candidates: tuple[str, ...]) -> str:
    """The text of a special token, among common spellings; "" if none matches."""
    if token < 0:
        return ""
    for text in candidates:
        if engine.tokenize(text, False, True) == [token]:
            return text
    return ""


class ChatJob(GenerateJob):
    """A generation whose prompt is a rendered chat (``prompt`` holds its tokens).

    On a session that already holds tokens, the template's BOS (``bos``) is
    dropped and ``closer`` — what the template writes after a model turn,
    whose end-of-turn token never reached the KV cache — is fed first.
    """

    def __init__(self, *args: Any, closer: list[int], bos: int | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.closer = closer
        self.bos = bos

    def start(self, rt: RuntimeState) -> bool:
        (sid,) = self.sessions
        prior = rt.known(sid)
        if prior is not None and (prior.position > 0 or prior.pending):
            assert isinstance(self.prompt, list)
            tokens = self.prompt
            if tokens and tokens[0] == self.bos:
                tokens = tokens[1:]
            self.prompt = self.closer + tokens
        return super().start(rt)
