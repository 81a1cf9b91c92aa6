"""The figures of ``scripts/soak.py``: growth after warm-up, the plot, the report.

Why a module of its own: they are pure functions of the samples (warm-up
and windows, medians, RSS and object growth per process, throughput; then
``soak.png`` and the printed summary), so they are read and tested
(tests/test_soak.py) without a cluster.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _soak_watch import Watched

MiB = 1 << 20


def windows(run_s: float, interval: float) -> tuple[float, float]:
    """(warm-up, window) in seconds for a run of ``run_s``."""
    warmup = min(max(60.0, 0.2 * run_s), 0.5 * run_s)
    window = max(0.1 * run_s, 3 * interval)
    return warmup, min(window, max(interval, (run_s - warmup) / 2))


def growth(
    points: list[tuple[float, float]], run_s: float, warmup_s: float, window_s: float
) -> dict[str, float] | None:
    """Median of the last window against the first window after warm-up."""
    base = [v for t, v in points if warmup_s <= t < warmup_s + window_s]
    last = [v for t, v in points if t >= run_s - window_s]
    if not base or not last:
        return None
    b, end = statistics.median(base), statistics.median(last)
    if b <= 0:
        return None
    return {"base": b, "last": end, "growth_pct": round(100 * (end - b) / b, 2)}


def series(samples: list[dict[str, Any]], name: str, key: str) -> list[tuple[float, float]]:
    return [
        (float(s["t"]), float(v))
        for s in samples
        if s["phase"] == "load" and (v := s["procs"].get(name, {}).get(key)) is not None
    ]


def analyse(
    samples: list[dict[str, Any]], watched: list[Watched], run_s: float, interval: float
) -> dict[str, Any]:
    warmup, window = windows(run_s, interval)
    rss: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    for w in watched:
        g = growth(series(samples, w.name, "rss"), run_s, warmup, window)
        if g is not None:
            g = {**g, "base_mib": round(g["base"] / MiB, 1), "last_mib": round(g["last"] / MiB, 1)}
        rss[w.name] = g
        objects[w.name] = growth(series(samples, w.name, "objects"), run_s, warmup, window)
    load = [s for s in samples if s["phase"] == "load" and "tok_s" in s]
    after = [s for s in load if s["t"] >= warmup]
    return {
        "warmup_s": round(warmup, 1),
        "window_s": round(window, 1),
        "rss": rss,
        "objects": objects,
        "rss_growth_max_pct": max(
            (g["growth_pct"] for g in rss.values() if g is not None), default=None
        ),
        "throughput": {
            "mean_tok_s": round(statistics.fmean(s["tok_s"] for s in load), 2) if load else None,
            "after_warmup_tok_s": round(statistics.fmean(s["tok_s"] for s in after), 2)
            if after
            else None,
            "mean_engine_tok_s": round(statistics.fmean(s["engine_tok_s"] for s in load), 2)
            if load
            else None,
        },
    }


def plot(
    samples: list[dict[str, Any]], watched: list[Watched], figures: dict[str, Any], path: Path
) -> None:
    """RSS per process, RSS and objects relative to the post-warm-up
    baseline (where growth shows), and throughput; warm-up shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(11, 10), sharex=True)
    warmup, window = figures["warmup_s"], figures["window_s"]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, w in enumerate(watched):
        color = colors[i % len(colors)]
        rss = [(s["t"], v) for s in samples if (v := s["procs"].get(w.name, {}).get("rss"))]
        top.plot([t for t, _ in rss], [v / MiB for _, v in rss], color=color, label=w.name)
        for key, style, what in (("rss", "-", "RSS"), ("objects", "--", "objects")):
            g = figures[key].get(w.name)
            if not g:
                continue
            pts = [(s["t"], v) for s in samples if (v := s["procs"].get(w.name, {}).get(key))]
            mid.plot(
                [t for t, _ in pts],
                [100 * (v - g["base"]) / g["base"] for _, v in pts],
                style,
                color=color,
                label=f"{w.name} {what} {g['growth_pct']:+.2f}%",
            )
    run_s = max((s["t"] for s in samples if s["phase"] == "load"), default=0.0)
    for ax in (top, mid, low):
        ax.axvspan(0, warmup, color="gray", alpha=0.12, lw=0)
        ax.axvline(run_s, color="black", lw=0.8, ls=":")
        ax.grid(alpha=0.3)
    mid.axvspan(warmup, warmup + window, color="tab:blue", alpha=0.08, lw=0)
    mid.axvspan(run_s - window, run_s, color="tab:red", alpha=0.08, lw=0)
    mid.axhline(0, color="black", lw=0.6)
    top.set_ylabel("RSS (MiB)")
    top.set_yscale("log")
    top.yaxis.set_major_formatter(ScalarFormatter())
    top.yaxis.set_minor_formatter(ScalarFormatter())
    top.tick_params(axis="y", which="minor", labelsize=7)
    top.legend(loc="center left", fontsize=8)
    top.set_title("RSS per process (psutil)", fontsize=9)
    mid.set_ylabel("change vs baseline (%)")
    mid.set_title(
        "RSS (solid) and gc-tracked objects (dashed) against the median of the blue window; "
        f"growth = red window median; worst RSS {figures['rss_growth_max_pct']}%",
        fontsize=9,
    )
    mid.legend(loc="upper left", fontsize=7, ncol=2)
    loaded = [s for s in samples if "tok_s" in s]
    xs = [s["t"] for s in loaded]
    low.plot(xs, [s["tok_s"] for s in loaded], label="generated tokens/s (clients)")
    low.plot(
        xs,
        [s["engine_tok_s"] for s in loaded],
        label="tokens evaluated/s (workers: prompts + decode)",
        alpha=0.7,
    )
    low.set_ylabel("tokens/s")
    low.set_xlabel("seconds since the load started (gray: warm-up; dotted: load stopped)")
    low.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _pct(g: dict[str, Any] | None) -> str:
    return "n/a" if g is None else f"{g['growth_pct']:+.2f}%"


def report(summary: dict[str, Any]) -> None:
    f = summary["figures"]
    cfg = summary["config"]
    load = summary["load"]
    for name, g in f["rss"].items():
        mib = "" if g is None else f" ({g['base_mib']} -> {g['last_mib']} MiB)"
        print(f"  {name:10s} RSS {_pct(g)}{mib}, objects {_pct(f['objects'].get(name))}")
    tp = f["throughput"]
    print(
        f"  throughput: {tp['mean_tok_s']} generated tok/s, "
        f"{tp['mean_engine_tok_s']} evaluated tok/s"
    )
    print(f"  actions: {load['actions']}")
    print(f"  errors by code: {load['errors_by_code']} (unexpected: {load['unexpected_by_code']})")
    print(f"  log lines by level: {summary['log_levels']}")
    judged = "" if cfg["rss_judged"] else f", not judged under {summary['config']['minutes']:g} min"
    rss = f["rss_growth_max_pct"]
    rss_text = (
        "n/a" if rss is None or (isinstance(rss, float) and math.isnan(rss)) else f"{rss:.2f}%"
    )
    print(
        f"RSS growth after warm-up: {rss_text} (bar < {cfg['rss_bar_pct']:g}%{judged}), "
        f"stuck lanes: {summary['stuck_lanes']} (bar 0)"
    )
    print("PASS" if summary["passed"] else f"FAIL: {'; '.join(summary['misses'])}", flush=True)
