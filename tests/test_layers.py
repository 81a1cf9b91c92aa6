"""The package's layers, checked from the code's own imports.

Arrows point down: ``faults`` <- ``protocol`` <- ``edge`` <- the processes
(``worker``, ``speech``, ``gateway``, ``loadtest``, never each other). Inside
``worker`` the core rooms (``core``, ``runtime``, ``engine``) reach nothing of
the wire, the edge or the rooms above them (``api``, ``chain``, the process),
checked transitively, and a planted violation proves the check can fail.
The client side never reaches ``worker`` or ``llama_cpp``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("faults", "protocol", "edge", "worker", "speech", "loadtest", "gateway")

# The core rooms: what runs a request once it is typed. Nothing reachable from
# them, however indirectly, may be the wire (protocol, zmq, msgpack), the edge,
# or the worker's rooms above the line (request parsing, the chain's link, the
# process: service, cli, config).
CORE_ROOMS = ("worker.core", "worker.runtime", "worker.engine")
ABOVE_THE_LINE = (
    "protocol",
    "zmq",
    "msgpack",
    "edge",
    "worker.api",
    "worker.chain",
    "worker.service",
    "worker.cli",
    "worker.config",
    "worker.metrics",
)


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


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


def _graph(external: bool = False) -> dict[str, set[str]]:
    """Module -> the project modules it imports (and, with ``external``, the
    top-level names of everything else it imports: ``zmq``, ``msgpack``, ...)."""
    modules = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = _imports(path, name, set(modules))
        graph[name] = {m for m in found if m in modules and m != name}
        if external:
            graph[name] |= {m.split(".")[0] for m in found if m.split(".")[0] not in PACKAGES}
            graph[name] |= {m for m in found if m not in modules and m.split(".")[0] in PACKAGES}
    return graph


def _reach_above_the_line(graph: dict[str, set[str]]) -> list[str]:
    """Import paths from a core room to anything above the line, transitively."""
    found: list[str] = []
    for root in sorted(n for n in graph if _under(n, CORE_ROOMS)):
        seen = {root}
        paths = {root: [root]}
        todo = [root]
        while todo:
            node = todo.pop()
            for nxt in sorted(graph.get(node, ())):
                if nxt in seen:
                    continue
                seen.add(nxt)
                paths[nxt] = [*paths[node], nxt]
                if _under(nxt, ABOVE_THE_LINE):
                    found.append(" -> ".join(paths[nxt]))
                else:
                    todo.append(nxt)
    return found


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


def test_core_rooms_reach_nothing_above_the_line() -> None:
    graph = _graph(external=True)
    assert any(_under(n, ("worker.core",)) for n in graph)  # the rooms exist
    assert _reach_above_the_line(graph) == []


def test_a_planted_indirect_violation_is_found() -> None:
    """The check follows imports through any module: a job importing request
    validation (which loads ``protocol.frames``) must fail it."""
    graph = _graph(external=True)
    graph["worker.core.jobs.base"] = graph["worker.core.jobs.base"] | {"worker.limits"}
    graph["worker.limits"] = graph["worker.limits"] | {"worker.api.validate"}
    found = _reach_above_the_line(graph)
    assert any(p.endswith("worker.limits -> worker.api.validate") for p in found), found
    graph = _graph(external=True)
    graph["worker.spec"] = graph["worker.spec"] | {"zmq"}
    assert any("worker.spec -> zmq" in p for p in _reach_above_the_line(graph))


def test_lower_layers_never_import_upper_ones() -> None:
    graph = _graph()
    order = {
        "faults": 0,
        "protocol": 1,
        "edge": 2,
        "loadtest": 3,
        "worker": 3,
        "speech": 3,
        "gateway": 3,
    }
    tops = ("loadtest", "worker", "speech", "gateway")
    siblings = [{a, b} for a in tops for b in tops if a < b]
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
        "import loadtest, loadtest.cli, protocol, edge, gateway.cli, gateway.openai.http, "
        "gateway.server"
    )
    assert "llama_cpp" not in loaded
    assert not any(m == "worker" or m.startswith("worker.") for m in loaded)


def test_argument_validation_loads_no_llama_cpp() -> None:
    loaded = _fresh_modules("import worker.api.validate, worker.spec, worker.core.jobs.base")
    assert "worker.api.validate" in loaded
    assert "llama_cpp" not in loaded


def test_every_op_has_one_handler() -> None:
    """``generate`` and ``chat`` once shadowed each other by dict-merge order;
    the op table now refuses an op defined twice."""
    from worker.api.generate import GENERATIONS
    from worker.api.ops import OPS, join

    with pytest.raises(ValueError, match="defined twice"):
        join({"a": OPS["ping"]}, {"a": OPS["info"]})
    from protocol.transport import Op

    # a generation is read into a ``Generation`` (the service builds its job)
    # and is no other family's op
    assert GENERATIONS[Op.GENERATE].__module__ == "worker.api.generate"
    assert GENERATIONS[Op.CHAT].__module__ == "worker.api.generate"
    assert not set(GENERATIONS) & set(OPS)
    assert OPS[Op.PREFILL].__module__ == "worker.api.handlers"
