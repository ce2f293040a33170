"""GrammarError: a grammar spec refused with its reason (an HTTP 400 at the server)."""

from __future__ import annotations

from collections.abc import Sequence

# appended to a refusal that only the request's own strict flag caused
STRICT_NOTE = " (strict is true: such keywords are refused, not left unenforced)"


class GrammarError(ValueError):
    """A refused spec (becomes an HTTP 400). `keywords` names unsupported schema keywords, if any."""

    def __init__(self, message: str, keywords: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.keywords = tuple(keywords)


# What a grammar backend may raise that ends its grammar, never the process: everything but the
# interpreter's own exits (a Rust panic arrives as pyo3's PanicException, a BaseException).
PROCESS_EXITS = (KeyboardInterrupt, SystemExit, GeneratorExit)


def failure_text(e: BaseException) -> str:
    """A backend failure in a few words: a GrammarError's message, else its type and message."""
    if isinstance(e, GrammarError):
        return str(e)
    text = " ".join(str(e).split())[:300]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
