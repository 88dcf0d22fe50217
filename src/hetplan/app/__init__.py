"""hetplan's application layer: what the commands do, callable from Python.

    import hetplan.app as app

    result = app.plan(model="gpt3-1.3b", cluster="metis-t4-v100-16", global_batch=64, top=5)
    result.best.plan.describe(), result.best.estimate.iteration_time_s
    result.record()                      # what 'hetplan plan --json' writes
    cost = app.estimate(app.UniformSetting(dp=4, tp=2, pp=2, micro_batch=2),
                        model="gpt2-amp", cluster="16xA100-80GB", global_batch=64)

The command line (``hetplan.cli``) reads its flags into the same typed options
(``WorkloadOptions``, ``UniformSetting``) and calls the same functions; the
text and HTML it shows render ``PlanReport`` (``hetplan.report``). Modules:
``workload`` (options to a Workload), ``planning`` and ``compare`` (planners
with the target filter), ``estimate``, ``report`` (``PlanReport``), ``records``
(plan-file entries, files written), ``explain`` and ``training`` (what a report
says besides the estimate), ``whatif``, ``tune`` (measured trials) and
``calibrate`` (fitting the cost model's rates).
"""

from hetplan.app.estimate import EstimateResult, UniformSetting, estimate
from hetplan.app.planning import PlanResult, plan
from hetplan.app.report import PlanReport
from hetplan.app.workload import WorkloadOptions, load_workload

__all__ = ["EstimateResult", "PlanReport", "PlanResult", "UniformSetting", "WorkloadOptions", "estimate",
           "load_workload", "plan"]
