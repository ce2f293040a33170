"""verify_drafts: greedy equality with the Sampler, rejection sampling's output distribution
(chi-square, with negative controls), seeded reproducibility, edge cases and input checks."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any
from unittest import mock

import pytest
import torch

from weft.runtime.executor import spec_verify
from weft.runtime.executor.sampler import Sampler, SamplingInputs, make_generator
from weft.runtime.executor.spec_verify import VerifyOutput, verify_drafts
from weft.runtime.sampling_params import SamplingParams


def request_rows(
    params: SamplingParams,
    drafts: Sequence[int],
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    stop_ids: frozenset[int] = frozenset(),
    generator: torch.Generator | None = None,
) -> list[SamplingInputs]:
    """The d+1 verify rows of one request: row j sees output + drafts[:j]."""
    return [
        SamplingInputs(params, list(prompt), [*output, *drafts[:j]], stop_ids, generator)
        for j in range(len(drafts) + 1)
    ]


# ---------------------------------------------------------------- greedy: equal to the Sampler

GREEDY_CONFIGS: list[dict[str, Any]] = [
    {"temperature": 0.0},
    {"temperature": 0.0, "repetition_penalty": 1.6},
    {"temperature": 0.0, "frequency_penalty": 0.9, "presence_penalty": 0.5},
    {"temperature": 0.0, "logit_bias": {3: 1.5, 5: -2.0}},
    {"temperature": 0.0, "min_new_tokens": 4},  # stop ids masked for the first rows only
    {"temperature": 0.8, "top_k": 1, "presence_penalty": 1.0},  # top_k=1 is greedy
]
V_GREEDY = 12
STOP = frozenset({0, 1})


def _greedy_case(seed: int, with_sampled: bool) -> tuple[Any, ...]:
    """Requests whose drafts follow the row-by-row Sampler's tokens with probability 0.7."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    reference = Sampler(V_GREEDY, "cpu")
    logits_parts, rows, counts, drafts, expected = [], [], [], [], []
    for i in range(30):
        params = SamplingParams(**GREEDY_CONFIGS[i % len(GREEDY_CONFIGS)])
        prompt = [rng.randrange(V_GREEDY) for _ in range(rng.randrange(1, 5))]
        output = [rng.randrange(2, V_GREEDY) for _ in range(rng.randrange(0, 3))]
        d = rng.randrange(0, 5)
        logits = torch.randn(d + 1, V_GREEDY) * 2
        logits[:, :2] += 2.0  # the stop ids are often the argmax: the min_new_tokens mask shows
        draft: list[int] = []
        targets: list[int] = []
        for j in range(d + 1):  # the Sampler row by row, on the context the drafts make
            (r,) = request_rows(params, draft, prompt, output, STOP)[j:]
            targets.append(int(reference(logits[j : j + 1], [r]).next_ids[0]))
            if j < d:
                follow = rng.random() < 0.7
                draft.append(targets[j] if follow else rng.randrange(V_GREEDY))
        a = next((j for j in range(d) if draft[j] != targets[j]), d)
        logits_parts.append(logits)
        rows += request_rows(params, draft, prompt, output, STOP)
        counts.append(d + 1)
        drafts.append(draft)
        expected.append(targets[: a + 1])
        if with_sampled and i % 3 == 0:  # a sampled neighbour with drafts of its own
            sp = SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.2)
            nd = [rng.randrange(V_GREEDY) for _ in range(rng.randrange(0, 4))]
            logits_parts.append(torch.randn(len(nd) + 1, V_GREEDY))
            rows += request_rows(sp, nd, prompt, output, STOP)
            counts.append(len(nd) + 1)
            drafts.append(nd)
            expected.append(None)
    return torch.cat(logits_parts), rows, counts, drafts, expected


