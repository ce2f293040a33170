"""runtime/executor/skinny.py: the projections grouped by shape, WEFT_GEMV and WEFT_PDL checked, nothing
chosen off CUDA, a size's launches dropped and restored."""

from __future__ import annotations

import pytest
import torch
import transformers

from weft.runtime.executor import skinny
from weft.runtime.models import build_model


def tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    return build_model(config, 64, torch.device("cpu"), torch.float32)


def test_projections_are_grouped_by_shape_with_the_down_projection_gated() -> None:
    groups = skinny.by_shape(tiny_llama())
    # qkv: 32 -> 4 q heads + 2 x 2 kv heads of 8; o: 32 -> 32; gate/up: 32 -> 96; down: 48 -> 32
    assert {k: len(v) for k, v in groups.items()} == {
        (64, 32, False): 3, (32, 32, False): 3, (96, 32, False): 3, (32, 48, True): 3,
    }  # fmt: skip


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
def test_nothing_is_chosen_for_weights_off_cuda(mode: str) -> None:
    model = tiny_llama()
    picks = skinny.choose(model, [1, 2, 4, 8], mode)
    assert len(picks) == 4 and not any(picks.values())
    assert all(not m.gemv_launches for group in skinny.by_shape(model).values() for m in group)


def test_weft_gemv_must_be_a_known_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEFT_GEMV", "always")
    with pytest.raises(ValueError, match="WEFT_GEMV must be auto, on or off, got 'always'"):
        skinny.mode_from_env()
    monkeypatch.setenv("WEFT_GEMV", "off")
    assert skinny.mode_from_env() == "off"


def test_weft_fold_norm_must_be_on_or_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WEFT_FOLD_NORM", raising=False)
    assert skinny.fold_from_env() is False  # the default until timed on the GPU
    monkeypatch.setenv("WEFT_FOLD_NORM", "on")
    assert skinny.fold_from_env() is True
    monkeypatch.setenv("WEFT_FOLD_NORM", "yes")
    with pytest.raises(ValueError, match="WEFT_FOLD_NORM must be on or off"):
        skinny.fold_from_env()


def test_a_size_is_dropped_and_restored() -> None:
    model = tiny_llama()
    mods = [m for group in skinny.by_shape(model).values() for m in group]
    for i, m in enumerate(mods):
        m.gemv_launches = {1: ("launch", i), 2: ("launch", -i)}
    dropped = skinny.drop_size(model, 1)
    assert len(dropped) == len(mods) == 12
    assert all(list(m.gemv_launches) == [2] for m in mods)
    assert skinny.drop_size(model, 4) == []  # a size no projection serves
    skinny.restore_size(dropped, 1)
    assert all(m.gemv_launches == {1: ("launch", i), 2: ("launch", -i)} for i, m in enumerate(mods))


def test_weft_pdl_must_be_a_known_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    from weft.runtime.executor.pdl import pdl_mode_from_env

    monkeypatch.delenv("WEFT_PDL", raising=False)
    assert pdl_mode_from_env() == "on"  # the default
    monkeypatch.setenv("WEFT_PDL", "yes")
    with pytest.raises(ValueError, match="WEFT_PDL must be on, all or off, got 'yes'"):
        pdl_mode_from_env()
    for mode in ("all", "off"):
        monkeypatch.setenv("WEFT_PDL", mode)
        assert pdl_mode_from_env() == mode


def test_weft_split_sum_must_be_here_or_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    from weft.runtime.executor.pdl import sum_here_from_env

    monkeypatch.delenv("WEFT_SPLIT_SUM", raising=False)
    assert sum_here_from_env()  # the default
    monkeypatch.setenv("WEFT_SPLIT_SUM", "launch")
    assert not sum_here_from_env()
    monkeypatch.setenv("WEFT_SPLIT_SUM", "last")
    with pytest.raises(ValueError, match="WEFT_SPLIT_SUM must be here or launch, got 'last'"):
        sum_here_from_env()


@pytest.mark.parametrize("gemv_faster", [True, False])
def test_the_graph_runner_keeps_the_faster_step(
    gemv_faster: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GraphRunner._keep_faster's bookkeeping (capture and replay stubbed: they need CUDA): the
    size's graphs with the GEMV come back when they replay faster; otherwise the cuBLAS graphs
    stay and the size leaves every projection's launches and the runner's record."""
    from weft.runtime.executor.cuda_graph import GraphRunner

    model = tiny_llama()
    mods = [m for group in skinny.by_shape(model).values() for m in group]
    for m in mods:
        m.gemv_launches = {1: "launch", 2: "launch"}
    runner = GraphRunner(model, None, 2, 32, torch.float32, torch.device("cpu"), pad_row=0)
    runner.gemv = {shape: {1: "launch", 2: "launch"} for shape in skinny.by_shape(model)}
    runner.graphs = {(1, False): "gemv graph", (1, True): "gemv shared graph", (2, False): "other"}
    times = {"gemv graph": 10.0, "cublas graph": 11.0 if gemv_faster else 9.0}

    def recapture(bs: int, stream: object) -> None:
        assert all(bs not in m.gemv_launches for m in mods)  # captured without the GEMV
        runner.graphs[bs, False] = "cublas graph"
        runner.graphs[bs, True] = "cublas shared graph"

    monkeypatch.setattr(runner, "_capture_size", recapture)
    monkeypatch.setattr(runner, "_replay_us", lambda bs: times[runner.graphs[bs, False]])
    runner._keep_faster(1, None)
    kept = "gemv" if gemv_faster else "cublas"
    assert runner.graphs == {(1, False): f"{kept} graph", (1, True): f"{kept} shared graph",
                             (2, False): "other"}  # fmt: skip
    assert all(m.gemv_launches == ({1: "launch", 2: "launch"} if gemv_faster else {2: "launch"})
               for m in mods)  # fmt: skip
    assert all(sizes == ({1: "launch", 2: "launch"} if gemv_faster else {2: "launch"})
               for sizes in runner.gemv.values())  # fmt: skip


def test_no_launch_that_fits_leaves_the_shape_on_cublas(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where no candidate launch fits the device (its shared memory), the shape gets no GEMV
    and a warning says so, instead of the start-up failing."""
    model = tiny_llama()
    monkeypatch.setattr(skinny._GraphTimer, "fits", lambda self, launch: False)
    mods = skinny.by_shape(model)[(32, 32, False)]
    with caplog.at_level("WARNING", logger="weft.runtime.executor.skinny"):
        assert skinny._pick(mods, [1, 2, 4, 32], True) == {}
    assert "no skinny GEMV launch fits the [32, 32] projections" in caplog.text


@pytest.mark.parametrize("sum_here", [True, False])
def test_the_timed_fastest_launch_is_picked_with_the_split_sum_asked_for(
    sum_here: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every size the GEMV serves (<= 16 rows) gets the candidate timed fastest, built with the
    WEFT_SPLIT_SUM choice (who sums split K)."""
    from weft.kernels.skinny import GemvLaunch

    mods = skinny.by_shape(tiny_llama())[(32, 32, False)]
    want = GemvLaunch(*skinny.CANDIDATES[-1], sum_here=sum_here)
    monkeypatch.setattr(skinny._GraphTimer, "fits", lambda self, launch: True)
    monkeypatch.setattr(skinny._GraphTimer, "gemv_op", staticmethod(lambda launch: launch))
    monkeypatch.setattr(skinny._GraphTimer, "us", lambda self, op: 1.0 if op == want else 2.0)
    assert skinny._pick(mods, [1, 2, 4, 32], sum_here) == {1: want, 2: want, 4: want}
