"""Metis (Um et al., ATC'24): device groups, pruned stage mappings, DP-first
intra-stage search, capacity-aware layer and data balancing."""

from hetplan.search.metis.planner import MetisOptions, MetisPlanner, SearchStats

__all__ = ["MetisOptions", "MetisPlanner", "SearchStats"]
