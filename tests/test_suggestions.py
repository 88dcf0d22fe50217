"""Unknown names are answered with the closest known one (difflib), for GPU types,
presets, planners and targets (issue 33, item 6)."""

from __future__ import annotations

import pytest

from hetplan.cluster.catalog import get_gpu
from hetplan.cluster.presets import get_cluster
from hetplan.errors import HetplanError
from hetplan.model.presets import get_model
from hetplan.plan.workload import Workload
from hetplan.search import get_planner


@pytest.mark.parametrize("call, suggestion", [
    (lambda: get_gpu("H10"), "did you mean 'H100'?"),
    (lambda: get_cluster("8xH10"), "did you mean 'H100'?"),
    (lambda: get_planner("galvatron-bwm"), "did you mean 'galvatron-bmw'?"),
    (lambda: get_model("gpt3-1.3"), "did you mean 'gpt3-1.3b'?"),
    (lambda: get_cluster("amp-heterogenous"), "did you mean 'amp-heterogeneous'?"),
    (lambda: Workload(get_model("gpt2-amp"), get_cluster("8xH100"), 8, target="megatorn"),
     "did you mean 'megatron'?"),
])
def test_a_close_name_is_suggested(call, suggestion: str) -> None:
    with pytest.raises(HetplanError) as err:
        call()
    assert suggestion in str(err.value) and "\n" not in str(err.value)


def test_nothing_close_suggests_nothing() -> None:
    with pytest.raises(HetplanError) as err:
        get_planner("zzzz")
    assert "did you mean" not in str(err.value)
