"""ZeRO-3's per-layer backward moments (cost/zero3.py): the range tables the searches
read give, range by range, what the estimate computes for that range."""

from __future__ import annotations

import numpy as np
import pytest

from hetplan.app.estimate import UniformSetting, estimate
from hetplan.cost.model import CostModel
from hetplan.cost.zero3 import zero3_layers, zero3_moment, zero3_moment_table


@pytest.mark.parametrize("model, recompute", [("tiny-gpt", "none"), ("tiny-llama-bf16", "full")])
def test_the_moment_table_is_each_ranges_moment(model: str, recompute: str) -> None:
    """Every range without two layers of a tied group (those are wrapped with the root and
    taken one by one): the table's total is ``zero3_moment``'s for that range alone, at a
    batch where the moments' order differs from one range to the next."""
    result = estimate(UniformSetting(dp=2, tp=1, pp=1, zero=3, recompute=recompute, micro_batch=2), model=model,
                      cluster="local-cpu-2", global_batch=8, replay=False)
    kernel = CostModel(result.workload).kernel
    layers = kernel.num_layers
    whole = zero3_layers(kernel, 0, layers, 1, 1, (recompute,), False, 1, tied=False)  # as StageCosts' table
    table = zero3_moment_table(whole, 3.0, np.arange(layers + 1), np.arange(layers + 1))
    checked = 0
    for a in range(layers):
        for b in range(a + 1, layers + 1):
            if any(a <= first and later < b for later, first, _ in kernel.tied_pairs()):
                continue
            moment = zero3_moment(zero3_layers(kernel, a, b, 1, 1, (recompute,), False, 1), 3.0)  # the estimate's
            assert table[a, b] == pytest.approx(moment.activations + moment.gathered + moment.grads), (a, b)
            checked += 1
    assert checked >= layers * (layers + 1) // 2 - 1
    assert (table[np.tril_indices(layers + 1)] == 0).all()
