"""FP8 quality on real weights (CPU): mean KL divergence of next-token distributions, bf16 against
FP8 (weights, and weights + KV), over ShareGPT text, and greedy agreement over 256 tokens.

    python benchmarks/quality.py                      # the packaged SmolLM2
    python benchmarks/quality.py --model ~/.cache/weft-models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf

The reference is the bf16 model (what the GPU runs). A GGUF is dequantized at load (full precision
from its blocks), then each variant is built from that checkpoint: `fp8` quantizes every projection
per output channel at load (runtime/models/quant/fp8.py) and quantizes activations per token
(W8A8, as the GPU's prefill GEMM and decode GEMV compute it); `fp8-kv` adds the fp8_e4m3 KV pool.
`--oracle` adds a float32 model and reports each variant's KL from it too (bf16's own rounding as
the floor).

Per prompt (the first human turn of ShareGPT conversations, in file order, cut to --prompt-tokens):
the reference writes --gen greedy tokens; every variant then reads prompt + that continuation in
one prefill (KL at each position, and top-1 agreement with the reference's token: teacher-forced)
and writes its own greedy --gen tokens (free-running: the common prefix and the share of equal
positions)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from weft.kernels.fp8 import quantize_per_token_ref, quantize_static_ref
from weft.runtime.executor.attention import create_attention_backend
from weft.runtime.executor.batch import ForwardBatch, ForwardMode
from weft.runtime.executor.memory import KVPool, ReqToTokenPool
from weft.runtime.loader import load_tokenizer, read_hf_config, resolve_model_path
from weft.runtime.loader.weights import iterate_weight_slices
from weft.runtime.models import build_model
from weft.runtime.models.llama import LlamaForCausalLM, head_dim_of
from weft.runtime.models.quant import QuantContext, make_quant_config, quantized_layers
from weft.runtime.models.quant.fp8 import Fp8Method

SHAREGPT = Path.home() / ".cache" / "weft-models" / "sharegpt.jsonl"
VARIANTS = ("fp8", "fp8-kv")  # beside the bf16 reference (and the float32 oracle)


##### Prompts #####


def sharegpt_prompts(path: Path, tokenizer: Any, count: int, max_tokens: int) -> list[list[int]]:
    """Token ids of the first human turn of conversations in file order, those of at least 32
    tokens, cut to max_tokens."""
    out: list[list[int]] = []
    with path.open() as f:
        for line in f:
            turns = json.loads(line).get("conversations") or []
            human = next((t["value"] for t in turns if t.get("from") == "human"), None)
            if not human:
                continue
            ids = tokenizer(human, add_special_tokens=False)["input_ids"][:max_tokens]
            if len(ids) >= 32:
                out.append(ids)
            if len(out) == count:
                break
    if len(out) < count:
        raise ValueError(f"{path} has only {len(out)} usable prompts, {count} asked for")
    return out


##### Models #####


class DequantizedFp8(Fp8Method):
    """Fp8Method's torch-path numbers at CPU speed: the fp8 weight upcast to float32 once (exact)
    instead of at every call (10 ns an element on 2 cores), the same float32 product of the fp8
    activations and weights, then both scales; tests/e2e/test_fp8_quality.py checks the two give
    the same logits. (A bfloat16 copy would round the sums to bf16 before the scales: 2.7e-3
    relative per projection, which SmolLM2's 30 layers turned into a KL of 0.02 between them.)"""

    def __init__(self, method: Fp8Method, layer: torch.nn.Module) -> None:
        super().__init__(method.scheme)
        self.weight = layer.weight.float()  # [N, K]
        self.scale = layer.weight_scale.float()
        self.input_scale = getattr(layer, "input_scale", None)

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if self.input_scale is None:
            xq, xs = quantize_per_token_ref(x)
        else:
            xq, xs = quantize_static_ref(x, self.input_scale), self.input_scale.float()
        y = torch.mm(xq.float(), self.weight.T) * xs * self.scale[None, :]
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)


def load_model(folder: Path, dtype: torch.dtype, fp8: bool, context: int) -> LlamaForCausalLM:
    hf = read_hf_config(folder)
    quant = make_quant_config("fp8", QuantContext(hf, folder, dtype)) if fp8 else None
    model = build_model(hf, context, torch.device("cpu"), dtype, None, quant)
    model.load_weights(iterate_weight_slices(folder))
    for _, layer, method in quantized_layers(model):
        assert isinstance(method, Fp8Method)
        fast = DequantizedFp8(method, layer)
        layer.quant = fast
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=layer.weight.dtype),
                                          requires_grad=False)  # fmt: skip
    return model


