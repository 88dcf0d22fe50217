"""Process setup: what ``hetplan.runtime.init`` does before a RuntimeContext exists.

In this order, on every rank: load and check the plan (its model, its
cluster, what the runtime can run of it) without torch.distributed; check the
number of processes; pick this rank's device; check that the launcher put the
process where the plan puts it; then, with more than one process, start the
process group, the heartbeat (hetplan.runtime.heartbeat), the device meshes
and the process groups of weights tied across stages. Every check that can
fail runs before the first collective, with the same message on every rank.
"""

from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from hetplan.cluster.io import load_cluster
from hetplan.errors import HetplanError
from hetplan.model.load import load_model
from hetplan.model.origin import is_reference, trusted, untrusted_message
from hetplan.model.spec import ModelSpec
from hetplan.plan.spec import Plan
from hetplan.plan.file import read_plan_file, resolve_cluster, resolve_model
from hetplan.runtime import heartbeat as hb
from hetplan.runtime import mixed
from hetplan.runtime import precision as mp
from hetplan.plan.layout import PlanLayout, RankPosition, tied_layer_groups
from hetplan.plan.support import check_runs, support_of
from hetplan.plan.validate import validate_plan

# Collective / rendezvous timeout (init(timeout_s=...), `--timeout`, env HETPLAN_PG_TIMEOUT_S). 5 minutes:
# longer than the legitimate waits of a healthy run -- other ranks waiting while one compiles its first
# step (torch.compile) or loads a checkpoint -- and short enough that a wedged job is noticed within
# minutes, not after 30 (torch's gloo default, and this constant's old value). Raise it for runs whose
# first step or checkpoint load takes longer. The heartbeat (hetplan.runtime.heartbeat) names a stopped
# rank after 0.8 of it.
DEFAULT_TIMEOUT_S = 300.0

TieGroups = dict[tuple[int, int, int, int], Any]


@dataclass(frozen=True)
class ProcessSetup:
    """What :func:`set_up` made for this process (the RuntimeContext's state)."""

    plan: Plan
    spec: Any
    layout: PlanLayout
    position: RankPosition
    device: torch.device
    notes: list[str]
    precision: str
    mesh: Any = None  # the ("pp", "dp", "tp") or ("pp", "dp", "cp", "tp") DeviceMesh; None in one process
    ep_mesh: Any = None  # ("pp", "edp", "ep", "tp") of an expert-parallel plan
    tie_groups: TieGroups = field(default_factory=dict)
    owns_process_group: bool = False
    heartbeat: Any = None
    mixed_groups: mixed.MixedGroups = field(default_factory=dict)  # stages of mixed TP degrees (runtime.mixed)


def set_up(plan: Plan | str | os.PathLike[str] | None = None, model: Any = None, *,
           timeout_s: float | None = None, backend: str | None = None, trust_plan_code: bool = False
           ) -> ProcessSetup:
    """Check ``plan`` and set up this process for it (see the module doc and
    ``hetplan.runtime.init``, which makes the RuntimeContext of it)."""
    if plan is None:
        plan = os.environ.get("HETPLAN_PLAN")
        if not plan:
            raise HetplanError("no plan given: pass one to hetplan.runtime.init or set HETPLAN_PLAN")
    plan, spec, cluster, layout, precision = check_plan_precision(plan, model, trust_plan_code)
    notes = list(layout.notes)
    already = dist.is_available() and dist.is_initialized()
    rank = _this_rank(layout, already)
    position = layout.position(rank)
    device = pick_device(plan, cluster, position, notes)
    if timeout_s is None:
        timeout_s = env_timeout()
    if cluster is not None and not os.environ.get("HETPLAN_ONE_MACHINE"):  # set by `hetplan train`
        check_node_placement(layout, cluster, rank)
    torch.set_num_threads(int(os.environ.get("HETPLAN_NUM_THREADS", torch.get_num_threads())))
    if layout.world_size == 1:
        return ProcessSetup(plan, spec, layout, position, device, notes, precision)
    if not already:
        be = backend or ("nccl" if device.type == "cuda" else "gloo")
        dist.init_process_group(be, timeout=datetime.timedelta(seconds=timeout_s))
    heartbeat = hb.start(layout, rank, timeout_s)  # names a rank that stops responding (world > 1)
    mesh, ep_mesh = make_meshes(layout, position, device)
    return ProcessSetup(plan, spec, layout, position, device, notes, precision, mesh, ep_mesh,
                        make_tie_groups(layout, spec), not already, heartbeat, mixed.make_groups(layout))


def _this_rank(layout: PlanLayout, already: bool) -> int:
    """This process's rank; the processes started must be one per device the plan uses."""
    world, rank = _env_int("WORLD_SIZE"), _env_int("RANK")
    if already:
        world, rank = dist.get_world_size(), dist.get_rank()
    if world is None:
        world, rank = 1, 0
    if world != layout.world_size:
        raise HetplanError(
            f"the plan runs on {layout.world_size} processes (one per device it uses) but {world} were started; "
            f"launch with `hetplan run PLAN -- SCRIPT` or torchrun --nproc-per-node={layout.world_size}"
        )
    assert rank is not None
    return rank


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def env_timeout() -> float:
    """The collective timeout from ``HETPLAN_PG_TIMEOUT_S`` (``DEFAULT_TIMEOUT_S`` unset)."""
    text = os.environ.get("HETPLAN_PG_TIMEOUT_S", "")
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise HetplanError(f"HETPLAN_PG_TIMEOUT_S={text!r}: the timeout must be a finite number of seconds > 0")
    return value