@pytest.mark.parametrize("with_sampled", [False, True])
def test_greedy_equals_the_sampler_row_by_row(with_sampled):
    for seed in range(4):
        logits, rows, counts, drafts, expected = _greedy_case(seed, with_sampled)
        probs: list[torch.Tensor | None] = [None] * len(counts)
        out = verify_drafts(Sampler(V_GREEDY, "cpu"), logits, rows, counts, drafts, probs)
        partial = 0
        for i, want in enumerate(expected):
            assert out.accepted[i] == len(out.tokens[i]) - 1
            assert out.tokens[i][:-1] == drafts[i][: out.accepted[i]]
            if want is not None:
                assert out.tokens[i] == want, (seed, i, drafts[i])
                partial += 0 < out.accepted[i] < len(drafts[i])
        assert partial > 0  # some requests stop inside their drafts


def test_greedy_logprobs_and_model_dtype():
    logits, rows, counts, drafts, expected = _greedy_case(7, with_sampled=True)
    probs: list[torch.Tensor | None] = [None] * len(counts)
    out = verify_drafts(Sampler(V_GREEDY, "cpu"), logits, rows, counts, drafts, probs, True)
    want = Sampler(V_GREEDY, "cpu")(logits, rows, want_logprobs=True).logprobs
    assert out.logprobs is not None and want is not None and out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, want, rtol=0, atol=0)
    # plain greedy rows in bf16 (the fast path: argmax of the raw logits, padded columns ignored)
    bf16 = torch.cat([torch.randn(9, V_GREEDY) * 3, torch.full((9, 4), 1e4)], 1).bfloat16()
    targets = bf16[:, :V_GREEDY].float().argmax(-1).tolist()
    counts, drafts = [4, 5], [targets[:2] + [V_GREEDY - 1 - targets[2]], targets[4:8]]
    plain = [*request_rows(SamplingParams(temperature=0.0), drafts[0])]
    plain += request_rows(SamplingParams(temperature=0.0), drafts[1])
    out = verify_drafts(Sampler(V_GREEDY, "cpu"), bf16, plain, counts, drafts, [None, None], True)
    assert out.tokens == [targets[:3], targets[4:9]] and out.accepted == [2, 4]
    assert out.logprobs is not None and out.logprobs.shape == (9, V_GREEDY)


def test_no_drafts_draws_exactly_what_the_sampler_draws():
    torch.manual_seed(3)
    configs: list[dict[str, Any]] = [
        {"temperature": 0.0},
        {"temperature": 1.3, "top_p": 0.8},
        {"top_k": 5, "sampling_seed": 11},
        {"min_p": 0.1, "repetition_penalty": 1.3},
        {"temperature": 0.7, "sampling_seed": 12, "logit_bias": {2: 3.0}},
        {},
    ]
    logits = torch.randn(48, 40) * 2

    def rows() -> list[SamplingInputs]:
        out = []
        for i in range(48):
            p = SamplingParams(**configs[i % len(configs)])
            g = None if p.sampling_seed is None else make_generator(p.sampling_seed + i, "cpu")
            out.append(SamplingInputs(p, [1, 2], [3], frozenset({0}), g))
        return out

    want = Sampler(40, "cpu", seed=5)(logits, rows()).next_ids.tolist()
    got = verify_drafts(
        Sampler(40, "cpu", seed=5), logits, rows(), [1] * 48, [[]] * 48, [None] * 48
    )
    assert got.tokens == [[t] for t in want] and got.accepted == [0] * 48


# ----------------------------------------------------- sampled: the output distribution is p

V = 6
TRIALS = 20_000


