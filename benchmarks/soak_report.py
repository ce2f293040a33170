"""Soak benchmark results: outcomes by kind and status, server RSS over time, KV drift at idle
points, the verdict and the text tables."""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MB = 1 << 20


@dataclass(frozen=True)
class Outcome:
    """One request of the soak: its kind, how it ended ("200", "400", "stream-error", "ReadTimeout",
    ...) and its latency in seconds."""

    kind: str
    status: str
    latency: float

    @property
    def ok(self) -> bool:
        return self.status == "200"


@dataclass(frozen=True)
class IdlePoint:
    """The server's KV accounting at a moment nothing ran (the workers paused and drained)."""

    t: float  # seconds since the soak started
    rss: int  # bytes, the server's process tree
    state: dict[str, Any]  # /server_info internal_states[0]

    @property
    def drift(self) -> int:
        """free + evictable + protected - total: 0 unless KV slots leaked (or were counted twice)."""
        s = self.state
        held = s["free_tokens"] + s["evictable_tokens"] + s["protected_tokens"]
        return int(held - s["max_total_tokens"])

    @property
    def idle(self) -> bool:
        return self.state["num_running"] == 0 and self.state["num_waiting"] == 0

    @property
    def clean(self) -> bool:
        return self.idle and self.drift == 0 and self.state["protected_tokens"] == 0


##### Server memory #####


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and all its descendants (psutil when installed, else /proc)."""
    try:
        import psutil
    except ImportError:
        return _proc_tree_rss(pid)
    root = psutil.Process(pid)
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


def _proc_tree_rss(pid: int, proc: Path = Path("/proc")) -> int:
    children: dict[int, list[int]] = defaultdict(list)
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces and ")"
            children[ppid].append(int(entry.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            pages = int((proc / str(p) / "statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue
        total += pages * os.sysconf("SC_PAGE_SIZE")
    return total


def rss_slope_mb_per_min(samples: list[tuple[float, int]]) -> float | None:
    """Least-squares growth of (seconds, bytes) samples in MB per minute; None under 2 samples."""
    if len(samples) < 2 or samples[-1][0] == samples[0][0]:
        return None
    t = np.array([s[0] for s in samples]) / 60.0
    y = np.array([s[1] for s in samples], dtype=np.float64) / MB
    return float(np.polyfit(t, y, 1)[0])


##### Summary #####


def summarize(
    outcomes: list[Outcome],
    rss: list[tuple[float, int]],
    idle: list[IdlePoint],
    duration: float,
) -> dict[str, Any]:
    """Everything the report prints and writes: per kind (count, statuses, latencies), errors by
    status, RSS over time (the trend over idle points, where load does not blur it) and KV drift."""
    kinds: dict[str, dict[str, Any]] = {}
    for kind in sorted({o.kind for o in outcomes}):
        mine = [o for o in outcomes if o.kind == kind]
        ms = np.array([o.latency for o in mine if o.ok]) * 1000.0
        kinds[kind] = {
            "sent": len(mine),
            "statuses": dict(Counter(o.status for o in mine).most_common()),
            "p50_ms": float(np.median(ms)) if len(ms) else None,
            "p99_ms": float(np.percentile(ms, 99)) if len(ms) else None,
        }
    errors = Counter(o.status for o in outcomes if not o.ok)
    idle_rss = [(p.t, p.rss) for p in idle]
    return {
        "duration_s": duration,
        "requests": len(outcomes),
        "requests_per_s": len(outcomes) / duration if duration > 0 else 0.0,
        "ok": sum(o.ok for o in outcomes),
        "errors_by_status": dict(errors.most_common()),
        "kinds": kinds,
        "rss_mb": {
            "first": rss[0][1] / MB if rss else None,
            "last": rss[-1][1] / MB if rss else None,
            "max": max(r for _, r in rss) / MB if rss else None,
            "idle_slope_mb_per_min": rss_slope_mb_per_min(idle_rss),
            "samples": [[round(t, 1), round(r / MB, 1)] for t, r in rss],
        },
        "kv": {
            "idle_points": len(idle),
            "max_abs_drift": max((abs(p.drift) for p in idle), default=None),
            "all_clean": bool(idle) and all(p.clean for p in idle),
            "points": [_kv_row(p) for p in idle],
        },
    }


def verdict(summary: dict[str, Any]) -> list[str]:
    """What went wrong (empty: the soak passed): any request that did not end in a 200, a KV
    drift or a non-idle checkpoint, no idle checkpoint at all."""
    problems = [f"{n} request(s) ended in {s}" for s, n in summary["errors_by_status"].items()]
    kv = summary["kv"]
    if not kv["idle_points"]:
        problems.append("no idle checkpoint: the KV accounting was never read")
    for p in kv["points"]:
        if p["drift"] or p["protected"] or p["running"] or p["waiting"]:
            problems.append(f"KV not conserved or not idle at t={p['t']:.0f} s: {p}")
    return problems


def _kv_row(p: IdlePoint) -> dict[str, Any]:
    s = p.state
    return {
        "t": round(p.t, 1),
        "rss_mb": round(p.rss / MB, 1),
        "running": s["num_running"],
        "waiting": s["num_waiting"],
        "free": s["free_tokens"],
        "evictable": s["evictable_tokens"],
        "protected": s["protected_tokens"],
        "total": s["max_total_tokens"],
        "drift": p.drift,
    }


##### Text #####


def text_tables(summary: dict[str, Any]) -> str:
    """The short text report: requests by kind, errors by status, RSS, KV at the idle points."""
    lines = [
        f"{summary['requests']} requests in {summary['duration_s']:.0f} s "
        f"({summary['requests_per_s']:.1f}/s), {summary['ok']} ok",
        "",
        f"{'kind':<14}{'sent':>7}{'p50 ms':>10}{'p99 ms':>10}  statuses",
    ]
    for kind, k in summary["kinds"].items():
        statuses = ", ".join(f"{s}: {n}" for s, n in k["statuses"].items())
        lines.append(
            f"{kind:<14}{k['sent']:>7}{_num(k['p50_ms']):>10}{_num(k['p99_ms']):>10}  {statuses}"
        )
    errors = summary["errors_by_status"]
    lines += [
        "",
        "errors by status: " + (", ".join(f"{s}: {n}" for s, n in errors.items()) or "none"),
    ]
    rss = summary["rss_mb"]
    lines.append(
        f"server RSS (MB): first {_num(rss['first'])}, last {_num(rss['last'])}, max "
        f"{_num(rss['max'])}; trend over idle points {_num(rss['idle_slope_mb_per_min'], 2)} MB/min"
    )
    lines += [
        "",
        f"{'idle at s':>9}{'RSS MB':>9}{'free':>10}{'evictable':>11}{'protected':>11}{'drift':>7}",
    ]
    for p in summary["kv"]["points"]:
        lines.append(
            f"{p['t']:>9.0f}{p['rss_mb']:>9.1f}{p['free']:>10}{p['evictable']:>11}"
            f"{p['protected']:>11}{p['drift']:>7}"
        )
    return "\n".join(lines)


def _num(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}"
