"""The fixed-strategy baselines of Galvatron-BMW's tables: pure DP (PyTorch
DDP), pure TP (Megatron), pure PP (PyTorch GPipe), pure SDP (FSDP / ZeRO-3)
and DeepSpeed 3D (2-way TP x 2-way PP, DP over the rest).

Every layer runs the same strategy; the layers are split evenly by block
(``common.layer_splits.block_split``). With ``--global-batch auto`` they
search the batch size as Galvatron's loop does: grow it until it no longer
fits, keep the best throughput.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError, OutOfMemoryError
from hetplan.plan.spec import LayerStrategy, Plan, RankedPlan, Stage
from hetplan.search.base import cost_model_for, rank_key
from hetplan.search.common.batch_grid import batch_grid
from hetplan.search.common.layer_splits import block_split
from hetplan.units import format_bytes


@dataclass(frozen=True)
class BaselineConfig:
    """A fixed strategy applied to every layer (Table II's baselines)."""

    name: str
    dp: int  # 0: all GPUs left after tp and pp
    tp: int  # 0: all GPUs
    pp: int  # 0: all GPUs
    zero: int = 0
    schedule: str = "1f1b"
    tune_micro_batches: bool = False  # choose the number of micro-batches (GPipe, DeepSpeed)
    # 1F1B baselines try up to this many micro-batches per stage. The paper does
    # not say how DeepSpeed-3D was configured; its batch sizes grow with the
    # memory budget like a fixed micro-batch count of at most pp (with more,
    # 1F1B memory would not grow with the batch), so the default is 1.
    max_micro_batches_per_stage: int = 1


class BaselinePlanner:
    """Pure DP / TP / PP / SDP and DeepSpeed-3D, with the batch-size loop."""

    searches_batch_size = True

    def __init__(self, config: BaselineConfig, batch_linear_steps: int = 8, batch_growth: float = 1.125) -> None:
        self.config = config
        self.name = config.name
        self.batch_linear_steps = batch_linear_steps
        self.batch_growth = batch_growth

    def degrees(self, workload: Workload) -> tuple[int, int, int]:
        """(dp, tp, pp) on this cluster: the degree given as 0 takes all GPUs the
        others leave."""
        n = workload.cluster.num_devices
        c = self.config
        fixed = max(1, c.dp) * max(1, c.tp) * max(1, c.pp)
        if n % fixed:
            raise HetplanError(f"{self.name} needs a multiple of {fixed} GPUs; the cluster has {n}")
        rest = n // fixed
        dp, tp, pp = c.dp or rest, c.tp or rest, c.pp or rest
        if dp * tp * pp != n:
            raise HetplanError(f"{self.name} needs a GPU count that splits into dp x tp x pp; got {n} GPUs")
        if pp > workload.model.num_layers:
            raise HetplanError(f"{self.name}: {pp} pipeline stages exceed the model's "
                               f"{workload.model.num_layers} layers")
        return dp, tp, pp

    def candidates(self, workload: Workload) -> list[Plan]:
        dp, tp, pp = self.degrees(workload)
        model, batch = workload.model, workload.global_batch_size
        bad = [layer.name for layer in model.layers if not layer.supports_tp(tp)]
        if bad:
            raise HetplanError(f"{self.name}: tp={tp} is not supported by layer {bad[0]!r} "
                               "(TP must divide its attention heads)")
        if self.config.tune_micro_batches:
            most = batch if self.config.schedule == "gpipe" else self.config.max_micro_batches_per_stage * pp
            counts = [m for m in range(1, min(batch, most) + 1) if batch % m == 0 and (batch // m) % dp == 0]
        else:
            counts = [1] if batch % dp == 0 else []
        split = block_split(model, pp)
        n_stage = dp * tp
        plans = []
        for m in counts:
            mbs = batch // m
            stages = []
            for j, layers in enumerate(split):
                stages.append(Stage(
                    layers=tuple(layers), devices=tuple(range(j * n_stage, (j + 1) * n_stage)), dp=dp, tp=tp,
                    dp_split=(mbs // dp,) * dp,
                    strategies=(LayerStrategy(self.config.zero if dp > 1 else 0),) * len(layers),
                ))
            plans.append(Plan(model=model.name, cluster=workload.cluster.name, global_batch_size=batch,
                              micro_batch_size=mbs, num_micro_batches=m, schedule=self.config.schedule,
                              stages=tuple(stages), planner=self.name))
        return plans

    def _ranked(self, workload: Workload, top_k: int, cost: CostModel | None = None) -> list[RankedPlan]:
        cm = cost_model_for(workload, cost)
        ranked = [RankedPlan(p, cm.estimate(p)) for p in self.candidates(workload)]
        ranked = [r for r in ranked if r.estimate.fits]
        ranked.sort(key=rank_key)
        return ranked[:top_k]

    def plan(self, workload: Workload, top_k: int = 5, cost: CostModel | None = None) -> list[RankedPlan]:
        dp, _, _ = self.degrees(workload)
        if workload.global_batch_size % dp:
            raise HetplanError(f"{self.name}: global batch {workload.global_batch_size} must be a multiple of dp={dp}")
        ranked = self._ranked(workload, top_k, cost)
        if not ranked:
            capacity = min(workload.device_capacity_bytes(d) for d in range(workload.cluster.num_devices))
            raise OutOfMemoryError(f"{self.name}: does not fit in {format_bytes(capacity)} per GPU at global batch "
                                   f"{workload.global_batch_size}; use a smaller batch or a larger --memory-limit")
        return ranked

    def plan_auto_batch(self, workload: Workload, top_k: int = 5) -> list[RankedPlan]:
        """The batch-size loop for a fixed strategy: grow the batch until it does
        not fit, keep the best throughput."""
        self.degrees(workload)
        results: list[RankedPlan] = []
        step = workload.cluster.num_devices
        for batch in batch_grid(step, self.batch_linear_steps, self.batch_growth):
            ranked = self._ranked(replace(workload, global_batch_size=batch), 1)
            if not ranked:
                break
            results.extend(ranked)
        if not results:
            capacity = min(workload.device_capacity_bytes(d) for d in range(workload.cluster.num_devices))
            raise OutOfMemoryError(f"{self.name}: does not fit in {format_bytes(capacity)} per GPU even at "
                                   f"global batch {step}; use a larger --memory-limit or more GPUs")
        results.sort(key=lambda r: (-r.estimate.samples_per_s, r.plan.global_batch_size))
        return results[:top_k]


BASELINES: dict[str, tuple[BaselineConfig, str]] = {
    "pure-dp": (BaselineConfig("pure-dp", dp=0, tp=1, pp=1), "pure data parallel on all GPUs (PyTorch DDP)"),
    "pure-tp": (BaselineConfig("pure-tp", dp=1, tp=0, pp=1), "pure tensor parallel on all GPUs (Megatron)"),
    "pure-pp": (BaselineConfig("pure-pp", dp=1, tp=1, pp=0, schedule="gpipe", tune_micro_batches=True),
                "pure pipeline parallel, one stage per GPU, GPipe schedule (PyTorch GPipe)"),
    "pure-sdp": (BaselineConfig("pure-sdp", dp=0, tp=1, pp=1, zero=3),
                 "pure sharded data parallel on all GPUs (FSDP / ZeRO-3)"),
    "deepspeed-3d": (BaselineConfig("deepspeed-3d", dp=0, tp=2, pp=2, tune_micro_batches=True),
                     "DeepSpeed 3D: 2-way TP x 2-way PP, DP over the rest, 1F1B"),
}
