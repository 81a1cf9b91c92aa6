"""Runs a snippet under one kernel rule in a child process (test_tiled_dot.py,
test_fa_rows.py, test_q8_gemm.py): ggml reads its switches once per
process, so comparing two rules takes a process each. The snippet gets the
rule as JSON in ``sys.argv[1]`` and prints one JSON line last; ``{root}``
and ``{readme}`` in it are filled in (other braces doubled, as for
``str.format``). ``spans`` is the one snippet the kernel tests share.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from worker.engine import kernels

ROOT = Path(__file__).resolve().parent.parent


_SPANS = """
import hashlib, json, sys
sys.path.insert(0, {root!r})
from worker.engine import Engine, EngineConfig, Segment, kernels
from worker.models import default_model_path

rule = kernels.KernelRule(**json.loads(sys.argv[1]))
lengths, spans = json.loads(sys.argv[2])
cfg = EngineConfig(str(default_model_path()), n_ctx=2048, n_seq=2, n_threads=2, kernel_rule=rule)
e = Engine(cfg)
toks = e.tokenize(open({readme!r}).read() * 4)
h = lambda row: hashlib.sha256(row.tobytes()).hexdigest()
out = {{"level": kernels.backend_cpu()["level"]}}
for n in lengths:
    e.seq_clear(0)
    for at in range(0, n, 512):
        assert e.decode([Segment(0, toks[at : min(at + 512, n)], at, "none")]).ok
    for k in spans:
        assert e.decode([Segment(0, toks[n : n + k], n, "all")]).ok
        span = [h(e.logits_row(e.output_index(0, i))) for i in range(k)]
        e.seq_rm(0, n, -1)
        single = []
        for i in range(k):
            assert e.decode([Segment(0, [toks[n + i]], n + i, "last")]).ok
            single.append(h(e.logits_row(e.output_index(0))))
        e.seq_rm(0, n, -1)
        out[f"{{n}}/{{k}}"] = {{"span": span, "single": single}}
out["q8_calls"] = kernels.q8_gemm_calls()
print(json.dumps(out))
"""


def spans(
    rule: kernels.KernelRule, lengths: tuple[int, ...], widths: tuple[int, ...]
) -> dict[str, Any]:
    """Under ``rule``: after a prompt of each of ``lengths`` tokens, a span
    of each of ``widths`` tokens in one forward, then the same tokens one at
    a time; logits hashed row by row, as ``{"N/K": {"span": [...],
    "single": [...]}}`` with the backend's ``level`` and the wide kernel's
    call count ``q8_calls``."""
    return run(_SPANS, rule, json.dumps([lengths, widths]))


def run(snippet: str, rule: kernels.KernelRule, *args: str) -> dict[str, Any]:
    """The snippet's last printed line, parsed; the child must succeed."""
    code = snippet.format(root=str(ROOT), readme=str(ROOT / "README.md"))
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(asdict(rule)), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out
