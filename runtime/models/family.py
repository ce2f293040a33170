"""What a model family module declares: the checkpoints it serves and what it supports."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class ModelFamily:
    """One family of checkpoints served by one model class. `architectures`: config.json's
    `architectures` values; `model_types`: the `model_type` values those may come with (and
    that select the family when a config names no architecture); `quantizable`: whether its
    model takes a QuantConfig (any EngineConfig.quantization; False: full precision only)."""

    name: str
    model_class: type[nn.Module]  # (runtime/models/__init__.py's model_class narrows it)
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    quantizable: bool = True

    def serves(self, arch: str, model_type: str) -> bool:
        return arch in self.architectures and model_type in self.model_types


def family_of(config: Any, families: Sequence[ModelFamily]) -> ModelFamily:
    """The family serving a HF config: the first of its architectures that a family lists
    (with a model_type the family lists too); a config without architectures by its model_type.
    ValueError naming every supported architecture otherwise."""
    archs = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    for arch in archs:
        found = [f for f in families if arch in f.architectures]
        if found:
            if found[0].serves(arch, str(model_type)):
                return found[0]
            break  # a known architecture with a model_type we do not expect from it
    if not archs:
        for family in families:
            if model_type in family.model_types:
                return family
    supported = sorted(a for f in families for a in f.architectures)
    raise ValueError(
        f"unsupported model: architectures={archs}, model_type={model_type!r}; "
        f"supported: {', '.join(supported)}"
    )


def supported_architectures(families: Sequence[ModelFamily]) -> dict[str, str]:
    """architecture -> the family name serving it, for every family."""
    return {arch: f.name for f in families for arch in f.architectures}
