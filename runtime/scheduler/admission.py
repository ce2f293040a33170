"""Admission by predicted peak KV use: the new-token ratio (SGLang's estimate of how much of its
max_new_tokens a request will use) and the forecast of the KV slots running requests will take."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from weft.runtime.config import EngineConfig
from weft.runtime.scheduler.cache_manager import KVCacheManager
from weft.runtime.scheduler.request import Req

DECODE_RESERVE_CLIP = 4096  # cap on the future tokens one request is assumed to still need


@dataclass
class NewTokenRatio:
    """The share of its remaining max_new_tokens a request without ignore_eos is expected to
    use. It decays (by `decay` a decode step, to `floor`) while decodes fit; a retraction raises
    it to what the requests left running have shown (their decoded share of max_new_tokens,
    plus `retract_steps` tokens each); an idle scheduler starts again from `init`. SGLang's
    policy, except that a retraction never lowers the ratio."""

    init: float
    floor: float
    decay: float
    retract_steps: int
    current: float = field(init=False)

    def __post_init__(self) -> None:
        self.current = self.init

    @classmethod
    def from_config(cls, config: EngineConfig) -> NewTokenRatio:
        init = min(config.init_new_token_ratio * config.schedule_conservativeness, 1.0)
        floor = min(init * config.min_new_token_ratio_factor, 1.0)
        decay = (init - floor) / config.new_token_ratio_decay_steps
        return cls(init, floor, decay, config.retract_decode_steps)

    def decay_step(self) -> None:
        self.current = max(self.current - self.decay, self.floor)

    def reset(self) -> None:
        self.current = self.init

    def raise_after_retract(self, running: list[Req]) -> None:
        """After a retraction, from the requests still running."""
        decoded = sum(len(r.output_ids) for r in running)
        budget = sum(r.max_new_tokens for r in running)
        shown = min((decoded + self.retract_steps * len(running)) / (budget + 1), 1.0)
        self.current = max(self.current, shown)


def expected_new_tokens(req: Req, ratio: float) -> int:
    """The tokens `req` is expected still to generate (each takes a KV slot): all it has left
    with ignore_eos, else `ratio` of it (clipped), and never fewer than min_new_tokens asks."""
    left = req.remaining_new_tokens
    if req.params.ignore_eos:
        return left
    owed = req.params.min_new_tokens - len(req.output_ids) - req.ahead
    return min(left, max(math.ceil(min(left, DECODE_RESERVE_CLIP) * ratio), owed))


class KVForecast:
    """The KV slots the running requests will still take, step by step, as predicted: request i
    grows by a slot a step for e_i steps (`expected_new_tokens`), then finishes and gives back
    r_i slots (`KVCacheManager.releasable`, plus what it grew), `lag` steps later (1 with overlap
    scheduling: a step's results are processed after the next step launched). The demand above
    today's use at step t is

        D(t) = sum over i still running at t of min(t, e_i)  -  sum over i done by t of r_i

    plus page_size - 1 slots per running request for a partly filled page. `peak()` is its
    maximum; admission keeps each new prompt's slots plus the peak within the available ones.
    With exact e_i (ignore_eos; a token a step, so no jump-forward) and a peak that fits, no
    decode step finds the pool full."""

    def __init__(self, cache: KVCacheManager, ratio: float, lag: int, running: list[Req]) -> None:
        self.cache = cache
        self.ratio = ratio
        self.lag = lag
        # (request, slots it will hold beyond those it has now: a prompt's not allocated yet)
        self.counted: list[tuple[Req, int]] = [(req, 0) for req in running]
        self.steps: list[int] = []  # e_i, sorted
        self.released: list[int] = []  # r_i, in the order of `steps`
        self.stale = True  # counted, not yet in steps / released (most steps admit nobody)

    def add(self, req: Req, held: int = 0) -> None:
        """Count `req`, which will also hold `held` slots not allocated yet."""
        self.counted.append((req, held))
        if not self.stale:
            self._insert(*self._entry(req, held))

    def fits(self, req: Req, need: int) -> bool:
        """Whether `req`, whose prompt takes `need` more slots now, fits beside those counted
        (then it is counted too). NOTE: a request that locked a cached prefix may have made
        that prefix stay locked when others finish, so theirs are counted again first. With a
        hybrid sliding-window pool, every request holding KV must also have room to grow to a
        window's worth of SWA pages (`swa_admits`; the chunk's own pages are checked as they
        are allocated)."""
        if need > self.cache.available_tokens or not self.cache.swa_admits():
            return False
        if self.stale or req.prefix_len:
            self._recount()
        entry = self._entry(req, need)
        if need + self.peak(entry) > self.cache.available_tokens:
            return False
        self.counted.append((req, need))
        self._insert(*entry)
        return True

    def entries(self) -> list[tuple[int, int]]:
        """(e_i, r_i) of the requests counted, by e_i."""
        if self.stale:
            self._recount()
        return list(zip(self.steps, self.released, strict=True))

    def peak(self, extra: tuple[int, int] | None = None) -> int:
        """The predicted peak demand in slots, with one more (e, r) entry if given."""
        if self.stale:
            self._recount()
        steps, released = self.steps, self.released
        if extra is not None:
            k = bisect.bisect_right(steps, extra[0])
            steps = [*steps[:k], extra[0], *steps[k:]]
            released = [*released[:k], extra[1], *released[k:]]
        slack, n = self.cache.page_size - 1, len(steps)
        best = done = i = 0
        while i < n:
            e, j, group = steps[i], i, 0
            while j < n and steps[j] == e:
                group += released[j]
                j += 1
            # at t = e + lag those ending later grew e + lag, this group e; the earlier are done
            demand = (n - i) * (e + slack) + (n - j) * self.lag - done
            best = max(best, demand)
            done += group
            i = j
        return best

    def _entry(self, req: Req, held: int) -> tuple[int, int]:
        return expected_new_tokens(req, self.ratio), held + self.cache.releasable(req)

    def _insert(self, steps: int, released: int) -> None:
        k = bisect.bisect_right(self.steps, steps)
        self.steps.insert(k, steps)
        self.released.insert(k, released)

    def _recount(self) -> None:
        entries = sorted(self._entry(req, held) for req, held in self.counted)
        self.steps = [e for e, _ in entries]
        self.released = [r for _, r in entries]
        self.stale = False
