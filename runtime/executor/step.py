"""One step of the model: what each request gets out of it, and a step launched on the device."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from weft.runtime.executor.batch import Batch
from weft.runtime.executor.logprobs import LogprobRows, gather_logprobs

if TYPE_CHECKING:
    from weft.runtime.scheduler.request import Req

# a step's prompt logprobs: (logprob, token) per position, its top-k lists, its by-id lists
PromptLists = tuple[
    list[tuple[float | None, int]], list[list[tuple[float, int]]], list[list[tuple[float, int]]]
]


@dataclass(slots=True)
class ReqStepResult:
    """What one request got out of one step. One object per request and step: the prompt-logprob
    lists exist only where a step computed some (fewer objects for the collector to track)."""

    next_id: int | None = None  # None: still prefilling, or max_new_tokens == 0
    output_logprob: tuple[float, int] | None = None
    output_top: list[tuple[float, int]] | None = None
    output_ids_lp: list[tuple[float, int]] | None = None
    input_logprobs: list[tuple[float | None, int]] | None = None
    input_top: list[list[tuple[float, int]]] | None = None
    input_ids_lp: list[list[tuple[float, int]]] | None = None
    # a verify step (speculative decoding): the accepted drafts and one more token (next_id is
    # the first), how many drafts were accepted, and the tokens' logprobs (chosen, top, by id)
    spec_ids: list[int] | None = None
    spec_accepted: int = 0
    spec_logprobs: tuple[list[tuple[float, int]], list[list[tuple[float, int]]],
                         list[list[tuple[float, int]]]] | None = None  # fmt: skip

    def prompt_lists(self) -> PromptLists:
        """The prompt logprobs, top-k and by-id lists of this step, made on first use."""
        if self.input_logprobs is None or self.input_top is None or self.input_ids_lp is None:
            self.input_logprobs, self.input_top, self.input_ids_lp = [], [], []
        return self.input_logprobs, self.input_top, self.input_ids_lp

    def add_logprobs_to(self, req: Req, appended: int = 1) -> None:
        """Append this step's output and prompt logprobs to the request's (`appended`: of a
        verify step, the logprobs of its first tokens that were appended)."""
        if self.spec_logprobs is not None:
            spec_chosen, spec_top, spec_by_id = self.spec_logprobs
            req.out_logprobs += spec_chosen[:appended]
            if req.top_logprobs_num:
                req.out_top_logprobs += spec_top[:appended]
            if req.token_ids_logprob:
                req.out_ids_logprobs += spec_by_id[:appended]
        if self.output_logprob is not None:
            req.out_logprobs.append(self.output_logprob)
        if self.output_top is not None:
            req.out_top_logprobs.append(self.output_top)
        if self.output_ids_lp is not None:
            req.out_ids_logprobs.append(self.output_ids_lp)
        if self.input_logprobs is not None:
            chosen, top, by_id = self.prompt_lists()
            req.in_logprobs += chosen
            req.input_logprob_next += len(chosen)
            req.in_top_logprobs += top
            req.in_ids_logprobs += by_id


@dataclass(eq=False)
class LaunchedStep:
    """One step queued on the device. `resolve()` waits for its sampled tokens (a copy started
    at launch) and returns what each request of the batch got."""

    number: int
    batch: Batch
    results: list[ReqStepResult]  # prompt logprobs are filled at launch
    samplers: list[int] = field(default_factory=list)  # batch indices that sample, in row order
    host_ids: torch.Tensor | None = None  # [S] on the host, valid once `ready` has passed
    ready: torch.cuda.Event | None = None
    logprobs: torch.Tensor | None = None  # [S, V] when some sampling request wants logprobs
    hidden: torch.Tensor | None = None  # the model's output until `sample` has used it
    sample_rows: list[int] = field(default_factory=list)  # hidden rows of the samplers
    in_rows: list[LogprobRows] = field(default_factory=list)  # rows for prompt logprobs
    masked: bool = False  # a sampler had a grammar at launch
    kv_ends: list[int] = field(default_factory=list)  # extend: each request's KV length after it

    def resolve(self) -> list[ReqStepResult]:
        if self.host_ids is None:
            return self.results
        if self.ready is not None:
            self.ready.synchronize()
        next_ids = self.host_ids.tolist()
        for k, i in enumerate(self.samplers):
            self.results[i].next_id = next_ids[k]
        if self.logprobs is None:
            return self.results
        for k, i in enumerate(self.samplers):
            req, res = self.batch.reqs[i], self.results[i]
            if not req.return_logprob:
                continue
            chosen, top, by_id = gather_logprobs(
                self.logprobs[k : k + 1], [next_ids[k]], req.top_logprobs_num, req.token_ids_logprob
            )
            res.output_logprob = chosen[0]
            res.output_top = top[0] if req.top_logprobs_num else None
            res.output_ids_lp = by_id[0] if req.token_ids_logprob else None
        return self.results


def samples(req: Req, n: int) -> bool:
    """Whether a request running n tokens this step samples one: its prefill (or the tokens it
    has, including one still on the device) completes and it may generate more."""
    return req.kv_len + n == req.seq_len + req.ahead and req.remaining_new_tokens > 0


def input_logprob_rows(req: Req, offset: int, n: int) -> tuple[list[int], list[int], bool] | None:
    """Hidden rows (and the tokens they predict) for the prompt logprobs in this chunk.

    The logprob of prompt token i comes from the logits at position i - 1; token 0 has none.
    This chunk covers positions [kv_len, kv_len + n).
    """
    start = req.input_logprob_next
    prompt_len = len(req.input_ids)
    lo, hi = req.kv_len, req.kv_len + n
    first_is_none = start == 0 and lo == 0
    # predicted token i in [max(start, 1), prompt_len) needs position i - 1 in [lo, hi)
    first = max(start, 1, lo + 1)
    last = min(prompt_len, hi + 1)  # exclusive
    hidden_rows = [offset + (i - 1 - lo) for i in range(first, last)]
    targets = [req.input_ids[i] for i in range(first, last)]
    if not hidden_rows and not first_is_none:
        return None
    return hidden_rows, targets, first_is_none
