"""weft: a structured-generation runtime with a frontend DSL (public face: re-exports only)."""

from __future__ import annotations

__version__ = "0.1.0"
