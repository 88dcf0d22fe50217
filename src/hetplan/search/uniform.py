"""The `uniform` planner: every uniform 3D configuration, ranked by the cost model.

What a user of Megatron-LM / torchtitan would try by hand: every factorisation
``dp × tp × pp`` of the GPUs (TP inside a node), every per-replica micro-batch
size, transformer blocks split evenly (embedding on the first stage, head on
the last, as Megatron-LM does), the same ZeRO stage and recomputation on
every layer, devices laid out TP-innermost, then DP, then PP (Megatron's
order). ``uniform_plan`` builds one such plan (``hetplan estimate --tp/--pp/--dp``).
"""

from __future__ import annotations

from typing import Iterator

from hetplan.cost.model import CostModel
from hetplan.cost.workload import Workload
from hetplan.model.spec import ModelSpec
from hetplan.errors import HetplanError
from hetplan.plan import Plan, RankedPlan, uniform_stage
from hetplan.search.base import rank_plans

ZERO_CHOICES = (0, 1, 3)
RECOMPUTE_CHOICES = ("none", "selective", "full")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def even_split(num_layers: int, pp: int) -> list[range]:
    """Contiguous layer ranges of (nearly) equal counts; earlier stages get the
    extra layer when the count does not divide."""
    base, extra = divmod(num_layers, pp)
    ranges, start = [], 0
    for j in range(pp):
        size = base + (1 if j < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def block_split(model: ModelSpec, pp: int) -> list[range]:
    """Megatron's split: the repeated blocks evenly over the stages (earlier
    stages get the extra one), the leading embedding on the first stage and the
    trailing head on the last. Falls back to an even split of all layers when
    there are fewer blocks than stages."""
    layers = model.layers
    first = 0
    while first < len(layers) and layers[first].kind == "embedding":
        first += 1
    last = len(layers)
    while last > first and layers[last - 1].kind == "head":
        last -= 1
    if last - first < pp:
        return even_split(len(layers), pp)
    ranges = [range(r.start + first, r.stop + first) for r in even_split(last - first, pp)]
    ranges[0] = range(0, ranges[0].stop)
    ranges[-1] = range(ranges[-1].start, len(layers))
    return ranges


def uniform_plan(
    workload: Workload, dp: int, tp: int, pp: int, micro_batch_per_replica: int,
    zero: int = 0, recompute: str = "none", schedule: str = "1f1b", sequence_parallel: bool = False,
    planner: str = "uniform", layer_split: list[range] | None = None, virtual_stages: int = 1,
) -> Plan:
    """One uniform 3D plan on the first dp·tp·pp GPUs of the cluster."""
    model, cluster = workload.model, workload.cluster
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("micro-batch", micro_batch_per_replica)):
        if value <= 0:
            raise HetplanError(f"{name} must be positive, got {value}")
    if dp * tp * pp > cluster.num_devices:
        raise HetplanError(
            f"dp x tp x pp = {dp * tp * pp} GPUs, but cluster {cluster.name!r} has {cluster.num_devices}"
        )
    if pp > model.num_layers:
        raise HetplanError(f"pp={pp} exceeds the model's {model.num_layers} layers")
    micro = dp * micro_batch_per_replica
    if workload.global_batch_size % micro:
        raise HetplanError(
            f"global batch {workload.global_batch_size} is not a multiple of dp x micro-batch = {micro}"
        )
    split = layer_split or block_split(model, pp)
    stages = []
    for j, layers in enumerate(split):
        first = j * dp * tp
        devices = list(range(first, first + dp * tp))
        stages.append(uniform_stage(layers, devices, dp, tp, micro, zero, recompute, sequence_parallel))
    return Plan(
        model=model.name, cluster=cluster.name, global_batch_size=workload.global_batch_size,
        micro_batch_size=micro, num_micro_batches=workload.global_batch_size // micro,
        schedule=schedule, stages=tuple(stages), planner=planner, virtual_stages=virtual_stages,
    )


def tp_fits_nodes(workload: Workload, tp: int) -> bool:
    """TP groups must not cross nodes: with devices in id order, every run of
    ``tp`` consecutive devices must lie in one node."""
    start = 0
    for node in workload.cluster.nodes:
        if (start % tp) or node.num_gpus % tp:
            return False
        start += node.num_gpus
    return True


def max_tp(workload: Workload) -> int:
    return min(layer.tp_max for layer in workload.model.layers)


def uniform_configs(workload: Workload) -> Iterator[tuple[int, int, int, int]]:
    """(dp, tp, pp, micro-batch per replica) using all GPUs."""
    n = workload.cluster.num_devices
    gbs = workload.global_batch_size
    heads = max_tp(workload)
    for tp in divisors(n):
        if tp > workload.cluster.max_gpus_per_node or not tp_fits_nodes(workload, tp):
            continue
        if heads < (1 << 30) and heads % tp:
            continue
        for pp in divisors(n // tp):
            if pp > workload.model.num_layers:
                continue
            dp = n // (tp * pp)
            if gbs % dp:
                continue
            for u in divisors(gbs // dp):
                yield dp, tp, pp, u


class UniformPlanner:
    """Enumerate uniform 3D plans (all dp/tp/pp, micro-batch, ZeRO, recompute)."""

    name = "uniform"

    def __init__(self, zero_choices: tuple[int, ...] = ZERO_CHOICES,
                 recompute_choices: tuple[str, ...] = RECOMPUTE_CHOICES) -> None:
        self.zero_choices = zero_choices
        self.recompute_choices = recompute_choices

    def candidates(self, workload: Workload) -> Iterator[Plan]:
        for dp, tp, pp, u in uniform_configs(workload):
            for zero in self.zero_choices:
                if zero and dp == 1:
                    continue
                for recompute in self.recompute_choices:
                    yield uniform_plan(workload, dp, tp, pp, u, zero, recompute, planner=self.name)

    def plan(self, workload: Workload, top_k: int = 5) -> list[RankedPlan]:
        plans = list(self.candidates(workload))
        if not plans:
            raise HetplanError(
                f"global batch {workload.global_batch_size} cannot be divided over any data-parallel "
                f"degree of the {workload.cluster.num_devices} GPUs; choose a multiple of a divisor of "
                f"{workload.cluster.num_devices}"
            )
        return rank_plans(CostModel(workload), plans, top_k)
