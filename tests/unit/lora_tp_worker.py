"""One tensor-parallel rank for test_lora_tp_agree.py: load LoRA adapters where some ranks can
read the folder and others cannot, and write what this rank then serves."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from weft.runtime.config import EngineConfig
from weft.runtime.executor.distributed import TPGroup
from weft.runtime.executor.lora_step import LoraRuntime
from weft.runtime.loader import read_hf_config
from weft.runtime.models import build_model


def main() -> None:
    """argv: rank, size, init method, base model folder, JSON {case: [each rank's adapter
    folder]}, output folder (out-<rank>.json: case -> {"error", "served"})."""
    rank, size, init, base, cases_json, out = sys.argv[1:7]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=int(rank), world_size=int(size))
    group = TPGroup(int(rank), int(size), torch.device("cpu"), dist.group.WORLD, dist.group.WORLD)
    config = EngineConfig(model=base, skip_tokenizer_init=True, cpu_threads=1, enable_lora=True,
                          max_lora_rank=8, tp_size=int(size))  # fmt: skip
    hf_config = read_hf_config(Path(base))
    model = build_model(hf_config, 64, group.device, torch.float32, group.model_info)
    lora = LoraRuntime(config, hf_config, model, group.device, torch.float32, group)
    results = {}
    for case, folders in json.loads(cases_json).items():
        lora.start_load(case, folders[int(rank)], background=False)
        ((name, error),) = lora.finished_loads(wait=True)
        assert name == case
        results[case] = {"error": None if error is None else str(error),
                         "served": sorted(lora.served())}  # fmt: skip
    Path(out, f"out-{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()
    # NOTE: no interpreter finalization: gloo's threads can abort it (see tp_worker.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
