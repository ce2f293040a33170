"""The scheduler's counters and clock: steps launched per kind and their launch-to-launch time,
the last busy periods (first launch to idle again), and the KV pool's use over time."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from weft.runtime.executor.batch import Batch, ForwardMode

BUSY_PERIODS = 64  # the last busy periods kept for get_state
KV_SAMPLES = 512  # most KV-use samples kept (when full: every other one, at half the rate)
KV_SAMPLE_S = 0.02  # the first sampling interval
COUNTERS = (
    "retractions",
    # KV slots held by requests (neither free nor evictable) summed over launched steps: the
    # difference of two get_states over that of the steps is the mean held per step
    "kv_held_step_sum",
    "prompt_tokens",
    "cached_tokens",
    "overlapped_steps",  # launched while the step before was still in flight
    "mixed_steps",  # prefill steps that also decoded running requests
    # speculative decoding: requests' verify steps (one per request and step), their drafts and
    # the drafts accepted (mean accepted length = (accepted + steps) / steps, as SGLang's)
    "spec_verify_steps",
    "spec_draft_tokens",
    "spec_accepted_tokens",
    # steps launched per kind, and their launch-to-launch wall time in µs (with overlap, the
    # device's time of each step); a step followed by an idle wait adds no time
    *(f"{kind}_{unit}" for kind in ("extend", "decode", "verify") for unit in ("steps", "us")),
)


class StepClock:
    """Counts (`counts`, from zero) and times the steps, and keeps the busy periods on
    time.perf_counter()'s clock: the machine's monotonic one, so a client on the same machine
    places its requests in them."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.busy_periods: deque[tuple[float, float]] = deque(maxlen=BUSY_PERIODS)
        self._busy_since: float | None = None
        self._last_launch: tuple[str, float, int] | None = None  # kind, time, batch size
        # told each timed step: (kind, batch size, seconds launch to launch, the kind of the
        # step launched after it)
        self.listener: Callable[[str, int, float, str], None] | None = None

    def launching(self, batch: Batch | None, prepared_s: float = 0.0) -> None:
        """A step is about to launch (None: none is): the time since the last launch goes to
        that step's kind. `prepared_s`: host time this step's own build took (the draft model's
        proposals for a verify step), timed as part of this step, not of the one before. NOTE:
        counted here, not when the next launch times it, so that a get_state answered in between
        sees every step whose results it may have seen."""
        now = time.perf_counter() - prepared_s
        kind = (
            "none"
            if batch is None
            else "verify"
            if batch.drafts is not None
            else "decode"
            if batch.mode == ForwardMode.DECODE
            else "extend"
        )
        if self._last_launch is not None:
            last, at, size = self._last_launch
            self.counts[f"{last}_us"] += int((now - at) * 1e6)
            if self.listener is not None:
                self.listener(last, size, now - at, kind)
        if batch is None:
            self._last_launch = None
            return
        if self._busy_since is None:
            self._busy_since = now
        self.counts[f"{kind}_steps"] += 1
        self._last_launch = (kind, now, batch.size)

    def idle(self) -> None:
        """Nothing to do: the last step is followed by a wait (not counted), a busy period ends."""
        self._last_launch = None
        if self._busy_since is not None:
            self.busy_periods.append((self._busy_since, time.perf_counter()))
            self._busy_since = None


class KVUsage:
    """The KV slots held by requests (neither free nor evictable) and the requests running, at a
    step's launch, sampled at most every `interval` seconds on time.perf_counter()'s clock. When
    KV_SAMPLES are kept, every other one goes and the interval doubles: the samples span the
    scheduler's whole life, evenly."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, int]] = []  # (time, slots held, requests running)
        self.interval = KV_SAMPLE_S
        self._last = -float("inf")

    def record(self, held: int, running: int) -> None:
        now = time.perf_counter()
        if now - self._last < self.interval:
            return
        self._last = now
        self.samples.append((now, held, running))
        if len(self.samples) >= KV_SAMPLES:
            self.samples = self.samples[::2]
            self.interval *= 2
