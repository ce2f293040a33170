"""llguidance mask prefetch: masks, forced tokens and state identical with and without it."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from test_constrain_support import (
    STOP,
    VOCAB,
    allowed,
    backend,
    encode,
    regexes,
    schemas,
    tokenizer,
)

from weft.constrain import (
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    GrammarSpec,
    allocate_bitmask,
    create_grammar_backend,
)


@functools.cache
def sync_backend() -> GrammarBackend:
    return create_grammar_backend("llguidance", tokenizer(), VOCAB, [STOP], prefetch_masks=False)


def corpus() -> list[tuple[GrammarSpec, list[str]]]:
    items = []
    for e in schemas():
        valid = [json.dumps(v, ensure_ascii=False) for v in e["valid"]] + e["valid_text"]
        items.append((GrammarSpec.json_schema(e["schema"]), valid))
    for r in regexes():
        items.append((GrammarSpec.regex(r["pattern"]), r["valid"]))
    return items


def row(m: GrammarMatcher) -> torch.Tensor:
    bitmask = allocate_bitmask(1, VOCAB)
    bitmask.fill_(0)
    m.fill_bitmask(bitmask, 0)
    return bitmask[0]


def test_masks_identical_over_the_corpus() -> None:
    """Every step of every valid corpus text: the same mask, forced tokens and answers."""
    steps = prefetched = 0
    for spec, texts in corpus():
        try:
            fast, slow = backend("llguidance").compile(spec), sync_backend().compile(spec)
        except GrammarError:
            continue
        for text in texts:
            a, b = fast.matcher(), slow.matcher()
            for token in [*encode(text), STOP]:
                prefetched += a._job is not None  # type: ignore[attr-defined]
                mask = row(a)
                assert torch.equal(mask, row(b)), (spec.spec, text, steps)
                assert torch.equal(mask, row(a)), "a repeat fill at the same state"
                assert a.error() == b.error() and a.forced_tokens() == b.forced_tokens()
                steps += 1
                if not allowed(mask[None], token):
                    break
                assert a.accept_token(token) == b.accept_token(token)
            assert a.is_terminated() == b.is_terminated()
    assert steps > 1000 and prefetched > steps // 2, (steps, prefetched)


def test_copy_rollback_and_accept_while_a_prefetch_runs() -> None:
    """State changes right after an accept (prefetch in flight) wait for it and stay exact."""
    schema = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30}}}
    spec = GrammarSpec.json_schema(schema)
    a = backend("llguidance").compile(spec).matcher()
    b = sync_backend().compile(spec).matcher()
    ids = encode('{"title": "Launch day"}')
    for token in ids[:5]:
        assert a.accept_token(token) and b.accept_token(token)
    assert a._job is not None  # type: ignore[attr-defined]
    clone = a.copy()
    assert torch.equal(row(clone), row(b))
    a.rollback(2)
    b.rollback(2)
    assert a.forced_tokens() == b.forced_tokens()
    assert torch.equal(row(a), row(b))
    for token in ids[3:]:
        assert a.accept_token(token) and b.accept_token(token)  # no fill in between
    assert torch.equal(row(a), row(b))
    assert a.accept_token(STOP) and b.accept_token(STOP) and a.is_terminated()
    assert torch.equal(row(a), row(b))


def test_a_batch_of_queued_prefetches_gives_the_same_masks() -> None:
    """Many matchers advanced in lock step (a batch): their prefetches queue together behind one
    another; every mask equals the one computed without prefetch."""
    items = [(spec, text) for spec, texts in corpus()[:40] for text in texts[:1]]
    pairs, ids = [], []
    for spec, text in items:
        try:
            fast, slow = backend("llguidance").compile(spec), sync_backend().compile(spec)
        except GrammarError:
            continue
        pairs.append((fast.matcher(), slow.matcher()))
        ids.append([*encode(text), STOP])
    assert len(pairs) >= 30
    steps = queued = 0
    for t in range(max(map(len, ids))):
        for (a, b), tokens in zip(pairs, ids, strict=True):
            if t >= len(tokens) or a.is_terminated():
                continue
            queued += a._job is not None  # type: ignore[attr-defined]
            mask = row(a)
            assert torch.equal(mask, row(b)), (t, tokens)
            steps += 1
            if allowed(mask[None], tokens[t]):
                assert a.accept_token(tokens[t]) and b.accept_token(tokens[t])
    assert steps > 300 and queued > steps // 2, (steps, queued)


def test_prefetch_forced_prefetches_forced_states_with_the_same_masks() -> None:
    """With prefetch_forced (forced tokens sampled through masks, no jump-forward) a state with
    forced tokens has its mask prefetched too; without it, none is started there. The masks equal
    the synchronous backend's at every step either way."""
    spec = GrammarSpec.regex(r'\{"answer": "(yes|no)", "id": [0-9]{3}\}')
    forced_backend = create_grammar_backend(
        "llguidance", tokenizer(), VOCAB, [STOP], prefetch_forced=True
    )
    text = '{"answer": "yes", "id": 123}'
    for b, prefetch_forced in ((forced_backend, True), (backend("llguidance"), False)):
        m, ref = b.compile(spec).matcher(), sync_backend().compile(spec).matcher()
        forced_states = 0
        for token in [*encode(text), STOP]:
            if m.forced_tokens():
                forced_states += 1
                started = m._job is not None or m._ready  # type: ignore[attr-defined]
                assert started == prefetch_forced
            mask = row(m)
            assert torch.equal(mask, row(ref))
            assert allowed(mask[None], token)
            assert m.accept_token(token) and ref.accept_token(token)
        assert forced_states > 0


