"""Qwen3-MoE and Mixtral vs HF transformers on tiny random checkpoints (greedy, token for token),
their checkpoint layouts, real-shape configs, refusals and the model registry."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from support import hf_greedy, save_word_tokenizer, scheduler_greedy

from weft.runtime.config import EngineConfig
from weft.runtime.loader.gguf_header import GGUFHeader
from weft.runtime.loader.gguf_weights import check_supported
from weft.runtime.loader.weights import iterate_weight_slices
from weft.runtime.models import (
    architectures,
    build_model,
    check_quantization,
    init_dummy_weights,
    model_class,
)
from weft.runtime.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM, SparseMoeBlock
from weft.runtime.models.parallel import TPInfo
from weft.runtime.scheduler.scheduler import Scheduler

VOCAB = 256
CPU = torch.device("cpu")
CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
COMMON: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "tie_word_embeddings": False, "initializer_range": 0.1,
    "bos_token_id": 1, "eos_token_id": None, "pad_token_id": None,
}  # fmt: skip

QWEN_EXTRA: dict[str, Any] = {"head_dim": 16}  # not a typed Qwen3MoeConfig argument


def hf_model(kind: str) -> Any:
    torch.manual_seed(0)
    if kind.startswith("qwen3moe"):
        config: Any = transformers.Qwen3MoeConfig(
            **COMMON, num_hidden_layers=3, intermediate_size=48, **QWEN_EXTRA,
            moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=kind.endswith("norm"),
            architectures=["Qwen3MoeForCausalLM"],
        )  # fmt: skip
        model: Any = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.MixtralConfig(
            **COMMON, num_hidden_layers=2, intermediate_size=32, num_local_experts=8,
            num_experts_per_tok=2, sliding_window=None, architectures=["MixtralForCausalLM"],
        )  # fmt: skip
        model = transformers.MixtralForCausalLM(config)
    return model.to(torch.float32).eval()


KINDS = ["qwen3moe-norm", "qwen3moe-raw", "mixtral"]


@pytest.fixture(scope="module", params=KINDS)
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(folder with the checkpoint as save_pretrained writes it + a tokenizer, the HF model)."""
    folder = tmp_path_factory.mktemp(request.param)
    model = hf_model(request.param)
    model.save_pretrained(folder)
    save_word_tokenizer(folder, VOCAB)
    return folder, model


def weft_greedy(folder: Path, prompts: list[list[int]], new: int) -> list[list[int]]:
    cfg = EngineConfig(model=str(folder), device="cpu", dtype="float32", cpu_threads=1,
                       max_total_tokens=512, max_running_requests=4)  # fmt: skip
    return scheduler_greedy(cfg, folder, prompts, new)


def test_greedy_output_matches_hf_generate(saved: Any) -> None:
    folder, hf = saved
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 11, 17)]
    new = 8
    expected = hf_greedy(hf, prompts, new)
    assert len({tuple(e) for e in expected}) > 1  # the prompts lead to different outputs
    assert weft_greedy(folder, prompts, new) == expected


def test_fused_and_per_expert_checkpoints_load_the_same(saved: Any) -> None:
    """save_pretrained's per-expert names (read lazily from safetensors) and transformers 5's
    in-memory fused experts (state_dict) give the same parameters, whole and per TP rank; the
    experts' rows and columns are where LlamaMLP-style sharding puts them."""
    folder, hf = saved
    names = list(hf.state_dict())
    assert any(n.endswith("experts.gate_up_proj") for n in names)
    file_names = [n for n, _ in iterate_weight_slices(folder)]
    assert any(".experts.0." in n for n in file_names)  # save_pretrained wrote them per expert
    for tp in (TPInfo(), TPInfo(rank=1, size=2)):
        a = build_model(hf.config, 64, CPU, torch.float32, tp)
        a.load_weights(iterate_weight_slices(folder))
        b = build_model(hf.config, 64, CPU, torch.float32, tp)
        b.load_weights(hf.state_dict().items())
        for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
            assert torch.equal(pa, pb), name
    layer, block = next((i, m.mlp) for i, m in enumerate(a.layers)
                        if isinstance(m.mlp, SparseMoeBlock))  # fmt: skip
    fused = hf.state_dict()[f"model.layers.{layer}.mlp.experts.gate_up_proj"]  # [E, 2I, H]
    full = block.full_inter
    assert block.inter == full // 2 and block.start == full // 2  # rank 1 of 2
    torch.testing.assert_close(block.experts.w13[:, : block.inter], fused[:, block.start : full])
    torch.testing.assert_close(block.experts.w13[:, block.inter :], fused[:, full + block.start :])


