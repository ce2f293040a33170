"""Finish checks and progress reports of requests: length, stop strings/regex, EOS and stop ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from weft.runtime.detokenize import IncrementalDecoder
from weft.runtime.ipc.messages import FinishReason, TokenOut
from weft.runtime.scheduler.request import Req
from weft.runtime.stop import StopMatcher, StopRegexTimeout


@dataclass
class StopState:
    """Scheduler-side decoded text of a request with stop strings; the detokenizer decodes the
    same ids with the same settings, so `trim_offset` points at the same character there."""

    decoder: IncrementalDecoder
    matcher: StopMatcher
    start: int = 0  # text offset from which a match counts (min_new_tokens)

    @classmethod
    def for_req(cls, req: Req, tokenizer: Any) -> StopState | None:
        p = req.params
        if not p.stop and not p.stop_regex:
            return None
        decoder = IncrementalDecoder(
            tokenizer,
            skip_special_tokens=p.skip_special_tokens,
            spaces_between_special_tokens=p.spaces_between_special_tokens,
            prefix_ids=decode_prefix(req),
        )
        return cls(decoder, StopMatcher(p.stop, p.stop_regex))


DECODE_PREFIX_TOKENS = 5  # prompt tokens decoded before the output for context (`▁` tokenizers)


def decode_prefix(req: Req) -> list[int]:
    return req.input_ids[-DECODE_PREFIX_TOKENS:]


def check_finish(req: Req, token: int, eos_ids: frozenset[int]) -> FinishReason | None:
    """Order: grammar, stop string / regex, EOS and stop token ids (none of these before
    min_new_tokens), then length — a last allowed token that completes a stop string or is an
    EOS reports "stop", not "length" (SGLang checks length first; its stop text then stays in
    the output). Also advances the request's grammar and stop-string state by `token`."""
    p = req.params
    n = len(req.output_ids)
    stop = req.stop_state
    grammar = req.grammar
    if grammar is not None and not grammar.accept_token(token):
        if grammar.error() is not None:
            return grammar_failed(grammar.error())
        return grammar_failed(
            f"no token can continue the output after {n - 1} token(s): the grammar allows none "
            "of this tokenizer's ordinary tokens here (e.g. its text spells out a special "
            f"token's text); token {token} was sampled from an empty mask"
        )
    if stop is not None:
        if n == p.min_new_tokens:
            stop.start = len(stop.decoder.text)
        stop.decoder.push([token])
    if grammar is not None:
        if grammar.error() is not None:
            return grammar_failed(grammar.error())
        if grammar.is_terminated():
            return FinishReason("stop", matched=token)
    if n >= p.min_new_tokens:
        if stop is not None:
            try:
                hit = stop.matcher.search(stop.decoder.text, stop.start)
            except StopRegexTimeout as e:
                return FinishReason("abort", message=str(e), status=400)
            if hit is not None:
                offset, matched = hit
                return FinishReason("stop", matched=matched, trim_offset=offset)
        if not p.ignore_eos and (token in eos_ids or token in p.stop_token_ids):
            return FinishReason("stop", matched=token)
    if n >= req.max_new_tokens:
        return FinishReason("length", length=req.max_new_tokens)
    return None


def grammar_failed(why: str | None) -> FinishReason:
    """The request's grammar failed mid-generation (a backend limit, a backend that raised):
    this request ends with the reason, a 400 (the grammar caused it)."""
    return FinishReason("abort", message=f"grammar error: {why}", status=400)


def jump_forward(req: Req, eos_ids: frozenset[int]) -> None:
    """Append the tokens the grammar forces (the only allowed continuation) without sampling;
    they reach the model together in the next step. Greedy output is unchanged by this."""
    grammar = req.grammar
    while req.finish is None and grammar is not None:
        forced = grammar.forced_tokens()
        if not forced:
            return
        for token in forced:
            req.output_ids.append(token)
            req.finish = check_finish(req, token, eos_ids)
            if req.finish is not None:
                return


def token_out(req: Req) -> TokenOut:
    """The request's progress since its last report; resets the pending deltas."""
    p = req.params
    new_ids = req.output_ids[req.sent_output_len :]
    req.sent_output_len = len(req.output_ids)
    out = TokenOut(
        rid=req.rid,
        new_ids=new_ids,
        finish=req.finish,
        prompt_tokens=len(req.input_ids),
        cached_tokens=req.cached_tokens,
        completion_tokens=len(req.output_ids),
        skip_special_tokens=p.skip_special_tokens,
        spaces_between_special_tokens=p.spaces_between_special_tokens,
        no_stop_trim=p.no_stop_trim,
        stop=list(p.stop),
        decode_prefix=decode_prefix(req),
        token_by_token=req.stop_state is not None,
        output_logprobs=req.out_logprobs,
        output_top_logprobs=req.out_top_logprobs,
        output_ids_logprobs=req.out_ids_logprobs,
        input_logprobs=req.in_logprobs,
        input_top_logprobs=req.in_top_logprobs,
        input_ids_logprobs=req.in_ids_logprobs,
        retractions=req.num_retractions,
        spec_verify_ct=req.spec.verify_steps if req.spec is not None else 0,
        spec_draft_tokens=req.spec.drafted if req.spec is not None else 0,
        spec_accepted_tokens=req.spec.accepted if req.spec is not None else 0,
        unenforced=req.unenforced,
    )
    req.out_logprobs, req.out_top_logprobs, req.out_ids_logprobs = [], [], []
    req.in_logprobs, req.in_top_logprobs, req.in_ids_logprobs = [], [], []
    return out
