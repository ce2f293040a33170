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
