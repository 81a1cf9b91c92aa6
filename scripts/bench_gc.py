"""What a full garbage collection costs a loaded worker, before and after it
freezes what start-up made (``edge.memory.freeze_startup_objects``).

The worker's own start-up is rebuilt in this process, as ``worker.cli.main``
does it up to serving (engine, service, edge server on an ipc socket), then
``gc.collect()`` (a full collection, what Python runs every so often while
requests make and drop objects, inside whichever turn it falls) is timed
``--n`` times; then the objects are frozen and the same is timed again. One
run prints both, the baseline first, with the ratio and the CPU flags.

    .venv/bin/python scripts/bench_gc.py [--n 20]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from _machine import cpu_flags  # noqa: E402

from edge import EdgeServer  # noqa: E402
from edge.memory import freeze_startup_objects  # noqa: E402
from worker import cli, config  # noqa: E402
from worker.service import LlmService  # noqa: E402


def full_collections(n: int) -> list[float]:
    """Milliseconds of ``n`` full collections, each with a few requests' worth
    of live objects (2,000 small lists, as token events in flight), which a
    collection in a real turn also walks, frozen or not."""
    out = []
    for _ in range(n):
        live = [[i, str(i)] for i in range(2000)]  # lists: always gc-tracked
        t0 = time.perf_counter()
        gc.collect()
        out.append((time.perf_counter() - t0) * 1000)
        del live
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--lanes", type=int, default=8)
    opts = ap.parse_args()
    endpoint = f"ipc://{tempfile.mkdtemp(prefix='skiff-gc-')}/w.sock"
    cfg = config.parse(["--bind", endpoint, "--lanes", str(opts.lanes), "--log-level", "warning"])
    engine = cli.build_engine(cfg)
    service = LlmService(cfg, engine)
    server = EdgeServer(cli.edge_config(cfg), service)
    try:
        tracked = len(gc.get_objects())
        before = full_collections(opts.n)
        frozen = freeze_startup_objects()
        after = full_collections(opts.n)
    finally:
        gc.unfreeze()
        server.close()
        engine.close()
    b, a = statistics.median(before), statistics.median(after)
    print(f"CPU flags: {cpu_flags()}")
    print(f"loaded worker (this process): {tracked} gc-tracked objects, {frozen} frozen")
    print(f"full collection, not frozen (baseline): p50 {b:.3f} ms, max {max(before):.3f} ms")
    print(f"full collection, start-up frozen:       p50 {a:.3f} ms, max {max(after):.3f} ms")
    print(f"frozen / baseline p50: {a / b:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
