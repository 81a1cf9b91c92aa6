"""Sampler chains over llama.cpp's sampler API.

Greedy sampling does not go through llama.cpp at all: an ``argmax`` over the
zero-copy logits row is exact (first maximum, like llama.cpp's greedy
sampler) and avoids building a 262k-entry candidate array per token.
Anything else builds a llama.cpp chain once per session; the chain holds the
RNG, the penalty history and the grammar state, so a seeded session
reproduces its tokens across ops.

The chain mirrors llama.cpp's common sampler (common/sampling.cpp):
``logit_bias`` (user biases, plus -inf on every end-of-generation token with
``ignore_eos``), then the ``samplers`` in order, then ``dist(seed)``. The
grammar (GBNF, or a JSON schema converted to GBNF) sits beside the chain as
in llama.cpp: a token is sampled without it and, only when the grammar
rejects it, sampled again with the grammar applied first. Differences:

- ``temperature <= 0``: only the logit modifiers (bias, grammar, penalties,
  dry) run, then ``greedy``; truncation samplers, xtc and mirostat are
  skipped.
- ``mirostat`` 1/2: penalties and dry (when enabled and listed in
  ``samplers``) still run before ``temp`` + mirostat; llama.cpp drops them.
- When no candidate survives (the grammar against ``logit_bias`` or
  ``ignore_eos``) ``sample`` raises ``SamplerError`` instead of letting
  llama.cpp's grammar abort the process.

Only sampled tokens are accepted into the session's history (penalties, dry,
grammar, mirostat). Prompt tokens are not, unless the caller feeds them with
``Sampler.accept`` (penalties and dry only).

The grammar checks (JSON schema -> GBNF, nesting and parse checks,
``LlamaGrammars``) and ``SamplerError`` are in ``grammar.py``.
"""

from __future__ import annotations

import ctypes
import math
import weakref
from collections.abc import Iterable
from typing import Any

import llama_cpp as ll
import numpy as np

from ..spec import SamplerSpec
from .grammar import (
    SamplerError,
    _init_grammar,
    schema_to_grammar,
)
from .model import Engine

# -- per-engine data ------------------------------------------------------------


_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


class _EngineData:
    """Shared by all samplers of one engine (one thread uses them)."""

    def __init__(self, engine: Engine) -> None:
        assert _TOKEN_DATA.itemsize == ctypes.sizeof(ll.llama_token_data)
        n = engine.n_vocab
        self.ids = np.arange(n, dtype=np.int32)
        self.candidates = np.zeros(n, dtype=_TOKEN_DATA)
        self.array = ll.llama_token_data_array(
            self.candidates.ctypes.data_as(ll.llama_token_data_p), n, -1, False
        )
        self._eog: tuple[int, ...] | None = None
        self._vocab = engine.vocab_handle
        self._n = n

    @property
    def eog_tokens(self) -> tuple[int, ...]:
        if self._eog is None:
            is_eog = ll.llama_vocab_is_eog
            vocab = self._vocab
            self._eog = tuple(t for t in range(self._n) if is_eog(vocab, t))
        return self._eog


_engine_data: weakref.WeakKeyDictionary[Engine, _EngineData] = weakref.WeakKeyDictionary()


def _data_for(engine: Engine) -> _EngineData:
    data = _engine_data.get(engine)
    if data is None:
        data = _engine_data[engine] = _EngineData(engine)
    return data


def eog_tokens(engine: Engine) -> tuple[int, ...]:
    """Every end-of-generation token of the engine's vocabulary (cached)."""
    return _data_for(engine).eog_tokens


# -- the chain ------------------------------------------------------------------


