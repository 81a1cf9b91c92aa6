"""worker.slice.ggufmeta: GGUF metadata without gguf.GGUFReader's full parse.

The reference is gguf.GGUFReader itself: every key the fast reader returns
must equal what GGUFReader gives (arrays: their item type and length), on
the packaged model, on a stage slice, and on small files built to put
string, numeric and nested arrays in front of the keys a stage needs; the
tensor entries after them (where a slice's stand-ins are) likewise.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from worker.slice.ggufmeta import (
    GGUFArray,
    GGUFMetaError,
    Value,
    iter_metadata,
    read_metadata,
    read_tensor_infos,
)
from worker.slice.slicer import SliceError, cached_slice, model_info


def _reference(path: Path) -> dict[str, Any]:
    """GGUFReader's view of the metadata: scalars and strings as values,
    arrays as (item type, item count)."""
    reader = gguf.GGUFReader(str(path))
    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):  # the reader's header pseudo-fields
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            # parts: key length, key, value type, item type, item count, items
            out[name] = ("array", int(field.parts[3][0]), int(field.parts[4][0]))
        else:
            out[name] = field.contents()
    return out


def _ours(path: Path) -> dict[str, Any]:
    def norm(value: Value) -> Any:
        if isinstance(value, GGUFArray):
            return ("array", value.item_type, value.count)
        return value

    items = list(iter_metadata(path))
    assert len({k for k, _ in items}) == len(items)
    return {key: norm(value) for key, value in items}


def _assert_same(path: Path) -> dict[str, Any]:
    want = _reference(path)
    got = _ours(path)
    assert list(got) == list(want)  # same keys, same order
    for key, value in want.items():
        assert got[key] == value and type(got[key]) is type(value), key
    return want


@pytest.fixture(scope="module")
def stage_slice(model_path: str) -> Path:
    """The slice a ``--layers 9:18`` stage loads (cached beside the model, as
    the worker caches it)."""
    return cached_slice(Path(model_path), 9, 18)


def test_matches_gguf_reader_on_the_default_model(model_path: str) -> None:
    want = _assert_same(Path(model_path))
    arch = want["general.architecture"]
    assert model_info(Path(model_path)) == (arch, want[f"{arch}.block_count"]) == ("gemma3", 18)
    assert want["tokenizer.ggml.tokens"] == ("array", gguf.GGUFValueType.STRING, 262144)


def test_matches_gguf_reader_on_a_stage_slice(stage_slice: Path) -> None:
    want = _assert_same(stage_slice)
    assert model_info(stage_slice) == ("gemma3", 9) == ("gemma3", want["gemma3.block_count"])
    got = read_metadata(
        stage_slice, ["skiff.stage.layer_start", "skiff.stage.layer_end", "nobody.home"]
    )
    assert got == {"skiff.stage.layer_start": 9, "skiff.stage.layer_end": 18}


def _write(path: Path, arch: str, kvs: list[tuple[str, Any, Any, Any]], big: bool = False) -> Path:
    """A tensor-less GGUF with ``kvs`` (name, value, type, sub type) after
    ``general.architecture``."""
    endian = gguf.GGUFEndian.BIG if big else gguf.GGUFEndian.LITTLE
    writer = gguf.GGUFWriter(str(path), arch, endianess=endian)
    for name, value, vtype, sub in kvs:
        writer.add_key_value(name, value, vtype, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


T = gguf.GGUFValueType
ARRAYS_FIRST: list[tuple[str, Any, Any, Any]] = [
    ("t.strings", ["", "a", "日本語 ✓", "x" * 1000, "\x00nul"], T.ARRAY, T.STRING),
    ("t.u8", [1, 2, 3], T.ARRAY, T.UINT8),
    ("t.i16", [-1, 2, -3, 4], T.ARRAY, T.INT16),
    ("t.i64", [-(2**40), 2**40], T.ARRAY, T.INT64),
    ("t.f64", [0.5, -1.25], T.ARRAY, T.FLOAT64),
    ("t.bools", [True, False, True], T.ARRAY, T.BOOL),
    ("t.nested_ints", [[1, 2, 3], [4], [5, 6]], T.ARRAY, None),
    ("t.nested_strings", [["ab", "c"], ["", "déjà", "vu"]], T.ARRAY, None),
    ("t.nested_deep", [[[1, 2], [3]], [[4, 5, 6]]], T.ARRAY, None),
    ("llama.block_count", 7, T.UINT32, None),
    ("t.after", "still in step", T.STRING, None),
    ("t.f32", 0.1, T.FLOAT32, None),
    ("t.bool", True, T.BOOL, None),
    ("t.u64", 2**63 + 5, T.UINT64, None),
    ("t.i8", -7, T.INT8, None),
]


@pytest.mark.parametrize("big", [False, True], ids=["little-endian", "big-endian"])
def test_string_numeric_and_nested_arrays_are_stepped_over(tmp_path: Path, big: bool) -> None:
    path = _write(tmp_path / "arrays.gguf", "llama", ARRAYS_FIRST, big=big)
    want = _assert_same(path)
    assert want["t.after"] == "still in step" and want["t.u64"] == 2**63 + 5
    assert model_info(path) == ("llama", 7)
    got = _ours(path)
    assert got["t.nested_strings"] == ("array", T.ARRAY, 2)
    assert got["t.strings"] == ("array", T.STRING, 5)


def test_the_walk_stops_at_the_keys_it_needs(tmp_path: Path) -> None:
    """A file cut inside an array that follows the needed keys still gives
    them: nothing past them is read (the tokenizer arrays, in a real model)."""
    vocab = [f"token-{i}" for i in range(5000)]
    kvs = [
        ("llama.block_count", 3, T.UINT32, None),
        ("tokenizer.ggml.tokens", vocab, T.ARRAY, T.STRING),
    ]
    whole = _write(tmp_path / "whole.gguf", "llama", kvs)
    cut = tmp_path / "cut.gguf"
    data = whole.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    assert model_info(cut) == ("llama", 3)
    assert read_metadata(cut, ["llama.block_count"]) == {"llama.block_count": 3}
    with pytest.raises(GGUFMetaError, match="truncated"):
        list(iter_metadata(cut))


def test_foreign_truncated_and_incomplete_files_are_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    text = tmp_path / "text.gguf"
    text.write_bytes(b"not a model at all")
    for path in (empty, text):
        with pytest.raises(GGUFMetaError):
            list(iter_metadata(path))
        with pytest.raises(SliceError):
            model_info(path)
    whole = _write(tmp_path / "arrays.gguf", "llama", ARRAYS_FIRST).read_bytes()
    for cut_at in (6, 20, 40, 200, len(whole) - 3):
        cut = tmp_path / f"cut{cut_at}.gguf"
        cut.write_bytes(whole[:cut_at])
        with pytest.raises(GGUFMetaError):
            list(iter_metadata(cut))
    no_count = _write(tmp_path / "no_count.gguf", "llama", ARRAYS_FIRST[:3])
    with pytest.raises(SliceError, match="block_count"):
        model_info(no_count)


def test_block_count_may_come_before_the_architecture(tmp_path: Path) -> None:
    """GGUFWriter always writes the architecture first; the spec does not
    ask for it, so the file is packed by hand."""

    def text(s: str) -> bytes:
        data = s.encode()
        return struct.pack("<Q", len(data)) + data

    kvs = [
        text("llama.block_count") + struct.pack("<II", T.UINT32, 5),
        text("mistral.block_count") + struct.pack("<II", T.UINT32, 9),
        text("general.architecture") + struct.pack("<I", T.STRING) + text("llama"),
    ]
    path = tmp_path / "order.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs))
    assert _assert_same(path)["general.architecture"] == "llama"
    assert model_info(path) == ("llama", 5)


@pytest.mark.parametrize("alignment", [None, 64])
def test_tensor_infos_match_gguf_reader(tmp_path: Path, alignment: int | None) -> None:
    """Tensor entries after arrays of every kind, with the default alignment
    and a custom one: names, GGML-order dims, types and file offsets as
    GGUFReader finds them."""
    path = tmp_path / "tensors.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, value, vtype, sub in ARRAYS_FIRST:
        writer.add_key_value(name, value, vtype, sub_type=sub)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    tensors = {
        "a.weight": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b.weight": np.ones(5, dtype=np.float16),
        "c.weight": np.zeros((4, 34), dtype=np.uint8),  # 4 rows of one Q8_0 block
    }
    for name, array in tensors.items():
        raw = gguf.GGMLQuantizationType.Q8_0 if array.dtype == np.uint8 else None
        writer.add_tensor(name, array, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    want = [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset))
        for t in gguf.GGUFReader(str(path)).tensors
    ]
    got = [(t.name, t.dims, t.ggml_type, t.offset) for t in read_tensor_infos(path)]
    assert got == want
    assert got[-1][1:3] == ((32, 4), 8)
    assert all(off % (alignment or 32) == 0 for *_, off in got)
