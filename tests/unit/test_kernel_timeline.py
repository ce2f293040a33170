"""kernels/timeline.py's stamp slots, and benchmarks/step_timeline.py's report on made-up stamps:
boundaries (previous end -> first release) and time inside kernels add up to the step's span."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from weft.kernels import timeline

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the scripts import their helpers as top-level modules
import step_timeline  # noqa: E402


def test_regions_take_consecutive_slots_and_read_back_per_program() -> None:
    t = timeline.Timeline("cpu", capacity=60, scratch=2, eager=True)
    a = t.region("gemv", 3)
    b = t.region("rmsnorm", 2)
    assert (a.numel(), b.numel(), t.used) == (15, 10, 35)
    a.copy_(torch.arange(1, 16))
    b.fill_(7)
    got = t.read(captured_only=False)
    assert [r.name for r, _ in got] == ["gemv", "rmsnorm"]
    assert got[0][1] == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]
    assert got[1][1] == [[7] * 5] * 2
    assert t.read() == []  # nothing was launched inside a graph capture
    with pytest.raises(ValueError, match="Timeline full: 35 \\+ 30 stamps > 60"):
        t.region("decode_split", 6)


def test_launches_outside_a_capture_share_the_scratch_slots() -> None:
    t = timeline.Timeline("cpu", capacity=64, scratch=4)
    a = t.region("gemv", 3)
    b = t.region("gemv", 4)
    assert a.data_ptr() == b.data_ptr() == t.buf.data_ptr() and b.numel() == 20
    assert t.regions == [] and t.used == 20
    with pytest.raises(ValueError, match="5 programs outside a capture exceeds the 4 scratch"):
        t.region("gemv", 5)
    with pytest.raises(ValueError, match="13 scratch programs do not fit 64 stamps"):
        timeline.Timeline("cpu", capacity=64, scratch=13)


def test_launches_write_nothing_without_an_active_timeline_or_off_cuda() -> None:
    dummy = torch.zeros(1)
    assert timeline.ACTIVE is None
    assert timeline.trace_for("gemv", 4, dummy) == (dummy, False)
    timeline.activate(timeline.Timeline("cpu", capacity=16, scratch=1, eager=True))
    try:  # the interpreter has no %globaltimer: CPU launches stay untraced
        assert timeline.trace_for("gemv", 4, dummy) == (dummy, False)
    finally:
        timeline.activate(None)


def _region(name: str, n: int) -> timeline.Region:
    return timeline.Region(name, 0, n, True)


def test_the_report_splits_the_span_into_boundaries_and_inside() -> None:
    # norm: starts 0, released 1000, row loaded 1500, ends 2000 (one program)
    # qkv: two programs start early (500, 600), released 2500 / 2600, walked 9000 / 9500,
    #      end 10000: boundary 500 ns after the norm's end
    # attention: a plain launch, starts 11000 (boundary 1000 ns), ends 15000
    # an unwritten launch (another graph's) is left out; the fifth stamp is the program's SM
    recs = [
        (_region("add_rmsnorm", 1), [[1, 1000, 1500, 2000, 3]]),
        (
            _region("gemv 6144x4096", 3),
            [[500, 2500, 9000, 9800, 0], [600, 2600, 9500, 10000, 7], [550, 2550, 8000, 9000, 0]],
        ),  # fmt: skip
        (_region("decode_split", 1), [[11000, 11000, 14000, 15000, 5]]),
        (_region("gemv 4096x4096", 1), [[0, 0, 0, 0, 0]]),
    ]
    launches = step_timeline.summarise(recs)
    assert [r.name for r in launches] == ["add_rmsnorm", "gemv 6144x4096", "decode_split"]
    qkv = launches[1]
    assert (qkv.first_start, qkv.last_start, qkv.first_release, qkv.last_end) == (500, 600, 2500,
                                                                                10000)  # fmt: skip
    assert qkv.work == 6500 and (qkv.sms, qkv.most_per_sm) == (2, 2)
    assert (launches[2].sms, launches[2].most_per_sm) == (1, 1)
    lines = step_timeline.report(launches, {"gemv 6144x4096": "qkv"}, show=3)
    assert lines[0].startswith("3 launches over 15.0 us (finest step between stamps 499 ns)")
    kinds = {ln.split()[0]: [float(x) for x in ln.split()[1:]] for ln in lines
             if ln.startswith("  ") and ln.split()[0] in ("qkv", "add_rmsnorm", "decode_split")}  # fmt: skip
    # qkv released 0.5 us after the norm's end, inside 7.5 us; attention 1.0 and 4.0 us
    assert kinds["qkv"] == [0.5, 7.5, 1] and kinds["decode_split"] == [1.0, 4.0, 1]
    assert kinds["add_rmsnorm"] == [1.0, 1.0, 1]  # from the step's first start to its release
    assert lines[-1] == "  boundaries 2.5 us + inside 12.5 us = 15.0"
