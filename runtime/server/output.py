"""A request's results: ReqState (what has arrived for one output) and the SGLang-shaped dicts built
from it (text, output_ids, meta_info with lengths, finish reason and logprobs)."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

from weft.runtime.ipc.messages import StrOut
from weft.runtime.server.generate_input import PromptSpec

WEIGHT_VERSION = "default"  # weights never change while serving (what /model_info says too)
_LOGPROB_FIELDS = (
    ("input_token_logprobs", "input_logprobs", False),
    ("output_token_logprobs", "output_logprobs", False),
    ("input_top_logprobs", "input_top_logprobs", True),
    ("output_top_logprobs", "output_top_logprobs", True),
    ("input_token_ids_logprobs", "input_ids_logprobs", True),
    ("output_token_ids_logprobs", "output_ids_logprobs", True),
)


@dataclass
class ReqState:
    """One output of a request, as the detokenizer's pieces arrive for it."""

    spec: PromptSpec
    input_ids: list[int]
    rid: str
    out_index: int
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    pieces: list[StrOut] = field(default_factory=list)  # not yet consumed
    meta: dict[str, Any] = field(default_factory=dict)
    finished: bool = False
    event: asyncio.Event = field(default_factory=asyncio.Event)
    created: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    rejected: str | None = None  # the scheduler refused the request itself (e.g. bad grammar)
    output_logprobs_sent: int = 0  # output logprob entries built so far (all outputs, streamed)

    def add(self, out: StrOut, now: float) -> None:
        """Take one piece: its new text and ids, the token times, the finish (if it is one)."""
        if out.token.new_ids:
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
        self.pieces.append(out)
        self.text += out.text
        self.output_ids += out.token.new_ids
        fin = out.token.finish
        if fin is not None:
            if fin.type == "abort" and fin.status is not None:
                self.rejected = fin.message or "the request was rejected"
            if out.full_text is not None:
                self.text = out.full_text
            self.finished = True


def schema_to_check(state: ReqState) -> str | None:
    """The JSON schema that a finished output is validated against, once (its meta_info gets
    `schema_valid` and, unless true, `schema_error`: constrain/validation.py), whatever the
    grammar left unenforced; None when there is nothing (more) to check."""
    if not state.finished or state.rejected is not None or "schema_valid" in state.meta:
        return None
    return state.spec.params.json_schema


def build_output(
    tokenizer: Any, state: ReqState, final: bool, pieces: list[StrOut] | None = None
) -> dict[str, Any]:
    """final: the whole result; otherwise the delta of the pieces not yet consumed (streaming).
    Without a tokenizer (skip_tokenizer_init) there is no "text" key, as in SGLang's results.
    `pieces`: those already taken from the state (by a caller that builds on another thread)."""
    if pieces is None:
        pieces, state.pieces = state.pieces, []
    last = pieces[-1].token if pieces else None
    if final:
        text, output_ids = state.text, state.output_ids
    else:
        text = "".join(p.text for p in pieces)
        output_ids = [t for p in pieces for t in p.token.new_ids]
    meta: dict[str, Any] = state.meta
    meta["id"] = state.rid
    meta.setdefault("weight_version", WEIGHT_VERSION)
    meta.setdefault("reasoning_tokens", 0)  # no reasoning parser on /generate (as SGLang without)
    if last is not None:
        meta["finish_reason"] = last.finish.to_dict() if last.finish else None
        meta["prompt_tokens"] = last.prompt_tokens
        meta["completion_tokens"] = last.completion_tokens
        meta["cached_tokens"] = last.cached_tokens
        meta["num_retractions"] = last.retractions
        if last.spec_verify_ct:  # speculative decoding (SGLang's keys, and the counts)
            steps = last.spec_verify_ct
            meta["spec_verify_ct"] = steps
            meta["spec_accept_length"] = (last.spec_accepted_tokens + steps) / steps
            meta["spec_draft_tokens"] = last.spec_draft_tokens
            meta["spec_accepted_tokens"] = last.spec_accepted_tokens
        if last.unenforced:
            meta["unenforced_keywords"] = list(last.unenforced)
    meta.setdefault("finish_reason", None)
    meta["e2e_latency"] = time.perf_counter() - state.created
    spec = state.spec
    if spec.return_logprob:
        with_text = spec.return_text_in_logprobs
        for key, attr, nested in _LOGPROB_FIELDS:
            if nested and "top" in key and not spec.top_logprobs_num:
                continue
            if nested and "ids" in key and not spec.token_ids_logprob:
                continue
            rows = [row for p in pieces for row in getattr(p.token, attr)]
            new: list[Any] = (
                [_entries(tokenizer, r, with_text) for r in rows]
                if nested
                else _entries(tokenizer, rows, with_text)
            )
            if final:
                meta[key] = meta.get(key, []) + new
            else:
                meta[key] = new
            if key == "output_token_logprobs":
                state.output_logprobs_sent += len(new)
        # SGLang's count of the output logprobs so far: == completion_tokens, also on a stream
        # whose chunks carry only their own tokens' entries
        meta["output_token_logprobs_length"] = state.output_logprobs_sent
    if tokenizer is None:
        return {"output_ids": list(output_ids), "meta_info": dict(meta)}
    return {"text": text, "output_ids": list(output_ids), "meta_info": dict(meta)}


def _entries(tokenizer: Any, rows: list[Any], with_text: bool) -> list[tuple[Any, int, str | None]]:
    if not rows:
        return []
    texts: list[str | None] = [None] * len(rows)
    if with_text:
        texts = list(tokenizer.batch_decode([[int(r[1])] for r in rows]))
    return [(_finite(r[0]), int(r[1]), t) for r, t in zip(rows, texts, strict=True)]


def _finite(logprob: float | None) -> float | None:
    """A token a grammar or min_new_tokens rules out has logprob -inf, which JSON cannot carry:
    it is null, as SGLang's orjson writes it."""
    return logprob if logprob is not None and math.isfinite(logprob) else None
