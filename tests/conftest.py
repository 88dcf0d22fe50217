"""Shared fixtures: small models and clusters built from the presets."""

from __future__ import annotations

import os

import pytest

from hetplan.cluster.io import load_cluster
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.model.presets import get_model


@pytest.fixture
def gpt2_hetero() -> Workload:
    return Workload(get_model("gpt2-amp"), load_cluster("amp-heterogeneous"), 32)


@pytest.fixture
def gpt2_cost(gpt2_hetero: Workload) -> CostModel:
    return CostModel(gpt2_hetero)


def pytest_configure(config: pytest.Config) -> None:
    # progress lines depend on how long work takes: none in tests, except where a test asks for them
    os.environ.setdefault("HETPLAN_PROGRESS", "0")
    # the replay check (hetplan.app.replay) off unless a test asks for it: it runs torch for seconds per plan
    os.environ.setdefault("HETPLAN_REPLAY", "0")
    """The fuzz tests run derandomized (the same inputs every run) unless a
    seed is given: ``pytest -m fuzz --hypothesis-seed=N`` explores others."""
    if config.getoption("hypothesis_seed", default=None) is not None:
        os.environ["HETPLAN_FUZZ_SEEDED"] = "1"
    # tests/distributed/conftest.py registers it too; here for multi-process
    # tests outside that folder (tests/test_profile_measure.py) run on their own
    config.addinivalue_line("markers", "distributed: starts several processes (torch.distributed, gloo)")
