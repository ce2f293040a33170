"""DraftRunner (speculative decoding's draft model) on CPU with tiny random Llamas: greedy proposals
equal the HF model's greedy continuation (requests of different lengths and draft lags, over two
propose rounds), KV written only at the table's slots of the positions run (the target's pool
untouched), sampled proposals keep their distributions, bad inputs are refused."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers

from weft.runtime.config import EngineConfig, TuningConfig
from weft.runtime.executor.batch import ForwardBatch, ForwardMode
from weft.runtime.executor.draft import DraftRunner
from weft.runtime.executor.draft_loader import load_draft, read_draft_hf_config
from weft.runtime.executor.memory import PageAllocator, ReqToTokenPool
from weft.runtime.executor.model_runner import ModelRunner
from weft.runtime.executor.sampler import Sampler, SamplingInputs, make_generator
from weft.runtime.loader import read_hf_config
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.scheduler.request import Req

V = 96  # vocabulary of the tiny models
CTX = 64  # the table's width (the target's context)
CPU = torch.device("cpu")
K = 4
# (prompt length, output tokens, kv_len, draft_len): a fresh draft, a partial lag, a jump-forward
# (seq_len > kv_len + 1), the steady state (draft_len = seq_len - 1)
SHAPES = [(7, 1, 7, 0), (12, 3, 14, 6), (4, 5, 5, 5), (9, 2, 10, 10)]


def save_llama(folder: Path, vocab: int, seed: int, layers: int = 2, context: int = 256) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
        initializer_range=0.2, tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("draft")
    return folder, save_llama(folder, V, seed=1)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("target")
    save_llama(folder, V, seed=2, layers=3)
    return folder


def engine_config(model: Path, page_size: int, **kwargs: Any) -> EngineConfig:
    return EngineConfig(model=str(model), device="cpu", dtype="float32", page_size=page_size,
                        max_total_tokens=1024, max_running_requests=8, **kwargs)  # fmt: skip


def build(config: EngineConfig, draft: Path, table: ReqToTokenPool, slots: int) -> DraftRunner:
    return DraftRunner.build(config, draft, CPU, torch.float32, table, config.resolved_page_size,
                             slots, target_vocab_size=V)  # fmt: skip


def make_reqs(table: ReqToTokenPool, alloc: PageAllocator, seed: int = 0) -> list[Req]:
    """Requests of SHAPES, each with a table row whose first 40 positions hold slots; pages go
    round-robin so no row's slots are contiguous."""
    gen = torch.Generator().manual_seed(seed)
    reqs = []
    for i, (prompt, outputs, kv_len, draft_len) in enumerate(SHAPES):
        ids = torch.randint(0, V, (prompt + outputs,), generator=gen).tolist()
        req = Req(f"r{i}", ids[:prompt], SamplingParams(max_new_tokens=32), max_new_tokens=32)
        req.output_ids = ids[prompt:]
        req.kv_len, req.draft_len, req.row = kv_len, draft_len, table.alloc()
        reqs.append(req)
    p = alloc.page_size
    pages: list[list[int]] = [[] for _ in reqs]
    for _ in range(-(-40 // p)):
        for held in pages:
            got = alloc.alloc_pages(1)
            assert got is not None
            held += got
    for req, held in zip(reqs, pages, strict=True):
        assert req.row is not None
        table.write(req.row, 0, alloc.page_slots(held)[:40])
    return reqs


def catch_up(draft: DraftRunner, table: ReqToTokenPool, reqs: list[Req]) -> None:
    """The draft's KV for positions [0, draft_len) of each request, as after target extends."""
    runs = [(r, r.draft_len) for r in reqs if r.draft_len]
    ids = [t for r, n in runs for t in r.tokens(0, n)]
    pos = torch.cat([torch.arange(n) for _, n in runs])
    rows = torch.tensor([r.row for r, _ in runs])
    lens = [n for _, n in runs]
    lens_t = torch.tensor(lens)
    fb = ForwardBatch(ForwardMode.EXTEND, torch.tensor(ids), pos,
                      table.table[torch.repeat_interleave(rows, lens_t), pos], rows, lens_t,
                      lens_t, lens, list(lens))  # fmt: skip
    draft.extend(fb)


def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()  # [V]


def hf_greedy(model: Any, ids: list[int], k: int) -> list[int]:
    out: list[int] = []
    for _ in range(k):
        out.append(int(hf_logits(model, ids + out).argmax()))
    return out


def greedy_rows(reqs: list[Req]) -> list[SamplingInputs]:
    greedy = SamplingParams(max_new_tokens=32, temperature=0.0)
    return [SamplingInputs(greedy, r.input_ids, r.output_ids, frozenset()) for r in reqs]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("rows", ["off", "on"])
def test_greedy_proposals_equal_the_model_alone(
    draft_model: tuple[Path, Any], page_size: int, rows: str
) -> None:
    """`rows`: step 0 (several tokens behind) as one extend, or as decode rows (spec_decode_rows:
    what a CUDA graph replays)."""
    folder, hf = draft_model
    config = engine_config(folder, page_size, tuning=TuningConfig(spec_decode_rows=rows))
    table, alloc = ReqToTokenPool(8, CTX, CPU), PageAllocator(256 // page_size, page_size, CPU)
    draft = build(config, folder, table, 256)
    assert (draft.decode_rows > 0) == (rows == "on")
    reqs = make_reqs(table, alloc)
    catch_up(draft, table, reqs)
    for accepted in ([1, 0, 4, 2], None):  # round 2 after a simulated verification
        prop = draft.propose(reqs, K, greedy_rows(reqs))
        assert prop.probs == [None] * len(reqs)
        for req, tokens in zip(reqs, prop.tokens, strict=True):
            assert tokens == hf_greedy(hf, req.fill_ids, K), req.rid
            assert req.draft_len == req.seq_len + K - 1
        if accepted is None:
            break
        for req, tokens, a in zip(reqs, prop.tokens, accepted, strict=True):
            seq = req.seq_len  # keep a drafts, then a bonus token the draft did not propose
            bonus = (tokens[a] + 1) % V if a < K else 5
            req.output_ids += tokens[:a] + [bonus]
            req.kv_len = seq + a
            req.draft_len = min(req.draft_len, seq + a)


def test_kv_written_only_at_the_table_slots_of_the_positions_run(
    draft_model: tuple[Path, Any], target_dir: Path
) -> None:
    """Built as the target's ModelRunner will build it: loaded first (before the pool is sized),
    then over the target's table and slot count."""
    folder, _ = draft_model
    config = engine_config(target_dir, 4)
    loaded = load_draft(config, str(folder), CPU, torch.float32, CTX)
    target = ModelRunner(config, target_dir, read_hf_config(target_dir), CTX)
    num_slots = target.allocator.num_pages * target.page_size
    with pytest.raises(ValueError, match="but the loaded draft is"):
        DraftRunner.build(config, target_dir, CPU, torch.float32, target.req_to_token, 4,
                          num_slots, target_vocab_size=V, loaded=loaded)  # fmt: skip
    draft = DraftRunner.build(config, folder, CPU, torch.float32, target.req_to_token, 4,
                              num_slots, target_vocab_size=V, loaded=loaded)  # fmt: skip
    assert draft.model is loaded.model
    assert draft.pool.num_slots == target.pool.num_slots
    target_kv = [t.clone() for t in (*target.pool.k, *target.pool.v)]
    sentinel = 1234.5
    for t in (*draft.pool.k, *draft.pool.v):
        t.fill_(sentinel)
    table = target.req_to_token
    reqs = make_reqs(table, target.allocator)
    catch_up(draft, table, reqs)
    draft.propose(reqs, K, greedy_rows(reqs))
    expected = set()
    for req in reqs:  # [0, draft_len) by extend, [draft_len, seq_len + K - 1) by propose
        expected |= set(table.table[req.row, : req.seq_len + K - 1].tolist())
    for t in (*draft.pool.k, *draft.pool.v):
        written = (t != sentinel).flatten(1).any(dim=1)
        assert set(written.nonzero().flatten().tolist()) == expected
    for before, after in zip(target_kv, (*target.pool.k, *target.pool.v), strict=True):
        assert torch.equal(before, after)


SAMPLED = [
    SamplingParams(temperature=0.7, top_k=20),
    SamplingParams(temperature=1.3, top_p=0.8, sampling_seed=7),
    SamplingParams(temperature=0.0),  # greedy in the same batch: no probs
    SamplingParams(temperature=0.9, min_p=0.1, frequency_penalty=0.5, logit_bias={3: 2.0}),
]


def test_sampled_proposals_keep_the_distribution_they_drew_from(
    draft_model: tuple[Path, Any],
) -> None:
    folder, hf = draft_model
    config = engine_config(folder, 1)
    table, alloc = ReqToTokenPool(8, CTX, CPU), PageAllocator(256, 1, CPU)
    draft = build(config, folder, table, 256)
    reqs = make_reqs(table, alloc)
    catch_up(draft, table, reqs)
    rows = [
        SamplingInputs(p, r.input_ids, r.output_ids, frozenset(),
                       make_generator(p.sampling_seed, CPU) if p.sampling_seed else None)
        for p, r in zip(SAMPLED, reqs, strict=True)
    ]  # fmt: skip
    prefixes = [r.fill_ids for r in reqs]
    prop = draft.propose(reqs, K, rows)
    ref = Sampler(V, CPU)
    for i, (p, prefix, tokens, probs) in enumerate(
        zip(SAMPLED, prefixes, prop.tokens, prop.probs, strict=True)
    ):
        if p.is_greedy:
            assert probs is None and tokens == hf_greedy(hf, prefix, K)
            continue
        assert probs is not None and probs.dtype == torch.float32 and probs.shape == (K, V)
        torch.testing.assert_close(probs.sum(-1), torch.ones(K))
        assert all(probs[j, t] > 0 for j, t in enumerate(tokens)), (i, tokens)
        if p.top_k > 0:
            assert int((probs > 0).sum(-1).max()) <= p.top_k
        # each row is the model's distribution after the tokens drawn before it (no penalties)
        plain = SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                               min_p=p.min_p, logit_bias=p.logit_bias)  # fmt: skip
        row = SamplingInputs(plain, [], [], frozenset())
        for j in range(K):
            x = ref.process(hf_logits(hf, prefix + tokens[:j])[None], [row])
            want = ref.probs(x, [row])[0]
            torch.testing.assert_close(probs[j], want / want.sum(), atol=1e-4, rtol=1e-3)


def test_vocab_mismatch_tp_and_bad_inputs_are_refused(
    draft_model: tuple[Path, Any], tmp_path: Path
) -> None:
    folder, _ = draft_model
    config = engine_config(folder, 1)
    table = ReqToTokenPool(8, CTX, CPU)
    with pytest.raises(ValueError, match=rf"vocab_size {V}.*target model has {V + 1}"):
        DraftRunner.build(config, folder, CPU, torch.float32, table, 1, 256,
                          target_vocab_size=V + 1)  # fmt: skip
    with pytest.raises(ValueError, match="tp_size=2"):
        DraftRunner.build(config, folder, CPU, torch.float32, table, 1, 256,
                          SimpleNamespace(size=2), target_vocab_size=V)  # fmt: skip
    short = tmp_path / "short"
    save_llama(short, V, seed=3, context=32)
    with pytest.raises(ValueError, match="max_position_embeddings 32"):
        build(config, short, table, 256)
    draft = build(config, folder, table, 256)
    reqs = make_reqs(table, PageAllocator(256, 1, CPU))
    rows = greedy_rows(reqs)
    with pytest.raises(ValueError, match="k >= 1"):
        draft.propose(reqs, 0, rows)
    reqs[1].draft_len = reqs[1].seq_len
    with pytest.raises(ValueError, match="draft_len 15 must be in"):
        draft.propose(reqs, K, rows)
    reqs[1].draft_len = 0
    with pytest.raises(
        ValueError, match=r"request r1 \(table row \d+\): no KV slot .* position 40,"
    ):
        draft.propose(reqs, 41 - reqs[1].seq_len + 1, rows)  # position 40 has no slot


def test_dummy_draft_and_bytes_per_slot(draft_model: tuple[Path, Any]) -> None:
    folder, _ = draft_model
    config = engine_config(folder, 1, load_format="dummy", kv_cache_dtype="auto")
    table = ReqToTokenPool(8, CTX, CPU)
    draft = build(config, folder, table, 256)
    _, hf_config = read_draft_hf_config(config, str(folder))
    per_slot = DraftRunner.bytes_per_slot(config, hf_config, None)
    assert per_slot == 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 kv heads of 16, float32
    used = sum(t.numel() * t.element_size() for t in (*draft.pool.k, *draft.pool.v))
    assert used == per_slot * 256
    reqs = make_reqs(table, PageAllocator(256, 1, CPU))
    catch_up(draft, table, reqs)
    prop = draft.propose(reqs, 2, greedy_rows(reqs))
    assert all(len(t) == 2 and all(0 <= x < V for x in t) for t in prop.tokens)


def recompute_greedy(model: Any, ids: list[int], k: int) -> list[int]:
    """k greedy tokens of a weft model, each from a full forward over the whole sequence (fresh
    KV every time)."""
    from weft.runtime.executor.attention import create_attention_backend
    from weft.runtime.executor.memory import KVPool

    layer = model.layers[0].self_attn
    out: list[int] = []
    for _ in range(k):
        seq = ids + out
        n = len(seq)
        pool = KVPool(n + 1, len(model.layers), layer.num_kv_heads, layer.head_dim,
                      torch.float32, CPU)  # fmt: skip
        table = ReqToTokenPool(1, n, CPU)
        table.table[0] = torch.arange(1, n + 1)
        attn = create_attention_backend("torch", "cpu", pool, table.table, 1)
        fb = ForwardBatch(ForwardMode.EXTEND, torch.tensor(seq), torch.arange(n),
                          torch.arange(1, n + 1), torch.tensor([0]), torch.tensor([n]),
                          torch.tensor([n]), [n], [n])  # fmt: skip
        attn.prepare(fb)
        with torch.no_grad():
            out.append(int(model.compute_logits(model(fb, attn)[-1:])[0, :V].argmax()))
    return out


def test_gguf_draft_keeps_its_blocks(tmp_path: Path) -> None:
    """quantization='gguf' with dummy weights: the draft holds random Q4_K_M-layout blocks (the
    quant hook, as the target would) and proposes its own greedy tokens."""
    from weft.runtime.models.quant import quantized_layers

    folder = tmp_path / "qwen"
    folder.mkdir()
    qwen = transformers.Qwen2Config(vocab_size=V, hidden_size=256, intermediate_size=512,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=256,
                                    architectures=["Qwen2ForCausalLM"])  # fmt: skip
    qwen.save_pretrained(folder)
    config = engine_config(folder, 1, load_format="dummy", quantization="gguf")
    table = ReqToTokenPool(8, CTX, CPU)
    draft = build(config, folder, table, 256)
    assert quantized_layers(draft.model)
    reqs = make_reqs(table, PageAllocator(256, 1, CPU))
    catch_up(draft, table, reqs)
    prop = draft.propose(reqs, 3, greedy_rows(reqs))
    for req, tokens in zip(reqs, prop.tokens, strict=True):
        assert tokens == recompute_greedy(draft.model, req.fill_ids, 3), req.rid
