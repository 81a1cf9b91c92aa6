#!/usr/bin/env python3
"""Write small random-weight models of other architectures, deterministic and cached.

    .venv/bin/python scripts/make_models.py [--arch llama] [--size tiny|bench] [--print-path]

Why: the registry ships one whole GGUF (Gemma 3 270M), and it is an odd one
for some questions: its tied 262,144-row head is ~70% of a decode's cost, so
no split by layers can balance a pipeline over it. These models are real
llama.cpp architectures with random weights: what they say is noise, what
they exercise is the real plumbing and the real cost of each layer.

The tokenizer is the packaged Gemma 3's SentencePiece vocabulary cut to its
first ``vocab`` pieces (ids are ordered by score, so the cut keeps the
control tokens, the 256 byte pieces at 238..493 that let any text tokenize,
``<start_of_turn>``/``<end_of_turn>``, and the most frequent pieces), with a
Gemma-style chat template. Every matrix is Q8_0, every norm F32; the head is
untied (``output.weight``). Sizes:

- ``tiny``: n_embd 128, 4 layers, vocab 32,768: a few MB, for tests.
- ``bench``: n_embd 1024, n_ff 4096, 16 layers, vocab 32,768 (~330 MB): the
  layers dominate a decode (the head is ~12% of it), as in most 1B+ models.

Files go to the model cache (``SKIFF_CACHE_DIR``, default ``~/.cache/skiff``)
as ``generated-ARCH-SIZE.HASH.gguf``, the hash covering the shape, seed and
this script's format version, so a changed recipe never reuses a stale file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FORMAT = 1  # bump when the recipe changes: it is part of the file's hash
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@dataclass(frozen=True)
class Shape:
    arch: str
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    n_head_kv: int
    vocab: int
    n_ctx: int = 8192
    seed: int = 0


SIZES = {
    "tiny": Shape("llama", 128, 384, 4, 4, 2, 32768),
    "bench": Shape("llama", 1024, 4096, 16, 16, 4, 32768),
}


def model_path(shape: Shape, size: str) -> Path:
    from worker.models import cache_dir

    key = json.dumps({**asdict(shape), "format": FORMAT}, sort_keys=True).encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    return cache_dir() / "models" / f"generated-{shape.arch}-{size}.{digest}.gguf"


def gemma_vocab(n: int) -> tuple[list[bytes], list[float], list[int]]:
    """The packaged Gemma 3 tokenizer's first ``n`` pieces, scores, types."""
    from gguf import GGUFReader

    from worker.models import default_model_path

    reader = GGUFReader(str(default_model_path()))
    f_tok = reader.fields["tokenizer.ggml.tokens"]
    f_score = reader.fields["tokenizer.ggml.scores"]
    f_type = reader.fields["tokenizer.ggml.token_type"]
    tokens = [bytes(f_tok.parts[i]) for i in f_tok.data[:n]]
    scores = [float(f_score.parts[i][0]) for i in f_score.data[:n]]
    types = [int(f_type.parts[i][0]) for i in f_type.data[:n]]
    return tokens, scores, types


def write(shape: Shape, out: Path) -> None:
    import gguf

    rng = np.random.default_rng(shape.seed)
    q8 = gguf.GGMLQuantizationType.Q8_0
    tmp = out.with_suffix(".partial")
    w = gguf.GGUFWriter(str(tmp), shape.arch)
    w.add_name(f"skiff generated {shape.arch} ({shape.n_layer}x{shape.n_embd}, random)")
    w.add_context_length(shape.n_ctx)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layer)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(shape.n_embd // shape.n_head)
    w.add_vocab_size(shape.vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    tokens, scores, types = gemma_vocab(shape.vocab)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    w.add_chat_template(CHAT_TEMPLATE)

    def matrix(name: str, rows: int, cols: int) -> None:
        # std 1/sqrt(cols) keeps activations of the order of one through the layers
        data = rng.standard_normal((rows, cols), dtype=np.float32) / np.float32(np.sqrt(cols))
        w.add_tensor(name, gguf.quants.quantize(data, q8), raw_dtype=q8)

    def norm(name: str) -> None:
        w.add_tensor(name, np.ones(shape.n_embd, dtype=np.float32))

    e, hd = shape.n_embd, shape.n_embd // shape.n_head
    matrix("token_embd.weight", shape.vocab, e)
    for i in range(shape.n_layer):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", e, e)
        matrix(f"blk.{i}.attn_k.weight", shape.n_head_kv * hd, e)
        matrix(f"blk.{i}.attn_v.weight", shape.n_head_kv * hd, e)
        matrix(f"blk.{i}.attn_output.weight", e, e)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", shape.n_ff, e)
        matrix(f"blk.{i}.ffn_up.weight", shape.n_ff, e)
        matrix(f"blk.{i}.ffn_down.weight", e, shape.n_ff)
    norm("output_norm.weight")
    matrix("output.weight", shape.vocab, e)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(out)  # whole or absent: a reader never trusts a half-written file


def ensure(size: str = "tiny") -> Path:
    """The model of ``size``, written on first use."""
    shape = SIZES[size]
    out = model_path(shape, size)
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        write(shape, out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--print-path", action="store_true", help="print only the path")
    args = ap.parse_args()
    path = ensure(args.size)
    if args.print_path:
        print(path)
    else:
        print(f"{path} ({path.stat().st_size / 2**20:.1f} MiB): {SIZES[args.size]}")


if __name__ == "__main__":
    main()
