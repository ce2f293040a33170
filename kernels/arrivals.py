"""Arrival counters for kernels whose last program to finish a tile sums its splits itself."""

from __future__ import annotations

import logging

import torch

# Counters per (device, owner kernel): enough for 32,768 tiles in one launch (128 KiB each).
COUNTERS = 1 << 15
_BUFFERS: dict[tuple[torch.device, str], torch.Tensor] = {}
_log = logging.getLogger(__name__)


def arrival_counters(device: torch.device, owner: str, tiles: int) -> torch.Tensor | None:
    """A zeroed int32 buffer of COUNTERS entries for `owner`'s launches on `device`, or None
    where the caller must sum its splits in a launch of its own instead: `tiles` is more than
    the buffer holds, or the buffer does not exist yet and the stream is capturing a CUDA graph
    (a buffer allocated there would be zeroed only when the graph replays).

    The protocol the kernels keep: each program of a tile stores its split's partial result,
    then adds one to the tile's counter (acq_rel, GPU scope, after a barrier of its threads);
    the program that arrives last reads every split back, writes the tile's result and sets
    the counter to 0 again. So the buffer is all zeros between launches.

    NOTE: launches of one owner share one buffer per device, so two of them must not run at
    once (kernels in one stream, programmatic dependents included, run their counters after
    `griddepcontrol.wait`, i.e. after the launch before them ended)."""
    if tiles > COUNTERS:
        return None
    key = (device, owner)
    buf = _BUFFERS.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            _log.debug("no %s arrival counters on %s before this capture: the graph sums its "
                       "splits in a launch of its own (run the launch once before capturing)",
                       owner, device)  # fmt: skip
            return None
        buf = _BUFFERS[key] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return buf
