"""The sampling of a speculative verify step: the model's logits at each request's last own token
and at its drafts, grammar masks, and the accepted tokens with their logprobs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from weft.runtime.executor.grammar_masks import GrammarMasks
from weft.runtime.executor.logprobs import gather_logprobs
from weft.runtime.executor.sampler import Sampler, SamplingInputs
from weft.runtime.executor.spec_verify import verify_drafts
from weft.runtime.executor.transfer import to_device

if TYPE_CHECKING:
    from weft.runtime.executor.step import LaunchedStep
    from weft.runtime.scheduler.request import Req


class VerifyRunner(Protocol):
    """What a verify step needs of the model runner."""

    device: torch.device
    model: Any
    masks: GrammarMasks
    sampler: Sampler

    def sampling_inputs(self, req: Req) -> SamplingInputs: ...


def sample_verify(runner: VerifyRunner, step: LaunchedStep, hidden: torch.Tensor) -> None:
    """Verify the drafts of `step` (a batch with drafts): each sampling request gets its
    accepted drafts and one more token (`ReqStepResult.spec_ids`), waiting for the device.

    Rows of request i: its last own token, then its d_i drafts (`LaunchedStep.sample_rows`, in
    sampler order). Row j samples as if the first j drafts were already its output (penalties,
    min_new_tokens) and is masked by the request's grammar in the state after those drafts."""
    batch = step.batch
    assert batch.drafts is not None
    reqs = [batch.reqs[i] for i in step.samplers]
    drafts = [batch.drafts[i] for i in step.samplers]
    counts = [len(d) + 1 for d in drafts]
    rows_t = to_device(step.sample_rows, torch.int64, runner.device)
    logits = runner.model.compute_logits(hidden[rows_t])  # [R, V]
    starts = _starts(counts)
    # constrained requests: without drafts, one row masked as in a decode step; with drafts, a
    # mask per row (the grammar walked along the drafts)
    plain = [i for i, d in zip(step.samplers, drafts, strict=True) if not d]
    masked = runner.masks.fill(batch.reqs, plain)
    if masked:
        first = to_device([starts[step.samplers.index(i)] for i in plain], torch.int64,
                          runner.device)  # fmt: skip
        sub = logits[first]
        runner.masks.apply(batch.reqs, plain, masked, sub)
        logits[first] = sub
    walks = [(r, d, at) for r, d, at in zip(reqs, drafts, starts, strict=True)
             if d and r.grammar is not None and not r.finished]  # fmt: skip
    if walks:
        runner.masks.apply_drafts(walks, logits)
    rows: list[SamplingInputs] = []
    for req, draft in zip(reqs, drafts, strict=True):
        base = req.sampling or runner.sampling_inputs(req)
        rows.append(base)
        rows += [_row_after(req, base, draft[:j]) for j in range(1, len(draft) + 1)]
    want_logprobs = any(r.return_logprob for r in reqs)
    out = verify_drafts(
        runner.sampler,
        logits,
        rows,
        counts,
        drafts,
        [req.draft_probs for req in reqs],
        want_logprobs=want_logprobs,
    )
    at = 0
    for k, i in enumerate(step.samplers):
        req, res, tokens = batch.reqs[i], step.results[i], out.tokens[k]
        res.spec_ids = tokens
        res.spec_accepted = out.accepted[k]
        res.next_id = tokens[0]
        if req.return_logprob and out.logprobs is not None:
            chosen, top, by_id = gather_logprobs(
                out.logprobs[at : at + len(tokens)],
                tokens,
                req.top_logprobs_num,
                req.token_ids_logprob,
            )
            res.spec_logprobs = (chosen, top, by_id)
        at += counts[k]


def _row_after(req: Req, base: SamplingInputs, drafts: list[int]) -> SamplingInputs:
    """The sampler row of `req` with `drafts` taken as its next output: a row of its own only
    where the output matters (penalties, stop ids masked below min_new_tokens)."""
    p = base.params
    if not p.uses_penalties and not base.masks_stop_ids:
        return base
    return SamplingInputs(p, base.prompt_ids, req.output_ids + drafts, base.stop_ids,
                          base.generator)  # fmt: skip


def _starts(counts: list[int]) -> list[int]:
    starts, at = [], 0
    for c in counts:
        starts.append(at)
        at += c
    return starts
