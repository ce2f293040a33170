"""Gemma 3 (text): sliding-window layers interleaved with global ones, Gemma's (1 + w) norms around
both sublayers, QK-norm, GeGLU and a scaled embedding, built on the Llama classes.

Per layer, as HF's Gemma3DecoderLayer computes it:
    h = h + post_attention_norm(attn(input_norm(h)))
    h = h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))
with the residual adds carried as in LlamaDecoderLayer (the next norm's add_forward)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from weft.runtime.executor.attention.base import AttentionBackend
from weft.runtime.executor.batch import ForwardBatch
from weft.runtime.models.family import ModelFamily
from weft.runtime.models.layers import (
    GemmaRMSNorm,
    GemvPlan,
    Projection,
    RotaryEmbedding,
    gelu_tanh_and_mul,
)
from weft.runtime.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from weft.runtime.models.parallel import ParallelLMHead, TPInfo, VocabParallelEmbedding, even_split

SLIDING, FULL = "sliding_attention", "full_attention"
_ACTIVATIONS = ("gelu_pytorch_tanh",)


class Gemma3Attention(LlamaAttention):
    """Llama's attention (QKV split by GQA group) with Gemma's QK-norm, the scale
    query_pre_attn_scalar**-0.5, and this layer's rope and window: a sliding layer uses the local
    rope base and `sliding_window`, a global one rope_theta with its scaling and no window."""

    def __init__(self, config: Any, layer: int, max_positions: int, tp: TPInfo) -> None:
        super().__init__(config, layer, max_positions, tp)
        kind = layer_types_of(config)[layer]
        self.scale = float(config.query_pre_attn_scalar) ** -0.5
        self.qk_norm = True
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(self.head_dim, max_positions, gemma3_rope(config, kind))
        self.sliding_window = int(config.sliding_window) if kind == SLIDING else None


class Gemma3MLP(nn.Module):
    """GeGLU (tanh GELU) over this rank's columns: gate/up column-split, down row-split.

    NOTE: down_proj is not `gated`: a GemvPlan would fuse SiLU (not GELU) into its GEMV."""

    def __init__(self, config: Any, tp: TPInfo) -> None:
        super().__init__()
        self.tp = tp
        self.start, self.inter = even_split(config.intermediate_size, tp.size, tp.rank)
        self.gate_up_proj = Projection(config.hidden_size, 2 * self.inter)
        self.down_proj = Projection(self.inter, config.hidden_size)

    def forward(self, x: torch.Tensor, gemv: GemvPlan | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, gemv)  # [T, 2 I]
        return self.tp.all_reduce(self.down_proj(gelu_tanh_and_mul(gate_up), gemv))


class Gemma3DecoderLayer(LlamaDecoderLayer):
    """Attention and the MLP, each between a pre-norm and a post-norm (all GemmaRMSNorm). A
    LlamaDecoderLayer for the model runner (self_attn); its own modules, not Llama's."""

    def __init__(self, config: Any, layer: int, max_positions: int, tp: TPInfo) -> None:
        nn.Module.__init__(self)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, layer, max_positions, tp)
        self.mlp = Gemma3MLP(config, tp)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's normed MLP output, the residual stream before it): the next layer (or
        the final norm) adds the two, as in LlamaDecoderLayer."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_forward(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, batch, attn))
        x, residual = self.pre_feedforward_layernorm.add_forward(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x, batch.gemv)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text model (HF Gemma3ForCausalLM, model_type gemma3_text). Loads, shards and
    draws dummy weights as LlamaForCausalLM does (same parameter names, plus the extra norms).
    Refuses what it does not compute: logit soft-capping, bidirectional attention, an activation
    other than tanh GELU."""

    def __init__(self, config: Any, max_positions: int, tp: TPInfo | None = None) -> None:
        check_config(config)
        nn.Module.__init__(self)
        tp = tp or TPInfo()
        self.config = config
        self.tp = tp
        self.vocab_size = config.vocab_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        # sqrt(hidden) rounded to the embedding's dtype first, as HF multiplies it
        scale = torch.tensor(config.hidden_size**0.5, dtype=self.embed_tokens.dtype, device="cpu")
        self.embed_scale = float(scale)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, max_positions, tp)
            for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings scaled by sqrt(hidden) (rounded to their dtype, as HF's)."""
        return self.embed_tokens(input_ids) * self.embed_scale

    def use_kernels(self, pdl: bool = True) -> None:
        """The projections' GEMV (with `pdl`) and the rotary kernel; the norms and GeGLU stay on
        torch ops (weft's kernels compute Llama's RMSNorm rounding and SiLU only)."""
        for module in self.modules():
            if isinstance(module, Projection):
                module.use_kernels(pdl)
            elif isinstance(module, RotaryEmbedding):
                module.use_kernels()


FAMILY = ModelFamily("Gemma3", Gemma3ForCausalLM, ("Gemma3ForCausalLM",), ("gemma3_text",))


def layer_types_of(config: Any) -> list[str]:
    """Each layer's kind: `layer_types`, or from the older `sliding_window_pattern` (every n-th
    layer global; Gemma 3 publishes 6)."""
    n = int(config.num_hidden_layers)
    kinds = getattr(config, "layer_types", None)
    if kinds is None:
        pattern = int(getattr(config, "sliding_window_pattern", None) or 6)
        kinds = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    kinds = list(kinds)
    if len(kinds) != n or not set(kinds) <= {SLIDING, FULL}:
        raise ValueError(f"gemma3 layer_types must be {n} of {SLIDING!r}/{FULL!r}, got {kinds}")
    return kinds


def gemma3_rope(config: Any, kind: str) -> dict[str, Any]:
    """The rope settings of one layer kind: transformers 5's rope_parameters[kind], else the 4.x
    attributes (rope_local_base_freq for sliding layers; rope_theta + rope_scaling for global)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get(kind), dict):
        out = dict(params[kind])
    elif kind == SLIDING:
        out = {"rope_theta": getattr(config, "rope_local_base_freq", None) or 10000.0}
    else:
        scaling = getattr(config, "rope_scaling", None) or {}
        out = {"rope_theta": getattr(config, "rope_theta", None) or 1_000_000.0, **scaling}
    out["rope_type"] = out.get("rope_type") or out.get("type") or "default"
    return out


def check_config(config: Any) -> None:
    """ValueError naming a Gemma 3 setting weft does not compute."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, key, None) is not None:
            raise ValueError(f"gemma3 with {key}={getattr(config, key)} is not supported "
                             "(weft applies no soft-capping; Gemma 3 checkpoints have none)")  # fmt: skip
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("gemma3 with use_bidirectional_attention=true is not supported")
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act not in _ACTIVATIONS:
        raise ValueError(f"gemma3 hidden_activation {act!r} is not supported (only "
                         f"{', '.join(_ACTIVATIONS)})")  # fmt: skip
    if SLIDING in layer_types_of(config) and not getattr(config, "sliding_window", None):
        raise ValueError("gemma3 has sliding_attention layers but no sliding_window")
