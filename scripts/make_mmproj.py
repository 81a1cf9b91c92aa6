#!/usr/bin/env python3
"""Write a tiny random-weight Gemma 3 multimodal projector (mmproj) GGUF.

    .venv/bin/python scripts/make_mmproj.py OUT.gguf [--n-embd 640] [--seed 0]

Why: no small projector ships for the packaged Gemma 3 270M, and a real one
(Gemma 3's, a SigLIP-400M encoder, is several hundred MB) is far too big for tests. This
writes a projector that llama.cpp's own multimodal library (``mtmd`` / clip)
loads as ``PROJECTOR_TYPE_GEMMA3`` and runs end to end (resize, patch
embedding, a few SigLIP-style ViT blocks, 4x4 average pooling, RMS norm,
projection into the text model's embedding width). Its weights are random,
so what it "sees" is meaningless; what it exercises is the real plumbing:
markers, ``<start_of_image>``/``<end_of_image>`` wrapping, non-causal image
decoding, KV placement in the right sequence, token counts.

Real deployments pass a real projector (for Gemma 3: the ``mmproj-*.gguf``
published beside the model, e.g. in ggml-org's Gemma 3 GGUF repositories).

Layout (names as llama.cpp's clip loader reads them, numpy shapes; the GGUF
stores the reversed ggml ``ne``):

    v.patch_embd.weight      [E, 3, P, P]   conv kernel (ggml [P, P, 3, E])
    v.patch_embd.bias        [E]
    v.position_embd.weight   [N, E]         N = (S / P)^2 patches
    v.blk.{i}.ln1/ln2.{weight,bias}                      [E]
    v.blk.{i}.attn_{q,k,v,out}.weight [E, E], .bias      [E]
    v.blk.{i}.ffn_up.weight  [F, E], .bias [F]
    v.blk.{i}.ffn_down.weight [E, F], .bias [E]
    v.post_ln.{weight,bias}  [E]
    mm.soft_emb_norm.weight  [E]            RMS-norm scale before projection
    mm.input_projection.weight [E, n_embd]  (ggml ne[0] = n_embd: what mtmd
                                            checks against the text model)

With the defaults (S = 64, P = 4, merge 4) an image becomes 16 x 16 patches,
pooled 4 x 4 into 16 image tokens whatever its input size (Gemma 3's
preprocessor resizes every image to S x S).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import gguf
import numpy as np

PROJECTOR_TYPE = "gemma3"


def write_test_projector(
    path: str | Path,
    n_embd: int = 640,
    *,
    image_size: int = 64,
    patch_size: int = 4,
    merge: int = 4,
    hidden: int = 64,
    ffn: int = 128,
    heads: int = 4,
    layers: int = 2,
    seed: int = 0,
    proj_scale: float = 0.125,
) -> Path:
    """Write the projector to ``path`` and return it.

    ``n_embd`` must equal the text model's embedding width (640 for Gemma 3
    270M): mtmd refuses a projector whose output width differs. Image tokens
    per image = ``(image_size // patch_size // merge) ** 2``. Weights are
    small (std 0.02, unit norms) so activations stay finite; ``proj_scale``
    sets the std of the final projection, i.e. roughly the magnitude of the
    image embeddings the language model receives (Gemma's own scaled token
    embeddings are of order 1).
    """
    side = image_size // patch_size
    if side * patch_size != image_size or side % merge:
        raise ValueError("image_size must be a multiple of patch_size * merge")
    if hidden % heads:
        raise ValueError("hidden must be a multiple of heads")
    n_patch = side * side
    rng = np.random.default_rng(seed)

    def normal(*shape: int, std: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    def zeros(n: int) -> np.ndarray:
        return np.zeros(n, dtype=np.float32)

    tensors: list[tuple[str, np.ndarray]] = [
        ("v.patch_embd.weight", normal(hidden, 3, patch_size, patch_size, std=0.1)),
        ("v.patch_embd.bias", zeros(hidden)),
        ("v.position_embd.weight", normal(n_patch, hidden)),
    ]
    for i in range(layers):
        blk = f"v.blk.{i}"
        tensors += [
            (f"{blk}.ln1.weight", ones(hidden)),
            (f"{blk}.ln1.bias", zeros(hidden)),
        ]
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensors += [
                (f"{blk}.{name}.weight", normal(hidden, hidden)),
                (f"{blk}.{name}.bias", zeros(hidden)),
            ]
        tensors += [
            (f"{blk}.ln2.weight", ones(hidden)),
            (f"{blk}.ln2.bias", zeros(hidden)),
            (f"{blk}.ffn_up.weight", normal(ffn, hidden)),
            (f"{blk}.ffn_up.bias", zeros(ffn)),
            (f"{blk}.ffn_down.weight", normal(hidden, ffn)),
            (f"{blk}.ffn_down.bias", zeros(hidden)),
        ]
    tensors += [
        ("v.post_ln.weight", ones(hidden)),
        ("v.post_ln.bias", zeros(hidden)),
        ("mm.soft_emb_norm.weight", ones(hidden)),
        ("mm.input_projection.weight", normal(hidden, n_embd, std=proj_scale)),
    ]

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), "clip")
    keys = gguf.Keys
    writer.add_name("skiff test projector (random weights)")
    writer.add_string(keys.Clip.PROJECTOR_TYPE, PROJECTOR_TYPE)
    writer.add_bool(keys.Clip.HAS_VISION_ENCODER, True)
    writer.add_bool(keys.Clip.HAS_AUDIO_ENCODER, False)
    vis = keys.ClipVision
    writer.add_uint32(vis.IMAGE_SIZE, image_size)
    writer.add_uint32(vis.PATCH_SIZE, patch_size)
    writer.add_uint32(vis.EMBEDDING_LENGTH, hidden)
    writer.add_uint32(vis.FEED_FORWARD_LENGTH, ffn)
    writer.add_uint32(vis.PROJECTION_DIM, n_embd)
    writer.add_uint32(vis.BLOCK_COUNT, layers)
    writer.add_uint32(vis.Attention.HEAD_COUNT, heads)
    writer.add_float32(vis.Attention.LAYERNORM_EPS, 1e-6)
    writer.add_array(vis.IMAGE_MEAN, [0.5, 0.5, 0.5])
    writer.add_array(vis.IMAGE_STD, [0.5, 0.5, 0.5])
    writer.add_bool(vis.USE_GELU, True)
    writer.add_uint32(vis.Projector.SCALE_FACTOR, merge)
    for name, data in tensors:
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the .gguf to write")
    ap.add_argument("--n-embd", type=int, default=640, help="the text model's n_embd")
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--patch-size", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    out = write_test_projector(
        args.out,
        args.n_embd,
        image_size=args.image_size,
        patch_size=args.patch_size,
        layers=args.layers,
        seed=args.seed,
    )
    ms = (time.perf_counter() - t0) * 1e3
    print(f"wrote {out} ({out.stat().st_size} bytes) in {ms:.0f} ms", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
