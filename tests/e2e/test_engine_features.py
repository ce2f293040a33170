"""Engine features on a tiny random Llama with SmolLM2's tokenizer: stops, EOS, n, seeds, streaming,
abort, prefill-only requests, and process lifetime. Logit bias makes the random model predictable."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest

import weft
from weft.runtime.server import request_parts
from weft.runtime.server.tokenizer_manager import RuntimeDown

WORLD = 905  # " world"
EOS = 2  # <|im_end|>
FORCE_WORLD = {"logit_bias": {str(WORLD): 100.0}}


@pytest.fixture(scope="module", params=["off", "on", "ngram"], ids=["plain", "overlap", "ngram"])
def engine(tiny_model_dir: Path, request: pytest.FixtureRequest) -> Any:
    """Every feature three ways: overlap scheduling (the CUDA default) forced on, off, and with
    speculative decoding (n-gram drafts; the random model repeats itself, so they are taken)."""
    mode = request.param
    extra = {"speculative_algorithm": "ngram"} if mode == "ngram" else {}
    overlap = "off" if mode == "ngram" else mode
    with weft.Engine(str(tiny_model_dir), seed=0, overlap_schedule=overlap, **extra) as eng:
        yield eng


def gen(engine: Any, prompt: str = "Hi", **params: Any) -> dict[str, Any]:
    out = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 8, **params})
    assert isinstance(out, dict)
    return out


def idle_state(engine: Any) -> dict[str, Any]:
    """get_state once nothing runs or waits (an earlier test's aborted request may still run)."""
    state = engine.get_state()
    for _ in range(200):
        if not state["num_running"] and not state["num_waiting"]:
            break
        time.sleep(0.05)
        state = engine.get_state()
    return state


def test_stop_string_is_trimmed_unless_no_stop_trim(engine: Any) -> None:
    out = gen(engine, stop="world w", **FORCE_WORLD)
    assert out["text"] == " "
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "world w"}
    assert out["output_ids"] == [WORLD, WORLD]
    kept = gen(engine, stop=["never", "world w"], no_stop_trim=True, **FORCE_WORLD)
    assert kept["text"] == " world world"


def test_stop_regex_is_trimmed(engine: Any) -> None:
    out = gen(engine, stop_regex=r"(world ){2}", **FORCE_WORLD)
    assert out["text"] == " world world world"[: len(" ")]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_stop_token_ids_and_eos(engine: Any) -> None:
    out = gen(engine, stop_token_ids=[WORLD], **FORCE_WORLD)
    assert out["output_ids"] == [WORLD]
    assert out["text"] == ""
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": WORLD}
    kept = gen(engine, stop_token_ids=[WORLD], no_stop_trim=True, **FORCE_WORLD)
    assert kept["text"] == " world"

    eos = gen(engine, logit_bias={str(EOS): 100.0})
    assert eos["output_ids"] == [EOS]
    assert eos["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
    ignored = gen(engine, logit_bias={str(EOS): 100.0}, ignore_eos=True)
    assert ignored["output_ids"] == [EOS] * 8
    assert ignored["meta_info"]["finish_reason"] == {"type": "length", "length": 8}


def test_min_new_tokens_masks_eos(engine: Any) -> None:
    out = gen(engine, logit_bias={str(EOS): 100.0}, min_new_tokens=3)
    assert len(out["output_ids"]) == 4
    assert EOS not in out["output_ids"][:3] and out["output_ids"][3] == EOS


def test_max_new_tokens_zero_and_none(engine: Any) -> None:
    zero = gen(engine, max_new_tokens=0)
    assert zero["output_ids"] == [] and zero["text"] == ""
    assert zero["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    ids = engine.tokenizer.encode("Hi")
    unlimited = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": None, "ignore_eos": True, "temperature": 0},
    )
    assert len(unlimited["output_ids"]) == 512 - len(ids)  # up to the context length


def test_seed_reproducible_and_batch_independent(engine: Any) -> None:
    params = {"temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 1234}
    a = engine.generate("Seeded", params)["output_ids"]
    b = engine.generate(["Other prompt", "Seeded"], [{"temperature": 1.0}, params])[1]["output_ids"]
    assert a == b
    c = engine.generate("Seeded", {**params, "sampling_seed": 99})["output_ids"]
    assert c != a


def test_n_samples(engine: Any) -> None:
    outs = engine.generate(
        "Pick", {"temperature": 1.0, "max_new_tokens": 6, "n": 3, "sampling_seed": 5}
    )
    assert isinstance(outs, list) and len(outs) == 3
    assert len({tuple(o["output_ids"]) for o in outs}) > 1
    again = engine.generate(
        "Pick", {"temperature": 1.0, "max_new_tokens": 6, "n": 3, "sampling_seed": 5}
    )
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]
    # the samples share the prompt through the cache (prefilled once first)
    assert all(o["meta_info"]["cached_tokens"] == o["meta_info"]["prompt_tokens"] - 1 for o in outs)
    batch = engine.generate(["a", "b"], {"temperature": 0, "max_new_tokens": 2, "n": 2})
    assert len(batch) == 4


def test_stream_deltas_add_up(engine: Any) -> None:
    params = {"temperature": 0, "max_new_tokens": 20}
    full = engine.generate("Stream me", params)
    chunks = list(engine.generate("Stream me", params, stream=True))
    assert len(chunks) > 1
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert [t for c in chunks for t in c["output_ids"]] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 20}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_stream_holds_back_a_partial_stop_string(engine: Any) -> None:
    chunks = list(
        engine.generate(
            "Hi",
            {"temperature": 0, "max_new_tokens": 8, "stop": " world world world", **FORCE_WORLD},
            stream=True,
        )
    )
    assert "".join(c["text"] for c in chunks) == ""


