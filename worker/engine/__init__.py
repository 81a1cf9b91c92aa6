"""The only package that imports ``llama_cpp``; see ``model.Engine``."""

from .batch import OutputMode, Segment
from .model import ROW_INVARIANT_ROWS, DecodeStatus, Engine, EngineConfig, EngineError
from .sampling import DEFAULT_SEED, Sampler, SamplerError, SamplerSpec, greedy_token

__all__ = [
    "DEFAULT_SEED",
    "ROW_INVARIANT_ROWS",
    "DecodeStatus",
    "Engine",
    "EngineConfig",
    "EngineError",
    "OutputMode",
    "Sampler",
    "SamplerError",
    "SamplerSpec",
    "Segment",
    "greedy_token",
]
