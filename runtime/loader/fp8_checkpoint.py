"""What an FP8 checkpoint holds, read from its config.json `quantization_config`: HF's `fp8`
(per-tensor, or block-wise `weight_block_size`) and compressed-tensors `float-quantized` (per-tensor
or per-channel weight scales, static or dynamic activations); none for a bf16 one."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

FP8_METHODS = ("fp8", "compressed-tensors")
_CT_FORMATS = ("float-quantized", "naive-quantized")


@dataclass(frozen=True)
class Fp8Scheme:
    """How an FP8 model's layers were (or are to be) quantized.

    - `prequantized`: the checkpoint holds fp8 `weight` tensors with `weight_scale` (else bf16 /
      fp32 weights, quantized per output channel as they load).
    - `weight`: the layout of the checkpoint's weight scales: "tensor" (one per tensor),
      "channel" (one per output row) or "block" (`weight_scale_inv` per block_n x block_k tile).
    - `static_input`: activations quantized with the checkpoint's calibrated per-tensor
      `input_scale`; else dynamically, per token.
    - `ignore`: HF module names (or "re:" patterns) left in full precision.
    """

    prequantized: bool = False
    weight: Literal["tensor", "channel", "block"] = "channel"
    block: tuple[int, int] | None = None
    static_input: bool = False
    ignore: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.weight not in ("tensor", "channel", "block"):
            raise ValueError(f"Fp8Scheme.weight must be tensor/channel/block, got {self.weight!r}")
        if (self.weight == "block") != (self.block is not None):
            raise ValueError("Fp8Scheme: a block size goes with weight='block' only")
        if not self.prequantized and (self.weight != "channel" or self.static_input):
            raise ValueError("Fp8Scheme: quantizing at load is per channel with dynamic inputs")

    @property
    def scale_suffix(self) -> str:
        return "weight_scale_inv" if self.weight == "block" else "weight_scale"

    def ignores(self, hf_module: str) -> bool:
        """Whether the HF module `model.layers.0.self_attn.q_proj` stays in full precision."""
        short = hf_module.removeprefix("model.")
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.fullmatch(entry[3:], hf_module) or re.fullmatch(entry[3:], short):
                    return True
            elif entry in (hf_module, short) or hf_module.endswith(f".{entry}"):
                return True
        return False


def checkpoint_quantization(hf_config: Any) -> str | None:
    """The quant_method of the checkpoint's `quantization_config` (None: full precision)."""
    qc = _quantization_config(hf_config)
    if qc is None:
        return None
    return str(qc.get("quant_method", "<no quant_method>"))


def fp8_scheme(hf_config: Any) -> Fp8Scheme:
    """The Fp8Scheme of a checkpoint; a bf16 one (no quantization_config) is quantized at load.
    Anything FP8 W8A8 cannot run raises ValueError naming the setting."""
    qc = _quantization_config(hf_config)
    if qc is None:
        return Fp8Scheme()
    method = qc.get("quant_method")
    if method == "fp8":
        return _hf_fp8(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise ValueError(f"quantization='fp8' loads bf16/fp16/fp32 checkpoints or FP8 ones (quant_method "
                     f"{' or '.join(FP8_METHODS)}); this checkpoint's quantization_config has "
                     f"quant_method={method!r}")  # fmt: skip


def refuse_quantized_checkpoint(hf_config: Any) -> None:
    """A checkpoint with a quantization_config loaded without --quantization: name the option
    (its tensors would otherwise fail one by one as having no place in a bf16 model)."""
    method = checkpoint_quantization(hf_config)
    if method in FP8_METHODS:
        raise ValueError(f"this checkpoint is quantized ({method}): load it with "
                         "quantization='fp8' (--quantization fp8)")  # fmt: skip
    if method is not None:
        raise ValueError(f"this checkpoint is quantized with {method!r}, which weft does not load")


##### Internal Helper Functions #####


def _quantization_config(hf_config: Any) -> dict[str, Any] | None:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    return qc


def _hf_fp8(qc: dict[str, Any]) -> Fp8Scheme:
    """transformers' / vLLM's `fp8`: per-tensor `weight_scale` (+ `input_scale` when static), or
    block-wise `weight_scale_inv` with `weight_block_size`."""
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"fp8 checkpoint: fmt={fmt!r} is not supported (only e4m3)")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"fp8 checkpoint: activation_scheme={scheme!r} (expected dynamic/static)")
    ignore = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())
    block = qc.get("weight_block_size")
    if block is not None:
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(block)):
            raise ValueError(f"fp8 checkpoint: weight_block_size={block!r} is not [n, k]")
        if scheme == "static":
            raise ValueError("fp8 checkpoint: block-wise weights with static activations")
        return Fp8Scheme(True, "block", (int(block[0]), int(block[1])), False, ignore)
    return Fp8Scheme(True, "tensor", None, scheme == "static", ignore)


