"""Each stage holds only its share of the model (issue 23).

A stage slice carries real tensors only where its stage reads them; the
rest are stand-ins (right name and shape, no bytes on disk) that llama.cpp
insists on loading. The claim "never read" is checked two ways: a chain whose
middle stage's stand-ins are all NaN gives one worker's logits to the bit,
and no stage has a stand-in's pages mapped in (``/proc/PID/pagemap``) after
prefilling and decoding, while the first stage holds only the embedding rows
it looked up.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import greedy_run, start_chain
from protocol import Client
from worker.engine import pages
from worker.slice.ggufmeta import GGUFArray, TensorInfo, read_metadata, read_tensor_infos
from worker.slice.slicer import cached_slice, file_sha256, stage_slice_path

PROMPT = "The lighthouse keeper climbed the stairs every evening, and the sea below"
STAGES = [(0, 6), (6, 12), (12, 18)]
Q8_0, Q1_0 = 8, 41  # GGML type numbers
# A page read maps its neighbours already in the page cache with it (the
# kernel's fault-around, and large folios on ext4 / xfs), so a stand-in may
# show mapped pages next to the last real tensor without ever being read:
# its first 2 MiB are not counted.
NEIGHBOURS = 2 << 20


def _extents(path: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's [start, end) in the file: up to the next tensor (or EOF)."""
    infos: list[TensorInfo] = sorted(read_tensor_infos(path), key=lambda t: t.offset)
    ends = [t.offset for t in infos[1:]] + [path.stat().st_size]
    return {t.name: (t.offset, end) for t, end in zip(infos, ends, strict=True)}


def _stand_ins(path: Path) -> tuple[list[str], int, int] | None:
    """The stand-ins' names and their [start, EOF) in a slice (they come
    last in the file), or None when it has none."""
    names = read_metadata(path, ["skiff.stage.stand_ins"]).get("skiff.stage.stand_ins")
    if names is None:
        return None
    assert isinstance(names, GGUFArray)
    extents = sorted(_extents(path).items(), key=lambda item: item[1][0])
    tail = extents[-names.count :]  # the last `count` tensors in the file
    return [name for name, _ in tail], tail[0][1][0], path.stat().st_size


@pytest.fixture(scope="module")
def slices(model_path: str) -> dict[tuple[int, int], Path]:
    """The 3-way split's stage slices (cached beside the model, as stages cache them)."""
    return {(lo, hi): cached_slice(Path(model_path), lo, hi) for lo, hi in STAGES}


def test_stage_slices_hold_only_what_their_stage_reads(
    model_path: str, slices: dict[tuple[int, int], Path]
) -> None:
    first, middle, last = (slices[r] for r in STAGES)
    infos = {p: {t.name: t for t in read_tensor_infos(p)} for p in (first, middle, last)}
    # the packaged model ties its head to token_embd: no output.weight anywhere
    assert not any("output.weight" in i for i in infos.values())
    # the first looks rows up, the last uses the matrix as its head: real, Q8_0
    assert infos[first]["token_embd.weight"].ggml_type == Q8_0
    assert infos[last]["token_embd.weight"].ggml_type == Q8_0
    # the middle reads neither: a Q1_0 stand-in of the same shape
    embd = infos[middle]["token_embd.weight"]
    assert embd.ggml_type == Q1_0 and embd.dims == infos[first]["token_embd.weight"].dims
    # stages with a next stage carry one spare block (never computed) as stand-ins
    for path, lo, hi in ((first, 0, 6), (middle, 6, 12)):
        assert read_metadata(path, ["gemma3.block_count"])["gemma3.block_count"] == hi - lo + 1
        spare = {n for n in infos[path] if n.startswith(f"blk.{hi - lo}.")}
        want = spare | ({"token_embd.weight"} if path == middle else set())
        region = _stand_ins(path)
        assert region is not None and set(region[0]) == want
    assert _stand_ins(last) is None
    assert read_metadata(last, ["gemma3.block_count"]) == {"gemma3.block_count": 6}
    # stand-ins take no bytes on disk: the file is extended over them (a hole)
    region = _stand_ins(middle)
    assert region is not None
    _, start, end = region
    assert middle.stat().st_blocks * 512 < start + (end - start) // 2
    assert end < Path(model_path).stat().st_size / 4  # the middle stage's file


def test_stand_ins_are_never_read(
    client: Client, model_path: str, slices: dict[tuple[int, int], Path], tmp_path: Path
) -> None:
    """The stages load from a folder beside a link to the model: the middle
    stage's slice is a copy with every stand-in byte 0xFF (NaN in every GGML
    type: f16 / e8m0 scales and f32 weights alike), the others are links to
    the cached slices."""
    source = Path(model_path)
    link = tmp_path / source.name
    link.symlink_to(source)
    sha = file_sha256(source)
    middle = stage_slice_path(link, sha, 6, 12, tmp_path)
    shutil.copyfile(slices[(6, 12)], middle)
    region = _stand_ins(middle)
    assert region is not None
    _, start, end = region
    with middle.open("r+b") as fh:
        fh.seek(start)
        fh.write(b"\xff" * (end - start))
    for lo, hi in (STAGES[0], STAGES[2]):
        stage_slice_path(link, sha, lo, hi, tmp_path).symlink_to(slices[(lo, hi)])
    args = ("--lanes", "2", "--ctx", "4096", "--model", str(link))
    ranges = [f"{lo}:{hi}" for lo, hi in STAGES]
    with start_chain(tmp_path, ranges, *args, name="n") as (e0, e1, e2):
        tokens = client.tokenize(PROMPT)
        want = greedy_run(client, "nan_full", tokens, 8)
        with Client(e0, timeout_ms=120_000) as head:
            got = greedy_run(head, "nan_chain", tokens, 8)
        assert got[0] == want[0]
        assert float(np.max(np.abs(got[1] - want[1]))) == 0.0
        for endpoint, (lo, hi) in zip((e0, e1, e2), STAGES, strict=True):
            with Client(endpoint) as c:
                pid = c.stats()["process"]["pid"]
                assert c.info()["stage"]["slice"] == f"{link.stem}.{sha[:16]}.stage-{lo}-{hi}.gguf"
            real = stage_slice_path(link, sha, lo, hi, tmp_path).resolve()
            assert pages.file_mappings(real, pid), f"{real} is not loaded"
            found = _stand_ins(real)
            if found is not None:
                _, start, end = found
                mapped = pages.mapped_bytes(real, start + NEIGHBOURS, end, pid)
                assert mapped == 0, f"stage {lo}:{hi}: {mapped} bytes of stand-ins mapped"
            if lo == 0:  # the first stage: the rows of the prompt's tokens only
                start, end = _extents(real)["token_embd.weight"]
                rows = pages.mapped_bytes(real, start, end, pid)
                assert 0 < rows < (end - start) // 10, rows
