"""select's choices methods: pure functions from each choice's token logprobs to a decision."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# (logprob | None, token id, token text | None): SGLang's logprob entry
LogprobEntry = tuple[float | None, int, str | None]


@dataclass(frozen=True)
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


class ChoicesMethod(ABC):
    """Decides a select() from the logprobs of each choice's tokens given the prompt.

    `input_token_logprobs[i]` covers exactly the tokens of choice i (a leading None, for a
    token with no context, is skipped); `unconditional_token_logprobs[i]` the same tokens
    scored without the prompt (only for methods that set `requires_unconditional_logprobs`)."""

    requires_unconditional_logprobs = False

    @abstractmethod
    def __call__(
        self,
        *,
        choices: Sequence[str],
        normalized_prompt_logprobs: Sequence[float],
        input_token_logprobs: Sequence[Sequence[LogprobEntry]],
        output_token_logprobs: Sequence[Sequence[LogprobEntry]],
        unconditional_token_logprobs: Sequence[Sequence[LogprobEntry]] | None = None,
    ) -> ChoicesDecision: ...


class TokenLengthNormalized(ChoicesMethod):
    """The choice with the highest mean token logprob (the default)."""

    def __call__(
        self,
        *,
        choices: Sequence[str],
        normalized_prompt_logprobs: Sequence[float],
        input_token_logprobs: Sequence[Sequence[LogprobEntry]],
        output_token_logprobs: Sequence[Sequence[LogprobEntry]],
        unconditional_token_logprobs: Sequence[Sequence[LogprobEntry]] | None = None,
    ) -> ChoicesDecision:
        best = argmax_first(normalized_prompt_logprobs)
        return ChoicesDecision(
            choices[best],
            _meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs),
        )


class GreedyTokenSelection(ChoicesMethod):
    """Compare token by token: keep the choices with the best logprob at each position until
    one is left (shorter choices are padded with their own mean)."""

    def __call__(
        self,
        *,
        choices: Sequence[str],
        normalized_prompt_logprobs: Sequence[float],
        input_token_logprobs: Sequence[Sequence[LogprobEntry]],
        output_token_logprobs: Sequence[Sequence[LogprobEntry]],
        unconditional_token_logprobs: Sequence[Sequence[LogprobEntry]] | None = None,
    ) -> ChoicesDecision:
        rows = [values(entries) for entries in input_token_logprobs]
        width = max((len(r) for r in rows), default=0)
        matrix = [r + [mean(r)] * (width - len(r)) for r in rows]
        remaining = list(range(len(choices)))
        for col in range(width):
            best = max(matrix[i][col] for i in remaining)
            remaining = [i for i in remaining if matrix[i][col] == best]
            if len(remaining) == 1:
                break
        meta = _meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        return ChoicesDecision(choices[remaining[0]], meta)


class UnconditionalLikelihoodNormalized(ChoicesMethod):
    """The choice whose tokens gain the most from the prompt: mean(conditional - unconditional)
    per token; the first unconditional logprob (no context) counts as 0."""

    requires_unconditional_logprobs = True

    def __call__(
        self,
        *,
        choices: Sequence[str],
        normalized_prompt_logprobs: Sequence[float],
        input_token_logprobs: Sequence[Sequence[LogprobEntry]],
        output_token_logprobs: Sequence[Sequence[LogprobEntry]],
        unconditional_token_logprobs: Sequence[Sequence[LogprobEntry]] | None = None,
    ) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional logprobs")
        scores = []
        for i, (cond, uncond) in enumerate(
            zip(input_token_logprobs, unconditional_token_logprobs, strict=True)
        ):
            c = [e[0] for e in cond]
            u = [0.0 if e[0] is None else e[0] for e in uncond]
            if len(c) != len(u):
                raise ValueError(
                    f"choice {choices[i]!r}: {len(c)} conditional but {len(u)} "
                    "unconditional logprobs"
                )
            diffs = [a - b for a, b in zip(c, u, strict=True) if a is not None]
            scores.append(mean(diffs))
        meta = _meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["unconditional_token_logprobs"] = [list(u) for u in unconditional_token_logprobs]
        meta["normalized_unconditional_prompt_logprobs"] = scores
        return ChoicesDecision(choices[argmax_first(scores)], meta)


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()


def values(entries: Sequence[LogprobEntry]) -> list[float]:
    """The logprobs of the entries, skipping None (a token scored without any context)."""
    return [e[0] for e in entries if e[0] is not None]


def mean(xs: Sequence[float]) -> float:
    """The mean; -inf for no values (a choice that cannot be scored never wins a comparison)."""
    return sum(xs) / len(xs) if xs else -math.inf


def normalized_logprob(entries: Sequence[LogprobEntry]) -> float:
    """The token-length-normalized logprob of one choice."""
    return mean(values(entries))


def argmax_first(xs: Sequence[float]) -> int:
    """Index of the maximum; ties go to the first."""
    best = 0
    for i, x in enumerate(xs):
        if x > xs[best]:
            best = i
    return best


def _meta(
    normalized: Sequence[float],
    input_lps: Sequence[Sequence[LogprobEntry]],
    output_lps: Sequence[Sequence[LogprobEntry]],
) -> dict[str, Any]:
    return {
        "normalized_prompt_logprobs": list(normalized),
        "input_token_logprobs": [list(e) for e in input_lps],
        "output_token_logprobs": [list(e) for e in output_lps],
    }
