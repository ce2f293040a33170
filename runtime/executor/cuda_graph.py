"""CUDA graphs for decode: capture the model's decode step at fixed batch sizes over static input
buffers, pad each real batch to the next captured size, and replay (with LoRA adapters, a second
graph per size adds the adapters' deltas, each token's pool slot a graph input)."""

from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING, Any

import torch

from weft.runtime.config import TuningConfig
from weft.runtime.executor.attention.base import AttentionBackend
from weft.runtime.executor.batch import ForwardBatch, ForwardMode
from weft.runtime.executor.graph_tuning import (
    blas_library,
    choose_blas,
    choose_gemv,
    projection_timer,
    replay_us,
)
from weft.runtime.lora.forward import LoraBatch
from weft.runtime.lora.pool import NO_LORA
from weft.runtime.models.layers import GemvPlan

if TYPE_CHECKING:
    from weft.runtime.executor.lora_step import LoraRuntime

logger = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256]
    sizes += list(range(288, max_batch + 1, 32))
    return [s for s in sizes if s <= max_batch] or [1]


def decode_rows_limit(mode: str, graphs: GraphRunner | None) -> int:
    """The most tokens a speculative extend (a verify step, the draft's catch-up) runs as decode
    rows, one per token (TuningConfig.spec_decode_rows): auto up to the largest captured graph
    (none without graphs), on without bound where no graph runs, off none."""
    limit = graphs.sizes[-1] if graphs is not None else 0
    return {"off": 0, "auto": limit}.get(mode, limit or 1 << 30)