def ref_dist(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """float64 [..., V]: softmax(logits / T) cut by top-k, top-p, min-p, renormalized."""
    probs = torch.softmax(logits.double() / p.temperature, -1)
    vals, ids = probs.sort(-1, descending=True)
    k = V if p.top_k == -1 else p.top_k
    vals = vals.masked_fill(torch.arange(V) >= k, 0.0)
    before = vals.cumsum(-1) - vals
    vals = vals.masked_fill(before >= p.top_p * vals.sum(-1, keepdim=True), 0.0)
    vals = vals.masked_fill(vals < p.min_p * vals[..., :1], 0.0)
    kept = torch.zeros_like(probs).scatter(-1, ids, vals)
    return kept / kept.sum(-1, keepdim=True)


def chi2_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square; cells expected below 5 are pooled; a cell of
    probability 0 that was observed fails at once."""
    obs, exp = observed.flatten().double(), expected_probs.flatten() * observed.sum()
    assert obs[exp == 0].sum() == 0, "a token outside the target's support was emitted"
    small = (exp > 0) & (exp < 5)
    obs = torch.cat([obs[exp >= 5], obs[small].sum(0, keepdim=True)])
    exp = torch.cat([exp[exp >= 5], exp[small].sum(0, keepdim=True)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    chi2 = (((obs - exp) ** 2) / exp).sum()
    df = torch.tensor(len(obs) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, chi2 / 2))


torch.manual_seed(2024)
L0 = torch.randn(V) * 0.9  # the target: first-token logits, then a Markov chain's rows
LT = torch.randn(V, V) * 0.9
Q0 = torch.softmax(torch.randn(V) * 1.2, -1)  # a draft model unlike it
QT = torch.softmax(torch.randn(V, V) * 1.2, -1)


def _emit_pairs(params: SamplingParams, draft: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TRIALS requests, 2 drafts each, in one verify call; those that emit one token get their
    second from a plain (0-draft) verify call. Returns (first tokens, pair counts [V, V])."""
    g = torch.Generator().manual_seed(seed)
    if draft == "one-hot":  # deterministic drafts (e.g. n-gram): any token, q one-hot
        x = torch.randint(0, V, (TRIALS, 2), generator=g)
        probs: list[torch.Tensor | None] = [None] * TRIALS
    else:  # a draft model: x0 ~ Q0, x1 ~ QT[x0]
        x0 = torch.multinomial(Q0, TRIALS, replacement=True, generator=g)
        x1 = torch.multinomial(QT[x0], 1, generator=g)[:, 0]
        x = torch.stack([x0, x1], 1)
        probs = list(torch.stack([Q0.expand(TRIALS, V), QT[x0]], 1))  # [TRIALS, 2, V]
    drafts = x.tolist()
    logits = torch.stack([L0.expand(TRIALS, V), LT[x[:, 0]], LT[x[:, 1]]], 1).reshape(-1, V)
    rows = [r for d in drafts for r in request_rows(params, d)]
    sampler = Sampler(V, "cpu", seed=seed + 1)  # NOTE: a stream apart from the drafts' own
    out = verify_drafts(sampler, logits, rows, [3] * TRIALS, drafts, probs)
    first = torch.tensor([t[0] for t in out.tokens])
    short = [i for i, t in enumerate(out.tokens) if len(t) == 1]
    more = verify_drafts(
        sampler,
        LT[first[short]],
        [SamplingInputs(params, [], [int(first[i])], frozenset()) for i in short],
        [1] * len(short),
        [[]] * len(short),
        [None] * len(short),
    )
    second = torch.tensor([t[1] for t in out.tokens if len(t) > 1] + [t[0] for t in more.tokens])
    order = [i for i, t in enumerate(out.tokens) if len(t) > 1] + short
    pairs = torch.zeros(V * V, dtype=torch.int64)
    pairs.index_add_(0, first[order] * V + second, torch.ones(TRIALS, dtype=torch.int64))
    return first, pairs.view(V, V)


SAMPLED_CASES = [
    (SamplingParams(), "one-hot"),
    (SamplingParams(), "draft-model"),
    (SamplingParams(temperature=0.7, top_k=4, top_p=0.9, min_p=0.05), "draft-model"),
    (SamplingParams(temperature=1.4, top_k=5, top_p=0.85), "one-hot"),
    # penalties see the drafts before each row: p(. | a) loses 1.1 on token a
    (SamplingParams(presence_penalty=0.8, frequency_penalty=0.3, min_p=0.1), "draft-model"),
]


@pytest.mark.parametrize(("params", "draft"), SAMPLED_CASES)
def test_first_token_and_pair_follow_the_target(params, draft):
    first, pairs = _emit_pairs(params, draft, seed=17)
    p0 = ref_dist(L0, params)  # [V]
    penalty = params.presence_penalty + params.frequency_penalty  # the first token is in output
    pt = ref_dist(LT - penalty * torch.eye(V), params)  # [V, V] rows: p(next | first)
    assert chi2_pvalue(torch.bincount(first, minlength=V), p0) > 1e-4
    assert chi2_pvalue(pairs, p0.unsqueeze(1) * pt) > 1e-4


def test_the_chi_square_test_can_fail():
    """Two broken verifiers fail it by far: one that accepts every draft, and one that draws
    the correction from p instead of the residual max(p - q, 0)."""
    params = SamplingParams()
    p0 = ref_dist(L0, params)
    always = mock.patch.object(spec_verify, "_accept", lambda u, p, q: torch.ones_like(u) > 0)
    with always:
        first, _ = _emit_pairs(params, "draft-model", seed=17)
    assert chi2_pvalue(torch.bincount(first, minlength=V), p0) < 1e-100
    plain_p = mock.patch.object(spec_verify, "_residual", lambda p, q: p)
    with plain_p:
        first, pairs = _emit_pairs(params, "draft-model", seed=17)
    assert chi2_pvalue(torch.bincount(first, minlength=V), p0) < 1e-8  # Q0 is near p0
    assert chi2_pvalue(pairs, p0.unsqueeze(1) * ref_dist(LT, params)) < 1e-100


# ------------------------------------------------------------------ seeds, edges, input checks

MINE = SamplingParams(temperature=1.3, top_p=0.9, sampling_seed=1)


def _mine(seed: int, logits: torch.Tensor, q: torch.Tensor) -> tuple[Any, ...]:
    drafts = torch.multinomial(q, 1, generator=torch.Generator().manual_seed(seed))[:, 0].tolist()
    rows = request_rows(MINE, drafts, [1], [2], generator=make_generator(seed, "cpu"))
    return logits, rows, len(drafts) + 1, drafts, q


def _run_with(mine: tuple[Any, ...], position: int, others: int) -> VerifyOutput:
    torch.manual_seed(position * 100 + others)
    logits, rows, counts, drafts, probs = [], [], [], [], []
    for i in range(others):
        d = [int(t) for t in torch.randint(0, 30, (i % 4,))]
        seeded = i % 3 == 2
        params = SamplingParams(temperature=0.0 if i % 3 == 0 else 1.0, top_k=-1 if i else 7)
        g = make_generator(i, "cpu") if seeded else None
        logits.append(torch.randn(len(d) + 1, 30))
        rows.append(request_rows(params, d, generator=g))
        counts.append(len(d) + 1)
        drafts.append(d)
        probs.append(torch.softmax(torch.randn(len(d), 30), -1) if i % 2 else None)
    m_logits, m_rows, m_count, m_drafts, m_probs = mine
    for lst, v in zip(
        (logits, rows, counts, drafts, probs),
        (m_logits, m_rows, m_count, m_drafts, m_probs),
        strict=True,
    ):
        lst.insert(position, v)
    flat = [r for rs in rows for r in rs]
    out = verify_drafts(
        Sampler(30, "cpu", seed=position), torch.cat(logits), flat, counts, drafts, probs
    )
    return VerifyOutput([out.tokens[position]], [out.accepted[position]], None)


def test_seeded_requests_are_reproducible_whatever_the_batch():
    results = []
    for seed in range(12):
        torch.manual_seed(50 + seed)
        logits = torch.randn(4, 30)
        q = torch.softmax(logits[:3] + torch.randn(3, 30), -1)  # a draft close to the target
        alone = _run_with(_mine(seed, logits, q), 0, 0).tokens
        for position, others in ((0, 5), (3, 7), (6, 6)):
            assert _run_with(_mine(seed, logits, q), position, others).tokens == alone
        results.append(alone[0])
    assert len({len(t) for t in results}) > 1 and len({tuple(t) for t in results}) > 6


def test_seeded_rows_leave_the_shared_generator_alone():
    sampler = Sampler(30, "cpu", seed=3)
    before = sampler.generator.get_state()
    torch.manual_seed(4)
    logits = torch.randn(4, 30)
    mine = _mine(9, logits, torch.softmax(torch.randn(3, 30), -1))
    verify_drafts(sampler, logits, mine[1], [4], [mine[3]], [mine[4]])
    assert torch.equal(sampler.generator.get_state(), before)


def test_zero_draft_probability_and_empty_residual_give_no_nan():
    # p keeps only its argmax (min_p=1); the draft names it with q = one-hot: always accepted
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.5, -1.0, 0.2]] * 2)
    params = SamplingParams(min_p=1.0)
    rows = request_rows(params, [1])
    out = verify_drafts(Sampler(V, "cpu"), logits, rows, [2], [[1]], [None])
    assert out.tokens == [[1, 1]]
    # forced to reject with p == q: the residual is all 0, so the correction falls back to p
    with mock.patch.object(spec_verify, "_accept", lambda u, p, q: torch.zeros_like(u) > 0):
        out = verify_drafts(Sampler(V, "cpu"), logits, rows, [2], [[1]], [None])
    assert out.tokens == [[1]] and out.accepted == [0]
    # q(x) == 0 at the drafted token: accepted (min(1, p/0) = 1), never NaN
    q = torch.tensor([[0.5, 0.0, 0.5, 0.0, 0.0, 0.0]])
    out = verify_drafts(
        Sampler(V, "cpu"), logits, request_rows(SamplingParams(), [1]), [2], [[1]], [q]
    )
    assert out.accepted == [1] and 0 <= out.tokens[0][1] < V
    # a draft outside the target's top-k is never accepted; the correction stays in the top-k
    n = 400
    rows = [r for _ in range(n) for r in request_rows(SamplingParams(top_k=2), [4])]
    out = verify_drafts(
        Sampler(V, "cpu"), logits.repeat(n, 1), rows, [2] * n, [[4]] * n, [None] * n
    )
    assert set(out.accepted) == {0} and {t[0] for t in out.tokens} == {1, 2}


