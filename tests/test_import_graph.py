"""The project's import graph: no circles, and every module on its floor (architecture page, "Floors").

The graph is read from the source (every `import` / `from ... import`, at module level, inside a function or
under `TYPE_CHECKING`, since a lazy import still ties two modules together), over the four packages
`bastion_sglang`, its `controller`, `kernels` and `calibration`. `from package import name` points at the
submodule when `name` is one, else at the package. An import of a module's own ancestor package is not an
edge (Python imports the parents first whatever the code says).

Floors are `FLOORS`, bottom up: a module imports project modules of its own floor or below only, and
SGLang only on a floor that allows it. To place a new module, add its dotted name (or a package pattern,
`name.*`) to the `modules` of its floor; `test_every_module_has_one_floor` fails until it is placed.
"""

from __future__ import annotations

import ast
import fnmatch
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

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
    assert "bastion_sglang.kernels" in graph["bastion_sglang.step.commit"]
    assert "bastion_sglang.registration" in graph["bastion_sglang"]
    assert "bastion_sglang.kernels.reference" in graph["bastion_sglang.kernels.triton_tree"]
    assert "bastion_sglang.kernels" not in graph["bastion_sglang.kernels.triton_tree"]


def test_no_import_circles() -> None:
    assert circles(import_graph()) == []


@dataclass(frozen=True)
class Floor:
    """One floor of the architecture page's "Floors": the modules on it and whether they may import SGLang."""

    name: str
    modules: tuple[str, ...]  # dotted module names; "pkg.*" also places every module under pkg
    sglang: bool  # whether its modules may import SGLang (at run time or for types)


def _under(package: str) -> tuple[str, str]:
    return package, f"{package}.*"


_P = "bastion_sglang"
FLOORS: tuple[Floor, ...] = (
    Floor("controller", _under(f"{_P}.controller"), sglang=False),
    Floor("kernels", _under(f"{_P}.kernels"), sglang=False),
    Floor(
        "config",
        (
            f"{_P}.integration.config",
            f"{_P}.step.timing",
            f"{_P}.integration.drafter_config",
            f"{_P}.integration.draft_vocab",
            f"{_P}.step.step_anatomy",
            f"{_P}.step.synthetic_profile",
            f"{_P}.step",
            f"{_P}.integration",
        ),
        sglang=False,
    ),
    Floor(
        "calibration store and lookup",
        (
            f"{_P}.calibration",
            *(
                f"{_P}.calibration.{name}"
                for name in (
                    "identity",
                    "store",
                    "lookup",
                    "fitting",
                    "microbench",
                    "random_inputs",
                    "sweep",
                    "plot",
                    "profile_cli",
                    "acceptance_fit",
                    "rank_histogram",
                )
            ),
            f"{_P}.assets.prompt_sets",
            f"{_P}.assets",
        ),
        sglang=False,
    ),
    Floor(
        "glue without SGLang",
        tuple(
            f"{_P}.step.{name}"
            for name in ("step_controller", "draft_context", "graph_buckets", "lattice_plan")
        ),
        sglang=False,
    ),
    Floor("SGLang adapter", (f"{_P}.integration.sglang_adapter",), sglang=True),
    Floor(
        "glue",
        tuple(
            f"{_P}.{name}"
            for name in (
                "worker",
                *(
                    f"step.{stage}"
                    for stage in (
                        "draft_protocols",
                        "graphs",
                        "spec_input",
                        "metrics",
                        "request_outputs",
                        "request_penalties",
                        "prefill_redraw",
                        "prefill",
                        "plan_stage",
                        "rank_sync",
                        "drafter_forward",
                        "accept",
                        "synthetic_acceptance",
                        "commit",
                        "target_forward",
                        "planning_setup",
                    )
                ),
                "integration.cpu_support",
                "integration.request_support",
                "calibration.runner_measurement",
                "calibration.startup",
                "reference.drafter",
                "reference.proposer",
                "reference.selector",
                "reference.lattice_proposer",
            )
        ),
        sglang=True,
    ),
    Floor("registration", (_P, f"{_P}.registration", f"{_P}.step.step_anatomy_hooks"), sglang=True),
    Floor(
        "commands",
        (
            f"{_P}.cli",
            *_under(f"{_P}.demo"),
            *_under(f"{_P}.bench"),
            f"{_P}.reference",
            *(f"{_P}.reference.{name}" for name in ("engine", "pair_bench", "sampling", "stats", "target")),
            *_under(f"{_P}.training"),
            *(
                f"{_P}.calibration.{name}"
                for name in ("__main__", "cli", "engines", "sglang_runner", "acceptance_run")
            ),
        ),
        sglang=True,
    ),
)
"""Bottom up. The glue's floor is split: the modules that never touch SGLang (the step controller among
them) below the adapter, the adapter at the bottom of the rest. The commands, which build servers and
engines with registration's `make_config`, sit on top."""


