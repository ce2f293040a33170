"""DraftRunner: the draft model of speculative decoding; runs k tokens ahead of the target for a
batch of requests over its own paged KV, indexed by the target's slots.

The draft shares the target's slot numbering: the same request-to-token table and the same page
allocator. It has its own KVPool (its own layers and heads, as many slots as the target's) and its
own attention backend over that pool and the shared table, so every slot the target allocates is
one the draft can write. The draft allocates and frees nothing.

    target extend (prefill chunk)  -> DraftRunner.extend(fb)   the same tokens into the draft's KV
    before a verify step           -> DraftRunner.propose(reqs, k, rows) -> Proposal
        step 0 (EXTEND, or DECODE when every request runs one token, or decode rows: one per
               token, `spec_decode_rows`): positions
               [draft_len, seq_len) of each request, logits at its last -> draft token 1
        steps 1..k-1 (DECODE, CUDA graphs where captured): position seq_len + i - 1 -> token i+1
        req.draft_len = seq_len + k - 1 (the caller lowers it to what verification accepted)
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from weft.runtime.config import EngineConfig
from weft.runtime.executor.attention import AttentionBackend, create_attention_backend
from weft.runtime.executor.batch import ForwardBatch, ForwardMode
from weft.runtime.executor.cuda_graph import GraphRunner, decode_rows_limit
from weft.runtime.executor.distributed import TPGroup
from weft.runtime.executor.draft_loader import DRAFT_SEED_OFFSET, LoadedDraft, load_draft
from weft.runtime.executor.memory import KVPool, ReqToTokenPool
from weft.runtime.executor.sampler import Sampler, SamplingInputs, argmax
from weft.runtime.executor.transfer import to_device
from weft.runtime.models import LlamaForCausalLM
from weft.runtime.models.llama import (
    LlamaDecoderLayer,
    head_dim_of,
    num_kv_heads_of,
    sliding_window_of,
)

if TYPE_CHECKING:
    from weft.runtime.scheduler.request import Req

logger = logging.getLogger(__name__)


@dataclass
class Proposal:
    """What the draft proposes for a batch: per request, k tokens and (sampled rows only) the
    distribution each was drawn from."""

    tokens: list[list[int]]  # [B][k]
    # per request: float32 [k, V] on the device (row j: token j's normalized distribution after
    # bias, temperature, top-k, top-p, min-p), or None for rows that take the argmax
    probs: list[torch.Tensor | None]


class DraftRunner:
    """The draft model, its KV pool, attention backend, sampler and (CUDA) decode graphs."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        hf_config: Any,
        pool: KVPool,
        attn: AttentionBackend,
        table: ReqToTokenPool,
        page_size: int,
        sampler: Sampler,
        graphs: GraphRunner | None,
        decode_rows: int = 0,
    ) -> None:
        self.model = model
        self.hf_config = hf_config
        self.pool = pool
        self.attn = attn
        self.table = table
        self.page_size = page_size
        self.sampler = sampler
        self.graphs = graphs
        self.decode_rows = decode_rows  # a step 0 of up to this many tokens runs as decode rows
        self.device = pool.k[0].device
        self.vocab_size = int(hf_config.vocab_size)
        self.num_forward_passes = 0  # draft forwards (extend + propose steps)

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        draft_path: str | os.PathLike[str],
        device: torch.device,
        dtype: torch.dtype,
        table: ReqToTokenPool,
        page_size: int,
        num_slots: int,
        tp: TPGroup | None = None,
        *,
        target_vocab_size: int,
        loaded: LoadedDraft | None = None,
    ) -> DraftRunner:
        """Load the draft (HF folder, .gguf file kept quantized as the target would keep it, or
        random weights with load_format='dummy'; `loaded`: already loaded by load_draft) and
        build its KV pool of `num_slots` slots, its attention backend over `table`, and on CUDA
        its decode graphs."""
        _refuse_tp(tp)
        path = os.fspath(draft_path)
        if loaded is None:
            loaded = load_draft(config, path, device, dtype, table.max_context)
        elif loaded.path != path:
            raise ValueError(f"draft_path {path!r} but the loaded draft is {loaded.path!r}")
        model, hf_config = loaded.model, loaded.hf_config
        if int(hf_config.vocab_size) != target_vocab_size:
            raise ValueError(
                f"the draft model {path!r} has vocab_size "
                f"{hf_config.vocab_size} but the target model has {target_vocab_size}: a draft "
                "must share the target's tokenizer and vocabulary"
            )
        fused = device.type == "cuda" and not config.disable_fused_kernels
        if fused:
            model.use_kernels(pdl=not config.tuning.disable_pdl)
        first = model.layers[0]
        assert isinstance(first, LlamaDecoderLayer)
        pool = KVPool(
            num_slots,
            hf_config.num_hidden_layers,
            first.self_attn.num_kv_heads,
            head_dim_of(hf_config),
            config.kv_torch_dtype,
            device,
        )
        attn = create_attention_backend(
            config.attention_backend, device.type, pool, table.table, page_size, config.tuning
        )
        if sliding_window_of(hf_config) is not None and not attn.supports_sliding_window:
            raise ValueError(
                f"attention backend {type(attn).__name__} has no sliding-window attention, which "
                f"the draft ({hf_config.model_type}) needs; use attention_backend='torch' or "
                "'flashinfer'"
            )
        graphs: GraphRunner | None = None
        if device.type == "cuda" and not config.disable_cuda_graph:
            if not attn.supports_cuda_graph:
                raise ValueError(
                    f"attention backend {type(attn).__name__} cannot run in CUDA graphs; "
                    "choose attention_backend='triton' or pass disable_cuda_graph=True"
                )
            graphs = GraphRunner(
                model,
                attn,
                min(config.cuda_graph_max_bs, config.max_running_requests),
                hf_config.hidden_size,
                dtype,
                device,
                pad_row=0,
                tuning=config.tuning,
            )
            graphs.capture()
        sampler = Sampler(hf_config.vocab_size, device, config.seed + DRAFT_SEED_OFFSET)
        logger.info("draft model %s: %d layers, KV %d bytes per slot", path,
                    hf_config.num_hidden_layers, pool_bytes(pool) // num_slots)  # fmt: skip
        rows = decode_rows_limit(config.tuning.spec_decode_rows, graphs)
        return cls(model, hf_config, pool, attn, table, page_size, sampler, graphs, rows)

    @staticmethod
    def bytes_per_slot(config: EngineConfig, draft_hf_config: Any, tp: TPGroup | None) -> int:
        """KV bytes per slot of the draft (size the target's pool with target + draft bytes)."""
        _refuse_tp(tp)
        return KVPool.bytes_per_slot(
            draft_hf_config.num_hidden_layers,
            num_kv_heads_of(draft_hf_config),
            head_dim_of(draft_hf_config),
            config.kv_torch_dtype,
        )

    ##### Public API #####

    @torch.no_grad()
    def extend(self, fb: ForwardBatch) -> None:
        """Run the draft over a forward batch the target just ran (its ids, positions, slots and
        lengths) to write the draft's KV there; no logits. The caller then sets each request's
        draft_len to its new kv_len."""
        # the target's shared-prefix plan and GEMV plan are the target's: the draft plans its own
        self._run(replace(fb, shared=None, gemv=None))

    @torch.no_grad()
    def propose(self, reqs: list[Req], k: int, rows: list[SamplingInputs]) -> Proposal:
        """k draft tokens per request (module docstring). The table must hold slots for every
        position the draft runs: [draft_len, seq_len + k - 1) of each request."""
        self._check(reqs, k, rows)
        self.table.flush()  # the caller's slot writes (the verify step's slots)
        rows = [_without_penalties(r) for r in rows]
        sampled = [i for i, r in enumerate(rows) if not r.picks_argmax]
        sampled_t = to_device(sampled, torch.int64, self.device) if sampled else None
        fb, last_rows = self._first_batch(reqs)
        catch_up = fb.mode == ForwardMode.EXTEND and sum(fb.extend_lens_cpu) <= self.decode_rows
        hidden = self._run(fb.as_decode_rows() if catch_up else fb)  # (a graph replays rows)
        ids, probs = self._draw(self._logits(hidden, last_rows), rows, sampled_t)
        steps, dists = [ids], [probs]
        seq_t = fb.seq_lens
        ones = torch.ones_like(seq_t)
        seq_cpu = fb.seq_lens_cpu
        for i in range(1, k):  # input: draft token i at position seq_len + i - 1
            positions = seq_t + (i - 1)
            fb = ForwardBatch(
                mode=ForwardMode.DECODE,
                input_ids=ids,
                positions=positions,
                out_cache_loc=self.table.table[fb.req_rows, positions],
                req_rows=fb.req_rows,
                seq_lens=seq_t + i,
                extend_lens=ones,
                seq_lens_cpu=[s + i for s in seq_cpu],
                extend_lens_cpu=[1] * len(reqs),
            )
            ids, probs = self._draw(self.model.compute_logits(self._run(fb)), rows, sampled_t)
            steps.append(ids)
            dists.append(probs)
        for req in reqs:
            req.draft_len = req.seq_len + k - 1
        tokens = torch.stack(steps, dim=1).tolist()  # [B, k]: the one wait for the device
        per_req: list[torch.Tensor | None] = [None] * len(reqs)
        if sampled:
            stacked = torch.stack([d for d in dists if d is not None], dim=1)  # [S, k, V]
            for j, i in enumerate(sampled):
                per_req[i] = stacked[j]
        return Proposal(tokens, per_req)

    ##### Internal Helper Functions #####

    def _check(self, reqs: list[Req], k: int, rows: list[SamplingInputs]) -> None:
        if k < 1:
            raise ValueError(f"propose needs k >= 1 draft tokens, got {k}")
        if len(rows) != len(reqs) or not reqs:
            raise ValueError(f"propose needs one sampling row per request and at least one "
                             f"request, got {len(reqs)} requests and {len(rows)} rows")  # fmt: skip
        at_rows: list[int] = []  # table cells of every position the draft runs
        at_cols: list[int] = []
        for req in reqs:
            if req.row is None or req.ahead:
                raise ValueError(f"request {req.rid}: propose needs its table row and all its "
                                 "tokens on the host (row set, nothing ahead)")  # fmt: skip
            if not 0 <= req.draft_len < req.seq_len:
                raise ValueError(f"request {req.rid}: draft_len {req.draft_len} must be in "
                                 f"[0, seq_len={req.seq_len})")  # fmt: skip
            end = req.seq_len + k - 1
            if end > self.table.max_context:
                raise ValueError(f"request {req.rid}: seq_len {req.seq_len} + k {k} - 1 exceeds "
                                 f"the table's context of {self.table.max_context}")  # fmt: skip
            at_rows += [req.row] * (end - req.draft_len)
            at_cols += range(req.draft_len, end)
        # slots of the reserved page are never handed out: such a cell was never allocated
        unset = self.table.cpu[at_rows, at_cols] < self.page_size  # the host mirror: no sync
        if bool(unset.any()):
            i = int(unset.nonzero()[0, 0])
            rid = next(r.rid for r in reqs if r.row == at_rows[i])
            raise ValueError(f"request {rid} (table row {at_rows[i]}): no KV slot allocated for "
                             f"position {at_cols[i]}, which the draft runs")  # fmt: skip

    def _first_batch(self, reqs: list[Req]) -> tuple[ForwardBatch, torch.Tensor | None]:
        """Step 0's batch (positions [draft_len, seq_len) per request) and the hidden rows of
        each request's last token (None: every request runs one token, one row each)."""
        lens = [r.seq_len - r.draft_len for r in reqs]
        ids = [t for r in reqs for t in r.tokens(r.draft_len, r.seq_len)]
        positions = [p for r in reqs for p in range(r.draft_len, r.seq_len)]
        seq_lens = [r.seq_len for r in reqs]
        rows = [r.row for r in reqs]
        parts: list[list[Any]] = [ids, positions, rows, seq_lens, lens]
        flat = to_device([x for part in parts for x in part], torch.int64, self.device)
        cut = list(itertools.accumulate(map(len, parts), initial=0))
        input_ids, pos, req_rows, seq_t, ext_t = (
            flat[cut[j] : cut[j + 1]] for j in range(len(parts))
        )
        decode = all(n == 1 for n in lens)
        if decode:
            row_per_token = req_rows
            last = None
        else:
            row_per_token = torch.repeat_interleave(req_rows, ext_t, output_size=len(ids))
            last = torch.cumsum(ext_t, 0) - 1
        fb = ForwardBatch(
            mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            input_ids=input_ids,
            positions=pos,
            out_cache_loc=self.table.table[row_per_token, pos],
            req_rows=req_rows,
            seq_lens=seq_t,
            extend_lens=ext_t,
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=lens,
        )
        return fb, last

    def _run(self, fb: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, hidden] of one draft forward (a view into the graph's buffer when a
        CUDA graph ran it: use it before the next forward)."""
        self.num_forward_passes += 1
        if self.graphs is not None and self.graphs.can_run(fb):
            return self.graphs.replay(fb)
        self.attn.prepare(fb)
        hidden: torch.Tensor = self.model(fb, self.attn)
        return hidden

    def _logits(self, hidden: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        return self.model.compute_logits(hidden if rows is None else hidden[rows])

    def _draw(
        self, logits: torch.Tensor, rows: list[SamplingInputs], sampled: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next draft ids [B] and, for the sampled rows, their normalized distributions [S, V]."""
        if sampled is None and not any(map(_processes, rows)):
            return argmax(logits[:, : self.vocab_size]), None
        x = self.sampler.process(logits, rows)  # [B, V] float32
        ids = argmax(x)
        if sampled is None:
            return ids, None
        sub_rows = [r for r in rows if not r.picks_argmax]  # the rows of `sampled`, in order
        probs = self.sampler.probs(x[sampled], sub_rows)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        ids[sampled] = self.sampler.draw(probs, sub_rows)
        return ids, probs


def pool_bytes(pool: KVPool) -> int:
    return sum(t.numel() * t.element_size() for t in (*pool.k, *pool.v))


def _refuse_tp(tp: TPGroup | None) -> None:
    if tp is not None and tp.size > 1:
        raise ValueError(
            f"a speculative draft model runs on one rank for now; tp_size={tp.size} is not "
            "supported with a draft model"
        )


def _without_penalties(row: SamplingInputs) -> SamplingInputs:
    """The row the draft samples with: repetition, frequency and presence penalties dropped (the
    draft's distribution need only be close to the target's; the verify step applies them)."""
    p = row.params
    if not p.uses_penalties:
        return row
    params = replace(p, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)
    return SamplingInputs(params, row.prompt_ids, row.output_ids, row.stop_ids, row.generator)


def _processes(row: SamplingInputs) -> bool:
    """Whether the row's logits need the sampler's processing (bias, min_new_tokens mask)."""
    return bool(row.params.logit_bias) or row.masks_stop_ids
