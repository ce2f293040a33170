"""A grammar backend that raises (an assert, a Rust panic, a bug) fails one request, never the
scheduler: compile failures are GrammarErrors of that spec, a matcher that raises mid-generation
ends its request with a 400 grammar error while the rest of the batch completes."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from weft.constrain import GrammarCompiler, GrammarError, GrammarSpec
from weft.constrain.base import CompiledGrammar, GrammarBackend, GrammarMatcher
from weft.constrain.llguidance_matcher import LLGuidanceMatcher
from weft.constrain.vocab import TokenSpace
from weft.runtime.config import EngineConfig
from weft.runtime.executor.distributed import Inbox
from weft.runtime.ipc.messages import FinishReason, TokenizedGenerateReq
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.scheduler.grammar import GrammarQueue
from weft.runtime.scheduler.request import Req
from weft.runtime.scheduler.scheduler import Scheduler


class Panic(BaseException):
    """What pyo3 raises for a Rust panic: a BaseException, not an Exception."""


##### Compiles #####


class RaisingBackend(GrammarBackend):
    """Compiles nothing: raises what the spec's text names."""

    name = "raising"

    def __init__(self) -> None:
        super().__init__(TokenSpace(4, 4, frozenset({3}), frozenset(), "test"), strict=False)

    def compile(self, spec: GrammarSpec, timeout_s: float | None = None) -> CompiledGrammar:
        raise {"assert": AssertionError("too many expressions"), "panic": Panic("boom")}[spec.spec]


@pytest.mark.parametrize(
    ("text", "message"),
    [("assert", "AssertionError: too many expressions"), ("panic", "Panic: boom")],
)
def test_a_compile_that_raises_fails_that_spec_alone(text: str, message: str) -> None:
    compiler = GrammarCompiler(RaisingBackend(), timeout_s=5)
    handle = compiler.submit(GrammarSpec.regex(text))
    with pytest.raises(GrammarError, match=re.escape(f"raising grammar backend ({message})")):
        handle.result(wait_s=5)
    limited = compiler.submit(GrammarSpec.regex("a{1000000}"))  # refused before the backend
    with pytest.raises(GrammarError, match="repetition count of 1000000; the limit is 10000"):
        limited.result(wait_s=5)
    compiler.close()


def test_an_interpreter_exit_is_not_contained() -> None:
    class Exiting(RaisingBackend):
        def compile(self, spec: GrammarSpec, timeout_s: float | None = None) -> CompiledGrammar:
            raise KeyboardInterrupt

    compiler = GrammarCompiler(Exiting(), timeout_s=5)
    with pytest.raises(KeyboardInterrupt):
        compiler.submit(GrammarSpec.regex("x")).result(wait_s=5)
    compiler.close()


class UnstartableGrammar(CompiledGrammar):
    def matcher(self) -> GrammarMatcher:
        raise Panic("deep_copy panicked")


class UnstartableBackend(RaisingBackend):
    def compile(self, spec: GrammarSpec, timeout_s: float | None = None) -> CompiledGrammar:
        return UnstartableGrammar(spec)


def test_a_matcher_that_cannot_start_fails_its_request_alone() -> None:
    queue = GrammarQueue(EngineConfig(), tokenizer=None, vocab_size=4, stop_ids=frozenset({3}))
    queue.compiler = GrammarCompiler(UnstartableBackend(), timeout_s=5)
    req = Req(rid="a", input_ids=[1], params=SamplingParams(), max_new_tokens=2)
    queue.submit(req, GrammarSpec.regex("x"))
    deadline = time.monotonic() + 10
    while not queue.scan()[0] and time.monotonic() < deadline:
        time.sleep(0.01)
    ready, failed = queue.take(*queue.scan())
    assert ready == [] and queue.pending == []
    assert failed == [(req, "Failed to start the grammar: Panic: deep_copy panicked")]
    queue.close()


##### Matchers #####


class FlakyMatcher(GrammarMatcher):
    """Allows every content token forever; the hook named by `breaks` raises `error`."""

    def __init__(self, breaks: str, error: BaseException) -> None:
        super().__init__(TokenSpace(64, 64, frozenset({0}), frozenset(), "test"))
        self.breaks, self.error_ = breaks, error

    def _hook(self, name: str) -> None:
        if name == self.breaks:
            raise self.error_

    def _fill_content(self, row_ptr: int) -> None:
        self._hook("fill")
        import ctypes

        ctypes.memset(row_ptr, 0xFF, self._space.words * 4)

    def _can_end(self) -> bool:
        return True

    def _accept_content(self, token: int) -> bool:
        self._hook("accept")
        return True

    def _rollback_content(self, k: int) -> None:
        self._hook("rollback")

    def _forced_content(self) -> list[int]:
        self._hook("forced")
        return []

    def _clone(self) -> GrammarMatcher:
        self._hook("clone")
        return FlakyMatcher(self.breaks, self.error_)


