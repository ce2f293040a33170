"""RequestLimits: the per-request caps the front enforces before any work is queued (top logprobs, n)."""

from __future__ import annotations

from dataclasses import dataclass

from weft.runtime.server.generate_input import PromptSpec


@dataclass(frozen=True)
class RequestLimits:
    """Caps on what one request may ask for; None is no cap (the offline Engine's default).

    `weft serve` sets them from --max-top-logprobs and --max-n: top logprobs cost a
    (positions x k) table in the reply (k up to the vocabulary, e.g. 49,152 entries per prompt
    token with input logprobs), and each of n samples is a sequence of its own in the batch."""

    max_top_logprobs: int | None = None
    max_n: int | None = None

    def __post_init__(self) -> None:
        if self.max_top_logprobs is not None and self.max_top_logprobs < 0:
            raise ValueError(f"max_top_logprobs must be >= 0, got {self.max_top_logprobs}")
        if self.max_n is not None and self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")

    def check_top_logprobs(self, value: int, name: str) -> None:
        cap = self.max_top_logprobs
        if cap is not None and value > cap:
            raise ValueError(
                f"{name} is {value}, more than this server's limit of {cap} "
                "(set by weft serve --max-top-logprobs)"
            )

    def check_n(self, value: int, name: str = "n") -> None:
        cap = self.max_n
        if cap is not None and value > cap:
            raise ValueError(
                f"{name} is {value}, more than this server's limit of {cap} "
                "(set by weft serve --max-n)"
            )

    def check(self, spec: PromptSpec) -> None:
        """A native request's prompt: its top_logprobs_num and sampling_params.n."""
        self.check_top_logprobs(spec.top_logprobs_num, "top_logprobs_num")
        self.check_n(spec.params.n, "sampling_params.n")
