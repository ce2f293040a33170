"""LoRA decode steps in CUDA graphs: a batch mixing two adapters and the base model gives the
same greedy tokens with graphs (the adapters' slots a graph input) as eagerly, and the LoRA
graphs are the ones replayed; a batch without adapter tokens replays the plain graph."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from weft.runtime.config import EngineConfig
from weft.runtime.executor.cuda_graph import GraphRunner
from weft.runtime.ipc.messages import TokenizedGenerateReq
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.scheduler.scheduler import Scheduler

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# random_llama's shapes (tests/gpu/conftest.py): hidden 256, 8 q / 2 kv heads of 32, MLP 512
DIMS = {"q_proj": (256, 256), "k_proj": (256, 64), "v_proj": (256, 64), "o_proj": (256, 256),
        "gate_proj": (256, 512), "up_proj": (256, 512), "down_proj": (512, 256)}  # fmt: skip
PARENT = {m: "self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
          for m in DIMS}  # fmt: skip
PROMPTS = [[5, 17, 99, 3, 250], [7, 7, 8, 1000, 12, 44, 9], [300, 301, 302]]


def save_adapter(folder: Path, rank: int, targets: list[str], seed: int) -> Path:
    """A random PEFT-format adapter (what peft's save_pretrained writes) for random_llama."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(4):
        for module in targets:
            fan_in, fan_out = DIMS[module]
            key = f"base_model.model.model.layers.{layer}.{PARENT[module]}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.2
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.2
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets,
              "bias": "none"}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def run(model: Path, adapters: dict[str, Path], graphs: bool) -> tuple[dict[str, list[int]], Any]:
    config = EngineConfig(model=str(model), skip_tokenizer_init=True, max_running_requests=8,
                          max_total_tokens=8192,
                          lora_paths=tuple(f"{n}={p}" for n, p in adapters.items()),
                          disable_cuda_graph=not graphs)  # fmt: skip
    sched = Scheduler(config, model, None)
    done: dict[str, list[int]] = {}
    sched.emit = lambda reqs: done.update(  # type: ignore[method-assign]
        {r.rid: list(r.output_ids) for r in reqs if r.finished}
    )
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    for i, lora in enumerate(["a", "b", None, "a"]):
        msg = TokenizedGenerateReq(f"r{i}", PROMPTS[i % 3], params, 24, lora_path=lora)
        sched.add_request(msg)
    while sched.has_work():
        sched.process_results(sched.launch(sched.schedule()))
    sched.settle()
    sched.cache.check_conservation()
    return done, sched


def test_lora_decode_in_graphs_equals_eager(
    random_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapters = {"a": save_adapter(tmp_path / "a", 8, list(DIMS), seed=1),
                "b": save_adapter(tmp_path / "b", 4, ["q_proj", "v_proj", "down_proj"], seed=2)}  # fmt: skip
    eager, _ = run(random_llama, adapters, graphs=False)
    replays = {"lora": 0, "plain": 0}
    real = GraphRunner.replay

    def counted(self: GraphRunner, fb: Any) -> torch.Tensor:
        staged = self._staged if self._staged is not None and self._staged[0] is fb else None
        lora = staged[3] if staged is not None else fb.lora is not None
        replays["lora" if lora else "plain"] += 1
        return real(self, fb)

    monkeypatch.setattr(GraphRunner, "replay", counted)
    graphed, sched = run(random_llama, adapters, graphs=True)
    assert sched.runner.graphs is not None and sched.runner.graphs.lora_graphs
    assert replays["lora"] > 0
    assert graphed == eager
    base_only, _ = run(random_llama, {}, graphs=True)  # (no LoRA: the plain graphs only)
    assert replays["plain"] > 0
    assert base_only["r2"] == eager["r2"]