def allowed(matcher: GrammarMatcher) -> list[int]:
    import torch

    bitmask = torch.zeros((1, 2), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    words = bitmask[0].tolist()
    return [i for i in range(64) if (words[i // 32] >> (i % 32)) & 1]


@pytest.mark.parametrize("error", [AssertionError("lexer"), Panic("rust"), RecursionError()])
def test_a_hook_that_raises_leaves_a_matcher_in_error_that_only_ends(error: BaseException) -> None:
    fill = FlakyMatcher("fill", error)
    assert allowed(fill) == [0]  # only the stop id
    assert fill.error() is not None and "computing the mask" in fill.error()
    assert type(error).__name__ in fill.error()
    assert not fill.accept_token(5) and not fill.accept_token(0)

    accept = FlakyMatcher("accept", error)
    assert allowed(accept) == list(range(1, 64)) + [0] or len(allowed(accept)) == 64
    assert not accept.accept_token(5)
    assert "accepting token 5" in (accept.error() or "")
    assert allowed(accept) == [0] and accept.forced_tokens() == []

    forced = FlakyMatcher("forced", error)
    assert forced.forced_tokens() == [] and "forced tokens" in (forced.error() or "")

    rollback = FlakyMatcher("rollback", error)
    assert rollback.accept_token(5)
    rollback.rollback(1)
    assert "rolling back" in (rollback.error() or "")

    with pytest.raises(GrammarError, match="copying its state"):
        FlakyMatcher("clone", error).copy()


def test_interpreter_exits_pass_through_a_matcher() -> None:
    with pytest.raises(KeyboardInterrupt):
        FlakyMatcher("accept", KeyboardInterrupt()).accept_token(5)
    with pytest.raises(SystemExit):
        allowed(FlakyMatcher("fill", SystemExit()))


##### The scheduler: one request's grammar fails mid-generation, its batch goes on #####


def run(model: Path, overlap: str, breaks: str, monkeypatch: Any) -> dict[str, FinishReason]:
    """Three requests in one batch: `bad` (its matcher raises a panic at its second token, in the
    hook `breaks`), `good` (constrained too) and `plain`; their finishes."""
    # the prefetch: a mask computed on the worker thread, its error raised where it is joined
    hook = {"accept": "_accept_content", "prefetch": "_finish"}[breaks]
    original = getattr(LLGuidanceMatcher, hook)

    def flaky(self: LLGuidanceMatcher, *args: Any) -> Any:
        countdown = getattr(self, "countdown", None)
        if countdown is not None:
            self.countdown = countdown - 1  # type: ignore[attr-defined]
            if countdown == 0:
                raise Panic("called `Option::unwrap()` on a `None` value")
        return original(self, *args)

    monkeypatch.setattr(LLGuidanceMatcher, hook, flaky)
    config = EngineConfig(model=str(model), cpu_threads=1, overlap_schedule=overlap)
    sched = Scheduler(config, model, None)
    done: dict[str, FinishReason] = {}
    outputs: dict[str, list[int]] = {}

    def emit(reqs: list[Any]) -> None:
        for r in reqs:
            if r.finished:
                done[r.rid], outputs[r.rid] = r.finish, list(r.output_ids)

    sched.emit = emit  # type: ignore[method-assign]
    take = sched.grammars.take

    def marking_take(*args: Any) -> Any:
        ready, failed = take(*args)
        for req in ready:
            if req.rid == "bad":
                req.grammar.countdown = 1
        return ready, failed

    sched.grammars.take = marking_take  # type: ignore[method-assign]
    regex = SamplingParams(max_new_tokens=6, regex="[a-z]{40}", temperature=0.0)
    plain = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    for rid, params in (("bad", regex), ("good", regex), ("plain", plain)):
        sched.add_request(TokenizedGenerateReq(rid, [5, 6, 7], params, 6))
    steps = 0
    while sched.has_work() or sched.grammars.pending:
        ready, failed = sched.grammars.scan()
        sched.apply(Inbox(ready, failed, []))
        batch = sched.schedule()
        sched.process_results(sched.launch(batch))
        if batch is None:
            time.sleep(0.005)
        steps += 1
        assert steps < 500
    sched.cache.check_conservation()
    sched.grammars.close()
    assert len(outputs["plain"]) == 6 and len(outputs["good"]) >= 2
    return done


@pytest.mark.parametrize("breaks", ["accept", "prefetch"])
@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_matcher_that_panics_mid_generation_ends_its_request_alone(
    tiny_model_dir: Path, overlap: str, breaks: str, monkeypatch: Any
) -> None:
    done = run(tiny_model_dir, overlap, breaks, monkeypatch)
    bad = done["bad"]
    assert bad.type == "abort" and bad.status == 400, bad
    assert bad.message is not None and "grammar error" in bad.message
    assert "Panic: called `Option::unwrap()` on a `None` value" in bad.message
    assert done["good"].type in ("stop", "length") and done["plain"].type == "length"