def test_async_generate(engine: Any) -> None:
    async def main() -> tuple[Any, list[Any]]:
        one = await engine.async_generate(
            "Async", sampling_params={"temperature": 0, "max_new_tokens": 4}
        )
        stream = await engine.async_generate(
            "Async", stream=True, sampling_params={"temperature": 0, "max_new_tokens": 4}
        )
        return one, [c async for c in stream]

    one, chunks = asyncio.run(main())
    assert "".join(c["text"] for c in chunks) == one["text"]


def test_abort_by_rid(engine: Any) -> None:
    stream = engine.generate(
        "Long", {"max_new_tokens": 400, "ignore_eos": True}, stream=True, rid="to-abort"
    )
    first = next(stream)
    assert first["meta_info"]["finish_reason"] is None
    engine.abort("to-abort")
    last = list(stream)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert gen(engine)["meta_info"]["completion_tokens"] == 8


def test_duplicate_rid_rejected(engine: Any) -> None:
    with pytest.raises(ValueError, match="unique"):
        engine.generate(["a", "b"], rid=["same", "same"])


def test_flush_cache_and_state(engine: Any) -> None:
    gen(engine, "Fill the cache")
    assert engine.get_state()["evictable_tokens"] > 0
    assert engine.flush_cache()
    state = engine.get_state()
    assert state["evictable_tokens"] == 0
    assert state["free_tokens"] == state["max_total_tokens"]


def test_state_places_a_run_in_the_schedulers_busy_periods(engine: Any) -> None:
    """get_state's busy_periods (first launch, idle again) are on the client's perf_counter
    clock: a request's period lies within the client's call, and the runs do not overlap."""
    idle_state(engine)
    start = time.perf_counter()
    gen(engine, "Count to ten")
    end = time.perf_counter()
    periods = idle_state(engine)["busy_periods"]
    assert all(a <= b for a, b in periods) and all(
        b <= c for (_, b), (c, _) in zip(periods, periods[1:], strict=False)
    )
    first, last = periods[-1]
    assert start <= first <= last <= time.perf_counter()
    assert first < end  # launched before the output came back


def test_child_death_stops_the_engine_with_a_clear_error(tiny_model_dir: Path) -> None:
    eng = weft.Engine(str(tiny_model_dir))
    try:
        procs = list(eng._procs.values())
        eng._procs["scheduler"].kill()
        with pytest.raises(RuntimeDown, match="scheduler process exited"):
            for _ in range(100):
                gen(eng)
    finally:
        eng.shutdown()
    assert not any(p.is_alive() for p in procs)


def test_shutdown_leaves_no_process(tiny_model_dir: Path) -> None:
    with weft.Engine(str(tiny_model_dir)) as eng:
        procs = list(eng._procs.values())
        assert all(p.is_alive() for p in procs)
    assert not any(p.is_alive() for p in procs)
    with pytest.raises(RuntimeDown):
        gen(eng)


def test_paged_prefix_reuse_is_page_aligned(tiny_model_dir: Path) -> None:
    with weft.Engine(str(tiny_model_dir), page_size=4) as eng:
        shared = list(range(1000, 1023))  # 23 shared tokens
        first = eng.generate(input_ids=shared + [5, 6], sampling_params={"max_new_tokens": 3})
        assert first["meta_info"]["cached_tokens"] == 0
        before = eng.get_state()["num_forward_tokens"]
        second = eng.generate(input_ids=shared + [7, 8, 9], sampling_params={"max_new_tokens": 3})
        ran = eng.get_state()["num_forward_tokens"] - before
        assert second["meta_info"]["cached_tokens"] == 20  # 23 rounded down to whole pages
        assert ran == 26 - 20 + 2
        # the whole first request (prompt + output but the last token) went into the tree
        again = eng.generate(
            input_ids=shared + [5, 6] + first["output_ids"], sampling_params={"max_new_tokens": 1}
        )
        assert again["meta_info"]["cached_tokens"] == 24
        state = eng.get_state()
        assert state["free_tokens"] + state["evictable_tokens"] == state["max_total_tokens"]


