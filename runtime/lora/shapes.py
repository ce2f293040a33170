"""Which projections take LoRA, how weft fuses them, and their shapes on one tensor-parallel rank."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

# the HF projection names PEFT targets, in the order of weft's fused outputs
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PARENT = {
    m: "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp" for m in TARGETS
}
# weft's projection -> the HF projections stacked in its output (out = q | k | v, gate | up)
FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
FUSED_OF = {hf: (fused, i) for fused, parts in FUSED.items() for i, hf in enumerate(parts)}
COLUMN_PARALLEL = ("qkv_proj", "gate_up_proj")  # output rows split over ranks: B is split
ROW_PARALLEL = ("o_proj", "down_proj")  # input columns split over ranks: A is split


@dataclass(frozen=True)
class LoraShapes:
    """A Llama-family model's projection shapes: head counts and the MLP width are this rank's
    (the whole model's with tp_size 1; `for_rank` gives a rank's)."""

    num_layers: int
    hidden: int
    head_dim: int
    num_heads: int
    num_kv_heads: int
    intermediate: int

    @classmethod
    def from_hf_config(cls, config: Any) -> LoraShapes:
        """The whole model's shapes from a transformers config (LlamaConfig and kin)."""
        heads = int(config.num_attention_heads)
        return cls(
            num_layers=int(config.num_hidden_layers),
            hidden=int(config.hidden_size),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            intermediate=int(config.intermediate_size),
        )

    def for_rank(self, tp_size: int, tp_rank: int) -> LoraShapes:
        """This model's shapes on rank tp_rank of tp_size, split as runtime/models/llama.py does."""
        # NOTE: imported here: weft.runtime.models imports the models, which may import this
        from weft.runtime.models.parallel import even_split, head_shard

        shard = head_shard(self.num_heads, self.num_kv_heads, tp_size, tp_rank)
        _, inter = even_split(self.intermediate, tp_size, tp_rank)
        return replace(
            self, num_heads=shard.q_count, num_kv_heads=shard.kv_count, intermediate=inter
        )

    def in_dim(self, fused: str) -> int:
        """The input width of weft projection `fused` (its A matrices' columns)."""
        if fused == "o_proj":
            return self.num_heads * self.head_dim
        return self.intermediate if fused == "down_proj" else self.hidden

    def slice_widths(self, fused: str) -> tuple[int, ...]:
        """The output widths of the HF projections fused into `fused` (its B matrices' rows)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "qkv_proj": (q, kv, kv),
            "o_proj": (self.hidden,),
            "gate_up_proj": (self.intermediate, self.intermediate),
            "down_proj": (self.hidden,),
        }[fused]

    def slice_starts(self, fused: str) -> tuple[int, ...]:
        """The first output column of each slice: lora_expand's slice_starts."""
        widths = self.slice_widths(fused)
        return tuple(sum(widths[:i]) for i in range(len(widths)))

    def out_dim(self, fused: str) -> int:
        return sum(self.slice_widths(fused))

    def hf_shape(self, module: str) -> tuple[int, int]:
        """(out, in) of HF projection `module`, e.g. k_proj: (kv heads * head_dim, hidden)."""
        fused, i = FUSED_OF[module]
        return self.slice_widths(fused)[i], self.in_dim(fused)
