"""A generate call's requests on their way to the scheduler: the prefill-only warm-up and the n
samples of a prompt, and the messages, encoded in parts."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from weft.runtime.ipc.messages import BatchGenerateReq, TokenizedGenerateReq, encode
from weft.runtime.server.generate_input import PromptSpec

# NOTE: a generate call's requests go to the scheduler in parts of about this many prompt tokens
# (16 prefill steps' worth at the default budget). The scheduler starts the first step once the
# first part is decoded and admitted, and takes the rest while the device runs: 1,024 prompts of
# 2,176 tokens in one message took ~0.5 s to decode and admit on the 2-core VM before anything ran.
BATCH_PART_TOKENS = 1 << 17


def aborted(out: dict[str, Any]) -> bool:
    reason = out["meta_info"].get("finish_reason")
    return isinstance(reason, dict) and reason.get("type") == "abort"


def prefill_only(spec: PromptSpec) -> PromptSpec:
    params = dataclasses.replace(spec.params, max_new_tokens=0, min_new_tokens=0, n=1)
    return dataclasses.replace(spec, params=params, return_logprob=False, stream=False)


def sample_j(spec: PromptSpec, j: int) -> PromptSpec:
    """Sample j of n: its own seed (seed + j) so the n samples differ but stay reproducible."""
    seed = spec.params.sampling_seed
    params = dataclasses.replace(spec.params, n=1, sampling_seed=None if seed is None else seed + j)
    return dataclasses.replace(spec, params=params)


def encode_parts(msgs: list[TokenizedGenerateReq]) -> list[bytes]:
    """The requests as messages in parts of BATCH_PART_TOKENS, all encoded before any is sent or
    registered; ValueError when the codec refuses a value (one no check caught: a request must
    not be left half sent, its rid held by a state no reply will ever end)."""
    try:
        return [
            encode(part[0] if len(part) == 1 else BatchGenerateReq(part))
            for part in batch_parts(msgs, BATCH_PART_TOKENS)
        ]
    except (OverflowError, UnicodeEncodeError, msgspec.EncodeError) as e:
        raise ValueError(
            f"the request has a value that cannot be sent to the scheduler: {e}"
        ) from e


def batch_parts(
    msgs: list[TokenizedGenerateReq], part_tokens: int
) -> list[list[TokenizedGenerateReq]]:
    """The requests in order, cut after each run that reaches `part_tokens` prompt tokens."""
    parts: list[list[TokenizedGenerateReq]] = [[]]
    tokens = 0
    for msg in msgs:
        if tokens >= part_tokens:
            parts.append([])
            tokens = 0
        parts[-1].append(msg)
        tokens += len(msg.input_ids)
    return parts
