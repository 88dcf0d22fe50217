"""Re-plan a plan file for the GPUs that are left (``hetplan replan plan.json --without 5 node:1``).

When GPUs fail or a node is taken away, the plan's cluster shrinks and is often no longer uniform: 7 good
GPUs of a node of 8 is exactly the uneven cluster hetplan's planners are made for. ``replan`` removes the
named GPUs from the plan file's own cluster, runs the plan's own planner with the file's own settings and
global batch on what is left, and says what the new plan costs against the old one and how the model's
layers move between stages. The planners are deterministic, so every node that re-plans from the same
file and the same ``--without`` gets the same plan. hetplan's checkpoints are saved by parameter name
and load under another plan (``runtime/checkpoint.py``), so the new plan resumes from the old run's
checkpoint: ``hetplan train --plan NEW --load CHECKPOINT``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from hetplan.app.planning import DEFAULT_TOP, PlanResult, plan_loaded
from hetplan.app.workload import DEFAULT_PLANNER
from hetplan.cluster.catalog import GPUSpec
from hetplan.cluster.spec import ClusterSpec
from hetplan.cost.model import CostModel
from hetplan.errors import HetplanError
from hetplan.plan.file import PlanFile, read_plan_file
from hetplan.plan.spec import Estimate, Plan
from hetplan.plan.workload import Workload
from hetplan.search.registry import planner_names


@dataclass(frozen=True)
class LayerMove:
    """Consecutive layers that move together: from ``old_stage`` to ``new_stage`` (0-based)."""

    first: int
    last: int
    old_stage: int
    new_stage: int


@dataclass(frozen=True)
class ReplanResult:
    """The old plan and its cost on the old cluster, the GPUs taken away, and the new plans."""

    old_plan: Plan
    old_estimate: Estimate
    old_cluster: ClusterSpec
    lost: tuple[int, ...]  # the old cluster's GPU ids removed
    result: PlanResult  # the new plans, on the cluster without them
    moves: tuple[LayerMove, ...]

    @property
    def slowdown(self) -> float:
        """New step time over old (1.25: a quarter slower)."""
        return self.result.best.estimate.iteration_time_s / self.old_estimate.iteration_time_s


def lost_devices(cluster: ClusterSpec, without: Sequence[str]) -> tuple[int, ...]:
    """The GPU ids that ``without`` names: ``5`` or ``gpu:5`` (a GPU's id in the plan's cluster, as
    the plan's stages number them), ``node:1`` (every GPU of node 1, 0-based, or of the node so named)."""
    if not without:
        raise HetplanError("--without needs at least one GPU id (e.g. 5 or gpu:5) or node (e.g. node:1)")
    lost: set[int] = set()
    for item in without:
        kind, sep, value = item.strip().rpartition(":") if ":" in item else ("gpu", ":", item.strip())
        if kind == "gpu" and value.isdigit():
            gpu = int(value)
            if gpu >= cluster.num_devices:
                raise HetplanError(f"--without {item}: the plan's cluster {cluster.name!r} has GPUs 0.."
                                   f"{cluster.num_devices - 1}")
            lost.add(gpu)
        elif kind == "node":
            lost.update(cluster.node_devices(_node_index(cluster, value, item)))
        else:
            raise HetplanError(f"--without {item!r}: give a GPU id (5 or gpu:5) or a node (node:1 or node:NAME)")
    if len(lost) == cluster.num_devices:
        raise HetplanError(f"without GPU(s) {', '.join(map(str, sorted(lost)))} none of the {cluster.num_devices} "
                           f"GPUs of {cluster.name!r} is left: nothing is left to plan on")
    return tuple(sorted(lost))


def _node_index(cluster: ClusterSpec, value: str, item: str) -> int:
    if value.isdigit() and int(value) < cluster.num_nodes:
        return int(value)
    names = [node.name for node in cluster.nodes]
    if value in names and names.count(value) == 1:
        return names.index(value)
    raise HetplanError(f"--without {item}: the plan's cluster {cluster.name!r} has nodes 0..{cluster.num_nodes - 1}"
                       + (f" ({', '.join(n for n in names if n)})" if any(names) else ""))


def cluster_without(cluster: ClusterSpec, lost: Sequence[int]) -> ClusterSpec:
    """``cluster`` less the GPUs ``lost``: each node keeps its other GPUs (a node left with none is
    dropped), renumbered in order; a bandwidth matrix keeps the rows and columns of the GPUs left."""
    gone = set(lost)
    nodes = []
    for index, node in enumerate(cluster.nodes):
        left = sum(1 for d in cluster.node_devices(index) if d not in gone)
        if left:
            nodes.append(replace(node, num_gpus=left))
    kept = [d.id for d in cluster.devices if d.id not in gone]
    matrix = cluster.bandwidth_matrix_gbps
    if matrix is not None:
        matrix = tuple(tuple(matrix[i][j] for j in kept) for i in kept)
    label = ", ".join(str(d) for d in sorted(gone))
    return replace(cluster, name=f"{cluster.name} without GPU {label}", nodes=tuple(nodes),
                   bandwidth_matrix_gbps=matrix, description=f"{cluster.name} less GPUs {label} (hetplan replan)")


def layer_moves(old: Plan, new: Plan, num_layers: int) -> tuple[LayerMove, ...]:
    """Runs of consecutive layers with the same old and new stage: what the checkpoint's resharding moves."""
    def stage_of(plan: Plan) -> list[int]:
        where = [0] * num_layers
        for s, stage in enumerate(plan.stages):
            for layer in stage.layers:
                where[layer] = s
        return where

    before, after = stage_of(old), stage_of(new)
    moves: list[LayerMove] = []
    for layer in range(num_layers):
        if moves and (moves[-1].old_stage, moves[-1].new_stage) == (before[layer], after[layer]):
            moves[-1] = replace(moves[-1], last=layer)
        else:
            moves.append(LayerMove(layer, layer, before[layer], after[layer]))
    return tuple(moves)


def replan_file(path: str, without: Sequence[str], index: int = 1, planner: str | None = None,
                top: int = DEFAULT_TOP, tokens: float | None = None,
                prices: dict[str, float] | None = None, replay: int | None = None) -> ReplanResult:
    """The ``index``-th plan of the plan file at ``path``, re-planned without the GPUs ``without``
    names, by ``planner`` (default: the planner the file was made by) with the file's settings;
    ``replay``: as ``plan_loaded``'s (0: no replayed step, what ``--elastic`` asks while a run waits)."""
    plan_file = read_plan_file(path)
    base = plan_file.workload(index)
    lost = lost_devices(base.cluster, without)
    return _replan_on(plan_file, index, base, cluster_without(base.cluster, lost), lost, planner, top, tokens,
                      prices, replay)


def replan_slower(path: str, slow: Mapping[int, float], index: int = 1, replay: int | None = None) -> ReplanResult:
    """The ``index``-th plan of the plan file at ``path``, re-planned by its own planner for its cluster
    with each device of ``slow`` (device id -> measured slowdown) as slow as measured (``slowed_cluster``);
    the old plan is costed on that cluster too, so ``slowdown`` below 1 is what the re-plan wins."""
    plan_file = read_plan_file(path)
    base = plan_file.workload(index)
    slowed = slowed_cluster(base.cluster, slow)
    return _replan_on(plan_file, index, replace(base, cluster=slowed), slowed, (), None, DEFAULT_TOP, None, None,
                      replay)


def _replan_on(plan_file: PlanFile, index: int, base: Workload, cluster: ClusterSpec, lost: tuple[int, ...],
               planner: str | None, top: int, tokens: float | None, prices: dict[str, float] | None,
               replay: int | None) -> ReplanResult:
    """The plan file's plan re-planned on ``cluster`` (``base``'s cluster less ``lost``, or made slower)."""
    old_plan = plan_file.plan(index)
    workload = replace(base, cluster=cluster)
    name = planner or _own_planner(plan_file.planner or old_plan.planner)
    result = plan_loaded(workload, name, top, explicit_target=False, any_target=not workload.target,
                         tokens=tokens, prices=prices, replay=replay)
    old_estimate = CostModel(base).estimate(old_plan)
    moves = layer_moves(old_plan, result.best.plan, base.model.num_layers)
    return ReplanResult(old_plan, old_estimate, base.cluster, lost, result, moves)


def slowed_cluster(cluster: ClusterSpec, slow: Mapping[int, float]) -> ClusterSpec:
    """``cluster`` with each device of ``slow`` (device id -> measured slowdown) a GPU type of its own,
    derived from its type with the rates divided by the slowdown: the measured rate in the cost model, as a
    calibration's compute factor is for a whole type. A node holding such a device is cut into runs of
    devices of one type (the same device ids, in order); the links keep their bandwidths (a device-to-device
    matrix of the old cluster's)."""
    matrix = cluster.bandwidth_matrix_gbps or tuple(
        tuple(0.0 if a == b else cluster.link_gbps(a, b) for b in range(cluster.num_devices))
        for a in range(cluster.num_devices))
    nodes = []
    for index, node in enumerate(cluster.nodes):
        runs: list[tuple[GPUSpec, int]] = []
        for device in cluster.node_devices(index):
            gpu = _slowed_gpu(node.gpu, device, slow[device]) if device in slow else node.gpu
            if runs and runs[-1][0] == gpu:
                runs[-1] = (gpu, runs[-1][1] + 1)
            else:
                runs.append((gpu, 1))
        nodes += [replace(node, gpu_type=gpu, gpu_spec=gpu, num_gpus=count) for gpu, count in runs]
    label = ", ".join(f"GPU {d} {f:.2f}x slower" for d, f in sorted(slow.items()))
    return replace(cluster, name=f"{cluster.name} with {label}", nodes=tuple(nodes), bandwidth_matrix_gbps=matrix,
                   description=f"{cluster.name}, {label} (measured: hetplan --elastic)")


def _slowed_gpu(gpu: GPUSpec, device: int, factor: float) -> GPUSpec:
    """``gpu`` as device ``device`` measured it: every rate divided by ``factor``."""
    return replace(gpu, name=f"{gpu.name} GPU{device} x{factor:.2f} slower", derived_from=gpu.catalog_name,
                   peak_flops=gpu.peak_flops / factor, peak_flops_fp32=gpu.peak_flops_fp32 / factor,
                   peak_flops_fp8=gpu.peak_flops_fp8 / factor, peak_flops_tf32=gpu.peak_flops_tf32 / factor,
                   memory_bandwidth_bytes_per_s=gpu.memory_bandwidth_bytes_per_s / factor)


def _own_planner(name: str) -> str:
    """The planner a plan file was made by, if hetplan has it by that name (a plan written by hand or
    by a planner object has none: the default planner then)."""
    return name if name in planner_names() else DEFAULT_PLANNER
