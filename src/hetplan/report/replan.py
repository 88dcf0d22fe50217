"""What ``hetplan replan`` prints: the GPUs taken away, the new plans, the cost against the old plan and
how the layers move between stages."""

from __future__ import annotations

from hetplan.app.replan import ReplanResult
from hetplan.report.text import plan_text
from hetplan.units import format_time


def replan_text(replan: ReplanResult, quiet: bool = False) -> str:
    old, cluster = replan.old_plan, replan.old_cluster
    gone = ", ".join(f"{d} ({cluster.devices[d].gpu.name}, node {cluster.devices[d].node})" for d in replan.lost)
    left = cluster.num_devices - len(replan.lost)
    head = (f"replan   {old.describe()} on {cluster.name} ({cluster.num_devices} GPUs), without GPU {gone}: "
            f"{left} GPUs left")
    new = replan.result.best
    old_s, new_s = replan.old_estimate.iteration_time_s, new.estimate.iteration_time_s
    change = (f"old plan {format_time(old_s)}/step on {cluster.num_devices} GPUs; new plan {format_time(new_s)}/step "
              f"on {left}: {100 * (replan.slowdown - 1):+.1f}% per step")
    moves = [f"  layers {m.first}-{m.last}: stage {m.old_stage} -> stage {m.new_stage}" if m.first != m.last else
             f"  layer {m.first}: stage {m.old_stage} -> stage {m.new_stage}" for m in replan.moves]
    resume = ("resume   hetplan train --plan NEW.json --load CHECKPOINT (write NEW.json with --json; checkpoints "
              "are saved by parameter name and load resharded under the new plan)")
    return "\n\n".join([head, plan_text(replan.result.report, quiet), change,
                        "\n".join(["layers, old stage -> new stage:", *moves]), resume])
