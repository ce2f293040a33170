"""ModelRunner: owns the model, the KV memory and the sampler; runs one Batch and returns a StepResult."""

from __future__ import annotations

import itertools
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from weft.runtime.config import EngineConfig
from weft.runtime.executor.attention import create_attention_backend
from weft.runtime.executor.batch import Batch, ForwardBatch, ForwardMode
from weft.runtime.executor.cuda_graph import GraphRunner, decode_rows_limit
from weft.runtime.executor.distributed import TPGroup
from weft.runtime.executor.draft import DraftRunner
from weft.runtime.executor.draft_loader import load_draft
from weft.runtime.executor.grammar_masks import GrammarMasks
from weft.runtime.executor.kv_memory import build_kv_memory
from weft.runtime.executor.logprobs import LogprobRows, gather_logprobs
from weft.runtime.executor.lora_step import LoraRuntime
from weft.runtime.executor.memory import ReqToTokenPool
from weft.runtime.executor.sampler import Sampler, SamplingInputs
from weft.runtime.executor.shared_prefix import PlanCache
from weft.runtime.executor.spec_step import sample_verify
from weft.runtime.executor.step import LaunchedStep, ReqStepResult, input_logprob_rows, samples
from weft.runtime.executor.transfer import to_device
from weft.runtime.loader import gguf_path, iterate_weight_slices
from weft.runtime.loader.fp8_checkpoint import refuse_quantized_checkpoint
from weft.runtime.loader.gguf_tensors import iterate_gguf
from weft.runtime.models import build_model, check_quantization, init_dummy_weights
from weft.runtime.models.quant import QuantContext, make_quant_config

