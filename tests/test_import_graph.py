"""The package's import graph: no circles between modules, and no runtime module importing a test-only package.

Imports inside functions count (they run when the function does); imports under ``if TYPE_CHECKING:``
do not (they never run: a manager may name the rooms it keeps in its annotations while the rooms
import the manager)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOT_SHIPPED = {"tests", "benchmarks", "scripts", "docs", "charts", "manifests", "build"}
# What `pip install splitserve[test]` adds; the serving stack must run without any of it.
TEST_ONLY = {"pytest", "hypothesis", "cryptography", "openai", "jsonschema", "scipy", "grpc_tools", "accelerate",
             "ruff"}


def runtime_modules() -> dict[str, Path]:
    modules = {}
    for path in REPO.rglob("*.py"):
        rel = path.relative_to(REPO)
        if rel.parts[0] in NOT_SHIPPED or rel.parts[0].startswith(".") or rel.name == "setup.py":
            continue
        if rel.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        parts = ("splitserve", *rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING"))


def imported_names(module: str, path: Path) -> set[str]:
    """Every module name an import statement of ``module`` may load at run time (absolute names)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if is_type_checking_block(child):
                for orelse in child.orelse:
                    visit(orelse)
                continue
            if isinstance(child, ast.Import):
                names.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                names.add(base)
                names.update(f"{base}.{alias.name}" for alias in child.names)
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return names


def import_graph() -> dict[str, set[str]]:
    modules = runtime_modules()
    return {m: {n for n in imported_names(m, p) if n in modules and n != m} for m, p in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            advanced = False
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_checker_finds_a_circle_it_is_shown() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles_between_runtime_modules() -> None:
    graph = import_graph()
    assert len(graph) > 150  # every runtime module was read
    assert circles(graph) == []


def test_no_runtime_module_imports_a_test_only_package() -> None:
    offenders = {m: sorted(n for n in imported_names(m, p) if n.split(".")[0] in TEST_ONLY)
                 for m, p in runtime_modules().items()}
    assert {m: names for m, names in offenders.items() if names} == {}
