"""The runtime's seams (issue 31): its modules form no import circle and import
no private name of one another, and hetplan's own GPT supplies its TP plans
through the hook user models use. Read from the source, without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import hetplan.runtime

RUNTIME = Path(hetplan.runtime.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(RUNTIME.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every ``from module import name`` and ``import module``
    in a file, at the top or inside a function (name "" for ``import module``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out += [(node.module, alias.name) for alias in node.names]
    return out


def _runtime_graph() -> dict[str, set[str]]:
    """Runtime module -> the runtime modules it imports anywhere in its file."""
    files = {_module_name(p): p for p in RUNTIME.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        for module, attr in _imports(path):
            target = f"{module}.{attr}" if f"{module}.{attr}" in files else module
            if target in files and target != name:
                graph[name].add(target)
    return graph


def _circle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of the graph ([] if none), by depth-first search."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_runtime_modules_form_no_import_circle() -> None:
    """Counting function-local imports too: a circle hidden in a lazy import is still one."""
    assert _circle(_runtime_graph()) == []


def test_no_module_imports_a_private_name_of_a_runtime_module() -> None:
    src = RUNTIME.parent
    found = [f"{path.relative_to(src)}: from {module} import {attr}"
             for path in sorted(src.rglob("*.py")) for module, attr in _imports(path)
             if module.startswith("hetplan.runtime") and attr.startswith("_") and module != _module_name(path)]
    assert found == []


def test_the_builtin_gpt_registers_its_tp_plans_where_it_is_defined() -> None:
    """Importing the model registers its TP plans and selective-recompute target
    (as a user model's ``register_tp_plan`` calls do); the registry imports no model."""
    code = (
        "import sys\n"
        "from hetplan.runtime import tp\n"
        "assert 'hetplan.runtime.models' not in sys.modules\n"
        "from hetplan.runtime.models import AttentionCore, Block, Embed, GPT, GPTConfig, Head\n"
        "model = GPT(GPTConfig(num_layers=1))\n"
        "assert [tp.tp_plan_for(m) is not None for m in (model.embed, model.layers['0'], model.head)] == [True] * 3\n"
        "assert tp.is_selective_target(model.layers['0'].attn.core)\n"
        "assert tp.registered_plan_in(model)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
