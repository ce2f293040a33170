"""Random LoRA adapters for the benchmarks: PEFT folders for offline.py's `lora` mode (one adapter
of the model's shapes on every projection, written once, and hard-linked copies under other names:
the values do not change a step's time; each name still takes its own pool slot), adapters made on
the device in a runner's pool for step.py's decode and profile steps, and step.py's `lora_launch`
(another launch for the LoRA kernels at decode batches, to compare launches step against step)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import save_file

from weft.runtime.executor.batch import Batch
from weft.runtime.executor.model_runner import ModelRunner
from weft.runtime.lora import FUSED, TARGETS, LoraAdapter, LoraShapes, LoraWeights
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


def random_adapters(runner: ModelRunner) -> list[str]:
    """A LoRA runner's pool filled: max_loras_per_batch random adapters of max_lora_rank on
    every projection (made on the device, as dummy weights are), resident and pinned; their
    names ([] without LoRA)."""
    lora = runner.lora
    if lora is None:
        return []
    pool, names = lora.pool, []
    shapes, rank = pool.shapes, pool.max_rank
    dtype = pool.a["o_proj"].dtype
    gen = torch.Generator(device=pool.device).manual_seed(0)

    def small(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=pool.device, dtype=dtype) * 0.01

    for k in range(pool.max_loras):
        layers = tuple({fused: LoraWeights(small(len(parts) * rank, shapes.in_dim(fused)),
                                           small(shapes.out_dim(fused), rank))
                        for fused, parts in FUSED.items()}
                       for _ in range(shapes.num_layers))  # fmt: skip
        name = f"random-{k}"
        lora.register(LoraAdapter(name, "(random)", rank, 2.0, shapes, layers))
        lora.acquire(name)
        names.append(name)
    return names


def spread_adapters(batch: Batch, names: list[str]) -> Batch:
    """Request i of `batch` under adapter i mod len(names): every adapter in the batch."""
    for i, req in enumerate(batch.reqs):
        req.lora_path = names[i % len(names)] if names else None
    return batch


@contextmanager
def forced_lora_launch(spec: str | None) -> Iterator[None]:
    """Benchmarks only: while inside, decode-sized LoRA batches (<= 128 tokens) run the launch
    `spec` = "BLOCK_N/N_ITERS/WARPS[/SPLIT_DIV]" instead of kernels.lora.default_launch's: its
    expand tiles of BLOCK_N columns walked N_ITERS at a time under WARPS warps, and its shrink
    split default_launch's way divided by SPLIT_DIV (1). A runner built inside captures its
    graphs with it. None: the default."""
    if spec is None:
        yield
        return
    from weft.kernels import lora

    try:
        block_n, n_iters, warps, *rest = (int(v) for v in str(spec).split("/"))
        div = rest[0] if rest else 1
        if len(rest) > 1 or div < 1:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"lora_launch: expected BLOCK_N/N_ITERS/WARPS[/SPLIT_DIV], got {spec!r}"
        ) from None
    default = lora.default_launch

    def launch(tokens: int, in_dim: int, block_m: int) -> lora.LoraLaunch:
        base = default(tokens, in_dim, block_m)
        if tokens > 128:
            return base
        return lora.LoraLaunch(max(1, base.split_k // div), base.block_k, block_n, n_iters, warps)

    launch(1, 4096, 16)  # (a bad value fails here, before any runner)
    lora.default_launch = launch  # type: ignore[assignment]
    try:
        yield
    finally:
        lora.default_launch = default  # type: ignore[assignment]
