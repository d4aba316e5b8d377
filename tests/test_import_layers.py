"""The package's import graph, read from the source: no cycles, and layers that import downward.

Every `import` and `from ... import` counts, wherever it sits (module level, inside a
function, under `if TYPE_CHECKING:`): an import deferred into a function still ties the two
modules together, it only hides the tie from the interpreter until a call.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "pagedllm"
PACKAGE_DIR = Path(__file__).resolve().parent.parent / PACKAGE

# Layers from the top (nearest the user) down, each stated by the folders that hold it: a
# module may import its own layer, any layer below it, and the shared modules; never a layer
# above. A feature package (lora/, spec_decode/, kv_transfer/, metrics/) is split by side: its
# subfolder named like a layer's folder (`core/`, `runner/`, `model/`, `frontend/`) is that
# layer's part of the feature, and its top-level modules (settings, what crosses a process
# boundary) are shared.
LAYERS: list[tuple[str, list[str]]] = [
    ("frontend", ["entrypoints", "frontend"]),
    ("engine client", ["client"]),
    ("core", ["core", "structured_output"]),
    ("executor", ["executor"]),
    ("worker", ["worker"]),
    ("model runner", ["runner"]),
    ("model/ops", ["model", "ops", "sample", "distributed"]),
]

# The package itself (its public API) and `python -m pagedllm` are the frontend's.
FRONTEND_ENTRY_POINTS = {"pagedllm", "pagedllm.__main__"}

# The core's interface: what crosses client <-> core and core <-> runner. Every layer reads them.
SHARED_IN_LAYER_FOLDERS = {
    "pagedllm.core.request",
    "pagedllm.core.scheduler_output",
    "pagedllm.core.messages",
}

SHARED_LAYER = "shared"
_FOLDER_LAYER = {folder: layer for layer, folders in LAYERS for folder in folders}
# The sides a feature package may have, by subfolder name.
FEATURE_SIDES = {
    "frontend": "frontend",
    "core": "core",
    "runner": "model runner",
    "model": "model/ops",
}


# ---- the graph ----------------------------------------------------------------------------
def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    modules = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _resolve(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a `from` import reads from (relative ones against `package`)."""
    if not node.level:
        return node.module or ""
    anchor = package.split(".")
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join([*anchor, node.module] if node.module else anchor)


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `module` imports: `from a import b` is an import of `a.b` where
    that is a module, else of `a` (b is one of a's attributes)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, package)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                names.add(submodule if submodule in modules else base)
    return {name for name in names if name in modules and name != module}


def build_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports."""
    return {module: imports_of(module, path, modules) for module, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle through each module that lies on a cycle, without repeats
    (a cycle is listed from its smallest name, ending where it starts)."""
    cycles: dict[tuple[str, ...], list[str]] = {}
    for start in sorted(graph):
        path = _shortest_path_back(graph, start)
        if path is None:
            continue
        smallest = path.index(min(path))
        cycle = path[smallest:] + path[:smallest]
        cycles.setdefault(tuple(cycle), [*cycle, cycle[0]])
    return list(cycles.values())


def _shortest_path_back(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """Breadth-first from start's imports back to start: [start, ..., last before start]."""
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        next_frontier = []
        for node in frontier:
            for target in sorted(graph.get(node, ())):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return path[::-1]
                if target not in parents:
                    parents[target] = node
                    next_frontier.append(target)
        frontier = next_frontier
    return None


# ---- the layers ---------------------------------------------------------------------------
def layer_of(module: str) -> str | None:
    """The layer whose folder holds `module` (SHARED_LAYER for shared modules; None outside
    the package)."""
    if module in FRONTEND_ENTRY_POINTS:
        return "frontend"
    if module in SHARED_IN_LAYER_FOLDERS:
        return SHARED_LAYER
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    if len(parts) >= 2 and parts[1] in _FOLDER_LAYER:
        return _FOLDER_LAYER[parts[1]]
    if len(parts) >= 3 and parts[2] in FEATURE_SIDES:
        return FEATURE_SIDES[parts[2]]
    return SHARED_LAYER


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    rank = {layer: index for index, (layer, _) in enumerate(LAYERS)}
    problems = []
    for module in sorted(graph):
        layer = layer_of(module)
        for target in sorted(graph[module]):
            target_layer = layer_of(target)
            if layer is None or target_layer is None:
                continue  # reported by test_every_module_has_a_layer
            if layer == SHARED_LAYER:
                if target_layer != SHARED_LAYER:
                    problems.append(
                        f"{module} (shared) imports {target} ({target_layer}): "
                        "a shared module may import only shared modules"
                    )
            elif target_layer != SHARED_LAYER and rank[target_layer] < rank[layer]:
                problems.append(f"{module} ({layer}) imports {target} ({target_layer}, above)")
    return problems


# ---- the tests ----------------------------------------------------------------------------
def test_no_import_cycles():
    cycles = find_cycles(build_graph(module_files()))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_every_module_has_a_layer():
    unassigned = sorted(m for m in module_files() if layer_of(m) is None)
    assert not unassigned, "modules with no layer (outside the package?):\n" + "\n".join(unassigned)


def test_layers_import_downward():
    problems = layer_violations(build_graph(module_files()))
    assert not problems, "imports that point up the layers:\n" + "\n".join(problems)


# ---- the checker's own behaviour ----------------------------------------------------------
def test_graph_reads_every_kind_of_import(tmp_path, monkeypatch):
    package = tmp_path / PACKAGE
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from .b import thing\n")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from pagedllm import sub\n"
        "if TYPE_CHECKING:\n"
        "    from pagedllm.c import C\n"
        "def f():\n"
        "    import pagedllm.d\n"
    )
    (package / "sub" / "b.py").write_text("from .. import a\nfrom ..sub import thing\n")
    (package / "c.py").write_text("")
    (package / "d.py").write_text("from pagedllm.sub.b import thing\n")
    monkeypatch.setattr(f"{__name__}.PACKAGE_DIR", package)
    graph = build_graph(module_files())
    assert graph["pagedllm.a"] == {"pagedllm.sub", "pagedllm.c", "pagedllm.d"}
    assert graph["pagedllm.sub"] == {"pagedllm.sub.b"}
    # `from ..sub import thing`: thing is an attribute, so the edge is to the package.
    assert graph["pagedllm.sub.b"] == {"pagedllm.a", "pagedllm.sub"}
    assert find_cycles(graph) == [
        ["pagedllm.a", "pagedllm.d", "pagedllm.sub.b", "pagedllm.a"],
        ["pagedllm.sub", "pagedllm.sub.b", "pagedllm.sub"],
    ]


def test_folders_assign_the_layers():
    assert layer_of("pagedllm.runner.model_runner") == "model runner"
    assert layer_of("pagedllm.worker.anything_new") == "worker"
    assert layer_of("pagedllm.entrypoints.openai.serving") == "frontend"
    assert layer_of("pagedllm.core.request") == SHARED_LAYER
    assert layer_of("pagedllm.core.scheduler") == "core"
    # A feature package: its sides by subfolder, its top level shared.
    assert layer_of("pagedllm.lora.core.scheduling") == "core"
    assert layer_of("pagedllm.spec_decode.runner.proposer") == "model runner"
    assert layer_of("pagedllm.lora.model.layers") == "model/ops"
    assert layer_of("pagedllm.metrics.frontend.prometheus") == "frontend"
    assert layer_of("pagedllm.lora.config") == SHARED_LAYER
    assert layer_of("pagedllm.config") == SHARED_LAYER
    assert layer_of("pagedllm") == "frontend"
    assert layer_of("elsewhere.module") is None


def test_layers_are_stated_in_few_folders():
    """The layer table stays a list of folders, not of modules."""
    folders = [folder for _, layer_folders in LAYERS for folder in layer_folders]
    named_modules = FRONTEND_ENTRY_POINTS | SHARED_IN_LAYER_FOLDERS
    assert len(folders) + len(FEATURE_SIDES) <= 17 and len(named_modules) <= 5
