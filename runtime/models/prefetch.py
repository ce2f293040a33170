"""Weight prefetch into the L2 during a decode step's light kernels: which weight at which point of
a decoder layer (the plan), and a side stream that issues them (the prefetcher)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

# Points of a decoder layer's forward, in order: a prefetch queued at a point starts when the
# kernels before it have finished (qkv: after the QKV GEMM; attn: after attention, before o_proj;
# gate_up: after the gate/up GEMM; down: after the down GEMM, the layer's last).
POINTS = ("qkv", "attn", "gate_up", "down")
# Weights a layer's points may name; next_qkv is the following layer's QKV weight.
WEIGHTS = ("qkv", "o_proj", "gate_up", "down", "next_qkv")
MIB = 1 << 20
# o_proj during rotary + attention, gate/up's first 16 MiB during o_proj + the norm
DEFAULT_PLAN = "qkv:o_proj,attn:gate_up:16"
DEFAULT_MAX_BATCH = 16
DEFAULT_MODE = "off"


@dataclass(frozen=True)
class PrefetchEntry:
    point: str
    weight: str
    mib: float | None  # the weight's first `mib` MiB; None: all of it

    def __post_init__(self) -> None:
        if self.point not in POINTS:
            raise ValueError(f"prefetch point {self.point!r} is not one of {POINTS}")
        if self.weight not in WEIGHTS:
            raise ValueError(f"prefetch weight {self.weight!r} is not one of {WEIGHTS}")
        if self.mib is not None and not self.mib > 0:
            raise ValueError(f"prefetch size must be > 0 MiB, got {self.mib}")


@dataclass(frozen=True)
class PrefetchPlan:
    entries: tuple[PrefetchEntry, ...]
    max_batch: int = DEFAULT_MAX_BATCH  # decode graphs up to this batch size prefetch

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"prefetch max batch must be >= 1, got {self.max_batch}")

    @classmethod
    def parse(cls, text: str, max_batch: int = DEFAULT_MAX_BATCH) -> PrefetchPlan:
        """'point:weight[:MiB],...', e.g. DEFAULT_PLAN."""
        entries = []
        for item in filter(None, (s.strip() for s in text.split(","))):
            parts = item.split(":")
            if len(parts) not in (2, 3):
                raise ValueError(f"prefetch entry {item!r} is not point:weight[:MiB]")
            try:
                mib = float(parts[2]) if len(parts) == 3 else None
            except ValueError:
                raise ValueError(f"prefetch entry {item!r}: {parts[2]!r} is not a number") from None
            entries.append(PrefetchEntry(parts[0], parts[1], mib))
        if not entries:
            raise ValueError("a prefetch plan needs at least one point:weight entry")
        return cls(tuple(entries), max_batch)


def plan_from_env() -> PrefetchPlan | None:
    """WEFT_L2_PREFETCH: a plan (see PrefetchPlan.parse), `on` for DEFAULT_PLAN or `off` (the
    default until the H200 measures it); WEFT_L2_PREFETCH_MAX_BS: the largest decode batch
    that prefetches."""
    text = os.environ.get("WEFT_L2_PREFETCH", DEFAULT_MODE).strip()
    if text == "off":
        return None
    raw = os.environ.get("WEFT_L2_PREFETCH_MAX_BS", str(DEFAULT_MAX_BATCH))
    try:
        max_batch = int(raw)
    except ValueError:
        raise ValueError(f"WEFT_L2_PREFETCH_MAX_BS must be an integer, got {raw!r}") from None
    return PrefetchPlan.parse(DEFAULT_PLAN if text == "on" else text, max_batch)


class WeightPrefetcher:
    """Issues a plan's prefetches on its own stream, each forked from the compute stream at its
    point, so it overlaps the kernels that follow; `join` merges the stream back (a CUDA graph's
    capture must end joined). Inactive outside `active()`: then every call returns at once."""

    def __init__(
        self,
        plan: PrefetchPlan,
        layers: Sequence[dict[str, torch.Tensor]],
        prefetch: Callable[[torch.Tensor, int], None] | None = None,
    ) -> None:
        """`layers`: each layer's weights by WEIGHTS name (next_qkv aside); `prefetch(weight,
        nbytes)` issues one prefetch (kernels.l2_prefetch by default). Weights on the CPU (unit
        tests) get no side stream: their prefetches go to the current stream."""
        if prefetch is None:
            from weft.kernels.prefetch import l2_prefetch

            prefetch = l2_prefetch
        self._prefetch: Callable[[torch.Tensor, int], None] = prefetch
        self.plan = plan
        device = layers[0]["qkv"].device if layers else torch.device("cpu")
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._todo: dict[tuple[int, str], list[tuple[torch.Tensor, int]]] = {}
        for i, weights in enumerate(layers):
            for e in plan.entries:
                if e.weight == "next_qkv" and i + 1 == len(layers):
                    continue
                w = layers[i + 1]["qkv"] if e.weight == "next_qkv" else weights[e.weight]
                size = w.numel() * w.element_size()
                nbytes = size if e.mib is None else min(size, int(e.mib * MIB))
                self._todo.setdefault((i, e.point), []).append((w, nbytes))
        self._active = False
        self._forked = False

    @contextlib.contextmanager
    def active(self, on: bool = True) -> Iterator[None]:
        before, self._active = self._active, on
        try:
            yield
        finally:
            self._active = before

    def at(self, layer: int, point: str) -> None:
        todo = self._todo.get((layer, point))
        if not self._active or not todo:
            return
        if self.stream is None:
            for weight, nbytes in todo:
                self._prefetch(weight, nbytes)
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for weight, nbytes in todo:
                self._prefetch(weight, nbytes)
        self._forked = True

    def join(self) -> None:
        if self._forked and self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)
            self._forked = False
