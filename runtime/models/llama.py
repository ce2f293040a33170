"""The Llama family (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, SmolLM2) over the paged KV pool."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from weft.runtime.executor.attention.base import AttentionBackend
from weft.runtime.executor.batch import ForwardBatch
from weft.runtime.models.family import ModelFamily
from weft.runtime.models.layers import (
    GemvPlan,
    Projection,
    RMSNorm,
    RotaryEmbedding,
    rope_parameters,
    silu_and_mul,
)
from weft.runtime.models.parallel import (
    ParallelLMHead,
    TPInfo,
    VocabParallelEmbedding,
    even_split,
    head_shard,
)
from weft.runtime.models.quant.base import quantized_layers, weight_shape
from weft.runtime.models.weights import Placement, Weight, checkpoint_names, load_weights


class LlamaAttention(nn.Module):
    """Attention over this rank's heads: QKV column-split by GQA group, o_proj row-split."""

    def __init__(self, config: Any, layer: int, max_positions: int, tp: TPInfo) -> None:
        super().__init__()
        self.layer = layer
        self.tp = tp
        self.head_dim = head_dim_of(config)
        self.shard = head_shard(
            config.num_attention_heads, num_kv_heads_of(config), tp.size, tp.rank
        )
        self.num_heads = self.shard.q_count
        self.num_kv_heads = self.shard.kv_count
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        self.qkv_proj = Projection(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Projection(self.q_size, config.hidden_size)
        self.qk_norm = config.model_type in ("qwen3", "qwen3_moe")
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(self.head_dim, max_positions, rope_parameters(config))
        self.sliding_window = sliding_window_of(config)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        # x: [T, hidden]
        gemv = batch.gemv
        return self.tp.all_reduce(
            self.o_proj(self.attend(self.qkv_proj(x, gemv), batch, attn), gemv)
        )

    def attend(
        self, qkv: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend
    ) -> torch.Tensor:
        """The attention of the projected [T, q + 2 kv] over the pool: [T, q_size], o_proj's x."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm.with_heads_of(q, self.k_norm, k)
        if self.rotary.stores_kv and attn.rotates(batch):  # the decode kernel rotates, stores
            out = attn.forward_rotating(q, k, v, self.layer, batch, self.scale,
                                        self.rotary.cos_sin, prefetch=self.o_proj.prefetch_tensor,
                                        sliding_window=self.sliding_window)  # fmt: skip
        else:  # the rotary kernel stores k and v into the pool too where the backend lets it
            target = attn.kv_store_target(self.layer, batch) if self.rotary.stores_kv else None
            q, k = self.rotary(batch.positions, q, k, (v, *target) if target else None)
            out = attn.forward(
                q, k, v, self.layer, batch, self.scale, self.sliding_window, kv_stored=bool(target)
            )
        return out.reshape(-1, self.q_size)


class LlamaMLP(nn.Module):
    """SwiGLU over this rank's columns: gate/up column-split, down row-split."""

    def __init__(self, config: Any, tp: TPInfo) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        self.tp = tp
        self.start, self.inter = even_split(config.intermediate_size, tp.size, tp.rank)
        self.act: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul
        self.gate_up_proj = Projection(config.hidden_size, 2 * self.inter)
        self.down_proj = Projection(self.inter, config.hidden_size, gated=True)

    def forward(self, x: torch.Tensor, gemv: GemvPlan | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, gemv)
        return self.tp.all_reduce(self.down_proj.forward_gated(gate_up, self.act, gemv))

    def use_kernels(self) -> None:
        from weft.kernels.activation import silu_and_mul as silu_and_mul_kernel

        self.act = silu_and_mul_kernel


class LlamaDecoderLayer(nn.Module):
    """Attention then the MLP: `mlp` is LlamaMLP unless the model passes another block taking
    (x, gemv) (an MoE model's sparse block)."""

    def __init__(
        self,
        config: Any,
        layer: int,
        max_positions: int,
        tp: TPInfo,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer, max_positions, tp)
        self.mlp = mlp if mlp is not None else LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it); the next layer (or the final
        norm) adds the two: `h = h + attn(norm(h)); h = h + mlp(norm(h))` with the adds fused
        into the norms."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_forward(x, residual)
        x = self.self_attn(x, batch, attn)
        x, residual = self.post_attention_layernorm.add_forward(x, residual)
        return self.mlp(x, batch.gemv), residual


