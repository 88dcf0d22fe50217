"""The shared cost model: compute, communication, memory and pipeline time.

``cost.model.CostModel`` is its entry point; ``hetplan.plan.workload.Workload`` its input.
"""