# --- the plan ---------------------------------------------------------------------------------
def check_plan(plan: Plan | str | os.PathLike[str], model: Any = None, trust_plan_code: bool = False
               ) -> tuple[Plan, Any, Any, PlanLayout]:
    """Load and check a plan without torch.distributed: (plan, ModelSpec,
    ClusterSpec or None, PlanLayout). Raises HetplanError naming the problem."""
    return check_plan_precision(plan, model, trust_plan_code)[:4]


def check_plan_precision(plan: Plan | str | os.PathLike[str], model: Any = None, trust_plan_code: bool = False
                         ) -> tuple[Plan, Any, Any, PlanLayout, str]:
    """``check_plan`` and the precision the plan trains in ("fp32", "bf16" or "fp16").
    The plan's model code (a ``pkg.mod:build`` source) is imported later only if
    ``model`` names it or ``trust_plan_code`` (hetplan.model.origin); a bare
    plan naming code is refused here, before any import."""
    settings: dict[str, Any] = {}
    if isinstance(plan, Plan):
        if model is None and is_reference(plan.model) and not trust_plan_code:
            raise HetplanError(untrusted_message(plan.model))
        spec = model if isinstance(model, ModelSpec) else load_model(model or plan.model)
        cluster = _load_cluster(plan)
    else:  # a plan file: the model and cluster it embeds (format 2), or their names
        plan_file = read_plan_file(plan)
        plan = plan_file.plan()
        spec = resolve_model(plan_file, model)
        cluster = resolve_cluster(plan_file) if plan_file.cluster is not None else _load_cluster(plan)
        settings = plan_file.settings
        _refuse_unrun_settings(settings)
    if trust_plan_code:
        spec = replace(spec, source=trusted(spec.source))
    if spec.name != plan.model:
        raise HetplanError(f"the plan was made for model {plan.model!r}, not {spec.name!r}; make a plan for this model")
    if cluster is not None:
        validate_plan(plan, spec, cluster)
    layout = PlanLayout.from_plan(plan, [layer.name for layer in spec.layers])
    if not support_of(spec).build:  # a model the runtime builds: what it can run of it (a script may build its own)
        check_runs(plan, spec)
    return plan, spec, cluster, layout, mp.precision_of(settings, spec.dtype_bytes)


def _load_cluster(plan: Plan) -> Any:
    """For a bare Plan object (no file): the named cluster, if this machine knows it."""
    try:
        return load_cluster(plan.cluster)
    except (HetplanError, OSError):
        return None


def _refuse_unrun_settings(settings: dict[str, Any]) -> None:
    """A plan costed with FP8 matmuls counted FP8's speed and its one-byte saved
    linear inputs; hetplan's runtime trains in the plan's 16-bit precision, so
    such a plan could run out of memory here: refuse it rather than train it
    as a different plan than the one costed."""
    if settings.get("fp8"):
        raise HetplanError("the plan was costed with FP8 matmuls (--fp8), which hetplan's runtime does not run: "
                           "make the plan without --fp8 to train it here, or export it to a tool with "
                           "Transformer Engine FP8 (hetplan export PLAN --format megatron)")


# --- the device and the node ------------------------------------------------------------------
def pick_device(plan: Plan, cluster: Any, position: RankPosition, notes: list[str]) -> torch.device:
    """This rank's device: ``HETPLAN_DEVICE`` if set, else the plan's GPU (checked
    against the one this process sees), else the CPU with a note."""
    forced = os.environ.get("HETPLAN_DEVICE")
    if forced:
        return torch.device(forced)
    gpu_plan = cluster is not None and cluster.devices[position.device].gpu.name.upper() != "CPU"
    if gpu_plan and torch.cuda.is_available():
        local = cluster.devices[position.device].local_rank
        if local >= torch.cuda.device_count():
            raise HetplanError(
                f"the plan puts rank {position.rank} on GPU {local} of its node, but this node has "
                f"{torch.cuda.device_count()} GPUs; the cluster differs from the plan's {plan.cluster!r}"
            )
        # a capped or retuned catalog GPU is checked as its catalog type; a GPU
        # described from scratch in a cluster file has no CUDA name to check
        expected = cluster.devices[position.device].gpu.catalog_name
        found = torch.cuda.get_device_name(local)
        if expected and not os.environ.get("HETPLAN_SKIP_GPU_CHECK") and not gpu_matches(expected, found):
            raise HetplanError(
                f"the plan puts rank {position.rank} on a {expected}, but this process sees a {found}; run the "
                f"plan on the cluster it was made for ({plan.cluster!r}) or set HETPLAN_SKIP_GPU_CHECK=1"
            )
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    if gpu_plan:
        msg = f"no CUDA device: running the plan for {plan.cluster!r} on CPU with gloo"
        if msg not in notes:
            notes.append(msg)
    return torch.device("cpu")


