"""Media prefill over the socket: a worker started with ``--mmproj``.

The projector is the generated test one (``scripts/make_mmproj.py``: random
weights, Gemma 3 layout, 16 tokens per image) beside the packaged Gemma 3
270M. It sees nothing, but it runs the real path: decoding, marker
splitting, encoding, non-causal decoding of the image rows into the
session's lane, positions, sampling. What is checked: token counts and
positions, that the KV lands in the session's own lane (the reference stage
server once wrote media into sequence 0: here a text session holds lane 0
while the image goes in), that bad media leave the session untouched,
that equal inputs give equal logits, that media positions stay opaque
(no token id) for export, speculation and trim, and that a chain equals
one worker. Where a projector may not be: test_media_projector.py.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _media_calls import IMAGE, WRAP, lanes, logits_after, media_error, probe, text_tokens
from media_images import TOKENS_PER_IMAGE, make_mmproj, png, rgb

from conftest import WAIT_S, start_chain, start_worker, stop_worker, tidy_client, wait_until
from protocol import Client
from worker.core.chat import FALLBACK_TEMPLATE, ChatTemplate
from worker.runtime.steps import NgramIndex

MAX_PIXELS = 4096  # --max-image-pixels of the media worker (64 x 64)


@pytest.fixture(scope="module")
def projector_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out: Path = make_mmproj.write_test_projector(tmp_path_factory.mktemp("mmproj") / "p.gguf")
    return out


@pytest.fixture(scope="module")
def media_worker(
    tmp_path_factory: pytest.TempPathFactory, projector_path: Path
) -> Iterator[tuple[str, Path]]:
    tmp = tmp_path_factory.mktemp("media")
    proc, endpoint, log = start_worker(
        tmp,
        "--lanes",
        "3",
        "--ctx",
        "3072",
        "--ubatch",
        "32",
        "--mmproj",
        str(projector_path),
        "--max-image-pixels",
        str(MAX_PIXELS),
        name="media",
    )
    yield endpoint, log
    stop_worker(proc)


@pytest.fixture()
def mc(media_worker: tuple[str, Path]) -> Iterator[Client]:
    """A client of the media worker whose test leaves no session behind."""
    with tidy_client(media_worker[0]) as c:
        yield c


@pytest.fixture(scope="module")
def marker(media_worker: tuple[str, Path]) -> str:
    with Client(media_worker[0]) as c:
        value: str = c.info()["media"]["marker"]
        return value


# -- the worker surface ----------------------------------------------------------------


def test_info_reports_the_projector(mc: Client, projector_path: Path) -> None:
    info = mc.info()
    assert info["media"] == {
        "marker": "<__media__>",
        "projector": str(projector_path),
        "image": True,
        "audio": False,
    }
    assert "prefill_media" in info["ops"]


# -- prefill_media ---------------------------------------------------------------------


def test_image_lands_in_its_own_lane_beside_a_concurrent_session(mc: Client, marker: str) -> None:
    other = mc.tokenize("A text session that must not notice the image.")
    prompt = f"Describe {marker} briefly."
    # Sent together, so they share turns; "other" is first and takes lane 0,
    # where the reference stage server once wrote media by mistake.
    pre = mc.send("prefill", "other", {"tokens": other})
    med = mc.send("prefill_media", "img", {"prompt": prompt, "media": [{"buffer": 0}]}, [IMAGE])
    assert mc.recv(pre).raise_for_error().result["position"] == len(other)
    res = mc.recv(med).raise_for_error().result
    text = text_tokens(mc, prompt, marker)
    assert res["media_tokens"] == TOKENS_PER_IMAGE
    assert res["token_count"] == len(text) + TOKENS_PER_IMAGE == res["position"]
    assert lanes(mc) == {"other": (0, len(other)), "img": (1, res["position"])}

    # The text session's next token sees only its own cells.
    t = probe(mc)
    mc.prefill("ref", other)
    assert np.array_equal(logits_after(mc, "other", t), logits_after(mc, "ref", t))
    mc.drop("ref")

    # trim back to the text before the image: the lane holds exactly that text
    head = mc.tokenize(f"Describe {WRAP[:16]}", True, True)  # <bos>Describe <start_of_image>
    assert text[: len(head)] == head
    assert mc.trim("img", len(head)) == len(head)
    mc.prefill("ref2", head)
    assert np.array_equal(logits_after(mc, "img", t), logits_after(mc, "ref2", t))
    mc.drop("img")
    assert set(lanes(mc)) == {"other", "ref2"}
    assert lanes(mc)["other"] == (0, len(other) + 1)


def test_two_images_in_one_prompt(mc: Client, marker: str) -> None:
    prompt = f"First {marker} then {marker}, which is brighter?"
    raw = rgb(33, 17, 5)
    args = {
        "prompt": prompt,
        "media": [{"buffer": 0, "mime": "image/png"}, {"buffer": 1, "width": 33, "height": 17}],
    }
    res = mc.call("prefill_media", "two", args, [png(rgb(20, 20, 4)), raw.tobytes()]).result
    assert res["media_tokens"] == 2 * TOKENS_PER_IMAGE
    assert res["token_count"] == len(text_tokens(mc, prompt, marker)) + 2 * TOKENS_PER_IMAGE
    assert res["position"] == res["token_count"]
    assert mc.decode("two", res["token"])["position"] == res["position"] + 1


def test_same_image_twice_gives_identical_logits_and_hidden_frames(mc: Client, marker: str) -> None:
    prompt = f"What do you see in {marker}?"
    a = mc.prefill_media("a", prompt, [IMAGE], output=["hidden"])
    b = mc.prefill_media("b", prompt, [IMAGE], output=["hidden"])
    assert a.result == {**b.result, "frame": a.result["frame"]}
    n = a.result["token_count"]
    ha, hb = a.frame.array("hidden"), b.frame.array("hidden")
    assert ha.shape == (n, mc.info()["model"]["n_embd"]) and ha.dtype == np.float32
    assert a.frame.positions == tuple(range(n))
    assert np.array_equal(ha, hb)
    # the next-token distribution (signal reads it) and the logits after one more token
    assert mc.call("signal", "a").result == mc.call("signal", "b").result
    t = probe(mc)
    assert np.array_equal(logits_after(mc, "a", t), logits_after(mc, "b", t))
    # another image changes what the model sees from the image on
    c = mc.prefill_media("c", prompt, [png(rgb(48, 48, 3))], output=["hidden"])
    first = len(mc.tokenize(f"What do you see in {WRAP[:16]}", True, True))
    hc = c.frame.array("hidden")
    assert np.array_equal(hc[:first], ha[:first])
    assert not np.array_equal(hc[first:], ha[first:])


def test_bad_media_leave_the_session_untouched(mc: Client, marker: str) -> None:
    mc.prefill("keep", mc.tokenize("Kept exactly as it is."))
    before = lanes(mc)
    good = png(rgb(16, 16, 6))
    corrupt = good[:41] + bytes(len(good) - 41)
    huge_header = good[:16] + struct.pack(">II", 100_000, 100_000) + good[24:]
    one = [{"buffer": 0}]
    cases: list[tuple[dict[str, Any], list[bytes], str]] = [
        ({"prompt": "no marker", "media": one}, [good], "0 media markers"),
        ({"prompt": f"{marker} and {marker}", "media": one}, [good], "2 media markers"),
        ({"prompt": marker, "media": one * 2}, [good], "1 media markers"),
        ({"prompt": marker, "media": one}, [corrupt], "cannot decode"),
        ({"prompt": marker, "media": one}, [png(rgb(100, 100, 7))], "--max-image-pixels"),
        ({"prompt": marker, "media": one}, [huge_header], "--max-image-pixels"),
        ({"prompt": marker, "media": one}, [b"GIF89a" + bytes(40)], "not a PNG or JPEG"),
        ({"prompt": marker, "media": [{"buffer": 0, "width": 8, "height": 8}]}, [good], "raw"),
        ({"prompt": marker, "media": [{"buffer": 0, "mime": "image/jpeg"}]}, [good], "jpeg"),
        ({"prompt": marker, "media": [{"buffer": 1}]}, [good], "buffer"),
        ({"prompt": marker, "media": []}, [], "media must be"),
        ({"prompt": marker, "media": one, "output": ["logits"]}, [good], "hidden"),
    ]
    for session in ("keep", "fresh"):
        for args, bufs, needle in cases:
            err = media_error(mc, "prefill_media", session, args, bufs)
            assert err.code == "bad_request" and needle in err.message, (args, err)
    gen = {"prompt": "no marker", "media": one, "max_tokens": 2}
    assert media_error(mc, "generate", "keep", gen, [good]).code == "bad_request"
    assert lanes(mc) == before
    assert mc.decode("keep", probe(mc))["position"] == before["keep"][1] + 1


# -- generate and chat -----------------------------------------------------------------


def test_generate_streams_with_an_image(mc: Client, marker: str) -> None:
    prompt = f"Look at {marker} and say"
    ref = mc.prefill_media("ref", prompt, [IMAGE])
    args = {"prompt": prompt, "media": [{"buffer": 0}], "max_tokens": 4, "ignore_eos": True}
    replies = [r.header for r in mc.stream("generate", None, args, buffers=[IMAGE])]
    events, done = replies[:-1], replies[-1]
    assert [e["event"] for e in events] == ["token"] * 4 and done["done"]
    assert events[0]["token"] == ref["token"]  # the same prompt phase, the same first token
    assert [e["position"] for e in events] == list(range(ref["position"], ref["position"] + 4))
    assert done["usage"]["prompt_tokens"] == ref["token_count"]
    # a named session continues with text after its media turn
    mc.call("generate", "conv", {**args, "stream": False}, [IMAGE])
    more = mc.call("generate", "conv", {"prompt": " and then", "max_tokens": 2, "stream": False})
    assert more.result["usage"]["prompt_tokens"] == 1 + len(mc.tokenize(" and then", False))


def test_chat_with_an_image_url_part(mc: Client, marker: str) -> None:
    url = "data:image/png;base64," + base64.b64encode(IMAGE).decode()
    content = [
        {"type": "text", "text": "What is in "},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "?"},
    ]
    args = {"messages": [{"role": "user", "content": content}], "max_tokens": 3}
    replies = [r.header for r in mc.stream("chat", None, {**args, "ignore_eos": True})]
    tokens = [r["token"] for r in replies if r.get("event") == "token"]
    # The marker sits where the image part was in the rendered conversation.
    rendered = ChatTemplate(FALLBACK_TEMPLATE, bos_token="<bos>").render(
        [{"role": "user", "content": f"What is in {marker}?"}]
    )
    ref = mc.prefill_media("ref", rendered, [IMAGE], add_special=False, parse_special=True)
    assert tokens[0] == ref["token"]
    assert replies[-1]["usage"]["prompt_tokens"] == ref["token_count"]
    assert ref["media_tokens"] == TOKENS_PER_IMAGE
    # the same with the marker written in the text and the image as a buffer
    marked = {"messages": [{"role": "user", "content": f"What is in {marker}?"}]}
    by_buffer = {**args, **marked, "media": [{"buffer": 0}], "stream": False}
    assert mc.call("chat", None, by_buffer, [IMAGE]).result["tokens"][0] == tokens[0]
    bad = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
                ],
            }
        ]
    }
    err = media_error(mc, "chat", None, bad, [])
    assert err.code == "bad_request" and "data:" in err.message


# -- media positions are opaque ---------------------------------------------------------


def test_media_positions_have_no_token_id(mc: Client, marker: str) -> None:
    res = mc.prefill_media("m", f"An image: {marker} and text after it.", [IMAGE])
    exported = mc.export_state("m")
    held = exported.result["session_state"]["tokens"]
    assert len(held) == res["position"] and held.count(-1) == TOKENS_PER_IMAGE
    assert mc.import_state("copy", exported) == res["position"]
    t = probe(mc)
    assert np.array_equal(logits_after(mc, "m", t), logits_after(mc, "copy", t))
    # prompt lookup drafts from the session's history: never a media position
    spec = {"mode": "prompt_lookup", "ngram": 1, "max_draft": 4}
    gen = {"prompt": " text", "max_tokens": 6, "speculative": spec, "stream": False}
    assert mc.call("generate", "m", gen).result["finish_reason"] in ("length", "stop")


def test_prompt_lookup_skips_positions_without_tokens() -> None:
    assert NgramIndex(1).draft([3, -1, -1, 4, 3], max_draft=3) == []
    assert NgramIndex(1).draft([3, 5, -1, 4, 3], max_draft=3) == [5]
    assert NgramIndex(1).draft([7, -1, 7, -1], max_draft=3) == []
    assert NgramIndex(2).draft([1, 2, 9, 1, 2], max_draft=2) == [9, 1]


def test_startup_log_names_the_projector(media_worker: tuple[str, Path]) -> None:
    log = media_worker[1].read_text()
    assert '"mmproj"' in log and "p.gguf" in log


def test_chat_turn_with_an_image_continues_a_session(mc: Client, marker: str) -> None:
    """A later turn on a chat session: the pending token and the template's
    closer go first, the rendered BOS is dropped, the image is in its place."""
    first = mc.chat([{"role": "user", "content": "Hello."}], session="c", max_tokens=2)
    assert first["finish_reason"] == "length"  # its last token is pending
    url = "data:image/png;base64," + base64.b64encode(IMAGE).decode()
    content = [{"type": "text", "text": "And this? "}, {"type": "image_url", "image_url": url}]
    turn = mc.chat([{"role": "user", "content": content}], session="c", max_tokens=2)
    rendered = ChatTemplate(FALLBACK_TEMPLATE, bos_token="<bos>").render(
        [{"role": "user", "content": f"And this? {marker}"}]
    )
    closer = mc.tokenize("<end_of_turn>\n", False, True)
    text = text_tokens(mc, rendered, marker, add_special=False)
    assert text[0] == mc.info()["model"]["bos"]
    fed = 1 + len(closer) + len(text) - 1 + TOKENS_PER_IMAGE
    assert turn["usage"]["prompt_tokens"] == fed
    # each turn fed its prompt and its first generated token (the second is pending)
    assert lanes(mc)["c"][1] == first["usage"]["prompt_tokens"] + 1 + fed + 1


def test_cancel_part_way_leaves_the_session_where_it_was(
    mc: Client, marker: str, media_worker: tuple[str, Path]
) -> None:
    head = mc.tokenize("Before the image.")
    mc.prefill("cut", head)
    long_text = " word" * 900  # ~7 prefill pieces after the image
    args = {"prompt": f"{marker}{long_text}", "media": [{"buffer": 0}]}
    rid = mc.send("prefill_media", "cut", args, [IMAGE])
    with Client(media_worker[0], timeout_ms=int(WAIT_S * 1000)) as watcher:
        wait_until(
            lambda: lanes(watcher).get("cut", (0, 0))[1] > len(head),
            what="the image landed",
            interval_s=0.005,  # the text after it is a few turns: cancel soon after
        )
        mc.call("cancel", None, {"id": rid})
    reply = mc.recv(rid)
    assert not reply.header["ok"], "the prefill finished before its cancel (text too short)"
    assert reply.header["error"]["code"] == "cancelled"
    assert lanes(mc)["cut"][1] == len(head)
    assert np.array_equal(logits_after(mc, "cut", probe(mc)), _fresh_logits(mc, head))


def _fresh_logits(c: Client, tokens: list[int]) -> np.ndarray:
    c.prefill("fresh", tokens)
    return logits_after(c, "fresh", probe(c))


def test_images_through_a_chain_equal_one_worker(
    mc: Client, marker: str, projector_path: Path, tmp_path: Path
) -> None:
    """Stage 0 with ``--mmproj`` embeds the image and runs its rows through
    its layers non-causally; the next stage does the same with them. The
    session's next-token logits, and a generation with an image, equal one
    worker's to the bit."""
    prompt = f"Describe {marker} in a word:"
    common = ("--lanes", "3", "--ctx", "3072", "--ubatch", "32")
    want = mc.prefill_media("ref-chain", prompt, [IMAGE])
    want_logits = logits_after(mc, "ref-chain", probe(mc))
    gen = {"prompt": prompt, "max_tokens": 6, "ignore_eos": True, "media": [{"buffer": 0}]}
    want_tokens = [r.header.get("token") for r in mc.stream("generate", None, gen, buffers=[IMAGE])]
    head_args = ("--mmproj", str(projector_path))
    with (
        start_chain(tmp_path, ["0:9", "9:18"], *common, head=head_args, name="m") as (e0, _),
        Client(e0, timeout_ms=120_000) as head,
    ):
        assert head.info()["media"]["marker"] == marker
        got = head.prefill_media("chain", prompt, [IMAGE])
        got_logits = logits_after(head, "chain", probe(head))
        got_tokens = [
            r.header.get("token") for r in head.stream("generate", None, gen, buffers=[IMAGE])
        ]
    assert (got["token"], got["token_count"]) == (want["token"], want["token_count"])
    assert float(np.max(np.abs(got_logits - want_logits))) == 0.0
    assert got_tokens == want_tokens and len(want_tokens) == 7  # 6 tokens, then done
