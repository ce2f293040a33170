"""The workloads and timed runs of benchmarks/offline.py: random-id requests, engine runs, the HF peer."""

from __future__ import annotations

import gc
import json
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

# A small fixed schema: strings, an integer, an enum and a short array.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "role", "tags"],
    "additionalProperties": False,
}

##### Workloads #####


@dataclass(frozen=True)
class Workload:
    """Requests submitted together in one `generate` call: token ids and per-request params."""

    name: str
    input_ids: list[list[int]]
    params: list[dict[str, Any]]
    lora_paths: list[str | None] | None = None  # each request's LoRA adapter (None: the base)

    @property
    def num_prompts(self) -> int:
        return len(self.input_ids)

    @property
    def input_tokens(self) -> int:
        return sum(len(ids) for ids in self.input_ids)

    @property
    def shape(self) -> str:
        """'N × in/out' when every request has the same lengths, else the totals."""
        ins = {len(ids) for ids in self.input_ids}
        outs = {p.get("max_new_tokens") for p in self.params}
        if len(ins) == 1 and len(outs) == 1:
            return f"{self.num_prompts} × {ins.pop()}/{outs.pop()}"
        return f"{self.num_prompts} req, {self.input_tokens} in"

    def head(self, n: int, max_new_tokens: int | None = None) -> Workload:
        params = [
            p if max_new_tokens is None else {**p, "max_new_tokens": max_new_tokens}
            for p in self.params[:n]
        ]
        loras = None if self.lora_paths is None else self.lora_paths[:n]
        return replace(self, input_ids=self.input_ids[:n], params=params, lora_paths=loras)

    def with_adapters(self, names: list[str]) -> Workload:
        """The same requests, request i under adapter names[i mod len(names)]: mixed batches."""
        loras: list[str | None] = [names[i % len(names)] for i in range(self.num_prompts)]
        return replace(self, name=f"{self.name}, {len(names)} adapters", lora_paths=loras)


def greedy(output_len: int) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}


def random_ids(rng: np.random.Generator, n: int, length: int, vocab: int) -> list[list[int]]:
    # ids from [3, vocab): the low ids are often BOS/EOS/pad in real vocabularies
    return rng.integers(3, vocab, size=(n, length)).tolist() if n and length else [[]] * n


def fixed_workload(
    name: str, n: int, input_len: int, output_len: int, vocab: int, seed: int
) -> Workload:
    ids = random_ids(np.random.default_rng(seed), n, input_len, vocab)
    return Workload(name, ids, [greedy(output_len)] * n)


def shared_prefix_workload(
    groups: int, size: int, prefix: int, question: int, output_len: int, vocab: int, seed: int
) -> Workload:
    """groups × size requests; the requests of a group share a prefix; group after group."""
    rng = np.random.default_rng(seed)
    ids = []
    for p in random_ids(rng, groups, prefix, vocab):
        ids += [p + q for q in random_ids(rng, size, question, vocab)]
    return Workload("shared prefix", ids, [greedy(output_len)] * len(ids))


def constrained_workload(
    n: int, input_len: int, max_tokens: int, vocab: int, seed: int
) -> Workload:
    ids = random_ids(np.random.default_rng(seed), n, input_len, vocab)
    params = {"temperature": 0, "max_new_tokens": max_tokens, "json_schema": json.dumps(SCHEMA)}
    return Workload("json_schema", ids, [params] * n)


def matched_unconstrained(work: Workload, lengths: list[int]) -> Workload:
    """The same prompts, unconstrained, each with the output length its constrained run had."""
    return replace(work, name="unconstrained", params=[greedy(n) for n in lengths])


##### Engine runs #####


@dataclass
class RunResult:
    section: str
    key: str  # what the headline ratios look up
    label: str
    engine: str
    shape: str
    num_prompts: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0
    note: str = ""
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tps(self) -> float | None:
        return self.output_tokens / self.seconds if self.seconds and not self.error else None

    @property
    def ms_per_token(self) -> float | None:
        return 1e3 * self.seconds / self.output_tokens if self.output_tokens else None

    def to_dict(self) -> dict[str, Any]:
        return {
            **{k: v for k, v in vars(self).items() if k != "extra"},
            "output_tok_per_s": self.output_tps,
            "ms_per_output_token": self.ms_per_token,
            **self.extra,
        }


