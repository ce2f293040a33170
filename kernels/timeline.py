"""Per-program timestamps that weft's kernels write while a Timeline is active: where a decode
step's time goes inside and between its kernels (a diagnostic; off by default, no cost then)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

STAMPS = 5  # per program: start, its wait returned, its main work done, end (ns); its SM


@dataclass(frozen=True)
class Region:
    """One kernel launch's stamps: `programs` rows of STAMPS int64 at `offset`."""

    name: str
    offset: int
    programs: int
    captured: bool  # launched while a CUDA graph was being captured


class Timeline:
    """A buffer of int64 stamps on `device` and the launches that write into it, in launch
    order. While `weft.kernels.timeline.ACTIVE` is one, each instrumented launch made during a
    CUDA graph capture takes the next `programs * STAMPS` slots, and the graph writes them at
    every replay, so `read` after a replay gives that replay's timeline. Launches outside a
    capture (warm-ups, timing runs) share the first `scratch` programs' slots and are not read,
    unless `eager`: then they take slots of their own too."""

    def __init__(
        self,
        device: torch.device | str,
        capacity: int = 1 << 22,
        scratch: int = 1 << 16,
        eager: bool = False,
    ) -> None:
        if not 0 <= scratch * STAMPS <= capacity:
            raise ValueError(f"Timeline: {scratch} scratch programs do not fit {capacity} stamps")
        self.buf = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.regions: list[Region] = []
        self.scratch, self.eager = scratch, eager
        self.used = scratch * STAMPS

    def region(self, name: str, programs: int) -> torch.Tensor:
        need = programs * STAMPS
        capturing = self.buf.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing and not self.eager:
            if programs > self.scratch:
                raise ValueError(f"Timeline: a launch of {programs} programs outside a capture "
                                 f"exceeds the {self.scratch} scratch programs")  # fmt: skip
            return self.buf[:need]
        if self.used + need > self.buf.numel():
            raise ValueError(f"Timeline full: {self.used} + {need} stamps > {self.buf.numel()}; "
                             "give it a larger capacity")  # fmt: skip
        self.regions.append(Region(name, self.used, programs, capturing))
        view = self.buf[self.used : self.used + need]
        self.used += need
        return view

    def read(self, captured_only: bool = True) -> list[tuple[Region, list[list[int]]]]:
        """Each region's stamps, [programs][STAMPS]: four times in ns (0: the program did not
        write them) and the SM the program ran on."""
        host = self.buf[: self.used].cpu().tolist()
        out = []
        for r in self.regions:
            if captured_only and not r.captured:
                continue
            flat = host[r.offset : r.offset + r.programs * STAMPS]
            out.append((r, [flat[i : i + STAMPS] for i in range(0, len(flat), STAMPS)]))
        return out


ACTIVE: Timeline | None = None


def activate(timeline: Timeline | None) -> None:
    """Make `timeline` the one launches write into (None: none, the default)."""
    global ACTIVE
    ACTIVE = timeline


def trace_for(name: str, programs: int, dummy: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A launch's stamp slots and whether it writes them (`dummy`, any tensor on the launch's
    device, stands in when no Timeline is active: it is not written)."""
    if ACTIVE is None or dummy.device.type != "cuda":  # the interpreter has no %globaltimer
        return dummy, False
    return ACTIVE.region(name, programs), True


@triton.jit
def now():  # type: ignore[no-untyped-def]
    """The GPU's global nanosecond timer (%globaltimer, one clock for every SM; CUDA only)."""
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def stamps(Trace, program, t0, t1, t2, t3):  # type: ignore[no-untyped-def]
    """Store `program`'s four times and its SM (%smid): one thread's stores of scalars."""
    sm = tl.inline_asm_elementwise(
        "mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    )
    row = Trace + program * 5  # STAMPS
    tl.store(row, t0)
    tl.store(row + 1, t1)
    tl.store(row + 2, t2)
    tl.store(row + 3, t3)
    tl.store(row + 4, sm.to(tl.int64))


__all__ = ["STAMPS", "Region", "Timeline", "activate", "now", "stamps", "trace_for"]
