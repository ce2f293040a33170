"""GGUF tensors -> HF-named fp32 arrays (dequantized, rope layout undone, Gemma's norm offset
removed) -> safetensors shards."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from gguf.quants import dequantize
from safetensors.numpy import save_file

from weft.runtime.loader.gguf_header import GGUFHeader, TensorInfo

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
# llama.cpp's converter interleaves the rotary halves of q and k for these architectures only
# (transformers' GGUF loader undoes it for exactly the same set).
_PERMUTED_ARCHITECTURES = ("llama",)
SHARD_BYTES = 2 << 30  # fp32 bytes per shard; writing one holds about twice that in memory

_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_PER_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma 3 names its four norms per layer differently: ffn_norm is the pre-MLP norm there
_PER_LAYER_GEMMA3 = {
    **_PER_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# NOTE: llama.cpp's converter stores Gemma's norm weights as 1 + w (its graph multiplies by the
# weight; HF's Gemma3RMSNorm by 1 + w), as transformers' GGUF loader undoes too
_NORM_OFFSET_ARCHITECTURES = ("gemma3",)
_IGNORED = {"rope_freqs.weight"}  # llama3 rope factors: a config value in HF, not a parameter
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def check_supported(header: GGUFHeader) -> None:
    """Raise ValueError if we cannot convert this file's architecture (nor any MoE one)."""
    experts = header.arch_value("expert_count", 0) or 0
    if int(experts) > 0 or header.architecture.endswith("moe"):
        raise ValueError(
            f"{header.path}: a mixture-of-experts GGUF ({header.architecture!r}, {experts} "
            "experts) is not supported: weft reads no GGUF expert tensors; pass the model's "
            "HF-format folder instead (Qwen3-MoE and Mixtral load from safetensors)"
        )
    if header.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{header.path}: GGUF architecture {header.architecture!r} is not supported; "
            f"weft converts {', '.join(SUPPORTED_ARCHITECTURES)} "
            "(Llama/Mistral/SmolLM/Qwen2/Qwen3/Gemma 3)"
        )


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF parameter name of a GGUF tensor of architecture `arch`; None for tensors HF has
    no parameter for."""
    if gguf_name in _IGNORED:
        return None
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _TOP_LEVEL and suffix in ("weight", "bias"):
        return f"{_TOP_LEVEL[stem]}.{suffix}"
    per_layer = _PER_LAYER_GEMMA3 if arch == "gemma3" else _PER_LAYER
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in per_layer:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF name")
    layer, part, suffix = match.groups()
    return f"model.layers.{layer}.{per_layer[part]}.{suffix}"


def norm_offset(gguf_name: str, arch: str) -> float:
    """What to add to a GGUF tensor to get HF's values: -1 for Gemma's norm weights (stored as
    1 + w), else 0."""
    if arch in _NORM_OFFSET_ARCHITECTURES and gguf_name.endswith("norm.weight"):
        return -1.0
    return 0.0


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its rope pairs adjacent rows; HF pairs the halves).

    Per head, llama.cpp stores rows (x0, y0, x1, y1, ...) where HF has (x0, x1, ..., y0, y1, ...):
    it wrote `w.reshape(n_heads, 2, half, *rest).swapaxes(1, 2)`, and this is the inverse.
    """
    half = w.shape[0] // n_heads // 2
    # (n_heads, half, 2, *rest) -> (n_heads, 2, half, *rest)
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_hf_tensors(header: GGUFHeader) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, fp32 array) for every parameter in the file, in file order."""
    check_supported(header)
    data = np.memmap(header.path, dtype=np.uint8, mode="r")
    heads = _head_counts(header)
    arch = header.architecture
    for info in header.tensors:
        name = hf_name(info.name, arch)
        if name is None:
            logger.debug("skipping GGUF tensor %s (no HF parameter)", info.name)
            continue
        w = _dequantize(data, info)
        part = info.name.split(".")[2] if info.name.startswith("blk.") else ""
        if arch in _PERMUTED_ARCHITECTURES and part in heads:
            w = unpermute_rope(w, heads[part])
        offset = norm_offset(info.name, arch)
        if offset:
            w = w.astype(np.float32) + np.float32(offset)
        yield name, np.ascontiguousarray(w, dtype=np.float32)


def write_safetensors(header: GGUFHeader, folder: Path) -> int:
    """Write the file's weights as fp32 safetensors into `folder`; returns the parameter count.

    One `model.safetensors` when it fits in SHARD_BYTES, else shards plus an index json.
    """
    plan = _plan_shards(header)
    n_shards = max(plan.values(), default=0) + 1
    shard_names = (
        ["model.safetensors"]
        if n_shards == 1
        else [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]
    )
    weight_map: dict[str, str] = {}
    pending: dict[str, np.ndarray] = {}
    current, total = 0, 0
    for name, array in iter_hf_tensors(header):
        shard = plan[name]
        if shard != current:
            save_file(pending, str(folder / shard_names[current]), metadata={"format": "pt"})
            pending, current = {}, shard
        pending[name] = array
        weight_map[name] = shard_names[shard]
        total += array.size
    save_file(pending, str(folder / shard_names[current]), metadata={"format": "pt"})
    if n_shards > 1:
        index = {"metadata": {"total_size": total * 4}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


##### Internal Helper Functions #####


def _head_counts(header: GGUFHeader) -> dict[str, int]:
    """Rows-per-rope-group counts for q and k (k uses the KV head count under GQA)."""
    n_heads = int(header.arch_value("attention.head_count"))
    n_kv = header.arch_value("attention.head_count_kv", n_heads)
    return {"attn_q": n_heads, "attn_k": int(n_kv)}


def _dequantize(data: np.memmap, info: TensorInfo) -> np.ndarray:
    raw = np.asarray(data[info.offset : info.offset + info.nbytes])
    raw = raw.reshape(*info.shape[:-1], info.row_bytes)
    try:
        w = dequantize(raw, info.qtype)
    except NotImplementedError as e:
        raise ValueError(
            f"{info.name}: ggml type {info.qtype.name} cannot be dequantized by gguf-py ({e})"
        ) from e
    assert w.shape == info.shape, (info.name, w.shape, info.shape)
    return w


def _plan_shards(header: GGUFHeader) -> dict[str, int]:
    """HF name -> shard index, filling shards in file order up to SHARD_BYTES of fp32."""
    plan: dict[str, int] = {}
    shard, used = 0, 0
    for info in header.tensors:
        name = hf_name(info.name, header.architecture)
        if name is None:
            continue
        nbytes = info.numel * 4
        if used and used + nbytes > SHARD_BYTES:
            shard, used = shard + 1, 0
        plan[name] = shard
        used += nbytes
    return plan
