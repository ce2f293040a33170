"""The programs mode of benchmarks/offline.py: DSL program throughput with the radix cache on and off
(a few-shot and a fork-heavy workload on the packaged model)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import weft

SHOTS = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Italy?", "Rome"),
    ("What is the capital of Canada?", "Ottawa"),
    ("What is the capital of Kenya?", "Nairobi"),
    ("What is the capital of Peru?", "Lima"),
    ("What is the capital of Norway?", "Oslo"),
    ("What is the capital of Egypt?", "Cairo"),
]
FEW_SHOT = "Answer each question with one word.\n" + "".join(f"Q: {q}\nA: {a}\n" for q, a in SHOTS)
COUNTRIES = [
    "Germany",
    "Spain",
    "Chile",
    "India",
    "Greece",
    "Poland",
    "Cuba",
    "Iran",
    "Mali",
    "Laos",
]
CONTEXT = (
    "A small town wants to cut its traffic. The council can build bike lanes, run more buses, "
    "charge for parking in the centre, or close the old bridge to cars. Residents disagree: "
    "shop owners fear fewer customers, parents want safer streets, and commuters want speed.\n"
)
ANGLES = ["cost", "safety", "shops", "commuters"]


@weft.function
def few_shot(s: weft.ProgramState, question: str) -> None:
    s += FEW_SHOT + "Q: " + question + "\nA:"
    s += weft.gen("answer", stop="\n")


@weft.function
def branch_solve_merge(s: weft.ProgramState, option: str) -> None:
    s += CONTEXT + "Option: " + option + ".\n"
    forks = s.fork(len(ANGLES))
    forks += lambda i: f"Judge the option by {ANGLES[i]} in one sentence:"
    forks += weft.gen("view", stop="\n")
    forks.join()
    for angle, view in zip(ANGLES, s["view"], strict=True):
        s += f"{angle}:{view}\n"
    s += "Verdict:" + weft.gen("verdict", stop="\n")


def hit_rate(states: list[Any], names: list[str]) -> tuple[int, int]:
    """(cached, prompt) tokens summed over the gens that set `names` in every state."""
    cached = prompt = 0
    for s in states:
        for name in names:
            metas = s.get_meta_info(name)
            for meta in metas if isinstance(metas, list) else [metas]:
                cached += meta["cached_tokens"]
                prompt += meta["prompt_tokens"]
    return cached, prompt


def run_workload(
    name: str, run: Callable[[], list[Any]], names: list[str], cache_on: bool
) -> dict[str, Any]:
    start = time.perf_counter()
    states = run()
    elapsed = time.perf_counter() - start
    errors = [s.error() for s in states if s.error() is not None]
    if errors:
        raise RuntimeError(f"{name}: {len(errors)} programs failed, first: {errors[0]!r}")
    cached, prompt = hit_rate(states, names)
    return {
        "workload": name,
        "radix cache": "on" if cache_on else "off",
        "programs": len(states),
        "seconds": elapsed,
        "programs/s": len(states) / elapsed,
        "cache hit rate": cached / max(prompt, 1),
    }


def bench(model: str | None, num: int, max_tokens: int, cache_on: bool) -> list[dict[str, Any]]:
    backend = weft.EngineBackend(model=model, disable_radix_cache=not cache_on)
    try:
        sampling = {"temperature": 0, "max_new_tokens": max_tokens, "backend": backend}
        questions = [(f"What is the capital of {c}?",) for c in (COUNTRIES * num)[:num]]
        options = [(f"option {i}: " + ["bike lanes", "more buses"][i % 2],) for i in range(num)]
        batch = max(1, num // 4)
        return [
            run_workload(
                "few-shot",
                lambda: few_shot.run_batch(questions, **sampling),
                ["answer"],
                cache_on,
            ),
            run_workload(
                "fork-heavy (4 branches)",
                lambda: branch_solve_merge.run_batch(options[:batch], **sampling),
                ["view", "verdict"],
                cache_on,
            ),
        ]
    finally:
        backend.shutdown()


def run_programs(model: str | None, num: int, max_tokens: int) -> None:
    """Both workloads with the radix cache on, then off; prints a markdown table."""
    rows = []
    for cache_on in (True, False):
        rows += bench(model, num, max_tokens, cache_on)
    rows.sort(key=lambda r: (r["workload"], r["radix cache"] == "off"))
    print("| workload | radix cache | programs | seconds | programs/s | cache hit rate |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['workload']} | {r['radix cache']} | {r['programs']} | {r['seconds']:.1f} "
            f"| {r['programs/s']:.2f} | {r['cache hit rate']:.0%} |"
        )