def floor_index(module: str, floors: Sequence[Floor]) -> list[int]:
    """The indices of the floors whose `modules` place `module` (one, for a placed module)."""
    return [
        index
        for index, floor in enumerate(floors)
        if any(fnmatch.fnmatchcase(module, pattern) for pattern in floor.modules)
    ]


def floor_violations(graph: Mapping[str, set[str]], floors: Sequence[Floor]) -> list[str]:
    """Every edge of `graph` from a module to a project module on a higher floor, as text naming both
    modules and floors (modules not placed on exactly one floor are `test_every_module_has_one_floor`'s)."""
    placed = {module: found[0] for module in graph if len(found := floor_index(module, floors)) == 1}
    return [
        f"{module} ({floors[placed[module]].name}) imports {target} ({floors[placed[target]].name})"
        for module in sorted(graph)
        for target in sorted(graph[module])
        if module in placed and target in placed and placed[target] > placed[module]
    ]


def sglang_violations(imports: Mapping[str, set[str]], floors: Sequence[Floor]) -> list[str]:
    """Every module on a floor without SGLang that imports it. imports: module -> every module name it
    imports (project or not)."""
    return [
        f"{module} ({floors[found[0]].name}) imports {name}"
        for module in sorted(imports)
        if len(found := floor_index(module, floors)) == 1 and not floors[found[0]].sglang
        for name in sorted(imports[module])
        if name == "sglang" or name.startswith("sglang.")
    ]


def imported_names() -> dict[str, set[str]]:
    """module -> every module name its import statements name (project, SGLang, anything)."""
    return {
        name: {base for base, _ in _imported_names(name, path)} for name, path in project_modules().items()
    }


SYNTHETIC = (
    Floor("low", ("pkg.low", "pkg.low.*"), sglang=False),
    Floor("high", ("pkg.high",), sglang=True),
)


def test_the_floor_check_finds_an_upward_edge() -> None:
    """A deliberately wrong edge (the low floor importing the high one) is reported; the right ones not."""
    graph = {"pkg.low": {"pkg.low.sub"}, "pkg.low.sub": set(), "pkg.high": {"pkg.low"}}
    assert floor_violations(graph, SYNTHETIC) == []
    graph["pkg.low.sub"] = {"pkg.high"}
    assert floor_violations(graph, SYNTHETIC) == ["pkg.low.sub (low) imports pkg.high (high)"]


def test_the_sglang_check_finds_sglang_on_a_floor_without_it() -> None:
    imports = {"pkg.low": {"torch"}, "pkg.high": {"sglang.srt.server_args"}}
    assert sglang_violations(imports, SYNTHETIC) == []
    imports["pkg.low"].add("sglang.srt.managers.schedule_batch")
    assert sglang_violations(imports, SYNTHETIC) == [
        "pkg.low (low) imports sglang.srt.managers.schedule_batch"
    ]


def test_every_module_has_one_floor() -> None:
    """A new module must be placed on a floor in FLOORS (module docstring), and on one only."""
    misplaced = {
        module: found for module in project_modules() if len(found := floor_index(module, FLOORS)) != 1
    }
    assert misplaced == {}


def test_modules_import_only_their_floor_or_below() -> None:
    assert floor_violations(import_graph(), FLOORS) == []


def test_importing_the_step_controller_loads_no_sglang() -> None:
    """The step controller runs without SGLang (the reference engine shares it): importing it in a fresh
    interpreter loads no SGLang module."""
    code = (
        "import sys\n"
        "import bastion_sglang.step.step_controller\n"
        "print(sorted(name for name in sys.modules if name.split('.')[0] == 'sglang'))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_floors_without_sglang_do_not_import_it() -> None:
    """controller/, kernels/, the config and timing modules, calibration's store and lookup and the glue
    below the adapter (the step controller among it) import no SGLang, not even for types."""
    assert sglang_violations(imported_names(), FLOORS) == []


def test_the_controller_imports_neither_sglang_nor_kernels() -> None:
    """The floors' rule for the bottom floor, read off the graph directly."""
    graph, names = import_graph(), imported_names()
    controller = [module for module in graph if floor_index(module, FLOORS) == [0]]
    assert f"{_P}.controller.policies" in controller
    kernels = {module for module in graph if fnmatch.fnmatchcase(module, f"{_P}.kernels*")}
    assert {module: graph[module] & kernels for module in controller if graph[module] & kernels} == {}
    assert {
        module: sorted(name for name in names[module] if name.split(".")[0] == "sglang")
        for module in controller
        if any(name.split(".")[0] == "sglang" for name in names[module])
    } == {}
