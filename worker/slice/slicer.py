"""``skiff-slice``: the model a pipeline stage holding layers ``[LO, HI)`` loads.

    skiff-slice MODEL.gguf --layers LO:HI -o OUT.gguf [--keep-all]
    skiff-slice MODEL.gguf --validate LO:HI [--slice OUT.gguf] [--threads 1]
    skiff-slice MODEL.gguf --balance N [--rows 4] [--threads 1]

A stage slice holds blocks ``LO .. HI-1`` renumbered from 0, with
``block_count`` and every per-layer metadata array cut to match, the output
norm, and of the rest only what its stage reads (issue 23: each stage holds
only its share):

- the token embedding when the stage is the first (it looks rows up) or the
  last with a tied head (the packaged Gemma 3 has no ``output.weight``: its
  head is ``token_embd`` itself);
- ``output.weight``, if the model has one, only on the last stage;
- a stage with a next stage also loads block ``HI`` (the engine taps layer
  ``HI-1`` and stops the graph there; the extra block only keeps the tapped
  one from being the graph's last, whose rows llama.cpp trims), never
  computed.

llama.cpp refuses a model without ``token_embd`` (``create_tensor`` with no
``TENSOR_NOT_REQUIRED`` flag) and checks every tensor's shape, not its type.
What a stage does not read is therefore a *stand-in*: the right name and
shape, the embedding in the cheapest type whose blocks fit a row (Q1_0,
1.125 bits a weight: 24 MB instead of 178 MB), the spare block in its own
types, and no bytes at all on disk: stand-ins sit after every real tensor
and the file is extended over them (a hole; read back as zeros). Missing
``output.weight`` is allowed: llama.cpp then ties the head to ``token_embd``
(a stand-in on a stage that never computes the head). The stand-ins' names
go under ``skiff.stage.stand_ins``; tests fill them with NaN and get the
same logits to the bit, and find none of their pages resident.

Gemma 3 derives which layers use the sliding window (and their RoPE base)
from the layer index — dense when ``(il + 1) % 6 == 0`` — so renumbering
alone moves the dense layers: a split at layer 9 then gives logit errors of
0.9 to 17 while greedy tokens may still agree. The slice therefore writes
``{arch}.attention.sliding_window_pattern`` as an explicit per-layer bool
array (true = sliding window), which llama.cpp reads in preference to the
derived pattern. The source's sha256 and the range go under ``skiff.stage.*``.

``--validate`` names the first layer whose output differs between the full
model and the slice (``validate.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .ggufmeta import GGUFMetaError, iter_metadata
from .swa import range_problem, swa_pattern
from .validate import first_difference

# Architectures whose per-layer behaviour is known to survive renumbering
# with the rules above (extend only with a test that compares logits:
# tests/test_archs.py runs --validate and a chain on each; docs/models.md).
ALLOWED_ARCHS = ("gemma3", "llama", "qwen2", "qwen3", "qwen3moe")


class SliceError(ValueError):
    """The model or the range cannot be sliced."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def parse_range(text: str) -> tuple[int, int]:
    try:
        lo_s, hi_s = text.split(":")
        lo, hi = int(lo_s), int(hi_s)
    except ValueError:
        raise SliceError(f"a layer range is LO:HI, not {text!r}") from None
    return lo, hi


def check_arch(arch: str) -> None:
    """Refuse an architecture not on the tested list, naming it and the list."""
    if arch not in ALLOWED_ARCHS:
        raise SliceError(
            f"architecture {arch!r} is not on the tested list {list(ALLOWED_ARCHS)}: "
            "its per-layer behaviour may not survive renumbering"
        )


def model_info(path: Path) -> tuple[str, int]:
    """(architecture, block count) of a GGUF.

    Every stage start asks this, so it reads only the metadata up to the two
    keys (``ggufmeta``): ``gguf.GGUFReader`` would first parse the whole
    tokenizer vocabulary that follows them (~13 s of CPU for the packaged
    model). ``{arch}.block_count`` may come before ``general.architecture``,
    so every ``*.block_count`` seen is kept until the architecture is known.
    """
    arch: str | None = None
    counts: dict[str, object] = {}
    try:
        with closing(iter_metadata(path)) as items:
            for key, value in items:
                if key == "general.architecture":
                    if not isinstance(value, str):
                        raise SliceError(f"{path}: general.architecture is not a string")
                    arch = value
                elif key.endswith(".block_count"):
                    counts[key] = value
                if arch is not None and f"{arch}.block_count" in counts:
                    break
    except GGUFMetaError as exc:
        raise SliceError(f"cannot read {path}: {exc}") from None
    if arch is None:
        raise SliceError(f"{path} has no general.architecture")
    n_layer = counts.get(f"{arch}.block_count")
    if n_layer is None:
        raise SliceError(f"{path} has no {arch}.block_count")
    if not isinstance(n_layer, int) or isinstance(n_layer, bool):
        raise SliceError(f"{path}: {arch}.block_count is not an integer")
    return arch, n_layer


