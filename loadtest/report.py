"""Presenting a summary: a text table, a JSON file, a figure."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_ROWS = (
    ("TTFT", "ttft_ms"),
    ("ITL", "itl_ms"),
    ("TPOT", "tpot_ms"),
    ("E2E", "e2e_ms"),
)
_COLS = ("mean", "p50", "p90", "p99", "max")


def _num(value: Any, width: int = 10) -> str:
    return f"{value:>{width}.1f}" if isinstance(value, int | float) else f"{'-':>{width}}"


def format_table(summary: dict[str, Any]) -> str:
    cfg = summary.get("config", {})
    req = summary["requests"]
    tok = summary["tokens"]
    thr = summary["throughput"]
    if cfg.get("mode") == "open":
        load = f"open loop, {cfg.get('rate')} req/s (Poisson)"
    else:
        load = f"closed loop, concurrency {cfg.get('concurrency')}"
    endpoints = cfg.get("endpoints") or []
    lines = [
        f"skiff-loadtest: {load}, {len(endpoints)} endpoint(s), max_tokens {cfg.get('max_tokens')}",
        f"requests   {req['sent']} sent, {req['ok']} ok, {req['errors']} errors "
        f"in {summary['duration_s']:.2f} s",
        f"tokens     {tok['output']} output, {tok['prompt']} prompt",
        f"throughput {thr['output_tok_s']:.1f} output tok/s, {thr['requests_per_s']:.2f} req/s",
        "",
        f"{'latency (ms)':<14}{'n':>6}" + "".join(f"{c:>10}" for c in _COLS),
    ]
    for label, key in _ROWS:
        dist = summary[key]
        lines.append(f"{label:<14}{dist['n']:>6}" + "".join(_num(dist[c]) for c in _COLS))
    server = summary.get("server_timings_ms") or {}
    for key, dist in server.items():
        lines.append(f"{'srv ' + key:<14}{dist['n']:>6}" + "".join(_num(dist[c]) for c in _COLS))
    codes = req.get("error_codes") or {}
    lines.append("")
    lines.append("errors by code: " + (", ".join(f"{k}={v}" for k, v in codes.items()) or "none"))
    reasons = req.get("finish_reasons") or {}
    lines.append("finish reasons: " + (", ".join(f"{k}={v}" for k, v in reasons.items()) or "none"))
    return "\n".join(lines)


def write_json(summary: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(summary, indent=2, sort_keys=False) + "\n")


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    s = sorted(values)
    n = len(s)
    return s, [(i + 1) / n for i in range(n)]


def write_plot(summary: dict[str, Any], path: str | Path) -> None:
    """Latency CDFs (TTFT, E2E) and output throughput over time, as one image."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, key in (("TTFT", "ttft_ms"), ("E2E", "e2e_ms")):
        values = summary["samples"][key]
        if values:
            xs, ys = _cdf(values)
            left.step(xs, ys, where="post", label=f"{label} (p50 {summary[key]['p50']:.0f} ms)")
    left.set_xlabel("latency (ms)")
    left.set_ylabel("fraction of requests")
    left.set_ylim(0, 1.02)
    left.set_title("latency CDF")
    left.grid(alpha=0.3)
    left.legend(loc="lower right")

    tl = summary["timeline"]
    right.step(tl["t_s"], tl["output_tok_s"], where="post", color="tab:green")
    mean = summary["throughput"]["output_tok_s"]
    right.axhline(mean, color="gray", linestyle="--", label=f"mean {mean:.1f} tok/s")
    right.set_xlabel("time since start (s)")
    right.set_ylabel(f"output tok/s ({tl['bin_s']:g} s bins)")
    right.set_title("throughput over time")
    right.grid(alpha=0.3)
    right.legend(loc="lower right")

    cfg = summary.get("config", {})
    mode = (
        f"concurrency {cfg.get('concurrency')}"
        if cfg.get("mode") != "open"
        else f"{cfg.get('rate')} req/s"
    )
    req = summary["requests"]
    fig.suptitle(f"skiff-loadtest: {mode}, {req['ok']} ok / {req['errors']} errors")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
