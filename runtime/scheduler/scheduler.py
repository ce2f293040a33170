"""Scheduler: the loop (receive -> schedule -> run -> process results) and its process entry point."""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

from weft.radix import NoCache, PrefixCache, RadixCache
from weft.runtime.config import EngineConfig
from weft.runtime.executor.batch import Batch, ForwardMode
from weft.runtime.executor.distributed import TPGroup, batch_digest, init_tp_group
from weft.runtime.executor.model_runner import ModelRunner
from weft.runtime.executor.step import LaunchedStep
from weft.runtime.ipc.channel import Channel, Endpoints, run_child
from weft.runtime.ipc.messages import (
    BatchTokenOut,
    FinishReason,
    Message,
)
from weft.runtime.loader import load_tokenizer, read_hf_config
from weft.runtime.loader.model_info import ModelInfo
from weft.runtime.scheduler.cache_manager import KVCacheManager
from weft.runtime.scheduler.decode import (
    build_decode_batch,
    mix_decode,
    pages_for_decode,
    retract_for_decode,
)
from weft.runtime.scheduler.finish import check_finish, jump_forward, token_out
from weft.runtime.scheduler.grammar import GrammarQueue
from weft.runtime.scheduler.intake import RequestIntake
from weft.runtime.scheduler.prefill import (
    PrefillAdder,
    SharedPrefixGate,
    decode_reserve,
    order_waiting,
)
from weft.runtime.scheduler.request import Req

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
FOLLOWER_GRAMMAR_TIMEOUT_SCALE = 4  # followers only wait for compiles rank 0 finished
BUSY_PERIODS = 64  # the last busy periods kept for get_state
STATS: dict[str, int] = {  # the scheduler's counters, from zero
    "retractions": 0,
    "prompt_tokens": 0,
    "cached_tokens": 0,
    "overlapped_steps": 0,  # launched while the step before was still in flight
    "mixed_steps": 0,  # prefill steps that also decoded running requests
    # steps launched per kind, and their launch-to-launch wall time in µs (with overlap, the
    # device's time of each step); a step followed by an idle wait adds no time
    **{f"{kind}_{unit}": 0 for kind in ("extend", "decode") for unit in ("steps", "us")},
}


