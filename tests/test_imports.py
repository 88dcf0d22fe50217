"""The planner side must import without torch (a 1,000-GPU plan needs only numpy)."""

import ast
import subprocess
import sys
from pathlib import Path


def test_planner_side_imports_without_torch() -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'transformers'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import hetplan, hetplan.model, hetplan.cluster, hetplan.cost, hetplan.search, hetplan.plan.spec\n"
        "import hetplan.plan.validate, hetplan.export.tools, hetplan.report.text, hetplan.cli\n"
        "from hetplan.cli import main\n"
        "assert main(['plan', '--quiet', '--top', '1']) == 0\n"
        "assert not any(m.split('.')[0] == 'torch' for m in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def _imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_profile_formats_import_nothing_from_the_runtime() -> None:
    """hetplan.profile is what the planner reads (file formats); the measuring
    half of 'hetplan profile' lives in hetplan.runtime.profiling, on the runtime's side."""
    import hetplan.profile

    found = {f"{path.name}: {name}" for path in sorted(Path(hetplan.profile.__file__).parent.glob("*.py"))
             for name in _imported_modules(path) if name.split(".")[:2] == ["hetplan", "runtime"]}
    assert not found