def _compressed_tensors(qc: dict[str, Any]) -> Fp8Scheme:
    fmt = qc.get("format")
    if fmt not in _CT_FORMATS:
        raise ValueError(f"compressed-tensors checkpoint: format={fmt!r} is not FP8 "
                         f"(supported: {', '.join(_CT_FORMATS)})")  # fmt: skip
    if qc.get("kv_cache_scheme"):
        raise ValueError("compressed-tensors checkpoint: kv_cache_scheme (calibrated KV scales) "
                         "is not supported; use --kv-cache-dtype fp8_e4m3 (unscaled) instead")  # fmt: skip
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise ValueError("compressed-tensors checkpoint: no config_groups")
    schemes = {_ct_group(g) for g in groups}
    if len(schemes) > 1:
        raise ValueError(f"compressed-tensors checkpoint: {len(schemes)} different schemes across "
                         "config_groups; weft takes one FP8 scheme for every layer")  # fmt: skip
    weight, static = schemes.pop()
    return Fp8Scheme(True, weight, None, static, tuple(qc.get("ignore") or ()))


def _ct_group(group: dict[str, Any]) -> tuple[Literal["tensor", "channel"], bool]:
    """(weight scale layout, static activations) of one config group; refuses what is not FP8
    W8A8 with per-tensor / per-channel weights."""
    targets = group.get("targets") or []
    if targets and not any(t == "Linear" or str(t).startswith("re:") for t in targets):
        raise ValueError(f"compressed-tensors checkpoint: targets {targets} (expected Linear)")
    w = group.get("weights") or {}
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise ValueError(f"compressed-tensors checkpoint: weights {w.get('type')}/"
                         f"{w.get('num_bits')} bits are not FP8 (float, 8)")  # fmt: skip
    if w.get("dynamic") or w.get("symmetric") is False:
        raise ValueError("compressed-tensors checkpoint: FP8 weights must be static and symmetric")
    strategy = w.get("strategy")
    if strategy not in ("tensor", "channel"):
        raise ValueError(f"compressed-tensors checkpoint: weight strategy {strategy!r} is not "
                         "supported (tensor or channel)")  # fmt: skip
    a = group.get("input_activations")
    if not a:
        raise ValueError("compressed-tensors checkpoint: FP8 weight-only (no input_activations) "
                         "is not supported; weft runs FP8 as W8A8")  # fmt: skip
    if a.get("type") != "float" or a.get("num_bits") != 8:
        raise ValueError(f"compressed-tensors checkpoint: input activations {a.get('type')}/"
                         f"{a.get('num_bits')} bits are not FP8")  # fmt: skip
    a_strategy = a.get("strategy")
    if a.get("dynamic"):  # per token (a dynamic per-tensor scale is taken per token: finer)
        if a_strategy not in ("token", "tensor"):
            raise ValueError(f"compressed-tensors checkpoint: dynamic activations by "
                             f"{a_strategy!r} are not supported (token)")  # fmt: skip
        return strategy, False
    if a_strategy != "tensor":
        raise ValueError(f"compressed-tensors checkpoint: static activations by {a_strategy!r} "
                         "are not supported (tensor)")  # fmt: skip
    return strategy, True
