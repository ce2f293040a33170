"""benchmarks/one_batch.py's step modes: KEY=VALUE settings parsed with clear errors, and each
mode applied from the runner's defaults (no setting of an earlier mode carries over)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the scripts import their helpers as top-level modules
import one_batch  # noqa: E402


def test_modes_parse_and_refuse_what_they_do_not_know() -> None:
    assert one_batch.parse_mode("sum=launch,prefetch=end:0.5,warps=2") == {
        "sum": "launch", "prefetch": "end:0.5", "warps": "2"}  # fmt: skip
    for bad, match in (("fold=on", "not KEY=VALUE"), ("sum", "not KEY=VALUE"),
                       ("warps=3", "warps='3'"), ("prefetch=end:2", "prefetch='end:2'"),
                       ("prefetch=mid", "prefetch='mid'"), ("norm=on", "norm='on'")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            one_batch.parse_mode(bad)


def _runner() -> Any:
    graphs = SimpleNamespace(gemv_mode="auto", sum_here=True, fold_norms=False)
    attn = SimpleNamespace(sum_here=True, decode_warps=None, l2_prefetch="end",
                           l2_prefetch_fraction=0.5, l2_prefetch_bs=4, fuse_rope=True, pdl=False,
                           pdl_trigger=True)  # fmt: skip
    return SimpleNamespace(graphs=graphs, attn=attn)


def test_each_mode_starts_from_the_defaults() -> None:
    runner = _runner()
    defaults = one_batch._defaults(runner)
    one_batch.apply_mode(runner, one_batch.parse_mode("sum=launch,prefetch=start:0.25"),
                         defaults, 2)  # fmt: skip
    assert not runner.graphs.sum_here and not runner.attn.sum_here
    assert (runner.attn.l2_prefetch, runner.attn.l2_prefetch_fraction) == ("start", 0.25)
    assert runner.attn.l2_prefetch_bs == 2
    one_batch.apply_mode(runner, one_batch.parse_mode("rope=separate,prefetch=off"), defaults, 2)
    assert runner.graphs.sum_here and runner.attn.sum_here  # back to the default
    assert runner.attn.l2_prefetch == "" and not runner.attn.fuse_rope
    one_batch.apply_mode(runner, one_batch.parse_mode("attn=pdl,warps=4,gemv=off"), defaults, 4)
    assert runner.attn.pdl and runner.attn.decode_warps == 4 and runner.graphs.gemv_mode == "off"
    assert runner.attn.fuse_rope and runner.attn.l2_prefetch == "end"
    assert runner.attn.pdl_trigger
    one_batch.apply_mode(runner, one_batch.parse_mode("attn=wait"), defaults, 4)
    assert runner.attn.pdl and not runner.attn.pdl_trigger
    one_batch.apply_mode(runner, one_batch.parse_mode("sum=here,norm=fold"), defaults, 4)
    assert not runner.attn.pdl and runner.attn.pdl_trigger and runner.graphs.fold_norms
    one_batch.apply_mode(runner, one_batch.parse_mode("gemv=on"), defaults, 4)
    assert not runner.graphs.fold_norms
