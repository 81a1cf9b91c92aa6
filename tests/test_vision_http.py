"""Images on ``/v1/chat/completions``, through a gateway, with the ``openai`` client.

Behind the gateway: the shared text-only worker and one started with the
test projector (``--mmproj``, random weights: it sees nothing, but runs the
real path). The gateway routes round robin, so a request with an image that
were not routed by what each worker's ``info`` says it can do would land on
the text-only worker every other time and be refused there. The answer must
equal, token for token, the same chat sent as the ZeroMQ ``chat`` op to the
seeing worker directly. A gateway whose only worker cannot see refuses an
image with a 400 that says so; ``http(s)`` URLs and oversized or
non-PNG/JPEG images are 400s before anything is sent.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
import pytest
from media_images import make_mmproj, png, rgb

from conftest import WAIT_S, start_worker, stop_worker, wait_until
from faults import Unsupported
from gateway.config import GatewayConfig
from gateway.openai.http import HttpFront
from gateway.openai.images import MAX_IMAGE_BYTES
from gateway.ops import carries_media, sees
from gateway.placement import Placer
from gateway.runner import Gateway
from protocol import Client

IMAGE_URL = "data:image/png;base64," + base64.b64encode(png(rgb(48, 48, 7))).decode()


def _ask(url: str) -> Any:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Describe this picture:"},
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": " in one word."},
            ],
        }
    ]


@pytest.fixture(scope="module")
def seeing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("sees")
    projector = make_mmproj.write_test_projector(tmp / "p.gguf")
    proc, endpoint, _ = start_worker(
        tmp,
        "--lanes",
        "2",
        "--ctx",
        "2048",
        "--ubatch",
        "32",
        "--mmproj",
        str(projector),
        name="sees",
    )
    yield endpoint
    stop_worker(proc)


@contextmanager
def _gateway(tmp: Path, workers: tuple[str, ...]) -> Iterator[tuple[Gateway, openai.OpenAI]]:
    """A gateway (its loop on a thread) with its HTTP front, once every worker is up."""
    cfg = GatewayConfig(bind=f"ipc://{tmp}/gw.sock", workers=workers, policy="round_robin")
    gateway = Gateway(cfg)
    thread = threading.Thread(target=gateway.serve_forever, daemon=True)
    thread.start()
    front = HttpFront(gateway.local_endpoint, routing_id=gateway.service.trust_peer())
    front.start("127.0.0.1", 0)
    try:
        with Client(gateway.endpoint) as c:

            def all_up() -> bool:
                status = c.call("gateway_status").result["workers"]
                return all(w["up"] and w["sees"] is not None for w in status)

            wait_until(all_up, what="workers up with their info")
        url = f"http://127.0.0.1:{front.port}/v1"
        yield gateway, openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    finally:
        front.stop()
        gateway.stop()
        thread.join(WAIT_S)
        gateway.close()


def test_an_image_goes_to_the_seeing_worker_and_equals_the_direct_op(
    worker: tuple[str, Path], seeing: str, tmp_path: Path
) -> None:
    with Client(seeing) as c:
        direct = c.call(
            "chat",
            None,
            {
                "messages": _ask(IMAGE_URL),
                "max_tokens": 6,
                "sampling": {"temperature": 0},
                "stream": False,
            },
        ).result
        text = c.detokenize(direct["tokens"])
    with _gateway(tmp_path, (worker[0], seeing)) as (gateway, oai):
        with Client(gateway.endpoint) as c:
            sees = {w["endpoint"]: w["sees"] for w in c.call("gateway_status").result["workers"]}
        assert sees == {worker[0]: False, seeing: True}
        for _ in range(2):  # round robin: the second would reach the text-only worker
            reply = oai.chat.completions.create(
                model="skiff", messages=_ask(IMAGE_URL), max_tokens=6, temperature=0
            )
            assert reply.choices[0].message.content == text == direct["text"]
            assert reply.usage is not None
            assert reply.usage.completion_tokens == len(direct["tokens"])
            assert reply.usage.prompt_tokens == direct["usage"]["prompt_tokens"]
        chunks = oai.chat.completions.create(
            model="skiff", messages=_ask(IMAGE_URL), max_tokens=6, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_no_seeing_worker_and_bad_images_are_400s(worker: tuple[str, Path], tmp_path: Path) -> None:
    with _gateway(tmp_path, (worker[0],)) as (_, oai):
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model="skiff", messages=_ask(IMAGE_URL), max_tokens=2)
        body: Any = err.value.body
        assert body["code"] == "unsupported" and "--mmproj" in body["message"]
        big = "data:image/png;base64," + base64.b64encode(b"\0" * (MAX_IMAGE_BYTES + 1)).decode()
        for url, says in (
            ("https://example.com/cat.png", "data:"),
            ("http://example.com/cat.png", "no network"),
            ("data:image/gif;base64,R0lGOD", "PNG or JPEG"),
            ("data:image/png;base64,%%%", "base64"),
            (big, "larger than"),
        ):
            with pytest.raises(openai.BadRequestError) as err:
                oai.chat.completions.create(model="skiff", messages=_ask(url), max_tokens=2)
            body = err.value.body
            assert body["type"] == "invalid_request_error" and body["param"] == "messages"
            assert says in body["message"], (url[:40], body)
        text = oai.chat.completions.create(
            model="skiff", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert text.choices[0].message.content is not None  # text still served


def test_which_requests_need_eyes_and_which_workers_have_them() -> None:
    def req(op: str, args: dict[str, Any]) -> Any:
        return SimpleNamespace(op=op, args=args)

    assert carries_media(req("chat", {"messages": _ask(IMAGE_URL)}))
    assert carries_media(req("generate", {"prompt": "<__media__>", "media": [{"buffer": 0}]}))
    assert carries_media(req("prefill_media", {}))
    assert not carries_media(req("chat", {"messages": [{"role": "user", "content": "hi"}]}))
    eyes, blind, unknown = ({"media": {"image": True}}, {"media": None}, None)
    assert (sees(eyes), sees(blind), sees(unknown)) == (True, False, None)
    w = [SimpleNamespace(info=i) for i in (blind, eyes, unknown)]
    assert Placer.seeing(w) == [w[1]]  # type: ignore[arg-type]
    assert Placer.seeing([w[0], w[2]]) == []  # type: ignore[arg-type]  # one not known yet: 503 later
    with pytest.raises(Unsupported, match="--mmproj"):
        Placer.seeing([w[0]])  # type: ignore[arg-type]