def _flush(engine: Any) -> None:
    for _ in range(50):  # False only while the scheduler still holds requests
        if engine.flush_cache():
            return
        time.sleep(0.1)
    raise RuntimeError("the engine did not flush its prefix cache")


def timed_generate(
    engine: Any, work: Workload, result: RunResult, deadline: float
) -> list[dict[str, Any]]:
    """Warm up on two of the requests, flush the cache, then time the whole workload in one call.
    At `deadline` (time.monotonic) every request still running is aborted and the run marked."""
    warm = work.head(2, max_new_tokens=min(4, work.params[0]["max_new_tokens"]))
    engine.generate(None, warm.params, input_ids=warm.input_ids, lora_path=warm.lora_paths)
    _flush(engine)
    timer = threading.Timer(
        max(0.0, deadline - time.monotonic()), engine.abort, (), {"abort_all": True}
    )
    timer.daemon = True
    before = engine.get_state()
    timer.start()
    start = time.perf_counter()
    try:
        outs = engine.generate(None, work.params, input_ids=work.input_ids,
                               lora_path=work.lora_paths)  # fmt: skip
    finally:
        timer.cancel()
    end = time.perf_counter()
    result.seconds = end - start
    after = engine.get_state()
    result.extra["steps"] = step_times(before, after) | timeline(after, start, end)
    result.extra["kv"] = kv_usage(before, after, start, end)
    assert isinstance(outs, list)
    metas = [o["meta_info"] for o in outs]
    result.num_prompts = len(outs)
    result.output_tokens = sum(m["completion_tokens"] for m in metas)
    result.cached_tokens = sum(m.get("cached_tokens", 0) for m in metas)
    aborted = sum((m.get("finish_reason") or {}).get("type") == "abort" for m in metas)
    if aborted:
        result.note = f"{aborted} requests aborted at the time budget; " + result.note
    return outs


