"""StepCosts: whether a decode step verifies drafts, chosen per batch-size class from the step
times and accepted tokens measured while serving."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

# whether to speculate at all (see StepCosts)
STEP_EMA = 0.2  # weight of the newest step in the tokens-per-step average
STEP_SAMPLES = 5  # step times kept per kind and batch-size class (see _typical)
REVISIT_EVERY = 32  # a batch-size class re-measures its less used kind of step this often ...
REVISIT_MAX = 256  # ... twice as rarely after each revisit that kept the choice, up to this
REVISIT_PLAIN_STEPS = 2  # plain steps in a row a revisit runs (the first is timed: see observe)


def size_class(batch_size: int) -> int:
    """Batch sizes measured together: powers of two (1, 2, 4, ...)."""
    return 1 << (batch_size - 1).bit_length()


@dataclass
class ClassCosts:
    """One batch-size class's recent step times (seconds per plain decode step and per verify
    step, the last STEP_SAMPLES of each) and the tokens each request got per verify step (a
    moving average)."""

    decode: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_SAMPLES))
    verify: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_SAMPLES))
    tokens_per_req: float | None = None
    since_revisit: int = 0
    revisit_every: int = REVISIT_EVERY
    plain_left: int = 0  # more plain steps the revisit under way runs
    better: bool | None = None  # whether verify steps paid at the last choice

    @property
    def decode_s(self) -> float | None:
        return _typical(self.decode)

    @property
    def verify_s(self) -> float | None:
        return _typical(self.verify)


class StepCosts:
    """Speculation pays when a verify step gives more tokens per second than a plain decode
    step: tokens_per_req / verify_s >= 1 / decode_s, both measured while serving, per batch-size
    class (the cost of verifying k more tokens per request grows with the batch as the step
    turns from reading weights to computing; acceptance depends on the text). A class first
    tries both kinds of step, then takes the faster, and runs the other kind once after
    REVISIT_EVERY choices so that a change (other text, longer contexts) is seen; each revisit
    that keeps the choice doubles the wait (up to REVISIT_MAX: a slower kind costs under 1% of
    the steps), a flip starts it again from REVISIT_EVERY.

    A plain step is timed only where a plain step follows it: a run of them overlaps each
    step's host work with the next one's device time, but the step before a verify step is
    waited for and its results processed before the drafts are built, a cost that belongs to
    switching kinds and made verify steps look better than they are (in an H100 replay at batch
    64, `benchmarks/spec_replay.py replay`, timed that way, they ran at every step at 0.4x of
    plain decoding). So a class measures plain steps, at first and on revisits,
    REVISIT_PLAIN_STEPS in a row.

    Probing costs what a verify step loses against plain steps, which at large batches is
    several plain steps (an H100 replay at batch 64: verify steps of 17 ms against plain ones
    of 2.6 ms, `benchmarks/spec_replay.py replay`). So a class not yet measured first takes the
    verdict of the nearest measured class, its verify step's extra time over a plain step
    scaled by the batch (the extra is compute, which grows with the tokens verified), and only
    probes where that says speculation may pay; otherwise it measures at its first revisit.
    And a class that chose plain steps waits (1 + the plain steps a verify step loses) times
    longer between revisits, so a revisit's cost stays a small share of the steps."""

    def __init__(self, stats: dict[str, int]) -> None:
        self.stats = stats
        self.classes: dict[int, ClassCosts] = {}
        self._seen = (0, 0)  # verify steps and accepted drafts already counted

    def speculate(self, batch_size: int) -> bool:
        size = size_class(batch_size)
        c = self.classes.setdefault(size, ClassCosts())
        if c.plain_left > 0:
            c.plain_left -= 1
            return False
        if c.verify_s is None:
            better = self._estimate(size, c)
            if better is None or better:
                return True  # a probe: the class's own verify time
        elif c.decode_s is None:
            return False
        else:
            better = _pays(c.tokens_per_req, c.verify_s, c.decode_s)
        if c.better is not None and better != c.better:
            c.revisit_every = REVISIT_EVERY
        c.better = better
        c.since_revisit += 1
        if c.since_revisit < round(c.revisit_every * (1 if better else _revisit_cost(c))):
            return better
        c.since_revisit = 0
        c.revisit_every = min(2 * c.revisit_every, REVISIT_MAX)
        if better:  # a revisit of plain steps: a run of them
            c.plain_left = REVISIT_PLAIN_STEPS - 1
        return not better

    def observe(self, kind: str, batch_size: int, seconds: float, next_kind: str) -> None:
        """StepClock's listener: a decode or verify step took `seconds`, launch to launch, and
        a step of `next_kind` launched next (a plain step counts only before a plain step)."""
        if kind not in ("decode", "verify"):
            return
        c = self.classes.setdefault(size_class(batch_size), ClassCosts())
        if kind == "decode":
            if next_kind == "decode":
                c.decode.append(seconds)
            return
        c.verify.append(seconds)
        steps, accepted = self.stats["spec_verify_steps"], self.stats["spec_accepted_tokens"]
        d_steps, d_acc = steps - self._seen[0], accepted - self._seen[1]
        self._seen = (steps, accepted)
        if d_steps > 0:  # (the verify step's results are processed before the next launch)
            c.tokens_per_req = _ema(c.tokens_per_req, (d_acc + d_steps) / d_steps)

    def _estimate(self, size: int, c: ClassCosts) -> bool | None:
        """Whether verify steps would pay in class `size` (without its own verify time), by
        the nearest class that measured both kinds (the larger of two as near): its tokens per
        request, and its verify step's extra time over a plain step times size / its size, on
        this class's plain step time where it has one. None where no class measured both."""
        known = [(k, o) for k, o in self.classes.items() if o.verify_s and o.decode_s]
        if not known:
            return None
        k, o = min(known, key=lambda ko: (abs(ko[0].bit_length() - size.bit_length()), -ko[0]))
        assert o.verify_s is not None and o.decode_s is not None
        decode = c.decode_s if c.decode_s is not None else o.decode_s
        verify = decode + max(0.0, o.verify_s - o.decode_s) * size / k
        return _pays(o.tokens_per_req, verify, decode)


def _pays(tokens_per_req: float | None, verify_s: float, decode_s: float) -> bool:
    """A verify step's tokens per second at least a plain step's."""
    return (tokens_per_req or 1.0) / verify_s >= 1.0 / decode_s


def _revisit_cost(c: ClassCosts) -> float:
    """1 + the plain steps' worth of time a verify step loses against plain steps (1 where the
    class has not timed both kinds)."""
    if c.verify_s is None or c.decode_s is None:
        return 1.0
    return 1.0 + max(0.0, c.verify_s / c.decode_s - (c.tokens_per_req or 1.0))


def _ema(old: float | None, new: float) -> float:
    return new if old is None else STEP_EMA * new + (1 - STEP_EMA) * old


def _typical(samples: deque[float]) -> float | None:
    """A kind's step time: the median of its recent samples, the smallest while there are
    fewer than 3 (a class's first step of a kind may carry one-time costs, and a moving
    average kept such an outlier for many revisits, each of which adds one sample)."""
    if not samples:
        return None
    return min(samples) if len(samples) < 3 else statistics.median(samples)
