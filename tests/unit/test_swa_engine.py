"""The hybrid sliding-window KV pool in in-process schedulers on a tiny random model whose layers
mix windowed (window 8) and global attention (torch backend, CPU): greedy outputs equal the plain
pool's token for token, with prompts past the window, shared prefixes, chunked prefill and a pool
short enough to retract; the KV of both pools is conserved; the same memory holds more tokens."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import save_tiny_llama

from weft.runtime.config import EngineConfig
from weft.runtime.executor import model_runner
from weft.runtime.executor.swa_memory import SWAPageAllocator
from weft.runtime.ipc.messages import TokenizedGenerateReq
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.scheduler.scheduler import Scheduler

WINDOW = 8
WINDOWED = [True, True, True, False]  # three windowed layers per global one


@pytest.fixture(scope="module")
def mixed_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-swa"), default_model_dir,
                           num_hidden_layers=len(WINDOWED))  # fmt: skip


@pytest.fixture(autouse=True)
def mixed_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Built models get WINDOWED's sliding windows (as Gemma 3's layers mix them)."""
    build = model_runner.build_model

    def build_mixed(*args: Any, **kwargs: Any) -> Any:
        model = build(*args, **kwargs)
        for layer, windowed in zip(model.layers, WINDOWED, strict=True):
            layer.self_attn.sliding_window = WINDOW if windowed else None
        return model

    monkeypatch.setattr(model_runner, "build_model", build_mixed)


def workload() -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(3)
    shared = [rng.randrange(50, 3000) for _ in range(40)]
    out = []
    for i in range(12):
        head = shared[: rng.choice([13, 22, 31, 40])] if i % 3 else []
        prompt = head + [rng.randrange(50, 3000) for _ in range(rng.randrange(6, 30))]
        params = SamplingParams(temperature=0, max_new_tokens=rng.randrange(8, 28))
        out.append((prompt, params))
    return out


def run(
    model: Path, setup: Callable[[Scheduler], None] | None = None, **config: Any
) -> tuple[dict[str, list[int]], Scheduler]:
    sched = Scheduler(EngineConfig(model=str(model), cpu_threads=1, **config), model, None)
    if setup is not None:
        setup(sched)
    done: dict[str, list[int]] = {}

    def emit(reqs: list[Any]) -> None:
        for r in reqs:
            if r.finished:
                done[r.rid] = list(r.output_ids)

    sched.emit = emit  # type: ignore[method-assign]
    items = workload()
    for i, (ids, params) in enumerate(items[:4]):  # these first: later ones share their prefix
        sched.add_request(TokenizedGenerateReq(f"r{i}", ids, params, params.max_new_tokens or 0))
    steps, later = 0, True
    while sched.has_work() or later:
        if later and (steps == 30 or not sched.has_work()):
            later = False
            for i, (ids, params) in enumerate(items[4:], start=4):
                msg = TokenizedGenerateReq(f"r{i}", ids, params, params.max_new_tokens or 0)
                sched.add_request(msg)
        sched.process_results(sched.launch(sched.schedule()))
        steps += 1
        assert steps < 3000, "the scheduler does not finish"
    sched.settle()
    sched.cache.check_conservation()
    assert len(done) == len(items)
    return done, sched


@pytest.mark.parametrize("page_size", [1, 4])
def test_hybrid_pool_outputs_equal_the_plain_pools(mixed_model_dir: Path, page_size: int) -> None:
    common: dict[str, Any] = {"page_size": page_size, "chunked_prefill_size": 16,
                              "max_prefill_tokens": 32, "max_total_tokens": 160,
                              "init_new_token_ratio": 0.05}  # fmt: skip
    plain, ref = run(mixed_model_dir, disable_hybrid_swa_memory=True, **common)
    assert not isinstance(ref.runner.allocator, SWAPageAllocator)
    hybrid, sched = run(mixed_model_dir, swa_full_tokens_ratio=0.2, **common)
    alloc = sched.runner.allocator
    assert isinstance(alloc, SWAPageAllocator) and alloc.window == WINDOW
    assert alloc.swa_total_slots < alloc.total_slots
    assert ref.stats["retractions"] > 0  # an optimistic ratio: the full pool was short
    assert sched.cache.swa is not None and sched.cache.swa.reclaimed > 0  # the SWA pool too
    assert sched.runner.num_forward_tokens < sum(len(p) + n.max_new_tokens for p, n in workload())
    assert hybrid == plain
    info = sched.state()
    assert info["max_total_swa_tokens"] == alloc.swa_total_slots and info["swa_window"] == WINDOW


def test_same_memory_holds_more_tokens(mixed_model_dir: Path) -> None:
    budget: dict[str, Any] = {"kv_cache_bytes": 1 << 20, "chunked_prefill_size": 16,
                              "max_prefill_tokens": 32}  # fmt: skip
    plain = Scheduler(EngineConfig(model=str(mixed_model_dir), disable_hybrid_swa_memory=True,
                                   **budget), mixed_model_dir, None)  # fmt: skip
    hybrid = Scheduler(EngineConfig(model=str(mixed_model_dir), swa_full_tokens_ratio=0.5,
                                    **budget), mixed_model_dir, None)  # fmt: skip
    # one global and three windowed layers: full × (1 + 3 × 0.5) = 4 layers' worth of plain
    gain = hybrid.max_total_tokens / plain.max_total_tokens
    assert gain == pytest.approx(4 / 2.5, rel=0.01)
    alloc = hybrid.runner.allocator
    assert isinstance(alloc, SWAPageAllocator)
    assert alloc.swa_total_slots == pytest.approx(0.5 * alloc.total_slots, rel=0.01)


