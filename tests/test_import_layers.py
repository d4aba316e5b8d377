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

# Layers from the top (nearest the user) down: a module may import its own layer, any
# layer below it, and the shared modules; never a layer above. A pattern ending in ".*"
# names a package and everything under it; the most specific pattern that matches a
# module assigns it (an exact name beats a package, a deeper package a shallower one).
LAYERS: list[tuple[str, list[str]]] = [
    (
        "frontend",
        [
            "pagedllm",  # the package's __init__: the public API
            "pagedllm.__main__",
            "pagedllm.entrypoints.*",
            "pagedllm.bench.*",
            "pagedllm.llm",
            "pagedllm.beam_search",
            "pagedllm.engine.llm_engine",
            "pagedllm.engine.async_llm",
            "pagedllm.engine.admission",
            "pagedllm.engine.processor",
            "pagedllm.engine.chat_template",  # bounded chat-template rendering (processor's)
            "pagedllm.engine.template_sandbox",
            "pagedllm.engine.thread_deadline",
            "pagedllm.engine.output_processor",
            "pagedllm.engine.detokenizer",
            "pagedllm.metrics.timeline",  # one per sequence, for both metrics sinks
            "pagedllm.metrics.prometheus",
            "pagedllm.metrics.timeseries",  # the dashboard's live samples
        ],
    ),
    ("engine client", ["pagedllm.engine.client", "pagedllm.engine.dp_router"]),
    (
        "core",
        [
            "pagedllm.engine.core",
            "pagedllm.engine.core_proc",
            "pagedllm.engine.engine_config",
            "pagedllm.engine.kv_tier_setup",
            # The KV tiers' scheduler side (what each tier holds, each step's moves).
            "pagedllm.kv_transfer.tier_manager",
            # Features' scheduler sides: participants of the scheduling loop.
            "pagedllm.kv_transfer.scheduling",
            "pagedllm.spec_decode.scheduling",
            "pagedllm.lora.scheduling",
            "pagedllm.metrics.logger",
            "pagedllm.core.*",
            "pagedllm.structured_output.*",
        ],
    ),
    ("executor", ["pagedllm.executor.*"]),
    ("worker", ["pagedllm.worker.*"]),
    (
        "model runner",
        [
            "pagedllm.worker.model_runner",
            # The runner's parts: its build, its sampling, its debug-mode KV check.
            "pagedllm.worker.model_building",
            "pagedllm.worker.sampling_stage",
            "pagedllm.worker.kv_integrity",
            "pagedllm.worker.input_batch",
            "pagedllm.worker.compiled_forward",
            "pagedllm.worker.huge_pages",
            "pagedllm.worker.kv_prefault",
            "pagedllm.worker.pooler",
            # The KV tiers' bytes: host memory, disk files, the link to a peer.
            "pagedllm.kv_transfer.tier_worker",
            "pagedllm.kv_transfer.transport",
            # Speculative decoding's proposers and rejection sampler run in the runner.
            "pagedllm.spec_decode.*",
        ],
    ),
    (
        "model/ops",
        [
            "pagedllm.model.*",
            "pagedllm.ops.*",
            "pagedllm.sample.*",
            # Process groups, collectives and thread binding: the model's layers call them.
            "pagedllm.distributed.*",
            # LoRA adapters: read and checked (frontend and runner), applied in the model.
            "pagedllm.lora.*",
        ],
    ),
]

# Leaf modules every layer may import. They import only one another, so they stay leaves.
SHARED: list[str] = [
    "pagedllm.config",
    "pagedllm.parallel_config",  # how the model is split over ranks (config's)
    "pagedllm.sampling_params",
    "pagedllm.pooling_params",
    "pagedllm.outputs",
    "pagedllm.errors",
    "pagedllm.fault_isolation",  # a batch retried row by row (scheduler and runner)
    "pagedllm.value_checks",  # checks of user values (ints, floats, text, JSON documents)
    "pagedllm.logger",
    "pagedllm.utils",
    # What crosses a boundary: client <-> core, core <-> runner.
    "pagedllm.core.request",
    "pagedllm.core.scheduler_output",
    "pagedllm.engine.messages",
    "pagedllm.metrics.stats",
    # Speculative decoding's settings and counters: read by the config, core and metrics.
    "pagedllm.spec_decode.config",
    "pagedllm.spec_decode.metrics",
    "pagedllm.spec_decode",
    # LoRA's request and settings: carried by requests, read by the config and scheduler.
    "pagedllm.lora.request",
    "pagedllm.lora.config",
    "pagedllm.lora",
    # The KV tiers' settings, the moves a step asks for, and the disk tier's file layout.
    "pagedllm.kv_transfer.config",
    "pagedllm.kv_transfer.ops",
    "pagedllm.kv_transfer.disk_layout",
    "pagedllm.kv_transfer",
    # Packages' own (empty or docstring-only) __init__ modules.
    "pagedllm.core",
    "pagedllm.distributed",
    "pagedllm.engine",
    "pagedllm.executor",
    "pagedllm.metrics",
    "pagedllm.model",
    "pagedllm.model.layers",
    "pagedllm.model.models",
    "pagedllm.ops",
    "pagedllm.sample",
    "pagedllm.structured_output",
    "pagedllm.worker",
]

SHARED_LAYER = "shared"


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
def _match_length(pattern: str, module: str) -> int:
    """How specific a match is (0: none); an exact name outranks any package pattern."""
    if pattern.endswith(".*"):
        package = pattern[:-2]
        if module == package or module.startswith(package + "."):
            return 2 * len(package)
        return 0
    return 2 * len(pattern) + 1 if module == pattern else 0


def layer_of(module: str) -> str | None:
    """The layer the most specific pattern gives `module` (SHARED_LAYER for shared modules)."""
    best, best_length = None, 0
    table = [*LAYERS, (SHARED_LAYER, SHARED)]
    for layer, patterns in table:
        for pattern in patterns:
            length = _match_length(pattern, module)
            if length > best_length:
                best, best_length = layer, length
    return best


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
    assert not unassigned, (
        "modules with no layer (add them to LAYERS or SHARED in this file):\n"
        + "\n".join(unassigned)
    )


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


def test_most_specific_pattern_assigns_the_layer():
    assert layer_of("pagedllm.worker.model_runner") == "model runner"
    assert layer_of("pagedllm.worker.anything_new") == "worker"
    assert layer_of("pagedllm.core.request") == SHARED_LAYER
    assert layer_of("pagedllm.core.scheduler") == "core"
    assert layer_of("pagedllm.nowhere") is None
