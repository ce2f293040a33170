"""The Llama family (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, SmolLM2) over the paged KV pool."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from weft.runtime.attention.base import AttentionBackend
from weft.runtime.batch import ForwardBatch
from weft.runtime.models.layers import RMSNorm, RotaryEmbedding, rope_parameters, silu_and_mul


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer: int, max_positions: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(self.head_dim, max_positions, rope_parameters(config))
        self.sliding_window = sliding_window_of(config)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        # x: [T, hidden]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(batch.positions, q, k)
        out = attn.forward(q, k, v, self.layer, batch, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        inter = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer: int, max_positions: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer, max_positions)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Parameter names follow HF checkpoints, except q/k/v and gate/up, which are fused on load."""

    def __init__(self, config: Any, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, max_positions) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Hidden states after the final norm: [T, hidden]."""
        x = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            x = layer(x, batch, attn)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> [N, V] float32
        return self.lm_head(hidden).float()

    ##### Weights #####

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; every parameter must be set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            target = _map_name(hf_name)
            if target is None:
                continue
            name, shard = target
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # some tied checkpoints store the shared matrix twice
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in this model")
            param = params[name]
            with torch.no_grad():
                dst = self._shard_view(param, name, shard)
                if dst.shape != tensor.shape:
                    raise ValueError(
                        f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(dst.shape)}"
                    )
                dst.copy_(tensor)
            loaded.add(f"{name}:{shard}")
        missing = [n for n in self._expected_keys() if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")

    def _shard_view(self, param: torch.Tensor, name: str, shard: str) -> torch.Tensor:
        layer = self.layers[0]
        assert isinstance(layer, LlamaDecoderLayer)
        attn = layer.self_attn
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            offsets = {"q": (0, attn.q_size), "k": (attn.q_size, attn.kv_size)}
            offsets["v"] = (attn.q_size + attn.kv_size, attn.kv_size)
            start, size = offsets[shard]
            return param.narrow(0, start, size)
        if name.endswith("gate_up_proj.weight"):
            inter = param.shape[0] // 2
            return param.narrow(0, 0 if shard == "gate" else inter, inter)
        return param

    def _expected_keys(self) -> list[str]:
        keys: list[str] = []
        for name, _ in self.named_parameters():
            if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
                keys += [f"{name}:{s}" for s in ("q", "k", "v")]
            elif name.endswith("gate_up_proj.weight"):
                keys += [f"{name}:gate", f"{name}:up"]
            elif not (name == "lm_head.weight" and self.tie_word_embeddings):
                keys.append(f"{name}:")
        return keys


_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


def _map_name(hf_name: str) -> tuple[str, str] | None:
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


def head_dim_of(config: Any) -> int:
    return int(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )


def sliding_window_of(config: Any) -> int | None:
    """Mistral's sliding window; Qwen's per-layer windows are refused rather than ignored."""
    window = getattr(config, "sliding_window", None)
    if config.model_type == "mistral":
        return int(window) if window else None
    if getattr(config, "use_sliding_window", False):
        raise ValueError(f"{config.model_type} with use_sliding_window=true is not supported")
    return None
