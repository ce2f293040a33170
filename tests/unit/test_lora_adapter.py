"""LoRA adapters saved by `peft` on a tiny random Llama, read by weft.runtime.lora: the deltas equal
peft's merge, bad adapters are clear errors, the tensor-parallel shares, the slot pool's LRU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from weft.kernels.lora_ref import lora_ref
from weft.runtime.lora import (
    FUSED,
    TARGETS,
    LoraPool,
    LoraPoolFull,
    LoraShapes,
    load_adapter,
    shard_adapter,
)

peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers")
# peft's save_pretrained asks transformers a deprecated question
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

LAYERS = 2


def _config() -> Any:
    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip


SHAPES = LoraShapes(LAYERS, hidden=64, head_dim=16, num_heads=4, num_kv_heads=2, intermediate=96)


def _save(folder: Path, seed: int, **lora: Any) -> dict[str, torch.Tensor]:
    """A peft adapter (random A and B) on the seed-0 random Llama, saved to `folder`; returns the
    HF weights peft's merge_and_unload gives."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config())
    torch.manual_seed(seed)
    config = peft.LoraConfig(init_lora_weights=False, **lora)
    wrapped = peft.get_peft_model(model, config)
    wrapped.save_pretrained(folder)
    return {k: v.detach().clone() for k, v in wrapped.merge_and_unload().state_dict().items()}


@pytest.fixture(scope="module")
def base() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(_config()).state_dict()


@pytest.fixture(scope="module")
def saved(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """name -> (folder, merged weights): every module, rsLoRA, and q/v only of a lower rank."""
    root = tmp_path_factory.mktemp("lora")
    specs = {
        "all": {"r": 8, "lora_alpha": 16, "target_modules": list(TARGETS)},
        "rslora": {"r": 16, "lora_alpha": 8, "target_modules": "all-linear", "use_rslora": True},
        "qv": {"r": 4, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]},
    }
    return {name: (root / name, _save(root / name, i + 1, **spec))
            for i, (name, spec) in enumerate(specs.items())}  # fmt: skip


def _hf(layer: int, module: str) -> str:
    parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"model.layers.{layer}.{parent}.{module}.weight"


@pytest.mark.parametrize("name", ["all", "rslora", "qv"])
def test_deltas_equal_peft_merge(name: str, saved: dict, base: dict[str, torch.Tensor]) -> None:
    folder, merged = saved[name]
    adapter = load_adapter(name, folder, SHAPES, max_rank=16)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    assert adapter.rank == cfg["r"]
    want_scaling = cfg["lora_alpha"] / (cfg["r"] ** 0.5 if cfg["use_rslora"] else cfg["r"])
    assert adapter.scaling == pytest.approx(want_scaling)
    for layer in range(LAYERS):
        for fused, parts in FUSED.items():
            delta = adapter.delta(layer, fused)
            if delta is None:  # qv: no MLP or o_proj weights at all
                assert name == "qv" and fused in ("o_proj", "gate_up_proj", "down_proj")
                delta = torch.zeros(SHAPES.out_dim(fused), SHAPES.in_dim(fused))
            want = torch.cat([merged[_hf(layer, m)] - base[_hf(layer, m)] for m in parts])
            torch.testing.assert_close(delta, want, atol=1e-5, rtol=1e-4)
    if name == "qv":  # the k slice of qkv is zeros, rank 4
        w = adapter.layers[0]["qkv_proj"]
        assert w.a.shape == (12, 64) and not w.a[4:8].any() and not w.b[64:96].any()


def test_regex_targets_and_dtype(tmp_path: Path, base: dict[str, torch.Tensor]) -> None:
    merged = _save(tmp_path, 7, r=4, lora_alpha=8, target_modules=r".*\.(k_proj|down_proj)")
    adapter = load_adapter("re", tmp_path, SHAPES, max_rank=8, dtype=torch.float16)
    assert set(adapter.layers[1]) == {"qkv_proj", "down_proj"}
    assert adapter.layers[1]["down_proj"].a.dtype == torch.float16
    k = adapter.delta(1, "qkv_proj")[64:96]
    torch.testing.assert_close(
        k, merged[_hf(1, "k_proj")] - base[_hf(1, "k_proj")], atol=2e-3, rtol=1e-2
    )


