"""The results of benchmarks/spec.py: one row per (workload, batch, variant), the comparison with the
baseline variant (speedup, identical greedy outputs), JSON and the markdown table."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from bench_utils import fmt, markdown_table


@dataclass
class Row:
    """One variant's run of one workload at one batch size (concurrency)."""

    workload: str
    batch: int
    variant: str
    speculative: bool
    requests: int = 0
    prompt_tokens: int = 0  # summed over the requests
    output_tokens: int = 0
    wall_s: float = 0.0  # the waves' generate calls, summed
    # the scheduler's steps over the run (get_state deltas): plain decode steps, verify steps and
    # their launch-to-launch time in µs (a step followed by an idle wait adds none)
    decode_steps: int = 0
    verify_steps: int = 0
    step_us: int = 0
    # per-request meta_info summed: verify steps (one per request and step), drafts, accepted
    spec_verify_ct: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # against the baseline variant of the same workload and batch (compare())
    baseline: str = ""
    speedup: float | None = None
    identical: int | None = None
    error: str = ""
    output_ids: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def tok_s(self) -> float | None:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else None

    @property
    def acceptance(self) -> float | None:
        """Accepted drafts / drafts."""
        d = self.spec_draft_tokens
        return self.spec_accepted_tokens / d if d else None

    @property
    def accept_length(self) -> float | None:
        """Tokens per verify step of a request, SGLang's (accepted + steps) / steps."""
        n = self.spec_verify_ct
        return (self.spec_accepted_tokens + n) / n if n else None

    @property
    def step_ms(self) -> float | None:
        """Mean launch-to-launch milliseconds of a decode or verify step."""
        steps = self.decode_steps + self.verify_steps
        return self.step_us / steps / 1e3 if steps else None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("output_ids")
        out["output_lengths"] = [len(ids) for ids in self.output_ids]
        for name in ("tok_s", "acceptance", "accept_length", "step_ms"):
            out[name] = getattr(self, name)
        return out


def compare(rows: list[Row], baseline: str) -> None:
    """Fill each row's speedup (tokens/s over the baseline's) and count of requests whose greedy
    output ids equal the baseline's, from the baseline variant's row of the same workload and
    batch; left None where that row is missing or failed."""
    base = {(r.workload, r.batch): r for r in rows if r.variant == baseline and not r.error}
    for r in rows:
        b = base.get((r.workload, r.batch))
        if r.error or b is None:
            continue
        r.baseline = baseline
        if r.tok_s is not None and b.tok_s:
            r.speedup = r.tok_s / b.tok_s
        pairs = zip(r.output_ids, b.output_ids, strict=False)
        r.identical = sum(mine == theirs for mine, theirs in pairs)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _x(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def table(rows: list[Row]) -> str:
    """Markdown: workload, batch, variant, tokens/s, speedup, acceptance, accepted length,
    identical outputs, steps; failed rows say why."""
    head = ["workload", "batch", "variant", "requests", "out tokens", "tok/s", "speedup",
            "acceptance", "accept len", "identical", "decode + verify steps", "ms/step"]  # fmt: skip
    body: list[list[Any]] = []
    for r in rows:
        if r.error:
            body.append([r.workload, r.batch, r.variant, r.error, *[""] * (len(head) - 4)])
            continue
        same = "n/a" if r.identical is None else f"{r.identical}/{r.requests}"
        spec = r.speculative
        body.append([r.workload, r.batch, r.variant, r.requests, r.output_tokens,
                     fmt(r.tok_s), f"{_x(r.speedup)}×" if r.speedup is not None else "n/a",
                     _pct(r.acceptance) if spec else "-", _x(r.accept_length) if spec else "-",
                     same, f"{r.decode_steps} + {r.verify_steps}", _x(r.step_ms, 3)])  # fmt: skip
    return markdown_table(head, body)


def report(meta: dict[str, Any], rows: list[Row]) -> str:
    """The run's header (command, device, model, workloads), notes, and the table."""
    lines = [
        f"## Speculative decoding: {meta.get('model')}",
        "",
        f"`{meta.get('command')}`",
        "",
        f"{meta.get('date')}, commit {meta.get('commit')}, {meta.get('device')}, copy "
        f"{fmt(meta.get('copy_GBps'))} GB/s, torch {meta.get('torch')}",
        "",
    ]
    lines += [f"- {k}: {v}" for k, v in meta.get("workloads", {}).items()]
    lines += [f"- {k}: `{v}`" for k, v in meta.get("variants", {}).items()]
    lines += [f"- NOTE: {n}" for n in meta.get("notes", [])]
    lines += ["", table(rows), ""]
    lines += ["tok/s: output tokens / wall time of the batch's generate calls (prefill included); "
              f"speedup and identical (greedy output ids equal): against `{meta.get('baseline')}` "
              "in the same run; acceptance: accepted / drafted; accept len: (accepted + verify "
              "steps) / verify steps, per request; ms/step: the scheduler's mean launch-to-launch "
              "time of a decode or verify step."]  # fmt: skip
    return "\n".join(lines)
