"""The batch policy: each step, a prefill of waiting requests if any can be admitted (within the
token budget, chunking long prompts, behind a prefill in flight with overlap, by the predicted
peak KV use), else a decode of the running requests, retracting the newest when the KV pool runs
out."""

from __future__ import annotations

import logging

from weft.runtime.config import EngineConfig
from weft.runtime.executor.batch import Batch
from weft.runtime.scheduler.admission import KVForecast, NewTokenRatio
from weft.runtime.scheduler.cache_manager import KVCacheManager
from weft.runtime.scheduler.decode import build_decode_batch, mix_decode, retract_for_decode
from weft.runtime.scheduler.overlap import Overlap
from weft.runtime.scheduler.prefill import PrefillAdder, SharedPrefixGate, order_waiting
from weft.runtime.scheduler.request import Queues, Req
from weft.runtime.scheduler.speculative import Speculator

logger = logging.getLogger(__name__)


class BatchPolicy:
    """Chooses the next batch from the queues (and changes them: admitted requests leave
    `waiting`, retracted ones go back to it). A prompt is admitted when its slots and the peak
    of the KV use predicted for it and the running requests fit (`KVForecast`); `ratio` says
    how much of their max_new_tokens requests without ignore_eos are expected to use: it
    decays while decodes fit and rises after a retraction, as in SGLang."""

    def __init__(
        self,
        config: EngineConfig,
        cache: KVCacheManager,
        queues: Queues,
        overlap: Overlap,
        stats: dict[str, int],
        speculator: Speculator | None = None,
    ) -> None:
        self.config = config
        self.speculator = speculator  # decode steps verify drafts
        self.cache = cache
        self.queues = queues
        self.overlap = overlap
        self.stats = stats
        self.ratio = NewTokenRatio.from_config(config)

    @property
    def new_token_ratio(self) -> float:
        return self.ratio.current

    def next_batch(self) -> Batch | None:
        """A prefill if any request can be admitted (mixed with the running decodes under
        enable_mixed_chunk), else a decode of the running requests."""
        batch = self.prefill()
        if batch is not None:
            if not self.config.enable_mixed_chunk:
                return batch
            decoding = self.overlap.decoding(self.queues.running)
            if not self.cache.swa_fits(decoding):  # they decode in the next step instead
                decoding = []
            mixed = mix_decode(batch, decoding, self.cache)
            self.stats["mixed_steps"] += len(mixed.reqs) > len(batch.reqs)
            return mixed
        return self.decode()

    def decode(self) -> Batch | None:
        """The running requests' next tokens; without a step in flight, the newest retracted
        first where they do not fit (with one, `Overlap.decode_continues` checked that they do)."""
        queues = self.queues
        retracted: list[Req] = []
        if self.overlap.inflight is not None:
            going = self.overlap.decoding(queues.running)
        else:
            retracted = retract_for_decode(queues.running, self.cache)
            retracted += retract_for_swa([r for r in queues.running if r not in retracted],
                                         self.cache)  # fmt: skip
            queues.running = going = [r for r in queues.running if r not in retracted]
        if retracted:
            self.stats["retractions"] += len(retracted)
            queues.waiting += retracted
            was = self.ratio.current
            self.ratio.raise_after_retract(going)
            logger.info(
                "KV pool full: retracted %d request(s); new_token_ratio %.3f -> %.3f",
                len(retracted),
                was,
                self.ratio.current,
            )
        else:
            self.ratio.decay_step()
        if not going:
            return None
        if self.speculator is not None:
            return self.speculator.build(going)
        return build_decode_batch(going, self.cache)

    def prefill(self, behind: Batch | None = None) -> Batch | None:
        """The next prefill batch. `behind`: a prefill still in flight (Overlap); its requests
        count as running, and the prompts it computes are not in the tree until it is
        processed, so requests that would share them wait (SharedPrefixGate). NOTE: a prompt
        sharing fewer than IN_BATCH_PREFIX_TOKENS new tokens with one of them does not wait
        and computes them."""
        queues, config = self.queues, self.config
        if not queues.waiting and queues.chunked is None:
            return None
        joining = behind.reqs if behind is not None else []
        chunked = queues.chunked
        running = queues.running + [r for r in joining if r is not chunked and not r.finished]
        mixed = len(queues.running) if config.enable_mixed_chunk else 0  # decode tokens too
        forecast = KVForecast(self.cache, self.ratio.current, int(self.overlap.enabled), running)
        adder = PrefillAdder(
            cache=self.cache,
            token_budget=max(config.max_prefill_tokens - mixed, 1),
            chunk_size=config.chunked_prefill_size,
            max_new_reqs=config.max_running_requests - len(running),
            forecast=forecast,
            idle=not running,
        )
        gate = None if config.disable_radix_cache else SharedPrefixGate()
        if gate is not None and behind is not None:
            for req, n in zip(behind.reqs, behind.extend_lens, strict=True):
                gate.admitted(req, start=req.kv_len - n)
        if chunked is not None:
            added = adder.add(chunked)  # (when refused, no side effect: it holds its slots)
            if not added and behind is not None:  # its chunk in flight is not processed yet
                return None  # settle first
            queues.chunked = None
            if not added:  # no room to go on: give its KV to the tree, retry later
                self.cache.cache_req(chunked, release=True)
                queues.waiting.insert(0, chunked)
            elif gate is not None:  # what its next chunk computes, followers wait for
                gate.admitted(chunked)
        if adder.chunked is None:
            for req in order_waiting(queues.waiting, config.schedule_policy, self.cache):
                if gate is not None and gate.should_wait(req):
                    continue
                if req.row is None and self.cache.lora_blocked(req):
                    continue  # every adapter slot is pinned by others: it waits for one
                if not adder.add(req):
                    break
                if gate is not None:
                    gate.admitted(req)
        batch = adder.batch()
        if batch is None:
            return None
        admitted = set(map(id, batch.reqs))
        queues.waiting = [r for r in queues.waiting if id(r) not in admitted]
        queues.chunked = adder.chunked
        for req in batch.reqs:
            if not req.admitted:
                req.admitted = True
                req.cached_tokens = req.prefix_len
        return batch


def retract_for_swa(running: list[Req], cache: KVCacheManager) -> list[Req]:
    """Retract the newest requests until the SWA pool has the pages of one decode step of the
    rest (`retract_for_decode` for the hybrid sliding-window pool; the oldest always stays)."""
    retracted: list[Req] = []
    by_age = sorted(running, key=lambda r: r.arrival)
    while len(by_age) > 1 and not cache.swa_fits(by_age):
        victim = by_age.pop()
        cache.cache_req(victim, release=True)  # its window's SWA KV goes to the tree, reclaimable
        victim.num_retractions += 1
        retracted.append(victim)
    return retracted