def step_times(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The scheduler's steps during a run: count, total and mean wall time per kind, and
    retractions (the differences of two `get_state()`s)."""
    out: dict[str, Any] = {"retractions": after["retractions"] - before["retractions"]}
    for kind in ("extend", "decode"):
        n = after[f"{kind}_steps"] - before[f"{kind}_steps"]
        total_s = (after[f"{kind}_us"] - before[f"{kind}_us"]) / 1e6
        out[kind] = {"steps": n, "total_s": round(total_s, 3)}
        out[kind]["mean_ms"] = round(1e3 * total_s / n, 3) if n else None
    return out


def timeline(after: dict[str, Any], start: float, end: float) -> dict[str, Any]:
    """Where the run's wall time outside the scheduler's busy periods went: before its first
    launch, after it went idle for the last time, and idle in between (the scheduler's
    `busy_periods` are time.perf_counter() seconds of the same machine's monotonic clock)."""
    periods = [(a, b) for a, b in after.get("busy_periods", []) if b >= start and a <= end]
    if not periods:
        return {}
    gaps = sum(b[0] - a[1] for a, b in zip(periods, periods[1:], strict=False))
    return {
        "before_first_step_s": round(periods[0][0] - start, 3),
        "after_last_step_s": round(end - periods[-1][1], 3),
        "idle_between_s": round(gaps, 3),
        "busy_periods": len(periods),
    }


def kv_usage(
    before: dict[str, Any], after: dict[str, Any], start: float, end: float, points: int = 9
) -> dict[str, Any]:
    """The KV pool's use during a run, as fractions of its slots held by requests (neither free
    nor evictable): the mean over the run's steps (exact, from the scheduler's sums), the min and
    max of the scheduler's samples inside the run, and `points` of them evenly spread over it
    ([seconds from the start, fraction, requests running])."""
    total = after["max_total_tokens"]
    steps = sum(after[f"{k}_steps"] - before[f"{k}_steps"] for k in ("extend", "decode"))
    held = after["kv_held_step_sum"] - before["kv_held_step_sum"]
    inside = [s for s in after.get("kv_samples", []) if start <= s[0] <= end]
    out: dict[str, Any] = {"pool_tokens": total, "samples": len(inside)}
    out["mean"] = held / steps / total if steps else None
    if inside:
        out["min"] = min(s[1] for s in inside) / total
        out["max"] = max(s[1] for s in inside) / total
        picks = [inside[round(i * (len(inside) - 1) / max(points - 1, 1))] for i in range(points)]
        out["points"] = [[round(t - start, 2), round(h / total, 4), n] for t, h, n in picks]
    return out


def run_workload(
    engine: Any, work: Workload, deadline: float, section: str, key: str, engine_label: str
) -> RunResult:
    result = RunResult(section, key, work.name, engine_label, work.shape)
    timed_generate(engine, work, result, deadline)
    expected = sum(p["max_new_tokens"] for p in work.params)
    if result.output_tokens != expected and not result.note:
        result.note = f"{result.output_tokens} of {expected} output tokens"
    return result


def run_constrained(
    engine: Any, work: Workload, deadline: float, engine_label: str
) -> list[RunResult]:
    """JSON-schema requests, then the same prompts unconstrained with the same output lengths."""
    con = RunResult("constrained", "constrained", "json_schema", engine_label, work.shape)
    outs = timed_generate(engine, work, con, deadline)
    lengths = [o["meta_info"]["completion_tokens"] for o in outs]
    valid = sum(_is_json(o["text"]) for o in outs)
    con.note = f"{valid}/{len(outs)} parse as JSON (the rest stopped at max_new_tokens) " + con.note
    fills = engine.get_state()["mask_fill"]  # the scheduler thread's fill_bitmask time, per request
    con.extra["mask_fill"] = fills
    con.note += (
        f"; mask fill per request and step: p50 {fills.get('p50_us', 0):.1f} us, "
        f"p99 {fills.get('p99_us', 0):.1f} us ({fills['count']} fills)"
    )
    con.extra["output_lengths"] = lengths
    plain = matched_unconstrained(work, lengths)
    free = RunResult("constrained", "unconstrained", plain.name, engine_label, con.shape)
    timed_generate(engine, plain, free, deadline)
    free.note = "same prompts and per-request output lengths " + free.note
    return [con, free]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


##### The HF transformers peer #####


def hf_peer(
    folder: str, work: Workload, batch: int, compile_mode: str, deadline: float
) -> RunResult:
    """transformers `generate` on random weights of the same config (not weft's values): static
    cache, greedy, fixed output length, `batch` requests per call; warm-up (and any torch.compile
    that transformers does for a static cache on CUDA) is timed apart."""
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    batch = min(batch, work.num_prompts)
    n = work.num_prompts // batch * batch  # whole batches: a new shape recompiles
    work = work.head(n)
    in_len, out_len = len(work.input_ids[0]), work.params[0]["max_new_tokens"]
    result = RunResult("offline", "hf", "HF transformers generate", f"HF {dtype}", work.shape)
    t0 = time.perf_counter()
    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    load_s = time.perf_counter() - t0
    kwargs: dict[str, Any] = {
        "do_sample": False,
        "cache_implementation": "static",
        "pad_token_id": 0,
    }
    if compile_mode == "off":
        kwargs["disable_compile"] = True
    sized = hasattr(transformers.GenerationConfig(), "max_cache_len")
    if sized:  # one cache size for warm-up and run, so nothing recompiles
        kwargs["max_cache_len"] = in_len + out_len

    try:
        t0 = time.perf_counter()
        _hf_generate(model, work.input_ids[:batch], min(out_len, 8) if sized else out_len, kwargs)
        warm_s = time.perf_counter() - t0
        done, start = 0, time.perf_counter()
        for i in range(0, n, batch):
            left = deadline - time.monotonic()
            if left <= 0:
                result.note = "cut short at the time budget; "
                break
            done += _hf_generate(model, work.input_ids[i : i + batch], out_len, kwargs, left)
        result.seconds = time.perf_counter() - start
    finally:
        model = None
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    result.num_prompts, result.output_tokens = n, done
    result.note += (
        f"random weights of the same config (not weft's values); static cache, batch {batch}, "
        f"compile {compile_mode}; load {load_s:.1f} s, warm-up {warm_s:.1f} s"
    )
    result.extra |= {
        "hf_load_s": load_s,
        "hf_warmup_s": warm_s,
        "transformers": transformers.__version__,
    }
    return result


def _hf_generate(
    model: Any,
    ids: list[list[int]],
    new: int,
    kwargs: dict[str, Any],
    max_time: float | None = None,
) -> int:
    """One `generate` call of exactly `new` tokens per row (unless max_time); tokens made."""
    x = torch.tensor(ids, device=model.device)
    with torch.no_grad():
        out = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=new,
            min_new_tokens=new,
            max_time=max_time,
            **kwargs,
        )
    return int((out.shape[1] - x.shape[1]) * out.shape[0])