@dataclass(frozen=True)
class Parts:
    """What a slice holds besides its own blocks, by what its stage reads."""

    embd: bool = True  # token embedding rows (the first stage looks tokens up)
    head: bool = True  # the output head (the last stage's logits)
    spare: bool = False  # block HI as a stand-in (a stage with a next stage)


WHOLE = Parts()  # every tensor real, no spare block (skiff-slice --keep-all)


def stage_parts(lo: int, hi: int, n_layer: int) -> Parts:
    """What the stage holding ``[lo, hi)`` of ``n_layer`` reads: a stage has
    a next stage exactly when it does not hold the last layer."""
    return Parts(embd=lo == 0, head=hi == n_layer, spare=hi < n_layer)


def standin_type(cols: int, source: Any) -> Any:
    """The cheapest GGML type whose blocks fit a row of ``cols`` weights (llama.cpp
    checks a tensor's shape, never its type): Q1_0 (128 weights in 18 bytes),
    else MXFP4 (32 in 17), else the source's own type."""
    import gguf

    q = gguf.GGMLQuantizationType
    for kind in (q.Q1_0, q.MXFP4):
        if cols % gguf.GGML_QUANT_SIZES[kind][0] == 0:
            return kind
    return source


def slice_model(
    src: Path,
    lo: int,
    hi: int,
    out: Path,
    fix_swa: bool = True,
    sha256: str | None = None,
    parts: Parts = WHOLE,
) -> Path:
    """Write the slice of blocks ``[lo, hi)`` of ``src`` holding ``parts`` to ``out``."""
    # Imported here: a worker imports this module at every start but slices
    # only on a cache miss, and gguf adds ~0.2 s of imports.
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    check_arch(arch)
    n_layer = int(reader.fields[f"{arch}.block_count"].contents())
    if not 0 <= lo < hi <= n_layer or (parts.spare and hi == n_layer):
        raise SliceError(f"layers {lo}:{hi} are not a range of the model's {n_layer}")
    problem = range_problem(arch, lo, hi)
    if problem is not None:
        raise SliceError(problem)
    end = hi + 1 if parts.spare else hi  # blocks in the file, the spare one included
    tmp = out.with_suffix(out.suffix + ".partial")
    writer = gguf.GGUFWriter(str(tmp), arch)
    pattern_key = f"{arch}.attention.sliding_window_pattern"
    for field in reader.fields.values():
        name = field.name
        if name == "general.architecture" or name.startswith("GGUF.") or name == pattern_key:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value: Any = field.contents()
        if name == f"{arch}.block_count":
            value = end - lo
        elif (
            name.startswith(f"{arch}.")
            and vtype == gguf.GGUFValueType.ARRAY
            and isinstance(value, list)
            and len(value) == n_layer
        ):
            value = value[lo:end]  # a per-layer array
        writer.add_key_value(name, value, vtype, sub_type=sub)
    pattern = swa_pattern(arch, lo, end)
    if pattern is not None and fix_swa:
        writer.add_key_value(
            pattern_key, pattern, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.BOOL
        )
    real, stand_ins = _pick_tensors(reader.tensors, lo, hi, parts)
    string = gguf.GGUFValueType.STRING
    writer.add_key_value("skiff.stage.source_sha256", sha256 or file_sha256(src), string)
    writer.add_key_value("skiff.stage.layer_start", lo, gguf.GGUFValueType.UINT32)
    writer.add_key_value("skiff.stage.layer_end", end, gguf.GGUFValueType.UINT32)
    writer.add_key_value("skiff.stage.source_block_count", n_layer, gguf.GGUFValueType.UINT32)
    if stand_ins:
        names = [name for name, _, _ in stand_ins]
        writer.add_key_value(
            "skiff.stage.stand_ins", names, gguf.GGUFValueType.ARRAY, sub_type=string
        )
    for name, tensor in real:
        writer.add_tensor_info(
            name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type
        )
    hole = 0  # stand-ins come last: their bytes are never written
    for name, shape, kind in stand_ins:
        byte_shape = gguf.quant_shape_to_byte_shape(shape, kind)
        nbytes = int(np.prod(byte_shape))
        writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, kind)
        hole += writer.ggml_pad(nbytes, writer.data_alignment)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, tensor in real:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()  # the last real tensor ends padded: the stand-ins start here
    if hole:
        with tmp.open("r+b") as fh:
            fh.truncate(fh.seek(0, 2) + hole)
    tmp.replace(out)
    return out


