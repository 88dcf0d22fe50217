"""The import graph of ``src/hetplan`` has no circle, and its lazy imports are the torch-optional ones.

Every ``import`` and ``from ... import`` in the package is an edge, at module top and inside functions
alike (a function-local import is still a dependency: it only hides it). Imports under
``if TYPE_CHECKING:`` are not edges: they never run, they only name types for annotations. An edge goes
to the module named (``from hetplan.cost import comm``: ``hetplan.cost.comm``; ``from hetplan.model import
load_model``: the package ``hetplan.model``) and to the packages above it, whose ``__init__`` runs
first, unless the importer is inside them.

A function-local import of a hetplan module is allowed only where it keeps torch (or transformers) from
being imported with the importer: the imported module pulls torch or transformers in at its own top
level, directly or through other hetplan modules. Everything else belongs at the top of the file.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
HEAVY = ("torch", "transformers")  # optional dependencies the planner side must not import


@dataclass
class Module:
    name: str
    path: Path
    top: set[str] = field(default_factory=set)  # hetplan modules imported at module level
    local: dict[str, int] = field(default_factory=dict)  # hetplan modules imported inside functions -> line
    named_local: dict[str, int] = field(default_factory=dict)  # those named by the import (no packages above)
    heavy_top: bool = False  # imports torch/transformers at module level


def _modules() -> dict[str, Module]:
    found = {}
    for path in sorted((SRC / "hetplan").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = Module(".".join(parts), path)
    return found


def _resolve(name: str, modules: dict[str, Module]) -> str:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def _targets(node: ast.Import | ast.ImportFrom, importer: Module, modules: dict[str, Module]
             ) -> list[tuple[str, bool]]:
    """The hetplan modules ``node`` runs, each with whether it is the one named (not a package above it)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = importer.name if importer.path.name == "__init__.py" else importer.name.rpartition(".")[0]
            parts = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(parts + ([base] if base else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    targets = {}
    for name in names:
        target = _resolve(name, modules) if name.startswith("hetplan") else ""
        named = True
        while target:  # the module and the packages above it, whose __init__ runs first
            if target != importer.name and not importer.name.startswith(target + "."):
                targets[target] = targets.get(target, False) or named
            target, named = target.rpartition(".")[0], False
    return sorted(targets.items())


def _is_heavy(node: ast.Import | ast.ImportFrom) -> bool:
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    return any(n.split(".")[0] in HEAVY for n in names)


Visit = Callable[["ast.Import | ast.ImportFrom", bool], None]


def _walk(tree: ast.AST, in_function: bool, visit: Visit) -> None:
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            for orelse in child.orelse:
                _walk(orelse, in_function, visit)
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            visit(child, in_function)
        inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        _walk(child, inner, visit)


def _graph() -> dict[str, Module]:
    modules = _modules()
    for module in modules.values():
        def visit(node: ast.Import | ast.ImportFrom, in_function: bool, module: Module = module) -> None:
            if not in_function and _is_heavy(node):
                module.heavy_top = True
            for target, named in _targets(node, module, modules):
                if in_function:
                    module.local.setdefault(target, node.lineno)
                    if named:
                        module.named_local.setdefault(target, node.lineno)
                else:
                    module.top.add(target)
        _walk(ast.parse(module.path.read_text(encoding="utf-8")), False, visit)
    return modules


def _pulls_heavy(name: str, modules: dict[str, Module], seen: set[str] | None = None) -> bool:
    """Whether importing ``name`` imports torch or transformers (through its top-level imports)."""
    seen = set() if seen is None else seen
    if name in seen:
        return False
    seen.add(name)
    module = modules[name]
    return module.heavy_top or any(_pulls_heavy(t, modules, seen) for t in module.top)


def _circles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    edges = {name: sorted(m.top | set(m.local)) for name, m in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(edges[node]):
                work.append((node, i + 1))
                nxt = edges[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
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
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return found


def test_no_import_circle() -> None:
    """No set of hetplan modules imports itself round, lazily or not."""
    assert _circles(_graph()) == []


def test_lazy_imports_are_the_torch_optional_ones() -> None:
    modules = _graph()
    needless = [f"{m.path.relative_to(SRC)}:{line} imports {target} inside a function"
                for m in modules.values() for target, line in sorted(m.named_local.items())
                if not _pulls_heavy(target, modules)]
    assert needless == [], "move these imports to the top of their files:\n" + "\n".join(needless)


# The layers (README "How it works"): the shared floor and the planner side below, the trainer and the
# application above. A lower module never imports an upper one, with one named exception: the model
# importers record, when a HF config or a pkg.mod:build model is imported, what hetplan's runtime can run
# of it (``ModelSpec.runtime``), found by the runtime's own rules (``runtime.support``, torch-free at
# import, and the HF staged forwards). The facts must come from the code that trains (issue 27), and
# every caller of an import -- planner, trainer, plan files -- needs them.
LOWER = ("hetplan.model", "hetplan.cluster", "hetplan.plan", "hetplan.profile", "hetplan.io", "hetplan.errors",
         "hetplan.units", "hetplan.limits", "hetplan.progress", "hetplan.published", "hetplan.cost",
         "hetplan.search", "hetplan.simulate", "hetplan.export")
UPPER = ("hetplan.runtime", "hetplan.app", "hetplan.cli", "hetplan.report")
IMPORTERS_READ_THE_RUNTIME_RULES = {
    "hetplan.model.hf -> hetplan.runtime", "hetplan.model.hf -> hetplan.runtime.support",
    "hetplan.model.hf -> hetplan.runtime.hf_stages",
    "hetplan.model.source -> hetplan.runtime", "hetplan.model.source -> hetplan.runtime.support",
}


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_lower_layers_do_not_import_upper_ones() -> None:
    modules = _graph()
    upward = {f"{m.name} -> {target}" for m in modules.values() if _within(m.name, LOWER)
              for target in {*m.top, *m.local} if _within(target, UPPER)}
    assert upward - IMPORTERS_READ_THE_RUNTIME_RULES == set(), "a lower layer imports an upper one"
    assert IMPORTERS_READ_THE_RUNTIME_RULES - upward == set(), "an exception no longer needed: remove it"


def test_no_module_imports_another_modules_private_name() -> None:
    private = []
    for path in sorted((SRC / "hetplan").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hetplan"):
                private += [f"{path.relative_to(SRC)}: {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__")]
    assert private == []


def test_the_walk_finds_a_circle_and_a_needless_lazy_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks above can fail: a two-module package with a lazy import back is caught twice."""
    pkg = tmp_path / "hetplan"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from hetplan import b\n")
    (pkg / "b.py").write_text("def f():\n    from hetplan.a import x\n    return x\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    modules = _graph()
    assert _circles(modules) == [["hetplan.a", "hetplan.b"]]
    assert modules["hetplan.b"].named_local == {"hetplan.a": 2} and not _pulls_heavy("hetplan.a", modules)
