#!/usr/bin/env python3
"""Write small random-weight models of other architectures, deterministic and cached.

    .venv/bin/python scripts/make_models.py [--arch llama|qwen2|qwen3|qwen3moe]
        [--size tiny|bench] [--print-path]

Why: the registry ships one whole GGUF (Gemma 3 270M: sliding window, tied
head), and users bring others: Llama- and Qwen-family models without a
sliding window, sometimes a mixture of experts. These models are real
llama.cpp architectures with random weights: what they say is noise, what
they exercise is the real plumbing (each architecture's tensors, graph and
metadata) and the real cost of each layer. What each architecture needs,
as llama.cpp 0.3.36 loads it (``src/models/ARCH.cpp``):

- ``llama``: q/k/v/o, gate/up/down, untied head (``output.weight``);
- ``qwen2``: the same plus q/k/v biases (``attn_{q,k,v}.bias``), untied;
- ``qwen3``: no biases, a per-head RMS norm on q and k (``attn_q_norm``,
  ``attn_k_norm``), and a head tied to the embedding, as in Qwen3 0.6B;
- ``qwen3moe``: qwen3's attention, and a mixture of experts in place of the
  dense FFN: a router (``ffn_gate_inp``), stacked experts
  (``ffn_{gate,up,down}_exps``), ``expert_count`` 4, ``expert_used_count``
  2, ``expert_feed_forward_length``; untied.

None has a sliding window. The tokenizer is the packaged Gemma 3's
SentencePiece vocabulary cut to its first ``vocab`` pieces (ids are ordered
by score, so the cut keeps the control tokens, the 256 byte pieces at
238..493 that let any text tokenize, and the most frequent pieces). Each
family gets its own chat template, rendered with its own control tokens:
the cut vocabulary's first unused control pieces (``<unused0>``...) are
renamed to the family's markers, so the template's text tokenizes to single
control tokens as in the real models (``<|start_header_id|>`` /
``<|eot_id|>`` for llama, ChatML's ``<|im_start|>`` / ``<|im_end|>`` for
the Qwens, which also add no BOS). The end-of-turn marker is the EOS, as in
the instruct models. Every matrix is Q8_0, every norm and bias F32. Sizes:

- ``tiny``: n_embd 128, 4 layers, vocab 8,192: 2-3 MB, for tests.
- ``bench``: n_embd 1024, n_ff 4096, 16 layers, vocab 32,768 (~330 MB for
  llama): the layers dominate a decode (the head is ~12% of it), as in most
  1B+ models.

Files go to the model cache (``SKIFF_CACHE_DIR``, default ``~/.cache/skiff``)
as ``generated-ARCH-SIZE.HASH.gguf``, the hash covering the shape, the
family's tokens and template, the seed and this script's format version, so
a changed recipe never reuses a stale file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FORMAT = 2  # bump when the recipe changes: it is part of the file's hash
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
    "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
UNUSED0 = 6  # <unused0> in the Gemma 3 vocabulary: the first renamed control piece


@dataclass(frozen=True)
class Family:
    """What a family's tokenizer and template look like."""

    template: str
    markers: tuple[str, ...]  # control pieces renamed from <unused0>...
    eos: str  # the end-of-turn marker, also the EOS
    add_bos: bool


FAMILIES = {
    "llama": Family(
        LLAMA_TEMPLATE,
        ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        "<|eot_id|>",
        True,
    ),
    "qwen": Family(CHATML_TEMPLATE, ("<|im_start|>", "<|im_end|>"), "<|im_end|>", False),
}


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
    tied: bool = False  # no output.weight: the head is token_embd
    n_expert: int = 0  # a mixture of experts (qwen3moe): experts, used per token, their n_ff
    n_expert_used: int = 0
    n_ff_exp: int = 0

    @property
    def family(self) -> Family:
        return FAMILIES["llama" if self.arch == "llama" else "qwen"]


ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe")
SIZES = {
    "tiny": Shape("llama", 128, 384, 4, 4, 2, 8192),
    "bench": Shape("llama", 1024, 4096, 16, 16, 4, 32768),
}


