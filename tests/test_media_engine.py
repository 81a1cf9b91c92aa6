"""Media prefill at the engine level: a projector beside the real model.

No small projector ships, so the module writes one (``scripts/make_mmproj.py``:
random weights, Gemma 3 layout, 16 tokens per image) and loads it beside the
packaged Gemma 3 270M. What is checked is the plumbing a real projector goes
through too: decoding, marker splitting, token counts, and above all that the
KV lands in the session's own lane (the reference server once wrote media
into sequence 0), that every bad request is refused before the KV is
touched, and that the same image gives the same logits in any lane.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from media_images import TOKENS_PER_IMAGE, make_mmproj
from media_images import png as _png
from media_images import rgb as _rgb

from worker.engine import Engine, EngineConfig, EngineError, Segment
from worker.engine.media import Projector
from worker.engine.media_native import Chunks, ProjectorError
from worker.engine.media_sniff import MediaError, MediaOverflow

LANES = 3


@pytest.fixture(scope="module")
def projector_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out: Path = make_mmproj.write_test_projector(tmp_path_factory.mktemp("mmproj") / "p.gguf")
    return out


@pytest.fixture(scope="module")
def engine(model_path: str) -> Iterator[Engine]:
    # Unified KV (lanes may exceed an equal share): every lane's cells share
    # one cache, which is where a write into the wrong sequence would hide.
    eng = Engine(
        EngineConfig(model_path, n_ctx=768, n_seq=LANES, n_ctx_per_seq=512, n_batch=64, n_ubatch=64)
    )
    assert eng.kv_unified
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def projector(engine: Engine, projector_path: Path) -> Iterator[Projector]:
    with Projector.load(projector_path, engine) as proj:
        yield proj


@pytest.fixture()
def clean(engine: Engine) -> Engine:
    for lane in range(engine.n_seq):
        engine.seq_clear(lane)
    return engine


def _positions(engine: Engine) -> list[tuple[int, int]]:
    return [(engine.pos_min(s), engine.pos_max(s)) for s in range(engine.n_seq)]


def test_generator_is_small_and_deterministic(tmp_path: Path) -> None:
    a = make_mmproj.write_test_projector(tmp_path / "a.gguf")
    b = make_mmproj.write_test_projector(tmp_path / "b.gguf")
    assert a.read_bytes() == b.read_bytes()
    assert a.stat().st_size < 10 << 20


def test_projector_loads_and_reports(projector: Projector, projector_path: Path) -> None:
    assert projector.info() == {
        "marker": "<__media__>",
        "projector": str(projector_path),
        "image": True,
        "audio": False,
    }
    assert projector.non_causal  # Gemma 3 attends both ways inside an image
    assert projector.image_tokens(640, 480) == TOKENS_PER_IMAGE


def test_wrong_width_projector_is_refused(engine: Engine, tmp_path: Path) -> None:
    bad = make_mmproj.write_test_projector(tmp_path / "w.gguf", n_embd=320)
    with pytest.raises(ProjectorError, match="cannot load projector"):
        Projector.load(bad, engine)


def test_png_jpeg_and_raw_rgb_each_give_the_image_tokens(projector: Projector) -> None:
    rgb = _rgb(40, 30, 1)
    png = projector.decode_image(memoryview(_png(rgb)), "image/png")
    raw = projector.decode_image(rgb.tobytes(), width=40, height=30)
    bitmaps = [png, raw]
    pil = pytest.importorskip("PIL.Image")
    import io

    buf = io.BytesIO()
    pil.fromarray(rgb).save(buf, format="JPEG")
    bitmaps.append(projector.decode_image(buf.getvalue(), "image/jpeg"))
    for bmp in bitmaps:
        assert (bmp.nx, bmp.ny) == (40, 30)
        with projector.tokenize(f"look {projector.marker} here", [bmp]) as ch:
            assert [p.kind for p in ch.parts] == ["text", "image", "text"]
            assert ch.media_tokens == TOKENS_PER_IMAGE
            assert ch.n_pos == ch.n_tokens == ch.text_tokens + TOKENS_PER_IMAGE
        bmp.close()


def test_media_lands_in_its_own_lane_and_is_lane_independent(
    clean: Engine, projector: Projector
) -> None:
    eng = clean
    other = eng.tokenize("Another session, unrelated to images")
    assert eng.decode([Segment(0, other, 0)]).ok
    before = _positions(eng)
    with (
        projector.decode_image(_png(_rgb(48, 48, 2))) as bmp,
        projector.tokenize(f"Describe {projector.marker} briefly.", [bmp], add_special=True) as ch,
    ):
        res = projector.eval(ch, 1, 0)
        assert res.n_past == ch.n_pos
        assert res.media_tokens == TOKENS_PER_IMAGE
        assert res.token_count == res.text_tokens + TOKENS_PER_IMAGE
        assert eng.pos_min(1) == 0 and eng.pos_max(1) == res.n_past - 1
        assert _positions(eng)[0] == before[0] == (0, len(other) - 1)  # not sequence 0
        assert eng.pos_max(2) == -1
        first = eng.logits_row(-1).copy()
        assert np.isfinite(first).all()

        res2 = projector.eval(ch, 2, 0)
        assert res2 == res
        assert np.array_equal(eng.logits_row(-1), first)  # same image, same logits
    assert _positions(eng)[0] == before[0]

    eng.seq_clear(2)  # a different image must change what the model predicts
    with (
        projector.decode_image(_png(_rgb(48, 48, 3))) as bmp,
        projector.tokenize(f"Describe {projector.marker} briefly.", [bmp], add_special=True) as ch,
    ):
        projector.eval(ch, 2, 0)
    assert not np.array_equal(eng.logits_row(-1), first)


def test_two_images_after_existing_text(clean: Engine, projector: Projector) -> None:
    eng = clean
    prefix = eng.tokenize("A conversation so far.")
    assert eng.decode([Segment(2, prefix, 0, outputs="none")]).ok
    m = projector.marker
    a = projector.decode_image(_png(_rgb(20, 20, 4)))
    b = projector.decode_image(_rgb(33, 17, 5).tobytes(), width=33, height=17)
    with a, b, projector.tokenize(f" first {m} then {m} compare", [a, b]) as ch:
        assert [p.kind for p in ch.parts] == ["text", "image", "text", "image", "text"]
        res = projector.eval(ch, 2, len(prefix))
    assert res.media_tokens == 2 * TOKENS_PER_IMAGE
    assert res.n_past == len(prefix) + res.token_count
    assert eng.pos_max(2) == res.n_past - 1
    assert eng.pos_max(0) == eng.pos_max(1) == -1


def test_bad_requests_leave_every_lane_untouched(clean: Engine, projector: Projector) -> None:
    eng = clean
    assert eng.decode([Segment(1, eng.tokenize("kept as it is"), 0, outputs="none")]).ok
    before = _positions(eng)
    rgb = _rgb(16, 16, 6)
    png = _png(rgb)
    m = projector.marker
    cases: dict[str, Callable[[], object]] = {
        "not an image": lambda: projector.decode_image(b"GIF89a" + bytes(64)),
        "truncated": lambda: projector.decode_image(png[:20]),
        "corrupt data": lambda: projector.decode_image(png[:41] + bytes(len(png) - 41)),
        "mime mismatch": lambda: projector.decode_image(png, "image/jpeg"),
        "too many pixels": lambda: projector.decode_image(png, max_pixels=255),
        "raw too many pixels": lambda: projector.decode_image(
            rgb.tobytes(), width=16, height=16, max_pixels=100
        ),
        "raw wrong length": lambda: projector.decode_image(rgb.tobytes()[:-1], width=16, height=16),
        "raw missing height": lambda: projector.decode_image(rgb.tobytes(), width=16),
        "huge header": lambda: projector.decode_image(
            png[:16] + struct.pack(">II", 100_000, 100_000) + png[24:], max_pixels=1 << 24
        ),
        "audio": lambda: projector.decode_audio(b"RIFF\0\0\0\0WAVE"),
    }
    for name, call in cases.items():
        with pytest.raises(MediaError):
            call()
        assert _positions(eng) == before, name

    with projector.decode_image(png, max_pixels=256) as bmp:
        for prompt, items in ((f"{m} and {m}", [bmp]), ("no marker", [bmp]), (m, [bmp, bmp])):
            with pytest.raises(MediaError, match="markers"):
                projector.tokenize(prompt, items)
    assert _positions(eng) == before


def test_eval_guards_run_before_the_kv(clean: Engine, projector: Projector) -> None:
    eng = clean
    head = eng.tokenize("some text already in the session")
    assert eng.decode([Segment(1, head, 0, outputs="none")]).ok
    before = _positions(eng)
    room = eng.n_ctx_per_seq - len(head)
    with (
        projector.decode_image(_png(_rgb(8, 8, 7))) as bmp,
        projector.tokenize(f"{projector.marker}" + " more" * room, [bmp]) as ch,
    ):
        with pytest.raises(ProjectorError, match="holds positions"):
            projector.eval(ch, 1, 3)  # not the lane's next position
        with pytest.raises(ProjectorError, match="out of range"):
            projector.eval(ch, LANES, 0)
        with pytest.raises(MediaOverflow) as err:
            projector.eval(ch, 1, len(head))
        assert err.value.needed == ch.n_pos > room == err.value.available
    assert _positions(eng) == before


def test_failure_inside_llama_cpp_trims_the_lane_back(clean: Engine, projector: Projector) -> None:
    eng = clean
    polls, stop_after = 0, -1

    def count() -> bool:  # llama.cpp polls this during compute; True aborts
        nonlocal polls
        polls += 1
        return 0 <= stop_after < polls

    with (
        projector.decode_image(_png(_rgb(8, 8, 10))) as bmp,
        projector.tokenize(f"text first {projector.marker} then text", [bmp]) as ch,
    ):
        eng.set_abort(count)
        try:
            projector.eval(ch, 2, 0)
            # Abort half-way through the same work (after some of it landed).
            stop_after, polls = polls // 2, 0
            with pytest.raises(ProjectorError, match="could not evaluate"):
                projector.eval(ch, 1, 0)
        finally:
            eng.set_abort(None)
    assert polls > 1
    assert eng.pos_max(1) == -1 and eng.pos_max(0) == -1
    assert eng.pos_max(2) == ch.n_pos - 1


def test_image_wider_than_the_micro_batch_is_refused(model_path: str, projector_path: Path) -> None:
    """llama.cpp asserts (kills the process) when a non-causal decode is
    wider than n_ubatch; the projector must refuse first."""
    eng = Engine(EngineConfig(model_path, n_ctx=256, n_seq=1, n_batch=8, n_ubatch=8))
    try:
        with (
            Projector.load(projector_path, eng) as proj,
            proj.decode_image(_png(_rgb(8, 8, 8))) as bmp,
            proj.tokenize(proj.marker, [bmp]) as ch,
        ):
            with pytest.raises(MediaError, match="micro-batch"):
                proj.eval(ch, 0, 0)
            assert eng.pos_max(0) == -1
    finally:
        eng.close()


def test_image_embeddings_can_be_taken_out(projector: Projector, engine: Engine) -> None:
    with (
        projector.decode_image(_png(_rgb(24, 24, 9))) as bmp,
        projector.tokenize(projector.marker, [bmp]) as ch,
    ):
        with pytest.raises(ProjectorError, match="text"):
            projector.encode(ch, 0)
        emb = projector.encode(ch, 1)
    assert emb.shape == (TOKENS_PER_IMAGE, engine.n_embd)
    assert emb.dtype == np.float32 and np.isfinite(emb).all()


def test_engine_decode_of_encoded_media_equals_the_helper(
    clean: Engine, projector: Projector
) -> None:
    """The worker's path — ``encode``, then ``Engine.decode`` of the rows with
    causal attention off, text through the engine's own batch — gives the
    helper's logits bit for bit; with causal attention the image differs."""
    eng = clean

    def by_engine(lane: int, ch: Chunks, causal: bool) -> np.ndarray:
        pos = 0
        for i, part in enumerate(ch.parts):
            if part.kind == "text":
                assert part.tokens is not None
                assert eng.decode([Segment(lane, list(part.tokens), pos)]).ok
            else:
                assert projector.non_causal_chunk(ch, i)
                embd = projector.encode(ch, i)
                seg = Segment(lane, [-1] * len(embd), pos, "last", embd)
                assert eng.decode([seg], causal=causal).ok
            pos += part.n_tokens
        assert eng.pos_max(lane) == pos - 1
        return eng.logits_row(eng.output_index(0)).copy()

    with (
        projector.decode_image(_png(_rgb(32, 32, 11))) as bmp,
        projector.tokenize(f"Look {projector.marker} here", [bmp], add_special=True) as ch,
    ):
        projector.eval(ch, 0, 0)
        want = eng.logits_row(-1).copy()
        assert np.array_equal(by_engine(1, ch, causal=False), want)
        assert not np.array_equal(by_engine(2, ch, causal=True), want)
    before = _positions(eng)
    wide = np.zeros((eng.n_ubatch + 1, eng.n_embd), dtype=np.float32)
    with pytest.raises(EngineError, match="micro-batch"):  # llama.cpp would abort
        eng.decode([Segment(0, [-1] * len(wide), 0, "last", wide)], causal=False)
    assert _positions(eng) == before
