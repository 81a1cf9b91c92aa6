"""Where speculation pays: skiff's automatic prompt lookup beside llama-server's.

Four systems, one at a time on the same 2 threads, 8 lanes / slots, greedy,
EOS ignored, 128 new tokens a request, closed-loop users (each sends its
requests one after another), all users starting together:

  skiff-off     skiff-worker --speculate off (plain decoding)
  skiff         skiff-worker with its defaults (--speculate auto)
  llama-server  llama-server, no speculation
  llama-ngram   llama-server --spec-type ngram-simple (its prompt lookup;
                ``--llama-spec`` changes the flags)

Workloads (token ids, the same for every system):

  edit    a code module and "the same module with one name changed": the
          answer quotes the prompt (issue 4's editing workload)
  quote   a chat turn asking for a paragraph back proofread: the answer
          quotes the user's text
  prose   a new question on new prose: little for a lookup to find

Printed per workload and concurrency: tok/s of each system, skiff / skiff-off
(what the automatic mode buys or costs), skiff / llama-server, skiff /
llama-ngram, and whether skiff's tokens equal skiff-off's (greedy: they
must, rows are batch-invariant).

    .venv/bin/python scripts/bench_speculate.py [--concurrency 1,2,4,8]
        [--workloads edit,quote,prose] [--requests 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_vs_llama_server as peer  # noqa: E402
from _machine import cpu_flags  # noqa: E402
from build_llama_server import built  # noqa: E402

from loadtest.prompts import prompt_of_tokens  # noqa: E402
from worker.models import default_model_path  # noqa: E402

_NAMES = ["load", "count_words", "top_words", "report", "parse", "merge", "clean", "split_words"]
_CODE = """def {a}(path):
    with open(path) as handle:
        return [line.strip() for line in handle if line.strip()]


def {b}(lines):
    counts = {{}}
    for line in lines:
        for word in line.split():
            counts[word] = counts.get(word, 0) + 1
    return counts


def {c}(counts, n):
    ranked = sorted(counts.items(), key=lambda kv: kv[1], reverse=True)
    return ranked[:n]


def main(path, n={n}):
    for word, count in {c}({b}({a}(path)), n):
        print(f"{{word}}: {{count}}")
"""


def _edit(seed: int) -> str:
    a, b, c = (_NAMES[(seed + k) % len(_NAMES)] for k in (0, 3, 5))
    code = _CODE.format(a=a, b=b, c=c, n=seed + 2)
    return (
        f"# file {seed}.py\n{code}\n# The same file with `{b}` renamed to `tally`, "
        "otherwise unchanged:\n"
    )


def _quote(seed: int) -> str:
    text = prompt_of_tokens(110, seed).rsplit("\n", 1)[0]
    return (
        "<start_of_turn>user\nPlease give this paragraph back with its spelling "
        f"checked, changing nothing else:\n\n{text}<end_of_turn>\n<start_of_turn>model\n"
        "Here is the paragraph, checked:\n\n"
    )


def _prose(seed: int) -> str:
    return f"[{seed}] " + prompt_of_tokens(128, seed)


WORKLOADS: dict[str, Callable[[int], str]] = {"edit": _edit, "quote": _quote, "prose": _prose}


def _prompts(model: str, kind: str, count: int, offset: int) -> list[list[int]]:
    from worker.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model_path=model, n_ctx=512, n_seq=1, n_threads=peer.THREADS))
    try:
        return [
            engine.tokenize(WORKLOADS[kind](offset + i), parse_special=True) for i in range(count)
        ]
    finally:
        engine.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--workloads", default="edit,quote,prose")
    ap.add_argument("--requests", type=int, default=2, help="requests per user")
    ap.add_argument("--systems", default="skiff-off,skiff,llama-server,llama-ngram")
    ap.add_argument("--llama-spec", default="--spec-type ngram-simple")
    ap.add_argument("--skiff-args", default="", help="extra flags for the skiff system")
    ap.add_argument("--llama-server", help="llama-server binary (default: the cached build)")
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args()
    binary = args.llama_server or (str(built()) if built() else None)
    if binary is None and any(s.startswith("llama") for s in args.systems.split(",")):
        sys.exit("no llama-server: run scripts/build_llama_server.py or pass --llama-server")
    peer.REQUESTS = args.requests
    model = str(default_model_path())
    levels = [int(x) for x in args.concurrency.split(",")]
    kinds = [k for k in args.workloads.split(",") if k]
    runs = [(k, c) for k in kinds for c in levels]
    per_run = max(levels) * args.requests
    # each run has prompts of its own (no cache sees one twice), the same for every system
    prompts = {(k, c): _prompts(model, k, per_run, 1000 * i) for i, (k, c) in enumerate(runs)}
    makers: dict[str, Callable[[], Any]] = {
        "skiff-off": lambda: peer.Skiff(model, ["--speculate", "off"], "skiff-off"),
        "skiff": lambda: peer.Skiff(model, shlex.split(args.skiff_args), "skiff"),
        "llama-server": lambda: peer.LlamaServer(str(binary), model),
        "llama-ngram": lambda: peer.LlamaServer(
            str(binary), model, tuple(shlex.split(args.llama_spec)), "llama-ngram"
        ),
    }
    rows: dict[str, dict[str, dict[str, float]]] = {}
    tokens: dict[str, dict[str, list[list[int]]]] = {}
    for name in args.systems.split(","):
        system = makers[name]()
        try:
            system.complete(prompts[runs[0]][0][:16])  # warm-up
            for kind, c in runs:
                res = peer.run(system, "distinct", c, 0.0, prompts[(kind, c)], [])
                key = f"{kind} c={c}"
                rows.setdefault(name, {})[key] = res.row()
                tokens.setdefault(name, {})[key] = sorted(r.tokens for r in res.records)
                print(f"  {name:<13}{key:<12}{rows[name][key]['tok_s']:7.1f} tok/s",
                      file=sys.stderr, flush=True)  # fmt: skip
        finally:
            system.close()
    report(rows, tokens)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=2))
    return 0


def report(rows: dict[str, dict[str, dict[str, float]]], tokens: dict[str, Any]) -> None:
    print(f"cpu flags: {cpu_flags()}")
    names = list(rows)
    head = "".join(f"{n:>14}" for n in names)
    print(f"\ntok/s{'':<9}{head}   auto/off  skiff/llama  skiff/llama-ngram  same tokens")
    for key in rows[names[0]]:

        def tok(name: str, key: str = key) -> float:
            return rows.get(name, {}).get(key, {}).get("tok_s", float("nan"))

        cells = "".join(f"{tok(n):>14.1f}" for n in names)
        same = tokens.get("skiff", {}).get(key) == tokens.get("skiff-off", {}).get(key)
        print(f"{key:<14}{cells}{tok('skiff') / tok('skiff-off'):>11.2f}"
              f"{tok('skiff') / tok('llama-server'):>13.2f}"
              f"{tok('skiff') / tok('llama-ngram'):>19.2f}  {same}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
