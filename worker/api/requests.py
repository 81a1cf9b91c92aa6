"""Typed requests: what a handler read out of a header, every field checked.

A handler reads a header into one of these in one pass over its op's table
(``generate.read_generation`` / ``read_chat``), and the job is built from it
by one function (``jobs.generation_job``): the reading knows the wire's
names and limits, the building knows the worker (its draft model, its chat
template, its projector), and the job below the line sees neither a header
nor a dict from the wire.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ..core.suspend import Resume
from ..spec import SamplerSpec


@dataclass(frozen=True)
class Speculation:
    """``speculative``: how a generation drafts tokens to verify."""

    mode: Literal["prompt_lookup", "draft_model", "off"]
    max_draft: int
    ngram: int = 3  # prompt_lookup
    path: str | None = None  # draft_model: must name the worker's own, when given


@dataclass(frozen=True)
class MediaItem:
    """One media item as read: its bytes (a buffer of the message, or an
    ``image_url`` part's data URL), not decoded yet (the job's builder
    decodes it, against the worker's projector and pixel budget)."""

    where: str  # how the request named it: media[0], messages[1].content[2]
    data: bytes | memoryview
    mime: str | None = None
    width: int | None = None  # raw RGB: its size
    height: int | None = None


@dataclass(frozen=True)
class Generation:
    """What ``generate`` and ``chat`` share: the session, how long, how to
    sample and stop, and what each token event carries."""

    session: str | None  # None: a fresh ephemeral session
    max_tokens: int
    spec: SamplerSpec | None  # None: greedy
    stop: tuple[str, ...]
    stop_tokens: frozenset[int]
    ignore_eos: bool
    stream: bool
    speculation: Speculation | None
    top_logprobs: int | None  # None: no logprobs
    outputs: tuple[str, ...]  # tensors of the row each token was sampled from
    prompt: str | list[int] | None = None  # generate's prompt or tokens; None for chat
    resume: Resume | None = None  # a stream suspended on another worker, going on here
    media: tuple[MediaItem, ...] = ()  # generate's media, or chat's (items or image parts)
    messages: list[dict[str, Any]] | None = None  # chat's, contents as strings; None: generate
    tools: list[dict[str, Any]] | None = None  # chat's tools; None: none offered
