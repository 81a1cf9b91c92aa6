"""Sampling parameters as a request gives them: pure data, no llama.cpp.

``validate.get_sampling`` builds a ``SamplerSpec`` from a request's map and
``engine/sampling.py`` builds it into a llama.cpp chain. Grammars are parsed
by llama.cpp, so validation asks a ``GrammarChecker`` (the engine's) rather
than importing it: checking arguments never loads the model library.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: pick a random seed

SAMPLER_NAMES = (
    "penalties",
    "dry",
    "top_n_sigma",
    "top_k",
    "typ_p",
    "top_p",
    "min_p",
    "xtc",
    "temperature",
)
DEFAULT_SAMPLERS = SAMPLER_NAMES  # llama.cpp's common sampler order
DEFAULT_DRY_BREAKERS = ("\n", ":", '"', "*")


@dataclass(frozen=True)
class SamplerSpec:
    """Validated sampling parameters; defaults are llama.cpp's (common.h).

    Hashable and comparable: lists are tuples, ``json_schema`` is canonical
    JSON text. ``penalty_last_n`` / ``dry_penalty_last_n`` of -1 mean the
    session's whole context.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = DEFAULT_SEED
    typical_p: float = 1.0
    top_n_sigma: float = -1.0
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64
    dry_sequence_breakers: tuple[str, ...] = DEFAULT_DRY_BREAKERS
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    logit_bias: tuple[tuple[int, float], ...] = ()
    ignore_eos: bool = False
    samplers: tuple[str, ...] = DEFAULT_SAMPLERS
    grammar: str | None = None
    json_schema: str | None = None

    @property
    def penalties_active(self) -> bool:
        return (
            "penalties" in self.samplers
            and self.penalty_last_n != 0
            and (
                self.repeat_penalty != 1.0
                or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0
            )
        )

    @property
    def dry_active(self) -> bool:
        return (
            "dry" in self.samplers
            and self.dry_multiplier != 0.0
            and self.dry_base >= 1.0
            and self.dry_penalty_last_n != 0
        )

    @property
    def constrained(self) -> bool:
        return self.grammar is not None or self.json_schema is not None

    @property
    def modifies_logits(self) -> bool:
        """Anything that can move the argmax of the raw logits."""
        return bool(
            self.logit_bias
            or self.ignore_eos
            or self.constrained
            or self.penalties_active
            or self.dry_active
        )

    @property
    def greedy(self) -> bool:
        """True only when the token is exactly the argmax of the raw logits."""
        if self.modifies_logits:
            return False
        if self.temperature <= 0.0:
            return True
        if self.mirostat != 0 or self.top_k != 1 or "top_k" not in self.samplers:
            return False
        # typical and xtc may drop the most likely token before top_k sees it
        before = self.samplers[: self.samplers.index("top_k")]
        if "typ_p" in before and self.typical_p < 1.0:
            return False
        return not ("xtc" in before and self._xtc_active)

    @property
    def _xtc_active(self) -> bool:
        return self.xtc_probability > 0.0 and self.xtc_threshold <= 0.5


class GrammarChecker(Protocol):
    """What validation needs to reject a bad grammar before any work starts."""

    def grammar_error(self, text: str) -> str | None:
        """Why a GBNF grammar does not parse; None when it does."""
        ...

    def schema_error(self, schema_json: str) -> str | None:
        """Why a JSON schema cannot become a grammar; None when it can."""
        ...


def canonical_schema(schema: dict[str, Any]) -> str:
    """Compact JSON text of a schema, keys in the schema's own order: the
    order of ``properties`` is the order the grammar writes them (as in
    OpenAI's structured outputs; a forced tool call relies on ``name``
    coming before ``arguments``), so two orders are two schemas."""
    return json.dumps(schema, separators=(",", ":"))


def spec_to_wire(spec: SamplerSpec) -> dict[str, Any]:
    """The request-side ``sampling`` map that ``validate.get_sampling`` turns
    back into an equal spec (how a session's sampler travels in a saved state)."""
    out: dict[str, Any] = {}
    for name in SamplerSpec.__dataclass_fields__:
        value = getattr(spec, name)
        if value is None:
            continue
        if name == "logit_bias":
            value = [{"token": t, "bias": b} for t, b in value]
        elif name == "json_schema":
            value = json.loads(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[name] = value
    return out
