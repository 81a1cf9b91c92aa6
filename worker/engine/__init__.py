"""The only package that imports ``llama_cpp``; see ``model.Engine``."""

from . import kernels
from .batch import OutputMode, Segment
from .model import DecodeStatus, Engine, EngineConfig, EngineError
from .sampling import LlamaGrammars, Sampler, SamplerError, greedy_token

__all__ = [
    "DecodeStatus",
    "Engine",
    "EngineConfig",
    "EngineError",
    "LlamaGrammars",
    "OutputMode",
    "Sampler",
    "SamplerError",
    "Segment",
    "greedy_token",
    "kernels",
]
