"""Overlap scheduling's one owner: the step launched and not processed yet, and the rules for
launching the next step before its results are known on the host."""

from __future__ import annotations

from weft.runtime.executor.batch import ForwardMode
from weft.runtime.executor.step import LaunchedStep
from weft.runtime.scheduler.cache_manager import KVCacheManager
from weft.runtime.scheduler.decode import pages_for_decode
from weft.runtime.scheduler.request import Req


class Overlap:
    """With overlap on (`enabled`), the scheduler launches step t+1 while the device runs step t,
    then processes step t's results: the host's work hides behind the device's. Step t+1's input
    tokens are step t's sampled ids, still on the device (`Req.ahead`); it samples only after
    step t is processed, so grammar masks, penalties and min_new_tokens see every token. Without
    overlap each step is processed as soon as it is launched (`settles_at_once`)."""

    def __init__(self, enabled: bool, mixed_chunk: bool) -> None:
        self.enabled = enabled
        self.mixed_chunk = mixed_chunk
        self.inflight: LaunchedStep | None = None  # launched, results not yet processed

    def decode_continues(self, running: list[Req], cache: KVCacheManager) -> bool:
        """Whether the next decode may launch before the in-flight step's tokens are on the
        host: after a decode step, with room for one more token per request."""
        step = self.inflight
        return (
            self.enabled
            and step is not None
            and step.batch.mode == ForwardMode.DECODE
            and pages_for_decode(running, cache) * cache.page_size <= cache.available_tokens
        )

    def prefill_may_follow(self, chunked: Req | None) -> bool:
        """Whether a prefill may launch while the prefill in flight runs: its requests need none
        of that step's tokens, so the device does not idle while the host builds and queues the
        next one (~85 ms for an 8k-token step of Llama-3.1-8B on the H200 at new token counts).
        Not with mixed steps (they decode the step's requests), behind a verify step (speculative
        decoding: its drafts' slots settle when it is processed), or when a chunked request that
        owes prompt logprobs goes on (its next chunk's rows depend on the step's)."""
        step = self.inflight
        return (
            self.enabled
            and step is not None
            and step.batch.mode == ForwardMode.EXTEND
            and step.batch.drafts is None
            and not self.mixed_chunk
            and not (chunked is not None and chunked.return_logprob)
        )

    def decoding(self, running: list[Req]) -> list[Req]:
        """The running requests that run a token next (those whose token in flight is their
        last sit out)."""
        if self.inflight is None:
            return list(running)
        return [r for r in running if r.remaining_new_tokens > 0]

    def deferred(self) -> LaunchedStep | None:
        """The in-flight step whose sampling waits for the next launch (a step with grammar
        masks: its masks compute while the loop receives and schedules)."""
        step = self.inflight
        return step if step is not None and step.hidden is not None else None

    def samples_at_launch(self, step: LaunchedStep) -> bool:
        """Whether `step` samples right after its launch (else at the next launch, `deferred`)."""
        return not (self.enabled and step.masked)

    @property
    def settles_at_once(self) -> bool:
        return not self.enabled

    def push(self, step: LaunchedStep | None) -> LaunchedStep | None:
        """Make `step` the one in flight; returns the step before it, whose results are due."""
        older, self.inflight = self.inflight, step
        return older

    def take(self) -> LaunchedStep | None:
        """The in-flight step, whose results are due now; none is in flight after."""
        step, self.inflight = self.inflight, None
        return step
