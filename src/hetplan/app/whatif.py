"""What-if: the best plan of the same model as the cluster or batch changes,
one result per variant (``--vary gpus=64,128`` | ``gpu=H100,A100-80GB`` |
``global-batch=256,512``).

``hetplan whatif`` varies the workload of its command line; ``hetplan report
--vary`` the plan file's. Both make each variant with ``variant_workload``
(the variant's cluster name, the homogeneous-cluster check) and print
``hetplan.report.whatif.whatif_table`` (a test checks they agree).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from hetplan.app.records import ranked_record
from hetplan.app.training import check_price_types, cluster_gpu_types, prices_for, training_numbers
from hetplan.cluster.io import load_cluster
from hetplan.cost.model import CostModel
from hetplan.cost.calibration import effective_calibration
from hetplan.errors import HetplanError

WHATIF_KNOBS = ("gpus", "gpu", "global-batch")


def parse_vary(text: str) -> tuple[str, list[str]]:
    """``WHAT=V1,V2,...`` as (what, values), checked as ``hetplan whatif`` checks it."""
    what, sep, values = text.partition("=")
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or what not in WHATIF_KNOBS or not items:
        raise HetplanError(f"--vary takes WHAT=V1,V2,... with WHAT one of {', '.join(WHATIF_KNOBS)}; got {text!r}")
    if what != "gpu":
        for v in items:
            if not v.isdigit() or int(v) <= 0:
                raise HetplanError(f"--vary {what}: {v!r} is not a positive whole number")
    return what, items


def check_varies(base: Any, what: str) -> None:
    """``gpus`` and ``gpu`` rebuild a homogeneous cluster; a mixed one cannot be varied that way."""
    if what in ("gpus", "gpu") and not base.cluster.is_homogeneous:
        raise HetplanError(f"--vary {what} changes a homogeneous cluster; {base.cluster.name!r} mixes GPU types "
                           "or node sizes: write one cluster file per variant and run 'hetplan compare' or plan each")


def variant_cluster_name(base: Any, what: str, value: str) -> str | None:
    """The preset name of the variant's cluster (None: the base cluster)."""
    gpu, count = base.cluster.devices[0].gpu.name, base.cluster.num_devices
    return f"{value}x{gpu}" if what == "gpus" else f"{count}x{value}" if what == "gpu" else None


def variant_workload(base: Any, what: str, value: str) -> Any:
    """The base workload with the variant's cluster or global batch, as
    ``hetplan whatif`` makes it: a new cluster takes its own calibration (a
    preset has none), over the links the base's profile measured."""
    if what == "global-batch":
        return replace(base, global_batch_size=int(value))
    cluster = load_cluster(variant_cluster_name(base, what, value) or "")
    given = cluster.meta.get("calibration") or base.calibration  # the base's --calibration carries over
    return replace(base, cluster=cluster, calibration=effective_calibration(base.profile, cluster, given))


@dataclass(frozen=True)
class WhatIfResult:
    """One variant: its best plan (``best``, a RankedPlan) or why there is none (``error``)."""

    what: str
    value: str
    workload: Any = None
    best: Any = None
    error: str = ""
    numbers: dict[str, float] = field(default_factory=dict)  # report/training.py's training_numbers

    @property
    def label(self) -> str:
        return f"{self.what}={self.value}"


def run_whatif(base: Any, what: str, items: Sequence[str], planner: Any, tokens: float | None = None,
               prices: dict[str, float] | None = None,
               make_workload: Callable[[Any, str, str], Any] = variant_workload,
               best_of: Callable[[Any, Any], Any] | None = None) -> list[WhatIfResult]:
    """Plan each variant with ``planner`` (the best plan only; ``best_of(planner,
    workload)`` runs it, default ``planner.plan(workload, 1)[0]``). A variant
    without a plan (nothing fits) is a result with ``error``, not a failure of
    the whole what-if; a variant that cannot be built (an unknown GPU type) is
    the user's mistake, raised before any planning."""
    check_varies(base, what)
    workloads = [make_workload(base, what, value) for value in items]
    if prices is not None:  # a price names a type of some variant's cluster
        check_price_types(prices, set().union(*(cluster_gpu_types(w.cluster) for w in [base, *workloads])))
    results = []
    for value, workload in zip(items, workloads):
        try:
            best = best_of(planner, workload) if best_of else planner.plan(workload, 1)[0]
        except HetplanError as exc:
            results.append(WhatIfResult(what, value, error=str(exc)))
            continue
        numbers = training_numbers(best.plan, best.estimate, workload.cluster, workload.model.seq_len, tokens,
                                   prices_for(prices, workload.cluster))
        results.append(WhatIfResult(what, value, workload, best, numbers=numbers))
    return results


def whatif_record(what: str, results: Sequence[WhatIfResult], tokens: float | None,
                  prices: dict[str, float] | None) -> dict[str, Any]:
    """What ``hetplan whatif --json`` writes: each variant's best plan as a
    plan-file record (with its memory breakdown, from the variant's cost model)."""
    data = [{"variant": {what: r.value}, "error": r.error} if r.best is None else
            {"variant": {what: r.value}, "cluster": r.workload.cluster.name,
             **ranked_record(r.best, CostModel(r.workload), tokens, prices)} for r in results]
    return {"vary": what, "variants": data}
