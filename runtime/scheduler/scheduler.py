"""Scheduler: the loop (receive -> schedule -> launch -> process results) over its parts: the
intake, the batch policy, the overlap of steps, the model runner and the KV cache."""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any

from weft.radix import NoCache, PrefixCache, RadixCache
from weft.runtime.config import EngineConfig
from weft.runtime.executor.batch import Batch, ForwardMode
from weft.runtime.executor.distributed import Inbox, TPGroup, batch_digest
from weft.runtime.executor.model_runner import ModelRunner
from weft.runtime.executor.step import LaunchedStep
from weft.runtime.executor.swa_memory import SWAPageAllocator
from weft.runtime.ipc.channel import Channel
from weft.runtime.ipc.messages import (
    BatchTokenOut,
    FlushCacheOut,
    FlushCacheReq,
    GetStateReq,
    LoadLoraReq,
    LoraOut,
    Message,
    StateOut,
    TokenizedGenerateReq,
    UnloadLoraReq,
)
from weft.runtime.loader import read_hf_config
from weft.runtime.loader.model_info import ModelInfo
from weft.runtime.loader.tokenizer_source import resolve_tokenizer
from weft.runtime.scheduler.cache_manager import KVCacheManager
from weft.runtime.scheduler.finish import token_out
from weft.runtime.scheduler.grammar import GrammarQueue
from weft.runtime.scheduler.intake import Intake
from weft.runtime.scheduler.overlap import Overlap
from weft.runtime.scheduler.policy import BatchPolicy
from weft.runtime.scheduler.request import Queues, Req
from weft.runtime.scheduler.results import apply_results
from weft.runtime.scheduler.speculative import Speculator
from weft.runtime.scheduler.stats import KVUsage, StepClock

logger = logging.getLogger(__name__)

FOLLOWER_GRAMMAR_TIMEOUT_SCALE = 4  # followers only wait for compiles rank 0 finished


