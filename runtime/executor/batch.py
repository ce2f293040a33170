"""Batches: the scheduler's CPU `Batch` of requests and the model's device-side `ForwardBatch`.

Data flow of one step:

    Scheduler --(Batch: requests + mode, CPU lists)--> ModelRunner.forward
        ModelRunner builds a ForwardBatch (device tensors: token ids, positions, KV slots, lengths)
        AttentionBackend.prepare(ForwardBatch) derives its own metadata (gather indices, masks, plans)
        model(ForwardBatch) -> hidden states -> logits at the rows that need them -> Sampler
    ModelRunner --(StepResult: next token ids, logprobs, CPU)--> Scheduler.process_results

A request's KV slots live in its row of the request-to-token table; `out_cache_loc` says where the
new tokens of this step write their K and V.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from weft.runtime.executor.shared_prefix import SharedPrefixPlan
    from weft.runtime.lora.forward import LoraBatch
    from weft.runtime.models.layers import GemvPlan
    from weft.runtime.scheduler.request import Req


class ForwardMode(enum.Enum):
    EXTEND = enum.auto()  # prefill: each request runs >= 1 new tokens after its cached prefix
    DECODE = enum.auto()  # each request runs exactly its last sampled token
    IDLE = enum.auto()  # nothing to run (a rank with an empty batch)


@dataclass
class Batch:
    """What the scheduler decided to run this step (CPU side)."""

    mode: ForwardMode
    reqs: list[Req]
    # per request: how many new tokens run this step (EXTEND: a chunk of fill_ids; DECODE: 1)
    extend_lens: list[int] = field(default_factory=list)
    # speculative verify step: each request's draft tokens, run after its own new tokens (they
    # are counted in extend_lens); the model samples at its last own token and at every draft
    drafts: list[list[int]] | None = None

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)


@dataclass
class ForwardBatch:
    """Device tensors for one forward pass. T = tokens this step, B = requests."""

    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64, KV slot each new token writes
    req_rows: torch.Tensor  # [B] int64, rows of the request-to-token table
    seq_lens: torch.Tensor  # [B] int64, KV length after this step
    extend_lens: torch.Tensor  # [B] int64, new tokens per request (1 for DECODE)
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    # DECODE with a backend that reads shared prefixes once per group: which requests share what
    shared: SharedPrefixPlan | None = None
    # the projections that run weft's skinny GEMV (a decode graph's choice); None: cuBLAS
    gemv: GemvPlan | None = None
    # each token's LoRA adapter slot (runtime/executor/lora_step.py); None: no adapter token
    lora: LoraBatch | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def prefix_lens_cpu(self) -> list[int]:
        return [s - e for s, e in zip(self.seq_lens_cpu, self.extend_lens_cpu, strict=True)]

    def as_decode_rows(self, token_rows: torch.Tensor | None = None) -> ForwardBatch:
        """This extend batch as decode rows, one per token (`token_rows`: each token's table
        row, when the caller has them already): a token attends to its request's KV up to its
        own position, the same keys as in the extend (every token's K and V are stored before
        attention reads them), so a decode CUDA graph can replay it. The hidden rows keep the
        extend's order."""
        seq_cpu = [p + 1 for s, n in zip(self.seq_lens_cpu, self.extend_lens_cpu, strict=True)
                   for p in range(s - n, s)]  # fmt: skip
        if token_rows is None:
            token_rows = torch.repeat_interleave(
                self.req_rows, self.extend_lens, output_size=len(seq_cpu)
            )
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids,
            positions=self.positions,
            out_cache_loc=self.out_cache_loc,
            req_rows=token_rows,
            seq_lens=self.positions + 1,
            extend_lens=torch.ones_like(self.positions),
            seq_lens_cpu=seq_cpu,
            extend_lens_cpu=[1] * len(seq_cpu),
        )
