"""Sampler chains over llama.cpp's sampler API.

Greedy sampling does not go through llama.cpp at all: an ``argmax`` over the
zero-copy logits row is exact (first maximum, like llama.cpp's greedy
sampler) and avoids building a 262k-entry candidate array per token.
Anything stochastic builds a llama.cpp chain once per session; the chain
holds the RNG, so a seeded session reproduces its tokens across ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import llama_cpp as ll
import numpy as np

from .model import Engine

DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: pick a random seed


@dataclass(frozen=True)
class SamplerSpec:
    """Validated sampling parameters; defaults are llama.cpp's."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = DEFAULT_SEED

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


def greedy_token(engine: Engine, batch_row: int) -> int:
    return int(np.argmax(engine.logits_row(batch_row)))


class Sampler:
    """A llama.cpp sampler chain bound to one session."""

    def __init__(self, engine: Engine, spec: SamplerSpec) -> None:
        self.spec = spec
        self._engine = engine
        params = ll.llama_sampler_chain_default_params()
        params.no_perf = True
        self._chain = ll.llama_sampler_chain_init(params)
        if spec.greedy:
            ll.llama_sampler_chain_add(self._chain, ll.llama_sampler_init_greedy())
            return
        if spec.top_k > 0:
            ll.llama_sampler_chain_add(self._chain, ll.llama_sampler_init_top_k(spec.top_k))
        if spec.top_p < 1.0:
            ll.llama_sampler_chain_add(self._chain, ll.llama_sampler_init_top_p(spec.top_p, 1))
        if spec.min_p > 0.0:
            ll.llama_sampler_chain_add(self._chain, ll.llama_sampler_init_min_p(spec.min_p, 1))
        ll.llama_sampler_chain_add(self._chain, ll.llama_sampler_init_temp(spec.temperature))
        ll.llama_sampler_chain_add(self._chain, ll.llama_sampler_init_dist(spec.seed))

    def sample(self, batch_row: int) -> int:
        """Sample from a row of the last batch; the chain accepts the token."""
        if self.spec.greedy:
            return greedy_token(self._engine, batch_row)
        return int(ll.llama_sampler_sample(self._chain, self._engine.ctx_handle, batch_row))

    def free(self) -> None:
        if self._chain:
            ll.llama_sampler_free(self._chain)
            self._chain = None
