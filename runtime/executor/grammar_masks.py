"""Grammar masks of a step: each constrained request's bitmask row (its request slot), filled on the
scheduler thread (usually a wait: the grammar worker prefetched it into the row), then applied to
the logits in one op; and the fill / apply timings the engine reports."""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

import torch

from weft.constrain import allocate_bitmask, apply_bitmask
from weft.runtime.executor.transfer import to_device

if TYPE_CHECKING:
    from weft.runtime.scheduler.request import Req

MASK_FILL_WINDOW = 10_000
COPY_RUN_BYTES = 64 << 10  # H2D: rows between two used ones are copied along below this gap


class GrammarMasks:
    """One int32 [max_reqs, ceil(V/32)] bitmask, row = request slot (pinned with CUDA; with CUDA
    also a device copy of it, refreshed per step for the rows that step uses)."""

    def __init__(self, max_reqs: int, vocab_size: int, device: torch.device, fused: bool) -> None:
        self.max_reqs, self.vocab_size = max_reqs, vocab_size
        self.device, self.fused = device, fused
        self.bitmask: torch.Tensor | None = None  # allocated on first use
        self._on_device: torch.Tensor | None = None
        # per constrained request and step: ns the scheduler thread spent in fill_bitmask (a mask
        # prefetched into the request's row is only waited for there); per step with masks: ns in
        # their apply (CPU: the masking itself; CUDA: queueing the copies and the kernel)
        self.fill_ns: deque[int] = deque(maxlen=MASK_FILL_WINDOW)
        self.apply_ns: deque[int] = deque(maxlen=MASK_FILL_WINDOW)
        self.num_fills = 0

    def warm_up(self, logits_dtype: torch.dtype) -> None:
        """CUDA with the fused apply: launch it once per variant a step can take, so that the
        first constrained step neither compiles nor loads the Triton kernel. (Triton specializes
        on 16-byte-aligned pointers: `apply`'s mask-row indices start 8 bytes per masked row
        into the index tensor, so odd and even counts are two variants; and on the logits'
        dtype, the model's.)"""
        if self.device.type != "cuda" or not self.fused:
            return
        from weft.kernels.bitmask import apply_token_bitmask

        words = (self.vocab_size + 31) // 32
        mask = torch.full((2, words), -1, dtype=torch.int32, device=self.device)
        logits = torch.zeros(2, self.vocab_size, dtype=logits_dtype, device=self.device)
        for n in (1, 2):
            index = to_device(list(range(n)) * 2, torch.int64, self.device)
            apply_token_bitmask(logits, mask, rows=index[:n], mask_rows=index[n:])

    def fill(self, reqs: list[Req], samplers: list[int]) -> list[int]:
        """The masks of the constrained requests among `samplers` (batch indices), each in the row
        of its request slot; their batch indices. (A request that ended since the launch, overlap
        scheduling, samples unmasked: its token is dropped.)"""
        constrained = [i for i in samplers if reqs[i].grammar is not None and not reqs[i].finished]
        if constrained and self.bitmask is None:
            self.bitmask = allocate_bitmask(self.max_reqs, self.vocab_size)
        clock = time.perf_counter_ns
        for i in constrained:
            assert self.bitmask is not None and reqs[i].row is not None
            t0 = clock()
            reqs[i].grammar.fill_bitmask(self.bitmask, reqs[i].row, bind=True)
            self.fill_ns.append(clock() - t0)
        self.num_fills += len(constrained)
        return constrained

    def apply(
        self, reqs: list[Req], samplers: list[int], masked: list[int], logits: torch.Tensor
    ) -> None:
        """Mask the logits rows (positions in `samplers`) of the `masked` batch indices with their
        requests' rows.

        NOTE: with CUDA the used rows are copied asynchronously from pinned memory, so they must
        not change until the copy ran: a matcher's worker writes its row's next mask only after
        its next accept, and every accept comes after this step's sampled tokens reached the host
        (LaunchedStep.resolve waits for an event recorded after this copy). Keep every accept (and
        rollback) after that wait. Rows between two used ones may be copied along while their
        owners' workers write them: they are not read.
        """
        assert self.bitmask is not None
        where = {i: k for k, i in enumerate(samplers)}
        slots = [_row(reqs[i]) for i in masked]
        t0 = time.perf_counter_ns()
        mask = self._copy_rows(slots) if self.device.type == "cuda" else self.bitmask
        index = to_device([where[i] for i in masked] + slots, torch.int64, self.device)
        rows, mask_rows = index[: len(masked)], index[len(masked) :]
        if self.fused:
            from weft.kernels.bitmask import apply_token_bitmask

            apply_token_bitmask(logits, mask, rows=rows, mask_rows=mask_rows)
        else:
            apply_bitmask(logits, mask, rows=rows, mask_rows=mask_rows)
        self.apply_ns.append(time.perf_counter_ns() - t0)

    def apply_drafts(self, items: list[tuple[Req, list[int], int]], logits: torch.Tensor) -> None:
        """Mask a verify step's rows of constrained requests with drafts: for (req, drafts,
        first logits row), row first + j gets the grammar's mask after the first j drafts (the
        matcher accepts them, then rolls back). A draft the grammar refuses (it checked them when
        they were drafted, so only a failing backend) ends the walk: later rows keep the last
        mask, and the target, masked, rejects that draft anyway."""
        total = sum(len(d) + 1 for _, d, _ in items)
        buf = allocate_bitmask(total, self.vocab_size)
        rows: list[int] = []
        for req, drafts, first in items:
            grammar = req.grammar
            taken = 0
            for j in range(len(drafts) + 1):
                k = len(rows)
                if j <= taken:
                    grammar.fill_bitmask(buf, k)
                else:
                    buf[k] = buf[k - 1]
                rows.append(first + j)
                if j == taken and j < len(drafts) and grammar.accept_token(drafts[j]):
                    taken += 1
            grammar.rollback(taken)
        self.num_fills += total
        mask = buf.to(self.device) if self.device.type == "cuda" else buf
        index = to_device(rows + list(range(total)), torch.int64, self.device)
        if self.fused:
            from weft.kernels.bitmask import apply_token_bitmask

            apply_token_bitmask(logits, mask, rows=index[:total], mask_rows=index[total:])
        else:
            apply_bitmask(logits, mask, rows=index[:total], mask_rows=index[total:])

    def stats(self) -> dict[str, float]:
        """The fill time per constrained request and step on the scheduler thread, in µs: the
        count of all fills and the median / p99 of the last MASK_FILL_WINDOW; and the apply's per
        step with masks (`apply_*`). The worker's mask computation is on neither."""
        if not self.fill_ns:
            return {"count": 0}
        (p50, p99), (apply_p50, apply_p99) = map(_p50_p99, (self.fill_ns, self.apply_ns))
        return {
            "count": self.num_fills,
            "p50_us": p50,
            "p99_us": p99,
            "apply_p50_us": apply_p50,
            "apply_p99_us": apply_p99,
        }

    ##### Internal Helper Functions #####

    def _copy_rows(self, slots: list[int]) -> torch.Tensor:
        """The device bitmask with `slots`' rows refreshed from the host: one async copy per run
        of used rows (rows between two used ones ride along below COPY_RUN_BYTES), so a few
        requests in far-apart slots never copy the rows in between."""
        assert self.bitmask is not None
        if self._on_device is None:
            self._on_device = torch.empty_like(self.bitmask, device=self.device)
        for lo, hi in copy_runs(slots, max(1, COPY_RUN_BYTES // (4 * self.bitmask.shape[1]))):
            self._on_device[lo:hi].copy_(self.bitmask[lo:hi], non_blocking=True)
        return self._on_device


def copy_runs(slots: list[int], max_gap: int) -> list[tuple[int, int]]:
    """[lo, hi) row ranges covering `slots`; two used rows with fewer than `max_gap` rows between
    them share a range."""
    runs: list[tuple[int, int]] = []
    for s in sorted(set(slots)):
        if runs and s - runs[-1][1] < max_gap:
            runs[-1] = (runs[-1][0], s + 1)
        else:
            runs.append((s, s + 1))
    return runs


def _p50_p99(ns: deque[int]) -> tuple[float, float]:
    """The median and p99 of ns values, in µs (0 if none)."""
    ordered = sorted(ns)
    n = len(ordered)
    if not n:
        return 0.0, 0.0
    return ordered[(n - 1) // 2] / 1e3, ordered[min(n - 1, (99 * n) // 100)] / 1e3


def _row(req: Req) -> int:
    """A request's table row (set: only requests holding one are filled)."""
    assert req.row is not None, req.rid
    return req.row
