"""The project's import graph: no circles, and the floors of DESIGN's layout respected.

The graph is read from the source (every `import` / `from ... import`, at module level or inside a function,
since a lazy import still ties two modules together), over the four packages `bastion_sglang`, its
`controller`, `kernels` and `calibration`. `from package import name` points at the submodule when `name` is
one, else at the package. An import of a module's own ancestor package is not an edge (Python imports the
parents first whatever the code says).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "bastion_sglang": ROOT / "bastion_sglang",
    "bastion_sglang.controller": ROOT / "controller",
    "bastion_sglang.kernels": ROOT / "kernels",
    "bastion_sglang.calibration": ROOT / "calibration",
}


def project_modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the four packages."""
    modules = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [part for part in path.relative_to(folder).with_suffix("").parts if part != "__init__"]
            modules[".".join([package, *parts])] = path
    return modules


def _imported_names(module: str, path: Path) -> Iterator[tuple[str, tuple[str, ...]]]:
    """(imported module, names taken from it) for every import statement of the file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base, tuple(alias.name for alias in node.names)


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (ancestor packages excluded)."""
    modules = project_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for base, names in _imported_names(name, path):
            targets = {f"{base}.{n}" for n in names if f"{base}.{n}" in modules}
            if len(targets) < len(names) or not names:
                targets.add(base)
            for target in targets:
                if target in modules and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_walk_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_the_project() -> None:
    """Edges the code certainly has: module-level, lazy (inside a function) and `from package import sub`."""
    graph = import_graph()
    assert "bastion_sglang.kernels" in graph["bastion_sglang.worker"]
    assert "bastion_sglang.registration" in graph["bastion_sglang"]
    assert "bastion_sglang.kernels.reference" in graph["bastion_sglang.kernels.triton_tree"]
    assert "bastion_sglang.kernels" not in graph["bastion_sglang.kernels.triton_tree"]


def test_no_import_circles() -> None:
    assert circles(import_graph()) == []


@pytest.mark.parametrize(
    ("floor", "forbidden"),
    [
        ("bastion_sglang.controller", "sglang"),
        ("bastion_sglang.kernels", "sglang"),
        ("bastion_sglang.config", "sglang"),
        ("bastion_sglang.timing", "sglang"),
    ],
)
def test_lower_floors_do_not_import_sglang(floor: str, forbidden: str) -> None:
    """controller/, kernels/, the config and the timing module are importable without SGLang."""
    for name, path in project_modules().items():
        if name == floor or name.startswith(floor + "."):
            bases = {base for base, _ in _imported_names(name, path)}
            assert not {b for b in bases if b == forbidden or b.startswith(forbidden + ".")}, name