def test_layers_to_transform(tmp_path: Path, base: dict[str, torch.Tensor]) -> None:
    merged = _save(
        tmp_path, 9, r=2, lora_alpha=4, target_modules=["o_proj"], layers_to_transform=[1]
    )
    adapter = load_adapter("one-layer", tmp_path, SHAPES, max_rank=8)
    assert adapter.layers[0] == {} and set(adapter.layers[1]) == {"o_proj"}
    o = _hf(1, "o_proj")
    torch.testing.assert_close(
        adapter.delta(1, "o_proj"), merged[o] - base[o], atol=1e-5, rtol=1e-4
    )


def _edited(src: Path, dst: Path, **config: Any) -> Path:
    shutil.copytree(src, dst)
    path = dst / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return dst


@pytest.mark.parametrize(
    "config, match",
    [
        ({"r": 32}, r"r=32 is above max_lora_rank=16"),
        ({"target_modules": ["q_proj", "lm_head"]}, "target module 'lm_head' is not supported"),
        ({"use_dora": True}, "use_dora=True is not supported"),
        ({"bias": "all"}, "bias='all' is not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"peft_type": "IA3"}, "peft_type 'IA3'"),
        ({"r": 4}, r"lora_A.weight' has shape \(8, \d+\), expected \(4, \d+\)"),
        ({"target_modules": ["q_proj"]}, "does not target it"),
        ({"target_modules": "(unclosed"}, "not a valid regex"),
    ],
)
def test_bad_configs_name_the_file(saved: dict, tmp_path: Path, config: dict, match: str) -> None:
    folder = _edited(saved["all"][0], tmp_path / "bad", **config)
    with pytest.raises(ValueError, match=match) as info:
        load_adapter("bad", folder, SHAPES, max_rank=16)
    assert str(folder) in str(info.value)


def test_bad_files_and_shapes(saved: dict, tmp_path: Path) -> None:
    good = saved["all"][0]
    with pytest.raises(ValueError, match="is not a folder"):
        load_adapter("x", tmp_path / "nowhere", SHAPES, 16)
    folder = tmp_path / "no-weights"
    shutil.copytree(good, folder)
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    with pytest.raises(
        ValueError, match="adapter_model.safetensors: no such file .*found adapter_model.bin"
    ):
        load_adapter("x", folder, SHAPES, 16)
    (folder / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="adapter_config.json: not readable JSON"):
        load_adapter("x", folder, SHAPES, 16)
    (folder / "adapter_config.json").unlink()
    with pytest.raises(ValueError, match="adapter_config.json: no such file"):
        load_adapter("x", folder, SHAPES, 16)
    with pytest.raises(ValueError, match=r"layer 1 is out of range \(the model has 1 layers\)"):
        load_adapter("x", good, LoraShapes(1, 64, 16, 4, 2, 96), 16)
    with pytest.raises(
        ValueError, match=r"down_proj.lora_A.weight' has shape \(8, 96\), expected \(8, 128\)"
    ):
        load_adapter("x", good, LoraShapes(LAYERS, 64, 16, 4, 2, 128), 16)


def test_non_finite_missing_half_and_unknown_tensors(saved: dict, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    cases = {
        "nan": (lambda t: t.update({_key(0, "v_proj", "B"): torch.full((32, 8), float("nan"))}),
                "non-finite"),
        "half": (lambda t: t.pop(_key(1, "o_proj", "A")), "layer 1 o_proj has no lora_A"),
        "extra": (lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)}),
                  "'base_model.model.lm_head.lora_A.weight' is not a LoRA A/B matrix"),
    }  # fmt: skip
    for name, (edit, match) in cases.items():
        folder = tmp_path / name
        shutil.copytree(saved["all"][0], folder)
        tensors = load_file(folder / "adapter_model.safetensors")
        edit(tensors)
        save_file(tensors, folder / "adapter_model.safetensors")
        with pytest.raises(ValueError, match=match):
            load_adapter(name, folder, SHAPES, 16)


