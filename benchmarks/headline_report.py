"""The headline table and plot of benchmarks/headline.py: rows from each part's JSON result, the
markdown BENCHMARKS.md takes, and a PNG of the figures."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench_utils import markdown_table


@dataclass(frozen=True)
class Row:
    """One headline figure: what it is, weft's value, what it stands next to in the same run."""

    part: str  # the part whose command measured it
    figure: str
    value: str
    against: str  # the peer or ceiling measured in the same run
    device: str
    date: str  # YYYY-MM-DD (commit)


def rows_of(parts: dict[str, dict[str, Any]]) -> list[Row]:
    """The headline rows of every part that has a result, in the suite's order."""
    rows: list[Row] = []
    for name, builder in BUILDERS.items():
        if name in parts:
            rows += builder(name, parts[name])
    return rows


def _when(result: dict[str, Any]) -> str:
    return f"{str(result.get('date', '?'))[:10]} ({result.get('commit', '?')})"


def _row(part: str, result: dict[str, Any], figure: str, value: str, against: str) -> Row:
    device = str(result.get("device", "?")).removeprefix("NVIDIA ")
    return Row(part, figure, value, against, device, _when(result))


def _copy(part: str, result: dict[str, Any]) -> list[Row]:
    gbps = result.get("copy_GBps")
    if not gbps:
        return []
    return [_row(part, result, "device-to-device copy, bytes read + written", f"{gbps:,.0f} GB/s",
                 "the ceiling of every row below (each part measures its own)")]  # fmt: skip


def _decode(part: str, result: dict[str, Any]) -> list[Row]:
    """Per batch: triton + CUDA graphs, pipelined, against the roofline and FlashInfer's step."""
    steps = [r for r in result.get("rows", []) if "error" not in r]
    ours = [r for r in steps if not r["backend"].startswith("flashinfer")]  # triton+graph
    peer = {r["batch"]: r for r in steps if r["backend"].startswith("flashinfer")}
    rows = []
    for r in ours:
        against = (f"roofline {r['roofline_ms']:.2f} ms at {result.get('copy_GBps', 0):,.0f} GB/s "
                   f"({r['x_roofline']:.2f}×)")  # fmt: skip
        if r["batch"] in peer:
            fi = peer[r["batch"]]["pipelined_ms"]
            against += f"; FlashInfer {fi:.2f} ms ({fi / r['pipelined_ms']:.2f}× weft's time)"
        else:
            against += "; FlashInfer not installed"
        figure = f"decode step, batch {r['batch']}, {r['context']} context ({r['backend']})"
        rows.append(_row(part, result, figure, f"{r['pipelined_ms']:.2f} ms", against))
    return rows


