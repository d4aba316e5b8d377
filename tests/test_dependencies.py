"""pyproject.toml declares every package pagedllm imports, and none it does not (issue 46).

Read from the source: every top-level `import` outside the standard library, wherever it
sits (a deferred import counts: the code needs the package the day it runs), mapped to its
distribution through the installed metadata. The package's imports must be runtime
dependencies or an extra's (`ray`, `bench`: imported only where that feature runs); the
tests' and benchmarks' may be `dev`'s too, or one the Makefile installs without its
dependencies (a package whose own requirements clash with the lock). Each declared package
is imported somewhere, but for the few that work without being imported (NOT_IMPORTED).
"""

from __future__ import annotations

import ast
import functools
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# Declared, used, never imported.
NOT_IMPORTED = {
    "ninja": "torch's cpp_extension runs it for a checkout's JIT build",
    "pytest-timeout": "a pytest plugin (pyproject's `timeout`)",
    "ruff": "the linter, run as a command",
}
# Extras other branches add (client libraries driven by their own tests) are checked there.
CHECKED_EXTRAS = ("dev", "bench", "ray")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _names(requirements: list[str]) -> set[str]:
    return {_normalize(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in requirements}


def _local_modules(folder: str) -> set[str]:
    """Modules the tests and benchmarks import by their own name (pytest puts their folders
    on sys.path); the package imports its own modules by their full names."""
    if folder == "pagedllm":
        return {"pagedllm"}
    paths = (REPO / folder).rglob("*")
    return {"pagedllm", "benchmarks", "tests"} | {p.stem for p in paths if p.suffix in ("", ".py")}


@functools.cache
def _top_level_imports(folder: str) -> frozenset[str]:
    modules: set[str] = set()
    for path in (REPO / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                modules |= {alias.name.partition(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                modules.add(node.module.partition(".")[0])
    return frozenset(modules - _local_modules(folder) - set(sys.stdlib_module_names))


@functools.cache
def _owners() -> dict[str, list[str]]:
    return packages_distributions()


def imported_distributions(*folders: str) -> set[str]:
    """The distributions whose modules the Python files under `folders` import."""
    third_party = set().union(*map(_top_level_imports, folders)) - {"__future__"}
    owners = _owners()
    unknown = {module for module in third_party if module not in owners}
    # Only what runs in other environments may be missing here: optional peers (vLLM's, in
    # benchmarks/peers) and the format library of the one-off tests/format_library_check.py.
    assert unknown <= {"vllm", "compressed_tensors"}, (
        f"imported but not installed: {sorted(unknown)}"
    )
    return {_normalize(dist) for module in third_party - unknown for dist in owners[module]}


def makefile_no_deps() -> set[str]:
    """The packages the Makefile installs with `pip install --no-deps NAME==VERSION ...`."""
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    lines = [line for line in text.splitlines() if "pip install" in line and "--no-deps" in line]
    return {_normalize(name) for line in lines for name in re.findall(r"([\w.-]+)==", line)}


def declared(*extras: str) -> set[str]:
    names = _names(PYPROJECT["project"]["dependencies"])
    for extra in extras:
        names |= _names(PYPROJECT["project"]["optional-dependencies"][extra])
    return names


def test_the_package_imports_only_what_it_declares():
    missing = imported_distributions("pagedllm") - declared("bench", "ray")
    assert not missing, f"pagedllm imports {sorted(missing)}: declare them in pyproject.toml"


def test_tests_and_benchmarks_import_only_what_is_declared():
    imported = imported_distributions("tests", "benchmarks")
    missing = imported - declared(*CHECKED_EXTRAS) - makefile_no_deps()
    assert not missing, f"tests or benchmarks import {sorted(missing)}: add them to `dev`"


def test_every_declared_package_is_imported():
    imported = imported_distributions("pagedllm", "tests", "benchmarks")
    unused = declared(*CHECKED_EXTRAS) - imported - set(NOT_IMPORTED)
    assert not unused, f"declared but never imported: {sorted(unused)}"
