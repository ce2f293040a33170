"""Overlap scheduling (step t+1 scheduled and its model launched before step t's tokens are on the
host; its sampling after they are): in-process schedulers on a tiny random model give the same
outputs with overlap on and off through stop tokens found mid-run, length limits, penalties,
min_new_tokens, grammar masks with jump-forward, pages, chunked prefill, retraction, seeded sampling
and an abort; KV slots are conserved."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import transformers

from weft.runtime.config import EngineConfig
from weft.runtime.executor.batch import ForwardMode
from weft.runtime.executor.distributed import Inbox
from weft.runtime.ipc.messages import AbortReq, TokenizedGenerateReq
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.scheduler.scheduler import Scheduler

Outputs = dict[str, tuple[list[int], str]]


def prompts() -> list[list[int]]:
    shared = [(11 * i) % 3000 + 100 for i in range(40)]
    out = []
    for i in range(10):
        head = shared[: 8 + 3 * i] if i % 3 else [500 + i, 7, 9]
        out.append(head + [(37 * i + j) % 2000 + 50 for j in range(3 + i % 5)])
    return out


def run(
    model: Path,
    overlap: str,
    params: list[SamplingParams],
    abort_at: tuple[int, str] | None = None,
    modes: list[ForwardMode] | None = None,
    spy: Callable[[Scheduler], None] | None = None,
    prompt_ids: list[list[int]] | None = None,
    **config: Any,
) -> tuple[Outputs, Scheduler]:
    cfg = EngineConfig(model=str(model), cpu_threads=1, overlap_schedule=overlap, **config)
    sched = Scheduler(cfg, model, None)
    if spy is not None:
        spy(sched)
    done: Outputs = {}

    def emit(reqs: list[Any]) -> None:
        for r in reqs:
            if r.finished:
                assert r.rid not in done, f"{r.rid} finished twice"
                done[r.rid] = (list(r.output_ids), r.finish.type)

    sched.emit = emit  # type: ignore[method-assign]
    for i, (ids, p) in enumerate(zip(prompt_ids or prompts(), params, strict=False)):
        sched.add_request(TokenizedGenerateReq(f"r{i}", ids, p, p.max_new_tokens or 0))
    steps = 0
    while sched.has_work() or sched.grammars.pending:  # run_forever's loop, without a channel
        ready, failed = sched.grammars.scan()
        msgs = [AbortReq(rid=abort_at[1])] if abort_at is not None and steps == abort_at[0] else []
        sched.apply(Inbox(ready, failed, msgs))
        batch = sched.schedule()
        if batch is not None and modes is not None:
            modes.append(batch.mode)
        sched.process_results(sched.launch(batch))
        if batch is None:
            time.sleep(0.005)  # grammars compiling
        steps += 1
        assert steps < 4000, "the scheduler does not finish"
    sched.cache.check_conservation()
    assert all(r.ahead == 0 for r in sched.running)
    return done, sched


def greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, **kw)


def check_same(model: Path, params: list[SamplingParams], **config: Any) -> Outputs:
    off, s_off = run(model, "off", params, **config)
    on, s_on = run(model, "on", params, **config)
    assert on == off
    assert s_off.stats["overlapped_steps"] == 0
    assert s_on.stats["overlapped_steps"] > 0, "nothing was overlapped"
    return on


@pytest.mark.parametrize(
    "config",
    [{}, {"page_size": 4}, {"page_size": 4, "chunked_prefill_size": 8, "max_prefill_tokens": 16}],
    ids=["plain", "pages", "chunked"],
)
def test_lengths_and_stop_tokens_found_mid_run(tiny_model_dir: Path, config: Any) -> None:
    plain = [greedy(4 + 3 * i, ignore_eos=True) for i in range(10)]
    first = check_same(tiny_model_dir, plain, **config)
    assert all(len(first[f"r{i}"][0]) == 4 + 3 * i for i in range(10))
    # stop at a token each request emits mid-way: the step after it was already launched
    stops = []
    for i in range(10):
        out = first[f"r{i}"][0]
        stops.append(greedy(40, stop_token_ids=[out[len(out) // 2]]))
    stopped = check_same(tiny_model_dir, stops, **config)
    assert any(kind == "stop" for _, kind in stopped.values())


def test_penalties_and_min_new_tokens_see_every_token(tiny_model_dir: Path) -> None:
    mixed = [
        greedy(16, frequency_penalty=0.8, presence_penalty=0.5)
        if i % 3 == 0
        else greedy(16, repetition_penalty=1.3)
        if i % 3 == 1
        else greedy(16, ignore_eos=True)
        for i in range(10)
    ]
    mixed[2] = greedy(16, min_new_tokens=8, stop_token_ids=[2, 3, 5])
    check_same(tiny_model_dir, mixed)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 2},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "tags", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("jump_forward", [True, False])
def test_grammar_masks_see_every_token(tiny_model_dir: Path, jump_forward: bool) -> None:
    """Overlap samples forced tokens one by one; without overlap, jump-forward (if on) appends
    them: the outputs are the same."""
    params = []
    for i in range(10):
        if i % 2:
            params.append(greedy(60, json_schema=json.dumps(SCHEMA)))
        elif i % 4 == 0:
            params.append(greedy(20, regex=r"(yes|no), [a-z]{2,5} [0-9]{1,3}\."))
        else:
            params.append(greedy(12, ignore_eos=True))
    outs = check_same(tiny_model_dir, params, disable_jump_forward=not jump_forward)
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    done = [i for i in range(1, 10, 2) if outs[f"r{i}"][1] == "stop"]
    assert len(done) >= 3, outs
    for i in done:
        value = json.loads(tok.decode(outs[f"r{i}"][0], skip_special_tokens=True))
        assert set(value) == {"name", "tags", "age"} and 0 <= value["age"] <= 99, value


def test_masked_steps_sample_after_the_next_schedule(tiny_model_dir: Path) -> None:
    """With overlap, a step whose requests sample under grammar masks is sampled only at the next
    launch (after the next schedule and the next step's host-side inputs), giving the masks
    its accepts started time to compute; a step without masks samples right after its launch.
    Outputs as without overlap."""
    events: list[tuple[str, int]] = []
    masked: set[int] = set()

    def spy(sched: Scheduler) -> None:
        launch, sample, schedule = sched.runner.launch, sched.runner.sample, sched.schedule
        inputs = sched.runner._forward_batch

        def on_launch(batch: Any, deferred: Any = None) -> Any:
            step = launch(batch, deferred)
            events.append(("launch", step.number))
            if any(batch.reqs[i].grammar is not None for i in step.samplers):
                masked.add(step.number)
            return step

        def on_sample(step: Any) -> None:
            events.append(("sample", step.number))
            sample(step)

        def on_schedule() -> Any:
            events.append(("schedule", 0))
            return schedule()

        def on_inputs(batch: Any) -> Any:
            events.append(("inputs", 0))
            return inputs(batch)

        sched.runner.launch, sched.runner.sample = on_launch, on_sample  # type: ignore[method-assign]
        sched.schedule = on_schedule  # type: ignore[method-assign]
        sched.runner._forward_batch = on_inputs  # type: ignore[method-assign]

    params = [greedy(30, json_schema=json.dumps(SCHEMA)) if i % 2 else greedy(50, ignore_eos=True)
              for i in range(8)]  # fmt: skip
    outs, _ = run(tiny_model_dir, "on", params, spy=spy)
    off, _ = run(tiny_model_dir, "off", params)
    assert outs == off
    deferred = plain = late = 0
    for k, (kind, n) in enumerate(events):
        if kind != "launch":
            continue
        between = events[k + 1 : events.index(("sample", n), k)]
        if n in masked:
            if ("schedule", 0) in between:
                deferred += 1
                # sampled in the next launch: after that step's inputs were built
                late += ("inputs", 0) in between[between.index(("schedule", 0)) :]
        else:
            assert ("schedule", 0) not in between, (n, between)
            plain += 1
    assert deferred >= 10 and plain >= 5 and late >= 5, (deferred, plain, late, len(masked))


def test_with_overlap_forced_tokens_do_not_break_the_decode_chain(tiny_model_dir: Path) -> None:
    """Jump-forward would append forced tokens and make the next step an extend, which nothing
    overlaps; with overlap the only extend steps are the prefills (jump-forward still saves
    passes without overlap)."""
    params = [greedy(40, json_schema=json.dumps(SCHEMA)) for _ in range(6)]
    counts = {}
    for overlap, jump in (("on", True), ("off", True), ("off", False)):
        modes: list[ForwardMode] = []
        _, sched = run(tiny_model_dir, overlap, params, modes=modes, disable_jump_forward=not jump)
        fills = sched.state()["mask_fill"]  # every masked sample timed on the scheduler thread
        assert fills["count"] >= 6 and 0 < fills["p50_us"] <= fills["p99_us"], fills
        counts[overlap, jump] = (len(modes), modes.count(ForwardMode.EXTEND))
    extends_on = counts["on", True][1]
    assert extends_on == counts["off", False][1], counts  # the prefills only
    assert counts["off", True][1] > extends_on, counts  # jump-forward's extends
    assert counts["off", True][0] < counts["off", False][0], counts  # ... save passes


def test_retraction(tiny_model_dir: Path) -> None:
    # without ignore_eos and with a ratio of 0, admission expects no decodes: the pool overflows
    params = [greedy(40) for _ in range(10)]
    tight = {"max_total_tokens": 200, "schedule_conservativeness": 0.0}
    on = check_same(tiny_model_dir, params, **tight)
    _, sched = run(tiny_model_dir, "on", params, **tight)
    assert sched.stats["retractions"] > 0 and len(on) == 10


def test_seeded_sampling(tiny_model_dir: Path) -> None:
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, sampling_seed=i, max_new_tokens=10)
        for i in range(10)
    ]
    check_same(tiny_model_dir, params)


def test_abort_while_a_step_is_in_flight(tiny_model_dir: Path) -> None:
    params = [greedy(30, ignore_eos=True) for _ in range(10)]
    off, _ = run(tiny_model_dir, "off", params, abort_at=(6, "r4"))
    on, _ = run(tiny_model_dir, "on", params, abort_at=(6, "r4"))
    assert on["r4"][1] == off["r4"][1] == "abort"
    assert {k: v for k, v in on.items() if k != "r4"} == {k: v for k, v in off.items() if k != "r4"}


def test_overlap_option_is_validated() -> None:
    with pytest.raises(ValueError, match="overlap_schedule"):
        EngineConfig(overlap_schedule="sometimes")  # type: ignore[arg-type]
    assert not EngineConfig(device="cpu").resolved_overlap
    assert EngineConfig(device="cpu", overlap_schedule="on").resolved_overlap


def test_retraction_with_grammars(tiny_model_dir: Path) -> None:
    """Retracted constrained requests release their slot's bitmask row (its prefetch may be in
    flight) and resume in another slot: the masks stay right, the JSON valid."""
    params = [greedy(40, json_schema=json.dumps(SCHEMA)) for _ in range(10)]
    outs = check_same(tiny_model_dir, params, max_total_tokens=200)
    _, sched = run(tiny_model_dir, "off", params, max_total_tokens=200)
    assert sched.stats["retractions"] > 0 and len(outs) == 10
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    for ids, kind in outs.values():
        assert kind in ("stop", "length"), kind
        if kind == "stop":
            json.loads(tok.decode(ids, skip_special_tokens=True))


def test_prefills_go_behind_a_prefill_in_flight(tiny_model_dir: Path) -> None:
    """With overlap a prefill is launched while the prefill before it is still in flight (its
    requests need none of that step's tokens; a chunked prompt goes on too). The outputs are
    those without overlap, and so is the reuse of long shared prefixes: a request sharing a
    prompt that the step in flight computes waits until that prompt is in the tree instead of
    computing it again."""
    pairs: list[tuple[ForwardMode | None, ForwardMode]] = []

    def spy(sched: Scheduler) -> None:
        launch = sched.launch

        def logged(batch: Any) -> Any:
            if batch is not None:
                inflight = sched.inflight
                pairs.append((None if inflight is None else inflight.batch.mode, batch.mode))
            return launch(batch)

        sched.launch = logged  # type: ignore[method-assign]

    params = [greedy(6 + i % 5, ignore_eos=True) for i in range(12)]
    config = {"page_size": 4, "max_prefill_tokens": 24}  # a few prompts per prefill, chunks
    on, _ = run(tiny_model_dir, "on", params, spy=spy, **config)
    assert on == run(tiny_model_dir, "off", params, **config)[0]
    assert (ForwardMode.EXTEND, ForwardMode.EXTEND) in pairs, pairs
    # 3 groups of 4 prompts, each group's on a prefix of 40 tokens
    groups = [[(17 * g + 3 * j) % 900 + 60 for j in range(40)] for g in range(3)]
    grouped = [groups[i % 3] + [(29 * i + j) % 700 + 40 for j in range(5)] for i in range(12)]
    config = {"page_size": 4, "max_prefill_tokens": 100}
    on, s_on = run(tiny_model_dir, "on", params, prompt_ids=grouped, **config)
    off, s_off = run(tiny_model_dir, "off", params, prompt_ids=grouped, **config)
    assert on == off
    # every follower reuses its group's prefix (without overlap, one loses 32 tokens of it here)
    cached = (s_on.stats["cached_tokens"], s_off.stats["cached_tokens"])
    assert cached[0] == 9 * 40 and cached[0] >= cached[1], cached


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workloads_give_the_outputs_of_overlap_off(tiny_model_dir: Path, seed: int) -> None:
    """Random mixes of what the scheduler must keep straight while steps overlap (prefills
    behind prefills, chunks going on behind their chunk in flight, groups sharing prefixes,
    one-token requests, small pools that retract): the outputs of overlap off, slots conserved."""
    rng = random.Random(seed)
    heads = [[rng.randrange(50, 3000) for _ in range(rng.choice([8, 24, 40]))] for _ in range(3)]
    prompt_ids, params = [], []
    for _ in range(16):
        head = rng.choice(heads) if rng.random() < 0.6 else []
        prompt_ids.append(head + [rng.randrange(50, 3000) for _ in range(rng.randrange(2, 30))])
        params.append(greedy(rng.choice([1, 2, 5, 12, 20]), ignore_eos=True))
    config = {
        "page_size": rng.choice([1, 4]),
        "max_prefill_tokens": rng.choice([24, 48, 96]),
        "chunked_prefill_size": rng.choice([0, 16, 32]),
        "max_total_tokens": rng.choice([260, 2000]),
    }
    on, _ = run(tiny_model_dir, "on", params, prompt_ids=prompt_ids, **config)
    off, _ = run(tiny_model_dir, "off", params, prompt_ids=prompt_ids, **config)
    assert on == off, config
