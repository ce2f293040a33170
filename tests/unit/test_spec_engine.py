"""Speculative decoding in in-process schedulers on a tiny random model (CPU): greedy outputs with
n-gram drafts equal those without, token for token, over page sizes, a pool short enough to
retract, stop ids and max_new_tokens, and with overlap scheduling between verify and plain
steps; drafts are accepted; KV slots are conserved."""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import save_tiny_llama

from weft.runtime.config import EngineConfig, TuningConfig
from weft.runtime.executor.batch import ForwardMode
from weft.runtime.executor.distributed import Inbox
from weft.runtime.ipc.messages import TokenizedGenerateReq
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.scheduler.scheduler import Scheduler


@pytest.fixture(scope="module")
def chaotic_model(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A 2-layer random Llama whose greedy output wanders (larger initial weights than the
    usual 0.02) instead of repeating one token: about a third of its n-gram drafts are
    accepted, so both acceptance and rejection run."""
    folder = tmp_path_factory.mktemp("chaotic-llama")
    return save_tiny_llama(folder, default_model_dir, tie_word_embeddings=False,
                           initializer_range=0.08)  # fmt: skip


def workload(n: int = 8, seed: int = 3) -> list[tuple[list[int], SamplingParams]]:
    """Prompts that repeat a phrase (n-gram lookup has something to find), greedy."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(50, 3000) for _ in range(rng.randrange(3, 9))]
        prompt = phrase * rng.randrange(2, 5) + [rng.randrange(50, 3000)]
        params = SamplingParams(temperature=0, max_new_tokens=rng.randrange(8, 40))
        out.append((prompt, params))
    return out


Outputs = dict[str, tuple[list[int], list[float], str]]


def run(model: Path, reqs: list[tuple[list[int], SamplingParams]], logprobs: bool = False,
        setup: Callable[[Scheduler], None] | None = None,
        **config: Any) -> tuple[Outputs, Scheduler]:  # fmt: skip
    """Each request's output ids, output logprobs and finish reason; the scheduler (`setup`
    sees it before the first request)."""
    sched = Scheduler(EngineConfig(model=str(model), cpu_threads=1, **config), model, None)
    if setup is not None:
        setup(sched)
    done: Outputs = {}
    lps: dict[str, list[float]] = {}

    def emit(rs: list[Any]) -> None:
        for r in rs:
            lps.setdefault(r.rid, []).extend(lp for lp, _ in r.out_logprobs)
            r.out_logprobs = []
            if r.finished:
                done[r.rid] = (list(r.output_ids), lps[r.rid], r.finish.type)

    sched.emit = emit  # type: ignore[method-assign]
    for i, (ids, params) in enumerate(reqs):
        msg = TokenizedGenerateReq(f"r{i}", ids, params, params.max_new_tokens or 0)
        msg.return_logprob = logprobs
        sched.add_request(msg)
    steps = 0
    while sched.has_work() or sched.grammars.pending:  # run_forever's loop, without a channel
        ready, failed = sched.grammars.scan()
        sched.apply(Inbox(ready, failed, []))
        batch = sched.schedule()
        sched.process_results(sched.launch(batch))
        if batch is None:
            time.sleep(0.005)  # grammars compiling
        steps += 1
        assert steps < 3000, "the scheduler does not finish"
    sched.settle()
    sched.cache.check_conservation()
    assert len(done) == len(reqs)
    return done, sched


def same_ids(a: Outputs, b: Outputs) -> bool:
    return {k: (v[0], v[2]) for k, v in a.items()} == {k: (v[0], v[2]) for k, v in b.items()}


@pytest.fixture(scope="module")
def plain(chaotic_model: Path) -> Outputs:
    return run(chaotic_model, workload(), logprobs=True)[0]


ROWS = TuningConfig(spec_decode_rows="on")
CASES = {
    "pages of 1": {},
    "pages of 4": {"page_size": 4},
    "one draft": {"speculative_num_draft_tokens": 2},
    "eight drafts, pages of 4": {"speculative_num_draft_tokens": 9, "page_size": 4},
    "short pool, retracting": {
        "page_size": 4,
        "max_total_tokens": 160,
        "schedule_conservativeness": 0.0,
    },
    "no radix cache": {"disable_radix_cache": True},
    "mixed chunks": {"enable_mixed_chunk": True},
    # verify steps as decode rows (what replays from the decode CUDA graphs)
    "verify as decode rows, pages of 4": {"page_size": 4, "tuning": ROWS},
    "verify as decode rows, retracting": {
        "page_size": 4,
        "max_total_tokens": 160,
        "schedule_conservativeness": 0.0,
        "tuning": ROWS,
    },
}


@pytest.mark.parametrize("case", list(CASES))
def test_ngram_greedy_equals_plain(chaotic_model: Path, plain: Outputs, case: str) -> None:
    modes: list[ForwardMode] = []  # of the verify steps' forwards
    spec, sched = run(chaotic_model, workload(), logprobs=True, speculative_algorithm="ngram",
                      setup=lambda s: watch_verify_modes(s, modes), **CASES[case])  # fmt: skip
    assert same_ids(spec, plain)
    for rid, (_, lps, _) in spec.items():  # the target's logprob of every accepted token
        assert lps == pytest.approx(plain[rid][1], abs=1e-3), rid
    st = sched.stats
    assert 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"]
    if "retract" in case:
        assert st["retractions"] > 0
    rows = "decode rows" in case
    assert set(modes) == {ForwardMode.DECODE if rows else ForwardMode.EXTEND}, modes


def watch_verify_modes(sched: Scheduler, modes: list[ForwardMode]) -> None:
    """Note the mode each verify step's forward runs in (decode rows, or one extend)."""
    build = sched.runner._forward_batch

    def watched(batch: Any) -> Any:
        fb, futures = build(batch)
        if batch.drafts is not None:
            modes.append(fb.mode)
        return fb, futures

    sched.runner._forward_batch = watched  # type: ignore[method-assign]


def alternate(sched: Scheduler) -> None:
    """A verify step, then two plain steps (StepCosts measures on a GPU what pays): the second
    plain step may launch behind the first."""
    assert sched.speculator is not None
    turn = iter(range(10**6))
    sched.speculator.costs.speculate = lambda batch_size: next(turn) % 3 == 0  # type: ignore[method-assign]


OVERLAP = {
    "ngram": {"speculative_algorithm": "ngram"},
    "draft": {"speculative_algorithm": "draft", "page_size": 4},
}


@pytest.mark.parametrize("algo", list(OVERLAP))
def test_overlap_between_plain_and_verify_steps(
    chaotic_model: Path, plain: Outputs, algo: str
) -> None:
    """With overlap scheduling, plain decode steps launch behind the one in flight and a verify
    step waits for it (its drafts need the tokens): outputs and logprobs equal plain decoding's."""
    config = dict(OVERLAP[algo], overlap_schedule="on")
    if algo == "draft":
        config["speculative_draft_model_path"] = str(chaotic_model)
    spec, sched = run(chaotic_model, workload(), logprobs=True, setup=alternate, **config)
    assert same_ids(spec, plain)
    for rid, (_, lps, _) in spec.items():
        assert lps == pytest.approx(plain[rid][1], abs=1e-3), rid
    st = sched.stats
    assert st["spec_verify_steps"] > 0 and st["spec_accepted_tokens"] > 0, st
    assert st["overlapped_steps"] > 0, st


WORDS = r"(ab|cd|abc|dab)( (ab|cd|abc|dab)){30}"


def constrained(tokenizer: Any) -> list[tuple[list[int], SamplingParams]]:
    """Regex-constrained greedy requests over a small alphabet, prompts in the same words: the
    output repeats n-grams of the prompt and of itself, and the grammar forces some tokens."""
    rng = random.Random(11)
    out = []
    for _ in range(6):
        text = " ".join(rng.choice(["ab", "cd", "abc", "dab"]) for _ in range(rng.randrange(8, 20)))
        params = SamplingParams(temperature=0, max_new_tokens=rng.randrange(20, 50), regex=WORDS)
        out.append((tokenizer.encode(text), params))
    return out


@pytest.mark.parametrize("overlap", [False, True])
def test_ngram_constrained_greedy_equals_plain(chaotic_model: Path, overlap: bool) -> None:
    """Also with overlap scheduling, plain and verify steps taking turns: forced tokens are
    sampled one by one after a plain step and appended (jump-forward) after a verify step."""
    page_size = 4
    from transformers import AutoTokenizer

    reqs = constrained(AutoTokenizer.from_pretrained(chaotic_model))
    plain, _ = run(chaotic_model, reqs, page_size=page_size)
    more: dict[str, Any] = {"overlap_schedule": "on", "setup": alternate} if overlap else {}
    spec, sched = run(chaotic_model, reqs, page_size=page_size, speculative_algorithm="ngram",
                      **more)  # fmt: skip
    assert same_ids(spec, plain)
    st = sched.stats
    assert 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"]
    tok = AutoTokenizer.from_pretrained(chaotic_model)
    for ids, _, finish in spec.values():  # each output is a prefix of the regex's language
        text = tok.decode(ids)
        assert re.fullmatch(WORDS, text) or finish == "length", (text, finish)


@pytest.mark.parametrize("draft", ["itself", "another model", "itself, verify as decode rows"])
def test_draft_model_greedy_equals_plain(
    chaotic_model: Path, tiny_model_dir: Path, plain: Outputs, draft: str
) -> None:
    """A draft model with the target's vocabulary: the target itself (its drafts are the
    target's own greedy tokens: nearly all accepted) and an unrelated random model (mostly
    rejected); outputs and logprobs equal plain decoding's either way."""
    path = tiny_model_dir if draft == "another model" else chaotic_model
    more = {"tuning": ROWS} if "decode rows" in draft else {}
    spec, sched = run(chaotic_model, workload(), logprobs=True, page_size=4,
                      speculative_algorithm="draft", speculative_draft_model_path=str(path),
                      **more)  # fmt: skip
    assert same_ids(spec, plain)
    for rid, (_, lps, _) in spec.items():
        assert lps == pytest.approx(plain[rid][1], abs=1e-3), rid
    st = sched.stats
    assert st["spec_verify_steps"] > 0
    if draft.startswith("itself"):
        assert st["spec_accepted_tokens"] >= 0.9 * st["spec_draft_tokens"], st
    else:
        assert st["spec_accepted_tokens"] < st["spec_draft_tokens"], st


def test_draft_model_sampling_runs_and_conserves(chaotic_model: Path) -> None:
    reqs = [(ids, SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=p.max_new_tokens,
                                 sampling_seed=i)) for i, (ids, p) in enumerate(workload())]  # fmt: skip
    spec, sched = run(chaotic_model, reqs, speculative_algorithm="draft",
                      speculative_draft_model_path=str(chaotic_model))  # fmt: skip
    assert sched.stats["spec_accepted_tokens"] > 0
    for i, (_, p) in enumerate(reqs):
        ids, _, finish = spec[f"r{i}"]
        assert len(ids) == p.max_new_tokens or finish == "stop", (i, len(ids), finish)