def test_layers_follow_the_config() -> None:
    qwen = build_model(hf_model("qwen3moe-norm").config, 64, CPU, torch.float32)
    assert isinstance(qwen, Qwen3MoeForCausalLM)
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in qwen.layers]
    assert sparse == [True, False, True]  # mlp_only_layers=[1]
    blocks = [layer.mlp for layer in qwen.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert all(b.renormalize and b.top_k == 2 and b.num_experts == 8 for b in blocks)
    assert qwen.layers[0].self_attn.qk_norm
    raw = build_model(hf_model("qwen3moe-raw").config, 64, CPU, torch.float32)
    assert not any(layer.mlp.renormalize for i, layer in enumerate(raw.layers) if i != 1)
    mixtral = build_model(hf_model("mixtral").config, 64, CPU, torch.float32)
    assert isinstance(mixtral, MixtralForCausalLM)
    assert all(isinstance(layer.mlp, SparseMoeBlock) and layer.mlp.renormalize
               for layer in mixtral.layers)  # fmt: skip
    assert not mixtral.layers[0].self_attn.qk_norm


def test_missing_expert_is_named() -> None:
    hf = hf_model("mixtral")
    state = dict(hf.state_dict())
    del state["model.layers.1.mlp.experts.down_proj"]
    model = build_model(hf.config, 64, CPU, torch.float32)
    with pytest.raises(
        ValueError, match=r"missing 8 expert tensor.*layers\.1\.mlp\.experts\.0\.down"
    ):
        model.load_weights(state.items())
    state = dict(hf.state_dict())
    state["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(8, 32, 64)
    with pytest.raises(ValueError, match="shape"):
        model.load_weights(state.items())


@pytest.mark.parametrize(
    ("folder", "billions"), [("qwen3-30b-a3b", 30.53), ("mixtral-8x7b", 46.70)]
)
def test_real_configs_have_the_published_parameter_count(folder: str, billions: float) -> None:
    """The benchmark configs build (on meta) to the published sizes: the expert stacks, the
    router and the dense parts all have the checkpoint's shapes."""
    config = transformers.AutoConfig.from_pretrained(CONFIGS / folder)
    model = build_model(config, 4096, torch.device("meta"), torch.bfloat16)
    total = sum(math.prod(shape) for _, shape in model.checkpoint_shapes())
    assert abs(total / 1e9 - billions) < 0.01, total


def test_dummy_weights_load_and_run(tmp_path: Path) -> None:
    """load_format=dummy at a (shrunk) real config: every expert and router tensor is drawn,
    deterministically, and a forward stays finite."""
    for folder in ("qwen3-30b-a3b", "mixtral-8x7b"):
        raw = json.loads((CONFIGS / folder / "config.json").read_text())
        raw.update(num_hidden_layers=2, hidden_size=64, intermediate_size=48, vocab_size=VOCAB,
                   moe_intermediate_size=16, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16)  # fmt: skip
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text(json.dumps(raw))
        config = transformers.AutoConfig.from_pretrained(tmp_path / folder)
        a = build_model(config, 64, CPU, torch.float32)
        b = build_model(config, 64, CPU, torch.float32)
        init_dummy_weights(a, seed=5)
        init_dummy_weights(b, seed=5)
        block = a.layers[0].mlp
        assert isinstance(block, SparseMoeBlock) and block.experts.w13.std() > 0.01
        for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
            assert torch.equal(pa, pb) and torch.isfinite(pa).all(), name
        x = torch.randn(5, 64)
        assert torch.isfinite(block(x)).all()


def test_quantized_moe_is_refused() -> None:
    for kind, arch in (("qwen3moe-norm", "Qwen3MoeForCausalLM"), ("mixtral", "MixtralForCausalLM")):
        config = hf_model(kind).config
        for quant in ("fp8", "gguf"):
            with pytest.raises(ValueError, match=rf"{arch} .*quantization='{quant}'.*experts"):
                check_quantization(config, quant)
        check_quantization(config, None)
    llama = transformers.LlamaConfig(architectures=["LlamaForCausalLM"])
    check_quantization(llama, "fp8")  # the Llama family keeps both
    check_quantization(llama, "gguf")
    header = GGUFHeader(Path("mixtral.gguf"), {"general.architecture": "llama",
                                               "llama.expert_count": 8}, ())  # fmt: skip
    with pytest.raises(ValueError, match="mixture-of-experts GGUF"):
        check_supported(header)
    header = GGUFHeader(Path("q.gguf"), {"general.architecture": "qwen3moe"}, ())
    with pytest.raises(ValueError, match="mixture-of-experts GGUF"):
        check_supported(header)


def test_registry_lists_the_families() -> None:
    archs = architectures()
    assert archs["Qwen3MoeForCausalLM"] == "Qwen3-MoE"
    assert archs["MixtralForCausalLM"] == "Mixtral"
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert archs[arch] == "Llama"
    assert model_class(hf_model("mixtral").config) is MixtralForCausalLM
    no_arch = transformers.Qwen3MoeConfig()
    no_arch.architectures = None
    assert model_class(no_arch) is Qwen3MoeForCausalLM  # by model_type alone
    wrong = transformers.Qwen3MoeConfig(architectures=["MixtralForCausalLM"])
    with pytest.raises(ValueError, match="unsupported model.*MixtralForCausalLM.*Qwen3Moe"):
        model_class(wrong)
    with pytest.raises(ValueError, match="supported: .*MixtralForCausalLM"):
        model_class(transformers.GPT2Config())


@pytest.mark.parametrize("quant", ["fp8", "gguf"])
def test_engine_refuses_quantized_moe(saved: Any, quant: str) -> None:
    """Through the scheduler's model load: a clear error before anything is read or built."""
    folder, hf = saved
    cfg = EngineConfig(model=str(folder), device="cpu", dtype="float32", cpu_threads=1,
                       max_total_tokens=512, load_format="dummy", quantization=quant)  # fmt: skip
    with pytest.raises(ValueError, match=rf"{hf.config.architectures[0]} .*no {quant} path"):
        Scheduler(cfg, folder, None)
