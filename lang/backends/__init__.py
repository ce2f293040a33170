"""DSL backends: in-process Engine, native HTTP endpoint, OpenAI-compatible servers, a fake."""

from __future__ import annotations

from weft.lang.backends.base import (
    Backend,
    BackendError,
    Completion,
    Context,
    GenRequest,
    SelectRequest,
    StreamDelta,
)
from weft.lang.backends.engine import EngineBackend
from weft.lang.backends.fake import FakeBackend
from weft.lang.backends.openai import OpenAI
from weft.lang.backends.runtime_endpoint import RuntimeEndpoint

__all__ = [
    "Backend",
    "BackendError",
    "Completion",
    "Context",
    "EngineBackend",
    "FakeBackend",
    "GenRequest",
    "OpenAI",
    "RuntimeEndpoint",
    "SelectRequest",
    "StreamDelta",
]
