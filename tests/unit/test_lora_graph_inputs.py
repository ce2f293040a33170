"""The CUDA-graph runner's LoRA inputs, on CPU (capture and replay need CUDA: the GPU test is
tests/gpu/test_lora_graphs_cuda.py): staging a batch with adapter tokens writes each row's slot
into the static slot buffer (NO_LORA on padded rows) and picks the LoRA graph; a batch without
any picks the plain one; the captured forward reads the adapters through the static buffer,
grouped by kernels/lora.py's lora_index, and runs without LoRA otherwise."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from weft.runtime.config import TuningConfig
from weft.runtime.executor.batch import ForwardBatch
from weft.runtime.executor.cuda_graph import GraphRunner
from weft.runtime.lora.forward import LoraBatch, LoraContext
from weft.runtime.lora.pool import NO_LORA

pytest.importorskip("triton", reason="lora_index lives in kernels/lora.py, which imports triton")


class _Model:
    """Records the LoRA batch each forward runs under."""

    def __init__(self, context: LoraContext) -> None:
        self.context = context
        self.seen: list[LoraBatch | None] = []

    def __call__(self, fb: ForwardBatch, attn: Any) -> torch.Tensor:
        self.seen.append(self.context.batch)
        return torch.zeros(fb.batch_size, 8)


def _runner() -> tuple[GraphRunner, _Model]:
    context = LoraContext()
    lora: Any = SimpleNamespace(context=context, pool=SimpleNamespace(max_loras=3))
    model = _Model(context)
    attn: Any = SimpleNamespace(prepare_replay=lambda fb, bs, shared: None, shared_prefix=False)
    runner = GraphRunner(model, attn, 8, 8, torch.float32, torch.device("cpu"), pad_row=0,
                         tuning=TuningConfig(), lora=lora)  # fmt: skip
    return runner, model


def test_staging_writes_the_slots_and_picks_the_variant() -> None:
    runner, _ = _runner()
    fb = runner.static_batch(3)  # a real batch of 3, padded to the captured size 4
    fb = ForwardBatch(**{**vars(fb)})
    fb.lora = LoraBatch(None, torch.tensor([2, NO_LORA, 0], dtype=torch.int32), None)  # type: ignore[arg-type]
    runner.stage(fb)
    assert runner._staged is not None and runner._staged[1:] == (4, False, True)
    assert runner.lora_slots[:4].tolist() == [2, NO_LORA, 0, NO_LORA]
    plain = runner.static_batch(2)
    runner.stage(plain)
    assert runner._staged is not None and runner._staged[1:] == (2, False, False)
    assert runner.can_run(fb) and runner.can_run(plain)


def test_the_captured_forward_reads_the_static_slots() -> None:
    runner, model = _runner()
    runner.lora_slots[:4] = torch.tensor([1, NO_LORA, 1, 0], dtype=torch.int32)
    fb = runner.static_batch(4)
    runner._forward(fb, lora=True)
    batch = model.seen[-1]
    assert batch is not None and batch.index is not None
    assert batch.token_slots.data_ptr() == runner.lora_slots.data_ptr()  # the graph's input
    block = batch.index.block_m
    tiles = batch.index.tile_slot.tolist()
    order = batch.index.sorted_tokens.tolist()
    assert tiles[:2] == [0, 1] and order[:1] == [3] and order[block : block + 2] == [0, 2]
    runner._forward(fb, lora=False)
    assert model.seen[-1] is None and runner.lora is not None


def test_without_lora_a_batch_with_adapter_tokens_runs_eagerly() -> None:
    context = LoraContext()
    attn: Any = SimpleNamespace(prepare_replay=lambda fb, bs, shared: None, shared_prefix=False)
    runner = GraphRunner(_Model(context), attn, 8, 8, torch.float32, torch.device("cpu"),
                         pad_row=0, tuning=TuningConfig())  # fmt: skip
    fb = ForwardBatch(**{**vars(runner.static_batch(2))})
    fb.lora = LoraBatch(None, torch.tensor([0, 0], dtype=torch.int32), None)  # type: ignore[arg-type]
    assert not runner.can_run(fb)
