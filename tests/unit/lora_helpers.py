"""A tiny random Llama and PEFT adapters for it, with the greedy tokens HF gives for each adapter
merged into the weights (peft merge_and_unload): what the LoRA tests compare weft to. Imported as
`lora_helpers` (pytest puts tests/unit on sys.path)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

NEW_TOKENS = 8
PROMPTS = [[5, 17, 33, 8, 91, 40, 2 + 60, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [99, 3]]
ADAPTERS = {  # name -> peft LoraConfig fields (random A and B: init_lora_weights=False)
    "all": {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"},
    "rs": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"],
           "use_rslora": True},
    "attn": {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
}  # fmt: skip


def llama_config(kv_heads: int = 2) -> Any:
    """4 heads over `kv_heads` kv heads, MLP width 96: both split over 2 or 4 ranks."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256,
        eos_token_id=2, bos_token_id=1, tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip


def base_model(kv_heads: int = 2) -> Any:
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(llama_config(kv_heads)).eval()


def greedy(model: Any, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def save_adapter(folder: Path, spec: dict[str, Any], seed: int, kv_heads: int = 2) -> Any:
    """A random PEFT adapter of `spec` saved into `folder` (B scaled up, so that it changes the
    greedy outputs); returns the base model with it merged."""
    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(init_lora_weights=False, **spec)
    wrapped = peft.get_peft_model(base_model(kv_heads), config)
    with torch.no_grad():
        for module in wrapped.modules():
            if hasattr(module, "lora_B") and "default" in getattr(module, "lora_B", {}):
                module.lora_B["default"].weight.mul_(4.0)
    wrapped.save_pretrained(folder)
    return wrapped.merge_and_unload().eval()


def build_lora_setup(
    root: Path, adapters: dict[str, dict[str, Any]] = ADAPTERS, kv_heads: int = 2
) -> tuple[Path, dict[str, Path], dict[tuple[str | None, int], list[int]]]:
    """(base model folder, adapter name -> folder, (adapter or None, prompt index) -> HF tokens)."""
    base = base_model(kv_heads)
    base.save_pretrained(root / "base", safe_serialization=True)
    expected: dict[tuple[str | None, int], list[int]] = {
        (None, i): greedy(base, p) for i, p in enumerate(PROMPTS)
    }
    folders = {}
    for seed, (name, spec) in enumerate(adapters.items(), start=1):
        folders[name] = root / name
        merged = save_adapter(folders[name], spec, seed, kv_heads)
        expected.update({(name, i): greedy(merged, p) for i, p in enumerate(PROMPTS)})
    return root / "base", folders, expected
