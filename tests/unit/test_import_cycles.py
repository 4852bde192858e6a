"""No import cycles among the project's modules, deferred or not: every ``import`` statement counts, also one
inside a function (import-linter's layers see only the module level). A cycle means two modules each need
the other: one place per concern says which comes first."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_FOLDERS = ("producers", "consumers", "streams", "schemas", "infra")


def _modules() -> dict[str, Path]:
    """Dotted name -> file, as the package imports them (``dora_rl/<folder>`` are links to the role folders)."""
    found: dict[str, Path] = {}
    sources = [(folder, f"dora_rl.{folder}") for folder in PACKAGE_FOLDERS] + [("dora_rl", "dora_rl"),
                                                                                ("bench", "bench")]
    for folder, prefix in sources:
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            if folder == "dora_rl" and rel.parts[0] in PACKAGE_FOLDERS:
                continue  # the links: already found under their own folder
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([prefix, *parts])] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports anywhere in its file."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in modules and t != name and not name.startswith(t + ".")}
    return out


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_one_that_imports_it_back() -> None:
    modules = _modules()
    assert "dora_rl.streams.rules" in modules and "dora_rl.core.rewards" in modules
    edges = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert sum(map(len, edges.values())) > 300, "the import graph looks empty: the resolver is broken"
    assert _cycles(edges) == [], "import cycles (deferred imports count)"


PROCESS_AND_IO = ("subprocess", "socket", "multiprocessing", "pyarrow", "datasets")
"""What the shared rules (``dora_rl.core``) never import: processes, sockets, dataset file I/O (deferred imports
count; import-linter's contract says the same for module-level imports)."""


def test_the_rules_import_no_process_socket_or_columnar_io() -> None:
    found: dict[str, set[str]] = {}
    for name, path in _modules().items():
        if not name.startswith("dora_rl.core"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            hit = {n.split(".")[0] for n in names} & set(PROCESS_AND_IO)
            if hit:
                found.setdefault(name, set()).update(hit)
    assert not found, f"dora_rl.core imports process or I/O machinery (belongs in infra or the app): {found}"
