"""Random PEFT LoRA adapters for benchmarks/offline.py's `lora` mode: one adapter of the model's
shapes on every projection, written once, and hard-linked copies under other names (the values do
not change a step's time; each name still takes its own pool slot)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import save_file

from weft.runtime.lora import TARGETS, LoraShapes
from weft.runtime.lora.shapes import PARENT


def adapter_tensors(config: dict[str, Any], rank: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """PEFT's tensors of a rank-`rank` adapter on every projection of every layer (bf16, small
    random values)."""
    shapes = LoraShapes.from_hf_config(SimpleNamespace(**config))
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shapes.num_layers):
        for module in TARGETS:
            out, inp = shapes.hf_shape(module)
            key = f"base_model.model.model.layers.{layer}.{PARENT[module]}.{module}"
            a = torch.randn(rank, inp, generator=gen) * 0.01
            b = torch.randn(out, rank, generator=gen) * 0.01
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
    return tensors


def adapter_folders(config: dict[str, Any], rank: int, count: int, root: Path) -> list[str]:
    """`lora_paths` entries ("lora{i}=folder") of `count` adapters under `root`: the first
    written, the others its hard-linked copies (plain copies where links fail)."""
    first = root / "lora0"
    if not first.is_dir():
        first.mkdir(parents=True)
        save_file(adapter_tensors(config, rank), str(first / "adapter_model.safetensors"))
        meta = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
                "target_modules": list(TARGETS)}  # fmt: skip
        (first / "adapter_config.json").write_text(json.dumps(meta))
    entries = []
    for i in range(count):
        folder = root / f"lora{i}"
        if not folder.is_dir():
            shutil.copytree(first, folder, copy_function=_link_or_copy)
        entries.append(f"lora{i}={folder}")
    return entries


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