def test_bad_inputs_are_refused():
    sampler = Sampler(V, "cpu")
    logits = torch.zeros(3, V)
    rows = request_rows(SamplingParams(), [1, 2])
    ok: dict[str, Any] = {"counts": [3], "drafts": [[1, 2]], "draft_probs": [None]}
    verify_drafts(sampler, logits, rows, **ok)
    bad: list[tuple[dict[str, Any], str]] = [
        ({"drafts": [[1, 9]]}, "draft token ids"),
        ({"draft_probs": [torch.zeros(1, V)]}, "draft_probs must be"),
        ({"draft_probs": [torch.zeros(2, V - 1)]}, "draft_probs must be"),
        ({"draft_probs": [torch.zeros(2 * V)]}, "draft_probs must be"),
        ({"draft_probs": [None, None]}, "one entry per request"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            verify_drafts(sampler, logits, rows, **{**ok, **change})
    with pytest.raises(ValueError, match="len\\(drafts\\[i\\]\\) \\+ 1"):
        verify_drafts(sampler, logits[:2], rows[:2], [2], [[1, 2]], [None])
    with pytest.raises(ValueError, match="counts sum"):
        verify_drafts(sampler, logits[:2], rows[:2], **ok)
    mixed = [*rows[:2], request_rows(SamplingParams(temperature=0.0), [1, 2])[2]]
    with pytest.raises(ValueError, match="mix greedy and sampled"):
        verify_drafts(sampler, logits, mixed, **ok)


def test_longer_draft_probs_read_only_their_first_rows_and_the_vocabulary():
    """A draft chain cut short (by a grammar, max_new_tokens) may pass the q it was drawn with
    whole; a draft model's padded vocabulary columns are ignored."""
    torch.manual_seed(8)
    logits = torch.randn(3, V)
    q = torch.softmax(torch.randn(4, V + 3), -1)
    q[:, V:] = 0.0
    rows = request_rows(SamplingParams(temperature=0.9), [2, 4])

    def run(probs: torch.Tensor) -> list[VerifyOutput]:
        sampler = Sampler(V, "cpu", seed=1)
        return [verify_drafts(sampler, logits, rows, [3], [[2, 4]], [probs]) for _ in range(40)]

    got, want = run(q), run(q[:2, :V].contiguous())
    assert [o.tokens for o in got] == [o.tokens for o in want]
    assert len({tuple(o.tokens[0]) for o in got}) > 1
