"""Time and money to train: GPU-hours and days for a number of tokens, and
cost from prices per GPU-hour.

A GPU's price comes from, first to last: ``--price-per-gpu-hour`` (per type,
or one for every GPU), its node's ``price_per_gpu_hour`` in the cluster file,
and ``DEFAULT_PRICES_PER_GPU_HOUR`` below. Cloud prices differ by provider,
region, commitment and month (2.5x for one H100 in 2026), so the defaults are
one cited snapshot, always named in the report as such, for the few GPUs it
covers; a plan with a GPU none of them prices gets no cost, and the report
says which type lacks a price."""

from __future__ import annotations

from typing import Any, Iterable

from hetplan.cluster.catalog import normalise_gpu_name
from hetplan.errors import HetplanError
from hetplan.plan.spec import Estimate, Plan

SECONDS_PER_HOUR = 3600.0
BILLION = 1e9

# On-demand $/GPU-hour of the "specialty provider" tier (the middle of three
# tiers), the midpoint of its range, in Mercatus's cloud GPU price guide of May
# 2026 (mercatus-ai.com/blog/cloud-gpu-pricing): A100 80GB $1.10-1.50, H100
# SXM5 $2.50-3.50, H200 SXM5 $3.50-4.50. Hyperscalers charge up to ~1.5-2x
# that, long-tail providers ~0.7x.
DEFAULT_PRICES_PER_GPU_HOUR = {"A100-80GB": 1.30, "H100": 3.00, "H200": 4.00}
DEFAULT_PRICE_SOURCE = "default prices: on-demand, specialty-provider tier, Mercatus cloud GPU guide, May 2026"


def price_per_hour(plan: Plan, cluster: Any, prices: dict[str, float] | None) -> tuple[float | None, set[str], str]:
    """(what the plan's GPUs cost per hour together, or None; where the prices
    came from; the GPU types no source prices). Given ``prices`` must price
    every GPU the cluster file does not: a type left out is an error."""
    if prices is not None:
        check_price_types(prices, cluster_gpu_types(cluster))
    total, sources, missing = 0.0, set(), set()
    for stage in plan.stages:
        for device in stage.devices:
            gpu = cluster.devices[device].gpu.name
            node_price = cluster.nodes[cluster.devices[device].node].price_per_gpu_hour
            given = _price_of(gpu, prices) if prices is not None else None
            if given is not None:
                total, source = total + given, "--price-per-gpu-hour"
            elif node_price:
                total, source = total + node_price, "the cluster file"
            elif prices is not None:
                raise HetplanError(f"no price for GPU type {gpu}; add {gpu}=PRICE to --price-per-gpu-hour "
                                   f"(or one PRICE for every GPU)")
            elif _price_of(gpu, DEFAULT_PRICES_PER_GPU_HOUR) is not None:
                total, source = total + DEFAULT_PRICES_PER_GPU_HOUR[_default_name(gpu)], DEFAULT_PRICE_SOURCE
            else:
                missing.add(gpu)
                continue
            sources.add(source)
    return (None if missing else total), sources, ", ".join(sorted(missing))


def cluster_gpu_types(cluster: Any) -> set[str]:
    """The GPU type names of ``cluster``'s devices."""
    return {device.gpu.name for device in cluster.devices}


def check_price_types(prices: dict[str, float], gpu_types: Iterable[str]) -> None:
    """Every GPU type ``--price-per-gpu-hour`` names is one of ``gpu_types``: a
    price for a type the cluster lacks (a typo, another cluster) would be ignored."""
    known = {normalise_gpu_name(gpu): gpu for gpu in gpu_types}
    unknown = [name for name in prices if name != "*" and normalise_gpu_name(name) not in known]
    if unknown:
        raise HetplanError(f"--price-per-gpu-hour prices {', '.join(unknown)}, which the cluster does not have; "
                           f"its GPU types are {', '.join(sorted(known.values()))}")


def prices_for(prices: dict[str, float] | None, cluster: Any) -> dict[str, float] | None:
    """The prices of ``cluster``'s GPU types (and the one for every GPU), for a
    what-if variant whose cluster holds some of the types priced."""
    if prices is None:
        return None
    types = {normalise_gpu_name(gpu) for gpu in cluster_gpu_types(cluster)}
    return {name: price for name, price in prices.items() if name == "*" or normalise_gpu_name(name) in types}


def _default_name(gpu: str) -> str:
    return next(name for name in DEFAULT_PRICES_PER_GPU_HOUR if normalise_gpu_name(name) == normalise_gpu_name(gpu))


def _price_of(gpu: str, prices: dict[str, float]) -> float | None:
    for name, price in prices.items():
        if name != "*" and normalise_gpu_name(name) == normalise_gpu_name(gpu):
            return price
    return prices.get("*")


def training_numbers(plan: Plan, estimate: Estimate, cluster: Any, seq_len: int, tokens: float | None,
                     prices: dict[str, float] | None) -> dict[str, Any]:
    """GPU-hours (and cost) per step, per billion tokens and for ``tokens``."""
    gpus = plan.num_devices
    step_hours = estimate.iteration_time_s / SECONDS_PER_HOUR
    tokens_per_step = plan.global_batch_size * seq_len
    out: dict[str, Any] = {"gpus": float(gpus), "tokens_per_step": float(tokens_per_step),
           "gpu_hours_per_billion_tokens": gpus * step_hours * BILLION / tokens_per_step}
    if tokens:
        steps = tokens / tokens_per_step
        out.update(tokens=tokens, steps=steps, days=steps * estimate.iteration_time_s / 86400.0,
                   gpu_hours=gpus * step_hours * steps)
    hourly, sources, missing = price_per_hour(plan, cluster, prices)
    if hourly is not None:
        out.update(usd_per_hour=hourly, usd_per_step=hourly * step_hours,
                   usd_per_billion_tokens=hourly * step_hours * BILLION / tokens_per_step)
        out["price_source"] = "; ".join(sorted(sources))
        if tokens:
            out["usd"] = hourly * step_hours * out["steps"]
    elif missing:
        out["unpriced_gpus"] = missing
    return out