def test_ngram_speculation_on_the_hybrid_pool_equals_plain_decoding(
    mixed_model_dir: Path,
) -> None:
    """n-gram speculation with every other decode step verifying: a verify step's drafts take
    SWA pages too, and its rejected ones go back; greedy outputs stay the plain pool's."""
    common: dict[str, Any] = {"page_size": 4, "chunked_prefill_size": 16,
                              "max_prefill_tokens": 32, "max_total_tokens": 400}  # fmt: skip
    plain, _ = run(mixed_model_dir, disable_hybrid_swa_memory=True, **common)
    turn = iter(range(10**6))

    def every_other(sched: Scheduler) -> None:
        assert sched.speculator is not None
        sched.speculator.costs.speculate = lambda batch_size: next(turn) % 2 == 0  # type: ignore[method-assign]

    spec, sched = run(mixed_model_dir, swa_full_tokens_ratio=0.05, speculative_algorithm="ngram",
                      speculative_num_draft_tokens=4, setup=every_other, **common)  # fmt: skip
    assert isinstance(sched.runner.allocator, SWAPageAllocator)
    assert sched.stats["spec_verify_steps"] > 0 and sched.stats["spec_draft_tokens"] > 0
    assert spec == plain


def test_draft_model_speculation_is_refused_on_the_hybrid_pool(mixed_model_dir: Path) -> None:
    config = EngineConfig(model=str(mixed_model_dir), speculative_algorithm="draft",
                          speculative_draft_model_path=str(mixed_model_dir))  # fmt: skip
    with pytest.raises(ValueError, match="disable_hybrid_swa_memory"):
        Scheduler(config, mixed_model_dir, None)


def test_a_verify_step_short_of_swa_pages_drops_its_drafts(mixed_model_dir: Path) -> None:
    """A verify step whose drafts need SWA pages the pool lacks (while one plain decode token
    fits) drops the drafts instead of failing their allocation or retracting; the output stays
    the plain pool's and both pools are conserved."""
    common: dict[str, Any] = {"page_size": 4, "max_total_tokens": 400}
    prompt = list(range(60, 90))
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)

    def outputs(sched: Scheduler, on_decode: Callable[[Scheduler], None] | None) -> list[int]:
        done: dict[str, list[int]] = {}
        sched.emit = lambda reqs: done.update(  # type: ignore[method-assign]
            {r.rid: list(r.output_ids) for r in reqs if r.finished}
        )
        sched.add_request(TokenizedGenerateReq("r", prompt, params, 16))
        while sched.has_work():
            req = sched.queues.running[0] if sched.queues.running else None
            if on_decode is not None and req is not None and req.output_ids:
                on_decode(sched)
                on_decode = None
            sched.process_results(sched.launch(sched.schedule()))
        sched.settle()
        sched.cache.check_conservation()
        return done["r"]

    plain = outputs(Scheduler(EngineConfig(model=str(mixed_model_dir), cpu_threads=1,
                                           **common), mixed_model_dir, None), None)  # fmt: skip
    sched = Scheduler(EngineConfig(model=str(mixed_model_dir), cpu_threads=1,
                                   swa_full_tokens_ratio=0.25, speculative_algorithm="ngram",
                                   speculative_num_draft_tokens=4, **common),
                      mixed_model_dir, None)  # fmt: skip
    spec = sched.speculator
    assert spec is not None
    spec.costs.speculate = lambda batch_size: False  # type: ignore[method-assign]
    hog: list[int] = []

    def short_of_swa(sched: Scheduler) -> None:
        """From now on every step verifies 4 drafts, and the SWA pool keeps just the pages of
        one plain decode token."""

        def four_drafts(req: Any) -> int:
            req.pending_draft = [7, 7, 7, 7]
            return 4

        spec._draft_len = four_drafts  # type: ignore[method-assign]
        spec.costs.speculate = lambda batch_size: True  # type: ignore[method-assign]
        cache, alloc = sched.cache, sched.runner.allocator
        assert cache.swa is not None and isinstance(alloc, SWAPageAllocator)
        req = sched.queues.running[0]
        cache.swa.free_own(req)
        cache.swa.reclaim(alloc.swa_total_slots)
        plain_need = cache.pages_needed(req, req.extend_len)
        got = alloc.swa.alloc_pages(alloc.swa_free_pages - plain_need)  # SWA pages only
        assert got is not None
        hog.extend(got)

    before = dict(sched.stats)
    steps = iter(range(10**6))
    real_schedule = sched.schedule

    def schedule() -> Any:  # the hog goes back after three starved verify steps
        if hog and next(steps) == 3:
            sched.runner.allocator.swa.free_page_list(hog)
            hog.clear()
        return real_schedule()

    sched.schedule = schedule  # type: ignore[method-assign]
    assert outputs(sched, short_of_swa) == plain
    assert sched.stats["retractions"] == before["retractions"] == 0
    assert sched.stats["spec_draft_tokens"] > before["spec_draft_tokens"]  # once it had room
