"""Gemma 3 (text) vs HF transformers on tiny random checkpoints: logits through prefill chunks and
decodes, greedy tokens through the scheduler (prompts longer than the window), a synthetic gemma3
GGUF converted (norms stored as 1 + w, names, config, chat template) and kept quantized, TP
placement with one kv head, real-shape configs, refusals and the registry."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from support import hf_greedy, save_word_tokenizer
from test_models import PagedRequest
from test_models_moe import weft_greedy

from weft.runtime.loader import convert_gguf
from weft.runtime.loader.gguf_convert import GEMMA_CHAT_TEMPLATE, gemma3_config
from weft.runtime.loader.gguf_header import GGUFHeader, read_gguf_header
from weft.runtime.loader.gguf_tensors import gguf_tensor_types, iterate_gguf
from weft.runtime.models import architectures, build_model, init_dummy_weights, model_class
from weft.runtime.models.gemma3 import Gemma3ForCausalLM, layer_types_of
from weft.runtime.models.layers import GemmaRMSNorm, rope_inv_freq
from weft.runtime.models.parallel import TPInfo
from weft.runtime.models.quant.gguf import GGUFQuantConfig

VOCAB = 256
CPU = torch.device("cpu")
CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
S, F = "sliding_attention", "full_attention"


def hf_config(**kw: Any) -> Any:
    args: dict[str, Any] = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "query_pre_attn_scalar": 24, "sliding_window": 6, "layer_types": [S, F, S, S],
        "max_position_embeddings": 128, "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        "rope_theta": 5000.0, "rope_local_base_freq": 300.0, "initializer_range": 0.1,
        "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
        "architectures": ["Gemma3ForCausalLM"], **kw,
    }  # fmt: skip
    config = transformers.Gemma3TextConfig(**args)
    config._attn_implementation = "eager"
    return config


def hf_model(config: Any, seed: int = 0) -> Any:
    """Random weights, norms too (HF starts them at 0, which (1 + w) would not test)."""
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    return model


@pytest.mark.parametrize("page_size", [1, 4])
def test_logits_match_hf_through_prefill_chunks_and_decode(page_size: int) -> None:
    config = hf_config()
    hf = hf_model(config)
    model = build_model(config, 128, CPU, torch.float32)
    model.load_weights(hf.state_dict().items())
    ids = torch.randint(0, VOCAB, (20,))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    req = PagedRequest(model, config, page_size, 20)
    spans = [(0, 9), (9, 14), (14, 15), (15, 16), (16, 20)]  # chunks, decodes, a last chunk
    got = torch.cat([req.run(model, ids, s, e) for s, e in spans])
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_greedy_output_matches_hf_generate(tmp_path: Path) -> None:
    """Through the scheduler (its KV pool, the window over a prompt longer than it)."""
    hf = hf_model(hf_config())
    hf.save_pretrained(tmp_path)
    save_word_tokenizer(tmp_path, VOCAB)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 11, 17)]
    new = 10
    expected = hf_greedy(hf, prompts, new)
    assert len({tuple(e) for e in expected}) > 1
    assert weft_greedy(tmp_path, prompts, new) == expected


def test_layers_follow_the_config() -> None:
    model = build_model(hf_config(), 128, CPU, torch.float32)
    assert isinstance(model, Gemma3ForCausalLM)
    attn = [layer.self_attn for layer in model.layers]
    assert [a.sliding_window for a in attn] == [6, None, 6, 6]
    assert all(a.scale == 24**-0.5 and a.qk_norm for a in attn)
    local = rope_inv_freq(32, {"rope_theta": 300.0, "rope_type": "default"})
    assert torch.equal(rope_inv_freq(32, attn[0].rotary.params), local)
    assert attn[1].rotary.params["rope_type"] == "linear"
    assert attn[1].rotary.params["rope_theta"] == 5000.0
    norms = [m for m in model.modules() if isinstance(m, GemmaRMSNorm)]
    assert len(norms) == 4 * 6 + 1
    norms[0].use_kernels(True)  # weft's RMSNorm kernel rounds as Llama does: Gemma stays on torch
    assert norms[0]._kernels is None
    # the older sliding_window_pattern: every 6th layer global
    old = hf_config(num_hidden_layers=7, layer_types=None)
    assert layer_types_of(old) == [S] * 5 + [F, S]


def test_tp_places_the_one_kv_head_on_every_rank() -> None:
    """MQA with tp 2: each rank one q head, the kv head replicated (head_shard, as Llama)."""
    config = hf_config()
    hf = hf_model(config)
    state = hf.state_dict()
    for rank in (0, 1):
        model = build_model(config, 64, CPU, torch.float32, TPInfo(rank=rank, size=2))
        model.load_weights(state.items())
        attn = model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (1, 1)
        q, k, v = attn.qkv_proj.weight.split([32, 32, 32])
        q_rows = state["model.layers.0.self_attn.q_proj.weight"][rank * 32 : rank * 32 + 32]
        torch.testing.assert_close(q, q_rows)
        torch.testing.assert_close(k, state["model.layers.0.self_attn.k_proj.weight"])
        torch.testing.assert_close(v, state["model.layers.0.self_attn.v_proj.weight"])
        assert model.layers[0].mlp.inter == 48


def test_refusals_and_registry() -> None:
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        with pytest.raises(ValueError, match=f"{key}=30.0 is not supported"):
            build_model(hf_config(**{key: 30.0}), 64, CPU, torch.float32)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        build_model(hf_config(use_bidirectional_attention=True), 64, CPU, torch.float32)
    with pytest.raises(ValueError, match="hidden_activation 'silu' is not supported"):
        build_model(hf_config(hidden_activation="silu"), 64, CPU, torch.float32)
    assert architectures()["Gemma3ForCausalLM"] == "Gemma3"
    assert model_class(hf_config()) is Gemma3ForCausalLM
    no_arch = hf_config()
    no_arch.architectures = None
    assert model_class(no_arch) is Gemma3ForCausalLM  # by model_type alone
    multimodal = transformers.Gemma3Config(architectures=["Gemma3ForConditionalGeneration"])
    with pytest.raises(ValueError, match="unsupported model.*Gemma3ForConditionalGeneration"):
        model_class(multimodal)


@pytest.mark.parametrize(("folder", "params"), [("gemma-3-270m", 268_098_176),
                                                ("gemma-3-12b", 11_766_034_176)])  # fmt: skip
def test_real_configs_have_the_published_parameter_count(folder: str, params: int) -> None:
    """The benchmark configs build (on meta) to the published sizes (268M; 12B's text model
    11.77B, the checkpoint's 12.2B less its SigLIP vision tower)."""
    config = transformers.AutoConfig.from_pretrained(CONFIGS / folder)
    model = build_model(config, 4096, torch.device("meta"), torch.bfloat16)
    assert sum(math.prod(shape) for _, shape in model.checkpoint_shapes()) == params
    kinds = layer_types_of(config)
    assert [i for i, k in enumerate(kinds) if k == F] == list(range(5, len(kinds), 6))


def test_dummy_weights_load_and_run(tmp_path: Path) -> None:
    raw = json.loads((CONFIGS / "gemma-3-12b" / "config.json").read_text())
    raw.update(num_hidden_layers=6, hidden_size=64, intermediate_size=96, vocab_size=VOCAB,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, layer_types=None)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    model = build_model(config, 64, CPU, torch.float32)
    init_dummy_weights(model, seed=5)
    req = PagedRequest(model, config, 1, 12)
    logits = req.run(model, torch.arange(12), 0, 12)
    assert logits.shape == (12, VOCAB) and torch.isfinite(logits).all()


##### A synthetic gemma3 GGUF, as llama.cpp writes one #####

TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\u2581"]
TOKENS += [chr(c) for c in range(ord("a"), ord("z") + 1)]
TOKENS += [f"\u2581{chr(c)}" for c in range(ord("a"), ord("z") + 1)]
TOKENS += [f"<unused{i}>" for i in range(VOCAB - len(TOKENS))]
GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def write_gemma3_gguf(path: Path, hf: Any) -> Path:
    """hf's weights under llama.cpp's gemma3 names, norms stored as 1 + w, ffn_gate as Q8_0; the
    metadata llama.cpp writes (no layer pattern, no local rope base, no chat template)."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters[F]["rope_theta"])
    w.add_sliding_window(c.sliding_window)
    w.add_tokenizer_model("llama")
    w.add_token_list(TOKENS)
    w.add_token_scores([0.0] * len(TOKENS))
    w.add_token_types([3] * 6 + [1] * (len(TOKENS) - 6))
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        array = t.numpy().astype(np.float32)
        if name.endswith("norm.weight"):
            array = array + np.float32(1.0)
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            out = f"blk.{layer}.{GGUF_NAMES[rest.removesuffix('.weight')]}.weight"
        if out.endswith("ffn_gate.weight"):
            w.add_tensor(out, gguf.quants.quantize(array, Q8_0), raw_dtype=Q8_0)
        else:
            w.add_tensor(out, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_converts_to_the_hf_model(tmp_path: Path) -> None:
    """Names, the norms' 1 + w undone (the same weights as transformers' own GGUF loader reads),
    the config llama.cpp's metadata implies, the Gemma chat template; weft from the folder and
    from the kept blocks equal to HF on the converted weights."""
    config = hf_config(num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=32,
                       rope_scaling=None, rope_local_base_freq=10000.0)  # fmt: skip
    hf = hf_model(config)
    path = write_gemma3_gguf(tmp_path / "g.gguf", hf)
    folder = convert_gguf(path, tmp_path / "cache")
    conv = transformers.Gemma3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="g.gguf",
                                                            dtype=torch.float32)  # fmt: skip
    ref_state = ref.state_dict()
    for name, t in conv.state_dict().items():
        assert torch.equal(t, ref_state[name]), name
        if "ffn" not in name and "mlp.gate_proj" not in name:
            torch.testing.assert_close(t, hf.state_dict()[name], atol=1e-6, rtol=0, msg=name)
    assert conv.config.layer_types == [S] * 5 + [F]
    assert conv.config.query_pre_attn_scalar == 32
    assert conv.config.rope_parameters[S]["rope_theta"] == 10000.0

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert tokenizer.chat_template == GEMMA_CHAT_TEMPLATE
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " hi "},
            {"role": "assistant", "content": "yo"}, {"role": "user", "content": "ok"}]  # fmt: skip
    assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        "<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\nyo"
        "<end_of_turn>\n<start_of_turn>user\nok<end_of_turn>\n<start_of_turn>model\n"
    )
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, 5]  # <eos>, <end_of_turn>

    ids = torch.randint(3, VOCAB, (14,))
    with torch.no_grad():
        expected = conv(ids[None]).logits[0]
    dense = build_model(conv.config, 64, CPU, torch.float32)
    dense.load_weights(conv.state_dict().items())
    torch.testing.assert_close(PagedRequest(dense, conv.config, 1, 14).run(dense, ids, 0, 14),
                               expected, atol=2e-5, rtol=1e-4)  # fmt: skip
    quant = GGUFQuantConfig(gguf_tensor_types(read_gguf_header(path)), conv.config)
    kept = build_model(conv.config, 64, CPU, torch.float32, quant=quant)
    kept.load_weights(iterate_gguf(path))
    assert kept.layers[0].mlp.gate_up_proj.quant is not None  # the Q8_0 gate rows stay blocks
    torch.testing.assert_close(PagedRequest(kept, conv.config, 1, 14).run(kept, ids, 0, 14),
                               expected, atol=2e-5, rtol=1e-4)  # fmt: skip


def test_gguf_config_rope_scaling_and_27b_scale() -> None:
    """What llama.cpp assumes beyond the file: the 27B's (62 layers) scale from hidden / heads,
    the global layers' linear rope scaling from rope.scaling.*."""
    config = transformers.Gemma3TextConfig(num_hidden_layers=62, hidden_size=5376,
                                           num_attention_heads=32, head_dim=128)  # fmt: skip
    meta = {"general.architecture": "gemma3", "gemma3.attention.key_length": 128,
            "gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}  # fmt: skip
    gemma3_config(config, GGUFHeader(Path("g.gguf"), meta, ()))
    assert config.query_pre_attn_scalar == 168
    assert config.rope_parameters[F]["rope_type"] == "linear"
    assert config.rope_parameters[F]["factor"] == 8.0
    assert config.rope_parameters[S]["rope_type"] == "default"
    small = transformers.Gemma3TextConfig(num_hidden_layers=18, hidden_size=640,
                                          num_attention_heads=4, head_dim=256)  # fmt: skip
    gemma3_config(small, GGUFHeader(Path("g.gguf"), {"general.architecture": "gemma3",
                                                     "gemma3.attention.key_length": 256}, ()))  # fmt: skip
    assert small.query_pre_attn_scalar == 256 and small.rope_parameters[F]["rope_type"] == "default"
