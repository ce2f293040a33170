"""TokenizerSource: which tokenizer a runtime uses (a given folder, the model's own, a synthetic one
for a dummy model without one, or none with skip_tokenizer_init); every process resolves the same."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from weft.runtime.config import EngineConfig
from weft.runtime.loader.synthetic_tokenizer import cached_synthetic_tokenizer, has_tokenizer
from weft.runtime.loader.weights import load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TokenizerKind = Literal["given", "model", "synthetic", "none"]


@dataclass(frozen=True)
class TokenizerSource:
    kind: TokenizerKind
    path: Path | None  # the folder loaded; None for "none"
    description: str  # for the log and /server_info

    def load(self) -> PreTrainedTokenizerBase | None:
        return None if self.path is None else load_tokenizer(self.path)

    def to_dict(self) -> dict[str, Any]:
        path = None if self.path is None else str(self.path)
        return {"kind": self.kind, "path": path, "description": self.description}


def resolve_tokenizer(config: EngineConfig, model_path: Path) -> TokenizerSource:
    """`config.tokenizer` if given; else the model folder's own; else, for random (dummy) weights,
    a synthetic byte-level tokenizer of the config's vocabulary (built once into the cache dir);
    with skip_tokenizer_init none at all. A folder without a tokenizer is otherwise a ValueError
    naming what to pass."""
    if config.skip_tokenizer_init:
        return TokenizerSource("none", None, "none (skip_tokenizer_init: token ids in and out)")
    if config.tokenizer is not None:
        return TokenizerSource(
            "given", Path(config.tokenizer), f"the tokenizer in {config.tokenizer}"
        )
    if has_tokenizer(model_path):
        return TokenizerSource("model", model_path, f"the model's own tokenizer ({model_path})")
    if config.load_format != "dummy":
        raise ValueError(
            f"the model folder {model_path} has no tokenizer (tokenizer.json or "
            "tokenizer_config.json): pass tokenizer= a folder with one (weft serve --tokenizer), "
            "or skip_tokenizer_init=True (--skip-tokenizer-init) to send and receive token ids"
        )
    hf = json.loads((model_path / "config.json").read_text())
    vocab_size, bos_id, eos = hf.get("vocab_size"), hf.get("bos_token_id"), hf.get("eos_token_id")
    if not isinstance(vocab_size, int):
        raise ValueError(f"{model_path}/config.json has no integer vocab_size")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    folder = cached_synthetic_tokenizer(config.resolved_cache_dir, vocab_size, bos_id, eos_ids)
    return TokenizerSource(
        "synthetic",
        folder,
        f"a synthetic byte-level tokenizer of {vocab_size} ids (BOS {bos_id}, EOS "
        f"{', '.join(map(str, eos_ids)) or 'none'}): {model_path} has no tokenizer and "
        "load_format is dummy",
    )