def test_dummy_weights_engine(tiny_model_dir: Path, tmp_path: Path) -> None:
    """load_format="dummy" needs only config.json (and a tokenizer): no weight files."""
    import shutil

    for name in os.listdir(tiny_model_dir):
        if not name.endswith(".safetensors"):
            shutil.copy(tiny_model_dir / name, tmp_path / name)
    with pytest.raises(ValueError, match="safetensors"):
        weft.Engine(str(tmp_path))
    with weft.Engine(str(tmp_path), load_format="dummy", seed=3) as eng:
        a = eng.generate("Hi", {"temperature": 0, "max_new_tokens": 5})
    with weft.Engine(str(tmp_path), load_format="dummy", seed=3) as eng:
        b = eng.generate("Hi", {"temperature": 0, "max_new_tokens": 5})
    assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == 5


def test_requests_sharing_an_uncached_prefix_prefill_it_once(engine: Any) -> None:
    """Submitted together, 8 prompts with a common 64-token head: one computes it, 7 reuse it."""
    engine.flush_cache()
    shared = [(7 * i) % 4000 + 100 for i in range(64)]
    ids = [shared + [200 + i, 300 + i, 400 + i] for i in range(8)]
    before = engine.get_state()["num_forward_tokens"]
    outs = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})
    assert sorted(o["meta_info"]["cached_tokens"] for o in outs) == [0] + [64] * 7
    assert engine.get_state()["num_forward_tokens"] - before == 64 + 8 * 3


def test_a_backtracking_stop_regex_aborts_its_request_only(engine: Any) -> None:
    with pytest.raises(ValueError, match="catastrophic backtracking"):
        gen(engine, max_new_tokens=80, stop_regex=["( world| world world)+x"], **FORCE_WORLD)
    assert gen(engine, stop="world w", **FORCE_WORLD)["text"] == " "  # still serving


def test_the_state_counts_steps_and_their_wall_time_per_kind(engine: Any) -> None:
    """get_state: extend / decode steps launched and their launch-to-launch time (µs). One
    request of 6 tokens: its prefill samples the first, 5 decode steps the rest (overlap too:
    no step is launched past max_new_tokens)."""
    before = idle_state(engine)
    engine.generate(
        input_ids=[11, 12, 13], sampling_params={"max_new_tokens": 6, "ignore_eos": True}
    )
    after = engine.get_state()
    assert after["extend_steps"] - before["extend_steps"] == 1
    assert after["decode_steps"] - before["decode_steps"] == 5
    assert after["decode_us"] > before["decode_us"] and after["extend_us"] > before["extend_us"]
    # the scheduler froze what it built at start-up: its collections skip those objects
    assert after["gc_frozen"] > 10_000
    assert len(after["gc_collections"]) == 3


def test_a_batch_is_sent_as_one_message_and_prefilled_in_one_step(engine: Any) -> None:
    """The prompts of one generate call reach the scheduler together: one prefill step for all
    (sent one by one, the first arrivals started a prefill of their own)."""
    before = idle_state(engine)
    prompts = [[20 + i, 30 + i, 40 + i, 50 + i] for i in range(24)]
    outs = engine.generate(
        input_ids=prompts, sampling_params={"max_new_tokens": 1, "ignore_eos": True}
    )
    assert (
        isinstance(outs, list) and [o["meta_info"]["completion_tokens"] for o in outs] == [1] * 24
    )
    assert engine.get_state()["extend_steps"] - before["extend_steps"] == 1


def test_a_batch_in_parts_gives_the_outputs_of_one_message(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call larger than BATCH_PART_TOKENS goes to the scheduler in several messages: the same
    greedy outputs, in input order."""
    prompts = [[20 + i, 30 + i, 40 + i, 50 + i] for i in range(24)]
    params = {"max_new_tokens": 3, "ignore_eos": True, "temperature": 0}
    whole = engine.generate(input_ids=prompts, sampling_params=params)
    monkeypatch.setattr(request_parts, "BATCH_PART_TOKENS", 10)  # parts of 3 prompts
    parts = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in parts] == [o["output_ids"] for o in whole]


def test_a_batch_with_a_running_rid_is_refused_whole(engine: Any) -> None:
    with pytest.raises(ValueError, match="rid values in a batch must be unique"):
        engine.generate(["a", "b", "c"], {"max_new_tokens": 2}, rid=["one", "twice", "twice"])
    busy = engine.generate(
        "Hi", {"max_new_tokens": 64, "ignore_eos": True}, rid="busy", stream=True
    )
    try:
        with pytest.raises(ValueError, match="'busy' is already running"):
            engine.generate(["a", "b"], {"max_new_tokens": 2}, rid=["fresh", "busy"])
        # nothing of the refused batch was sent or kept: its other rid is free
        assert (
            engine.generate("a", {"max_new_tokens": 2}, rid="fresh")["meta_info"]["id"] == "fresh"
        )
    finally:
        assert sum(1 for _ in busy) >= 1
