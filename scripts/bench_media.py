"""Media prefill: skiff beside llama.cpp's own llama-server, same run (issue 14).

The figure is the **time to first token of a prompt that holds images**: the
client's wall time of one non-streaming request for a single new token (skiff
``generate`` with ``media``; llama-server ``/completion`` with
``multimodal_data``), p50 over N rounds, for a prompt of ~20 text tokens with
one image and with two, and skiff / llama-server as a ratio. Beside it, per
system, the text-only prefill of a prompt with exactly as many positions
(text tokens + 18 per image: ``<start_of_image>``, 16 image rows,
``<end_of_image>``) and media / text: what an image costs beyond its
positions (PNG decode, projector encode, an exclusive non-causal decode).

Why: a media prompt is the one prompt skiff cannot share a forward with
other work (docs/media.md), so its latency is the number to watch, and the
honest yardstick is the C++ server built from the very llama.cpp skiff links
(``scripts/build_llama_server.py``) running the same mtmd code. The machine is
noisy (2 shared cores), so only ratios within one run mean anything: the two
systems run side by side and are interleaved request by request (the order
flips every round), so drift hits both.

Setup, the same for both: the packaged model, the test projector of
``scripts/make_mmproj.py`` (random weights, Gemma 3 layout, 16 tokens per
image; written to a temp dir), 2 threads, one lane / slot of 2,048 cells,
batch and micro-batch 512, nothing reused: skiff with ``--prefix-cache 0``,
llama-server with ``--cache-ram 0`` and ``cache_prompt: false``, and every
round's text and images are new. Images are random-pixel 256x256 PNGs
(``tests/media_images.py``); mtmd resizes them to the projector's 64x64.
llama-server picks a random media marker per start (``/props``
``media_marker``); skiff's comes from ``info.media.marker``. llama-server's
time includes base64-encoding the images (its clients must); skiff takes
them as raw message buffers. On a box loaded by other jobs, 2 threads per
system wait on each other's descheduled threads and absolute times balloon
(``--threads 1`` is then ~3x faster); the ratios are what to read.

    .venv/bin/python scripts/build_llama_server.py     # once, ~10 min
    .venv/bin/python scripts/bench_media.py [--rounds 10] [--size 256]
        [--budget-s 150] [--threads 2] [--llama-server PATH] [--json out.json]
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

from build_llama_server import built  # noqa: E402
from make_mmproj import write_test_projector  # noqa: E402
from media_images import png, rgb  # noqa: E402

from loadtest.prompts import prompt_of_tokens  # noqa: E402
from protocol import Client  # noqa: E402
from worker.models import default_model_path  # noqa: E402

THREADS, N_CTX, BATCH = 2, 2048, 512
IMG = "{img}"  # stands for the system's own media marker in the prompts below
PROMPTS = {
    1: "Round {r}: look at this picture {img} and tell me in one word which colour "
    "fills most of it, please.",
    2: "Round {r}: compare the first picture {img} with the second one {img} and "
    "tell me which is brighter.",
}
CASES = ("1 image", "2 images", "text, 1-image positions", "text, 2-image positions")


class System(Protocol):
    name: str
    command: list[str]

    def media(self, prompt: str, images: list[bytes]) -> tuple[float, int]: ...

    def text(self, tokens: list[int]) -> tuple[float, int]: ...

    def close(self) -> None: ...


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class Skiff:
    """A skiff worker with the projector, one lane; requests on one client."""

    name = "skiff"

    def __init__(self, model: str, mmproj: Path, tmp: Path, threads: int) -> None:
        self.endpoint = f"ipc://{tmp}/w.sock"
        self.command = [sys.executable, "-m", "worker.cli", "--bind", self.endpoint,
                        "--model", model, "--mmproj", str(mmproj), "--lanes", "1",
                        "--ctx", str(N_CTX), "--threads", str(threads), "--batch", str(BATCH),
                        "--ubatch", str(BATCH), "--prefix-cache", "0",
                        "--log-level", "warning"]  # fmt: skip
        self.log = tmp / "skiff.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(self.command, cwd=ROOT, stdout=log, stderr=log)
        self.client = Client(self.endpoint, timeout_ms=300_000)
        try:
            self.client.wait_ready(120, alive=lambda: self.proc.poll() is None)
            self.marker = str(self.client.info()["media"]["marker"])
        except Exception as err:
            self.close()
            tail = self.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"skiff worker did not start: {tail}") from err

    def media(self, prompt: str, images: list[bytes]) -> tuple[float, int]:
        args = {
            "prompt": prompt.replace(IMG, self.marker),
            "media": [{"buffer": i} for i in range(len(images))],
            "max_tokens": 1,
            "stream": False,
        }
        t0 = time.perf_counter()
        res = self.client.call("generate", None, args, images).result
        return time.perf_counter() - t0, int(res["usage"]["prompt_tokens"])

    def text(self, tokens: list[int]) -> tuple[float, int]:
        args = {"tokens": tokens, "max_tokens": 1, "stream": False}
        t0 = time.perf_counter()
        res = self.client.call("generate", None, args).result
        return time.perf_counter() - t0, int(res["usage"]["prompt_tokens"])

    def tokenize(self, text: str) -> list[int]:
        return list(self.client.tokenize(text))

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            _stop(self.proc)


class LlamaServer:
    """llama-server with the same projector, one slot, no prompt cache."""

    name = "llama-server"

    def __init__(self, binary: str, model: str, mmproj: Path, threads: int) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.command = [binary, "-m", model, "--mmproj", str(mmproj),
                        "--threads", str(threads), "--threads-batch", str(threads),
                        "--parallel", "1", "--ctx-size", str(N_CTX), "--batch-size", str(BATCH),
                        "--ubatch-size", str(BATCH), "--cache-ram", "0",
                        "--host", "127.0.0.1", "--port", str(self.port)]  # fmt: skip
        self.proc = subprocess.Popen(
            self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            self._wait_healthy(120)
            self.marker = str(self._get("/props").get("media_marker") or "<__media__>")
        except Exception:
            self.close()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode})")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError("llama-server did not become healthy")

    def _get(self, path: str) -> dict[str, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("GET", path)
        out: dict[str, Any] = json.loads(conn.getresponse().read())
        return out

    def _complete(self, prompt: Any) -> tuple[float, int]:
        body = json.dumps({"prompt": prompt, "n_predict": 1, "cache_prompt": False})
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        t0 = time.perf_counter()
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        elapsed = time.perf_counter() - t0
        conn.close()
        if resp.status != 200:
            raise RuntimeError(f"llama-server HTTP {resp.status}: {data[:300]!r}")
        return elapsed, int(json.loads(data)["tokens_evaluated"])

    def media(self, prompt: str, images: list[bytes]) -> tuple[float, int]:
        # base64 is part of what a llama-server client must do, so it is timed
        t0 = time.perf_counter()
        encoded = [base64.b64encode(b).decode() for b in images]
        prompt = prompt.replace(IMG, self.marker)
        spent = time.perf_counter() - t0
        elapsed, n = self._complete({"prompt_string": prompt, "multimodal_data": encoded})
        return spent + elapsed, n

    def text(self, tokens: list[int]) -> tuple[float, int]:
        return self._complete(tokens)

    def close(self) -> None:
        _stop(self.proc)


@dataclass
class Samples:
    seconds: list[float] = field(default_factory=list)
    positions: set[int] = field(default_factory=set)

    def add(self, got: tuple[float, int]) -> None:
        self.seconds.append(got[0])
        self.positions.add(got[1])

    def p50_ms(self) -> float:
        return statistics.median(self.seconds) * 1000 if self.seconds else float("nan")


def text_tokens(skiff: Skiff, n: int, seed: int) -> list[int]:
    """A text prompt of exactly ``n`` tokens (BOS included), new for every seed."""
    tokens = skiff.tokenize(f"Round {seed}: " + prompt_of_tokens(2 * n + 16, seed))
    if len(tokens) < n:
        raise RuntimeError(f"filler text too short: {len(tokens)} < {n} tokens")
    return tokens[:n]


def one_round(systems: list[System], skiff: Skiff, r: int, size: int,
              out: dict[str, dict[str, Samples]]) -> None:  # fmt: skip
    """Every case once on every system; the system order flips each round.
    The text reference has as many positions as skiff counted for the
    round's media prompt."""
    order = systems if r % 2 == 0 else systems[::-1]
    positions: dict[int, int] = {}
    for n_img in (1, 2):
        images = [png(rgb(size, size, 1000 * (r + 1) + 10 * n_img + i)) for i in range(n_img)]
        prompt = PROMPTS[n_img].replace("{r}", str(r))
        for system in order:
            got = system.media(prompt, images)
            out[system.name][CASES[n_img - 1]].add(got)
            if system is skiff:
                positions[n_img] = got[1]
    for n_img in (1, 2):
        tokens = text_tokens(skiff, positions[n_img], 100 * (r + 1) + n_img)
        for system in order:
            out[system.name][CASES[n_img + 1]].add(system.text(tokens))


