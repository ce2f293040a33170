"""A PEFT LoRA adapter folder read into weft's fused layout (qkv_proj, o_proj, gate_up_proj,
down_proj), checked against the model's shapes; and one tensor-parallel rank's share of it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from weft.runtime.lora.config import AdapterConfig, read_config
from weft.runtime.lora.shapes import FUSED, PARENT, TARGETS, LoraShapes

WEIGHTS_FILE = "adapter_model.safetensors"
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT may keep ".default")
_KEY = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\."
    rf"({'|'.join(TARGETS)})\.lora_(A|B)(?:\.[\w-]+)?\.weight"
)


@dataclass(frozen=True)
class LoraWeights:
    """One fused projection of one layer: slice i's A in rows [i * rank, (i + 1) * rank) of `a`,
    its B in the slice's rows of `b`; a slice the adapter does not target is zeros."""

    a: torch.Tensor  # [num_slices * rank, in]
    b: torch.Tensor  # [out, rank]: out = the fused projection's (q | k | v, gate | up)


@dataclass(frozen=True)
class LoraAdapter:
    """A LoRA adapter in CPU memory: delta W = scaling * B @ A for each targeted projection, laid
    out for the model of `shapes` (the whole model's, or one tensor-parallel rank's)."""

    name: str
    path: str
    rank: int
    scaling: float
    shapes: LoraShapes
    layers: tuple[Mapping[str, LoraWeights], ...]  # per layer: fused projection -> weights

    def delta(self, layer: int, fused: str) -> torch.Tensor | None:
        """The float32 [out, in] that merging adds to `fused`'s weight in `layer` (None: none)."""
        w = self.layers[layer].get(fused)
        if w is None:
            return None
        widths = self.shapes.slice_widths(fused)
        b_parts = w.b.float().split(list(widths))
        a_parts = w.a.float().split(self.rank)
        return (
            torch.cat([b_i @ a_i for b_i, a_i in zip(b_parts, a_parts, strict=True)]) * self.scaling
        )


