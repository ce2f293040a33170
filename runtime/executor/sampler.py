"""Sampler: a batch of logits to next-token ids (bias, penalties, temperature, truncation)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from weft.runtime.executor.transfer import to_device
from weft.runtime.sampling_params import SamplingParams

TOP_P_WINDOW = 1024  # top-p first looks for its cut among this many most likely tokens


@dataclass
class SamplingInputs:
    """One row of a batch, built by the scheduler from its request."""

    params: SamplingParams
    prompt_ids: Sequence[int]  # repetition_penalty counts prompt + output tokens (HF style)
    output_ids: Sequence[int]  # frequency/presence penalties and min_new_tokens count these
    stop_ids: frozenset[int]  # model EOS ids | params.stop_token_ids, masked until min_new_tokens
    generator: torch.Generator | None = None  # per-request RNG when sampling_seed is set
    # argmax of the raw logits, whatever the output so far (the batch fast path: one check)
    plain: bool = field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        self.plain = (
            self.picks_argmax
            and not p.logit_bias
            and not p.uses_penalties
            and not (self.stop_ids and p.min_new_tokens > 0)
        )

    @property
    def picks_argmax(self) -> bool:
        """Greedy rows and top_k=1 rows pick the argmax and draw no random numbers."""
        return self.params.is_greedy or self.params.top_k == 1

    @property
    def masks_stop_ids(self) -> bool:
        return bool(self.stop_ids) and len(self.output_ids) < self.params.min_new_tokens


@dataclass
class SampleOutput:
    next_ids: torch.Tensor  # int64 [B]
    # float32 [B, vocab_size]: log of the distribution drawn from, before top-k/top-p/min-p
    # (greedy rows: temperature 1); None unless want_logprobs
    logprobs: torch.Tensor | None


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A torch RNG on `device`, seeded (the per-request one for `sampling_seed`)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Batched sampling on the logits' device; no Python loop over the vocabulary.

    Pipeline per batch (each stage skipped when no row needs it):
      float32 copy of logits[:, :vocab_size]  (padded vocab columns never take part)
      -> logit_bias -> stop ids masked below min_new_tokens
      -> repetition penalty (prompt + output) -> frequency and presence penalties (output)
      -> logprobs (optional) -> argmax rows: argmax
      -> sampled rows: / temperature, softmax, top-k, top-p, min-p, exponential-race draw

    The draw picks argmax(p / q) with q ~ Exp(1), which samples exactly from p without
    normalizing it. Seeded rows take q from their own generator over the whole vocabulary, so a
    seeded request draws the same tokens whatever else is in the batch; unseeded rows share the
    sampler's generator (deterministic given the engine seed and the batch sequence).
    """

    def __init__(self, vocab_size: int, device: torch.device | str, seed: int = 0) -> None:
        assert vocab_size > 0, vocab_size
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = make_generator(seed, self.device)

    def __call__(
        self,
        logits: torch.Tensor,  # [B, V'] with V' >= vocab_size
        rows: Sequence[SamplingInputs],
        want_logprobs: bool = False,
    ) -> SampleOutput:
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
        assert logits.shape[1] >= self.vocab_size, (logits.shape, self.vocab_size)
        assert logits.device.type == self.device.type, (logits.device, self.device)
        if all(r.plain for r in rows) or (
            all(r.picks_argmax for r in rows) and not any(map(_needs_processing, rows))
        ):
            # fast path: argmax on the raw logits (bf16/fp16 -> fp32 is exact and monotonic)
            head = logits[:, : self.vocab_size]  # [B, V]
            logprobs = self._logprobs(head.float(), rows) if want_logprobs else None
            return SampleOutput(argmax(head), logprobs)
        x = self.process(logits, rows)  # [B, V]
        logprobs = self._logprobs(x, rows) if want_logprobs else None
        next_ids = argmax(x)
        sampled = [i for i, r in enumerate(rows) if not r.picks_argmax]
        if sampled:
            idx = self._ints(sampled)
            next_ids[idx] = self._sample(x[idx], [rows[i] for i in sampled])
        return SampleOutput(next_ids, logprobs)

    def process(self, logits: torch.Tensor, rows: Sequence[SamplingInputs]) -> torch.Tensor:
        """float32 [B, vocab_size] logits after bias, min-tokens mask and penalties (a copy)."""
        x = logits[:, : self.vocab_size].to(torch.float32, copy=True).contiguous()
        self._apply_bias(x, rows)
        self._mask_stop_ids(x, rows)
        if any(r.params.uses_penalties for r in rows):
            self._apply_penalties(x, rows)
        return x

    ##### Internal Helper Functions #####

    def _apply_bias(self, x: torch.Tensor, rows: Sequence[SamplingInputs]) -> None:
        r_idx: list[int] = []
        t_idx: list[int] = []
        values: list[float] = []
        for i, r in enumerate(rows):
            for token_id, bias in (r.params.logit_bias or {}).items():
                r_idx.append(i)
                t_idx.append(token_id)
                values.append(bias)
        if r_idx:
            assert max(t_idx) < self.vocab_size, "logit_bias id out of vocabulary: verify_vocab"
            index = (self._ints(r_idx), self._ints(t_idx))
            x.index_put_(index, self._floats(values), accumulate=True)

    def _mask_stop_ids(self, x: torch.Tensor, rows: Sequence[SamplingInputs]) -> None:
        # NOTE: min_new_tokens wins over everything, ignore_eos and logit_bias included
        pairs = [(i, t) for i, r in enumerate(rows) if r.masks_stop_ids for t in r.stop_ids]
        if pairs:
            assert max(t for _, t in pairs) < self.vocab_size, "stop id out of vocabulary"
            index = torch.tensor(pairs, dtype=torch.int64, device=self.device)  # [n, 2]
            x[index[:, 0], index[:, 1]] = float("-inf")

    def _apply_penalties(self, x: torch.Tensor, rows: Sequence[SamplingInputs]) -> None:
        B, V = x.shape
        out_counts = self._counts([r.output_ids for r in rows], B, V)  # [B, V]
        if any(r.params.repetition_penalty != 1.0 for r in rows):
            seen = (self._counts([r.prompt_ids for r in rows], B, V) + out_counts) > 0
            rep = self._floats([r.params.repetition_penalty for r in rows]).unsqueeze(1)  # [B, 1]
            x.copy_(torch.where(seen, torch.where(x > 0, x / rep, x * rep), x))
        freq = self._floats([r.params.frequency_penalty for r in rows]).unsqueeze(1)  # [B, 1]
        pres = self._floats([r.params.presence_penalty for r in rows]).unsqueeze(1)  # [B, 1]
        x.sub_(freq * out_counts + pres * (out_counts > 0))

    def _counts(self, seqs: Sequence[Sequence[int]], B: int, V: int) -> torch.Tensor:
        """float32 [B, V]: how often each token occurs in each row's sequence."""
        counts = torch.zeros(B, V, dtype=torch.float32, device=self.device)
        lengths = [len(s) for s in seqs]
        if sum(lengths):
            tokens = _flat_ids(seqs, sum(lengths))  # [sum(lengths)] on the CPU
            assert int(tokens.max()) < V, "token id out of vocabulary in prompt or output"
            tokens = tokens.to(self.device)
            rows = torch.repeat_interleave(torch.arange(B, device=self.device), self._ints(lengths))
            counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.float32), True)
        return counts

    def _logprobs(self, x: torch.Tensor, rows: Sequence[SamplingInputs]) -> torch.Tensor:
        temps = [1.0 if r.params.is_greedy else r.params.temperature for r in rows]
        return torch.log_softmax(x / self._floats(temps).unsqueeze(1), dim=-1)

    def _sample(self, x: torch.Tensor, rows: Sequence[SamplingInputs]) -> torch.Tensor:
        """int64 [b]: one draw per row from softmax(x / T) truncated by top-k, top-p, min-p."""
        return self.draw(self.distribution(x, rows), rows)

    # NOTE: public: the speculative draft (draft.py) keeps the distribution it drew from
    def distribution(self, x: torch.Tensor, rows: Sequence[SamplingInputs]) -> torch.Tensor:
        """float32 [b, V]: softmax(x / T) of processed logits x [b, V], truncated by top-k,
        top-p and min-p; not renormalized (`draw` needs no normalization)."""
        temps = self._floats([r.params.temperature for r in rows]).unsqueeze(1)  # [b, 1]
        probs = torch.softmax(x / temps, dim=-1)  # [b, V]
        return self._truncate(probs, [r.params for r in rows])

    def draw(self, probs: torch.Tensor, rows: Sequence[SamplingInputs]) -> torch.Tensor:
        """int64 [b]: one draw per row from the (unnormalized) distribution `probs` [b, V]."""
        q = torch.empty_like(probs)  # [b, V] Exp(1) noise
        shared = [i for i, r in enumerate(rows) if r.generator is None]
        if len(shared) == len(rows):
            q.exponential_(generator=self.generator)
        else:
            if shared:
                noise = torch.empty(
                    len(shared), probs.shape[1], dtype=probs.dtype, device=probs.device
                )
                q[self._ints(shared)] = noise.exponential_(generator=self.generator)
            for i, r in enumerate(rows):
                if r.generator is not None:
                    q[i].exponential_(generator=r.generator)
        # NOTE: q can underflow to 0 only in theory; the clamp keeps 0/0 out of the argmax
        return argmax(probs / q.clamp_(min=torch.finfo(torch.float32).tiny))

    def _truncate(self, probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Zero what top-k, then top-p (on the renormalized top-k mass), then min-p drop."""
        V = probs.shape[1]
        ks = [V if p.top_k == -1 else min(p.top_k, V) for p in params]
        cut = [i for i, p in enumerate(params) if ks[i] < V or p.top_p < 1.0]
        if cut:
            idx = self._ints(cut)
            sub = probs[idx]  # [c, V]
            k_list = [ks[i] for i in cut]
            k_cut = self._ints(k_list).unsqueeze(1)  # [c, 1]
            top_p = [params[i].top_p if params[i].top_p < 1.0 else float("inf") for i in cut]
            # rows cut by top-p alone look for their cut among the most likely tokens first
            width = max(k if k < V else min(V, TOP_P_WINDOW) for k in k_list)
            vals, ids = _head(sub, width, k_cut)  # [c, width] descending, top-k applied
            mass = torch.where(k_cut < V, vals.sum(-1, keepdim=True), sub.sum(-1, keepdim=True))
            limit = self._floats(top_p).unsqueeze(1) * mass  # [c, 1]
            cum = vals.cumsum(dim=-1)  # [c, width]
            if width < V and not bool(((k_cut < V) | (cum[:, -1:] >= limit)).all()):
                vals, ids = _head(sub, V, k_cut)  # a top-p cut lies past the window: sort it all
                cum = vals.cumsum(dim=-1)
            # top-p: keep a token while the mass before it is below top_p (the first always stays)
            vals = vals.masked_fill(cum - vals >= limit, 0.0)
            probs = probs.index_copy(0, idx, torch.zeros_like(sub).scatter_(1, ids, vals))
        if any(p.min_p > 0.0 for p in params):
            min_ps = self._floats([p.min_p for p in params]).unsqueeze(1)  # [b, 1]
            probs = probs.masked_fill(probs < min_ps * probs.amax(dim=-1, keepdim=True), 0.0)
        return probs

    def _ints(self, values: Sequence[int]) -> torch.Tensor:
        return to_device(values, torch.int64, self.device)

    def _floats(self, values: Sequence[float]) -> torch.Tensor:
        return to_device(values, torch.float32, self.device)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """int64 [B]: torch.argmax(x, -1) of x [B, V]; on CUDA by weft.kernels.argmax_rows (torch
    reduces a 128k-wide row in 33-36 us on the H200, the kernel in a few)."""
    if not x.is_cuda:
        return x.argmax(dim=-1)
    from weft.kernels.argmax import argmax_rows

    return argmax_rows(x)


def _flat_ids(seqs: Sequence[Sequence[int]], total: int) -> torch.Tensor:
    """int64 [total]: the sequences back to back; lists go through numpy (3x faster than torch)."""
    if all(isinstance(s, list) for s in seqs):
        return torch.from_numpy(np.fromiter(itertools.chain.from_iterable(seqs), np.int64, total))
    return torch.cat([torch.as_tensor(s, dtype=torch.int64).cpu() for s in seqs])


def _head(probs: torch.Tensor, width: int, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The `width` largest probabilities of each row, descending, past each row's top-k zeroed."""
    vals, ids = (
        probs.topk(width, dim=-1) if width < probs.shape[1] else probs.sort(dim=-1, descending=True)
    )
    ranks = torch.arange(width, device=probs.device)  # [width]
    return vals.masked_fill(ranks >= k, 0.0), ids  # k: [c, 1]


def _needs_processing(r: SamplingInputs) -> bool:
    return bool(r.params.logit_bias) or r.masks_stop_ids or r.params.uses_penalties
