"""The step's global loss while its all-reduce runs (hetplan.runtime.pending):
every way of reading it waits for the collective once and sees the mean."""

from __future__ import annotations

import math

import pytest
import torch

from hetplan.runtime.pending import PendingLoss


class CountingWork:
    """A collective's work handle that counts its waits."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> bool:
        self.waits += 1
        return True


@pytest.mark.parametrize("read", [float, lambda v: v.item(), lambda v: float(f"{v:.4f}"), math.isfinite,
                                  lambda v: torch.stack([v, v]).tolist()[1], lambda v: float(v + 0)])
def test_every_read_waits_once_and_sees_the_mean(read) -> None:
    work = CountingWork()
    loss = PendingLoss(torch.tensor(3.0), work, 2)
    assert work.waits == 0
    first = read(loss)
    assert first in (1.5, True), first
    assert float(loss) == 1.5 and f"{loss:.2f}" == "1.50" and work.waits == 1  # divided once, waited once
    assert type(loss.detach()) is torch.Tensor
