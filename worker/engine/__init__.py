"""The only package that imports ``llama_cpp``; see ``model.Engine``."""

from . import kernels
from .grammar import LlamaGrammars, SamplerError
from .load import EngineConfig, EngineError
from .model import DecodeStatus, Engine, OutputMode, Segment
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