class Sampler:
    """A llama.cpp sampler chain bound to one session.

    Raises ``SamplerError`` when the spec cannot be built (invalid grammar,
    a ``logit_bias`` token outside the vocabulary).
    """

    def __init__(self, engine: Engine, spec: SamplerSpec) -> None:
        self.spec = spec
        self._engine = engine
        self._data = _data_for(engine)
        self._history: list[Any] = []  # penalties / dry: fed by ``accept``
        self._grammar: Any = None  # beside the chain, as in llama.cpp's common sampler
        self._one = ll.llama_token_data()
        # What replays this chain's state on another worker (``state`` /
        # ``restore``): tokens fed to the penalty history, tokens the grammar
        # accepted, and how many times the chain ran (each run of a ``dist``
        # chain draws once from its RNG, whatever the candidates).
        self._fed: list[int] = []
        self._grammar_fed: list[int] = []
        self._runs = 0
        self._dist: Any = None
        params = ll.llama_sampler_chain_default_params()
        params.no_perf = True
        self._chain: Any = ll.llama_sampler_chain_init(params)
        try:
            self._build(spec)
        except BaseException:
            self.free()
            raise

    def _add(self, smpl: Any) -> Any:
        if not smpl:
            raise SamplerError("llama.cpp could not create a sampler")
        ll.llama_sampler_chain_add(self._chain, smpl)
        return smpl

    def _build(self, spec: SamplerSpec) -> None:
        engine = self._engine
        n_vocab = engine.n_vocab
        if spec.greedy:
            self._add(ll.llama_sampler_init_greedy())
            return
        biases = list(spec.logit_bias)
        for token, _ in biases:
            if not 0 <= token < n_vocab:
                raise SamplerError(
                    f"sampling.logit_bias token {token} is outside the vocabulary [0, {n_vocab})"
                )
        if spec.ignore_eos:
            biases.extend((t, float("-inf")) for t in self._data.eog_tokens)
        if biases:
            arr = (ll.llama_logit_bias * len(biases))()
            for i, (token, bias) in enumerate(biases):
                arr[i] = ll.llama_logit_bias(token, bias)
            self._add(ll.llama_sampler_init_logit_bias(n_vocab, len(biases), arr))
        if spec.constrained:
            text = spec.grammar
            if text is None:
                assert spec.json_schema is not None
                text = schema_to_grammar(spec.json_schema)
            ptr, why = _init_grammar(engine.vocab_handle, text)
            if not ptr:
                field_name = "grammar" if spec.grammar is not None else "json_schema"
                raise SamplerError(f"sampling.{field_name} is not a valid grammar: {why}")
            self._grammar = ptr

        seed = spec.seed
        if spec.temperature <= 0.0:
            for name in spec.samplers:
                if name in ("penalties", "dry"):
                    self._add_named(name, spec)
            self._add(ll.llama_sampler_init_greedy())
        elif spec.mirostat:
            for name in spec.samplers:
                if name in ("penalties", "dry"):
                    self._add_named(name, spec)
            self._add(ll.llama_sampler_init_temp(spec.temperature))
            if spec.mirostat == 1:
                self._add(
                    ll.llama_sampler_init_mirostat(
                        n_vocab, seed, spec.mirostat_tau, spec.mirostat_eta, 100
                    )
                )
            else:
                self._add(
                    ll.llama_sampler_init_mirostat_v2(seed, spec.mirostat_tau, spec.mirostat_eta)
                )
        else:
            for name in spec.samplers:
                self._add_named(name, spec)
            self._dist = self._add(ll.llama_sampler_init_dist(seed))

    def _add_named(self, name: str, spec: SamplerSpec) -> None:
        """Add one sampler of the ``samplers`` list; exact no-ops are skipped."""
        n_ctx = self._engine.n_ctx_per_seq
        if name == "penalties":
            if spec.penalties_active:
                last_n = n_ctx if spec.penalty_last_n < 0 else spec.penalty_last_n
                self._history.append(
                    self._add(
                        ll.llama_sampler_init_penalties(
                            self._engine.n_vocab,
                            last_n,
                            spec.repeat_penalty,
                            spec.frequency_penalty,
                            spec.presence_penalty,
                        )
                    )
                )
        elif name == "dry":
            if spec.dry_active:
                last_n = n_ctx if spec.dry_penalty_last_n < 0 else spec.dry_penalty_last_n
                raw = [b.encode("utf-8") for b in spec.dry_sequence_breakers]
                breakers = (ctypes.c_char_p * max(len(raw), 1))(*raw)
                self._history.append(
                    self._add(
                        ll.llama_sampler_init_dry(
                            self._engine.vocab_handle,
                            spec.dry_multiplier,
                            spec.dry_base,
                            spec.dry_allowed_length,
                            last_n,
                            breakers,
                            len(raw),
                        )
                    )
                )
        elif name == "top_n_sigma":
            if spec.top_n_sigma > 0.0:
                self._add(ll.llama_sampler_init_top_n_sigma(spec.top_n_sigma))
        elif name == "top_k":
            if spec.top_k > 0:
                self._add(ll.llama_sampler_init_top_k(spec.top_k))
        elif name == "typ_p":
            if spec.typical_p < 1.0:
                self._add(ll.llama_sampler_init_typical(spec.typical_p, 1))
        elif name == "top_p":
            if spec.top_p < 1.0:
                self._add(ll.llama_sampler_init_top_p(spec.top_p, 1))
        elif name == "min_p":
            if spec.min_p > 0.0:
                self._add(ll.llama_sampler_init_min_p(spec.min_p, 1))
        elif name == "xtc":
            if spec._xtc_active:
                self._add(
                    ll.llama_sampler_init_xtc(
                        spec.xtc_probability, spec.xtc_threshold, 1, spec.seed
                    )
                )
        elif name == "temperature":
            self._add(
                ll.llama_sampler_init_temp_ext(
                    spec.temperature, spec.dynatemp_range, spec.dynatemp_exponent
                )
            )
        else:
            raise SamplerError(f"sampling.samplers: unknown sampler {name!r}")

    def sample(self, batch_row: int) -> int:
        """Sample from a row of the last batch; the chain accepts the token.

        With a grammar, llama.cpp's common-sampler shortcut: sample without
        it, and only when the grammar rejects that token apply the grammar
        to the whole vocabulary and sample again (the expensive path).
        """
        if self.spec.greedy:
            return self._engine.greedy(batch_row)
        logits = self._engine.logits_row(batch_row)
        token = self._run(logits, grammar_first=False)
        if self._grammar is not None and not self._grammar_allows(token, logits):
            token = self._run(logits, grammar_first=True)
        if self._grammar is not None:
            ll.llama_sampler_accept(self._grammar, token)
            self._grammar_fed.append(token)
        ll.llama_sampler_accept(self._chain, token)
        self._fed.append(token)
        return token

    def _run(self, logits: np.ndarray, grammar_first: bool) -> int:
        data = self._data
        cand = data.candidates
        cand["id"] = data.ids
        cand["logit"] = logits
        cand["p"] = 0.0
        arr = data.array
        arr.data = cand.ctypes.data_as(ll.llama_token_data_p)  # type: ignore[assignment]
        arr.size = len(cand)
        arr.selected = -1
        arr.sorted = False
        if grammar_first:
            ll.llama_sampler_apply(self._grammar, ctypes.byref(arr))
        ll.llama_sampler_apply(self._chain, ctypes.byref(arr))
        self._runs += 1
        index = int(arr.selected)
        if not 0 <= index < arr.size:
            raise SamplerError("the sampler chain selected no token")
        chosen = arr.data[index]
        if math.isnan(chosen.logit) or chosen.logit == float("-inf"):
            # every candidate was excluded (grammar vs. logit_bias / ignore_eos);
            # accepting it would abort inside llama.cpp's grammar.
            raise SamplerError("no token satisfies the grammar and logit_bias of sampling")
        return int(chosen.id)

    def _grammar_allows(self, token: int, logits: np.ndarray, index: int | None = None) -> bool:
        one = self._one
        one.id = token  # type: ignore[assignment]
        one.logit = float(logits[token if index is None else index])
        one.p = 0.0
        arr = ll.llama_token_data_array(ctypes.pointer(one), 1, -1, False)
        ll.llama_sampler_apply(self._grammar, ctypes.byref(arr))
        return bool(arr.data[0].logit != float("-inf"))

    def accept(self, tokens: Iterable[int]) -> None:
        """Feed tokens the chain did not sample (e.g. a prompt) into the
        penalty and dry history; the grammar and RNG are untouched."""
        toks = [int(t) for t in tokens]
        for smpl in self._history:
            for token in toks:
                ll.llama_sampler_accept(smpl, token)
        self._fed.extend(toks)

    @property
    def portable(self) -> bool:
        """Whether ``state`` captures everything: a ``dist`` chain without
        mirostat (its running estimate) or xtc (its own RNG)."""
        return self._dist is not None and not self.spec.mirostat and not self.spec._xtc_active

    def state(self) -> dict[str, Any]:
        """The chain's state as plain data (``portable`` chains only)."""
        return {"fed": list(self._fed), "grammar_fed": list(self._grammar_fed), "runs": self._runs}

    def restore(self, fed: Iterable[int], grammar_fed: Iterable[int], runs: int) -> None:
        """Bring a fresh chain to a saved ``state``: replay the penalty and
        grammar history, and advance the RNG by as many draws."""
        toks = [int(t) for t in fed]
        for smpl in self._history:
            for token in toks:
                ll.llama_sampler_accept(smpl, token)
        self._fed = toks
        if self._grammar is not None:
            zero = np.zeros(1, dtype=np.float32)
            for token in grammar_fed:
                # llama.cpp aborts the process on a token its grammar rejects
                if not self._grammar_allows(int(token), zero, 0):
                    raise SamplerError(f"grammar state: token {int(token)} is not allowed")
                ll.llama_sampler_accept(self._grammar, int(token))
                self._grammar_fed.append(int(token))
        if self._dist is not None:
            one = ll.llama_token_data(0, 0.0, 0.0)
            arr = ll.llama_token_data_array(ctypes.pointer(one), 1, -1, False)
            for _ in range(runs):
                arr.size = 1
                ll.llama_sampler_apply(self._dist, ctypes.byref(arr))
        self._runs = runs

    def free(self) -> None:
        if self._chain:
            ll.llama_sampler_free(self._chain)
            self._chain = None
        if self._grammar is not None:
            ll.llama_sampler_free(self._grammar)
            self._grammar = None
            self._history = []
