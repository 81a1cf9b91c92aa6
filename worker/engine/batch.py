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
        self.n_embd = n_embd
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


def ubatch_rows(seqs: Sequence[int], n_ubatch: int, per_lane_streams: bool) -> list[list[int]]:
    """The batch rows of each micro-batch llama.cpp computes, in its order.

    A unified KV cache splits a batch into runs of ``n_ubatch`` rows in batch
    order. A cache with one stream per lane needs each micro-batch to hold
    the same number of rows of each lane, lanes of consecutive ids, a lane's
    rows together (``llama_batch_allocr::split_equal(n_ubatch, sequential=
    true)``): rows come out of batch order. Logits are mapped back by
    llama.cpp; a layer tap (``tap.py``) sees graph rows and is mapped back
    with this. It mirrors llama.cpp's code, so the engine checks its result
    against the captures' sizes (``Engine.take_taps``).
    """
    n = len(seqs)
    if not per_lane_streams or all(s == seqs[0] for s in seqs):
        # one lane's rows (a prompt piece, a stage's single stream) split as a
        # unified cache splits: runs of n_ubatch in batch order
        return [list(range(i, min(i + n_ubatch, n))) for i in range(0, n, n_ubatch)]
    rows_of: dict[int, list[int]] = {}
    for i, s in enumerate(seqs):
        rows_of.setdefault(int(s), []).append(i)
    taken = dict.fromkeys(rows_of, 0)
    used = [False] * n
    left = n
    out: list[list[int]] = []
    while left:
        lanes: list[int] = []
        for i in range(n):
            s = int(seqs[i])
            if used[i] or s in lanes or (lanes and s != lanes[-1] + 1):
                continue
            lanes.append(s)
            if len(lanes) > n_ubatch:
                break
        per: list[list[int]] = [[] for _ in lanes]
        while all(taken[s] < len(rows_of[s]) for s in lanes):
            for k, s in enumerate(lanes):
                i = rows_of[s][taken[s]]
                per[k].append(i)
                used[i] = True
                taken[s] += 1
                left -= 1
            if (len(per[0]) + 1) * len(lanes) > n_ubatch:
                break
        out.append([i for rows in per for i in rows])
    return out