def _pick_tensors(
    tensors: Sequence[Any], lo: int, hi: int, parts: Parts
) -> tuple[list[tuple[str, Any]], list[tuple[str, tuple[int, ...], Any]]]:
    """(real tensors renamed, stand-ins as (name, shape, type)) of a slice.

    A stand-in's shape is in GGUF's row-major order (``[rows, cols]``), as
    ``gguf`` writes quantized shapes."""
    tied = not any(t.name == "output.weight" for t in tensors)
    real: list[tuple[str, Any]] = []
    stand_ins: list[tuple[str, tuple[int, ...], Any]] = []
    for tensor in tensors:
        name = tensor.name
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if name.startswith("blk."):
            il = int(name.split(".")[1])
            name = f"blk.{il - lo}." + name.split(".", 2)[2]
            if lo <= il < hi:
                real.append((name, tensor))
            elif parts.spare and il == hi:  # loaded, never computed: its own types
                stand_ins.append((name, shape, tensor.tensor_type))
        elif name == "output.weight":
            if parts.head:
                real.append((name, tensor))
            # else dropped: llama.cpp then uses token_embd as the head, never computed here
        elif name == "token_embd.weight" and not (parts.embd or (parts.head and tied)):
            stand_ins.append((name, shape, standin_type(shape[-1], tensor.tensor_type)))
        else:
            real.append((name, tensor))
    return real, stand_ins


def stage_slice_path(src: Path, sha256: str, lo: int, hi: int, folder: Path) -> Path:
    """Where the stage ``[lo, hi)``'s slice of ``src`` is cached (named apart from
    the ``layers-LO-HI`` slices of before stand-ins, which held everything)."""
    return folder / f"{src.stem}.{sha256[:16]}.stage-{lo}-{hi}.gguf"


def cached_slice(src: Path, lo: int, hi: int, cache_dir: Path | None = None) -> Path:
    """The model the stage holding ``[lo, hi)`` loads (``stage_parts``), sliced
    once and kept beside the source (keyed by its sha256 and the range)."""
    sha = file_sha256(src)
    out = stage_slice_path(src, sha, lo, hi, cache_dir or src.parent)
    if out.exists() and out.stat().st_size > 0:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    _, n_layer = model_info(src)
    return slice_model(src, lo, hi, out, sha256=sha, parts=stage_parts(lo, hi, n_layer))


def validate(
    src: Path, lo: int, hi: int, sliced: Path | None = None, text: str = "", threads: int = 1
) -> str | None:
    """Compare a slice's layers with the full model's (``validate.py``); the
    first that differs (``None`` when every layer is bit-identical). Without
    ``sliced``, the slice a stage holding ``[lo, hi)`` loads is cut to a
    temp dir."""
    if sliced is not None:
        return first_difference(src, sliced, lo, hi, text, threads)
    with tempfile.TemporaryDirectory(prefix="skiff-validate-") as tmp:
        parts = stage_parts(lo, hi, model_info(src)[1])
        path = slice_model(src, lo, hi, Path(tmp) / "slice.gguf", parts=parts)
        return first_difference(src, path, lo, hi, text, threads)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="skiff-slice", description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--layers", help="LO:HI, the stage's layers")
    ap.add_argument("-o", "--out", type=Path, help="the stage model to write")
    ap.add_argument(
        "--keep-all",
        action="store_true",
        help="keep the embedding and head real and add no spare block (not a stage's slice)",
    )
    ap.add_argument("--validate", metavar="LO:HI", help="compare a slice layer by layer")
    ap.add_argument("--slice", type=Path, help="with --validate: an existing slice to check")
    ap.add_argument("--no-swa-fix", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--balance",
        type=int,
        metavar="N",
        help="measure each layer's and the head's cost and print the best split into N stages",
    )
    ap.add_argument("--rows", type=int, default=4, help="with --balance: decode batch size")
    ap.add_argument(
        "--threads", type=int, default=1, help="with --balance or --validate: compute threads"
    )
    args = ap.parse_args(argv)
    try:
        if args.balance:
            from .balance import measure, report

            costs = measure(str(args.model), rows=args.rows, threads=args.threads)
            sys.stdout.write(report(costs, args.balance) + "\n")
            return 0
        if args.validate:
            lo, hi = parse_range(args.validate)
            why = validate(args.model, lo, hi, args.slice, threads=args.threads)
            sys.stdout.write(
                f"{'OK: every layer identical' if why is None else 'DIFFERS: ' + why}\n"
            )
            return 0 if why is None else 1
        if not args.layers or not args.out:
            ap.error("give --layers LO:HI and -o OUT.gguf, or --validate LO:HI")
        lo, hi = parse_range(args.layers)
        parts = WHOLE if args.keep_all else stage_parts(lo, hi, model_info(args.model)[1])
        slice_model(args.model, lo, hi, args.out, fix_swa=not args.no_swa_fix, parts=parts)
        sys.stdout.write(f"wrote {args.out} (layers {lo}:{hi}, {parts})\n")
        return 0
    except SliceError as exc:
        sys.stderr.write(f"skiff-slice: {exc}\n")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
