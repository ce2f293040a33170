"""Unit tests for weft.runtime.loader: safetensors iteration, model resolution errors, GGUF
parsing and tensor conversion on tiny synthetic files (no packaged model, no transformers load)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from weft.runtime.loader import (
    iterate_weights,
    load_tokenizer,
    read_hf_config,
    resolve_model_path,
)

Q8_0 = gguf.GGMLQuantizationType.Q8_0


# ---------------------------------------------------------------- helpers


def tiny_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(8, 4, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=g),
        "model.norm.weight": torch.randn(4, generator=g),
    }


def hf_folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return path


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k of llama models."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray], heads: int, kv: int) -> Path:
    """A GGUF file holding `tensors` (float32 stored as F32; a name ending in '@q8' as Q8_0)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.attention.head_count", heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", kv)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    for name, array in tensors.items():
        if name.endswith("@q8"):
            writer.add_tensor(name[:-3], gguf.quants.quantize(array, Q8_0), raw_dtype=Q8_0)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + sum(shape)).standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------- safetensors iteration


def test_iterate_single_file(tmp_path):
    tensors = tiny_tensors()
    save_file(tensors, str(hf_folder(tmp_path) / "model.safetensors"))
    got = dict(iterate_weights(tmp_path))
    assert got.keys() == tensors.keys()
    for name, t in tensors.items():
        assert torch.equal(got[name], t)
        assert got[name].device.type == "cpu"


@pytest.mark.parametrize("with_index", [True, False])
def test_iterate_sharded(tmp_path, with_index):
    tensors = tiny_tensors()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[:2],
        "model-00002-of-00002.safetensors": names[2:],
    }
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / file))
    if with_index:
        weight_map = {k: file for file, keys in shards.items() for k in keys}
        (tmp_path / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": weight_map})
        )
        # a file the index does not name (e.g. Mistral's consolidated.safetensors) is not read
        save_file({"stray": torch.zeros(1)}, str(tmp_path / "consolidated.safetensors"))
    got = dict(iterate_weights(tmp_path, device=torch.device("cpu")))
    assert got.keys() == tensors.keys()
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)


def test_iterate_errors(tmp_path):
    tensors = tiny_tensors()
    save_file(tensors, str(tmp_path / "a.safetensors"))
    save_file({"model.norm.weight": torch.zeros(4)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(ValueError, match="more than one file"):
        list(iterate_weights(tmp_path))
    index = {"weight_map": {"x": "model-00009-of-00009.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="missing shards: model-00009-of-00009.safetensors"):
        list(iterate_weights(tmp_path))


def test_read_hf_config_and_tokenizer_errors(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4).save_pretrained(
        tmp_path
    )
    config = read_hf_config(tmp_path)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("llama", 64, 2)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(ValueError, match="cannot read the model config"):
        read_hf_config(tmp_path)
    with pytest.raises(ValueError, match="has no config.json"):
        read_hf_config(tmp_path / "missing")
    with pytest.raises(ValueError, match="cannot load a tokenizer from .*local files only"):
        load_tokenizer(tmp_path)


# ---------------------------------------------------------------- resolve_model_path


def test_resolve_hf_folder(tmp_path):
    folder = hf_folder(tmp_path / "m")
    save_file(tiny_tensors(), str(folder / "model.safetensors"))
    assert resolve_model_path(str(folder), tmp_path / "cache") == folder.resolve()
    assert not (tmp_path / "cache").exists()


def make_no_config_folder(tmp: Path) -> str:
    (tmp / "m").mkdir()
    (tmp / "m" / "x.gguf").write_bytes(b"")
    return str(tmp / "m")


def make_pickle_only_folder(tmp: Path) -> str:
    (hf_folder(tmp / "m") / "pytorch_model.bin").write_bytes(b"pickle")
    return str(tmp / "m")


def make_non_gguf_file(tmp: Path) -> str:
    (tmp / "weights.pt").write_bytes(b"x")
    return str(tmp / "weights.pt")


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda tmp: "HuggingFaceTB/SmolLM2-135M-Instruct", ["'HuggingFaceTB/", "nothing exists"]),
        (make_no_config_folder, ["/m has no config.json", "pass the file itself", "x.gguf"]),
        (make_pickle_only_folder, ["/m has no *.safetensors", "pytorch_model.bin", "no pickle"]),
        (make_non_gguf_file, ["weights.pt is a file but not a .gguf file"]),
    ],
)
def test_resolve_errors(tmp_path, make, expected):
    with pytest.raises(ValueError) as e:
        resolve_model_path(make(tmp_path), tmp_path / "cache")
    assert all(text in str(e.value) for text in expected), str(e.value)
    if "pickle" not in expected[-1]:  # says what is accepted, and that nothing is downloaded
        assert all(
            text in str(e.value) for text in ["HF-format folder", ".gguf", "never downloads"]
        )