class Scheduler:
    """One per tensor-parallel rank. Rank 0 owns the channel and shares what it receives; every
    rank then runs the same deterministic schedule on the same inputs (rank 0's sampled tokens),
    so the radix cache, the KV accounting and the grammar matchers stay identical everywhere."""

    def __init__(
        self,
        config: EngineConfig,
        model_path: Path,
        channel: Channel | None,
        tp: TPGroup | None = None,
    ) -> None:
        self.config = config
        self.channel = channel
        self.tp = tp
        self.is_leader = tp is None or tp.is_leader
        hf_config = read_hf_config(model_path)
        self.info = ModelInfo.from_folder(model_path, hf_config, config)
        self.tokenizer = resolve_tokenizer(config, model_path).load()  # None: skip_tokenizer_init
        self.runner = ModelRunner(config, model_path, hf_config, self.info.context_len, tp)
        self.runner.stop_ids = self.info.eos_ids
        tree: PrefixCache = (
            NoCache(self.runner.allocator, self.runner.page_size)
            if config.disable_radix_cache
            else RadixCache(self.runner.allocator, self.runner.page_size)
        )
        self.cache = KVCacheManager(
            self.runner.allocator, tree, self.runner.req_to_token, self.runner.lora
        )
        self.queues = Queues()
        self.clock = StepClock()
        self.stats = self.clock.counts
        self.kv_usage = KVUsage()
        self.checked_idle = True
        scale = 1 if self.is_leader else FOLLOWER_GRAMMAR_TIMEOUT_SCALE
        self.grammars = GrammarQueue(
            config,
            self.tokenizer,
            self.info.vocab_size,
            self.info.eos_ids,
            timeout_s=config.grammar_timeout * scale,
        )
        if self.runner.device.type == "cuda" and self.tokenizer is not None:  # no ~1 s stall later
            self.grammars.start_backend()
        self.overlap = Overlap(config.resolved_overlap, config.enable_mixed_chunk)
        # NOTE: with overlap, forced tokens are sampled one by one (the mask allows only them: the
        # same output). Appending them would make the next step an eager extend that no step
        # can overlap, and with many constrained requests some always have forced tokens.
        self.jump_forward = not config.disable_jump_forward and not self.overlap.enabled
        self.speculator = (
            Speculator(
                config, self.cache, self.stats, self.runner.propose_drafts, self.runner.verify_rows
            )
            if config.speculative_algorithm is not None
            else None
        )
        if self.speculator is not None:
            self.clock.listener = self.speculator.costs.observe
        self.policy = BatchPolicy(
            config, self.cache, self.queues, self.overlap, self.stats, self.speculator
        )
        self.intake = Intake(
            channel,
            self.queues,
            self.cache,
            self.grammars,
            self.info,
            self.tokenizer,
            self.runner.device,
            self.max_total_tokens,
            frozenset(config.lora_adapters),
        )

    @property
    def max_total_tokens(self) -> int:
        return self.runner.allocator.total_slots

    ##### The loop #####

    def run_forever(self, parent_pid: int) -> None:
        """receive -> schedule -> launch -> process results, until the parent is gone. With
        overlap the results processed are those of the step before: the host works on them while
        the device runs the step just launched."""
        while True:
            self.receive(parent_pid)
            batch = self.schedule()
            step = self.launch(batch)
            self.process_results(step)

    def receive(self, parent_pid: int) -> None:
        """Wait for something to do (rank 0 reads the channel and shares it), then apply it."""
        if not self.has_work():
            self.clock.idle()
            if not self.grammars.pending:
                self.on_idle()
        loading = self.runner.lora is not None and bool(self.runner.lora.loading)
        inbox = (
            self.intake.collect(parent_pid, self.has_work(), loading) if self.is_leader else None
        )
        if self.tp is not None:
            inbox = self.tp.share_inbox(inbox)
        assert inbox is not None
        self.apply(inbox)
        for reply in self.lora_replies():  # adapters read in the background since
            self.reply(reply)

    def schedule(self) -> Batch | None:
        """The next batch: a prefill if any request can be admitted, else a decode of the running
        requests; with a step in flight that the next may not follow, that step is processed
        first. With tensor parallelism every rank must pick the same one (checked)."""
        batch = None
        overlap = self.overlap
        if overlap.inflight is not None and not self.decode_may_follow():
            if overlap.prefill_may_follow(self.queues.chunked):
                batch = self.policy.prefill(behind=overlap.inflight.batch)
            if batch is None:
                self.settle()
        if batch is None:
            batch = self.policy.next_batch()
        if self.tp is not None:
            self.tp.check_agree(batch_digest(batch), "the batch to run")
        return batch

    def launch(self, batch: Batch | None) -> LaunchedStep | None:
        """Queue the batch on the device. Its requests' KV now counts as computed, and a token it
        samples is `ahead` (known on the device only) until its results are processed."""
        spec = self.speculator
        self.clock.launching(batch, spec.take_draft_s() if spec is not None else 0.0)
        if batch is None:
            return None
        held = self.max_total_tokens - self.cache.available_tokens
        self.stats["kv_held_step_sum"] += held
        self.kv_usage.record(held, len(self.queues.running))
        # the in-flight step's sampling, if deferred (a step with grammar masks), comes first
        step = self.runner.launch(batch, self.overlap.deferred())
        self.stats["overlapped_steps"] += self.overlap.inflight is not None
        draft_ran = self.runner.draft is not None and batch.mode == ForwardMode.EXTEND
        draft_ran = draft_ran and batch.drafts is None  # (it ran these tokens too: draft KV)
        for req, n in zip(batch.reqs, batch.extend_lens, strict=True):
            if draft_ran and req.draft_len >= req.kv_len:
                req.draft_len = req.kv_len + n
            req.kv_len += n
        if batch.mode == ForwardMode.EXTEND:  # (a chunk's next one may launch before it is done)
            step.kv_ends = [req.kv_len for req in batch.reqs]
        for k, i in enumerate(step.samplers):
            req = batch.reqs[i]
            req.ahead += 1
            req.future = (step.number, k)
        return step

    def process_results(self, step: LaunchedStep | None) -> None:
        """Process the step launched before `step` (overlap: while the device runs `step`'s
        model), then sample `step` unless its sampling waits for the next launch; without
        overlap, wait for `step` and process it."""
        older = self.overlap.push(step)
        if older is not None:
            self.finish_step(older)
        if step is not None and self.overlap.samples_at_launch(step):
            self.runner.sample(step)
        if self.overlap.settles_at_once:
            self.settle()

    ##### Helpers of the loop #####

    def decode_may_follow(self) -> bool:
        """Whether the next decode may launch behind the step in flight (Overlap): not when it
        would verify drafts, whose proposals need the in-flight step's tokens."""
        running = self.queues.running
        if not self.overlap.decode_continues(running, self.cache):
            return False
        if not self.cache.swa_fits(self.overlap.decoding(running)):  # (hybrid SWA pool)
            return False
        spec = self.speculator
        return spec is None or not spec.verifies_next(len(self.overlap.decoding(running)))

    def has_work(self) -> bool:
        return bool(self.queues) or self.overlap.inflight is not None

    def on_idle(self) -> None:
        """Runs once each time the scheduler becomes idle: the KV conservation check, and the
        new-token ratio starts again (as SGLang's)."""
        if not self.checked_idle:
            self.retire_loras()  # (an unloaded adapter whose last request was aborted)
            self.cache.check_conservation()
            self.policy.ratio.reset()
            self.checked_idle = True

    def apply(self, inbox: Inbox) -> None:
        """What arrived, in order: requests whose grammar compiled, then each message (all but
        new requests see the in-flight step processed first)."""
        if Intake.controls(inbox):
            self.settle()
        if inbox.msgs or inbox.ready:
            self.checked_idle = False
        self.emit(self.intake.admit_compiled(inbox))
        for msg in inbox.msgs:
            if isinstance(msg, FlushCacheReq):
                self.reply(self.flush_cache())
            elif isinstance(msg, GetStateReq):
                self.reply(StateOut(self.state()))
            elif isinstance(msg, (LoadLoraReq, UnloadLoraReq)):
                reply = self.update_lora(msg)
                if reply is not None:
                    self.reply(reply)
            else:
                self.emit(self.intake.handle(msg))

    def add_request(self, msg: TokenizedGenerateReq) -> None:
        self.checked_idle = False
        self.emit(self.intake.handle(msg))

    def settle(self) -> None:
        """Wait for the in-flight step and process its results."""
        step = self.overlap.take()
        if step is not None:
            self.finish_step(step)

    def finish_step(self, step: LaunchedStep) -> None:
        if step.hidden is not None:  # its sampling was deferred (process_results)
            self.runner.sample(step)
        eos = self.info.eos_ids
        # a verify step is processed before the next launch even with overlap: what a grammar
        # forces after its tokens joins the next step (jump-forward)
        verified = step.batch.drafts is not None and not self.config.disable_jump_forward
        forced = self.jump_forward or verified
        self.emit(apply_results(step, self.queues, self.cache, eos, forced, self.stats))
        self.retire_loras()

    def emit(self, reqs: list[Req]) -> None:
        if reqs and self.channel is not None:
            self.channel.send("detokenizer", BatchTokenOut([token_out(r) for r in reqs]))

    def reply(self, msg: Message) -> None:
        if self.channel is not None:
            self.channel.send("engine", msg)

    ##### Control #####

    def flush_cache(self) -> FlushCacheOut:
        if self.has_work() or self.grammars.pending:
            return FlushCacheOut(False, "Cache not flushed: there are running or waiting requests.")
        self.cache.tree.reset()
        return FlushCacheOut(True, "Cache flushed.")

    def update_lora(self, msg: LoadLoraReq | UnloadLoraReq) -> LoraOut | None:
        """Load or unload an adapter while serving (every rank alike: they all get the message).
        A refusal changes nothing: 400 for a bad adapter, 404 for an unknown name. A load is
        read off the loop (None now; `lora_replies` answers once it is read), except with
        tensor parallelism, where every rank reads it now and serves it from this step, or
        none does (LoraRuntime.start_load: the ranks agree on the read)."""
        lora = self.runner.lora
        if lora is None:
            return LoraOut(False, "this server was started without LoRA: start it with "
                           "--enable-lora (and --max-lora-rank) or --lora-paths to load adapters "
                           "while serving", {}, 400)  # fmt: skip
        if isinstance(msg, LoadLoraReq):
            try:
                lora.start_load(msg.name, msg.path, background=self.tp is None)
            except ValueError as e:
                return LoraOut(False, str(e), lora.served(), 400)
            return None if self.tp is None else self.lora_replies(wait=True)[0]
        try:
            lora.unload(msg.name)
        except KeyError:
            served = ", ".join(lora.served()) or "none"
            return LoraOut(False, f"unknown LoRA adapter {msg.name!r} (loaded: {served})",
                           lora.served(), 404)  # fmt: skip
        self.retire_loras()
        self.intake.lora_names = frozenset(lora.served())
        message = f"LoRA adapter {msg.name!r} unloaded"
        logger.info(message)
        return LoraOut(True, message, lora.served())

    def lora_replies(self, wait: bool = False) -> list[LoraOut]:
        """The answers to the loads whose read finished (all with `wait`): served from now on,
        or the read's error (a 400: the file and the problem)."""
        lora = self.runner.lora
        if lora is None or not lora.loading:
            return []
        replies = []
        for name, error in lora.finished_loads(wait):
            if error is None:
                message = f"LoRA adapter {name!r} loaded from {lora.adapters[name].path}"
                logger.info(message)
                replies.append(LoraOut(True, message, lora.served()))
                continue
            known = isinstance(error, (ValueError, OSError))  # the loader's: file and problem
            detail = str(error) if known else f"{type(error).__name__}: {error}"
            replies.append(LoraOut(False, detail, lora.served(), 400))
        self.intake.lora_names = frozenset(lora.served())
        return replies

    def retire_loras(self) -> None:
        """Free the unloaded adapters whose last request finished."""
        lora = self.runner.lora
        if lora is None or not lora.retiring:
            return
        queues = self.queues
        reqs = [*queues.waiting, *queues.running, *self.grammars.pending]
        reqs += [queues.chunked] if queues.chunked is not None else []
        lora.retire({r.lora_path for r in reqs if r.lora_path is not None})

    def state(self) -> dict[str, Any]:
        alloc, queues = self.runner.allocator, self.queues
        return {
            "num_running": len(queues.running),
            "num_waiting": len(queues.waiting) + (1 if queues.chunked else 0),
            "max_total_tokens": self.max_total_tokens,
            "free_tokens": alloc.free_slots,
            "evictable_tokens": self.cache.tree.evictable_size(),
            "protected_tokens": self.cache.tree.protected_size(),
            "num_forward_tokens": self.runner.num_forward_tokens,
            "num_forward_passes": self.runner.num_forward_passes,
            "shared_prefix_steps": self.runner.num_shared_prefix_steps,
            "mask_fill": self.runner.mask_fill_stats(),
            "num_compiling": len(self.grammars.pending),
            "new_token_ratio": self.policy.new_token_ratio,
            "page_size": self.runner.page_size,
            **self.swa_state(),
            # objects the collector skips (frozen at start-up) and its passes over the rest
            "gc_frozen": gc.get_freeze_count(),
            "gc_collections": [g["collections"] for g in gc.get_stats()],
            "busy_periods": [list(p) for p in self.clock.busy_periods],
            "kv_samples": [list(s) for s in self.kv_usage.samples],  # [time, held, running]
            **self.stats,
        }

    def swa_state(self) -> dict[str, int]:
        """The hybrid sliding-window pool's sizes (none without one)."""
        alloc = self.runner.allocator
        if not isinstance(alloc, SWAPageAllocator):
            return {}
        return {"max_total_swa_tokens": alloc.swa_total_slots, "swa_free_tokens": alloc.swa_free_slots,
                "swa_window": alloc.window}  # fmt: skip

    ##### The queues and the step in flight, by name (tests and tools read them) #####

    @property
    def waiting(self) -> list[Req]:
        return self.queues.waiting

    @property
    def running(self) -> list[Req]:
        return self.queues.running

    @property
    def inflight(self) -> LaunchedStep | None:
        return self.overlap.inflight
