"""The request-to-token table's host mirror (what the scheduler writes on GPUs): run in-process
schedulers with the mirror forced on CPU and check that after every flush the kernels' table equals
the mirror, and that outputs equal the unmirrored run's, through prefix hits, pages, chunked
prefill and retraction."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import weft.runtime.executor.model_runner as model_runner
from weft.runtime.config import EngineConfig
from weft.runtime.executor.memory import ReqToTokenPool
from weft.runtime.ipc.messages import TokenizedGenerateReq
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.scheduler.scheduler import Scheduler


class MirroredPool(ReqToTokenPool):
    def __init__(self, max_reqs: int, max_context: int, device: Any) -> None:
        super().__init__(max_reqs, max_context, device, mirror=True)


def run(
    model: Path,
    mirrored: bool,
    monkeypatch: pytest.MonkeyPatch,
    new: int,
    ignore_eos: bool = True,
    **config: Any,
) -> tuple[dict[str, list[int]], int]:
    with monkeypatch.context() as m:
        if mirrored:
            m.setattr(model_runner, "ReqToTokenPool", MirroredPool)
        sched = Scheduler(EngineConfig(model=str(model), cpu_threads=1, **config), model, None)
    pool = sched.runner.req_to_token
    assert (pool.cpu is not pool.table) == mirrored
    done: dict[str, list[int]] = {}
    sched.emit = lambda reqs: done.update({r.rid: list(r.output_ids) for r in reqs if r.finished})  # type: ignore[method-assign]
    shared = [(11 * i) % 3000 + 100 for i in range(40)]
    for i in range(14):
        head = shared[: 8 + 3 * i] if i % 3 else [500 + i, 7, 9]
        ids = head + [(37 * i + j) % 2000 + 50 for j in range(3 + i % 5)]
        params = SamplingParams(temperature=0, ignore_eos=ignore_eos, max_new_tokens=new + i % 6)
        sched.add_request(TokenizedGenerateReq(f"r{i}", ids, params, params.max_new_tokens or 0))
    while sched.has_work():
        batch = sched.schedule()
        assert batch is not None
        pool.flush()
        assert torch.equal(pool.table, pool.cpu), "a slot write did not reach the device table"
        sched.process_results(sched.launch(batch))
    sched.cache.check_conservation()
    return done, sched.stats["retractions"]


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"page_size": 4},
        {"page_size": 4, "chunked_prefill_size": 8, "max_prefill_tokens": 16},
        # admission expects no decodes (ratio 0, no ignore_eos): they outgrow the pool: retraction
        {"max_total_tokens": 200, "new": 40, "ignore_eos": False, "schedule_conservativeness": 0.0},
    ],
    ids=["plain", "pages", "chunked", "retraction"],
)
def test_mirrored_table_gives_the_same_outputs(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, config: dict[str, Any]
) -> None:
    plain, retracted = run(tiny_model_dir, False, monkeypatch, **{"new": 5, **config})
    mirrored, _ = run(tiny_model_dir, True, monkeypatch, **{"new": 5, **config})
    assert len(plain) == 14 and mirrored == plain
    assert (retracted > 0) == ("max_total_tokens" in config)