class GraphRunner:
    """Replays the decode forward (embedding -> final norm) for batches of one token per request.

    Padded rows read row `pad_row` of the request table with seq_len 0 (attention skips them) and
    write their K/V to the reserved slot 0, so they touch no request's KV. What each size's
    graph runs on (its cuBLAS path, the skinny GEMV's plan) is chosen at capture
    (graph_tuning.py) and handed to the model with the batch; the model is not modified.

    With `lora`, each size also has a graph that runs the adapters' deltas: the tokens' pool
    slots are a static input (NO_LORA on padded rows and base-model tokens), their grouping
    (kernels/lora.py's lora_index) runs inside the graph, and the pool's buffers never move. A
    batch without adapter tokens replays the plain graph, which does no LoRA work.
    """

    def __init__(
        self,
        model: Any,
        attn: AttentionBackend,
        max_batch: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        pad_row: int,
        tuning: TuningConfig,
        lora: LoraRuntime | None = None,
    ) -> None:
        self.model = model
        self.attn = attn
        self.sizes = capture_sizes(max_batch)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=device)
        self.req_rows = torch.full((n,), pad_row, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int64, device=device)
        self.extend_lens = torch.ones(n, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.pad_row = pad_row
        self.lora = lora
        self.lora_slots = torch.full((n,), NO_LORA, dtype=torch.int32, device=device)
        # (batch, padded size, shared variant, with LoRA)
        self._staged: tuple[ForwardBatch, int, bool, bool] | None = None
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (size, shared variant)
        self.lora_graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # the same, LoRA
        self.pool: Any = None
        self.tuning = tuning
        self.blas: dict[int, str] = {}  # the cuBLAS path each size's graph was captured with
        self.gemv: dict[int, GemvPlan] = {}  # the sizes whose graphs run the skinny GEMV

    def static_batch(self, bs: int, gemv: GemvPlan | None = None) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_rows=self.req_rows[:bs],
            seq_lens=self.seq_lens[:bs],
            extend_lens=self.extend_lens[:bs],
            seq_lens_cpu=[0] * bs,
            extend_lens_cpu=[1] * bs,
            gemv=gemv,
        )

    @torch.no_grad()
    def capture(self) -> None:
        mode = self.tuning.graph_blas
        if mode == "auto":
            self.blas = choose_blas(self.sizes, projection_timer(self.model, self.sizes[-1]))
        else:
            self.blas = dict.fromkeys(self.sizes, mode)
        self.gemv = choose_gemv(self.model, self.sizes, self.tuning.gemv)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in reversed(self.sizes):  # largest first: later graphs reuse its memory
                self._capture_size(bs, self.gemv.get(bs), stream)
            if self.tuning.gemv == "auto":
                for bs in sorted(self.gemv):
                    self._keep_faster(bs, stream)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s (cuBLASLt at %s; the skinny "
                    "GEMV at %s)", self.sizes, [bs for bs, lib in self.blas.items()
                                                if lib == "cublaslt"], sorted(self.gemv))  # fmt: skip

    def _capture_size(self, bs: int, gemv: GemvPlan | None, stream: torch.cuda.Stream) -> None:
        for lora in (False, True) if self.lora is not None else (False,):
            for shared in reversed(self.attn.graph_variants()):
                with blas_library(self.blas[bs]):
                    self._capture(bs, shared, gemv, stream, lora)

    def _keep_faster(self, bs: int, stream: torch.cuda.Stream) -> None:
        """Capture size bs again with cuBLAS in place of the skinny GEMV and keep whichever
        step replays faster: the whole step decides (the GEMV folds SiLU-and-mul into the down
        projection and launches as a programmatic dependent, which no per-projection timing
        sees)."""
        with_gemv = {key: g for key, g in self.graphs.items() if key[0] == bs}
        lora_with_gemv = {key: g for key, g in self.lora_graphs.items() if key[0] == bs}
        gemv_us = self._replay_us(bs)
        self._capture_size(bs, None, stream)
        if gemv_us < self._replay_us(bs):
            self.graphs.update(with_gemv)
            self.lora_graphs.update(lora_with_gemv)
        else:
            del self.gemv[bs]

    def _replay_us(self, bs: int) -> float:
        """Size bs's graph replayed as captured: padded rows, whose attention reads nothing and
        whose K/V go to the reserved slot."""
        return replay_us(self.graphs[bs, False], reps=7)

    def _capture(
        self, bs: int, shared: bool, gemv: GemvPlan | None, stream: torch.cuda.Stream,
        lora: bool = False,
    ) -> None:  # fmt: skip
        fb = self.static_batch(bs, gemv)
        self.attn.prepare_graph(fb, shared)
        for _ in range(2):  # compile kernels, settle allocations
            self.hidden[:bs] = self._forward(fb, lora)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            self.hidden[:bs] = self._forward(fb, lora)
        if self.pool is None:
            self.pool = graph.pool()
        (self.lora_graphs if lora else self.graphs)[bs, shared] = graph

    def _forward(self, fb: ForwardBatch, lora: bool) -> torch.Tensor:
        """The captured work: the model, with LoRA the adapters' deltas of the slots in
        `lora_slots` (grouped on the device, in the graph)."""
        if not lora:
            return self.model(fb, self.attn)
        assert self.lora is not None
        from weft.kernels.lora import default_block_m, lora_index

        slots = self.lora_slots[: fb.batch_size]
        pool = self.lora.pool
        index = lora_index(slots, pool.max_loras, default_block_m(fb.batch_size))
        with self.lora.context.use(LoraBatch(pool, slots, index)):
            return self.model(fb, self.attn)

    def can_run(self, fb: ForwardBatch) -> bool:
        return (
            fb.mode == ForwardMode.DECODE
            and fb.batch_size <= self.sizes[-1]
            and (fb.lora is None or self.lora is not None)
        )

    def stage(self, fb: ForwardBatch) -> None:
        """Queue the copies of fb's inputs into the static buffers, all but its token ids (which
        may still be sampled on the device: `replay` copies them)."""
        b = fb.batch_size
        bs = self.sizes[bisect.bisect_left(self.sizes, b)]
        self.positions[:b].copy_(fb.positions)
        self.out_cache_loc[:b].copy_(fb.out_cache_loc)
        self.req_rows[:b].copy_(fb.req_rows)
        self.seq_lens[:b].copy_(fb.seq_lens)
        if bs > b:
            self.input_ids[b:bs].zero_()
            self.positions[b:bs].zero_()
            self.out_cache_loc[b:bs].zero_()
            self.req_rows[b:bs].fill_(self.pad_row)
            self.seq_lens[b:bs].zero_()
        lora = fb.lora is not None and self.lora is not None
        if lora:
            assert fb.lora is not None
            self.lora_slots[:b].copy_(fb.lora.token_slots)
            self.lora_slots[b:bs].fill_(NO_LORA)
        shared = fb.shared is not None and self.attn.shared_prefix
        self.attn.prepare_replay(fb, bs, shared)
        self._staged = (fb, bs, shared, lora)

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Hidden states [B, hidden] of a real decode batch of size B (staged first unless
        `stage(fb)` was the last call)."""
        if self._staged is None or self._staged[0] is not fb:
            self.stage(fb)
        assert self._staged is not None
        _, bs, shared, lora = self._staged
        self._staged = None
        self.input_ids[: fb.batch_size].copy_(fb.input_ids)
        (self.lora_graphs if lora else self.graphs)[bs, shared].replay()
        return self.hidden[: fb.batch_size]
