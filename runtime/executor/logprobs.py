"""Logprob extraction: chosen-token, top-k and requested-id logprobs from log-distributions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

Entry = tuple[float, int]  # (logprob, token id)


class LogprobRows(NamedTuple):
    """The hidden rows of one request whose logits give its prompt logprobs in this step."""

    req_index: int
    hidden_rows: list[int]
    targets: list[int]  # the prompt token each row predicts
    first_is_none: bool  # the chunk starts at prompt token 0, whose logprob is None


def gather_logprobs(
    logprobs: torch.Tensor,  # [K, V] log-distributions
    targets: Sequence[int],  # [K] token whose logprob is wanted per row
    top_k: int,
    token_ids: Sequence[int],
) -> tuple[list[Entry], list[list[Entry]], list[list[Entry]]]:
    """Per row: (logprob of target, top_k (logprob, id) best first, logprobs of token_ids)."""
    k = logprobs.shape[0]
    tgt = torch.tensor(list(targets), dtype=torch.int64, device=logprobs.device)
    chosen_lp = logprobs[torch.arange(k, device=logprobs.device), tgt].tolist()
    chosen = [(float(lp), int(t)) for lp, t in zip(chosen_lp, targets, strict=True)]
    top: list[list[Entry]] = [[] for _ in range(k)]
    if top_k > 0:
        vals, idx = logprobs.topk(min(top_k, logprobs.shape[1]), dim=-1)
        top = [
            [(float(v), int(i)) for v, i in zip(vr, ir, strict=True)]
            for vr, ir in zip(vals.tolist(), idx.tolist(), strict=True)
        ]
    by_id: list[list[Entry]] = [[] for _ in range(k)]
    if token_ids:
        ids = list(token_ids)
        picked = logprobs[:, torch.tensor(ids, dtype=torch.int64, device=logprobs.device)].tolist()
        by_id = [[(float(v), t) for v, t in zip(row, ids, strict=True)] for row in picked]
    return chosen, top, by_id
