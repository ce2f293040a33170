"""weft: a structured-generation runtime with a frontend DSL (public face: re-exports only)."""

from __future__ import annotations

from weft.runtime.config import EngineConfig
from weft.runtime.engine import Engine
from weft.runtime.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["Engine", "EngineConfig", "SamplingParams", "__version__"]
