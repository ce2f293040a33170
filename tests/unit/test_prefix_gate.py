"""In-batch prefix sharing in the scheduler: requests arriving together with a long shared prefix
get it prefilled once, also when the first of them is prefilled in chunks (its followers wait for
each chunk instead of recomputing what the chunk computes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from weft.runtime.config import EngineConfig
from weft.runtime.executor.batch import ForwardMode
from weft.runtime.ipc.messages import TokenizedGenerateReq
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.scheduler.scheduler import Scheduler

PREFIX = [(13 * i) % 3000 + 100 for i in range(160)]
GROUPS = 3
MEMBERS = 4
OWN = 8


def prompts() -> list[list[int]]:
    out = []
    for g in range(GROUPS):
        head = [2000 + g] + PREFIX  # each group's prefix differs from the first token on
        for m in range(MEMBERS):
            out.append(head + [(31 * g + 7 * m + j) % 1500 + 50 for j in range(OWN)])
    return out


def extend_tokens(model: Path, **config: Any) -> tuple[int, int]:
    """(prompt tokens computed by extend steps, extend steps) of one run of all prompts at once."""
    cfg = EngineConfig(model=str(model), cpu_threads=1, overlap_schedule="off", **config)
    sched = Scheduler(cfg, model, None)
    sched.emit = lambda reqs: None  # type: ignore[method-assign]
    for i, ids in enumerate(prompts()):
        params = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
        sched.add_request(TokenizedGenerateReq(f"r{i}", ids, params, 2))
    computed = steps = 0
    while sched.has_work():
        batch = sched.schedule()
        if batch is not None and batch.mode == ForwardMode.EXTEND:
            computed += sum(batch.extend_lens)
            steps += 1
        sched.process_results(sched.launch(batch))
        assert steps < 500, "the scheduler does not finish"
    sched.cache.check_conservation()
    return computed, steps


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("chunk", [0, 64])  # 64: the last chunk holds 33 prefix tokens
def test_a_shared_prefix_is_prefilled_once_per_group(
    tiny_model_dir: Path, page_size: int, chunk: int
) -> None:
    computed, steps = extend_tokens(
        tiny_model_dir,
        page_size=page_size,
        chunked_prefill_size=chunk,
        max_prefill_tokens=chunk or 4096,
    )
    head = 1 + len(PREFIX)
    aligned = head - head % page_size  # the tree keeps whole pages; the rest is recomputed
    ideal = GROUPS * (head + OWN) + GROUPS * (MEMBERS - 1) * (head - aligned + OWN)
    assert computed == ideal, (computed, ideal, steps)


def test_without_the_radix_cache_every_request_computes_its_prompt(tiny_model_dir: Path) -> None:
    computed, _ = extend_tokens(tiny_model_dir, disable_radix_cache=True, chunked_prefill_size=48,
                                max_prefill_tokens=48)  # fmt: skip
    assert computed == sum(map(len, prompts()))
