"""The cuBLAS path per decode graph size: the measured choice, its switch, and the setting
restored after capture."""

from __future__ import annotations

import pytest
import torch

from weft.runtime.executor.graph_blas import blas_library, choose, mode_from_env


def test_choose_takes_cublaslt_only_where_it_saves_enough() -> None:
    times = {("cublas", 1): 10.0, ("cublaslt", 1): 9.9, ("cublas", 64): 10.0,
             ("cublaslt", 64): 9.0, ("cublas", 128): 9.0, ("cublaslt", 128): 9.5}  # fmt: skip
    calls: list[tuple[str, int]] = []

    def time_ms(lib: str, size: int) -> float:
        calls.append((lib, size))
        return times[lib, size]

    picks = choose([1, 64, 128], time_ms)
    assert picks == {1: "cublas", 64: "cublaslt", 128: "cublas"}  # 1% is noise; 10% is not
    assert sorted(calls) == sorted(times)


@pytest.mark.parametrize("value", ["auto", "cublas", "cublaslt"])
def test_the_switch_takes_its_three_values(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEFT_GRAPH_BLAS", value)
    assert mode_from_env() == value


def test_a_bad_switch_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEFT_GRAPH_BLAS", "lt")
    with pytest.raises(ValueError, match="WEFT_GRAPH_BLAS must be auto, cublas or cublaslt"):
        mode_from_env()


def test_the_library_setting_is_restored_even_after_an_error() -> None:
    before = torch.backends.cuda.preferred_blas_library()
    with pytest.raises(KeyError), blas_library("cublas"):
        raise KeyError("inside")
    assert torch.backends.cuda.preferred_blas_library() == before


def test_the_timer_runs_every_projection_at_each_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """projection_timer on CPU, with CUDA events and the library switch faked: every nn.Linear
    runs on `batch` rows of its input width, once per pass (a warm-up and `reps` timed)."""
    import contextlib

    from torch import nn

    from weft.runtime.executor import graph_blas

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
    real_linear = graph_blas.F.linear

    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(tuple(x.shape))  # type: ignore[arg-type]
        return real_linear(x, w, b)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(graph_blas, "blas_library", lambda name: contextlib.nullcontext())
    monkeypatch.setattr(graph_blas.F, "linear", linear)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8, bias=False))
    time_ms = graph_blas.projection_timer(model, max_batch=5, reps=2)
    for batch in (1, 5, 3):
        calls.clear()
        assert time_ms("cublas", batch) == 1.0
        assert calls == [(batch, 8), (batch, 16)] * 3
    with pytest.raises(AssertionError):
        time_ms("cublas", 6)
