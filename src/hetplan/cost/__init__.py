"""The shared cost model: compute, communication, memory and pipeline time."""

from hetplan.cost.model import CostModel
from hetplan.cost.workload import Workload

__all__ = ["CostModel", "Workload"]
