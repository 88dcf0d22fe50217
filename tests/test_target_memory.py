"""Plans for a tool are costed with the memory that tool holds (issue 33, item 2)."""

from __future__ import annotations

import pytest

from hetplan.cluster.io import load_cluster
from hetplan.cost.model import CostModel
from hetplan.model.presets import get_model
from hetplan.plan.workload import Workload
from hetplan.search.baselines.uniform import uniform_plan


@pytest.mark.parametrize("zero", [0, 2])
def test_megatron_bf16_holds_fp32_gradients(zero: int) -> None:
    """Megatron's bf16 accumulates and all-reduces gradients in fp32
    (validate_args): 2 more bytes per parameter a GPU holds gradients for than
    the same plan costed with bf16 gradients, sharded over dp under ZeRO-2."""
    model, cluster = get_model("llama3-8b"), load_cluster("8xH100")
    peaks = {}
    for target in ("", "megatron"):
        workload = Workload(model, cluster, 8, target=target)
        plan = uniform_plan(workload, 2, 4, 1, 1, zero=zero)  # no recompute: the tools keep the head whole under full
        peaks[target] = CostModel(workload).estimate(plan).peak_memory_bytes[0]
    params_per_gpu = model.total_params / 4  # tp4: each rank holds a quarter (embedding and head split too)
    extra = 2 * params_per_gpu / (2 if zero >= 2 else 1)
    assert peaks["megatron"] - peaks[""] == pytest.approx(extra, rel=0.02)


def test_only_megatron_holds_other_gradients_than_the_optimizer_names() -> None:
    model, cluster = get_model("llama3-8b"), load_cluster("8xH100")
    assert Workload(model, cluster, 8, target="megatron").state_bytes == (2, 4, 12)
    for target in ("", "torchtitan", "deepspeed"):
        assert Workload(model, cluster, 8, target=target).state_bytes == (2, 2, 12)
