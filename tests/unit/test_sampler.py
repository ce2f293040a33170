"""Sampler: argmax, truncation support, temperature statistics, penalties, masks, seeds."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weft.runtime.executor import sampler as sampler_module
from weft.runtime.executor.sampler import Sampler, SamplingInputs, make_generator
from weft.runtime.sampling_params import SamplingParams


def row(prompt=(), output=(), stop_ids=(), seed=None, **params) -> SamplingInputs:
    generator = None if seed is None else make_generator(seed, "cpu")
    return SamplingInputs(
        SamplingParams(**params), list(prompt), list(output), frozenset(stop_ids), generator
    )


def draws(logits_1d: torch.Tensor, n: int, seed: int = 0, **params) -> torch.Tensor:
    """n independent draws for one logits row (a batch of n identical rows)."""
    sampler = Sampler(logits_1d.shape[0], "cpu", seed=seed)
    return sampler(logits_1d.expand(n, -1), [row(**params) for _ in range(n)]).next_ids


# probabilities 0.3 .25 .2 .1 .08 .05 .02, scattered over a vocabulary of 10 (3 tokens at -inf)
PROBS = torch.tensor([0.3, 0.25, 0.2, 0.1, 0.08, 0.05, 0.02], dtype=torch.float64)
PLACE = [6, 2, 9, 0, 4, 7, 1]  # token id of each probability above


def crafted_logits() -> torch.Tensor:
    logits = torch.full((10,), float("-inf"))
    logits[PLACE] = PROBS.log().float()
    return logits


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(16, 100)
    out = Sampler(100, "cpu")(logits, [row(temperature=0.0) for _ in range(16)])
    assert out.next_ids.dtype == torch.int64
    assert torch.equal(out.next_ids, logits.argmax(-1))
    assert out.logprobs is None
    bf16 = logits.bfloat16()
    out = Sampler(100, "cpu")(bf16, [row(temperature=1e-7) for _ in range(16)])
    assert torch.equal(out.next_ids, bf16.float().argmax(-1))


def test_top_k_1_is_greedy():
    torch.manual_seed(1)
    logits = torch.randn(32, 50)
    rows = [row(temperature=2.0, top_k=1, seed=i if i % 2 else None) for i in range(32)]
    assert torch.equal(Sampler(50, "cpu")(logits, rows).next_ids, logits.argmax(-1))


@pytest.mark.parametrize(
    ("params", "kept"),
    [
        ({"top_k": 3}, 3),
        ({"top_k": 3, "temperature": 5.0}, 3),
        ({"top_p": 0.5}, 2),  # mass before each: 0 .3 .55 -> keep 2
        ({"top_p": 0.6}, 3),  # .55 < .6 -> keep 3
        ({"top_p": 0.01}, 1),  # the top token always stays
        ({"min_p": 0.5}, 3),  # p >= .15
        ({"min_p": 0.3}, 4),  # p >= .09
        ({"min_p": 1.0}, 1),
        # top-p runs on the renormalized top-k mass: .3 .25 .2 .1 /.85 -> before: 0 .35 .65 .88
        ({"top_k": 4, "top_p": 0.8}, 3),
        ({"top_k": 5, "min_p": 0.3}, 4),
        ({"top_p": 0.9, "min_p": 0.5}, 3),
        ({}, 7),
    ],
)
def test_truncation_support(params, kept):
    ids = draws(crafted_logits(), 2000, seed=3, **params)
    # support is exactly the `kept` most likely tokens: never a truncated one, and all kept ones
    assert set(ids.tolist()) == set(PLACE[:kept])


def test_truncated_rows_do_not_truncate_their_neighbours():
    logits = crafted_logits().expand(1001, -1)
    rows = [row(top_k=2)] + [row() for _ in range(1000)]
    ids = Sampler(10, "cpu", seed=5)(logits, rows).next_ids
    assert ids[0].item() in PLACE[:2]
    assert set(ids[1:].tolist()) == set(PLACE)


@pytest.mark.parametrize("window", [1, 2, 5])
def test_top_p_window_gives_the_full_sort_result(window):
    torch.manual_seed(7)
    logits = torch.randn(96, 60) * 2
    configs: list[dict[str, Any]] = [
        {"top_p": 0.3},
        {"top_p": 0.97},
        {"top_p": 0.8, "top_k": 7},
        {"top_k": 3},
        {},
    ]
    rows = [row(seed=i, **configs[i % len(configs)]) for i in range(96)]
    full = Sampler(60, "cpu")(logits, rows).next_ids
    rows = [row(seed=i, **configs[i % len(configs)]) for i in range(96)]
    with mock.patch.object(sampler_module, "TOP_P_WINDOW", window):
        assert torch.equal(Sampler(60, "cpu")(logits, rows).next_ids, full)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_frequencies_match_softmax(temperature):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    n = 10_000
    counts = torch.bincount(draws(logits, n, seed=11, temperature=temperature), minlength=6)
    expected = torch.softmax(logits.double() / temperature, -1) * n
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 25.0, (chi2, counts, expected)  # df=5: p(chi2 > 25) ~ 1e-4; seed is fixed


LOGITS6 = [2.0, -1.0, 0.5, -2.0, 1.0, 3.0]


@pytest.mark.parametrize(
    ("inputs", "expected"),
    [
        # HF repetition penalty over prompt + output: positive / p, negative * p
        (
            {"prompt": [0, 1], "output": [1, 3], "repetition_penalty": 2.0},
            [1.0, -2.0, 0.5, -4.0, 1.0, 3.0],
        ),
        ({"prompt": [5], "output": [], "repetition_penalty": 0.5}, [2, -1, 0.5, -2, 1, 6.0]),
        # frequency: -f * count over the output only
        (
            {"prompt": [0], "output": [1, 1, 4], "frequency_penalty": 0.5},
            [2.0, -2.0, 0.5, -2.0, 0.5, 3.0],
        ),
        ({"output": [2, 2, 2], "frequency_penalty": -1.0}, [2, -1, 3.5, -2, 1, 3]),
        # presence: -p once a token has appeared in the output
        (
            {"prompt": [0], "output": [1, 1, 4], "presence_penalty": 0.5},
            [2.0, -1.5, 0.5, -2.0, 0.5, 3.0],
        ),
        # all three, in order: repetition, then frequency, then presence
        (
            {
                "prompt": [5],
                "output": [0, 0, 3],
                "repetition_penalty": 2.0,
                "frequency_penalty": 0.25,
                "presence_penalty": 1.0,
            },
            [2 / 2 - 0.5 - 1, -1.0, 0.5, -2 * 2 - 0.25 - 1, 1.0, 1.5],
        ),
    ],
)
def test_penalties_against_hand_computed_logits(inputs, expected):
    sampler = Sampler(6, "cpu")
    logits = torch.tensor([LOGITS6, LOGITS6])
    plain = row(prompt=inputs.get("prompt", ()), output=inputs.get("output", ()))
    out = sampler.process(logits, [row(**inputs), plain])
    torch.testing.assert_close(out[0], torch.tensor(expected, dtype=torch.float32))
    torch.testing.assert_close(out[1], logits[1])  # a row without penalties is untouched
    assert logits.tolist() == [LOGITS6, LOGITS6]  # the caller's logits are never modified


def test_logit_bias_forces_and_bans():
    torch.manual_seed(2)
    logits = torch.randn(64, 30)
    rows = [row(logit_bias={7: 100.0}, seed=i) for i in range(64)]
    assert Sampler(30, "cpu")(logits, rows).next_ids.tolist() == [7] * 64
    top = logits[0].argmax().item()
    banned = Sampler(30, "cpu")(logits[:1], [row(temperature=0, logit_bias={top: -100.0})])
    assert banned.next_ids.item() == logits[0].topk(2).indices[1].item()


def test_min_new_tokens_masks_stop_ids():
    logits = torch.tensor([[0.0, 10.0, 9.0, 1.0, 0.0]]).expand(5, -1)
    eos, stop = {1}, {1, 2}
    rows = [
        row(output=[3], stop_ids=eos, temperature=0, min_new_tokens=2),  # 1 < 2: EOS masked
        row(output=[3, 3], stop_ids=eos, temperature=0, min_new_tokens=2),  # reached: EOS wins
        row(output=[], stop_ids=stop, temperature=0, min_new_tokens=1),  # stop ids masked too
        row(stop_ids=eos, temperature=0, min_new_tokens=1, ignore_eos=True, logit_bias={1: 50.0}),
        row(output=[3], stop_ids=eos, min_new_tokens=3, top_k=2, seed=4),  # sampled: 2 or 3
    ]
    out = Sampler(5, "cpu")(logits, rows, want_logprobs=True)
    assert out.next_ids.tolist()[:4] == [2, 1, 3, 2]
    assert out.next_ids[4].item() in (2, 3)
    assert out.logprobs is not None and out.logprobs[0, 1].item() == float("-inf")


def test_padded_vocab_columns_never_chosen():
    torch.manual_seed(3)
    logits = torch.randn(8, 24)
    logits[:, 20:] = 1e4  # columns past the tokenizer vocabulary
    rows = [row(temperature=0.0)] * 4 + [row(temperature=5.0, seed=i) for i in range(4)]
    out = Sampler(20, "cpu")(logits, rows, want_logprobs=True)
    assert (out.next_ids < 20).all()
    assert torch.equal(out.next_ids[:4], logits[:4, :20].argmax(-1))
    assert out.logprobs is not None and out.logprobs.shape == (8, 20)
    greedy_only = Sampler(20, "cpu")(logits, [row(temperature=0.0)] * 8)  # the fast path
    assert (greedy_only.next_ids < 20).all()


MINE: dict[str, Any] = {"temperature": 1.3, "top_p": 0.95}


def _seeded_run(
    seed: int, position: int, others: list[dict[str, Any]], mine: dict[str, Any] = MINE
) -> list[int]:
    """Tokens that a request with `seed` gets at `position` among `others`, step by step."""
    sampler = Sampler(40, "cpu", seed=99)
    torch.manual_seed(4)
    steps = 12
    logit_steps = torch.randn(steps, 40) * 2
    generator = make_generator(seed, "cpu")
    neighbours = [row(**o) for o in others]
    tokens: list[int] = []
    for step in range(steps):
        me = SamplingInputs(SamplingParams(**mine), [1], tokens, frozenset(), generator)
        batch = neighbours[:position] + [me] + neighbours[position:]
        logits = torch.randn(len(batch), 40)
        logits[position] = logit_steps[step]
        tokens.append(int(sampler(logits, batch).next_ids[position]))
    return tokens


@pytest.mark.parametrize("mine", [MINE, {"top_k": 5}, {"min_p": 0.1, "repetition_penalty": 1.2}])
def test_same_seed_same_tokens_whatever_the_batch(mine):
    alone = _seeded_run(1234, 0, [], mine)
    others: list[dict[str, Any]] = [
        {"temperature": 0.0},
        {"top_k": 3},
        {"seed": 7, "min_p": 0.2},
        {},
        {"repetition_penalty": 1.5, "output": [1, 2]},
        {"logit_bias": {3: 5.0}, "top_p": 0.3},
    ]
    assert _seeded_run(1234, 3, others, mine) == alone
    assert _seeded_run(1234, 6, others, mine) == alone
    assert _seeded_run(1234, 1, others[:2], mine) == alone
    assert len(set(alone)) > 1


def test_different_seeds_differ_and_engine_seed_is_deterministic():
    assert _seeded_run(1, 0, []) != _seeded_run(2, 0, [])
    torch.manual_seed(5)
    logits = torch.randn(50, 40)
    rows = [row(temperature=1.0) for _ in range(50)]
    first = Sampler(40, "cpu", seed=8)(logits, rows).next_ids
    assert torch.equal(first, Sampler(40, "cpu", seed=8)(logits, rows).next_ids)
    assert not torch.equal(first, Sampler(40, "cpu", seed=9)(logits, rows).next_ids)


def test_logits_in_the_model_dtype_sample_as_their_float32_copy():
    """The LM head returns logits in the model's dtype (bf16 on CUDA): every path (greedy fast
    path, penalties, bias, seeded draws, logprobs) gives what the float32 copy gives."""
    torch.manual_seed(7)
    bf16 = (torch.randn(5, 40) * 3).bfloat16()

    def rows() -> list[SamplingInputs]:
        return [
            row(temperature=0.0),
            row(temperature=0.7, seed=3),
            row(logit_bias={5: 4.0}, repetition_penalty=1.3, prompt=[1, 2], output=[5]),
            row(temperature=1.5, top_p=0.5, seed=9),
            row(top_k=1, presence_penalty=0.5, output=[3]),
        ]

    for n in (1, 5):
        got = Sampler(40, "cpu", seed=2)(bf16[:n], rows()[:n], want_logprobs=True)
        want = Sampler(40, "cpu", seed=2)(bf16[:n].float(), rows()[:n], want_logprobs=True)
        assert torch.equal(got.next_ids, want.next_ids)
        assert got.logprobs is not None and got.logprobs.dtype == torch.float32
        torch.testing.assert_close(got.logprobs, want.logprobs)


def test_logprobs_are_normalized_and_untruncated():
    torch.manual_seed(6)
    logits = torch.randn(4, 30)
    rows = [
        row(temperature=0.0),
        row(temperature=0.5, top_k=1),
        row(temperature=2.0, top_p=0.2, min_p=0.5, seed=1),
        row(logit_bias={4: 3.0}, frequency_penalty=1.0, output=[4, 4]),
    ]
    sampler = Sampler(30, "cpu")
    out = sampler(logits, rows, want_logprobs=True)
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs.logsumexp(-1), torch.zeros(4), atol=1e-5, rtol=0)
    x = sampler.process(logits, rows)
    temps = torch.tensor([1.0, 0.5, 2.0, 1.0]).unsqueeze(1)
    torch.testing.assert_close(out.logprobs, torch.log_softmax(x / temps, -1))
    assert torch.isfinite(out.logprobs).all()  # before truncation: every token has mass
    fast = sampler(logits[:1], rows[:1], want_logprobs=True).logprobs
    assert fast is not None
    torch.testing.assert_close(fast[0], torch.log_softmax(logits[0], -1))


def _allowed(logits: list[float], p: SamplingParams) -> set[int]:
    """Reference support in float64, lenient at the float32 boundaries (a superset)."""
    lg = torch.tensor(logits, dtype=torch.float64)
    if p.is_greedy or p.top_k == 1:
        return {int(lg.argmax())}
    probs = torch.softmax(lg / p.temperature, -1)
    order = probs.argsort(descending=True).tolist()
    k = len(order) if p.top_k == -1 else min(p.top_k, len(order))
    kept = order[:k]
    mass = sum(probs[i].item() for i in kept)
    before, allowed = 0.0, []
    for i in kept:
        if p.top_p >= 1.0 or before < p.top_p * mass + 1e-5:
            allowed.append(i)
        before += probs[i].item()
    top = probs[order[0]].item()
    return {i for i in allowed if probs[i].item() >= p.min_p * top * (1 - 1e-4)}


row_params = st.fixed_dictionaries(
    {
        "temperature": st.one_of(st.just(0.0), st.floats(0.05, 3.0), st.floats(0.7, 1.5)),
        "top_k": st.one_of(st.just(-1), st.integers(1, 5), st.integers(1, 45)),
        "top_p": st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
        "min_p": st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
        "sampling_seed": st.one_of(st.none(), st.integers(0, 2**32)),
    }
)


@settings(max_examples=150, deadline=None)
@given(
    vocab=st.integers(2, 40),
    data=st.data(),
    params=st.lists(row_params, min_size=1, max_size=8),
    engine_seed=st.integers(0, 1000),
    window=st.sampled_from([1, 3, 1024]),  # top-p's first look; 1024: the whole vocabulary
)
def test_sampled_id_always_in_allowed_support(vocab, data, params, engine_seed, window):
    copies = 16  # each row drawn 16 times in one batch, so a leak past a cut-off shows
    rows, all_logits, allowed = [], [], []
    for kw in params:
        steps = data.draw(
            st.lists(st.integers(-40, 40), min_size=vocab, max_size=vocab, unique=True)
        )
        logits = [s * 0.25 for s in steps]  # distinct logits: no ties at the cut-offs
        p = SamplingParams(**kw)
        for j in range(copies):
            seed = p.sampling_seed
            generator = None if seed is None else make_generator(seed + j, "cpu")
            rows.append(SamplingInputs(p, [], [], frozenset(), generator))
            all_logits.append(logits)
        allowed.append(_allowed(logits, p))
    with mock.patch.object(sampler_module, "TOP_P_WINDOW", window):
        out = Sampler(vocab, "cpu", seed=engine_seed)(torch.tensor(all_logits), rows)
    for i, token in enumerate(out.next_ids.tolist()):
        assert token in allowed[i // copies]


def test_penalty_inputs_may_be_lists_tuples_or_tensors():
    sampler = Sampler(6, "cpu")
    logits = torch.tensor([LOGITS6] * 3)
    kw = {"repetition_penalty": 1.5, "frequency_penalty": 0.3, "presence_penalty": 0.2}
    rows = [
        row(prompt=[0, 5], output=[1, 1, 4], **kw),
        SamplingInputs(SamplingParams(**kw), (0, 5), (1, 1, 4), frozenset(), None),
        SamplingInputs(
            SamplingParams(**kw), torch.tensor([0, 5]), torch.tensor([1, 1, 4]), frozenset(), None
        ),
    ]
    out = sampler.process(logits, rows)
    torch.testing.assert_close(out[1], out[0])
    torch.testing.assert_close(out[2], out[0])
