"""Time and money to train: GPU-hours and days for a number of tokens, and
cost from prices per GPU-hour (given by the user; hetplan ships no price list,
since cloud prices differ by provider, region, commitment and month)."""

from __future__ import annotations

from typing import Any

from hetplan.cluster.catalog import normalise_gpu_name
from hetplan.errors import HetplanError
from hetplan.plan import Estimate, Plan

SECONDS_PER_HOUR = 3600.0
BILLION = 1e9


def price_per_hour(plan: Plan, cluster: Any, prices: dict[str, float]) -> float:
    """What the plan's GPUs cost per hour together; every GPU type needs a price."""
    total = 0.0
    for stage in plan.stages:
        for device in stage.devices:
            gpu = cluster.devices[device].gpu.name
            price = _price_of(gpu, prices)
            if price is None:
                raise HetplanError(f"no price for GPU type {gpu}; add {gpu}=PRICE to --price-per-gpu-hour "
                                   f"(or one PRICE for every GPU)")
            total += price
    return total


def _price_of(gpu: str, prices: dict[str, float]) -> float | None:
    for name, price in prices.items():
        if name != "*" and normalise_gpu_name(name) == normalise_gpu_name(gpu):
            return price
    return prices.get("*")


def training_numbers(plan: Plan, estimate: Estimate, cluster: Any, seq_len: int, tokens: float | None,
                     prices: dict[str, float] | None) -> dict[str, float]:
    """GPU-hours (and cost) per step, per billion tokens and for ``tokens``."""
    gpus = plan.num_devices
    step_hours = estimate.iteration_time_s / SECONDS_PER_HOUR
    tokens_per_step = plan.global_batch_size * seq_len
    out = {"gpus": float(gpus), "tokens_per_step": float(tokens_per_step),
           "gpu_hours_per_billion_tokens": gpus * step_hours * BILLION / tokens_per_step}
    if tokens:
        steps = tokens / tokens_per_step
        out.update(tokens=tokens, steps=steps, days=steps * estimate.iteration_time_s / 86400.0,
                   gpu_hours=gpus * step_hours * steps)
    if prices is not None:
        hourly = price_per_hour(plan, cluster, prices)
        out.update(usd_per_hour=hourly, usd_per_step=hourly * step_hours,
                   usd_per_billion_tokens=hourly * step_hours * BILLION / tokens_per_step)
        if tokens:
            out["usd"] = hourly * step_hours * out["steps"]
    return out


def training_lines(numbers: dict[str, float]) -> list[str]:
    """The numbers of ``training_numbers`` as sentences."""
    lines = [f"{numbers['gpu_hours_per_billion_tokens']:,.1f} GPU-hours per billion tokens "
             f"({numbers['tokens_per_step']:,.0f} tokens per step on {numbers['gpus']:.0f} GPUs)."]
    if "usd_per_hour" in numbers:
        lines.append(f"cost ${numbers['usd_per_hour']:,.2f}/hour: ${numbers['usd_per_step']:,.4f} per step, "
                     f"${numbers['usd_per_billion_tokens']:,.2f} per billion tokens.")
    if "tokens" in numbers:
        text = (f"{numbers['tokens']:.3g} tokens: {numbers['steps']:,.0f} steps, {numbers['days']:,.1f} days, "
                f"{numbers['gpu_hours']:,.0f} GPU-hours")
        lines.append(text + (f", ${numbers['usd']:,.0f}." if "usd" in numbers else "."))
    return lines
