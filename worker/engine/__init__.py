"""The only package that imports ``llama_cpp``; see ``model.Engine``."""

from . import kernels
from .batch import DecodeStatus, OutputMode, Segment
from .grammar import LlamaGrammars, SamplerError
from .load import EngineConfig, EngineError
from .model import Engine
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
