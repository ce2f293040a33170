"""The backend interface the interpreter talks to, and the request/result records it passes."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from weft.lang.chat_template import ChatTemplate
from weft.lang.choices import ChoicesDecision, ChoicesMethod
from weft.lang.params import SamplingArgs


class BackendError(RuntimeError):
    """A request to the model failed (the server's status and message are in the text)."""


@dataclass(frozen=True)
class Context:
    """Where the program is: its text, the finished messages, and the open role if any."""

    text: str
    messages: tuple[dict[str, str], ...] = ()
    role: str | None = None
    turn_text: str = ""  # text of the open role so far ("" right after it began)


@dataclass(frozen=True)
class GenRequest:
    ctx: Context
    args: SamplingArgs


@dataclass(frozen=True)
class SelectRequest:
    ctx: Context
    choices: tuple[str, ...]
    temperature: float
    method: ChoicesMethod
    lora: str | None = None  # the LoRA adapter to score under (None: the base model)


@dataclass(frozen=True)
class Completion:
    text: str
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StreamDelta:
    """New text of a streamed gen; `meta_info` is the latest (cumulative) meta, when known."""

    text: str
    meta_info: dict[str, Any] | None = None


class Backend(ABC):
    """What runs a program's model calls. Every method may be called from several threads."""

    @abstractmethod
    def chat_template(self) -> ChatTemplate:
        """The role prefixes/suffixes of the model's chat template."""

    @abstractmethod
    def generate(self, req: GenRequest) -> list[Completion]:
        """`req.args.n` completions of the program text (stop strings already trimmed)."""

    @abstractmethod
    def generate_stream(self, req: GenRequest) -> Iterator[StreamDelta]:
        """One completion (n == 1) as text increments; the last delta carries the final meta."""

    @abstractmethod
    def select(self, req: SelectRequest) -> ChoicesDecision:
        """Score every choice as a continuation of the program text and let the method decide."""

    @abstractmethod
    def cache_prefix(self, text: str, lora: str | None = None) -> None:
        """Prefill `text` (no generation) so later requests that start with it hit the cache
        (under the LoRA adapter `lora`: each adapter has its own cached prefixes)."""

    @abstractmethod
    def flush_cache(self) -> bool:
        """Empty the server's prefix cache; False when it cannot (busy, or no such thing)."""

    @abstractmethod
    def get_server_info(self) -> dict[str, Any]:
        """What the server says about itself."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook: most backends own nothing
        """Release what the backend owns (an engine it started); safe to call twice."""