def _by_key(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """offline.py's runs that finished, by key."""
    return {r["key"]: r for r in result.get("results", []) if not r.get("error")}


def _steps(run: dict[str, Any]) -> str:
    """'decode 1,998 × 28.6 ms, extend 123 × 189.6 ms' (the scheduler's own step times)."""
    steps = run.get("steps") or {}
    parts = [f"{kind} {steps[kind]['steps']:,} × {steps[kind]['mean_ms']:.1f} ms"
             for kind in ("decode", "extend") if steps.get(kind, {}).get("steps")]  # fmt: skip
    return ", ".join(parts)


def _offline(part: str, result: dict[str, Any]) -> list[Row]:
    run = _by_key(result).get("offline")
    if run is None or not run.get("output_tok_per_s"):
        return []
    against = f"copy {result.get('copy_GBps', 0):,.0f} GB/s in the same run; {_steps(run)}"
    if hf := _by_key(result).get("hf"):
        against += f"; HF transformers {hf['output_tok_per_s']:,.0f} tok/s"
    value = f"{run['output_tok_per_s']:,.0f} output tok/s"
    return [_row(part, result, f"offline {run['shape']} in/out", value, against)]


def _prefix(part: str, result: dict[str, Any]) -> list[Row]:
    runs = _by_key(result)
    on, off = runs.get("prefix:on"), runs.get("prefix:off")
    if not (on and off and on.get("output_tok_per_s") and off.get("output_tok_per_s")):
        return []
    ratio = on["output_tok_per_s"] / off["output_tok_per_s"]
    against = (f"radix cache off {off['seconds']:.1f} s ({off['output_tok_per_s']:,.0f} tok/s) vs "
               f"on {on['seconds']:.1f} s ({on['output_tok_per_s']:,.0f} tok/s)")  # fmt: skip
    figure = f"prefix sharing {on['shape']}, radix cache on / off"
    return [_row(part, result, figure, f"{ratio:.2f}×", against)]


def _constrained(part: str, result: dict[str, Any]) -> list[Row]:
    runs = _by_key(result)
    con, free = runs.get("constrained"), runs.get("unconstrained")
    if not (con and free and con.get("ms_per_output_token") and free.get("ms_per_output_token")):
        return []
    a, b = con["ms_per_output_token"], free["ms_per_output_token"]
    fills = con.get("mask_fill") or {}
    against = (f"unconstrained, same prompts and lengths: {b:.3f} vs {a:.3f} ms per output token; "
               f"mask fill p99 {fills.get('p99_us', 0):.1f} µs")  # fmt: skip
    figure = f"JSON-schema decoding {con['shape']}, overhead per output token"
    return [_row(part, result, figure, f"{100 * (a / b - 1):+.1f}%", against)]


BUILDERS = {"copy": _copy, "decode": _decode, "offline": _offline, "prefix": _prefix,
            "constrained": _constrained, "fp8_decode": _decode, "fp8_offline": _offline}  # fmt: skip


def markdown(rows: list[Row], parts: dict[str, dict[str, Any]]) -> str:
    """The table, then each part's exact command (the table's `run` column names the part)."""
    head = ["figure", "weft", "peer or ceiling, same run", "GPU", "date (commit)", "run"]
    body = [[r.figure, f"**{r.value}**", r.against, r.device, r.date, f"`{r.part}`"] for r in rows]
    lines = [markdown_table(head, body), ""]
    for name in BUILDERS:
        if name in parts:
            lines.append(f"- `{name}`: `{parts[name].get('command', '?')}`")
    return "\n".join(lines) + "\n"


def to_json(rows: list[Row]) -> list[dict[str, str]]:
    return [asdict(r) for r in rows]


##### The plot #####


def plot(parts: dict[str, dict[str, Any]], path: Path) -> bool:
    """A PNG of the decode steps against their roofline and peer, offline throughput and the
    prefix-sharing runs; False (and nothing written) without matplotlib or results."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [p for p in (_decode_panel(parts), _throughput_panel(parts)) if p]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, unit, groups) in zip(axes[0], panels, strict=True):
        width = 0.8 / max(len(g) for g in groups.values())
        shown: set[str] = set()
        for j, values in enumerate(groups.values()):
            names = sorted(values, key=_series_order)
            for i, name in enumerate(names):
                x = j + (i - (len(names) - 1) / 2) * width
                bar = ax.bar(x, values[name], width, color=colors[_series_order(name) % len(colors)],
                             label=None if name in shown else name)  # fmt: skip
                ax.bar_label(bar, labels=[_short(values[name])], fontsize=7)
                shown.add(name)
        ax.set_xticks(range(len(groups)), list(groups))
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(unit)
        ax.legend(fontsize=8)
    device = next((str(p.get("device")) for p in parts.values() if p.get("device")), "?")
    dates = sorted({str(p.get("date", ""))[:10] for p in parts.values()} - {""})
    fig.suptitle(f"weft headline figures: {device}, {', '.join(dates)}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _short(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.2f}"


def _series_order(name: str) -> int:
    order = ["weft", "FlashInfer", "roofline", "radix cache on", "radix cache off"]
    return order.index(name) if name in order else len(order)


Panel = tuple[str, str, dict[str, dict[str, float]]]


def _decode_panel(parts: dict[str, dict[str, Any]]) -> Panel | None:
    groups: dict[str, dict[str, float]] = {}
    for r in parts.get("decode", {}).get("rows", []):
        if "error" in r:
            continue
        g = groups.setdefault(f"batch {r['batch']}", {})
        if r["backend"].startswith("flashinfer"):
            g["FlashInfer"] = r["pipelined_ms"]
        else:
            g["weft"], g["roofline"] = r["pipelined_ms"], r["roofline_ms"]
    return (
        ("Llama-3.1-8B decode step, 2048 context", "ms (lower is better)", groups)
        if groups
        else None
    )


def _throughput_panel(parts: dict[str, dict[str, Any]]) -> Panel | None:
    groups: dict[str, dict[str, float]] = {}
    offline = _by_key(parts.get("offline", {})).get("offline")
    if offline and offline.get("output_tok_per_s"):
        groups["offline 1000 × 1000/1000"] = {"weft": offline["output_tok_per_s"]}
    runs = _by_key(parts.get("prefix", {}))
    if runs.get("prefix:on") and runs.get("prefix:off"):
        groups["prefix sharing 64 × 16"] = {
            "radix cache on": runs["prefix:on"]["output_tok_per_s"] or 0.0,
            "radix cache off": runs["prefix:off"]["output_tok_per_s"] or 0.0,
        }
    return (
        ("Llama-3.1-8B offline throughput", "output tok/s (higher is better)", groups)
        if groups
        else None
    )
