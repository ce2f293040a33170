"""verify_drafts on CUDA: greedy equal to the CUDA Sampler row by row, rejection sampling's
output distribution (chi-square), seeded rows, and its time at real vocabulary sizes (printed,
with -s). Skipped without CUDA."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from weft.runtime.executor.sampler import Sampler, SamplingInputs, make_generator
from weft.runtime.executor.spec_verify import verify_drafts
from weft.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda"


def request_rows(
    params: SamplingParams,
    drafts: Sequence[int],
    output: Sequence[int] = (),
    generator: torch.Generator | None = None,
) -> list[SamplingInputs]:
    """The d+1 verify rows of one request: row j sees output + drafts[:j]."""
    return [
        SamplingInputs(params, [1, 2], [*output, *drafts[:j]], frozenset({0}), generator)
        for j in range(len(drafts) + 1)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_equals_the_cuda_sampler_row_by_row(dtype: torch.dtype) -> None:
    V = 1000
    configs: list[dict[str, Any]] = [
        {"temperature": 0.0},
        {"temperature": 0.0, "repetition_penalty": 1.5, "frequency_penalty": 0.5},
        {"temperature": 0.0, "logit_bias": {7: 2.0}, "min_new_tokens": 3},
        {"top_k": 1, "temperature": 0.9},
        {"temperature": 1.0, "top_p": 0.9},  # a sampled neighbour: only its shape is checked
    ]
    rng = random.Random(0)
    torch.manual_seed(0)
    reference = Sampler(V, DEV)
    parts, rows, counts, drafts, expected = [], [], [], [], []
    for i in range(40):
        params = SamplingParams(**configs[i % len(configs)])
        d = rng.randrange(0, 6)
        logits = (torch.randn(d + 1, V + 24, device=DEV) * 3).to(dtype)
        logits[:, 0] += 4.0  # the stop id is often the argmax: the min_new_tokens mask shows
        draft: list[int] = []
        targets: list[int] = []
        for j in range(d + 1):
            r = request_rows(params, draft, [5])[j]
            targets.append(int(reference(logits[j : j + 1], [r]).next_ids[0]))
            if j < d:
                draft.append(targets[j] if rng.random() < 0.75 else rng.randrange(V))
        a = next((j for j in range(d) if draft[j] != targets[j]), d)
        parts.append(logits)
        rows += request_rows(params, draft, [5])
        counts.append(d + 1)
        drafts.append(draft)
        expected.append(None if i % len(configs) == 4 else targets[: a + 1])
    out = verify_drafts(Sampler(V, DEV), torch.cat(parts), rows, counts, drafts, [None] * 40)
    for i, want in enumerate(expected):
        assert out.tokens[i][:-1] == drafts[i][: out.accepted[i]]
        if want is not None:
            assert out.tokens[i] == want, (i, drafts[i])


def _chi2_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    obs, exp = observed.flatten().double().cpu(), probs.flatten().cpu() * observed.sum().item()
    assert obs[exp == 0].sum() == 0, "a token outside the target's support was emitted"
    keep = exp >= 5
    obs = torch.cat([obs[keep], obs[~keep].sum(0, keepdim=True)])
    exp = torch.cat([exp[keep], exp[~keep].sum(0, keepdim=True)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    chi2 = (((obs - exp) ** 2) / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2.0), chi2 / 2))


def _ref_dist(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    probs = torch.softmax(logits.double().cpu() / p.temperature, -1)
    vals, ids = probs.sort(-1, descending=True)
    vals = vals.masked_fill(torch.arange(probs.shape[-1]) >= (p.top_k % 10_000), 0.0)
    vals = vals.masked_fill(vals.cumsum(-1) - vals >= p.top_p * vals.sum(-1, keepdim=True), 0.0)
    kept = torch.zeros_like(probs).scatter(-1, ids, vals)
    return kept / kept.sum(-1, keepdim=True)


@pytest.mark.parametrize(
    "params", [SamplingParams(), SamplingParams(temperature=0.7, top_k=4, top_p=0.9)]
)
def test_first_token_follows_the_target_on_cuda(params: SamplingParams) -> None:
    """20k requests with 2 draft-model drafts each; the first emitted token is distributed as p0,
    the second (when the call emitted one) as p(. | first)."""
    V, n = 6, 20_000
    g = torch.Generator().manual_seed(3)
    l0, lt = torch.randn(V, generator=g), torch.randn(V, V, generator=g)
    q0 = torch.softmax(torch.randn(V, generator=g) * 1.2, -1)
    qt = torch.softmax(torch.randn(V, V, generator=g) * 1.2, -1)
    x0 = torch.multinomial(q0, n, replacement=True, generator=g)
    x1 = torch.multinomial(qt[x0], 1, generator=g)[:, 0]
    drafts = torch.stack([x0, x1], 1).tolist()
    probs: list[torch.Tensor | None] = list(torch.stack([q0.expand(n, V), qt[x0]], 1).to(DEV))
    logits = torch.stack([l0.expand(n, V), lt[x0], lt[x1]], 1).reshape(-1, V).to(DEV)
    rows = [r for d in drafts for r in request_rows(params, d)]
    out = verify_drafts(Sampler(V, DEV, seed=11), logits, rows, [3] * n, drafts, probs)
    first = torch.tensor([t[0] for t in out.tokens])
    assert _chi2_pvalue(torch.bincount(first, minlength=V), _ref_dist(l0, params)) > 1e-4
    pairs = torch.zeros(V, V, dtype=torch.int64)
    for t in out.tokens:
        if len(t) > 1:
            pairs[t[0], t[1]] += 1
    for a in range(V):  # the second token given the first: p(. | a), from the bonus/corrections
        if pairs[a].sum() >= 200:
            assert _chi2_pvalue(pairs[a], _ref_dist(lt[a], params)) > 1e-4, a


def test_seeded_request_is_reproducible_among_others_on_cuda() -> None:
    V = 500
    torch.manual_seed(5)
    mine_logits = torch.randn(4, V, device=DEV)
    q = torch.softmax(mine_logits[:3] + torch.randn(3, V, device=DEV), -1)
    drafts = mine_logits[:3].argmax(-1).tolist()
    params = SamplingParams(temperature=1.2, top_p=0.95)

    def run(position: int, others: int) -> list[int]:
        parts, rows, counts, all_drafts, probs = [], [], [], [], []
        for i in range(others):
            d = torch.randint(0, V, (i % 5,)).tolist()
            p = SamplingParams(temperature=0.0 if i % 4 == 0 else 0.8)
            gen = make_generator(i, DEV) if i % 3 == 1 else None
            parts.append(torch.randn(len(d) + 1, V, device=DEV))
            rows.append(request_rows(p, d, generator=gen))
            counts.append(len(d) + 1)
            all_drafts.append(d)
            probs.append(torch.softmax(torch.randn(len(d), V, device=DEV), -1) if i % 2 else None)
        mine = (mine_logits, request_rows(params, drafts, generator=make_generator(42, DEV)))
        parts.insert(position, mine[0])
        rows.insert(position, mine[1])
        counts.insert(position, 4)
        all_drafts.insert(position, drafts)
        probs.insert(position, q)
        flat = [r for rs in rows for r in rs]
        sampler = Sampler(V, DEV, seed=position + others)
        out = verify_drafts(sampler, torch.cat(parts), flat, counts, all_drafts, probs)
        return out.tokens[position]

    alone = run(0, 0)
    assert run(4, 9) == alone and run(9, 9) == alone and run(0, 30) == alone


def _median_ms(fn: Callable[[], object], repeat: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _time_case(vocab: int, bs: int, k: int, mode: str) -> tuple[float, float]:
    """(ms of one plain sampling step of bs rows, ms of verify_drafts over bs x (k+1) rows)."""
    params = (
        SamplingParams(temperature=0.0)
        if mode == "greedy"
        else SamplingParams(temperature=0.8, top_p=0.9)
    )
    logits = (torch.randn(bs * (k + 1), vocab + 128, device=DEV) * 3).bfloat16()
    drafts = torch.randint(0, vocab, (bs, k)).tolist()
    probs: list[torch.Tensor | None] = [
        torch.softmax(torch.randn(k, vocab, device=DEV), -1) if mode == "q" else None
        for _ in range(bs)
    ]
    rows = [r for d in drafts for r in request_rows(params, d)]
    one = [request_rows(params, [])[0] for _ in range(bs)]
    sampler = Sampler(vocab, DEV)
    plain = _median_ms(lambda: sampler(logits[:bs], one).next_ids.tolist())
    spec = _median_ms(lambda: verify_drafts(sampler, logits, rows, [k + 1] * bs, drafts, probs))
    out = verify_drafts(sampler, logits, rows, [k + 1] * bs, drafts, probs)
    assert all(1 <= len(t) <= k + 1 for t in out.tokens)
    return plain, spec


@pytest.mark.parametrize("vocab", [151_936])
def test_verify_time_at_real_shapes(vocab: int) -> None:
    """Per batch size: one plain sampling step of bs rows against verify_drafts over bs x (k+1)
    rows (k = 4), greedy / sampled with one-hot drafts / sampled with a draft model's q; the
    time of each call includes the host's wait for its tokens."""
    k = 4
    print(f"\nvocab {vocab}, k={k}: median ms (sampling includes its .tolist())")
    print(f"{'bs':>4} {'mode':>10} {'sample bs':>10} {'verify':>8}")
    for bs in (1, 8, 32, 64):
        for mode in ("greedy", "one-hot", "q"):
            plain, spec = _time_case(vocab, bs, k, mode)
            print(f"{bs:>4} {mode:>10} {plain:>10.3f} {spec:>8.3f}")
