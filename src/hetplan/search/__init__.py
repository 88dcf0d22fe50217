"""Planners: each paper's algorithm plus baselines, all ranked by the shared cost model.

``common/`` holds what every planner shares; ``amp/``, ``galvatron/`` and
``metis/`` are the papers' planners; ``baselines/`` the systems they compare
against; ``exhaustive`` the oracle; ``auto`` hetplan's own. ``registry`` names
them all.
"""

from hetplan.search.base import rank_plans
from hetplan.search.registry import get_planner, planner_descriptions, planner_names

__all__ = ["get_planner", "planner_names", "planner_descriptions", "rank_plans"]
