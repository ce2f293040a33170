"""A PEFT LoRA adapter's adapter_config.json, read and checked: what weft serves, or why not."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weft.runtime.lora.shapes import PARENT, TARGETS

CONFIG_FILE = "adapter_config.json"

# PEFT options that change what the adapter computes beyond x @ A^T @ B^T * scaling: refused
# when set (their value when unset, as PEFT writes it)
_REFUSED: dict[str, tuple[Any, ...]] = {
    "rank_pattern": (None, {}),  # per-module ranks
    "alpha_pattern": (None, {}),  # per-module alphas
    "modules_to_save": (None, []),  # fully trained copies of other modules (e.g. lm_head)
    "use_dora": (None, False),  # weight-decomposed LoRA
    "lora_bias": (None, False),  # a bias on lora_B
    "layer_replication": (None, []),
    "target_parameters": (None, []),  # LoRA on bare nn.Parameters
    "trainable_token_indices": (None, [], {}),  # retrained embedding rows
    "alora_invocation_tokens": (None, []),  # activated LoRA
    "use_qalora": (None, False),
}


@dataclass(frozen=True)
class AdapterConfig:
    """The parts of adapter_config.json that weft uses. `targets` is the list PEFT was given
    (module names) or None when it was a regex (`pattern`)."""

    rank: int
    alpha: float
    use_rslora: bool
    targets: frozenset[str] | None
    pattern: str | None
    layers: frozenset[int] | None  # layers_to_transform (None: every layer)

    @property
    def scaling(self) -> float:
        """alpha / r, or with rsLoRA alpha / sqrt(r)."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def targets_module(self, layer: int, module: str) -> bool:
        """Whether PEFT would have wrapped model.layers.{layer}.{parent}.{module} of a Llama."""
        if self.layers is not None and layer not in self.layers:
            return False
        if self.pattern is not None:
            return (
                re.fullmatch(self.pattern, f"model.layers.{layer}.{PARENT[module]}.{module}")
                is not None
            )
        assert self.targets is not None
        return module in self.targets


def read_config(folder: Path) -> AdapterConfig:
    """adapter_config.json of `folder`, checked; a ValueError names the file and the problem."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{path}: no such file (a PEFT adapter folder holds {CONFIG_FILE})")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not readable JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return parse_config(raw, str(path))


def parse_config(raw: dict[str, Any], where: str) -> AdapterConfig:
    """The checked AdapterConfig of a parsed adapter_config.json (`where` names it in errors)."""
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{where}: peft_type {peft_type!r} is not supported (only LORA)")
    for key, unset in _REFUSED.items():
        if raw.get(key) not in unset:
            raise ValueError(f"{where}: {key}={raw[key]!r} is not supported")
    bias = raw.get("bias", "none")
    if bias != "none":
        raise ValueError(f"{where}: bias={bias!r} is not supported (only 'none')")
    rank = raw.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where}: r must be a positive integer, got {rank!r}")
    alpha = raw.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    targets, pattern = _targets(raw.get("target_modules"), where)
    return AdapterConfig(
        rank=rank,
        alpha=float(alpha),
        use_rslora=bool(raw.get("use_rslora", False)),
        targets=targets,
        pattern=pattern,
        layers=_layers(raw.get("layers_to_transform"), where),
    )


##### Internal Helper Functions #####


def _targets(value: Any, where: str) -> tuple[frozenset[str] | None, str | None]:
    """(module names, None) for a list, (None, regex) for a string; "all-linear" is every
    projection (PEFT leaves out only the output head)."""
    if value == "all-linear":
        return frozenset(TARGETS), None
    if isinstance(value, str):
        try:
            re.compile(value)
        except re.error as e:
            raise ValueError(f"{where}: target_modules {value!r} is not a valid regex ({e})") from e
        return None, value
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise ValueError(
            f"{where}: target_modules must be a list of names or a regex, got {value!r}"
        )
    names = set()
    for entry in value:
        name = entry.rsplit(".", 1)[-1]  # PEFT matches a suffix: "self_attn.q_proj" works too
        if name not in TARGETS:
            raise ValueError(f"{where}: target module {entry!r} is not supported "
                             f"(weft applies LoRA to {', '.join(TARGETS)})")  # fmt: skip
        names.add(name)
    return frozenset(names), None


def _layers(value: Any, where: str) -> frozenset[int] | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return frozenset([value])
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return frozenset(value)
    raise ValueError(
        f"{where}: layers_to_transform must be an int or a list of ints, got {value!r}"
    )
