"""hetplan: plan and run parallel training on heterogeneous GPU clusters.

The planner side (model, cluster, cost, search, plan, simulate) needs only numpy
and PyYAML; torch is imported lazily by the runtime, the profiler and nn.Module
import.
"""

from hetplan.errors import HetplanError

__all__ = ["HetplanError"]
__version__ = "0.1.0"
