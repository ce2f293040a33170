"""LoRA on real weights: the packaged SmolLM2-135M-Instruct with two synthetic adapters built with
peft (all projections / rsLoRA on a few), served together in one batch with the base model:
each request's greedy tokens equal HF's model with its adapter merged (peft merge_and_unload)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support import hf_greedy

from weft.runtime.config import EngineConfig
from weft.runtime.executor.distributed import Inbox
from weft.runtime.ipc.messages import TokenizedGenerateReq
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.scheduler.scheduler import Scheduler

peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

NEW = 12
ADAPTERS = {
    "all": {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"},
    "rs": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"],
           "use_rslora": True},
}  # fmt: skip


def _base(folder: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_adapters_on_smollm2_equal_the_merged_model(
    default_model_dir: Path, tmp_path: Path
) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    prompts = [tok.encode(t) for t in ("The capital of France is", "def add(a, b):")]
    expected: dict[str | None, list[list[int]]] = {None: hf_greedy(_base(default_model_dir),
                                                                   prompts, NEW)}  # fmt: skip
    for seed, (name, spec) in enumerate(ADAPTERS.items(), start=1):
        torch.manual_seed(seed)
        config = peft.LoraConfig(init_lora_weights=False, **spec)
        wrapped = peft.get_peft_model(_base(default_model_dir), config)
        with torch.no_grad():  # B scaled up: the adapters change the greedy tokens
            for module in wrapped.modules():
                if hasattr(module, "lora_B") and "default" in getattr(module, "lora_B", {}):
                    module.lora_B["default"].weight.mul_(8.0)
        wrapped.save_pretrained(tmp_path / name)
        expected[name] = hf_greedy(wrapped.merge_and_unload().eval(), prompts, NEW)
    assert expected["all"] != expected[None] and expected["rs"] != expected[None]

    cfg = EngineConfig(model=str(default_model_dir), dtype="float32", cpu_threads=2,
                       lora_paths=tuple(f"{n}={tmp_path / n}" for n in ADAPTERS))  # fmt: skip
    sched = Scheduler(cfg, default_model_dir, None)
    done: dict[str, list[int]] = {}
    sched.emit = lambda reqs: done.update({r.rid: list(r.output_ids) for r in reqs if r.finished})
    params = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True)
    runs = [(name, i) for name in (None, *ADAPTERS) for i in range(len(prompts))]
    for name, i in runs:
        msg = TokenizedGenerateReq(f"{name}-{i}", prompts[i], params, NEW, lora_path=name)
        sched.add_request(msg)
    while sched.has_work():
        sched.apply(Inbox([], [], []))
        sched.process_results(sched.launch(sched.schedule()))
    sched.cache.check_conservation()
    for name, i in runs:
        assert done[f"{name}-{i}"] == expected[name][i], (name, i)
