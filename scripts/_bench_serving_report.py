"""The printed report of ``scripts/bench_serving.py``: tables, ratios, figures to reach.

Why a module of its own: turning every system's rows and the ping samples
into the text a run ends with (tok/s per concurrency, skiff against each
peer, TTFT, the turn profile, and the goals met or missed) is apart from
measuring them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from _bench_serving_common import STAGGER_S, THREADS, Row

from loadtest import percentile


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def report(
    systems: dict[str, dict[int, Row]],
    ping: dict[str, Any],
    cs: Sequence[int],
    n_new: int,
    k: int,
    prompts_tokens: tuple[int, int],
) -> list[str]:
    lines = [
        f"aggregate output tok/s: {n_new} new tokens/request (EOS suppressed), "
        f"{k} requests per concurrent user, prompts of {prompts_tokens[0]}-{prompts_tokens[1]} "
        f"tokens, {THREADS} threads",
        f"{'system':<20}" + "".join(f"{'c=' + str(c):>10}" for c in cs),
    ]
    for name, rows in systems.items():
        lines.append(
            f"{name:<20}" + "".join(f"{fmt(rows[c].tok_s) if c in rows else '-':>10}" for c in cs)
        )
    skiff = systems.get("skiff", {})
    lines.append("")
    for name, rows in systems.items():
        if name == "skiff":
            continue
        cells = [
            fmt(
                ratio(skiff[c].tok_s if c in skiff else None, rows[c].tok_s if c in rows else None),
                ".2f",
            )
            for c in cs
        ]
        lines.append(f"{'skiff / ' + name:<20}" + "".join(f"{x:>10}" for x in cells))
    lines.append("")
    lines.append(f"{'TTFT p50 ms':<20}" + "".join(f"{'c=' + str(c):>10}" for c in cs))
    for name, rows in systems.items():
        if any(rows[c].ttft_p50_ms is not None for c in cs if c in rows):
            lines.append(
                f"{name:<20}"
                + "".join(f"{fmt(rows[c].ttft_p50_ms if c in rows else None):>10}" for c in cs)
            )
    errs = {n: sum(r.errors for r in rows.values()) for n, rows in systems.items()}
    if any(errs.values()):
        lines.append("errors: " + ", ".join(f"{n}={e}" for n, e in errs.items() if e))
    for name, rows in systems.items():
        short = {c: r.tokens for c, r in rows.items() if r.tokens != r.requests * n_new}
        if short:
            lines.append(f"WARNING {name}: fewer tokens than requested at c={sorted(short)}")
    raw = systems.get("raw", {})
    if raw:
        lines.append(
            f"{'raw decode step ms':<20}"
            + "".join(
                f"{fmt(raw[c].extra.get('decode_step_ms') if c in raw else None, '.2f'):>10}"
                for c in cs
            )
        )
    if skiff:
        lines.append(
            f"{'skiff mean turn ms':<20}"
            + "".join(
                f"{fmt(skiff[c].extra.get('mean_turn_ms') if c in skiff else None, '.2f'):>10}"
                for c in cs
            )
        )

    c_lo, c_hi = min(cs), max(cs)
    mixes = [
        (n, rows[c_hi].extra.get("forward_mix") if c_hi in rows else None)
        for n, rows in (("raw", raw), ("skiff", skiff))
    ]
    if any(mix for _, mix in mixes):
        lines.append("")
        lines.append(f"c={c_hi}: forwards without / with prompt pieces (llama_decode and rows)")
        for name, mix in mixes:
            if mix:
                lines.append(f"  {name:<6}" + _mix_line(mix))
    prof = skiff[c_hi].extra.get("profile_ms_per_forward") if c_hi in skiff else None
    if prof:
        lines.append("")
        lines.append(f"skiff c={c_hi}: where a turn's time goes, ms per forward (stats.profile)")
        for part, ms in prof.items():
            lines.append(f"  {part:<24}{ms:8.3f}  {100 * ms / prof['wall']:5.1f}%")
    ttft_lo = skiff[c_lo].extra.get("ttft_staggered_p50_ms") if c_lo in skiff else None
    ttft_hi = skiff[c_hi].extra.get("ttft_staggered_p50_ms") if c_hi in skiff else None
    lines.append("")
    lines.append(
        f"skiff TTFT p50 (users started {STAGGER_S} s apart): "
        f"c={c_lo} {fmt(ttft_lo)} ms, c={c_hi} {fmt(ttft_hi)} ms, "
        f"ratio {fmt(ratio(ttft_hi, ttft_lo), '.2f')}"
    )
    samples = ping.get("samples_ms") or []
    p50 = percentile(samples, 50) if samples else None
    p99 = percentile(samples, 99) if samples else None
    turn = ping.get("mean_turn_ms")
    turn_p99 = ping.get("turn_p99_ms")
    lines.append(
        f"ping during {c_hi} skiff streams: n={len(samples)} lost={ping.get('lost', '-')} "
        f"p50 {fmt(p50, '.2f')} ms, p99 {fmt(p99, '.2f')} ms; "
        f"skiff scheduler turn mean {fmt(turn, '.2f')} ms, p99 {fmt(turn_p99, '.2f')} ms, "
        f"max {fmt(ping.get('turn_max_ms'), '.2f')} ms"
    )

    def target(label: str, value: float | None, goal: float, le: bool = False) -> str:
        if value is None:
            return f"  {label}: - (not measured)"
        met = value <= goal if le else value >= goal
        return f"  {label}: {value:.2f} {'OK' if met else 'MISSED'}"

    lines.append("")
    lines.append("figures to reach:")
    r_raw = ratio(
        skiff[c_hi].tok_s if c_hi in skiff else None, raw[c_hi].tok_s if c_hi in raw else None
    )
    lines.append(target(f"skiff c{c_hi} / raw c{c_hi} >= 0.97", r_raw, 0.97))
    peer = systems.get("llama_cpp.server", {})
    r_peer = ratio(
        skiff[c_hi].tok_s if c_hi in skiff else None, peer[c_hi].tok_s if c_hi in peer else None
    )
    lines.append(target(f"skiff c{c_hi} / llama_cpp.server c{c_hi} >= 3", r_peer, 3.0))
    lines.append(
        target(f"TTFT p50 c{c_hi} / TTFT p50 c{c_lo} <= 2", ratio(ttft_hi, ttft_lo), 2.0, le=True)
    )
    # A ping waits for at most the forward in progress. Pings land in long
    # (prefill) turns more often than short ones, so the bound is the longest turn.
    lines.append(
        target("ping p99 / longest turn <= 1", ratio(p99, ping.get("turn_max_ms")), 1.0, le=True)
    )
    return lines


def _mix_line(mix: dict[str, dict[str, float]]) -> str:
    d, p = mix["decode_only"], mix["with_prompt"]
    d_ms = 1e3 * d["seconds"] / max(1, d["forwards"])
    p_ms = 1e3 * p["seconds"] / max(1, p["forwards"])
    return (
        f"decode only {d['forwards']:.0f} x {d_ms:.1f} ms = {d['seconds']:.2f} s | "
        f"with prompts {p['forwards']:.0f} x {p_ms:.1f} ms = {p['seconds']:.2f} s "
        f"({p.get('prompt_tokens', 0):.0f} prompt tokens) | "
        f"total {d['seconds'] + p['seconds']:.2f} s"
    )
