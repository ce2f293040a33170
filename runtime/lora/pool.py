"""The GPU slots that hold the adapters a batch runs: loaded from CPU on demand, pinned while
requests use them, the least recently used unpinned one evicted when a slot is needed.

    slot:      0 .. max_loras - 1 (a token of the base model has slot NO_LORA = -1)
    resident = pinned (refs > 0: a running request uses it) + evictable (refs == 0, in LRU order)
    free + resident == max_loras  (check_integrity)

Per fused projection and layer the buffers are what kernels/lora.py's lora_forward takes:
A [slots, num_slices * max_rank, in], B [slots, out, max_rank], ranks [slots] (0 where the
slot's adapter does not target that projection, or the slot is empty: no work), scalings [slots].
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch

from weft.runtime.lora.adapter import LoraAdapter
from weft.runtime.lora.shapes import FUSED, LoraShapes

NO_LORA = -1  # the slot of a base-model token (kernels/lora.py's NO_LORA)


class LoraPoolFull(RuntimeError):
    """Every slot holds an adapter that running requests use: none can be evicted."""


class PoolWeights(NamedTuple):
    """One (layer, fused projection)'s buffers: lora_forward's a, b, scalings, ranks, slice_starts."""

    a: torch.Tensor  # [slots, num_slices * max_rank, in]
    b: torch.Tensor  # [slots, out, max_rank]
    scalings: torch.Tensor  # [slots] float32
    ranks: torch.Tensor  # [slots] int32
    slice_starts: tuple[int, ...]


class LoraPool:
    """max_loras adapter slots of rank up to max_rank for a model of `shapes` (this rank's)."""

    def __init__(
        self,
        shapes: LoraShapes,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"LoraPool needs max_loras >= 1 and max_rank >= 1, got "
                             f"{max_loras} and {max_rank}")  # fmt: skip
        self.shapes = shapes
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = torch.device(device)
        layers = shapes.num_layers
        self.a = {f: torch.zeros(layers, max_loras, len(parts) * max_rank, shapes.in_dim(f),
                                 dtype=dtype, device=self.device)
                  for f, parts in FUSED.items()}  # fmt: skip
        self.b = {f: torch.zeros(layers, max_loras, shapes.out_dim(f), max_rank,
                                 dtype=dtype, device=self.device) for f in FUSED}  # fmt: skip
        self.ranks = {f: torch.zeros(layers, max_loras, dtype=torch.int32, device=self.device)
                      for f in FUSED}  # fmt: skip
        self.scalings = torch.zeros(max_loras, dtype=torch.float32, device=self.device)
        self._names: list[str | None] = [None] * max_loras  # slot -> adapter name
        self._slot: dict[str, int] = {}
        self._refs: dict[str, int] = {}
        self._evictable: OrderedDict[str, None] = OrderedDict()  # refs == 0, oldest use first

    ##### Public API #####

    def weights(self, layer: int, fused: str) -> PoolWeights:
        """The buffers lora_forward takes for projection `fused` of `layer` (views, no copy)."""
        return PoolWeights(self.a[fused][layer], self.b[fused][layer], self.scalings,
                           self.ranks[fused][layer], self.shapes.slice_starts(fused))  # fmt: skip

    def slot_of(self, name: str) -> int | None:
        return self._slot.get(name)

    def can_acquire(self, names: set[str]) -> bool:
        """Whether all of `names` can be resident at once, next to the pinned adapters."""
        pinned = {n for n, refs in self._refs.items() if refs > 0}
        return len(pinned | names) <= self.max_loras

    def acquire(self, adapter: LoraAdapter) -> int:
        """Pin `adapter` (one more request uses it) and return its slot, copying it in from CPU
        first if it is not resident, into a free slot or the least recently used evictable one.
        LoraPoolFull when every slot is pinned."""
        name = adapter.name
        slot = self._slot.get(name)
        if slot is None:
            slot = self._take_slot(name)
            self._write(slot, adapter)
            self._names[slot] = name
            self._slot[name] = slot
            self._refs[name] = 0
        self._refs[name] += 1
        self._evictable.pop(name, None)
        return slot

    def release(self, name: str) -> None:
        """One request of `name` finished (or left the batch): unpinned at zero, it stays
        resident as the most recently used evictable adapter."""
        assert self._refs.get(name, 0) > 0, f"LoraPool.release({name!r}) without an acquire"
        self._refs[name] -= 1
        if self._refs[name] == 0:
            self._evictable[name] = None

    def drop(self, name: str) -> bool:
        """Free `name`'s slot (an adapter unloaded while serving). False if it is pinned (its
        requests still run: drop it once they finished); True if it was dropped or not resident."""
        if self._refs.get(name, 0) > 0:
            return False
        if name in self._slot:
            self._evict(name)
        return True

    def pinned(self) -> dict[str, int]:
        """Adapter name -> the number of requests using it, for the adapters in use."""
        return {n: refs for n, refs in self._refs.items() if refs > 0}

    def resident(self) -> dict[str, int]:
        """Adapter name -> slot, for every adapter on the device."""
        return dict(self._slot)

    def check_integrity(self) -> None:
        """free + pinned + evictable == max_loras, and the maps agree; raises with the numbers."""
        free = sum(n is None for n in self._names)
        pinned = sum(refs > 0 for refs in self._refs.values())
        evictable = len(self._evictable)
        if free + pinned + evictable != self.max_loras or len(self._slot) != pinned + evictable:
            raise RuntimeError(f"LoRA pool leak: free {free} + pinned {pinned} + evictable "
                               f"{evictable} != {self.max_loras} slots ({self._slot})")  # fmt: skip
        for name, slot in self._slot.items():
            assert self._names[slot] == name, (
                f"slot {slot} holds {self._names[slot]!r}, not {name!r}"
            )
            assert (self._refs[name] == 0) == (name in self._evictable), f"{name!r} refs/LRU"

    ##### Internal Helper Functions #####

    def _take_slot(self, name: str) -> int:
        if None in self._names:
            return self._names.index(None)
        if not self._evictable:
            raise LoraPoolFull(f"cannot load LoRA adapter {name!r}: all {self.max_loras} slots "
                               f"hold adapters in use ({', '.join(self.pinned())})")  # fmt: skip
        victim = next(iter(self._evictable))
        slot = self._slot[victim]
        self._evict(victim)
        return slot

    def _evict(self, name: str) -> None:
        slot = self._slot.pop(name)
        self._names[slot] = None
        del self._refs[name]
        self._evictable.pop(name, None)
        self.scalings[slot] = 0.0
        for ranks in self.ranks.values():
            ranks[:, slot] = 0  # an empty slot does no work even if a stale index points at it

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy `adapter` into `slot`: rows past its rank and projections it lacks are zeros."""
        shapes, r, max_rank = self.shapes, adapter.rank, self.max_rank
        if r > max_rank:
            raise ValueError(f"LoRA adapter {adapter.name!r}: rank {r} > max_lora_rank {max_rank}")
        if adapter.shapes != shapes:
            raise ValueError(f"LoRA adapter {adapter.name!r} was laid out for {adapter.shapes}, "
                             f"this pool holds {shapes} (shard it for this rank first)")  # fmt: skip
        for fused, parts in FUSED.items():
            ranks = []
            for layer, modules in enumerate(adapter.layers):
                a = self.a[fused][layer, slot].view(len(parts), max_rank, -1)
                b = self.b[fused][layer, slot]
                a.zero_()
                b.zero_()
                w = modules.get(fused)
                if w is not None:
                    a[:, :r].copy_(w.a.view(len(parts), r, -1))
                    b[:, :r].copy_(w.b)
                ranks.append(r if w is not None else 0)
            self.ranks[fused][:, slot] = torch.tensor(ranks, dtype=torch.int32)
        self.scalings[slot] = adapter.scaling
