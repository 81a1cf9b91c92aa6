"""What the media tests over the socket ask a worker (test_media_worker,
test_media_projector): the test image, its named sessions' lanes and
positions, a prompt's text tokens around the image's wrapper, the logits
after one more token, and the error of a refused media call.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from media_images import png, rgb

from protocol import Client, SkiffError

IMAGE = png(rgb(48, 48, 2))
# What mtmd wraps each Gemma 3 image in (so the text tokens of a prompt are
# those of the prompt with the marker replaced by these two special tokens).
WRAP = "<start_of_image><end_of_image>"


def lanes(c: Client) -> dict[str, tuple[int, int]]:
    """Named sessions -> (lane, position)."""
    return {
        s["session"]: (s["lane"], s["position"])
        for s in c.stats()["sessions"]
        if not s.get("ephemeral")
    }


def text_tokens(c: Client, prompt: str, marker: str, add_special: bool = True) -> list[int]:
    ids: list[int] = c.tokenize(prompt.replace(marker, WRAP), add_special, True)
    return ids


def logits_after(c: Client, session: str, token: int) -> np.ndarray:
    """Decode ``token`` into ``session``: the next-token logits (a copy)."""
    reply = c.decode(session, token, output=["logits"])
    return np.array(reply.frame.array("logits")[0])


def probe(c: Client) -> int:
    token: int = c.tokenize(" yes", add_special=False)[0]
    return token


def media_error(
    c: Client, op: str, session: str | None, args: dict[str, Any], bufs: list[Any]
) -> Any:
    with pytest.raises(SkiffError) as err:
        c.call(op, session, args, bufs)
    return err.value
