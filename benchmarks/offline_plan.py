"""The plan of benchmarks/offline.py: which engine configuration runs which job (one engine each)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_utils import merge_kwargs, parse_kv
from offline_jobs import (
    RunResult,
    Workload,
    constrained_workload,
    fixed_workload,
    run_constrained,
    run_workload,
    shared_prefix_workload,
)

# chat and programs run the packaged model on CPU; the others build engines on --model (dummy
# weights), `all` runs every engine mode
ENGINE_MODES = ("offline", "prefix", "constrained", "ablations")
MODES = ("chat", "programs", *ENGINE_MODES, "lora", "all")
Job = Callable[[Any, float, str], list[RunResult]]  # (engine, hard deadline, engine label)


@dataclass
class EngineSpec:
    label: str
    kwargs: dict[str, Any]
    jobs: list[tuple[str, str, Job]] = field(default_factory=list)  # (section, key, run)


@dataclass
class Plan:
    """Engine configurations in order of first use, each with its jobs; `base` is the default
    engine (EngineConfig defaults plus --engine-arg) that the other configurations vary."""

    device: str
    base: dict[str, Any]
    engines: dict[tuple[Any, ...], EngineSpec] = field(default_factory=dict)
    skipped: list[RunResult] = field(default_factory=list)
    workloads: list[Workload] = field(default_factory=list)

    def key(self, kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """Equal for kwargs that make the same engine on this device (ValueError: none can)."""
        from weft.runtime.executor.attention import resolve_backend_name

        k = dict(kwargs)
        k["attention_backend"] = resolve_backend_name(
            k.get("attention_backend", "auto"), self.device
        )
        k["disable_cuda_graph"] = self.device != "cuda" or bool(k.get("disable_cuda_graph"))
        k["disable_radix_cache"] = bool(k.get("disable_radix_cache"))
        return tuple(sorted((n, json.dumps(v, sort_keys=True)) for n, v in k.items()))

    def label(self, kwargs: dict[str, Any]) -> str:
        """'triton, CUDA graphs', 'triton, eager, radix cache off', 'torch, schedule_policy=lpm'."""
        k, base = dict(self.key(kwargs)), dict(self.key(self.base))
        parts = [json.loads(k.pop("attention_backend"))]
        if self.device == "cuda":
            parts.append("eager" if json.loads(k["disable_cuda_graph"]) else "CUDA graphs")
        if json.loads(k.pop("disable_radix_cache")):
            parts.append("radix cache off")
        k.pop("disable_cuda_graph")
        for name, text in k.items():
            value = json.loads(text)
            if base.get(name) == text or (name == "max_loras_per_batch" and "lora_paths" in k):
                continue
            if name == "lora_paths":  # (its folders say nothing; max_loras_per_batch: the count)
                parts.append(f"{len(value)} LoRA adapters")
            elif isinstance(value, dict):  # tuning: the fields that differ, as tuning.gemv=off
                was = json.loads(base[name]) if name in base else {}
                parts += [f"{name}.{f}={x}" for f, x in value.items() if was.get(f) != x]
            else:
                parts.append(f"{name}={value}")
        return ", ".join(parts)

    def add(self, over: dict[str, Any], section: str, key: str, job: Job) -> None:
        kwargs = merge_kwargs(self.base, over)
        spec = self.engines.setdefault(self.key(kwargs), EngineSpec(self.label(kwargs), kwargs))
        if key not in [k for _, k, _ in spec.jobs]:
            spec.jobs.append((section, key, job))

    def add_workload(self, over: dict[str, Any], work: Workload, section: str, key: str) -> None:
        if all(w is not work for w in self.workloads):
            self.workloads.append(work)

        def job(engine: Any, deadline: float, label: str) -> list[RunResult]:
            return [run_workload(engine, work, deadline, section, key, label)]

        self.add(over, section, key, job)

    def set_context_length(self, max_position: int | None) -> None:
        """Room for the longest request (rounded up), unless --engine-arg sets it."""
        longest = max(
            len(ids) + p["max_new_tokens"]
            for w in self.workloads
            for ids, p in zip(w.input_ids, w.params, strict=True)
        )
        ctx = -(-(longest + 16) // 64) * 64
        self.base.setdefault("context_length", min(ctx, max_position or ctx))
        for spec in self.engines.values():
            spec.kwargs.setdefault("context_length", self.base["context_length"])


def build_plan(args: argparse.Namespace, device: str, model: dict[str, Any]) -> Plan:
    """`model`: the config.json. Sets args.offline_work (the HF peer runs its first requests)."""
    base = {"model": args.folder, "load_format": args.load_format, **args.engine_arg}
    plan, vocab, seed = Plan(device, base), int(model["vocab_size"]), args.seed
    modes = set(ENGINE_MODES) if args.mode == "all" else {args.mode}
    if "offline" in modes:
        work = fixed_workload(
            "offline", args.num_prompts, args.input_len, args.output_len, vocab, seed
        )
        args.offline_work = work
        plan.add_workload({}, work, "offline", "offline")
    if "prefix" in modes:
        shared = shared_prefix_workload(
            *(args.groups, args.group_size, args.prefix_len, args.question_len),
            *(args.prefix_output_len, vocab, seed + 1),
        )
        plain = fixed_workload(
            "no shared prefix", args.noshare_prompts, args.prefix_len + args.question_len,
            args.prefix_output_len, vocab, seed + 2,
        )  # fmt: skip
        for cache, over in (("on", {}), ("off", {"disable_radix_cache": True})):
            plan.add_workload(over, shared, "prefix", f"prefix:{cache}")
            plan.add_workload(over, plain, "prefix", f"noshare:{cache}")
        if device == "cuda":  # radix cache on, the shared prefix read per request in decode
            per_request = {"disable_shared_prefix_decode": True}
            plan.add_workload(per_request, shared, "prefix", "prefix:on-per-request")
    if "constrained" in modes:
        con = constrained_workload(
            args.constrained_batch, args.constrained_input_len, args.constrained_max_tokens,
            vocab, seed + 3,
        )  # fmt: skip
        plan.workloads.append(con)
        plan.add(
            {}, "constrained", "constrained", lambda e, d, lbl: run_constrained(e, con, d, lbl)
        )
    if "ablations" in modes:
        add_ablations(plan, args, vocab)
    if "lora" in modes:
        add_lora(plan, args, model, vocab)
    plan.set_context_length(model.get("max_position_embeddings"))
    return plan


def add_ablations(plan: Plan, args: argparse.Namespace, vocab: int) -> None:
    """The ablation workload on the base engine and on each variant that makes another engine
    here; the others are listed as skipped with the reason."""
    work = fixed_workload(
        "ablation", args.ablation_prompts, args.ablation_input_len, args.ablation_output_len,
        vocab, args.seed + 4,
    )  # fmt: skip
    plan.add_workload({}, work, "ablations", "ablation:base")
    for name, over in ablation_variants(args):
        try:
            key = plan.key(merge_kwargs(plan.base, over))  # raises for a backend this device lacks
            if plan.device != "cuda" and "disable_cuda_graph" in over:
                raise ValueError("no CUDA device: CUDA graphs do not apply")
            if key == plan.key(plan.base):
                raise ValueError("the same engine as the base on this device")
        except ValueError as e:
            skip = RunResult("ablations", f"ablation:{name}", name, "-", work.shape)
            skip.error = f"skipped: {e}"
            plan.skipped.append(skip)
            continue
        name = f"ablation:{plan.label(merge_kwargs(plan.base, over))}"
        plan.add_workload(over, work, "ablations", name)


def add_lora(plan: Plan, args: argparse.Namespace, model: dict[str, Any], vocab: int) -> None:
    """The lora workload on the base engine (also the merged adapter's speed: merging adds no
    work), then mixed over each --lora-adapters count of random rank --lora-rank adapters."""
    from offline_lora import adapter_folders

    work = fixed_workload(
        "lora", args.lora_prompts, args.input_len, args.output_len, vocab, args.seed + 5
    )
    plan.add_workload({}, work, "lora", "lora:base")
    for n in args.lora_adapters:
        entries = adapter_folders(model, args.lora_rank, n, Path(args.tmp) / "lora")
        over = {"lora_paths": entries, "max_loras_per_batch": n, "max_lora_rank": args.lora_rank}
        mixed = work.with_adapters([e.partition("=")[0] for e in entries])
        plan.add_workload(over, mixed, "lora", f"lora:{n}")


def ablation_variants(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """CUDA graphs off; each --ablation-backends backend eager; each --variant NAME:K=V,..."""
    out: list[tuple[str, dict[str, Any]]] = [("CUDA graphs off", {"disable_cuda_graph": True})]
    out += [
        (b, {"attention_backend": b, "disable_cuda_graph": True}) for b in args.ablation_backends
    ]
    for text in args.variant:
        name, _, pairs = text.partition(":")
        out.append((name, parse_kv(pairs.split(",")) if pairs else {}))
    return out
