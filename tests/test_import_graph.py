"""strata's import graph has no cycle, and its layers point one way.

Every module under strata/ is parsed (never imported) and every `strata.*` import it makes is an
edge: at module level and inside functions alike, since a deferred import that closes a cycle is
still a cycle in the design (it only moves the failure to the first call). Imports under
`if TYPE_CHECKING:` are left out: they never run, and an annotation may name a type of the layer
above. `from strata.x import y` is an edge to strata.x.y where that is a module, else to strata.x.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "strata"


def _module_names() -> dict[str, Path]:
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


MODULES = _module_names()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _nearest_module(name: str) -> str:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str, path: Path) -> set[str]:
    """The strata modules `module` imports anywhere but under `if TYPE_CHECKING:`."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(_nearest_module(a.name) for a in node.names if a.name.split(".")[0] == "strata")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            if base.split(".")[0] == "strata":
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    out.add(full if full in MODULES else _nearest_module(base))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    out.discard(module)
    out.discard("")
    return out


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, iterative)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_graph_is_read():
    """The parse sees the imports it should (a broken walk would find no cycle anywhere)."""
    assert len(MODULES) > 200
    assert "strata.model_config" in GRAPH["strata.reference.model"]
    assert "strata.errors" in GRAPH["strata.model_config"]
    # a deferred import counts: doctor's source reader reads GGUF files only when asked to
    assert "strata.formats.gguf_file" in GRAPH["strata.doctor.source"]


def test_find_cycle_names_one():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    cycle = _find_cycle(GRAPH)
    assert cycle is None, "import cycle in strata/: " + " -> ".join(cycle)


def _importers_outside(package: str, allowed: tuple[str, ...]) -> list[str]:
    bad = []
    for module, deps in GRAPH.items():
        if module == package or module.startswith(package + "."):
            bad += [f"{module} -> {d}" for d in sorted(deps)
                    if not any(d == a or d.startswith(a + ".") for a in allowed)]
    return bad


# the modules that describe a model (below every computation on one)
DESCRIPTION = ("strata.errors", "strata.layer_kinds", "strata.tensor_names", "strata.model_config",
               "strata.families")


@pytest.mark.parametrize("package, allowed", [
    # the reference is pure: numpy over the model's description and the byte formats
    ("strata.reference", ("strata.reference", "strata.formats") + DESCRIPTION),
    # byte formats know nothing of the model above them but its description
    ("strata.formats", ("strata.formats",) + DESCRIPTION),
    # the model's description is the bottom: it imports only itself
    ("strata.layer_kinds", DESCRIPTION),
    ("strata.tensor_names", DESCRIPTION),
    ("strata.model_config", DESCRIPTION),
    ("strata.families", DESCRIPTION),
])
def test_layers_point_down(package, allowed):
    bad = _importers_outside(package, allowed)
    assert not bad, f"{package} imports above its layer: " + "; ".join(bad)