if TYPE_CHECKING:
    from weft.runtime.scheduler.request import Req

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_path: Any,
        hf_config: Any,
        context_len: int,
        tp: TPGroup | None = None,
    ):
        self.config = config
        self.tp = tp
        self.device = tp.device if tp is not None else torch.device(config.resolved_device)
        self.dtype = config.torch_dtype
        self.hf_config = hf_config
        self.context_len = context_len
        self.page_size = config.resolved_page_size
        self.stop_ids: frozenset[int] = frozenset()  # set by the scheduler (model EOS ids)

        if self.device.type == "cpu" and config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        t0 = time.perf_counter()
        torch.manual_seed(config.seed)
        model_tp = tp.model_info if tp is not None else None
        dummy = config.load_format == "dummy"
        kept_gguf = config.resolved_quantization == "gguf" and not dummy
        checkpoint = gguf_path(config.model) if kept_gguf else model_path
        check_quantization(hf_config, config.resolved_quantization)  # before reading anything
        if not dummy and config.resolved_quantization is None:
            refuse_quantized_checkpoint(hf_config)
        quant = make_quant_config(
            config.resolved_quantization, QuantContext(hf_config, checkpoint, self.dtype, dummy)
        )
        self.model = build_model(hf_config, context_len, self.device, self.dtype, model_tp, quant)
        if dummy:
            init_dummy_weights(self.model, config.seed, quant=quant)
        elif kept_gguf:  # the blocks straight from the file
            self.model.load_weights(iterate_gguf(checkpoint, device=self.device))
        else:  # each rank reads only its slices
            self.model.load_weights(iterate_weight_slices(model_path, device=self.device))
        logger.info("model loaded in %.1f s", time.perf_counter() - t0)
        self.fused = self.device.type == "cuda" and not config.disable_fused_kernels
        if self.fused:  # RMSNorm + residual, rotary, SiLU-and-mul, grammar masks as Triton kernels
            self.model.use_kernels(pdl=not config.tuning.disable_pdl)
        self.lora = (
            LoraRuntime(config, hf_config, self.model, self.device, self.dtype, tp)
            if config.lora_enabled
            else None
        )

        loaded = None  # speculative decoding's draft model, loaded before the pool is sized
        draft_bytes = None
        if config.speculative_draft_model_path is not None:
            loaded = load_draft(config, config.speculative_draft_model_path, self.device,
                                self.dtype, context_len)  # fmt: skip
            draft_bytes = DraftRunner.bytes_per_slot(config, loaded.hf_config, tp)
        memory = build_kv_memory(config, self.model, hf_config, self.device, context_len, tp,
                                 draft_bytes)  # fmt: skip
        self.allocator = memory.allocator
        self.pool = memory.pool
        self.swa_window = memory.swa_window
        num_pages = self.allocator.num_pages
        self.req_to_token = ReqToTokenPool(config.max_running_requests, context_len, self.device)
        self.attn = create_attention_backend(
            config.attention_backend,
            self.device.type,
            self.pool,
            self.req_to_token.table,
            self.page_size,
            config.tuning,
        )
        if self.pool.hybrid and not self.attn.supports_hybrid_swa_pool:
            raise ValueError(
                f"attention backend {type(self.attn).__name__} cannot read the hybrid "
                "sliding-window KV pool yet; pass disable_hybrid_swa_memory=True or "
                "attention_backend='triton' or 'torch'"
            )
        self.draft = (
            DraftRunner.build(config, loaded.path, self.device, self.dtype, self.req_to_token,
                              self.page_size, num_pages * self.page_size, tp,
                              target_vocab_size=hf_config.vocab_size, loaded=loaded)
            if loaded is not None
            else None
        )  # fmt: skip
        if any(memory.windowed) and not self.attn.supports_sliding_window:
            raise ValueError(
                f"attention backend {type(self.attn).__name__} has no sliding-window attention, "
                f"which this {hf_config.model_type} model needs"
            )
        # decode steps tell the backend which requests share a prefix (radix cache on only)
        self.plan_shared = (
            self.attn.supports_shared_prefix
            and not config.disable_shared_prefix_decode
            and not config.disable_radix_cache
        )
        self.attn.shared_prefix = self.plan_shared
        self.plans = PlanCache()
        self.sampler = Sampler(hf_config.vocab_size, self.device, config.seed)
        self.graphs: GraphRunner | None = None
        if self.device.type == "cuda" and not config.disable_cuda_graph:
            if not self.attn.supports_cuda_graph:
                raise ValueError(
                    f"attention backend {type(self.attn).__name__} cannot run in CUDA graphs; "
                    "choose attention_backend='triton' or pass disable_cuda_graph=True"
                )
            t1 = time.perf_counter()
            self.graphs = GraphRunner(
                self.model,
                self.attn,
                min(config.cuda_graph_max_bs, config.max_running_requests),
                hf_config.hidden_size,
                self.dtype,
                self.device,
                pad_row=0,
                tuning=config.tuning,
                lora=self.lora,
            )
            self.graphs.capture()
            logger.info("CUDA graphs captured in %.1f s", time.perf_counter() - t1)
        self.verify_rows = decode_rows_limit(config.tuning.spec_decode_rows, self.graphs)
        self.num_forward_tokens = 0  # tokens actually run through the model (prefix reuse tests)
        self.num_forward_passes = 0
        self.num_shared_prefix_steps = 0  # decode steps that read a shared prefix once per group
        self.num_launches = 0
        self._last_ids: tuple[int, torch.Tensor] | None = None  # the last launch's sampled ids
        # host copies of sampled ids: one per step that can be alive at once (overlap keeps two)
        pin = self.device.type == "cuda"
        self._host_ids = [
            torch.empty(config.max_running_requests, dtype=torch.int64, pin_memory=pin)
            for _ in range(3)
        ]
        self.masks = GrammarMasks(
            self.req_to_token.max_reqs, self.hf_config.vocab_size, self.device, self.fused
        )
        self.masks.warm_up(self.dtype)

    ##### One step #####

    def forward(self, batch: Batch) -> list[ReqStepResult]:
        """Run one step and wait for its results."""
        step = self.launch(batch)
        self.sample(step)
        return step.resolve()

    @torch.no_grad()
    def launch(self, batch: Batch, deferred: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the model for one step (on CUDA nothing here waits for the GPU). Which requests
        sample is decided now; `sample` draws their tokens once the host state they depend on
        (grammar, penalties) is up to date, and `LaunchedStep.resolve` reads them. A request
        with a sampled token still on the device (`req.ahead`, overlap scheduling) runs that
        token: it is taken from the previous launch's output on the device.

        `deferred`: the previous step, still to sample (overlap with grammar masks). It samples
        after this step's inputs are built and staged (all but the token ids it samples) and
        before its model: its masks, prefetched since its accepts, get that time too."""
        self.req_to_token.flush()  # the scheduler's slot writes since the last step
        self.pool.flush()  # and its SWA slot-map writes (hybrid pool)
        fb, futures = self._forward_batch(batch)
        graphs = self.graphs if self.graphs is not None and self.graphs.can_run(fb) else None
        if graphs is not None:
            graphs.stage(fb)
        else:
            self.attn.prepare(fb)
        if deferred is not None:
            self.sample(deferred)
        if futures is not None:
            self._take_futures(fb, *futures)
        if graphs is not None:
            hidden = graphs.replay(fb)
        elif self.lora is not None:  # the projections' LoRA sites read fb.lora
            with self.lora.context.use(fb.lora):
                hidden = self.model(fb, self.attn)
        else:
            hidden = self.model(fb, self.attn)  # [T, hidden]; on CUDA this only queues kernels
            if self.draft is not None and batch.mode == ForwardMode.EXTEND and not batch.drafts:
                self.draft.extend(fb)  # the same tokens into the draft model's KV
        self.num_forward_tokens += fb.input_ids.numel()
        self.num_forward_passes += 1
        self.num_shared_prefix_steps += fb.shared is not None
        self.num_launches += 1
        step = LaunchedStep(self.num_launches, batch, [ReqStepResult() for _ in batch.reqs])
        step.hidden = hidden
        offset = 0
        drafts = batch.drafts
        for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens, strict=True)):
            d = len(drafts[i]) if drafts is not None else 0
            if samples(req, n - d):  # (a verify step samples at its last own token and drafts)
                step.sample_rows += range(offset + n - d - 1, offset + n)
                step.samplers.append(i)
                step.masked = step.masked or req.grammar is not None
            if batch.mode == ForwardMode.EXTEND and req.owes_input_logprobs:
                rows = input_logprob_rows(req, offset, n)
                if rows is not None:
                    step.in_rows.append(LogprobRows(i, *rows))
            offset += n
        return step

    def propose_drafts(self, reqs: list[Req], k: int) -> tuple[list[list[int]], list[Any]]:
        """The draft model's k tokens ahead of each request, and the distributions they were
        drawn from (None where the request is greedy); slots for them are allocated."""
        assert self.draft is not None, "speculative_algorithm='draft' without a draft model"
        rows = [r.sampling or self.sampling_inputs(r) for r in reqs]
        proposal = self.draft.propose(reqs, k, rows)
        return proposal.tokens, list(proposal.probs)

    def mask_fill_stats(self) -> dict[str, float]:
        """Grammar mask fill and apply times (GrammarMasks.stats)."""
        return self.masks.stats()

    def _take_futures(
        self, fb: ForwardBatch, at_t: torch.Tensor, row_t: torch.Tensor, steps: set[int]
    ) -> None:
        """Put the last sampled step's device-side ids into fb's input ids (rows at_t)."""
        last = self._last_ids
        assert last is not None and steps == {last[0]}, "future tokens of a step not the last"
        fb.input_ids[at_t] = last[1][row_t]

    def _forward_batch(
        self, batch: Batch
    ) -> tuple[ForwardBatch, tuple[torch.Tensor, torch.Tensor, set[int]] | None]:
        """The step's device inputs, and where its future tokens go (`_take_futures`): input
        rows, rows of the sampled ids, and the step that samples them."""
        ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        future_at: list[int] = []  # token index in this step <- row of the last launch's ids
        future_row: list[int] = []
        future_steps: set[int] = set()
        drafts = batch.drafts
        for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens, strict=True)):
            start = req.kv_len
            if req.ahead:
                assert n == 1 and req.future is not None, (req.rid, n)
                future_steps.add(req.future[0])
                future_at.append(len(ids))
                future_row.append(req.future[1])
                ids.append(0)
            elif drafts is not None:  # a verify step: its own new tokens, then its drafts
                ids += req.tokens(start, start + n - len(drafts[i])) + drafts[i]
            else:
                ids += req.tokens(start, start + n)
            positions += range(start, start + n)
            seq_lens.append(start + n)
        # one host-to-device copy for all of it (it does not wait for the step before)
        rows = [r.row for r in batch.reqs]
        assert all(r is not None for r in rows), "a request without its table row"
        ext = list(batch.extend_lens)
        parts: list[list[Any]] = [ids, positions, rows, seq_lens, ext, future_at, future_row]
        flat = to_device([x for part in parts for x in part], torch.int64, self.device)
        cut = list(itertools.accumulate(map(len, parts), initial=0))
        input_ids, pos, req_rows, seq_t, ext_t, at_t, row_t = (
            flat[cut[k] : cut[k + 1]] for k in range(len(parts))
        )
        if batch.mode == ForwardMode.DECODE:  # one token per request
            row_per_token = req_rows
        else:
            row_per_token = torch.repeat_interleave(req_rows, ext_t, output_size=len(ids))
            self.plans.clear()
        fb = ForwardBatch(
            mode=batch.mode,
            input_ids=input_ids,
            positions=pos,
            out_cache_loc=self.req_to_token.table[row_per_token, pos],
            req_rows=req_rows,
            seq_lens=seq_t,
            extend_lens=ext_t,
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=ext,
            shared=(
                self.plans.plan(batch.reqs)
                if self.plan_shared and batch.mode == ForwardMode.DECODE
                else None
            ),
        )
        if self.lora is not None:
            fb.lora = self.lora.forward_state(batch, len(ids))
        if drafts is not None and len(ids) <= self.verify_rows:  # a verify step, as decode rows
            fb = fb.as_decode_rows(row_per_token)
        return fb, ((at_t, row_t, future_steps) if future_at else None)

    @torch.no_grad()
    def sample(self, step: LaunchedStep) -> None:
        """Logits, grammar masks and sampling for a launched step; the tokens start their way to
        the host. Called before the next launch (which may take these tokens as its input)."""
        hidden, step.hidden = step.hidden, None
        assert hidden is not None, "sample() called twice for one step"
        batch = step.batch
        if step.in_rows:
            self._input_logprobs(batch, hidden, step.in_rows, step.results)
        sample_rows = step.sample_rows
        if not sample_rows:
            return
        if batch.drafts is not None:
            sample_verify(self, step, hidden)
            return
        masked = self.masks.fill(batch.reqs, step.samplers)  # CUDA: while the GPU runs
        if len(sample_rows) == hidden.shape[0]:  # every row samples (decode): no gather
            picked = hidden
        else:
            picked = hidden[to_device(sample_rows, torch.int64, self.device)]
        logits = self.model.compute_logits(picked)  # [S, V]
        if masked:
            self.masks.apply(batch.reqs, step.samplers, masked, logits)
        reqs = [batch.reqs[i] for i in step.samplers]
        inputs = [r.sampling or self.sampling_inputs(r) for r in reqs]
        out = self.sampler(logits, inputs, want_logprobs=any(r.return_logprob for r in reqs))
        if self.tp is not None:  # every rank continues with rank 0's tokens
            self.tp.broadcast_tokens(out.next_ids)
        step.logprobs = out.logprobs
        self._last_ids = (step.number, out.next_ids)
        if self.device.type == "cuda":  # the tokens come back while the GPU goes on
            host = self._host_ids[step.number % len(self._host_ids)][: out.next_ids.numel()]
            host.copy_(out.next_ids, non_blocking=True)
            step.host_ids, step.ready = host, torch.cuda.Event()
            step.ready.record()
        else:
            step.host_ids = out.next_ids

    def sampling_inputs(self, req: Req) -> SamplingInputs:
        """The request's sampler row, built once: it reads the request's own token lists."""
        ids = frozenset(req.params.stop_token_ids)
        stop_ids = ids if req.params.ignore_eos else ids | self.stop_ids
        req.sampling = SamplingInputs(
            req.params, req.input_ids, req.output_ids, stop_ids, req.generator
        )
        return req.sampling

    def _input_logprobs(
        self,
        batch: Batch,
        hidden: torch.Tensor,
        rows: list[LogprobRows],
        results: list[ReqStepResult],
    ) -> None:
        flat = [h for r in rows for h in r.hidden_rows]
        logprobs = (
            torch.log_softmax(self.model.compute_logits(hidden[flat]).float(), dim=-1)
            if flat
            else None
        )
        at = 0
        for r in rows:
            req = batch.reqs[r.req_index]
            lps, tops, by_ids = results[r.req_index].prompt_lists()
            if r.first_is_none:
                lps.append((None, req.input_ids[0]))
                if req.top_logprobs_num:
                    tops.append([])
                if req.token_ids_logprob:
                    by_ids.append([])
            k = len(r.hidden_rows)
            if k and logprobs is not None:
                chosen, top, by_id = gather_logprobs(
                    logprobs[at : at + k], r.targets, req.top_logprobs_num, req.token_ids_logprob
                )
                lps += chosen
                if req.top_logprobs_num:
                    tops += top
                if req.token_ids_logprob:
                    by_ids += by_id
            at += k
