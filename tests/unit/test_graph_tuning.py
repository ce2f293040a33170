"""What the decode graphs run on (runtime/executor/graph_tuning.py): projections grouped by
shape, nothing chosen off CUDA, the fastest launch picked, the cuBLAS path measured and its
setting restored; the graph runner keeps the faster step without touching the model."""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers
from torch import nn

from weft.runtime.config import TuningConfig
from weft.runtime.executor import graph_tuning
from weft.runtime.models import build_model, init_dummy_weights
from weft.runtime.models.layers import GemvPlan


def tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    return build_model(config, 64, torch.device("cpu"), torch.float32)


def test_projections_are_grouped_by_shape_with_the_down_projection_gated() -> None:
    groups = graph_tuning.by_shape(tiny_llama())
    # qkv: 32 -> 4 q heads + 2 x 2 kv heads of 8; o: 32 -> 32; gate/up: 32 -> 96; down: 48 -> 32
    assert {k: len(v) for k, v in groups.items()} == {
        (64, 32, False): 3, (32, 32, False): 3, (96, 32, False): 3, (32, 48, True): 3,
    }  # fmt: skip


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
def test_nothing_is_chosen_for_weights_off_cuda(mode: str) -> None:
    assert graph_tuning.choose_gemv(tiny_llama(), [1, 2, 4, 8], mode) == {}


