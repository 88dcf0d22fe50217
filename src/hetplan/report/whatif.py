"""The what-if table (``hetplan whatif``, ``hetplan report --vary``): one row
per variant of ``hetplan.app.whatif.run_whatif``."""

from __future__ import annotations

from typing import Sequence

from hetplan.app.whatif import WhatIfResult
from hetplan.report.text import table
from hetplan.units import format_bytes, format_time


def whatif_rows(results: Sequence[WhatIfResult]) -> list[list[str]]:
    """A row per variant: best plan, iteration time, tokens/s, MFU, max memory, $/1B tokens, days."""
    rows = []
    for r in results:
        if r.best is None:
            rows.append([r.label, f"no plan: {r.error[:60]}", *["-"] * 6])
            continue
        e, n = r.best.estimate, r.numbers
        money = f"${n['usd_per_billion_tokens']:,.0f}" if "usd_per_billion_tokens" in n else "-"
        days = f"{n['days']:,.1f}" if "days" in n else "-"
        rows.append([r.label, r.best.plan.describe(), format_time(e.iteration_time_s), f"{e.tokens_per_s:,.0f}",
                     f"{100 * e.mfu:.1f}%", format_bytes(e.max_memory_bytes), money, days])
    return rows


WHATIF_HEADERS = ("variant", "best plan", "iter time", "tokens/s", "MFU", "max mem/GPU", "$/1B tokens")


def whatif_table(results: Sequence[WhatIfResult], tokens: float | None = None) -> str:
    """The table ``hetplan whatif`` prints."""
    return table([*WHATIF_HEADERS, "days" if tokens else "days (--tokens)"], whatif_rows(results),
                 [False, False, True, True, True, True, True, True])
