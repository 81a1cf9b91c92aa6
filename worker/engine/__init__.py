"""The only package that imports ``llama_cpp``; see ``model.Engine``."""

from . import kernels
from .batch import DecodeStatus, OutputMode, Segment
from .grammar import LlamaGrammars, SamplerError
from .model import Engine, EngineConfig, EngineError
from .sampling import Sampler

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
    "kernels",
]
