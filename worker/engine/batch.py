"""Filling one reusable ``llama_batch`` from segments, and what decoding it said.

A segment is a run of consecutive tokens of one sequence (lane). The batch
is allocated once at ``n_batch`` capacity; its token/pos/logits arrays are
written through numpy views so a 512-token chunk costs a few slice writes,
not 512 ctypes calls. Only ``seq_id`` (an array of pointers) needs a loop,
and we skip rows whose lane did not change since the last fill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import llama_cpp as ll
import numpy as np

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
        self._starts = []
        self._lens = []
        seq_ptrs = self.raw.seq_id
        for seg in segments:
            n = len(seg)
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
            self._starts.append(row)
            self._lens.append(n)
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

    def describe(self) -> str:
        return {
            0: "ok",
            1: "no KV slot for the batch (context full)",
            2: "aborted",
            -1: "invalid input batch",
        }.get(self.code, f"fatal error {self.code}")
