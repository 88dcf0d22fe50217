"""Cost model vs published iteration times (Korthikanti et al. 2022).

Prints paper vs predicted time for every row, and exits non-zero when any
prediction is off by more than TOLERANCE (the same bound tests assert).
"""

from __future__ import annotations

import sys

from hetplan.published import KORTHIKANTI_2022, KORTHIKANTI_22B_LAYER_MS, predict, predict_22b_layer_ms
from hetplan.report.text import table

TOLERANCE = 0.15


def main() -> int:
    rows, worst = [], 0.0
    for row in KORTHIKANTI_2022:
        for mode, paper in (("selective", row.selective_s), ("full", row.full_s)):
            if paper is None:
                continue
            est = predict(row, mode)
            err = est.iteration_time_s / paper - 1
            worst = max(worst, abs(err))
            mfu = f"{100 * est.mfu:.1f}% (paper {100 * row.selective_mfu:.1f}%)" if mode == "selective" else ""
            rows.append([row.name, f"tp{row.tp} pp{row.pp} dp{row.dp}", mode, f"{paper:.2f}",
                         f"{est.iteration_time_s:.2f}", f"{100 * err:+.1f}%", mfu])
    print(table(["model", "degrees", "recompute", "paper s", "hetplan s", "error", "MFU"], rows,
                [False, False, False, True, True, True, False]))
    print()
    ours = predict_22b_layer_ms()
    layer_rows = []
    for key, paper in KORTHIKANTI_22B_LAYER_MS.items():
        err = ours[key] / paper - 1
        worst = max(worst, abs(err))
        layer_rows.append([key, f"{paper:.1f}", f"{ours[key]:.1f}", f"{100 * err:+.1f}%"])
    print(table(["22B layer, tp8 mbs4", "paper ms", "hetplan ms", "error"], layer_rows))
    print(f"\nworst error {100 * worst:.1f}% (target <= {100 * TOLERANCE:.0f}%)")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