def report(out: dict[str, dict[str, Samples]], rounds: int) -> None:
    s, ls = out["skiff"], out["llama-server"]
    print(f"\nmedia prefill TTFT, p50 of {rounds} rounds (client wall time, 1 new token)")
    print(f"{'case':<26}{'positions s/l':>15}{'skiff ms':>10}{'llama ms':>10}{'s/l':>7}"
          f"{'paired':>8}")  # fmt: skip
    for case in CASES:
        pos = f"{_pos(s[case])}/{_pos(ls[case])}"
        a, b = s[case].p50_ms(), ls[case].p50_ms()
        pairs = zip(s[case].seconds, ls[case].seconds, strict=True)
        paired = statistics.median(x / y for x, y in pairs)
        print(f"{case:<26}{pos:>15}{a:>10.1f}{b:>10.1f}{a / b:>7.2f}{paired:>8.2f}")
    print("(s/l: ratio of the p50s; paired: p50 of the per-round ratios)")
    print(f"{'media / text':<26}{'':>15}{'skiff':>10}{'llama':>10}")
    for n_img in (1, 2):
        media, text = CASES[n_img - 1], CASES[n_img + 1]
        rs = s[media].p50_ms() / s[text].p50_ms()
        rl = ls[media].p50_ms() / ls[text].p50_ms()
        print(f"{'  ' + media:<26}{'':>15}{rs:>10.2f}{rl:>10.2f}")


