"""The llama.cpp engine: one model, one context, one reusable batch.

The only module family that touches ``llama_cpp``: everything above talks
to ``Engine``: tokenize, ``decode(segments)`` (one ``llama_decode``), rows
of logits as zero-copy numpy views (``output_index`` finds a token's row),
and the per-lane memory ops the runtime needs. A ``Segment`` is a run of
consecutive tokens of one lane (sequence). A ``Batch`` is allocated once at
``n_batch`` capacity and written through numpy views, so a 512-token chunk
costs a few slice writes, not 512 ctypes calls; only ``seq_id`` (an array
of pointers) needs a loop, over the rows whose lane changed since the last
fill. Loading (the backend, the model file, the context and the choices
made there) is ``load.py``'s; an ``Engine`` holds the handles it opens.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import llama_cpp as ll
import numpy as np

from . import kernels, seqstate
from .load import EngineConfig, EngineError, open_context
from .seqstate import FileDigest
from .tap import TapError, in_batch_order, ubatch_rows

OutputMode = Literal["none", "last", "all"]


@dataclass(frozen=True)
class Segment:
    """``tokens`` of lane ``seq`` at positions ``pos0 .. pos0+len-1``; or,
    with ``embd`` (``[n, n_embd]`` f32), input embeddings instead of tokens."""

    seq: int
    tokens: Sequence[int]
    pos0: int
    outputs: OutputMode = "last"
    embd: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.embd) if self.embd is not None else len(self.tokens)


class Batch:
    """A reusable ``llama_batch`` of token ids, or (``n_embd`` > 0) of input
    embeddings: llama.cpp takes one kind per batch, so an engine keeps one
    of each and a forward of mixed steps runs as one decode per kind."""

    def __init__(self, capacity: int, n_seq: int, n_embd: int = 0) -> None:
        self.capacity = capacity
        self.raw = ll.llama_batch_init(capacity, n_embd, n_seq)
        self._token: np.ndarray | None = None
        self._embd: np.ndarray | None = None
        if n_embd:
            self._embd = np.ctypeslib.as_array(self.raw.embd, shape=(capacity, n_embd))
        else:
            self._token = np.ctypeslib.as_array(self.raw.token, shape=(capacity,))
        self._pos = np.ctypeslib.as_array(self.raw.pos, shape=(capacity,))
        self._nseq = np.ctypeslib.as_array(self.raw.n_seq_id, shape=(capacity,))
        self._logits = np.ctypeslib.as_array(self.raw.logits, shape=(capacity,))
        self._seq_of_row = np.full(capacity, -1, dtype=np.int64)
        self._starts: list[int] = []
        self._lens: list[int] = []
        self._nseq[:] = 1

    def fill(self, segments: Sequence[Segment]) -> int:
        total = sum(len(s) for s in segments)
        if total > self.capacity:
            raise ValueError(f"batch of {total} tokens exceeds n_batch {self.capacity}")
        row = 0
        self._starts = [0] * len(segments)
        self._lens = [len(s) for s in segments]
        seq_ptrs = self.raw.seq_id
        # Rows go in lane order, whatever order the segments come in: with a
        # KV stream per lane llama.cpp cuts a micro-batch at the first row
        # whose lane is not the previous lane + 1 (its ``split_equal``), so
        # lanes 3, 5, 6 then 4 would be two passes over the weights where
        # 3, 4, 5, 6 is one. The order changes no row's numbers (each row is
        # computed as if alone: ``engine.kernels``); ``row`` maps segments.
        for i in sorted(range(len(segments)), key=lambda k: segments[k].seq):
            seg = segments[i]
            n = self._lens[i]
            end = row + n
            if self._embd is not None:
                if seg.embd is None:
                    raise ValueError("an embeddings batch takes only embedding segments")
                self._embd[row:end] = seg.embd
            elif seg.embd is not None:
                raise ValueError("a token batch takes no embedding segments")
            else:
                assert self._token is not None
                self._token[row:end] = seg.tokens
            self._pos[row:end] = np.arange(seg.pos0, seg.pos0 + n, dtype=np.int32)
            self._logits[row:end] = 1 if seg.outputs == "all" else 0
            if seg.outputs == "last" and n:
                self._logits[end - 1] = 1
            for r in range(row, end):
                if self._seq_of_row[r] != seg.seq:
                    seq_ptrs[r][0] = seg.seq
                    self._seq_of_row[r] = seg.seq
            self._starts[i] = row
            row = end
        self.raw.n_tokens = row
        return row

    def seqs(self) -> np.ndarray:
        """The lane of each row of the last fill, in batch order."""
        return self._seq_of_row[: int(self.raw.n_tokens)]

    def row(self, segment_index: int, offset: int = -1) -> int:
        """Batch row of token ``offset`` of a segment (negative from the end)."""
        n = self._lens[segment_index]
        k = offset if offset >= 0 else n + offset
        if not 0 <= k < n:
            raise IndexError(f"segment {segment_index} has {n} tokens, no offset {offset}")
        return self._starts[segment_index] + k

    def free(self) -> None:
        ll.llama_batch_free(self.raw)


@dataclass(frozen=True)
class DecodeStatus:
    """Outcome of one ``llama_decode``. ``code`` is llama.cpp's return value."""

    code: int

    @property
    def ok(self) -> bool:
        return self.code == 0

    _WHY = {1: "no KV slot for the batch (context full)", 2: "aborted", -1: "invalid input batch"}

    def describe(self) -> str:
        return "ok" if self.ok else self._WHY.get(self.code, f"fatal error {self.code}")


