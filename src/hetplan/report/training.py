"""Time and money to train as sentences: the numbers of
``hetplan.app.training.training_numbers`` as ``hetplan plan``, ``estimate`` and
the HTML report print them."""

from __future__ import annotations

from hetplan.units import format_count


def training_lines(numbers: dict[str, float]) -> list[str]:
    """The numbers of ``training_numbers`` as sentences."""
    lines = [f"{numbers['gpu_hours_per_billion_tokens']:,.1f} GPU-hours per billion tokens "
             f"({numbers['tokens_per_step']:,.0f} tokens per step on {numbers['gpus']:.0f} GPUs)."]
    if "usd_per_hour" in numbers:
        lines.append(f"cost ${numbers['usd_per_hour']:,.2f}/hour: ${numbers['usd_per_step']:,.4f} per step, "
                     f"${numbers['usd_per_billion_tokens']:,.2f} per billion tokens (prices from "
                     f"{numbers['price_source']}).")
    elif "unpriced_gpus" in numbers:
        lines.append(f"no cost: no price for {numbers['unpriced_gpus']} (give --price-per-gpu-hour, or "
                     "price_per_gpu_hour on the node in the cluster file).")
    if "tokens" in numbers:
        text = (f"{format_count(numbers['tokens'])} tokens: {numbers['steps']:,.0f} steps, {numbers['days']:,.1f} days, "
                f"{numbers['gpu_hours']:,.0f} GPU-hours")
        lines.append(text + (f", ${numbers['usd']:,.0f}." if "usd" in numbers else "."))
    return lines