class Runner:
    """Batched prefill and greedy decode of one model over its own KV pool (torch backend)."""

    def __init__(self, model: LlamaForCausalLM, rows: int, max_len: int, kv: torch.dtype) -> None:
        cfg = model.config
        self.model, self.max_len = model, max_len
        heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.pool = KVPool(rows * max_len, cfg.num_hidden_layers, heads, head_dim_of(cfg), kv,
                           "cpu")  # fmt: skip
        self.table = ReqToTokenPool(rows, max_len, "cpu")
        self.table.table[:] = torch.arange(rows * max_len).view(rows, max_len)
        self.attn = create_attention_backend("torch", "cpu", self.pool, self.table.table, 1)

    @torch.no_grad()
    def step(self, seqs: list[list[int]], starts: list[int]) -> list[torch.Tensor]:
        """Run tokens seqs[b][starts[b]:] of rows b (their earlier tokens are in the pool): the
        float32 log-probs [new tokens, V] of each row."""
        ends = [len(s) for s in seqs]
        ext = [e - s for s, e in zip(starts, ends, strict=True)]
        ids = torch.tensor([t for s, b in zip(seqs, starts, strict=True) for t in s[b:]])
        pos = torch.cat([torch.arange(s, e) for s, e in zip(starts, ends, strict=True)])
        spans = enumerate(zip(starts, ends, strict=True))
        loc = torch.cat([self.table.table[r, s:e] for r, (s, e) in spans])
        fb = ForwardBatch(
            mode=ForwardMode.DECODE if max(ext) == 1 else ForwardMode.EXTEND,
            input_ids=ids, positions=pos, out_cache_loc=loc,
            req_rows=torch.arange(len(seqs)), seq_lens=torch.tensor(ends),
            extend_lens=torch.tensor(ext), seq_lens_cpu=ends, extend_lens_cpu=ext,
        )  # fmt: skip
        self.attn.prepare(fb)
        hidden = self.model(fb, self.attn)
        return [torch.log_softmax(self.model.compute_logits(h).float(), dim=-1)
                for h in hidden.split(ext)]  # fmt: skip

    def greedy(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        """n greedy tokens after each prompt (all rows decode together)."""
        seqs = [list(p) for p in prompts]
        logps = self.step(seqs, [0] * len(seqs))
        for i in range(n):
            for s, lp in zip(seqs, logps, strict=True):
                s.append(int(lp[-1].argmax()))
            if i + 1 < n:
                logps = self.step(seqs, [len(s) - 1 for s in seqs])
        return [s[len(p) :] for s, p in zip(seqs, prompts, strict=True)]


##### Measures #####


@dataclass
class Score:
    """One variant's numbers against one reference, summed over prompts."""

    kl_sum: float = 0.0
    kl_max: float = 0.0
    positions: int = 0
    top1_equal: int = 0  # teacher-forced: argmax == the reference's greedy token
    top1_total: int = 0
    prefixes: list[int] = field(default_factory=list)  # free-running common prefix per prompt
    equal: int = 0  # free-running equal positions
    total: int = 0

    def add_kl(self, ref: torch.Tensor, var: torch.Tensor) -> None:
        kl = (ref.exp() * (ref - var)).sum(-1).clamp_min(0)  # [T]
        self.kl_sum += float(kl.sum())
        self.kl_max = max(self.kl_max, float(kl.max()))
        self.positions += kl.numel()

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mean_kl": self.kl_sum / max(1, self.positions),
                               "max_kl": self.kl_max, "kl_positions": self.positions}  # fmt: skip
        if self.top1_total:
            out["top1_agreement"] = self.top1_equal / self.top1_total
        if self.total:
            out["greedy_equal_share"] = self.equal / self.total
            out["greedy_common_prefix_mean"] = sum(self.prefixes) / len(self.prefixes)
            out["greedy_full_matches"] = sum(p == self.total // len(self.prefixes)
                                             for p in self.prefixes)  # fmt: skip
        return out


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    folder = resolve_model_path(args.model, args.cache_dir)
    prompts = sharegpt_prompts(args.sharegpt, load_tokenizer(folder), args.prompts,
                               args.prompt_tokens)  # fmt: skip
    max_len = args.prompt_tokens + args.gen + 1
    t0 = time.perf_counter()
    ref = load_model(folder, torch.bfloat16, False, max_len)
    fp8 = load_model(folder, torch.bfloat16, True, max_len)
    rows = args.batch
    runners = {"bf16": Runner(ref, rows, max_len, torch.bfloat16)}
    if "fp8" in args.variants:
        runners["fp8"] = Runner(fp8, rows, max_len, torch.bfloat16)
    if "fp8-kv" in args.variants:
        runners["fp8-kv"] = Runner(fp8, rows, max_len, torch.float8_e4m3fn)
    if args.oracle:
        runners["fp32"] = Runner(load_model(folder, torch.float32, False, max_len), rows, max_len,
                                 torch.float32)  # fmt: skip
    scores = {name: Score() for name in runners if name != "bf16"}
    oracle = {name: Score() for name in runners if name not in ("fp32",)} if args.oracle else {}
    for b in range(0, len(prompts), rows):
        batch = prompts[b : b + rows]
        conts = {"bf16": runners["bf16"].greedy(batch, args.gen)}
        for name, runner in runners.items():
            if name not in ("bf16", "fp32"):
                conts[name] = runner.greedy(batch, args.gen)
        full = [p + c for p, c in zip(batch, conts["bf16"], strict=True)]
        # teacher-forced: every model reads prompt + the reference's continuation at once
        logps = {name: r.step(full, [0] * len(full)) for name, r in runners.items()}
        for i, prompt in enumerate(batch):
            want = torch.tensor(conts["bf16"][i])
            cut = slice(0, len(full[i]) - 1)  # predictions of tokens 1..end
            ref_lp = logps["bf16"][i][cut]
            for name, score in scores.items():
                var = logps[name][i][cut]
                score.add_kl(ref_lp, var)
                score.top1_equal += int((var[len(prompt) - 1 :].argmax(-1) == want).sum())
                score.top1_total += len(want)
                if name in conts:
                    got = conts[name][i]
                    score.prefixes.append(common_prefix(got, conts["bf16"][i]))
                    score.equal += sum(x == y for x, y in zip(got, conts["bf16"][i], strict=True))
                    score.total += len(got)
            for name, score in oracle.items():
                score.add_kl(logps["fp32"][i][cut], logps[name][i][cut])
        print(f"  prompts {b + len(batch)}/{len(prompts)} ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr, flush=True)  # fmt: skip
    return {
        "model": str(args.model or "packaged SmolLM2-135M-Instruct"),
        "reference": "bf16",
        "prompts": len(prompts),
        "prompt_tokens_max": args.prompt_tokens,
        "generated": args.gen,
        "seconds": round(time.perf_counter() - t0, 1),
        "vs_bf16": {name: s.summary() for name, s in scores.items()},
        **({"vs_fp32": {n: s.summary() for n, s in oracle.items()}} if oracle else {}),
    }


def table(result: dict[str, Any]) -> str:
    lines = [f"{result['model']}: {result['prompts']} ShareGPT prompts (<= "
             f"{result['prompt_tokens_max']} tokens) + {result['generated']} greedy tokens",
             f"{'variant':<10} {'mean KL':>10} {'max KL':>9} {'top-1 (forced)':>15} "
             f"{'greedy equal':>13} {'common prefix':>14}"]  # fmt: skip
    for ref in ("vs_bf16", "vs_fp32"):
        for name, s in result.get(ref, {}).items():
            top1 = s.get("top1_agreement", math.nan)
            eq = s.get("greedy_equal_share", math.nan)
            pre = s.get("greedy_common_prefix_mean", math.nan)
            lines.append(f"{name + (' (fp32)' if ref == 'vs_fp32' else ''):<10} "
                         f"{s['mean_kl']:>10.5f} {s['max_kl']:>9.3f} {top1:>15.4f} {eq:>13.4f} "
                         f"{pre:>14.1f}")  # fmt: skip
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: packaged SmolLM2)")
    ap.add_argument("--sharegpt", type=Path, default=SHAREGPT)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--gen", type=int, default=256, help="greedy tokens per prompt")
    ap.add_argument("--batch", type=int, default=8, help="prompts run together")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--oracle", action="store_true", help="also a float32 model, the KL floor")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "weft")
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.gen < 1 or args.batch < 1 or args.prompt_tokens < 32:
        ap.error("--prompts, --gen, --batch must be >= 1 and --prompt-tokens >= 32")
    if not args.sharegpt.is_file():
        ap.error(f"{args.sharegpt} is missing: shared/tools/fetch-models.sh sharegpt")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = evaluate(args)
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
