"""Runtime tests that start several processes (gloo on CPU).

They are marked ``distributed`` (and the costliest ``slow``); both still run in
``make test``. ``pytest -m "not distributed"`` skips them for a quick loop.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "distributed: starts several processes (torch.distributed, gloo)")
    config.addinivalue_line("markers", "slow: one of the costliest distributed tests (still part of make test)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.distributed)


@pytest.fixture(scope="session", autouse=True)
def _torch_threads() -> None:
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
