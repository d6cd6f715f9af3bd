"""The engine package's layout: no import cycles, nothing imports the command line, and the sub-packages
depend on each other in one direction (models <- speculative <- runtime <- serving, training <- cli).

Imports are read from the source (every `import` and `from ... import`, at module level or inside a
function), so a cycle hidden in a lazy import counts too."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "engine" / "ddtree"

# a sub-package may import the ones listed before it, and ddtree.config; never a later one
LAYERS = ["models", "speculative", "runtime", "serving", "training"]
TOP = {"config", "cli", "__main__", "__init__"}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: pathlib.Path) -> set[str]:
    """The ddtree modules `path` imports (a `from pkg import name` counts as pkg.name when that is a module)."""
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "ddtree")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                if node.module:
                    base = base + node.module.split(".")
            elif node.module and node.module.split(".")[0] == "ddtree":
                base = node.module.split(".")
            else:
                continue
            for alias in node.names:
                candidate = ".".join([*base, alias.name])
                found.add(candidate if candidate in MODULES else ".".join(base))
    return {m for m in found if m in MODULES}


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {name: imports_of(path) for name, path in MODULES.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_the_graph_reads_real_imports():
    assert "ddtree.runtime.engine" in GRAPH["ddtree.runtime.build"]
    assert "ddtree.models.llama" in GRAPH["ddtree.runtime.engine"]
    assert "ddtree.config" in GRAPH["ddtree.cli"]


def test_no_import_cycles():
    assert find_cycle(GRAPH) is None, " -> ".join(find_cycle(GRAPH) or [])


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_nothing_imports_the_command_line():
    importers = sorted(m for m, deps in GRAPH.items() if "ddtree.cli" in deps and m != "ddtree.__main__")
    assert importers == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer_of(m) in LAYERS))
def test_sub_packages_import_only_earlier_layers(module):
    mine = LAYERS.index(layer_of(module))
    later = sorted(d for d in GRAPH[module] if layer_of(d) in LAYERS and LAYERS.index(layer_of(d)) > mine)
    assert later == [], f"{module} imports {later}"
    assert not GRAPH[module] & {"ddtree.cli", "ddtree.__main__"}