class Engine:
    """One loaded model with one context of ``n_seq`` sequences (lanes)."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.model_handle, self.ctx_handle, self.tap = open_context(cfg)
        self.vocab_handle = ll.llama_model_get_vocab(self.model_handle)
        self._mem = ll.llama_get_memory(self.ctx_handle)
        self.n_vocab = int(ll.llama_vocab_n_tokens(self.vocab_handle))
        self.n_embd = int(ll.llama_model_n_embd(self.model_handle))
        self.n_layer = int(ll.llama_model_n_layer(self.model_handle))
        self.n_ctx_train = int(ll.llama_model_n_ctx_train(self.model_handle))
        self.n_ctx = int(ll.llama_n_ctx(self.ctx_handle))
        self.n_ctx_per_seq = min(cfg.lane_cells, int(ll.llama_n_ctx_seq(self.ctx_handle)))
        self.n_batch = int(ll.llama_n_batch(self.ctx_handle))
        self.n_ubatch = int(ll.llama_n_ubatch(self.ctx_handle))
        self.n_seq = cfg.n_seq
        self.bos = int(ll.llama_vocab_bos(self.vocab_handle))
        self.eos = int(ll.llama_vocab_eos(self.vocab_handle))
        self.kv_unified = cfg.unified
        self.n_stream = 1 if self.kv_unified else self.n_seq  # KV streams (one per lane)
        self.swa_full = cfg.swa_full
        # Sliding window of the model's windowed layers (0 = none). Even with
        # swa_full a lane can lack old windowed cells: a restored sequence
        # state holds only the last window of them (llama_state_seq_set_data).
        self.n_swa = int(ll.llama_model_n_swa(self.model_handle))
        self._batch = Batch(self.n_batch, self.n_seq)
        self._embd_batch: Batch | None = None  # made on the first embeddings input
        self._last = self._batch  # the batch of the last decode (for output_index)
        self._dropped: list[int] = []  # per segment: leading tokens decoded apart
        self._hidden = False
        # seconds spent filling batches and inside llama_decode (stats' profile)
        self.timing = {"fill": 0.0, "decode": 0.0}
        # the model file's sha256, hashed once (in the background after prepare())
        self.digest = FileDigest(cfg.model_path)
        # the CPU variant and ggml features this process computes with (fixed at load)
        self.cpu = kernels.backend_cpu()
        # prompt pieces' last tokens may join decode rows' micro-batch (_decode);
        # share_head may be switched at any time (scripts/bench_turn_anatomy.py)
        self._splits = self.n_stream > 1 and self.tap is None and bool(self.cpu["batch_invariant"])
        self.share_head = cfg.share_head
        self._abort_fn: Any = None
        self._piece_cache: dict[int, bytes] = {}

    # -- lifecycle -----------------------------------------------------------

    def close(self) -> None:
        if self.ctx_handle:
            self._batch.free()
            if self._embd_batch is not None:
                self._embd_batch.free()
            ll.llama_free(self.ctx_handle)
            ll.llama_model_free(self.model_handle)
            self.ctx_handle = None
            self.model_handle = None

    def metadata(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = ll.llama_model_meta_val_str(self.model_handle, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    # -- vocabulary ----------------------------------------------------------

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        vocab, raw = self.vocab_handle, text.encode("utf-8")
        cap = len(raw) + 8
        buf = (ll.llama_token * cap)()
        n = ll.llama_tokenize(vocab, raw, len(raw), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (ll.llama_token * cap)()
            n = ll.llama_tokenize(vocab, raw, len(raw), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """The raw bytes of one token (may be part of a UTF-8 character)."""
        cached = self._piece_cache.get(token)
        if cached is not None:
            return cached
        buf = ctypes.create_string_buffer(64)
        n = ll.llama_token_to_piece(self.vocab_handle, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = ll.llama_token_to_piece(self.vocab_handle, token, buf, len(buf), 0, False)
        out = buf.raw[:n]
        self._piece_cache[token] = out
        return out

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(ll.llama_vocab_is_eog(self.vocab_handle, token))

    # -- forward -------------------------------------------------------------

    def decode(self, segments: Sequence[Segment], causal: bool = True) -> DecodeStatus:
        """Run one forward over all segments (one ``llama_decode``, or two:
        ``_decode``). After success, ``logits_row(output_index(seg_index, k))``
        reads the rows the segments asked for. On failure the caller must
        reconcile positions from ``pos_max`` (llama.cpp keeps ubatches that completed).

        ``causal=False`` decodes with bidirectional attention inside each
        sequence (Gemma 3's image tokens see each other). llama.cpp switches
        it for the whole context, so the caller runs such a batch alone; and
        it aborts the process when a non-causal batch is wider than one
        micro-batch, so that is refused here first.
        """
        if not causal:
            total = sum(len(s) for s in segments)
            if total > self.n_ubatch:
                raise EngineError(
                    f"a non-causal batch of {total} rows exceeds the micro-batch ({self.n_ubatch})"
                )
            ll.llama_set_causal_attn(self.ctx_handle, False)
            try:
                return self._decode_once(segments)
            finally:
                ll.llama_set_causal_attn(self.ctx_handle, True)
        return self._decode(segments)

    def _decode(self, segments: Sequence[Segment]) -> DecodeStatus:
        """One ``llama_decode``; or, beside one-token rows, the prompt pieces
        but their last tokens first (no outputs), then those last tokens with
        the one-token rows: llama.cpp runs the head once per micro-batch, and
        a piece's own logits row would cost a pass over Gemma 3's 262k-row
        head (docs/architecture.md, "Engine choices"). Only with
        batch-invariant kernels (the logits are bit-identical either way)."""
        self._dropped = []
        cut = [s.outputs == "last" and s.embd is None and len(s) > 1 for s in segments]
        joinable = any(len(s) == 1 for s in segments)  # else the tails add a micro-batch
        if not (self.share_head and self._splits and not self._hidden and joinable and any(cut)):
            return self._decode_once(segments)
        pairs = list(zip(segments, cut, strict=True))
        status = self._decode_once(
            [Segment(s.seq, s.tokens[:-1], s.pos0, "none") for s, c in pairs if c]
        )
        if not status.ok:
            return status
        self._dropped = [len(s) - 1 if c else 0 for s, c in pairs]
        return self._decode_once(
            [Segment(s.seq, s.tokens[-1:], s.pos0 + len(s) - 1) if c else s for s, c in pairs]
        )

    def _decode_once(self, segments: Sequence[Segment]) -> DecodeStatus:
        embd = any(s.embd is not None for s in segments)
        if embd and self._embd_batch is None:
            self._embd_batch = Batch(self.n_batch, self.n_seq, self.n_embd)
        batch = self._embd_batch if embd and self._embd_batch is not None else self._batch
        t0 = time.perf_counter()
        n = batch.fill(segments)
        self._last = batch
        if n == 0:
            return DecodeStatus(0)
        if self.tap is not None:
            self.tap.reset()
        t1 = time.perf_counter()
        status = int(ll.llama_decode(self.ctx_handle, batch.raw))
        timing = self.timing
        timing["fill"] += t1 - t0
        timing["decode"] += time.perf_counter() - t1
        return DecodeStatus(status)

    def micro_batches(self) -> list[list[int]]:
        """The batch rows of each micro-batch of the last ``llama_decode``, in
        the order llama.cpp computed them (each one a pass over the weights)."""
        return ubatch_rows(self._last.seqs().tolist(), self.n_ubatch, self.n_stream > 1)

    def take_taps(self) -> dict[int, np.ndarray]:
        """The layer outputs the tap captured during the last decode."""
        if self.tap is None:
            raise EngineError("this engine has no layer tap")
        try:
            return in_batch_order(self.tap.take(), self.micro_batches(), unified=self.n_stream == 1)
        except TapError as exc:
            raise EngineError(str(exc)) from exc

    def set_hidden(self, on: bool) -> None:
        """Whether the next decodes also output final hidden states.

        llama.cpp's embeddings output: with it on, EVERY row of a batch is
        an output row (logits included), whatever the segments asked; so it
        is switched on only for the forwards that want hidden states.
        """
        if on != self._hidden:
            ll.llama_set_embeddings(self.ctx_handle, on)
            self._hidden = on

    def hidden_row(self, batch_index: int) -> np.ndarray:
        """Zero-copy view of one row's final hidden state (after the output
        norm, before the output head); valid until the next decode."""
        ptr = ll.llama_get_embeddings_ith(self.ctx_handle, batch_index)
        if not ptr:
            raise EngineError(f"no hidden state for batch row {batch_index}")
        return np.ctypeslib.as_array(ptr, shape=(self.n_embd,))

    def greedy(self, batch_index: int) -> int:
        """The most likely token of one output row (the first of a tie)."""
        return int(np.argmax(self.logits_row(batch_index)))

    def logits_row(self, batch_index: int) -> np.ndarray:
        """Zero-copy view of one output row; valid until the next decode."""
        ptr = ll.llama_get_logits_ith(self.ctx_handle, batch_index)
        if not ptr:
            raise EngineError(f"no logits for batch row {batch_index}")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def output_index(self, segment_index: int, offset: int = -1) -> int:
        """Batch row of a token of the last decoded batch (offset -1 = last)."""
        if offset >= 0 and self._dropped:
            offset -= self._dropped[segment_index]  # decoded before its tail
            if offset < 0:
                raise IndexError(f"segment {segment_index} has no output row there")
        return self._last.row(segment_index, offset)

    def set_abort(self, fn: Callable[[], bool] | None) -> None:
        """Install (or remove) a check llama.cpp polls during compute."""
        if fn is None:
            self._abort_fn = None
            ll.llama_set_abort_callback(self.ctx_handle, ll.ggml_abort_callback(), None)
            return

        def _cb(_data: Any) -> bool:
            return bool(fn())

        self._abort_fn = ll.ggml_abort_callback(_cb)
        ll.llama_set_abort_callback(self.ctx_handle, self._abort_fn, None)

    # -- memory --------------------------------------------------------------

    def pos_max(self, seq: int) -> int:
        """Largest position stored for ``seq``; -1 when it holds nothing."""
        return int(ll.llama_memory_seq_pos_max(self._mem, seq))

    def pos_min(self, seq: int) -> int:
        """Smallest position stored for ``seq``; -1 when it holds nothing."""
        return int(ll.llama_memory_seq_pos_min(self._mem, seq))

    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> bool:
        return bool(ll.llama_memory_seq_rm(self._mem, seq, p0, p1))

    def seq_clear(self, seq: int) -> None:
        ll.llama_memory_seq_rm(self._mem, seq, -1, -1)

    def state_get(self, seq: int, all_cells: bool = False) -> np.ndarray:
        """One sequence's KV state as a new uint8 array (``seqstate.save``)."""
        return seqstate.save(self.ctx_handle, seq, all_cells)

    def state_set(self, seq: int, data: np.ndarray) -> bool:
        """Load a sequence's KV state; False when llama.cpp refuses it
        (``seqstate.load``: re-laid for this context's KV streams first)."""
        return seqstate.load(self.ctx_handle, seq, data, self.n_stream)

    def identity(self) -> dict[str, Any]:
        """What a saved KV state is only valid with: the model file's sha256
        (hashed once), KV cell types, state format, and the arithmetic (an
        AVX2 and an AVX-512 build round differently: a session moved between
        them could not continue as at home, so such a move is refused)."""
        return {
            "model_sha256": self.digest.hexdigest(),
            "n_layer": self.n_layer,
            "n_embd": self.n_embd,
            "n_vocab": self.n_vocab,
            "kv_type_k": "f16",
            "kv_type_v": "f16",
            "state_format": seqstate.FORMAT,
            "batch_invariant": self.cpu["batch_invariant"],
            "cpu_kernels": f"{self.cpu['level']}: {' '.join(self.cpu['features'])}",
        }

    def layout(self) -> dict[str, Any]:
        """This context's cache layout (informative: a state loads across
        lane counts and cell counts as long as the session fits a lane)."""
        return {
            "n_ctx_per_lane": self.n_ctx_per_seq,
            "kv_streams": self.n_stream,
            "swa_full": self.swa_full,
            "kv_unified": self.kv_unified,
        }