def shape_of(arch: str, size: str) -> Shape:
    """The ``size`` shape in ``arch``: qwen3 ties its head (as Qwen3 0.6B);
    qwen3moe has 4 experts of n_ff / 2, 2 used per token."""
    base = replace(SIZES[size], arch=arch)
    if arch == "qwen3":
        return replace(base, tied=True)
    if arch == "qwen3moe":
        return replace(base, n_expert=4, n_expert_used=2, n_ff_exp=base.n_ff // 2)
    return base


def model_path(shape: Shape, size: str) -> Path:
    from worker.models import cache_dir

    recipe = {**asdict(shape), "family": asdict(shape.family), "format": FORMAT}
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
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


def add_tokenizer(w: Any, shape: Shape) -> None:
    """The cut Gemma vocabulary with the family's markers and template."""
    family = shape.family
    tokens, scores, types = gemma_vocab(shape.vocab)
    for i, marker in enumerate(family.markers):
        assert tokens[UNUSED0 + i] == f"<unused{i}>".encode()  # a control piece we may rename
        tokens[UNUSED0 + i] = marker.encode()
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(UNUSED0 + family.markers.index(family.eos))
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(family.add_bos)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    w.add_chat_template(family.template)


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
    if shape.n_expert:
        w.add_expert_count(shape.n_expert)
        w.add_expert_used_count(shape.n_expert_used)
        w.add_expert_feed_forward_length(shape.n_ff_exp)
    w.add_vocab_size(shape.vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    add_tokenizer(w, shape)

    def matrix(name: str, *dims: int) -> None:
        # std 1/sqrt(cols) keeps activations of the order of one through the layers
        data = rng.standard_normal(dims, dtype=np.float32) / np.float32(np.sqrt(dims[-1]))
        w.add_tensor(name, gguf.quants.quantize(data, q8), raw_dtype=q8)

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    def bias(name: str, n: int) -> None:
        # small noise, not zeros: a bias llama.cpp failed to add would show
        w.add_tensor(name, rng.standard_normal(n, dtype=np.float32) * np.float32(0.1))

    e, hd = shape.n_embd, shape.n_embd // shape.n_head
    kv = shape.n_head_kv * hd
    qwen3 = shape.arch in ("qwen3", "qwen3moe")
    matrix("token_embd.weight", shape.vocab, e)
    for i in range(shape.n_layer):
        norm(f"blk.{i}.attn_norm.weight", e)
        matrix(f"blk.{i}.attn_q.weight", e, e)
        matrix(f"blk.{i}.attn_k.weight", kv, e)
        matrix(f"blk.{i}.attn_v.weight", kv, e)
        if shape.arch == "qwen2":
            for part, n in (("q", e), ("k", kv), ("v", kv)):
                bias(f"blk.{i}.attn_{part}.bias", n)
        if qwen3:
            norm(f"blk.{i}.attn_q_norm.weight", hd)
            norm(f"blk.{i}.attn_k_norm.weight", hd)
        matrix(f"blk.{i}.attn_output.weight", e, e)
        norm(f"blk.{i}.ffn_norm.weight", e)
        if shape.n_expert:
            x, f = shape.n_expert, shape.n_ff_exp
            matrix(f"blk.{i}.ffn_gate_inp.weight", x, e)
            matrix(f"blk.{i}.ffn_gate_exps.weight", x, f, e)
            matrix(f"blk.{i}.ffn_up_exps.weight", x, f, e)
            matrix(f"blk.{i}.ffn_down_exps.weight", x, e, f)
        else:
            matrix(f"blk.{i}.ffn_gate.weight", shape.n_ff, e)
            matrix(f"blk.{i}.ffn_up.weight", shape.n_ff, e)
            matrix(f"blk.{i}.ffn_down.weight", e, shape.n_ff)
    norm("output_norm.weight", e)
    if not shape.tied:
        matrix("output.weight", shape.vocab, e)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(out)  # whole or absent: a reader never trusts a half-written file


def ensure(size: str = "tiny", arch: str = "llama") -> Path:
    """The model of ``arch`` and ``size``, written on first use."""
    shape = shape_of(arch, size)
    out = model_path(shape, size)
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        write(shape, out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", choices=ARCHS, default="llama")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--print-path", action="store_true", help="print only the path")
    args = ap.parse_args()
    path = ensure(args.size, args.arch)
    if args.print_path:
        print(path)
    else:
        shape = shape_of(args.arch, args.size)
        print(f"{path} ({path.stat().st_size / 2**20:.1f} MiB): {shape}")


if __name__ == "__main__":
    main()
