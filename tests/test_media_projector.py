"""Where a projector may be: a worker without one refuses media by name
(OpenAI-style text parts need none), and a projector wider than the
micro-batch, or on a stage after the first, stops the worker at startup.
"""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from _media_calls import IMAGE, lanes, media_error
from media_images import make_mmproj

from conftest import start_worker
from protocol import Client


@pytest.fixture(scope="module")
def projector_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out: Path = make_mmproj.write_test_projector(tmp_path_factory.mktemp("mmproj") / "p.gguf")
    return out


# -- no projector, or one where it cannot work ---------------------------------------------


def test_without_a_projector_media_is_unsupported(client: Client) -> None:
    assert client.info()["media"] is None
    url = "data:image/png;base64," + base64.b64encode(IMAGE).decode()
    parts = [{"type": "image_url", "image_url": {"url": url}}]
    for op, session, args in (
        ("prefill_media", "m", {"prompt": "<__media__>", "media": [{"buffer": 0}]}),
        ("generate", None, {"prompt": "<__media__>", "media": [{"buffer": 0}]}),
        ("chat", None, {"messages": [{"role": "user", "content": parts}]}),
    ):
        err = media_error(client, op, session, args, [IMAGE])
        assert err.code == "unsupported" and "--mmproj" in err.message, (op, err)
    assert "m" not in lanes(client)
    # OpenAI-style text parts need no projector: they are the message's text
    text_parts = [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi."}]
    a = client.chat([{"role": "user", "content": text_parts}], max_tokens=3)
    b = client.chat([{"role": "user", "content": "Say hi."}], max_tokens=3)
    assert a["tokens"] == b["tokens"]


def test_worker_refuses_a_projector_wider_than_its_micro_batch(
    tmp_path: Path, projector_path: Path
) -> None:
    """llama.cpp aborts the process on a non-causal decode wider than
    n_ubatch: a worker whose micro-batch cannot hold one image must not start."""
    with pytest.raises(RuntimeError, match="micro-batch"):
        start_worker(
            tmp_path,
            "--lanes",
            "1",
            "--ctx",
            "512",
            "--ubatch",
            "8",
            "--mmproj",
            str(projector_path),
        )


def test_a_later_stage_refuses_a_projector(projector_path: Path, tmp_path: Path) -> None:
    """Only stage 0 embeds images: a projector on a later stage is a
    configuration mistake, refused at startup by name."""
    with pytest.raises(RuntimeError, match="stage 0"):
        start_worker(tmp_path, "--layers", "9:18", "--mmproj", str(projector_path), name="bad")