def gpu_matches(catalog_name: str, cuda_name: str) -> bool:
    """Whether a CUDA device name is the catalog's GPU type: every token of the
    catalog name but its memory size appears in the device name
    ('RTX-TITAN' ~ 'NVIDIA TITAN RTX', 'A100-80GB' ~ 'NVIDIA A100-SXM4-80GB')."""
    def tokens(text: str) -> set[str]:
        return {t for t in re.split(r"[\s\-_]+", text.upper()) if t}

    want = {t for t in tokens(catalog_name) if not re.fullmatch(r"\d+GB", t)}
    return want <= tokens(cuda_name)


def check_node_placement(layout: PlanLayout, cluster: Any, rank: int) -> None:
    """With torchrun's node rank / local rank in the environment, check this
    process runs where the plan puts it (see `hetplan run`)."""
    group_rank, local_rank = _env_int("GROUP_RANK"), _env_int("LOCAL_RANK")
    local_world = _env_int("LOCAL_WORLD_SIZE")
    if group_rank is None or local_rank is None:
        return
    device = layout.devices[rank]
    nodes = sorted({cluster.devices[d].node for d in layout.devices})
    node = cluster.devices[device].node
    on_node = [d for d in layout.devices if cluster.devices[d].node == node]
    expected = (nodes.index(node), on_node.index(device), len(on_node))
    found = (group_rank, local_rank, local_world if local_world is not None else len(on_node))
    if len(nodes) == 1:
        expected = (0, rank, layout.world_size)
    if found != expected:
        raise HetplanError(
            f"rank {rank} runs as process {found[1]} of {found[2]} on launcher node {found[0]}, but the plan puts it "
            f"on GPU {device} = process {expected[1]} of {expected[2]} on plan node {expected[0]}; start the "
            "processes with the per-node commands `hetplan run PLAN --print -- SCRIPT` prints"
        )


# --- meshes and groups ------------------------------------------------------------------------
def make_meshes(layout: PlanLayout, position: RankPosition, device: torch.device) -> tuple[Any, Any]:
    """(this rank's DeviceMesh, the expert-parallel mesh or None); every rank
    builds every mesh (DeviceMesh creates its groups collectively)."""
    from torch.distributed.device_mesh import DeviceMesh  # lazy: only runs of more than one process need it

    def mesh(ranks: Any, dims: tuple[str, ...]) -> Any:
        return DeviceMesh(device.type, torch.tensor(ranks, dtype=torch.int64), mesh_dim_names=dims)

    if layout.heterogeneous:  # one (dp, tp) mesh per stage; every rank builds all of them
        main = None
        for j in range(layout.pp):
            for rows in _stage_meshes(layout, j):
                built = mesh(rows, ("dp", "tp"))
                main = built if position.rank in [r for row in rows for r in row] else main
    elif layout.cp > 1:  # TP innermost, then CP, then DP (hetplan.plan.spec)
        main = mesh(layout.mesh_ranks_cp(), ("pp", "dp", "cp", "tp"))
    else:
        main = mesh(layout.mesh_ranks(), ("pp", "dp", "tp"))
    ep_mesh = None
    if layout.ep > 1:  # the dp * cp ranks of a TP rank in EP groups of ep (hetplan.plan.layout)
        ep_mesh = mesh(layout.ep_mesh_ranks(), ("pp", "edp", "ep", "tp"))
    return main, ep_mesh


def _stage_meshes(layout: PlanLayout, stage: int) -> list[list[list[int]]]:
    """The ``[dp][tp]`` rank grids of a stage of a heterogeneous plan: one for
    the stage, or one ``[1][replica_tp[r]]`` grid per replica where its
    replicas run different TP degrees (each replica its own TP mesh; runtime.mixed)."""
    rows = layout.stage_mesh_ranks(stage)
    if layout.plan.stages[stage].replica_tp is None:
        return [rows]
    return [[row] for row in rows]


def make_tie_groups(layout: PlanLayout, spec: Any) -> TieGroups:
    """Process groups joining the copies of weights tied across stages (same dp/tp index)."""
    pairs: set[tuple[int, int]] = set()
    for group in tied_layer_groups(spec):
        idx = sorted({layout.pp_index_of_layer(n) for n in group})
        for a in idx:
            for b in idx:
                if a < b:
                    pairs.add((a, b))
    groups: TieGroups = {}
    if layout.heterogeneous:
        for a, b in sorted(pairs):
            groups[(a, b, -1, -1)] = dist.new_group(sorted(layout.stage_ranks(a) + layout.stage_ranks(b)))
        return groups
    ranks = [[cp_row for dp_row in stage for cp_row in dp_row] for stage in layout.mesh_ranks_cp()]
    for a, b in sorted(pairs):
        for d in range(layout.dp * layout.cp):  # (dp index, cp index) with CP innermost
            for t in range(layout.tp):
                groups[(a, b, d, t)] = dist.new_group([ranks[a][d][t], ranks[b][d][t]])
    return groups