def lock_step_pairs(n: int) -> tuple[list[tuple[GrammarMatcher, GrammarMatcher]], list[list[int]]]:
    """Up to n (prefetching, synchronous) matcher pairs over corpus entries, with their tokens."""
    pairs, ids = [], []
    for spec, texts in corpus()[:n]:
        try:
            fast, slow = backend("llguidance").compile(spec), sync_backend().compile(spec)
        except GrammarError:
            continue
        pairs.append((fast.matcher(), slow.matcher()))
        ids.append([*encode(texts[0]), STOP])
    return pairs, ids


@pytest.fixture
def batching(monkeypatch: pytest.MonkeyPatch) -> None:
    """Step batches on (opt-in in the runtime)."""
    from weft.constrain.llguidance_prefetch import MASK_WORKER

    monkeypatch.setattr(MASK_WORKER, "batching", True)


def walk_in_step_batches(pairs: list, ids: list[list[int]]) -> int:
    """Each step: every matcher's fill checked against the synchronous one, then all accepts
    inside one prefetch_batch (as the scheduler's finish_step does); the steps walked."""
    from weft.constrain import prefetch_batch

    steps = 0
    for t in range(max(map(len, ids))):
        live = [(a, b, tokens[t]) for (a, b), tokens in zip(pairs, ids, strict=True)
                if t < len(tokens) and not a.is_terminated()]  # fmt: skip
        ok = []
        for a, b, token in live:
            mask = row(a)
            assert torch.equal(mask, row(b)), (t, token)
            steps += 1
            ok.append(allowed(mask[None], token))
        with prefetch_batch():
            for (a, b, token), fine in zip(live, ok, strict=True):
                if fine:
                    assert a.accept_token(token) and b.accept_token(token)
    return steps


def test_a_step_batch_computes_its_masks_together(batching: None) -> None:
    """Accepts inside prefetch_batch() hand their masks over only when it closes, as one batch
    computed in parallel: every mask equals the synchronous backend's."""
    from weft.constrain.llguidance_prefetch import MASK_WORKER

    pairs, ids = lock_step_pairs(40)
    assert len(pairs) >= 30
    together = MASK_WORKER._run_together
    sizes: list[int] = []

    def spy(items: list) -> None:
        sizes.append(len(items))
        together(items)

    MASK_WORKER._run_together = spy  # type: ignore[method-assign]
    try:
        # the new matchers' first masks were queued one by one: wait for them (they come after
        # any job still queued by an earlier test), so the queue holds nothing when we look
        for a, _ in pairs:
            row(a)
        with_batch = MASK_WORKER.batch()
        with with_batch:
            a, _ = pairs[0]
            assert a.accept_token(ids[0][0])
            assert MASK_WORKER._jobs.empty(), "handed over before the batch closed"
        row(a)  # joins the one-job batch
        pairs, ids = lock_step_pairs(40)
        steps = walk_in_step_batches(pairs, ids)
    finally:
        del MASK_WORKER._run_together
    assert steps > 300 and max(sizes) >= 20, (steps, sizes)


