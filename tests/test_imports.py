"""The planner side must import without torch (a 1,000-GPU plan needs only numpy)."""

import subprocess
import sys


def test_planner_side_imports_without_torch() -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'transformers'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import hetplan, hetplan.model, hetplan.cluster, hetplan.cost, hetplan.search, hetplan.plan\n"
        "import hetplan.validate, hetplan.export, hetplan.report.text, hetplan.cli\n"
        "from hetplan.cli import main\n"
        "assert main(['plan', '--quiet', '--top', '1']) == 0\n"
        "assert not any(m.split('.')[0] == 'torch' for m in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
