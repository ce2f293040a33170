"""INTERIM greedy-only verification (replaced by the h41-verify branch)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weft.runtime.executor.sampler import Sampler, SamplingInputs


@dataclass
class VerifyOutput:
    tokens: list[list[int]]
    accepted: list[int]
    logprobs: torch.Tensor | None


def verify_drafts(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: Sequence[SamplingInputs],
    counts: Sequence[int],
    drafts: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None],
    want_logprobs: bool = False,
) -> VerifyOutput:
    out = sampler(logits, rows, want_logprobs)
    ids = out.next_ids.tolist()
    tokens, accepted, at = [], [], 0
    for c, d in zip(counts, drafts, strict=True):
        t = ids[at : at + c]
        a = 0
        while a < len(d) and d[a] == t[a]:
            a += 1
        tokens.append(t[: a + 1])
        accepted.append(a)
        at += c
    return VerifyOutput(tokens, accepted, out.logprobs)
