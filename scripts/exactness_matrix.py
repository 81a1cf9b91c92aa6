"""Every exactness claim, under every CPU variant this host can run.

skiff promises that a session's logits do not depend on where or with whom it
ran. Those are claims about ggml's arithmetic, and ggml has one CPU backend
per x86 level (x64, sse42, sandybridge, haswell, skylakex, icelake, zen4 ...)
with different kernels. This script loads each variant in turn (the
portable build, ``scripts/build_llama_portable.sh``, built once and cached,
with only that variant left in its backend directory; or the tuned build
alone with ``--tuned``), runs the claims at the engine
level in a child process per variant and rule, and prints a table of
variant x claim -> max abs logit diff (0 is exact), then the rule each
variant needs: the switches of ``worker/engine/kernels.py`` under which
every claim holds, cheapest first: ``q8-gemm`` (``fa-rows`` with the wide
Q8_0 matmul, where the variant has it), ``fa-rows`` (``tiled-dot`` with the
rows-at-once attention), ``tiled-dot`` (the tiled K-quant matmul
with its dots), then ``tinyblas``, then ``strict``.

Claims, each at every ``--lengths`` N of KV before the checked rows:
- ``batch``: lanes decoded in one forward (B = 2, 5, 8) vs each alone;
- ``span``: 4, 8, 16 rows of one session in one forward vs one at a time;
- ``chunks``: an N-token prompt prefilled in pieces of 64 / 100 vs 512;
- ``migrate``: state out of one lane into another context of another
  layout (2 lanes), then 4 decode steps vs the session that never moved;
- ``reuse``: a prefix kept from another prompt's lane, the rest prefilled,
  vs a cold prefill (what exact prefix reuse does);
- ``trim``: 4 steps, trimmed back, the same 4 steps again;
- ``threads``: 1 thread vs 2.

    .venv/bin/python scripts/exactness_matrix.py            # portable build (~30 min once)
    .venv/bin/python scripts/exactness_matrix.py --tuned    # this venv's build only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import venv
from pathlib import Path
from typing import Any

from _machine import cpu_flags

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

CLAIMS = ("batch", "span", "chunks", "migrate", "reuse", "trim", "threads")
# Reported, not part of a rule: a unified KV cache (only a worker with
# --ctx-per-lane above ctx / lanes uses one) after another session freed
# cells ahead of this one, against a per-lane cache.
# llama.cpp then puts the session's new tokens before its older cells, and
# the one-row attention loop sums them in that order (docs/exactness.md).
KNOWN = ("unified",)
RULES = {
    "tinyblas": {"llamafile": True},
    "strict": {"llamafile": False},
    "tiled-dot": {"llamafile": True, "tiled_dot": True},
    "fa-rows": {"llamafile": True, "tiled_dot": True, "fa_rows": True},
    "q8-gemm": {"llamafile": True, "tiled_dot": True, "fa_rows": True, "q8_gemm": True},
    "upstream": {"fa_one_row": False, "tiled_mm": True, "llamafile": True},
}


# -- the child: one variant, one rule ------------------------------------------


def _claims(lengths: list[int], rule: dict[str, bool], model: str) -> dict[str, float]:
    import numpy as np

    from worker.engine import Engine, EngineConfig, Segment, kernels

    forced = kernels.KernelRule(**rule)

    def engine(lanes: int, threads: int = 2) -> Engine:
        cfg = EngineConfig(
            model, n_ctx=lanes * 2048, n_seq=lanes, n_threads=threads, kernel_rule=forced
        )
        return Engine(cfg)

    def fill(e: Engine, lane: int, toks: list[int], pos0: int = 0, chunk: int = 512) -> None:
        for at in range(0, len(toks), chunk):
            assert e.decode([Segment(lane, toks[at : at + chunk], pos0 + at, "none")]).ok

    def steps(e: Engine, lane: int, toks: list[int], pos0: int) -> list[np.ndarray]:
        out = []
        for i, t in enumerate(toks):
            assert e.decode([Segment(lane, [t], pos0 + i, "last")]).ok
            out.append(e.logits_row(e.output_index(0)).copy())
        return out

    def diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
        return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))

    main = engine(8)
    other = engine(2)
    base = main.tokenize((ROOT / "README.md").read_text() * 8)
    worst = dict.fromkeys(CLAIMS + KNOWN, 0.0)

    def note(claim: str, value: float) -> None:
        worst[claim] = max(worst[claim], value)

    for n in lengths:
        prompt, nxt = base[:n], base[n : n + 16]
        main.seq_clear(0)
        fill(main, 0, prompt)
        state = main.state_get(0)
        for lane in range(1, 8):  # the same prompt in every lane (state copies)
            main.seq_clear(lane)
            assert main.state_set(lane, state)
        one = steps(main, 0, nxt, n)  # lane 0 alone, one token a forward: the reference
        ref = one[:4]
        alone = [steps(main, lane, nxt[lane : lane + 1], n) for lane in range(1, 8)]
        alone.insert(0, one[:1])
        for lane in range(8):
            main.seq_rm(lane, n, -1)
        for b in (2, 5, 8):  # batch
            assert main.decode([Segment(lane, [nxt[lane]], n, "last") for lane in range(b)]).ok
            got = [[main.logits_row(main.output_index(lane)).copy()] for lane in range(b)]
            note("batch", max(diff(alone[lane], got[lane]) for lane in range(b)))
            for lane in range(b):
                main.seq_rm(lane, n, -1)
        for k in (4, 8, 16):  # span
            assert main.decode([Segment(0, nxt[:k], n, "all")]).ok
            rows = [main.logits_row(main.output_index(0, i)).copy() for i in range(k)]
            note("span", diff(one[:k], rows))
            main.seq_rm(0, n, -1)
        note("trim", diff(ref, steps(main, 0, nxt[:4], n)))  # trim (lane 0 was trimmed)
        for chunk in (64, 100):  # chunks (lane 0 was prefilled in 512s)
            main.seq_clear(1)
            fill(main, 1, prompt, chunk=chunk)
            note("chunks", diff(ref, steps(main, 1, nxt[:4], n)))
        other.seq_clear(1)  # migrate: into a context of another layout
        assert other.state_set(1, state)
        note("migrate", diff(ref, steps(other, 1, nxt[:4], n)))
        donor = base[: n // 2] + base[3000 : 3000 + n - n // 2]  # reuse
        main.seq_clear(2)
        fill(main, 2, donor)
        main.seq_rm(2, n // 2, -1)
        fill(main, 2, prompt[n // 2 :], pos0=n // 2)
        note("reuse", diff(ref, steps(main, 2, nxt[:4], n)))
    main.close()
    other.close()
    single = engine(1, threads=1)  # threads
    n = lengths[-1]
    fill(single, 0, base[:n])
    note("threads", diff(ref, steps(single, 0, base[n : n + 4], n)))
    single.close()
    unified = Engine(EngineConfig(model, n_ctx=4096, n_seq=2, kv_unified=True, kernel_rule=forced))
    fill(unified, 0, base[:300])  # another session ahead of this one ...
    fill(unified, 1, base[:120])
    unified.seq_clear(0)  # ... leaves: its cells are a hole before ours
    near = steps(unified, 1, base[120:128], 120)
    unified.close()
    per_lane = engine(2)
    fill(per_lane, 1, base[:120])
    worst["unified"] = diff(steps(per_lane, 1, base[120:128], 120), near)
    per_lane.close()
    return worst


# -- the parent: builds, variants, the table --------------------------------------


def _portable(cache: Path) -> tuple[Path, Path]:
    """(python of a venv with the portable wheel, its backend dir); built once."""
    import hashlib

    import build_llama
    import llama_patch

    key = hashlib.sha256(
        f"{build_llama.VERSION} portable {llama_patch.fingerprint()}".encode()
    ).hexdigest()[:12]
    home = cache / "portable" / key
    backends, wheels, env = home / "backends", home / "wheels", home / "venv"
    py = env / "bin" / "python"
    if not list(backends.glob("libggml-cpu-*.so")):
        print(f"building the portable wheel into {home} (once, ~30 min)", file=sys.stderr)
        script = ROOT / "scripts" / "build_llama_portable.sh"
        subprocess.run([str(script), str(wheels), str(backends)], check=True)
    if not py.exists():
        venv.create(env, with_pip=True)
        (wheel,) = wheels.glob("llama_cpp_python-*.whl")
        pip = [str(py), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "--no-deps", str(wheel)], check=True)
        subprocess.run([*pip, "numpy", "typing-extensions", "diskcache", "jinja2"], check=True)
    return py, backends


def _only(backend: Path) -> None:
    """Leave exactly ``backend`` in the portable build's backend directory (the
    one compiled in as GGML_BACKEND_DIR), the rest parked in ``all/``: ggml
    loads the best variant it finds, so this is how one variant is chosen."""
    folder = backend.parent
    parked = folder / "all"
    parked.mkdir(exist_ok=True)
    for lib in folder.glob("libggml-cpu-*.so"):
        lib.rename(parked / lib.name)
    os.link(parked / backend.name, backend)


def _restore(folder: Path) -> None:
    parked = folder / "all"
    if not parked.is_dir():
        return
    for lib in folder.glob("libggml-cpu-*.so"):
        lib.unlink()
    for lib in parked.glob("libggml-cpu-*.so"):
        lib.rename(folder / lib.name)
    parked.rmdir()


def _run_child(py: Path, backend: Path | None, rule: str, lengths: list[int]) -> dict[str, Any]:
    from worker.models import default_model_path

    # the caller's PYTHONPATH stays behind ROOT: an overlay of llama_cpp (one CPU level's
    # libggml-cpu built apart) is then what the child loads, as it is what this process loads
    path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    if backend is not None:
        _only(backend)
    cmd = [str(py), __file__, "--child", rule, "--lengths", ",".join(map(str, lengths))]
    cmd += ["--model", str(default_model_path())]  # the portable venv lacks the model package
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if backend is not None:
        _restore(backend.parent)
    if proc.returncode == 3:
        return {"unsupported": True}
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1:] or ["failed"]}
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tuned", action="store_true", help="only this venv's tuned build")
    ap.add_argument("--lengths", default="100,513,1000")
    ap.add_argument("--variants", default="", help="comma list (default: every one built)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument(
        "--with-upstream", action="store_true", help="also run upstream's kernels (the contrast)"
    )
    ap.add_argument("--child", choices=sorted(RULES), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.child:
        from worker.engine import EngineError

        try:
            t0 = time.monotonic()
            worst = _claims(lengths, RULES[args.child], args.model)
        except EngineError as exc:
            print(exc, file=sys.stderr)
            # With one CPU variant left, ggml registers no CPU backend when this
            # host lacks its instructions, and the (sound) model cannot load.
            unsupported = "cannot run" in str(exc) or "cannot load model" in str(exc)
            sys.exit(3 if unsupported else 1)
        from worker.engine import kernels

        out = {
            "claims": worst,
            "cpu": kernels.backend_cpu(),
            "seconds": time.monotonic() - t0,
            "q8_calls": kernels.q8_gemm_calls(),  # 0: no wide Q8_0 kernel in this variant
        }
        print(json.dumps(out))
        return
    from worker.models import cache_dir

    if args.tuned:
        runs: list[tuple[str, Path, Path | None]] = [("tuned", Path(sys.executable), None)]
    else:
        py, backends = _portable(cache_dir())
        _restore(backends)  # an interrupted run may have parked them
        names = sorted(p.name[len("libggml-cpu-") : -3] for p in backends.glob("libggml-cpu-*.so"))
        wanted = [v for v in args.variants.split(",") if v] or names
        runs = [(v, py, backends / f"libggml-cpu-{v}.so") for v in wanted]
    flags = cpu_flags()
    print(f"host cpu flags: {flags}")
    print(f"lengths: {lengths}; cells: max abs logit diff (0 = exact)")
    cols = CLAIMS + KNOWN
    print(f"{'variant':<13} {'rule':<9} " + " ".join(f"{c:>8}" for c in cols) + "  needs")
    table: list[dict[str, Any]] = []
    for name, py, backend in runs:
        needs = "?"
        for rule in ("q8-gemm", "fa-rows", "tiled-dot", "tinyblas", "strict"):
            res = _run_child(py, backend, rule, lengths)
            table.append({"variant": name, "rule": rule, **res})
            if res.get("unsupported"):
                print(f"{name:<13} {'-':<9} this CPU cannot run it")
                break
            if rule == "q8-gemm" and "claims" in res and not res.get("q8_calls"):
                print(f"{name:<13} {rule:<9} not built for this variant (AVX-512 VNNI only)")
                continue
            if "error" in res:
                print(f"{name:<13} {rule:<9} error: {res['error']}")
                continue
            cells = res["claims"]
            exact = all(cells[c] == 0.0 for c in CLAIMS)
            needs = rule if exact else "?"
            row = " ".join(f"{cells[c]:>8.3g}" for c in cols)
            print(f"{name:<13} {rule:<9} {row}  {res['cpu']['level']}: {needs}")
            if exact:
                break  # the cheaper rule holds; the strict one is not needed
        if args.with_upstream and not res.get("unsupported"):
            res = _run_child(py, backend, "upstream", lengths)
            if "claims" in res:
                table.append({"variant": name, "rule": "upstream", **res})
                row = " ".join(f"{res['claims'][c]:>8.3g}" for c in cols)
                print(f"{name:<13} {'upstream':<9} {row}  (llama.cpp's own paths)")
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
