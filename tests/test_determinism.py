"""The same input gives the same plan under any machine load and any hash seed:
search budgets count work, never seconds."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import json
from hetplan.cluster.io import load_cluster
from hetplan.plan.workload import Workload
from hetplan.model.presets import get_model
from hetplan.search.auto import AutoPlanner
from hetplan.search.metis import MetisOptions, MetisPlanner

workload = Workload(get_model("gpt3-1.3b"), load_cluster("metis-mixed-64"), 64)
metis = MetisPlanner(MetisOptions(max_evaluations=6))
auto = AutoPlanner(max_solves=3)
out = {
    "metis": [r.to_dict() for r in metis.plan(workload, 3)],
    "metis_budget_hit": metis.stats.budget_hit,
    "auto": [r.to_dict() for r in auto.plan(workload, 3)],
    "auto_budget_hit": auto.stats.budget_hit,
}
print(json.dumps(out, sort_keys=True))
"""


def _run(hash_seed: str) -> str:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600,
                          check=True)
    return done.stdout


def test_tiny_budgets_give_the_same_plans_under_load_and_any_hash_seed() -> None:
    quiet = _run("0")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]  # both cores busy
    try:
        loaded = _run("12345")
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert '"metis_budget_hit": true' in quiet and '"auto_budget_hit": true' in quiet  # the budgets did cut
    assert quiet == loaded
