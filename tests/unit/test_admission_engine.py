"""Admission by predicted peak KV use in in-process schedulers on a tiny random model (CPU): a
workload that outgrows a small KV pool completes without a retraction, with the outputs of a run
on a pool that holds it all (overlap on and off), running more requests at once than reserving
every request's whole output would; an optimistic ratio on the same pool retracts (the pool is
really short) and still gives those outputs; KV slots are conserved."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from weft.runtime.config import EngineConfig
from weft.runtime.ipc.messages import TokenizedGenerateReq
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.scheduler.scheduler import Scheduler

POOL = 320  # slots; the workload's prompts + outputs take 16 * ~55


def workload(ignore_eos: bool) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(7)
    out = []
    for _ in range(16):
        prompt = [rng.randrange(50, 3000) for _ in range(rng.randrange(10, 30))]
        n = rng.randrange(16, 48)
        out.append((prompt, SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=ignore_eos)))
    return out


def run(model: Path, ignore_eos: bool, **config: Any) -> tuple[dict[str, list[int]], int, int]:
    """Outputs by request id, retractions, and the most requests running at once."""
    sched = Scheduler(EngineConfig(model=str(model), cpu_threads=1, **config), model, None)
    done: dict[str, list[int]] = {}

    def emit(reqs: list[Any]) -> None:
        for r in reqs:
            if r.finished:
                assert r.finish.type == "length" or not ignore_eos, r.finish
                done[r.rid] = list(r.output_ids)

    sched.emit = emit  # type: ignore[method-assign]
    for i, (ids, params) in enumerate(workload(ignore_eos)):
        sched.add_request(TokenizedGenerateReq(f"r{i}", ids, params, params.max_new_tokens or 0))
    most = steps = 0
    while sched.has_work():
        batch = sched.schedule()
        sched.process_results(sched.launch(batch))
        most = max(most, len(sched.running))
        steps += 1
        assert steps < 2000, "the scheduler does not finish"
    sched.settle()
    sched.cache.check_conservation()
    assert len(done) == 16
    return done, sched.stats["retractions"], most


@pytest.fixture(scope="module")
def roomy(tiny_model_dir: Path) -> dict[bool, dict[str, list[int]]]:
    """The outputs on a pool that holds the whole workload, with and without ignore_eos."""
    outs = {}
    for ignore_eos in (True, False):
        outs[ignore_eos], retracted, _ = run(tiny_model_dir, ignore_eos)
        assert retracted == 0
    return outs


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_workload_that_outgrows_the_pool_runs_without_retraction(
    tiny_model_dir: Path, roomy: dict[bool, dict[str, list[int]]], overlap: str
) -> None:
    tight, retracted, most = run(
        tiny_model_dir, True, overlap_schedule=overlap, max_total_tokens=POOL
    )
    assert tight == roomy[True]
    assert retracted == 0
    # reserving every request's prompt + max_new_tokens would run at most this many at once
    totals = sorted(len(ids) + p.max_new_tokens for ids, p in workload(True))  # type: ignore[misc]
    whole = max(k for k in range(len(totals) + 1) if sum(totals[:k]) <= POOL)
    assert most > whole, (most, whole)


def test_an_optimistic_ratio_on_the_same_pool_retracts_and_gives_the_same_outputs(
    tiny_model_dir: Path, roomy: dict[bool, dict[str, list[int]]]
) -> None:
    """Without ignore_eos, a ratio of 0 expects no decodes: the pool is really too small."""
    tight, retracted, _ = run(
        tiny_model_dir, False, max_total_tokens=POOL, schedule_conservativeness=0.0
    )
    assert retracted > 0
    assert tight == roomy[False]
