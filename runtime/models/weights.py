"""HF-named checkpoint tensors into our (fused, tensor-parallel) parameters; dummy checkpoints."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


class LazyWeight(Protocol):
    """A checkpoint tensor not read yet: its shape, and a way to read one slice of it."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def read(self, dim: int, start: int, size: int) -> torch.Tensor:
        """Elements [start, start + size) along dim; dim -1: the whole tensor."""
        ...


Weight = torch.Tensor | LazyWeight


@dataclass(frozen=True)
class Placement:
    """Where a checkpoint tensor goes: the slice [start, start + size) along `dim` (-1: all of it)
    of a tensor of `full_shape`, copied to rows [dst_start, ...) of our (fused) parameter."""

    full_shape: tuple[int, ...]
    dim: int = -1
    start: int = 0
    size: int = 0
    dst_start: int = 0


def map_name(hf_name: str) -> tuple[str, str] | None:
    """HF checkpoint name -> (our parameter name, shard); None for tensors we do not use."""
    if "rotary_emb.inv_freq" in hf_name:
        return None
    name = hf_name.removeprefix("model.")
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in _FUSED:
            fused, shard = _FUSED[part]
            return ".".join(parts[:i] + [fused] + parts[i + 1 :]), shard
    return name, ""


def checkpoint_names(name: str) -> list[tuple[str, str]]:
    """The inverse of map_name for one of our (HF-prefixed) parameter names: the checkpoint
    tensors (name, shard) it is made of ("...qkv_proj.weight" -> q_proj, k_proj, v_proj)."""
    parts = [(fused, shard, hf) for hf, (fused, shard) in _FUSED.items() if f".{fused}." in name]
    if not parts:
        return [(name, "")]
    return [(name.replace(fused, hf), shard) for fused, shard, hf in parts]


def read_placed(hf_name: str, src: Weight, place: Placement) -> torch.Tensor:
    """The slice of checkpoint tensor `src` that `place` names, after checking its full shape."""
    _check_shape(hf_name, src, place)
    return _read(src, place)


def _read(src: Weight, place: Placement) -> torch.Tensor:
    if place.dim < 0:
        return src if isinstance(src, torch.Tensor) else src.read(-1, 0, 0)
    if isinstance(src, torch.Tensor):
        return src.narrow(place.dim, place.start, place.size)
    return src.read(place.dim, place.start, place.size)


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, Weight]],
    place: Callable[[str, str, tuple[int, ...]], Placement],
    expected: list[str],
) -> None:
    """Copy each HF-named tensor's slice for this rank into its parameter; every expected
    `name:shard` key must be set. `place(name, shard, shape)` gives the Placement (`shape`: the
    parameter's). Tensors of a quantized layer (`<layer>.<suffix>`) go to its QuantMethod, with
    the Placement of the layer's weight; each method's `finish` runs at the end."""
    params = dict(model.named_parameters())
    quant = _quantized(model)
    tied = bool(getattr(model, "tie_word_embeddings", False))
    loaded: set[str] = set()
    for hf_name, src in weights:
        target = map_name(hf_name)
        if target is None:
            continue
        name, shard = target
        if name == "lm_head.weight" and tied:
            continue  # some tied checkpoints store the shared matrix twice
        prefix, _, suffix = name.rpartition(".")
        if prefix in quant and suffix != "bias":
            layer, method = quant[prefix]
            if suffix not in (*method.checkpoint_suffixes(), *method.optional_suffixes()):
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in this model "
                                 f"({type(method).__name__} takes {prefix}."
                                 f"{'|'.join(method.checkpoint_suffixes())})")  # fmt: skip
            p = place(f"{prefix}.weight", shard, tuple(getattr(layer, "weight_shape")))  # noqa: B009
            if suffix == "weight":
                _check_shape(hf_name, src, p)
            method.load(layer, suffix, shard, src, p)
            loaded.add(f"{name}:{shard}")
            continue
        if name not in params:
            raise ValueError(f"checkpoint tensor {hf_name!r} has no place in this model")
        param = params[name]
        p = place(name, shard, tuple(param.shape))
        data = read_placed(hf_name, src, p)
        with torch.no_grad():
            dst = param.narrow(0, p.dst_start, data.shape[0])
            if dst.shape != data.shape:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r}: slice {tuple(data.shape)} does not fit "
                    f"{tuple(dst.shape)}"
                )
            dst.copy_(data)
        loaded.add(f"{name}:{shard}")
    missing = [n for n in expected if n not in loaded]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    for layer, method in quant.values():
        method.finish(layer)


class _Sink(Protocol):
    """What loading needs of a quantized layer's QuantMethod (runtime/models/quant/base.py)."""

    def checkpoint_suffixes(self) -> tuple[str, ...]: ...

    def optional_suffixes(self) -> tuple[str, ...]: ...

    def load(
        self, layer: nn.Module, suffix: str, shard: str, src: Weight, place: Placement
    ) -> None: ...

    def finish(self, layer: nn.Module) -> None: ...


def _quantized(model: nn.Module) -> dict[str, tuple[nn.Module, _Sink]]:
    """prefix -> (layer, its method) for the layers carrying a QuantMethod (`quant`)."""
    out: dict[str, tuple[nn.Module, _Sink]] = {}
    for prefix, module in model.named_modules():
        method = getattr(module, "quant", None)
        if method is not None:
            out[prefix] = (module, method)
    return out


def _check_shape(hf_name: str, src: Weight, p: Placement) -> None:
    if tuple(src.shape) != p.full_shape:
        raise ValueError(
            f"checkpoint tensor {hf_name!r} has shape {tuple(src.shape)}, expected {p.full_shape}"
        )


class DummySource(Protocol):
    """A QuantConfig's random tensors in its own format (runtime/models/quant/base.py)."""

    def dummy_weight(
        self, name: str, shape: tuple[int, ...], seed: int, device: torch.device
    ) -> Weight | None: ...


def dummy_weights(
    shapes: Iterable[tuple[str, tuple[int, ...]]],
    seed: int,
    device: torch.device,
    dtype: torch.dtype,
    std: float = 0.02,
    quant: DummySource | None = None,
) -> Iterator[tuple[str, Weight]]:
    """A random checkpoint: N(0, std) matrices, unit norms, zero biases, or the tensors `quant`
    draws in its own format (QuantConfig.dummy_weight). Each tensor depends only on (seed, name),
    so every tensor-parallel layout of the same model gets the same weights."""
    for name, shape in shapes:
        special = quant.dummy_weight(name, shape, seed, device) if quant is not None else None
        if special is not None:
            yield name, special
        elif name.endswith("norm.weight") or "layernorm" in name:
            yield name, torch.ones(shape, dtype=dtype, device=device)
        elif name.endswith(".bias"):
            yield name, torch.zeros(shape, dtype=dtype, device=device)
        else:
            gen = torch.Generator(device=device).manual_seed(
                seed * 1_000_003 + zlib.crc32(name.encode())
            )
            out = torch.empty(shape, dtype=dtype, device=device)
            yield name, out.normal_(0.0, std, generator=gen)