def load_adapter(
    name: str,
    path: str | Path,
    shapes: LoraShapes,
    max_rank: int,
    dtype: torch.dtype | None = None,
) -> LoraAdapter:
    """Read the PEFT adapter folder `path` for a model of `shapes` (the whole model's): a
    ValueError names the file and the problem (a missing file, a refused option, a rank above
    max_rank, an unknown module or layer, a wrong shape, a non-finite value). Tensors keep the
    file's dtype unless `dtype` is given."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"LoRA adapter {name!r}: {folder} is not a folder")
    config = read_config(folder)
    if config.rank > max_rank:
        raise ValueError(f"{folder / 'adapter_config.json'}: r={config.rank} is above "
                         f"max_lora_rank={max_rank}")  # fmt: skip
    file = folder / WEIGHTS_FILE
    tensors = _read_tensors(file)
    found = _check_tensors(tensors, config, shapes, str(file))
    layers = []
    for layer in range(shapes.num_layers):
        fused_weights = {}
        for fused, parts in FUSED.items():
            present = [(i, m) for i, m in enumerate(parts) if (layer, m) in found]
            if present:
                fused_weights[fused] = _stack(
                    found, layer, fused, present, shapes, config.rank, dtype
                )
        layers.append(fused_weights)
    return LoraAdapter(name, str(folder), config.rank, config.scaling, shapes, tuple(layers))


def shard_adapter(adapter: LoraAdapter, tp_size: int, tp_rank: int) -> LoraAdapter:
    """Rank tp_rank's share of `adapter` (as load_adapter gives it, for the whole model): B's
    rows of this rank's heads / MLP columns for the column-parallel qkv_proj and gate_up_proj,
    A's columns of its heads / MLP columns for the row-parallel o_proj and down_proj. Each
    rank's o/down delta is a partial sum, added before the all-reduce as the base one's is."""
    if tp_size == 1:
        return adapter
    from weft.runtime.models.parallel import even_split, head_shard  # NOTE: as in shapes.py

    shapes = adapter.shapes
    d = shapes.head_dim
    h = head_shard(shapes.num_heads, shapes.num_kv_heads, tp_size, tp_rank)
    mlp_start, inter = even_split(shapes.intermediate, tp_size, tp_rank)
    q_full, kv_full = shapes.num_heads * d, shapes.num_kv_heads * d
    rows = {  # column-parallel: (start, count) of each slice's rows in the full B
        "qkv_proj": [(h.q_start * d, h.q_count * d), (q_full + h.kv_start * d, h.kv_count * d),
                     (q_full + kv_full + h.kv_start * d, h.kv_count * d)],
        "gate_up_proj": [(mlp_start, inter), (shapes.intermediate + mlp_start, inter)],
    }  # fmt: skip
    cols = {"o_proj": (h.q_start * d, h.q_count * d), "down_proj": (mlp_start, inter)}
    layers = []
    for weights in adapter.layers:
        local = {}
        for fused, w in weights.items():
            if fused in rows:
                b = torch.cat([w.b[s : s + n] for s, n in rows[fused]]).contiguous()
                local[fused] = LoraWeights(w.a, b)
            else:
                start, count = cols[fused]
                local[fused] = LoraWeights(w.a[:, start : start + count].contiguous(), w.b)
        layers.append(local)
    return replace(adapter, shapes=shapes.for_rank(tp_size, tp_rank), layers=tuple(layers))


##### Internal Helper Functions #####


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    if not file.is_file():
        other = (
            " (found adapter_model.bin: only safetensors is read)"
            if (file.parent / "adapter_model.bin").is_file()
            else ""
        )
        raise ValueError(f"{file}: no such file{other}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e})") from e


def _check_tensors(
    tensors: dict[str, torch.Tensor], config: AdapterConfig, shapes: LoraShapes, where: str
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, HF module) -> (A [r, in], B [out, r]) after checking every tensor of the file."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise ValueError(f"{where}: tensor {key!r} is not a LoRA A/B matrix of a supported "
                             f"projection ({', '.join(TARGETS)})")  # fmt: skip
        layer, parent, module, half = int(match[1]), match[2], match[3], match[4]
        if parent != PARENT[module]:
            raise ValueError(f"{where}: tensor {key!r}: {module} is not under {parent}")
        if layer >= shapes.num_layers:
            raise ValueError(f"{where}: tensor {key!r}: layer {layer} is out of range "
                             f"(the model has {shapes.num_layers} layers)")  # fmt: skip
        if not config.targets_module(layer, module):
            raise ValueError(f"{where}: tensor {key!r}: adapter_config.json does not target it")
        out, in_dim = shapes.hf_shape(module)
        want = (config.rank, in_dim) if half == "A" else (out, config.rank)
        if tuple(t.shape) != want:
            raise ValueError(f"{where}: tensor {key!r} has shape {tuple(t.shape)}, expected "
                             f"{want} (r={config.rank})")  # fmt: skip
        if not t.is_floating_point() or not torch.isfinite(t).all():
            raise ValueError(f"{where}: tensor {key!r} holds non-finite or non-float values")
        halves.setdefault((layer, module), {})[half] = t
    found = {}
    for (layer, module), pair in sorted(halves.items()):
        if len(pair) != 2:
            missing = "B" if "A" in pair else "A"
            raise ValueError(f"{where}: layer {layer} {module} has no lora_{missing} tensor")
        found[(layer, module)] = (pair["A"], pair["B"])
    if config.targets is not None:
        absent = sorted(config.targets - {m for _, m in found}, key=TARGETS.index)
        if absent:
            raise ValueError(f"{where}: adapter_config.json targets {', '.join(absent)} "
                             f"but the file holds no weights for it")  # fmt: skip
    if not found:
        raise ValueError(f"{where}: the file holds no LoRA weights")
    return found


def _stack(
    found: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
    layer: int,
    fused: str,
    present: list[tuple[int, str]],
    shapes: LoraShapes,
    rank: int,
    dtype: torch.dtype | None,
) -> LoraWeights:
    """The slices' A stacked by rows, their B by output rows, zeros for the absent ones."""
    dtype = dtype or found[(layer, present[0][1])][0].dtype
    widths = shapes.slice_widths(fused)
    starts = shapes.slice_starts(fused)
    a = torch.zeros(len(widths) * rank, shapes.in_dim(fused), dtype=dtype)
    b = torch.zeros(sum(widths), rank, dtype=dtype)
    for i, module in present:
        a_i, b_i = found[(layer, module)]
        a[i * rank : (i + 1) * rank] = a_i
        b[starts[i] : starts[i] + widths[i]] = b_i
    return LoraWeights(a, b)
