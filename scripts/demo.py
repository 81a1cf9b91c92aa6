"""Demo: start a worker on the default model and stream a completion from it.

Run through ``scripts/run``. The worker is a child process on a private
ipc:// socket; Ctrl-C (or the end of the demo) stops it cleanly.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from protocol import Client, SkiffError  # noqa: E402


def stream(client: Client, session: str, prompt: str, n_tokens: int) -> None:
    """prefill_sampled, then decode one token at a time, printing text deltas."""
    tokens = client.tokenize(prompt)
    print(f"\n{prompt}", end="", flush=True)
    started = time.perf_counter()
    generated = [client.prefill_sampled(session, tokens)["token"]]
    ttft = time.perf_counter() - started
    shown = ""
    while len(generated) < n_tokens:
        text = client.detokenize(generated)
        if not text.endswith("\ufffd"):  # never print half a UTF-8 character
            print(text[len(shown) :], end="", flush=True)
            shown = text
        generated.append(client.decode(session, generated[-1])["token"])
    print(client.detokenize(generated)[len(shown) :], flush=True)
    total = time.perf_counter() - started
    rate = (len(generated) - 1) / max(1e-9, total - ttft)
    print(
        f"\n[{len(tokens)} prompt tokens, {len(generated)} generated; "
        f"first token {ttft * 1000:.0f} ms; {rate:.1f} tok/s]"
    )
    client.drop(session)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--prompt", default="The three most important inventions of the twentieth century were"
    )
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--model", default="default")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="skiff-demo-") as tmp:
        endpoint = f"ipc://{tmp}/worker.sock"
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "worker.cli",
                "--bind",
                endpoint,
                "--model",
                args.model,
                "--log-format",
                "console",
                "--log-level",
                "warning",
            ],
            cwd=ROOT,
        )
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        try:
            with Client(endpoint, timeout_ms=60_000) as client:
                try:
                    client.wait_ready(120, alive=lambda: proc.poll() is None)
                except SkiffError:
                    raise SystemExit("demo: the worker did not start") from None
                info = client.info()
                print(
                    f"skiff worker up: {info['model']['name']} · {info['lanes']} lanes · "
                    f"{info['n_ctx_per_lane']} cells per lane"
                )
                stream(client, "demo", args.prompt, args.tokens)
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
