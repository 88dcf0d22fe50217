"""SageMaker model parallelism's automatic tree partition as a planner (``--planner smp``)."""

from hetplan.search.smp.planner import DEFAULT_ALPHA, SMPPlanner

__all__ = ["DEFAULT_ALPHA", "SMPPlanner"]
