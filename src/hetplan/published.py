"""Published measurements the cost model is checked against.

These iteration times are also among the ~120 runs the four fitted constants of
``cost/constants.py`` are fitted on (``benchmarks/fit_cost_model.py``); the
per-layer times below are not.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv:2205.05198), Table 3/4 and §6: A100-80GB SXM in DGX nodes of 8
over InfiniBand, GPT-style models, sequence 2048, vocabulary 51200, fp16.
"selective" = attention-core recompute with sequence parallelism; "full" =
full-layer recompute. Iteration times in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetplan.cluster.presets import homogeneous_cluster
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.model.presets import gpt_decoder
from hetplan.plan.spec import Estimate, Plan
from hetplan.search.baselines.uniform import uniform_plan


@dataclass(frozen=True)
class CalibrationRow:
    name: str
    num_layers: int
    hidden: int
    heads: int
    num_gpus: int
    tp: int
    pp: int
    dp: int
    global_batch: int
    micro_batch: int
    selective_s: float
    full_s: float | None
    selective_mfu: float


KORTHIKANTI_2022 = (
    CalibrationRow("22B", 48, 6144, 64, 8, 8, 1, 1, 4, 4, 1.10, 1.42, 0.415),
    CalibrationRow("175B", 96, 12288, 96, 64, 8, 8, 1, 64, 1, 13.75, 18.13, 0.514),
    CalibrationRow("530B", 105, 20480, 128, 280, 8, 35, 1, 280, 1, 37.83, 49.05, 0.560),
    CalibrationRow("1T", 128, 25600, 160, 512, 8, 64, 1, 512, 1, 71.49, 94.42, 0.563),
    CalibrationRow("530B-dp8", 105, 20480, 128, 2240, 8, 35, 8, 2240, 1, 39.15, None, 0.542),
)

# Per transformer layer, 22B model, tp 8, micro-batch 4 (Korthikanti §6.2, Fig. 8):
# forward 7.7 ms; backward 11.9 ms without recompute, 19.5 ms with full and
# 13.2 ms with selective recompute.
KORTHIKANTI_22B_LAYER_MS = {"forward": 7.7, "backward": 11.9, "backward_full": 19.5, "backward_selective": 13.2}


def calibration_plan(row: CalibrationRow, recompute: str) -> tuple[Workload, Plan]:
    model = gpt_decoder(f"gpt-{row.name}", row.num_layers, row.hidden, row.heads, 2048, vocab=51200)
    workload = Workload(model, homogeneous_cluster(row.num_gpus, "A100-80GB"), row.global_batch)
    plan = uniform_plan(workload, row.dp, row.tp, row.pp, row.micro_batch, 0, recompute,
                        sequence_parallel=recompute == "selective")
    return workload, plan


def predict(row: CalibrationRow, recompute: str) -> Estimate:
    workload, plan = calibration_plan(row, recompute)
    return CostModel(workload).estimate(plan)


def predict_22b_layer_ms() -> dict[str, float]:
    """The cost model's per-layer numbers for the 22B row (TP comm included)."""
    row = KORTHIKANTI_2022[0]
    workload, _ = calibration_plan(row, "none")
    kernel = CostModel(workload).kernel
    gpu = workload.cluster.devices[0].gpu
    block = 1  # the first transformer block (layer 0 is the embedding)
    comm_s = float(kernel.collective_time("allreduce", tuple(range(row.tp)),
                                          kernel.arrays.tp_comm_bytes[block] * row.micro_batch))

    def times(recompute: str, sequence_parallel: bool = False) -> tuple[float, float, float]:
        t = kernel.layer_times(gpu, row.micro_batch, row.tp, recompute, sequence_parallel)
        return float(t.fwd_s[block]), float(t.bwd_s[block]), float(t.recompute_s[block])

    plain, full, selective = times("none"), times("full"), times("selective", True)
    return {
        "forward": 1e3 * (plain[0] + comm_s),
        "backward": 1e3 * (plain[1] + comm_s),
        "backward_full": 1e3 * (full[1] + full[2] + 2 * comm_s),
        "backward_selective": 1e3 * (selective[1] + selective[2] + comm_s),
    }
