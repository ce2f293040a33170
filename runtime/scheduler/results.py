"""A processed step's results into its requests: tokens appended, finish checks, prompts and
finished requests cached in the tree, requests whose prefill completed joining the running set."""

from __future__ import annotations

from weft.runtime.executor.batch import ForwardMode
from weft.runtime.executor.step import LaunchedStep
from weft.runtime.ipc.messages import FinishReason
from weft.runtime.scheduler.cache_manager import KVCacheManager
from weft.runtime.scheduler.finish import check_finish, jump_forward
from weft.runtime.scheduler.request import Queues, Req
from weft.runtime.scheduler.speculative import append_verified, settle_verify


def apply_results(
    step: LaunchedStep,
    queues: Queues,
    cache: KVCacheManager,
    eos_ids: frozenset[int],
    forced_tokens: bool,
    stats: dict[str, int],
) -> list[Req]:
    """Add `step`'s tokens to its requests (with `forced_tokens`, also the tokens a grammar
    forces after them: jump-forward); returns the requests to report (finished, or streaming).
    Its sampling is done and its tokens are on the host (LaunchedStep.resolve waits for them)."""
    batch, results = step.batch, step.resolve()
    report: list[Req] = []
    was_running = set(map(id, queues.running))
    joined: list[Req] = []  # requests whose prefill completed this step
    sampled = set(step.samplers)
    for i, (req, res) in enumerate(zip(batch.reqs, results, strict=True)):
        if i in sampled:
            req.ahead -= 1
        if req.finished:  # ended by a token of the step before (overlap): nothing to add
            continue
        if res.spec_ids is not None:  # a verify step: several tokens, and its KV settled
            assert batch.drafts is not None and step.kv_ends
            drafts = len(batch.drafts[i])
            appended = append_verified(req, res.spec_ids, eos_ids)
            if req.return_logprob:
                res.add_logprobs_to(req, appended)
            settle_verify(req, cache, step.kv_ends[i], drafts, res.spec_accepted)
            stats["spec_verify_steps"] += 1
            stats["spec_draft_tokens"] += drafts
            stats["spec_accepted_tokens"] += res.spec_accepted
            if forced_tokens and req.finish is None and not req.return_logprob:
                jump_forward(req, eos_ids)
            if req.finished:
                cache.cache_req(req, release=True)
            if req.finished or req.stream:
                report.append(req)
            continue
        if req.return_logprob:  # (no logprob work on the decode hot path otherwise)
            res.add_logprobs_to(req)
        if (step.kv_ends[i] if step.kv_ends else req.kv_len) < req.seq_len:
            cache.cache_req(req, release=False)  # a chunk: share what is done
            if req.stream and req.in_logprobs:
                report.append(req)
            continue
        if id(req) not in was_running:
            joined.append(req)
            if not req.counted:
                req.counted = True
                stats["prompt_tokens"] += len(req.input_ids)
                stats["cached_tokens"] += req.cached_tokens
        if res.next_id is None:
            req.finish = FinishReason("length", length=req.max_new_tokens)
        else:
            req.output_ids.append(res.next_id)
            req.finish = check_finish(req, res.next_id, eos_ids)
            if forced_tokens and req.finish is None and not req.return_logprob:
                jump_forward(req, eos_ids)
        if req.finished:
            cache.cache_req(req, release=True)
        elif batch.mode == ForwardMode.EXTEND and id(req) not in was_running:
            cache.cache_req(req, release=False)  # its prompt, for others to share
        if req.finished or req.stream:
            report.append(req)
    queues.running = [r for r in queues.running + joined if not r.finished]
    return report
