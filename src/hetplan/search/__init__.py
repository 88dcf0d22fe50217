"""Planners: each paper's algorithm plus baselines, all ranked by the shared cost model.

Every module in this package that defines ``register()`` is imported in name
order and registers its planners, so adding a planner needs no edit here.
"""

import importlib
import pkgutil

from hetplan.search.base import get_planner, planner_descriptions, planner_names, rank_plans, register_planner
from hetplan.search.uniform import UniformPlanner, uniform_plan

register_planner("uniform", "every uniform dp x tp x pp, micro-batch, ZeRO and recompute choice (even layer split)",
                 UniformPlanner)

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    _module = importlib.import_module(f"{__name__}.{_info.name}")
    if hasattr(_module, "register"):
        _module.register()

__all__ = ["get_planner", "planner_names", "planner_descriptions", "rank_plans", "register_planner",
           "UniformPlanner", "uniform_plan"]
