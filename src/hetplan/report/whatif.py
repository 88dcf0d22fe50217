"""What-if: the best plan of the same model as the cluster or batch changes,
one result per variant (``--vary gpus=64,128`` | ``gpu=H100,A100-80GB`` |
``global-batch=256,512``).

``hetplan whatif`` (cli.py's ``cmd_whatif``) builds each variant from the
command line; ``hetplan report --vary`` builds it from the plan file's
workload with ``variant_workload``. Both go through the same rules (the
variant's cluster name, the homogeneous-cluster check) and ``whatif_table``
prints the same table as ``cmd_whatif`` (a test checks they agree).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

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
    from hetplan.cluster import load_cluster
    from hetplan.cost.calibration import effective_calibration

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
    from hetplan.report.training import training_numbers

    check_varies(base, what)
    workloads = [make_workload(base, what, value) for value in items]
    results = []
    for value, workload in zip(items, workloads):
        try:
            best = best_of(planner, workload) if best_of else planner.plan(workload, 1)[0]
        except HetplanError as exc:
            results.append(WhatIfResult(what, value, error=str(exc)))
            continue
        numbers = training_numbers(best.plan, best.estimate, workload.cluster, workload.model.seq_len, tokens,
                                   prices)
        results.append(WhatIfResult(what, value, workload, best, numbers=numbers))
    return results


def whatif_rows(results: Sequence[WhatIfResult]) -> list[list[str]]:
    """A row per variant: best plan, iteration time, tokens/s, MFU, max memory, $/1B tokens, days."""
    from hetplan.units import format_bytes, format_time

    rows = []
    for r in results:
        if r.best is None:
            rows.append([r.label, f"no plan: {r.error[:60]}", *["-"] * 6])
            continue
        e, n = r.best.estimate, r.numbers
        money = f"${n['usd_per_billion_tokens']:,.0f}" if "usd_per_billion_tokens" in n else "-"
        days = f"{n['days']:,.1f}" if "days" in n else "-"
        rows.append([r.label, r.best.plan.describe(), format_time(e.iteration_time_s), f"{e.tokens_per_s:,.0f}",
                     f"{100 * e.mfu:.1f}%", format_bytes(e.max_memory_bytes), money, days])
    return rows


WHATIF_HEADERS = ("variant", "best plan", "iter time", "tokens/s", "MFU", "max mem/GPU", "$/1B tokens")


def whatif_table(results: Sequence[WhatIfResult], tokens: float | None = None) -> str:
    """The table ``hetplan whatif`` prints."""
    from hetplan.report.text import table

    return table([*WHATIF_HEADERS, "days" if tokens else "days (--tokens)"], whatif_rows(results),
                 [False, False, True, True, True, True, True, True])