def _key(layer: int, module: str, half: str) -> str:
    return f"base_model.model.{_hf(layer, module)[:-7]}.lora_{half}.weight"


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_shares_rebuild_the_delta(saved: dict, tp: int) -> None:
    """Column-parallel projections: each rank's delta is its rows of the full one; row-parallel:
    its columns, and the ranks' x-slices through them sum to the full delta's output."""
    adapter = load_adapter("all", saved["all"][0], SHAPES, max_rank=16)
    shares = [shard_adapter(adapter, tp, rank) for rank in range(tp)]
    full = {f: adapter.delta(1, f) for f in FUSED}
    q, kv = full["qkv_proj"].split([64, 32 + 32])[0], full["qkv_proj"][64:]
    rows_q = torch.cat([s.delta(1, "qkv_proj")[: s.shapes.num_heads * 16] for s in shares])
    torch.testing.assert_close(rows_q, q)
    k_rank0 = shares[0].delta(1, "qkv_proj")[
        64 // tp : 64 // tp + shares[0].shapes.num_kv_heads * 16
    ]
    torch.testing.assert_close(k_rank0, kv[: k_rank0.shape[0]])
    gate = torch.cat([s.delta(1, "gate_up_proj")[: s.shapes.intermediate] for s in shares])
    torch.testing.assert_close(gate, full["gate_up_proj"][:96])
    for fused in ("o_proj", "down_proj"):
        torch.testing.assert_close(
            torch.cat([s.delta(1, fused) for s in shares], dim=1), full[fused]
        )


def test_pool_lru_pinning_and_layout(saved: dict) -> None:
    adapters = {n: load_adapter(n, saved[n][0], SHAPES, max_rank=16) for n in saved}
    pool = LoraPool(SHAPES, max_loras=2, max_rank=16, dtype=torch.float32, device="cpu")
    assert pool.acquire(adapters["all"]) == 0 and pool.acquire(adapters["qv"]) == 1
    assert pool.acquire(adapters["all"]) == 0  # resident: pinned twice
    assert not pool.can_acquire({"rslora"})
    with pytest.raises(LoraPoolFull, match="'rslora': all 2 slots"):
        pool.acquire(adapters["rslora"])
    pool.release("qv")
    pool.release("all")
    assert pool.pinned() == {"all": 1} and pool.can_acquire({"rslora"})
    assert pool.acquire(adapters["rslora"]) == 1  # qv was the only evictable adapter
    assert pool.resident() == {"all": 0, "rslora": 1}
    pool.release("all")
    pool.release("rslora")  # both evictable: "all" was used least recently
    assert pool.acquire(adapters["qv"]) == 0 and pool.slot_of("all") is None
    assert not pool.drop("qv") and pool.drop("rslora") and pool.slot_of("rslora") is None
    pool.check_integrity()
    with pytest.raises(AssertionError, match="without an acquire"):
        pool.release("rslora")
    # slot 0 now holds qv (rank 4, no MLP): its stale rows were zeroed, its MLP rank is 0
    w = pool.weights(0, "qkv_proj")
    assert w.ranks.tolist() == [4, 0] and w.slice_starts == (0, 64, 96)
    assert pool.weights(0, "down_proj").ranks.tolist() == [0, 0]
    assert not w.a[0].view(3, 16, 64)[:, 4:].any() and not w.b[0][:, 4:].any()
    assert w.scalings.tolist() == [1.0, 0.0]


def test_pool_weights_through_the_reference_equal_the_merged_delta(saved: dict) -> None:
    """The pool's layout is the kernels' contract: lora_ref over it gives x @ delta^T per token."""
    adapters = [load_adapter(n, saved[n][0], SHAPES, max_rank=16) for n in ("all", "rslora", "qv")]
    pool = LoraPool(SHAPES, max_loras=4, max_rank=16, dtype=torch.float32, device="cpu")
    slots = [pool.acquire(a) for a in adapters]
    token_slots = torch.tensor([slots[0], -1, slots[2], slots[1], slots[1], slots[0]])
    for fused in FUSED:
        x = torch.randn(6, SHAPES.in_dim(fused))
        y = torch.randn(6, SHAPES.out_dim(fused))
        got = lora_ref(
            x, y, *pool.weights(1, fused)[:4], token_slots, pool.weights(1, fused).slice_starts
        )
        for t, slot in enumerate(token_slots.tolist()):
            delta = adapters[slots.index(slot)].delta(1, fused) if slot >= 0 else None
            want = y[t] if delta is None else y[t] + x[t] @ delta.t()
            torch.testing.assert_close(got[t], want, atol=1e-4, rtol=1e-4)
