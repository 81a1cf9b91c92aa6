"""The package's layers, checked from the code's own imports.

Arrows point down: ``faults`` <- ``protocol`` <- ``edge`` <- ``worker``'s edge
side (service, handlers, cli), and the core (scheduler, jobs, generation,
runtime, engine) knows nothing of the wire. The client side (``protocol``,
``edge``, ``loadtest``, ``gateway``) never reaches ``worker`` or ``llama_cpp``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("faults", "protocol", "edge", "worker", "loadtest", "gateway")

# The core: what runs a request once it is typed. None of it may import the
# wire (protocol, zmq, msgpack) or the edge.
CORE = (
    "worker.scheduler",
    "worker.outcomes",
    "worker.peers",
    "worker.limits",
    "worker.jobs",
    "worker.batch_jobs",
    "worker.generate",
    "worker.media_feed",
    "worker.media_jobs",
    "worker.ticket",
    "worker.speculative",
    "worker.spec",
    "worker.stats",
    "worker.chat",
    "worker.runtime",
    "worker.engine",
)
WIRE = ("protocol", "zmq", "msgpack", "edge")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str, modules: set[str] | None = None) -> set[str]:
    """Modules ``path`` imports (absolute names; relative ones resolved).

    ``from pkg import sub`` counts as importing ``pkg.sub`` only when ``sub``
    is a module (a package's ``__init__`` importing its own modules is not a
    cycle); otherwise as importing ``pkg``.
    """
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                stem = ".".join([*base, node.module] if node.module else base)
            else:
                stem = node.module or ""
            subs = {f"{stem}.{alias.name}" for alias in node.names}
            known = subs & modules if modules is not None else set()
            out.update(known or {stem})
    return out


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = _imports(path, name, set(modules))
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, if any (TYPE_CHECKING imports count too)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle() -> None:
    graph = _graph()
    assert len(graph) > 40  # the walk really found the package
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_core_imports_nothing_of_the_wire() -> None:
    offenders = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = _module_name(path)
            if not any(name == c or name.startswith(c + ".") for c in CORE):
                continue
            imported = _imports(path, name)
            bad = sorted(m for m in imported if any(m == w or m.startswith(w + ".") for w in WIRE))
            if bad:
                offenders.append(f"{name}: {bad}")
    assert offenders == []


def test_lower_layers_never_import_upper_ones() -> None:
    graph = _graph()
    order = {"faults": 0, "protocol": 1, "edge": 2, "loadtest": 3, "worker": 3, "gateway": 3}
    siblings = ({"loadtest", "worker"}, {"gateway", "worker"}, {"gateway", "loadtest"})
    upward = [
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if order[b.split(".")[0]] > order[a.split(".")[0]]
        or {a.split(".")[0], b.split(".")[0]} in siblings
    ]
    assert upward == []


def _fresh_modules(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return set(out.stdout.split())


def test_client_side_leaves_llama_cpp_and_worker_out() -> None:
    loaded = _fresh_modules(
        "import loadtest, loadtest.cli, protocol, edge, gateway.cli, gateway.http, gateway.server"
    )
    assert "llama_cpp" not in loaded
    assert not any(m == "worker" or m.startswith("worker.") for m in loaded)


def test_argument_validation_loads_no_llama_cpp() -> None:
    loaded = _fresh_modules("import worker.validate, worker.spec, worker.ticket")
    assert "worker.validate" in loaded
    assert "llama_cpp" not in loaded
