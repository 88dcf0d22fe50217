"""The cost model lands near published A100 measurements with sourced constants."""

import pytest

from hetplan.published import KORTHIKANTI_2022, KORTHIKANTI_22B_LAYER_MS, predict, predict_22b_layer_ms

TOLERANCE = 0.15


@pytest.mark.parametrize("row", KORTHIKANTI_2022, ids=lambda r: r.name)
def test_iteration_time_near_korthikanti(row) -> None:
    selective = predict(row, "selective")
    assert selective.fits
    assert selective.iteration_time_s == pytest.approx(row.selective_s, rel=TOLERANCE)
    assert selective.mfu == pytest.approx(row.selective_mfu, rel=TOLERANCE)
    if row.full_s is not None:
        full = predict(row, "full")
        assert full.iteration_time_s == pytest.approx(row.full_s, rel=TOLERANCE)
        assert full.iteration_time_s > selective.iteration_time_s


def test_layer_times_near_korthikanti() -> None:
    ours = predict_22b_layer_ms()
    for key, paper in KORTHIKANTI_22B_LAYER_MS.items():
        assert ours[key] == pytest.approx(paper, rel=TOLERANCE), key
    assert ours["backward_selective"] < ours["backward_full"]
    assert ours["backward"] < ours["backward_full"]
