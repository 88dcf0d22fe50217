"""Galvatron-BMW (Wang et al., TKDE 2024): per-layer DP/SDP/TP/CKPT strategies
under a memory budget, memory/time-balanced pipeline partitions, batch-size search."""

from hetplan.search.galvatron.planner import VARIANTS, GalvatronConfig, GalvatronPlanner, get_variant

__all__ = ["GalvatronConfig", "GalvatronPlanner", "VARIANTS", "get_variant"]