def test_a_failing_parallel_compute_falls_back_to_one_by_one(
    batching: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If the library's parallel call raises, each mask is computed alone: still identical."""
    from weft.constrain.llguidance_prefetch import MASK_WORKER

    class Broken:
        def unsafe_compute_mask_ptr(self, *args: object) -> None:
            raise RuntimeError("executor down")

    monkeypatch.setattr(MASK_WORKER, "_executor", Broken())
    pairs, ids = lock_step_pairs(12)
    assert walk_in_step_batches(pairs, ids) > 100


def test_a_batch_holds_only_its_own_threads_jobs(batching: None) -> None:
    """A prefetch another thread starts while a batch is open goes to the worker at once."""
    import threading

    from weft.constrain.llguidance_prefetch import MASK_WORKER

    spec = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    a = backend("llguidance").compile(spec).matcher()
    b = sync_backend().compile(spec).matcher()
    token = encode("{")[0]
    accepted: list[bool] = []
    with MASK_WORKER.batch():
        other = threading.Thread(target=lambda: accepted.append(a.accept_token(token)))
        other.start()
        other.join()
        assert accepted == [True] and MASK_WORKER._held == []  # not held by this batch
        assert a._job is not None and a._job.done.acquire(timeout=10)  # type: ignore[attr-defined]
        a._job.done.release()  # type: ignore[attr-defined]
        assert b.accept_token(token) and torch.equal(row(a), row(b))


def test_without_batching_a_batch_changes_nothing() -> None:
    """The default: prefetches inside prefetch_batch() start at once, one by one."""
    from weft.constrain import prefetch_batch
    from weft.constrain.llguidance_prefetch import MASK_WORKER

    assert not MASK_WORKER.batching
    pairs, ids = lock_step_pairs(12)
    with prefetch_batch():
        assert MASK_WORKER._held is None
    assert walk_in_step_batches(pairs, ids) > 100


def test_several_worker_threads_give_the_same_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    """With 3 worker threads on one queue (WEFT_MASK_THREADS) every mask still equals the
    synchronous backend's, and jobs ran on more than one thread."""
    import threading

    from weft.constrain import llguidance_prefetch

    worker = llguidance_prefetch.MaskWorker()
    worker.num_workers = 3
    monkeypatch.setattr(llguidance_prefetch, "MASK_WORKER", worker)
    threads: set[str] = set()
    put = worker._put

    def spy(items: list) -> None:
        finish = items[0][2]

        def traced(address: int) -> None:
            threads.add(threading.current_thread().name)
            finish(address)

        put([(items[0][0], items[0][1], traced, items[0][3])])

    worker._put = spy  # type: ignore[method-assign]
    pairs, ids = lock_step_pairs(40)
    assert walk_in_step_batches(pairs, ids) > 300
    assert len(threads) > 1, threads


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("WEFT_MASK_THREADS", "two", "WEFT_MASK_THREADS must be a thread count"),
        ("WEFT_MASK_BATCH", "yes", "WEFT_MASK_BATCH must be 0 or 1"),
    ],
)
def test_bad_worker_switches_are_refused_by_name(
    name: str, value: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from weft.constrain import llguidance_prefetch

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        llguidance_prefetch.MaskWorker()
    monkeypatch.setenv(name, {"WEFT_MASK_THREADS": "2", "WEFT_MASK_BATCH": "1"}[name])
    worker = llguidance_prefetch.MaskWorker()
    assert worker.num_workers == 2 if name == "WEFT_MASK_THREADS" else worker.batching
