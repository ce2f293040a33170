"""Reading an HF-format folder: safetensors weights (lazily), config and tokenizer, local only."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

INDEX_FILE = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of `folder`: those its index names, else every *.safetensors.

    Raises ValueError naming the folder and what is missing.
    """
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a safetensors index (no weight_map): {e}") from e
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{folder}: {INDEX_FILE} names missing shards: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        note = f" (found {', '.join(pickles)}, but weft loads no pickle files)" if pickles else ""
        raise ValueError(f"{folder} has no *.safetensors weight files{note}")
    return files


def iterate_weights(
    folder: Path, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, tensor) for every tensor in the folder, one file open at a time.

    Tensors are materialized on `device` one by one as the caller consumes them.
    """
    seen: set[str] = set()
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for name in f.keys():
                if name in seen:
                    raise ValueError(f"{folder}: tensor {name!r} appears in more than one file")
                seen.add(name)
                yield name, f.get_tensor(name)


class SafetensorsSlice:
    """One tensor of an open safetensors file, read slice by slice (a rank reads only its part)."""

    def __init__(self, handle: Any, name: str, device: torch.device) -> None:
        self._handle = handle
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())
        self.name = name
        self.device = device

    def read(self, dim: int, start: int, size: int) -> torch.Tensor:
        """Elements [start, start + size) along dim; dim -1: the whole tensor."""
        if dim < 0:
            return self._handle.get_tensor(self.name).to(self.device)
        index: list[slice] = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + size)
        return self._slice[tuple(index)].to(self.device)


def iterate_weight_slices(
    folder: Path, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, SafetensorsSlice]]:
    """Like iterate_weights, but yields lazy tensors: nothing is read until `read` is called,
    which must happen before the next item is requested (the file closes after its last one)."""
    seen: set[str] = set()
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in seen:
                    raise ValueError(f"{folder}: tensor {name!r} appears in more than one file")
                seen.add(name)
                yield name, SafetensorsSlice(f, name, torch.device(device))


def read_hf_config(folder: Path) -> PretrainedConfig:
    """The folder's config.json through AutoConfig, never touching the network."""
    from transformers import AutoConfig

    if not (Path(folder) / "config.json").is_file():
        raise ValueError(f"{folder} has no config.json, so it is not an HF-format model folder")
    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot read the model config in {folder}: {e}") from e


def load_tokenizer(folder_or_name: Path | str) -> PreTrainedTokenizerBase:
    """The fast tokenizer (with its chat template) of a local folder; nothing is downloaded."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder_or_name), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(
            f"cannot load a tokenizer from {folder_or_name} (local files only; it needs "
            f"tokenizer.json or tokenizer_config.json): {e}"
        ) from e
    if not tokenizer.is_fast:
        raise ValueError(
            f"{folder_or_name}: only a slow tokenizer is available; weft needs a fast one"
        )
    return tokenizer
