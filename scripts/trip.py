"""Which of skiff's modules one request runs through, counted by running it.

The worker runs in this process's main thread under ``sys.setprofile``; a
client thread sends one warm-up request (first-call set-up is not the trip),
then the measured one, and the profiler records every skiff module whose
code runs on the worker's thread from the send until the final reply
arrives. The loop's idle polling before and after is outside the window.
Modules are listed in the order the trip first enters them; data-only
modules (a dataclass's generated ``__init__`` has no file) do not appear,
which is the point: they are read, not walked through. Nor does the loop's
once-a-second upkeep (``housekeeping``, ``trim_heap``) when it happens to
fall inside the window: it is not the request's path.

    .venv/bin/python scripts/trip.py                 # a greedy text generate
    .venv/bin/python scripts/trip.py --sampling      # with a sampling map
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from protocol import Client  # noqa: E402
from worker import cli  # noqa: E402

_OWN = str(ROOT) + os.sep
_VENV = (sys.prefix + os.sep, str(Path(sys.prefix).resolve()) + os.sep)
_recording = threading.Event()
_seen: dict[str, int] = {}
_calls: dict[tuple[str, str], int] = {}


# The loop's once-a-second upkeep (idle sessions, heap trimming) is not the
# request's path; when it happens to fall inside the window, what it calls
# is left out, so the count does not depend on timing.
_UPKEEP = frozenset({"housekeeping", "trim_heap"})
_in_upkeep: list[FrameType] = []


def _profile(frame: FrameType, event: str, arg: Any) -> None:
    if _in_upkeep:
        if event == "return" and frame is _in_upkeep[-1]:
            _in_upkeep.pop()
        return
    if event != "call" or not _recording.is_set():
        return
    if frame.f_code.co_name in _UPKEEP:
        _in_upkeep.append(frame)
        return
    name = frame.f_code.co_filename
    # the project's own modules: the venv may live under the checkout
    if name.startswith(_OWN) and not name.startswith(_VENV):
        _seen.setdefault(name, len(_seen))
        key = (name, frame.f_code.co_qualname)
        _calls[key] = _calls.get(key, 0) + 1


def _drive(endpoint: str, args: dict[str, Any], done: list[str]) -> None:
    try:
        with Client(endpoint, timeout_ms=120_000) as client:
            client.wait_ready()
            list(client.generate(args))  # warm-up: first-call set-up
            _recording.set()
            list(client.generate(args))
            _recording.clear()
            done.append("ok")
    except Exception as exc:  # reported by the main thread
        done.append(f"failed: {exc!r}")
    finally:
        os.kill(os.getpid(), signal.SIGTERM)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sampling", action="store_true", help="a seeded non-greedy request")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument(
        "--functions", action="store_true", help="also list each module's functions that ran"
    )
    opts = ap.parse_args()
    endpoint = f"ipc://{tempfile.mkdtemp(prefix='skiff-trip-')}/w.sock"
    args: dict[str, Any] = {"prompt": "The capital of France is", "max_tokens": opts.max_tokens}
    if opts.sampling:
        args["sampling"] = {"temperature": 0.8, "seed": 7}
    done: list[str] = []
    threading.Thread(target=_drive, args=(endpoint, args, done), daemon=True).start()
    sys.setprofile(_profile)
    try:
        cli.main(["--bind", endpoint, "--lanes", "2", "--log-level", "warning"])
    finally:
        sys.setprofile(None)
    if done != ["ok"]:
        print(f"trip: the client {done}", file=sys.stderr)
        return 1
    paths = sorted(_seen, key=_seen.__getitem__)
    modules = [str(Path(p).relative_to(ROOT)) for p in paths]
    print(
        f"one generate ({'sampled' if opts.sampling else 'greedy'}) runs through "
        f"{len(modules)} modules, in order of first entry:"
    )
    for i, (path, m) in enumerate(zip(paths, modules, strict=True), 1):
        print(f"{i:3d}. {m}")
        if opts.functions:
            for (where, func), n in _calls.items():
                if where == path:
                    print(f"       {func} x{n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