def test_no_launch_that_fits_leaves_the_shape_on_cublas(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where no candidate launch fits the device (its shared memory), the shape gets no GEMV
    and a warning says so, instead of the start-up failing."""
    model = tiny_llama()
    monkeypatch.setattr(graph_tuning._GraphTimer, "fits", lambda self, launch: False)
    mods = graph_tuning.by_shape(model)[(32, 32, False)]
    with caplog.at_level("WARNING", logger="weft.runtime.executor.graph_tuning"):
        assert graph_tuning._pick(mods, [1, 2, 4, 32]) == {}
    assert "no skinny GEMV launch fits the [32, 32] projections" in caplog.text


def test_the_timed_fastest_launch_is_picked_for_every_size_the_gemv_serves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every size the GEMV serves (<= 16 rows) gets the candidate timed fastest."""
    pytest.importorskip("triton", reason="GemvLaunch lives with its Triton kernel")
    from weft.kernels.skinny import GemvLaunch

    mods = graph_tuning.by_shape(tiny_llama())[(32, 32, False)]
    want = GemvLaunch(*graph_tuning.CANDIDATES[-1])
    monkeypatch.setattr(graph_tuning._GraphTimer, "fits", lambda self, launch: True)
    monkeypatch.setattr(graph_tuning._GraphTimer, "gemv_op", staticmethod(lambda launch: launch))
    monkeypatch.setattr(graph_tuning._GraphTimer, "us", lambda self, op: 1.0 if op == want else 2.0)
    assert graph_tuning._pick(mods, [1, 2, 4, 32]) == {1: want, 2: want, 4: want}


@pytest.mark.parametrize("gemv_faster", [True, False])
def test_the_graph_runner_keeps_the_faster_step(
    gemv_faster: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GraphRunner._keep_faster's bookkeeping (capture and replay stubbed: they need CUDA): the
    size's graphs with the GEMV come back when they replay faster; otherwise the cuBLAS graphs
    stay and the size leaves the runner's plans. The model's modules are never modified."""
    from weft.runtime.executor.cuda_graph import GraphRunner

    model = tiny_llama()
    before = {name: dict(vars(m)) for name, m in model.named_modules()}
    runner = GraphRunner(model, None, 2, 32, torch.float32, torch.device("cpu"), pad_row=0,
                         tuning=TuningConfig())  # fmt: skip
    plan = GemvPlan({(32, 32, False): "launch"})  # type: ignore[dict-item]
    runner.gemv = {1: plan, 2: plan}
    runner.graphs = {(1, False): "gemv graph", (1, True): "gemv shared graph", (2, False): "other"}
    times = {"gemv graph": 10.0, "cublas graph": 11.0 if gemv_faster else 9.0}

    def recapture(bs: int, gemv: GemvPlan | None, stream: object) -> None:
        assert gemv is None  # captured without the GEMV
        runner.graphs[bs, False] = "cublas graph"
        runner.graphs[bs, True] = "cublas shared graph"

    monkeypatch.setattr(runner, "_capture_size", recapture)
    monkeypatch.setattr(runner, "_replay_us", lambda bs: times[runner.graphs[bs, False]])
    runner._keep_faster(1, None)
    kept = "gemv" if gemv_faster else "cublas"
    assert runner.graphs == {(1, False): f"{kept} graph", (1, True): f"{kept} shared graph",
                             (2, False): "other"}  # fmt: skip
    assert runner.gemv == ({1: plan, 2: plan} if gemv_faster else {2: plan})
    assert {name: dict(vars(m)) for name, m in model.named_modules()} == before
    assert runner.static_batch(2, plan).gemv is plan and runner.static_batch(1).gemv is None


def test_a_gemv_plan_reaches_exactly_the_projections_it_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A forward's GemvPlan (ForwardBatch.gemv) sends the shapes it names to the skinny GEMV,
    with their launch and the down projection's SiLU-and-mul inside; the rest stay on F.linear."""
    pytest.importorskip("triton", reason="the GEMV's module imports triton")
    from weft.kernels import skinny

    model = tiny_llama()
    calls: list[tuple[tuple[int, int], object, bool]] = []

    def fake_gemv(x, weight, bias=None, *, silu_mul=False, launch=None, pdl=False):  # type: ignore[no-untyped-def]
        calls.append((tuple(weight.shape), launch, silu_mul))
        if silu_mul:
            gate, up = x.chunk(2, dim=-1)
            x = torch.nn.functional.silu(gate) * up
        return torch.nn.functional.linear(x, weight, bias)

    monkeypatch.setattr(skinny, "gemv", fake_gemv)
    init_dummy_weights(model, seed=0)
    plan = GemvPlan({(32, 48, True): "down", (64, 32, False): "qkv"})  # type: ignore[dict-item]
    layer = model.layers[0]
    x = torch.randn(3, 32)
    with torch.no_grad():
        assert torch.allclose(layer.mlp(x, plan), layer.mlp(x), atol=1e-6)
        assert calls == [((32, 48), "down", True)]
        calls.clear()
        qkv = layer.self_attn.qkv_proj
        assert torch.allclose(qkv(x, plan), qkv(x), atol=1e-6)
        assert calls == [((64, 32), "qkv", False)]


def test_choose_blas_takes_cublaslt_only_where_it_saves_enough() -> None:
    times = {("cublas", 1): 10.0, ("cublaslt", 1): 9.9, ("cublas", 64): 10.0,
             ("cublaslt", 64): 9.0, ("cublas", 128): 9.0, ("cublaslt", 128): 9.5}  # fmt: skip
    calls: list[tuple[str, int]] = []

    def time_ms(lib: str, size: int) -> float:
        calls.append((lib, size))
        return times[lib, size]

    picks = graph_tuning.choose_blas([1, 64, 128], time_ms)
    assert picks == {1: "cublas", 64: "cublaslt", 128: "cublas"}  # 1% is noise; 10% is not
    assert sorted(calls) == sorted(times)


def test_the_library_setting_is_restored_even_after_an_error() -> None:
    before = torch.backends.cuda.preferred_blas_library()
    with pytest.raises(KeyError), graph_tuning.blas_library("cublas"):
        raise KeyError("inside")
    assert torch.backends.cuda.preferred_blas_library() == before


def test_the_timer_runs_every_projection_at_each_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """projection_timer on CPU, with CUDA events and the library switch faked: every nn.Linear
    runs on `batch` rows of its input width, once per pass (a warm-up and `reps` timed)."""

    class Event:
        clock = 0.0

        def __init__(self, enable_timing: bool) -> None:
            self.at = 0.0

        def record(self) -> None:
            Event.clock += 1.0
            self.at = Event.clock

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, other: Event) -> float:
            return other.at - self.at

    calls: list[tuple[int, int]] = []
    real_linear = graph_tuning.F.linear

    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(tuple(x.shape))  # type: ignore[arg-type]
        return real_linear(x, w, b)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(graph_tuning, "blas_library", lambda name: contextlib.nullcontext())
    monkeypatch.setattr(graph_tuning.F, "linear", linear)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8, bias=False))
    time_ms = graph_tuning.projection_timer(model, max_batch=5, reps=2)
    for batch in (1, 5, 3):
        calls.clear()
        assert time_ms("cublas", batch) == 1.0
        assert calls == [(batch, 8), (batch, 16)] * 3
    with pytest.raises(AssertionError):
        time_ms("cublas", 6)