def _pos(samples: Samples) -> str:
    return ",".join(str(p) for p in sorted(samples.positions)) or "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--size", type=int, default=256, help="image width = height (pixels)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=150.0,
        help="wall-time budget of the whole run: no round starts that would end past it",
    )
    parser.add_argument("--threads", type=int, default=THREADS, help="threads of both systems")
    parser.add_argument("--llama-server", help="llama-server binary (default: the cached build)")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    cached = built()
    binary = args.llama_server or (str(cached) if cached else None)
    if binary is None:
        sys.exit("no llama-server: run scripts/build_llama_server.py or pass --llama-server")
    started = time.monotonic()
    model = str(default_model_path())
    print("command:", shlex.join([sys.executable, *sys.argv]), flush=True)

    systems: list[System] = []
    with tempfile.TemporaryDirectory(prefix="bench-media-") as tmp_name:
        tmp = Path(tmp_name)
        mmproj = write_test_projector(tmp / "mmproj.gguf")
        try:
            skiff = Skiff(model, mmproj, tmp, args.threads)
            systems.append(skiff)
            systems.append(LlamaServer(binary, model, mmproj, args.threads))
            for system in systems:
                print(f"  {system.name}: {shlex.join(system.command)}", flush=True)
            warm = {system.name: {case: Samples() for case in CASES} for system in systems}
            last = time.monotonic()
            one_round(systems, skiff, -1, args.size, warm)  # warm-up, not counted
            out = {system.name: {case: Samples() for case in CASES} for system in systems}
            done, took = 0, time.monotonic() - last
            for r in range(args.rounds):
                # stop before a round that would end past the budget (but run one)
                if done and time.monotonic() - started + took > args.budget_s:
                    print(f"  budget of {args.budget_s:.0f} s: stopped after {done} rounds",
                          file=sys.stderr)  # fmt: skip
                    break
                last = time.monotonic()
                one_round(systems, skiff, r, args.size, out)
                took, done = time.monotonic() - last, done + 1
                print(f"  round {done}/{args.rounds}: {took:.1f} s", file=sys.stderr, flush=True)
        finally:
            for system in reversed(systems):
                system.close()
    report(out, done)
    if args.json_path:
        summary = {
            name: {case: {"p50_ms": smp.p50_ms(), "positions": sorted(smp.positions),
                          "ms": [x * 1000 for x in smp.seconds]}
                   for case, smp in cases.items()}
            for name, cases in out.items()
        }  # fmt: skip
        Path(args.json_path).write_text(json.dumps({"rounds": done, **summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