class LlamaForCausalLM(nn.Module):
    """Parameter names follow HF checkpoints, except q/k/v and gate/up, which are fused on load."""

    def __init__(self, config: Any, max_positions: int, tp: TPInfo | None = None) -> None:
        super().__init__()
        tp = tp or TPInfo()
        self.config = config
        self.tp = tp
        self.vocab_size = config.vocab_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, max_positions, tp, self.make_mlp(config, i, tp))
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def make_mlp(self, config: Any, layer: int, tp: TPInfo) -> nn.Module:
        """Layer `layer`'s MLP block (called while the layers are built, before anything else
        of a subclass exists): the dense SwiGLU here."""
        return LlamaMLP(config, tp)

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Hidden states after the final norm: [T, hidden]."""
        x = self.embed(batch.input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(x, residual, batch, attn)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm.add_forward(x, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings [T, hidden] of the tokens [T]."""
        return self.embed_tokens(input_ids)

    def use_kernels(self, pdl: bool = True) -> None:
        """Run RMSNorm (+ residual add), rotary embedding and SiLU-and-mul as weft's Triton
        kernels (CUDA; on CPU only under TRITON_INTERPRET=1, for tests); with `pdl`, the norms
        and the projections' GEMV (where a GemvPlan chooses it) launch as programmatic
        dependents (sm_90+)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Projection)):
                module.use_kernels(pdl)
            elif isinstance(module, (RotaryEmbedding, LlamaMLP)):
                module.use_kernels()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> [N, V] in the model's dtype (gathered from every rank's vocab rows)
        return self.lm_head(hidden)

    ##### Weights #####

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        """Copy this rank's slice of each HF-named tensor in, fusing q/k/v and gate/up; every
        parameter must be set. Lazy tensors are read slice by slice."""
        if self.vocab_padded:
            with torch.no_grad():  # rows past the vocabulary stay zero (quantized: zero blocks)
                for param in (*self.embed_tokens.parameters(), *self.lm_head.parameters()):
                    param.zero_()
        load_weights(self, weights, self._placement, self._expected_keys())

    @property
    def vocab_padded(self) -> bool:
        return self.embed_tokens.count < self.embed_tokens.per_rank

    def _placement(self, name: str, shard: str, shape: tuple[int, ...]) -> Placement:
        layer = self.layers[0]
        assert isinstance(layer, LlamaDecoderLayer)
        attn, d = layer.self_attn, layer.self_attn.head_dim
        hidden = self.config.hidden_size
        # the dense MLPs' columns (as LlamaMLP splits them; an MoE layer's mlp has none)
        mlp_start, mlp_inter = even_split(self.config.intermediate_size, self.tp.size, self.tp.rank)
        heads, kv_heads = self.config.num_attention_heads, num_kv_heads_of(self.config)
        h = attn.shard
        suffix = name.rsplit(".", 1)[-1]
        cols = (hidden,) if suffix == "weight" else ()
        if "qkv_proj" in name:
            q, kv = h.q_count * d, h.kv_count * d
            if shard == "q":
                return Placement((heads * d, *cols), 0, h.q_start * d, q, 0)
            offset = q if shard == "k" else q + kv
            return Placement((kv_heads * d, *cols), 0, h.kv_start * d, kv, offset)
        if "gate_up_proj" in name:
            full = self.config.intermediate_size
            dst = 0 if shard == "gate" else mlp_inter
            return Placement((full, hidden), 0, mlp_start, mlp_inter, dst)
        if name.endswith("o_proj.weight"):
            return Placement((hidden, heads * d), 1, h.q_start * d, h.q_count * d)
        if name.endswith("down_proj.weight"):
            return Placement((hidden, self.config.intermediate_size), 1, mlp_start, mlp_inter)
        if name in ("embed_tokens.weight", "lm_head.weight"):
            emb = self.embed_tokens
            return Placement((self.vocab_size, hidden), 0, emb.start, emb.count)
        return Placement(shape)

    def _expected_keys(self) -> list[str]:
        quant = {prefix: method for prefix, _, method in quantized_layers(self)}
        keys: list[str] = []
        for prefix, method in quant.items():
            if prefix == "lm_head" and self.tie_word_embeddings:
                continue
            shards = [s for _, s in checkpoint_names(f"{prefix}.weight")]
            for suffix in method.checkpoint_suffixes():
                keys += [f"{prefix}.{suffix}:{s}" for s in shards]
        for name, _ in self.named_parameters():
            prefix, _, leaf = name.rpartition(".")
            if prefix in quant and leaf != "bias":
                continue  # the method's storage: its checkpoint tensors are listed above
            if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
                keys += [f"{name}:{s}" for s in ("q", "k", "v")]
            elif name.endswith("gate_up_proj.weight"):
                keys += [f"{name}:gate", f"{name}:up"]
            elif not (name == "lm_head.weight" and self.tie_word_embeddings):
                keys.append(f"{name}:")
        return keys

    def checkpoint_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """The HF-named tensors (full, unsharded shapes) a checkpoint of this model holds."""
        quant = {prefix: layer for prefix, layer, _ in quantized_layers(self)}
        named = [(n, tuple(p.shape)) for n, p in self.named_parameters()
                 if n.rpartition(".")[0] not in quant or n.endswith(".bias")]  # fmt: skip
        for prefix, layer in quant.items():  # a quantized layer's weight, as a checkpoint has it
            named.append((f"{prefix}.weight", weight_shape(layer)))
        out: list[tuple[str, tuple[int, ...]]] = []
        for name, shape in named:
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            hf = name if name.startswith("lm_head") else f"model.{name}"
            for part, shard in checkpoint_names(hf):
                out.append((part, self._placement(name, shard, shape).full_shape))
        return out


FAMILY = ModelFamily(
    "Llama",
    LlamaForCausalLM,
    ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
    ("llama", "mistral", "qwen2", "qwen3"),
)


def num_kv_heads_of(config: Any) -> int:
    return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


def head_dim_of(config: Any) -> int:
    return int(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )


def sliding_window_of(config: Any) -> int | None:
    """Mistral's (and Mixtral's) sliding window; Qwen's per-layer windows are refused rather
    than ignored."""
    window = getattr(config, "sliding_window", None)
    if config.model_type in ("mistral", "mixtral"):
        return int(window) if window else None
    if getattr(config, "use_sliding_window", False):
        raise ValueError(f"{config.model_type} with use_sliding_window=true is not supported")
    return None
