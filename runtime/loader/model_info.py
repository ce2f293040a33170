"""ModelInfo: the facts about a loaded model that requests are checked against (context, vocab, EOS)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weft.runtime.config import EngineConfig


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


@dataclass(frozen=True)
class ModelInfo:
    model_path: str
    model_type: str
    architectures: tuple[str, ...]
    context_len: int
    vocab_size: int
    eos_ids: frozenset[int]

    @classmethod
    def from_folder(cls, folder: Path, hf_config: Any, config: EngineConfig) -> ModelInfo:
        max_pos = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
        if config.context_length is not None:
            if max_pos and config.context_length > max_pos:
                raise ValueError(
                    f"context_length {config.context_length} exceeds the model's "
                    f"max_position_embeddings ({max_pos})"
                )
            context_len = config.context_length
        elif max_pos:
            context_len = max_pos
        else:
            raise ValueError("the model config has no max_position_embeddings; pass context_length")
        eos = _ids(getattr(hf_config, "eos_token_id", None))
        gen_path = Path(folder) / "generation_config.json"
        if gen_path.is_file():
            eos |= _ids(json.loads(gen_path.read_text()).get("eos_token_id"))
        return cls(
            model_path=str(config.model) if config.model else str(folder),
            model_type=str(hf_config.model_type),
            architectures=tuple(getattr(hf_config, "architectures", None) or ()),
            context_len=context_len,
            vocab_size=int(hf_config.vocab_size),
            eos_ids=frozenset(eos),
        )

    def check_request(self, input_len: int, max_new_tokens: int, pool_tokens: int) -> str | None:
        """None if a request of this shape can run; else the reason, worded for the user."""
        if input_len == 0:
            return "The input is empty: give a non-empty prompt or input_ids."
        if input_len >= self.context_len:
            return (
                f"The input ({input_len} tokens) is longer than the model's context length "
                f"({self.context_len} tokens)."
            )
        if input_len + max_new_tokens > self.context_len:
            return (
                f"Requested token count exceeds the model's maximum context length of "
                f"{self.context_len} tokens. You requested a total of {input_len + max_new_tokens} "
                f"tokens: {input_len} tokens from the input messages and {max_new_tokens} tokens "
                f"for the completion. Please reduce the number of tokens in the input messages or "
                f"the completion to fit within the limit."
            )
        if input_len + max_new_tokens > pool_tokens:
            return (
                f"Requested token count ({input_len} input + {max_new_tokens} new = "
                f"{input_len + max_new_tokens}) exceeds the KV cache capacity of this engine "
                f"({pool_tokens} tokens); reduce max_new_tokens or start the engine with a larger "
                f"KV pool."
            )
        return None

    def resolve_max_new_tokens(
        self, requested: int | None, input_len: int, pool_tokens: int
    ) -> int:
        """`None` means "up to the limit": the context length and the KV pool, whichever is less."""
        if requested is not None:
            return requested
        return max(min(self.context_len, pool_tokens) - input_len, 0)
