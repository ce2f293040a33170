"""Req: one generation request inside the scheduler, with its KV bookkeeping and finish state; the
scheduler's queues of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from weft.runtime.ipc.messages import FinishReason, TokenizedGenerateReq
from weft.runtime.sampling_params import SamplingParams


@dataclass(eq=False)
class Req:
    """Token layout of a request (all lengths in tokens):

    fill_ids = input_ids + output_ids
    |<-- prefix_len -->|                        from the radix tree, locked via last_node
    |<------------ kv_len ------------>|        KV computed and held in the table row
    |<--------------------- len(fill_ids) ----------------->|
                                       |<- extend_len ->|   still to prefill (0 while decoding
                                                            except the last sampled token)
    """

    rid: str
    input_ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # resolved: never None, fits the context and the KV pool
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: output logprobs only; k >= 0: input logprobs for [k, P)
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] = ()
    stream: bool = False
    arrival: int = 0  # admission order, for FCFS and retraction choice
    lora_path: str | None = None  # the LoRA adapter's name; None: the base model

    output_ids: list[int] = field(default_factory=list)
    # overlap scheduling: sampled tokens still on the device (launched steps not yet processed),
    # and where the newest one will be: (step number, row among that step's sampled rows)
    ahead: int = 0
    future: tuple[int, int] | None = None
    row: int | None = None  # row of the request-to-token table while it holds KV
    kv_len: int = 0
    prefix_len: int = 0  # leading KV slots owned by the radix tree (locked)
    cached_tokens: int = 0  # prompt tokens served from the cache at first admission (reported)
    last_node: Any = None  # radix node locked for this request
    finish: FinishReason | None = None
    generator: torch.Generator | None = None
    sampling: Any = None  # its sampler.SamplingInputs, built when it first samples
    stop_state: Any = None  # scheduler-side stop-string checker, when the request has stops
    grammar: Any = None  # constrain.GrammarMatcher of a constrained request, once compiled
    grammar_handle: Any = None  # constrain.CompileHandle while the grammar compiles
    unenforced: list[str] = field(default_factory=list)  # schema keywords not enforced
    num_retractions: int = 0
    admitted: bool = False  # set at the first admission (cached_tokens is measured then)
    counted: bool = False  # its prompt went into the cache-hit statistics
    # speculative decoding: leading positions whose KV the draft model holds (the target's are
    # kv_len); the n-gram drafter over its tokens; the drafts chosen for the next step and the
    # draft model's distributions of them; its speculative.SpecCounts
    draft_len: int = 0
    ngram: Any = None
    pending_draft: list[int] = field(default_factory=list)
    draft_probs: Any = None
    spec: Any = None

    # logprob results not yet sent (deltas)
    out_logprobs: list[tuple[float, int]] = field(default_factory=list)
    out_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    out_ids_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    in_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    in_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    in_ids_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    sent_output_len: int = 0  # output tokens already reported
    input_logprob_next: int = 0  # first prompt position whose input logprob is still owed

    def __post_init__(self) -> None:
        self.input_logprob_next = max(self.input_logprob_next, self.logprob_start_len, 0)

    @classmethod
    def from_msg(cls, msg: TokenizedGenerateReq, max_new_tokens: int, arrival: int) -> Req:
        return cls(
            rid=msg.rid,
            input_ids=list(msg.input_ids),
            params=msg.params,
            max_new_tokens=max_new_tokens,
            return_logprob=msg.return_logprob,
            logprob_start_len=msg.logprob_start_len,
            top_logprobs_num=msg.top_logprobs_num,
            token_ids_logprob=tuple(msg.token_ids_logprob),
            stream=msg.stream,
            arrival=arrival,
            lora_path=msg.lora_path,
        )

    @property
    def fill_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """fill_ids[start:end] without building fill_ids (the decode hot path)."""
        n = len(self.input_ids)
        if end <= n:
            return self.input_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.input_ids[start:] + self.output_ids[: end - n]

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def extend_len(self) -> int:
        """Tokens to run next: the known ones past kv_len, plus a sampled one still on the device."""
        return self.seq_len + self.ahead - self.kv_len

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def owes_input_logprobs(self) -> bool:
        return self.wants_input_logprobs and self.input_logprob_next < len(self.input_ids)

    @property
    def remaining_new_tokens(self) -> int:
        return max(self.max_new_tokens - len(self.output_ids) - self.ahead, 0)


@dataclass
class Queues:
    """The scheduler's requests by state: waiting for admission (in arrival order, retracted
    ones first), running (decoding), and the one prompt being prefilled in chunks, if any."""

    waiting: list[Req] = field(default_factory=list)
    running: list[Req] = field(default_factory=list)
    chunked: Req | None = None

    def __bool__(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)
