"""What a stream suspended on one worker needs to go on on another.

A gateway moving a worker's streams (``suspend``, then the session's
export and import) hands the stream's ``resume`` map back to a
``generate`` on the new worker; this is that map, typed. The new job counts
its tokens and usage from it, holds back the same text (a possible stop
string's start) and decodes the same partial UTF-8 character, so the
client's stream goes on as if it had never moved.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class Resume:
    completion_tokens: int = 0  # tokens the stream showed before it moved
    prompt_tokens: int = 0  # usage, as the first worker counted it
    cached_tokens: int = 0
    held: str = ""  # decoded text held back as a possible stop string's start
    utf8: bytes = b""  # bytes of a partial UTF-8 character not yet shown
    drafted: int = 0  # speculative decoding's counts so far
    accepted: int = 0
    ephemeral: bool = False  # a sessionless stream: its session ends with it
    # The stops in force (a chat's template adds its end of turn to the
    # request's): the stream goes on as a ``generate`` that keeps them.
    stop: tuple[str, ...] = ()
    stop_tokens: tuple[int, ...] = ()


def moved_name() -> str:
    """A name for a sessionless stream's session while it moves."""
    return f"~moved-{uuid.uuid4().hex}"
