"""Speculative verification: target logits at drafted positions -> accepted tokens (batched)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weft.runtime.executor.sampler import Sampler, SamplingInputs, argmax, argmax_only
from weft.runtime.executor.transfer import to_device


@dataclass
class VerifyOutput:
    # per request: the accepted draft tokens, then one more (the target's correction or bonus
    # token): 1..d_i+1 tokens
    tokens: list[list[int]]
    accepted: list[int]  # per request: how many draft tokens were accepted (len(tokens[i]) - 1)
    # float32 [R, V]: per verified row, what Sampler returns as logprobs (log of the distribution
    # drawn from before truncation; greedy rows at temperature 1); None unless want_logprobs
    logprobs: torch.Tensor | None


def verify_drafts(
    sampler: Sampler,
    logits: torch.Tensor,  # [R, V'] with V' >= vocab_size: the target's logits, masks applied
    rows: Sequence[SamplingInputs],  # [R]: row j of request i sees output + drafts[i][:j]
    counts: Sequence[int],  # per request: d_i + 1 consecutive rows
    drafts: Sequence[Sequence[int]],  # per request: its d_i draft tokens
    # per request: q [>= d_i, >= V] (its first d_i rows and V columns are read; columns past V
    # must hold no mass), or None: deterministic drafts (q one-hot at each draft token)
    draft_probs: Sequence[torch.Tensor | None],
    want_logprobs: bool = False,
) -> VerifyOutput:
    """The tokens each request keeps after one verify forward of the target over its drafts.

    Greedy requests (SamplingInputs.picks_argmax) accept drafts while each equals the argmax of
    its row's processed logits, then emit the argmax of the first row that disagrees (or of the
    last row): the tokens the Sampler gives row by row. Sampled requests use speculative
    rejection sampling (Leviathan et al. 2023, Chen et al. 2023): draft x_j is accepted with
    probability min(1, p_j(x_j) / q_j(x_j)), with p_j the Sampler's truncated distribution at row
    j; the first rejection emits a draw from norm(max(p_j - q_j, 0)) (p_j where that is all 0),
    and a request that accepts all its drafts emits a bonus draw from p_{d_i}. Every emitted
    token is then distributed as the Sampler would draw it.

    Randomness: a sampled request with drafts takes d_i uniforms, then the one draw (the
    Sampler's exponential race over the vocabulary), from its own generator when it has one,
    else from sampler.generator (uniforms of all such requests first, then their draws, in
    request order). A request with no drafts draws exactly as the Sampler does for that row.
    The host waits for the device once, for the tokens at the end (plus the Sampler's own
    top-p check, when a row's cut lies past its first window).
    """
    _check(sampler, logits, rows, counts, drafts, draft_probs)
    V = sampler.vocab_size
    device = sampler.device
    starts = list(itertools.accumulate(counts, initial=0))[:-1]
    heads = [rows[s] for s in starts]  # one row per request: its params and generator
    if argmax_only(rows):
        x = logits[:, :V]  # [R, V] the Sampler's fast path: argmax of the raw logits
        logprobs = sampler.logprobs(x.float(), rows) if want_logprobs else None
    else:
        x = sampler.process(logits, rows)  # [R, V] float32
        logprobs = sampler.logprobs(x, rows) if want_logprobs else None
    greedy = [i for i, r in enumerate(heads) if r.picks_argmax]
    sampled = [i for i, r in enumerate(heads) if not r.picks_argmax]
    accepted = torch.empty(len(counts), dtype=torch.int64, device=device)  # [N]
    last = torch.empty(len(counts), dtype=torch.int64, device=device)  # [N] the token after them
    for group in (greedy, sampled):
        if not group:
            continue
        g_counts = [counts[i] for i in group]
        g_starts = [starts[i] for i in group]
        g_drafts = [drafts[i] for i in group]
        if group is greedy:
            a, t = _verify_greedy(sampler, x, g_counts, g_starts, g_drafts)
        else:
            g_probs = [draft_probs[i] for i in group]
            a, t = _verify_sampled(sampler, x, rows, g_counts, g_starts, g_drafts, g_probs)
        idx = to_device(group, torch.int64, device)
        accepted[idx], last[idx] = a, t
    a_list, t_list = torch.stack([accepted, last]).tolist()
    tokens = [[*d[:a], t] for d, a, t in zip(drafts, a_list, t_list, strict=True)]
    return VerifyOutput(tokens, a_list, logprobs)


##### Internal Helper Functions #####


def _verify_greedy(
    sampler: Sampler,
    x: torch.Tensor,  # [R, V] processed logits (or the raw head on the fast path)
    counts: list[int],
    starts: list[int],
    drafts: Sequence[Sequence[int]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [n], last token [n]) of greedy requests: drafts kept while they equal argmax."""
    device = sampler.device
    own = [s + j for s, c in zip(starts, counts, strict=True) for j in range(c)]
    targets = argmax(x if len(own) == x.shape[0] else x[to_device(own, torch.int64, device)])
    local = list(itertools.accumulate(counts, initial=0))[:-1]  # each request's first row in own
    rows_d, req_d, pos_d, ids_d = _draft_index(local, drafts)
    a = torch.zeros(len(counts), dtype=torch.int64, device=device)
    if ids_d:
        match = targets[to_device(rows_d, torch.int64, device)] == to_device(
            ids_d, torch.int64, device
        )
        a = _accepted_lengths(match, req_d, pos_d, len(counts), max(counts) - 1, device)
    return a, targets[to_device(local, torch.int64, device) + a]


def _verify_sampled(
    sampler: Sampler,
    x: torch.Tensor,  # [R, V] float32 processed logits
    rows: Sequence[SamplingInputs],
    counts: list[int],
    starts: list[int],
    drafts: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [n], last token [n]) of sampled requests by speculative rejection sampling."""
    device = sampler.device
    V = sampler.vocab_size
    n = len(counts)
    own = [s + j for s, c in zip(starts, counts, strict=True) for j in range(c)]
    own_rows = [rows[k] for k in own]
    picked = x if len(own) == x.shape[0] else x[to_device(own, torch.int64, device)]
    weights = sampler.probs(picked, own_rows)  # [Rs, V] p up to each row's sum
    sums = weights.sum(dim=-1, keepdim=True)  # [Rs, 1]
    local = list(itertools.accumulate(counts, initial=0))[:-1]  # each request's first row
    heads = [own_rows[s] for s in local]
    first = to_device(local, torch.int64, device)  # [n]
    rows_d, req_d, pos_d, ids_d = _draft_index(local, drafts)
    if not ids_d:  # no drafts at all: plain sampling of one token per request
        return torch.zeros(n, dtype=torch.int64, device=device), sampler.draw(weights[first], heads)
    ids = to_device(ids_d, torch.int64, device)  # [Ds] draft tokens, requests back to back
    at = to_device(rows_d, torch.int64, device)  # [Ds] their rows
    p_x = weights[at, ids] / sums[at, 0]  # [Ds]
    q = _DraftQ(drafts, draft_probs, ids, V, device)
    lengths = [c - 1 for c in counts]
    accept = _accept(_uniforms(sampler, heads, lengths, device), p_x, q.at_drafts())
    a = _accepted_lengths(accept, req_d, pos_d, n, max(lengths), device)  # [n]
    # NOTE: row first + a is the first rejected draft's row, or the bonus row past the drafts
    stop = first + a  # [n]
    rejected = a < to_device(lengths, torch.int64, device)  # [n]
    q_first = to_device(list(itertools.accumulate(lengths, initial=0))[:-1], torch.int64, device)
    q_rows = q.rows((q_first + a).clamp_(max=len(ids_d) - 1), V)  # [n, V] (junk where accepted)
    residual = _residual(weights[stop] / sums[stop], q_rows)  # [n, V]
    use_residual = rejected & (residual.sum(dim=-1) > 0)  # all 0 only where p == q
    dist = torch.where(use_residual.unsqueeze(1), residual, weights[stop])  # [n, V]
    return a, sampler.draw(dist, heads)


class _DraftQ:
    """The draft distributions q of the draft tokens (requests back to back): one-hot at the
    token for deterministic drafts, never built as a [Ds, V] tensor of them."""

    def __init__(
        self,
        drafts: Sequence[Sequence[int]],
        draft_probs: Sequence[torch.Tensor | None],
        ids: torch.Tensor,  # int64 [Ds] the draft tokens
        V: int,
        device: torch.device,
    ) -> None:
        self.ids = ids
        # NOTE: a chain cut short (grammar, max_new_tokens) keeps the q rows of its first drafts
        given = [
            p[: len(d), :V] for d, p in zip(drafts, draft_probs, strict=True) if p is not None and d
        ]
        self.probs = (  # float32 [Dp, V]: the given rows, back to back
            torch.cat([p.to(device=device, dtype=torch.float32) for p in given]) if given else None
        )
        where: list[int] = []  # per draft token: its row in self.probs, or -1 (one-hot)
        taken = 0
        for d, p in zip(drafts, draft_probs, strict=True):
            if p is None:
                where += [-1] * len(d)
            else:
                where += range(taken, taken + len(d))
                taken += len(d)
        self.where = to_device(where, torch.int64, device)  # [Ds]

    def at_drafts(self) -> torch.Tensor:
        """float32 [Ds]: q_j(x_j) of each draft token."""
        q_x = torch.ones(self.ids.shape[0], dtype=torch.float32, device=self.ids.device)
        if self.probs is not None:
            given = self.where >= 0
            q_x = torch.where(given, self.probs[self.where.clamp(min=0), self.ids], q_x)
        return q_x

    def rows(self, k: torch.Tensor, V: int) -> torch.Tensor:
        """float32 [n, V]: the q rows of draft tokens k [n]."""
        q = torch.nn.functional.one_hot(self.ids[k], V).float()  # [n, V]
        if self.probs is not None:
            w = self.where[k]  # [n]
            q = torch.where((w >= 0).unsqueeze(1), self.probs[w.clamp(min=0)], q)
        return q


def _accept(u: torch.Tensor, p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """bool [Ds]: u < min(1, p/q), written u * q < p: no division, so q == 0 accepts iff p > 0."""
    return u * q_x < p_x


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """float32 [n, V]: max(p - q, 0), what a rejection draws from (the draw needs no sum)."""
    return (p - q).clamp_(min=0.0)


def _uniforms(
    sampler: Sampler, heads: Sequence[SamplingInputs], lengths: Sequence[int], device: torch.device
) -> torch.Tensor:
    """float32 [sum lengths]: U[0, 1) per draft; seeded requests from their own generator."""
    shared = [n for h, n in zip(heads, lengths, strict=True) if h.generator is None]
    pool = (
        torch.rand(sum(shared), device=device, generator=sampler.generator) if sum(shared) else None
    )
    parts: list[torch.Tensor] = []
    at = 0
    for h, n in zip(heads, lengths, strict=True):
        if n == 0:
            continue
        if h.generator is None:
            assert pool is not None
            parts.append(pool[at : at + n])
            at += n
        else:
            parts.append(torch.rand(n, device=device, generator=h.generator))
    return torch.cat(parts)


def _draft_index(
    local: Sequence[int], drafts: Sequence[Sequence[int]]
) -> tuple[list[int], list[int], list[int], list[int]]:
    """Per draft token (requests back to back): its row, its request, its position, its id."""
    rows: list[int] = []
    reqs: list[int] = []
    pos: list[int] = []
    ids: list[int] = []
    for i, (s, d) in enumerate(zip(local, drafts, strict=True)):
        rows += range(s, s + len(d))
        reqs += [i] * len(d)
        pos += range(len(d))
        ids += d
    return rows, reqs, pos, ids


def _accepted_lengths(
    ok: torch.Tensor,  # bool [Ds]: per draft token, requests back to back
    reqs: list[int],
    pos: list[int],
    n: int,
    width: int,
    device: torch.device,
) -> torch.Tensor:
    """int64 [n]: per request, how many of its drafts pass before the first that fails."""
    grid = torch.zeros(n, width, dtype=torch.int64, device=device)  # [n, max d] padding fails
    grid[to_device(reqs, torch.int64, device), to_device(pos, torch.int64, device)] = ok.long()
    return grid.cumprod(dim=1).sum(dim=1)


def _check(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: Sequence[SamplingInputs],
    counts: Sequence[int],
    drafts: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None],
) -> None:
    V = sampler.vocab_size
    if not len(counts) == len(drafts) == len(draft_probs):
        raise ValueError(
            f"counts, drafts and draft_probs need one entry per request, got "
            f"{len(counts)}, {len(drafts)} and {len(draft_probs)}"
        )
    if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] < V:
        raise ValueError(
            f"logits must be [rows={len(rows)}, >= vocab {V}], got {tuple(logits.shape)}"
        )
    if sum(counts) != len(rows):
        raise ValueError(f"counts sum to {sum(counts)} but there are {len(rows)} rows")
    at = 0
    for i, (c, d, probs) in enumerate(zip(counts, drafts, draft_probs, strict=True)):
        if c != len(d) + 1:
            raise ValueError(
                f"request {i}: counts[i] must be len(drafts[i]) + 1 = {len(d) + 1}, got {c}"
            )
        if any(not 0 <= t < V for t in d):
            raise ValueError(f"request {i}: draft token ids must be in [0, {V}), got {list(d)}")
        if probs is not None and (
            probs.dim() != 2 or probs.shape[0] < len(d) or probs.shape[1] < V
        ):
            raise ValueError(
                f"request {i}: draft_probs must be [>= {len(d)} drafts, >= vocab {V}], "
                f"got {tuple(probs.shape)}"
            )
        if len({rows[k].picks_argmax for k in range(at, at + c)}) != 1:
            raise ValueError(f"request {i}: its rows mix greedy and sampled parameters")
        at += c