class Scheduler(RequestIntake):
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
        self.tokenizer = load_tokenizer(model_path)
        self.runner = ModelRunner(config, model_path, hf_config, self.info.context_len, tp)
        self.runner.stop_ids = self.info.eos_ids
        tree: PrefixCache = (
            NoCache(self.runner.allocator, self.runner.page_size)
            if config.disable_radix_cache
            else RadixCache(self.runner.allocator, self.runner.page_size)
        )
        self.cache = KVCacheManager(self.runner.allocator, tree, self.runner.req_to_token)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.arrivals = 0
        self.stats = dict(STATS)
        self._last_launch: tuple[str, float] | None = None
        # (first launch, idle again) per busy period, time.perf_counter() seconds: the clock is
        # the machine's monotonic one, so a client on the same machine places its requests in it
        self.busy_periods: deque[tuple[float, float]] = deque(maxlen=BUSY_PERIODS)
        self._busy_since: float | None = None
        self.checked_idle = True
        scale = 1 if self.is_leader else FOLLOWER_GRAMMAR_TIMEOUT_SCALE
        self.grammars = GrammarQueue(
            config,
            self.tokenizer,
            self.info.vocab_size,
            self.info.eos_ids,
            timeout_s=config.grammar_timeout * scale,
        )
        if self.runner.device.type == "cuda":  # a server: no ~1 s stall at the first schema
            self.grammars.start_backend()
        self.overlap = config.resolved_overlap
        # NOTE: with overlap, forced tokens are sampled one by one (the mask allows only them: the
        # same output). Appending them would make the next step an eager extend that no step
        # can overlap, and with many constrained requests some always have forced tokens.
        self.jump_forward = not config.disable_jump_forward and not self.overlap
        self.inflight: LaunchedStep | None = None  # launched, results not yet processed

    @property
    def max_total_tokens(self) -> int:
        return self.runner.allocator.total_slots

    ##### The loop #####

    def run_forever(self, parent_pid: int) -> None:
        """receive -> schedule -> run -> process results, until the parent is gone. With overlap
        scheduling the results processed are those of the step before: the host works on them
        while the device runs the step just launched."""
        while True:
            self.receive(parent_pid)
            batch = self.schedule()
            step = self.launch(batch)
            self.process_results(step)

    def receive(self, parent_pid: int) -> None:
        """Wait for something to do (rank 0 reads the channel and shares it), then apply it."""
        if not self.has_work():
            self._last_launch = None  # the last step is followed by a wait: not counted
            if self._busy_since is not None:
                self.busy_periods.append((self._busy_since, time.perf_counter()))
                self._busy_since = None
        inbox = self.collect(parent_pid) if self.is_leader else None
        if self.tp is not None:
            if not self.is_leader and not self.has_work() and not self.grammars.pending:
                self.on_idle()
            inbox = self.tp.share_inbox(inbox)
        assert inbox is not None
        self.apply(inbox)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.inflight)

    def on_idle(self) -> None:
        """Runs once each time the scheduler becomes idle: the KV conservation check."""
        if not self.checked_idle:
            self.cache.check_conservation()
            self.checked_idle = True

    ##### Scheduling #####

    def schedule(self) -> Batch | None:
        """The next batch: a prefill if any request can be admitted, else a decode of the running
        requests. With tensor parallelism every rank must pick the same one (checked)."""
        batch = None
        if self.inflight is not None and not self.can_continue(self.inflight):
            batch = self.prefill_behind(self.inflight)
            if batch is None:
                self.settle()
        if batch is None:
            batch = self.pick_batch()
        if self.tp is not None:
            self.tp.check_agree(batch_digest(batch), "the batch to run")
        return batch

    def can_continue(self, step: LaunchedStep) -> bool:
        """Whether the next step may be launched before `step`'s tokens are known on the host:
        after a decode step, with room for one more token per request. (Its model input is
        `step`'s tokens on the device; its sampling waits until `step`'s results are processed,
        so grammar masks, penalties and min_new_tokens see every token before it.)"""
        return (
            self.overlap
            and step.batch.mode == ForwardMode.DECODE
            and pages_for_decode(self.running, self.cache) * self.cache.page_size
            <= self.cache.available_tokens
        )

    def prefill_behind(self, step: LaunchedStep) -> Batch | None:
        """With overlap, the next prefill, launched while prefill `step` is in flight: it needs
        none of that step's tokens, so the device does not idle while the host builds and queues
        it (~85 ms for an 8k-token step of Llama-3.1-8B on the H200 at new token counts). Not
        with mixed steps (they decode `step`'s requests) or when a chunked request that owes
        prompt logprobs goes on (its next chunk's rows depend on `step`'s). NOTE: `step`'s
        prompts reach the tree when it is processed; a prompt sharing fewer than
        IN_BATCH_PREFIX_TOKENS new tokens with one of them does not wait and computes them."""
        if not self.overlap or step.batch.mode != ForwardMode.EXTEND:
            return None
        if self.config.enable_mixed_chunk or (self.chunked and self.chunked.return_logprob):
            return None
        return self.schedule_prefill(behind=step.batch)

    def pick_batch(self) -> Batch | None:
        batch = self.schedule_prefill()
        if batch is not None:
            if not self.config.enable_mixed_chunk:
                return batch
            mixed = mix_decode(batch, self.decoding(), self.cache)
            self.stats["mixed_steps"] += len(mixed.reqs) > len(batch.reqs)
            return mixed
        if self.inflight is not None:
            going = self.decoding()
            retracted: list[Req] = []  # can_continue checked that one more token fits
        else:
            retracted = retract_for_decode(self.running, self.cache)
            self.running = going = [r for r in self.running if r not in retracted]
        if retracted:
            self.stats["retractions"] += len(retracted)
            self.waiting += retracted
            self.new_token_ratio = min(1.0, self.new_token_ratio + 0.3)
            logger.info("KV pool full: retracted %d request(s)", len(retracted))
        else:
            self.new_token_ratio = max(
                MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
            )
        return build_decode_batch(going, self.cache) if going else None

    def decoding(self) -> list[Req]:
        """The running requests that run a token next (overlap: those whose token in flight is
        their last sit out)."""
        if self.inflight is None:
            return list(self.running)
        return [r for r in self.running if r.remaining_new_tokens > 0]

    def schedule_prefill(self, behind: Batch | None = None) -> Batch | None:
        """The next prefill batch. `behind`: a prefill still in flight (`prefill_behind`); its
        requests count as running, and the prompts it computes are not in the tree until it is
        processed, so requests that would share them wait (SharedPrefixGate)."""
        if not self.waiting and self.chunked is None:
            return None
        joining = behind.reqs if behind is not None else []
        running = self.running + [r for r in joining if r is not self.chunked and not r.finished]
        mixed = len(self.running) if self.config.enable_mixed_chunk else 0  # decode tokens too
        adder = PrefillAdder(
            cache=self.cache,
            token_budget=max(self.config.max_prefill_tokens - mixed, 1),
            chunk_size=self.config.chunked_prefill_size,
            max_new_reqs=self.config.max_running_requests - len(running),
            reserved=decode_reserve(running, self.new_token_ratio),
            new_token_ratio=self.new_token_ratio,
            idle=not running,
        )
        gate = None if self.config.disable_radix_cache else SharedPrefixGate()
        if gate is not None and behind is not None:
            for req, n in zip(behind.reqs, behind.extend_lens, strict=True):
                gate.admitted(req, start=req.kv_len - n)
        if self.chunked is not None:
            chunked = self.chunked
            added = adder.add(chunked)  # (when refused, no side effect: it holds its slots)
            if not added and behind is not None:  # its chunk in flight is not processed yet
                return None  # settle first
            self.chunked = None
            if not added:  # no room to go on: give its KV to the tree, retry later
                self.cache.cache_req(chunked, release=True)
                self.waiting.insert(0, chunked)
            elif gate is not None:  # what its next chunk computes, followers wait for
                gate.admitted(chunked)
        if adder.chunked is None:
            for req in order_waiting(self.waiting, self.config.schedule_policy, self.cache):
                if gate is not None and gate.should_wait(req):
                    continue
                if not adder.add(req):
                    break
                if gate is not None:
                    gate.admitted(req)
        batch = adder.batch()
        if batch is None:
            return None
        admitted = set(map(id, batch.reqs))
        self.waiting = [r for r in self.waiting if id(r) not in admitted]
        self.chunked = adder.chunked
        for req in batch.reqs:
            if not req.admitted:
                req.admitted = True
                req.cached_tokens = req.prefix_len
        return batch

    ##### Results out #####

    def launch(self, batch: Batch | None) -> LaunchedStep | None:
        """Queue the batch on the device. Its requests' KV now counts as computed, and a token it
        samples is `ahead` (known on the device only) until its results are processed."""
        now = time.perf_counter()
        if self._last_launch is not None:
            kind, at = self._last_launch
            self.stats[f"{kind}_us"] += int((now - at) * 1e6)
        if batch is None:
            self._last_launch = None
            return None
        if self._busy_since is None:
            self._busy_since = now
        # NOTE: counted here, not when the next launch times it: a get_state answered in between
        # sees every step whose results it may have seen
        kind = "decode" if batch.mode == ForwardMode.DECODE else "extend"
        self.stats[f"{kind}_steps"] += 1
        self._last_launch = (kind, now)
        deferred = self.inflight  # its sampling, if deferred (process_results), comes first
        if deferred is not None and deferred.hidden is None:
            deferred = None
        step = self.runner.launch(batch, deferred)
        self.stats["overlapped_steps"] += self.inflight is not None
        for req, n in zip(batch.reqs, batch.extend_lens, strict=True):
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
        model), then sample `step`; without overlap, wait for `step` and process it. With
        overlap a step with grammar masks samples at the next launch (or its processing): the
        masks just started compute while the loop receives and schedules."""
        older, self.inflight = self.inflight, step
        if older is not None:
            self.finish_step(older)
        if step is not None and not (self.overlap and step.masked):
            self.runner.sample(step)
        if not self.overlap:
            self.settle()

    def settle(self) -> None:
        """Wait for the in-flight step and process its results."""
        step, self.inflight = self.inflight, None
        if step is not None:
            self.finish_step(step)

    def finish_step(self, step: LaunchedStep) -> None:
        if step.hidden is not None:  # its sampling was deferred (process_results)
            self.runner.sample(step)
        self.emit(self._finish_reqs(step))

    def _finish_reqs(self, step: LaunchedStep) -> list[Req]:
        """Add `step`'s tokens to its requests; the requests to report."""
        batch, results = step.batch, step.resolve()
        report: list[Req] = []
        was_running = set(map(id, self.running))
        joined: list[Req] = []  # requests whose prefill completed this step
        sampled = set(step.samplers)
        for i, (req, res) in enumerate(zip(batch.reqs, results, strict=True)):
            if i in sampled:
                req.ahead -= 1
            if req.finished:  # ended by a token of the step before (overlap): nothing to add
                continue
            if req.return_logprob:  # (no logprob work on the decode hot path otherwise)
                res.add_logprobs_to(req)
            if (step.kv_ends[i] if step.kv_ends else req.kv_len) < req.seq_len:
                self.cache.cache_req(req, release=False)  # a chunk: share what is done
                if req.stream and req.in_logprobs:
                    report.append(req)
                continue
            if id(req) not in was_running:
                joined.append(req)
                if not req.counted:
                    req.counted = True
                    self.stats["prompt_tokens"] += len(req.input_ids)
                    self.stats["cached_tokens"] += req.cached_tokens
            if res.next_id is None:
                req.finish = FinishReason("length", length=req.max_new_tokens)
            else:
                req.output_ids.append(res.next_id)
                req.finish = check_finish(req, res.next_id, self.info.eos_ids)
                if self.jump_forward and req.finish is None and not req.return_logprob:
                    jump_forward(req, self.info.eos_ids)
            if req.finished:
                self.cache.cache_req(req, release=True)
            elif batch.mode == ForwardMode.EXTEND and id(req) not in was_running:
                self.cache.cache_req(req, release=False)  # its prompt, for others to share
            if req.finished or req.stream:
                report.append(req)
        self.running = [r for r in self.running + joined if not r.finished]
        return report

    def emit(self, reqs: list[Req]) -> None:
        if reqs and self.channel is not None:
            self.channel.send("detokenizer", BatchTokenOut([token_out(r) for r in reqs]))

    def reply(self, msg: Message) -> None:
        if self.channel is not None:
            self.channel.send("engine", msg)


def run_scheduler_process(
    config: EngineConfig, model_path: str, ends: Endpoints, parent: int, tp_rank: int = 0
) -> None:
    """Entry point of a scheduler child process (tensor-parallel rank `tp_rank`)."""

    def start(channel: Channel | None) -> tuple[Scheduler, dict[str, Any]]:
        t0 = time.perf_counter()
        tp = None
        if config.tp_size > 1:
            tp = init_tp_group(tp_rank, config.tp_size, config.resolved_device, ends.tp_init)
        scheduler = Scheduler(config, Path(model_path), channel, tp)
        info = {
            "max_total_tokens": scheduler.max_total_tokens,
            "page_size": scheduler.runner.page_size,
            "load_seconds": round(time.perf_counter() - t0, 2),
            "pid": os.getpid(),
            "tp_size": config.tp_size,
        }
        return scheduler, info

    if tp_rank == 0:
        peers = {"detokenizer": ends.detokenizer, "engine": ends.engine}
        name, listen = "scheduler", ends.scheduler
    else:
        peers, name, listen = {}, f"scheduler-{tp_rank}", None
    run_child(name, config.log_level, listen, peers, start, lambda s: s.run_forever(parent))
