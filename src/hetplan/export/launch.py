"""Launch files for an export: which node runs which ranks, and scripts that start them.

Every tool numbers a hetplan plan's ranks the same way: stages in pipeline
order; inside a stage, data-parallel replica, then context-parallel rank,
then TP rank (TP fastest) — hetplan's ``Stage.devices`` order (plan/spec.py).
torchtitan 0.3 builds its mesh as ("pp", "dp_replicate", "dp_shard", "cp",
"tp") (torchtitan/distributed/parallel_dims.py:318), Megatron-LM orders
tp-cp-ep-dp-pp, DeepSpeed's pipeline topology is (pipe, data)
(deepspeed/runtime/pipe/topology.py:240-241) and AutoTP's mesh
(data_parallel, tensor_parallel) (deepspeed/utils/groups.py:220). So rank
``r`` must run on the plan's ``r``-th device, and each launcher gives a node
consecutive ranks: a node's GPUs must be one run of that order.

Written per export (``Export.files``, beside ``hetplan export --out``):

* ``.launch.sh``: run on every node as ``bash NAME.launch.sh NODE_RANK``; it
  starts the node's processes (torchrun, or DeepSpeed's launcher with
  ``--no_ssh``) on the plan's GPUs (``CUDA_VISIBLE_DEVICES``, or DeepSpeed's
  ``--include``). On a cluster of several GPU types it first checks, with
  nvidia-smi, that the node has the GPU type the plan gives that node rank.
* ``.sbatch``: a Slurm job with one task per node that runs the launch script
  (node rank = ``SLURM_PROCID``); on a mixed cluster one heterogeneous-job
  component per run of nodes of one GPU type, asked for by ``--constraint``.
* ``.hostfile`` (DeepSpeed): one line per node, in rank order.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any, Sequence

from hetplan.errors import HetplanError
from hetplan.plan.spec import Plan

DEFAULT_MASTER_PORT = 29500  # torchrun's default --master-port (torch/distributed/run.py)


@dataclass(frozen=True)
class NodeRun:
    """One node's share of the job: the launcher's node rank, the cluster
    node, the plan's devices on it in rank order, and its first global rank."""

    node_rank: int
    node: int
    devices: tuple[int, ...]
    first_rank: int

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + len(self.devices))


def rank_order(plan: Plan) -> list[int]:
    """The plan's devices in global rank order (stage, then replica, cp, tp)."""
    return [d for stage in plan.stages for d in stage.devices]


def node_runs(plan: Plan, cluster: Any, tool: str) -> list[NodeRun]:
    """The nodes in launch order, each with its run of consecutive ranks, or
    a one-line refusal if a node's GPUs are not one run of the rank order."""
    runs: list[tuple[int, list[int]]] = []
    for rank, device in enumerate(rank_order(plan)):
        if device >= cluster.num_devices:
            raise HetplanError(f"the plan uses GPU {device}, but cluster {cluster.name!r} has {cluster.num_devices}")
        node = cluster.devices[device].node
        if runs and runs[-1][0] == node:
            runs[-1][1].append(device)
        elif any(n == node for n, _ in runs):
            raise HetplanError(f"{tool} gives each node consecutive ranks (TP fastest, then DP, then PP), but this "
                               f"plan puts GPUs of node {node} at ranks apart (GPU {device} is rank {rank}); use the "
                               "hetplan runtime for this plan")
        else:
            runs.append((node, [device]))
    result, first = [], 0
    for k, (node, devices) in enumerate(runs):
        result.append(NodeRun(k, node, tuple(devices), first))
        first += len(devices)
    return result


def local_ids(cluster: Any, run: NodeRun) -> list[int]:
    """The run's GPUs as the node numbers them (``CUDA_VISIBLE_DEVICES``)."""
    return [cluster.devices[d].local_rank for d in run.devices]


def _span(values: Sequence[int]) -> str:
    """'0-7' for a run of consecutive numbers, else '0,2,5'."""
    values = list(values)
    if len(values) > 1 and values == list(range(values[0], values[0] + len(values))):
        return f"{values[0]}-{values[-1]}"
    return ",".join(map(str, values))


def placement_lines(plan: Plan, cluster: Any, runs: Sequence[NodeRun]) -> list[str]:
    """One comment line per node rank: the cluster node, its GPU type, the
    plan's GPUs, ranks and pipeline stages on it."""
    stage_of = {d: j for j, stage in enumerate(plan.stages) for d in stage.devices}
    lines = []
    for run in runs:
        node = cluster.nodes[run.node]
        stages = sorted({stage_of[d] for d in run.devices})
        lines.append(f"node rank {run.node_rank}: cluster node {run.node} ({node.num_gpus}x {node.gpu_type}), "
                     f"GPUs {_span(local_ids(cluster, run))}, ranks {_span(run.ranks)}, "
                     f"pipeline stage{'s' if len(stages) > 1 else ''} {_span(stages)}")
    return lines


def gpu_token(gpu_type: str) -> str:
    """What nvidia-smi's GPU name contains for a catalog GPU type: its model
    ('A100' for 'A100-80GB', as in 'NVIDIA A100-SXM4-80GB'; 'RTX 4090')."""
    return gpu_type.replace("-", " ") if gpu_type.upper().startswith("RTX") else gpu_type.split("-")[0]


def _mixed(cluster: Any, runs: Sequence[NodeRun]) -> bool:
    return len({cluster.nodes[r.node].gpu_type for r in runs}) > 1


_CHECK_GPU = r'''check_gpu() {  # the GPU type the plan gives this node rank; another type would change the plan
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        echo "warning: no nvidia-smi; not checking that node rank $NODE_RANK has $1 GPUs" >&2
        return 0
    fi
    local found
    found="$(nvidia-smi --query-gpu=name --format=csv,noheader | sort -u | tr '\n' ';')"
    case "${found,,}" in
        *"${1,,}"*) ;;
        *) echo "node rank $NODE_RANK must run on $1 GPUs (the plan's placement); this node has: $found" >&2
           exit 2 ;;
    esac
}'''


def launch_script(title: str, plan: Plan, cluster: Any, runs: Sequence[NodeRun], setup: Sequence[str],
                  per_node: str, usage: Sequence[str] = ()) -> str:
    """A bash script run on each node with its node rank (argument,
    ``NODE_RANK`` or Slurm's ``SLURM_PROCID``): ``setup`` lines, then per
    node rank the variables ``NPROC`` and ``GPUS`` (local ids in rank
    order), then the ``per_node`` command."""
    mixed = _mixed(cluster, runs)
    lines = ["#!/usr/bin/env bash", f"# {title}: the launch of a hetplan plan (hetplan export) on cluster "
             f"{cluster.name!r}: {len(runs)} node(s), {sum(len(r.devices) for r in runs)} processes.",
             "# Run on every node: bash THIS_FILE NODE_RANK (the .sbatch file does, with Slurm), with MASTER_ADDR",
             "# set to node rank 0's address (MASTER_PORT: default 29500).", *(f"# {u}" for u in usage),
             "# Placement (rank r runs on the plan's r-th GPU):",
             *(f"#   {line}" for line in placement_lines(plan, cluster, runs)),
             "set -euo pipefail",
             'HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
             'NAME="$(basename "${BASH_SOURCE[0]}" .launch.sh)"',
             'NODE_RANK="${1:-${NODE_RANK:-${SLURM_PROCID:-}}}"',
             f'MASTER_PORT="${{MASTER_PORT:-{DEFAULT_MASTER_PORT}}}"', *setup]
    if mixed:
        lines.append(_CHECK_GPU)
    lines.append('case "$NODE_RANK" in')
    for run in runs:
        node = cluster.nodes[run.node]
        check = f"; check_gpu {shlex.quote(gpu_token(node.gpu_type))}" if mixed else ""
        gpus = ",".join(map(str, local_ids(cluster, run)))
        lines.append(f"    {run.node_rank}) NPROC={len(run.devices)}; GPUS={gpus}"
                     f"{check} ;;  # cluster node {run.node} ({node.gpu_type}), ranks {_span(run.ranks)}")
    lines += [f'    *) echo "usage: bash $0 NODE_RANK (0 to {len(runs) - 1})" >&2; exit 2 ;;', "esac",
              ': "${MASTER_ADDR:?set MASTER_ADDR to the address of node rank 0}"', per_node]
    return "\n".join(lines) + "\n"


def torchrun_command(runs: Sequence[NodeRun], program: Sequence[str]) -> str:
    """The per-node torchrun line: the node's GPUs in rank order
    (``CUDA_VISIBLE_DEVICES``: local rank i runs on the i-th; torchrun
    numbers ranks node by node, node rank order)."""
    return 'export CUDA_VISIBLE_DEVICES="$GPUS"\n' + " ".join(["exec torchrun", f"--nnodes={len(runs)}",
                     '--node-rank="$NODE_RANK"', '--nproc-per-node="$NPROC"', '--master-addr="$MASTER_ADDR"',
                     '--master-port="$MASTER_PORT"', *program])


def _components(cluster: Any, runs: Sequence[NodeRun]) -> list[tuple[str, int, int]]:
    """Slurm job components: runs of consecutive node ranks with one GPU type
    and GPU count, as (GPU type, GPUs per node, nodes)."""
    parts: list[tuple[str, int, int]] = []
    for run in runs:
        node = cluster.nodes[run.node]
        if parts and parts[-1][:2] == (node.gpu_type, node.num_gpus):
            parts[-1] = (node.gpu_type, node.num_gpus, parts[-1][2] + 1)
        else:
            parts.append((node.gpu_type, node.num_gpus, 1))
    return parts


def sbatch_script(tool: str, plan: Plan, cluster: Any, runs: Sequence[NodeRun]) -> str:
    """A Slurm batch script: one task per node running NAME.launch.sh (found
    beside this file), node rank = ``SLURM_PROCID``, ``MASTER_ADDR`` = the
    first node. Whole nodes (``--exclusive``), so the plan's local GPU ids
    exist. On a mixed cluster the GPU types come from ``--constraint`` in a
    heterogeneous job, one component per run of nodes of one type, in rank
    order (Slurm numbers a heterogeneous step's tasks component by component)."""
    parts = _components(cluster, runs)
    hetero = len(parts) > 1
    lines = ["#!/bin/bash", f"# Slurm job for a hetplan plan's {tool} export on cluster {cluster.name!r}.",
             "# Submit: sbatch THIS_FILE (it runs NAME.launch.sh, beside it, once per node).",
             *(f"#   {line}" for line in placement_lines(plan, cluster, runs))]
    if hetero:
        lines.append("# One job component per GPU type: --constraint names the node feature of those GPUs; change it "
                     "to your site's feature name if it differs.")
    for k, (gpu, per_node, count) in enumerate(parts):
        if k:
            lines.append("#SBATCH hetjob")
        lines += [f"#SBATCH --nodes={count}", "#SBATCH --ntasks-per-node=1", f"#SBATCH --gpus-per-node={per_node}",
                  "#SBATCH --exclusive"]
        if hetero:
            lines.append(f"#SBATCH --constraint={gpu_token(gpu).replace(' ', '')}")
    group = f" --het-group=0-{len(parts) - 1}" if hetero else ""
    lines += ["set -euo pipefail",
              'SCRIPT="$(scontrol show job "$SLURM_JOB_ID" | sed -n \'s/^ *Command=//p\' | head -n 1)"',
              'LAUNCH="${SCRIPT%.sbatch}.launch.sh"',
              '[ -f "$LAUNCH" ] || { echo "no $LAUNCH beside $SCRIPT (hetplan export --out writes both)" >&2; '
              'exit 2; }',
              'MASTER_ADDR="$(scontrol show hostnames "${SLURM_JOB_NODELIST_HET_GROUP_0:-$SLURM_JOB_NODELIST}" '
              '| head -n 1)"',
              f'export MASTER_ADDR MASTER_PORT="${{MASTER_PORT:-{DEFAULT_MASTER_PORT}}}"',
              f'srun{group} --ntasks-per-node=1 --kill-on-bad-exit=1 bash "$LAUNCH"']
    return "\n".join(lines) + "\n"


def launch_files(tool: str, title: str, plan: Plan, cluster: Any, runs: Sequence[NodeRun], setup: Sequence[str],
                 per_node: str, usage: Sequence[str] = ()) -> dict[str, str]:
    """``.launch.sh`` and ``.sbatch`` for the export's ``files``."""
    return {".launch.sh": launch_script(title, plan, cluster, runs, setup, per_node, usage),
            ".sbatch": sbatch_script(tool, plan, cluster, runs)}


def launch_note(main_suffix: str = "", extra: str = "") -> str:
    """The export's note naming its launch files (written beside ``--out``;
    ``main_suffix``: the name the launch script expects the export under)."""
    out = (f"write the export with --out NAME{main_suffix}" if main_suffix else
           "hetplan export --out NAME.EXT writes them")
    return (f"launch: NAME.launch.sh (bash NAME.launch.sh NODE_RANK on each node, MASTER_ADDR set) and NAME.sbatch "
            f"(Slurm) start the plan's ranks on its GPUs; {out}{extra}")


# --------------------------------------------------------------------------- DeepSpeed's launcher


def deepspeed_runs(plan: Plan, cluster: Any) -> list[NodeRun]:
    """The nodes for DeepSpeed's launcher, which orders hosts as the hostfile
    lists them and sorts each host's ``--include`` slots
    (deepspeed/launcher/runner.py:289), then gives a host's ``n`` processes
    consecutive ranks with local rank ``rank % n`` on the ``local rank``-th
    slot (deepspeed/launcher/launch.py:160-213). A plan whose ranks that
    order does not put on the plan's GPUs is refused in one line."""
    runs = node_runs(plan, cluster, "DeepSpeed's launcher")
    for run in runs:
        ids = local_ids(cluster, run)
        slots = sorted(ids)
        for rank, want in zip(run.ranks, ids):
            got = slots[rank % len(slots)]
            if got != want:
                raise HetplanError(f"DeepSpeed's launcher puts rank {rank} on GPU {got} of node {run.node} (the "
                                   f"(rank mod {len(slots)})-th of its sorted --include slots), but the plan puts it "
                                   f"on GPU {want}; export for torchtitan or Megatron-LM (torchrun), or use the "
                                   "hetplan runtime")
    return runs


def deepspeed_hostfile(plan: Plan, cluster: Any, runs: Sequence[NodeRun]) -> str:
    """One ``HOST slots=N`` line per node in rank order; placeholder host
    names ``nodeK`` (cluster node K), which the user replaces (ssh names)
    keeping the order; comments say what each node must be."""
    lines = [f"# DeepSpeed hostfile for a hetplan plan's export on cluster {cluster.name!r}.",
             "# One line per node, in rank order: replace each name with the host that has those GPUs (its ssh name)",
             "# and keep the order; NAME.launch.sh reads the names from here.",
             *(f"# {line}" for line in placement_lines(plan, cluster, runs))]
    lines += [f"node{run.node} slots={cluster.nodes[run.node].num_gpus}" for run in runs]
    return "\n".join(lines) + "\n"


def deepspeed_launch_script(plan: Plan, cluster: Any, runs: Sequence[NodeRun]) -> str:
    """DeepSpeed's launcher with the hostfile and ``--include`` built from
    it: without a node rank from node 0 over ssh (pdsh, DeepSpeed's default),
    with one (the .sbatch file) on that node alone (``--no_ssh``)."""
    include = "@".join(f"${{HOSTS[{k}]}}:{','.join(map(str, sorted(local_ids(cluster, run))))}"
                       for k, run in enumerate(runs))
    setup = ['HOSTFILE="$HERE/$NAME.hostfile"', 'CONFIG="$HERE/$NAME.json"',
             '[ -f "$CONFIG" ] || { echo "no $CONFIG: write the export with --out $NAME.json" >&2; exit 2; }',
             ': "${TRAIN_SCRIPT:?set TRAIN_SCRIPT to your training script (it calls deepspeed.initialize with '
             '--deepspeed_config)}"',
             "mapfile -t HOSTS < <(awk '!/^[[:space:]]*#/ && NF {print $1}' \"$HOSTFILE\")",
             f'[ "${{#HOSTS[@]}}" -eq {len(runs)} ] || {{ echo "$HOSTFILE must list {len(runs)} hosts, in rank order" '
             '>&2; exit 2; }',
             f'INCLUDE="{include}"',
             'RUN=(deepspeed --hostfile "$HOSTFILE" --include "$INCLUDE" --master_port "$MASTER_PORT")',
             'PROGRAM=("$TRAIN_SCRIPT" --deepspeed --deepspeed_config "$CONFIG")',
             'if [ -z "$NODE_RANK" ]; then  # from node 0: the launcher starts every node over ssh',
             '    exec "${RUN[@]}" ${MASTER_ADDR:+--master_addr "$MASTER_ADDR"} "${PROGRAM[@]}"',
             "fi"]
    per_node = 'exec "${RUN[@]}" --no_ssh --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" "${PROGRAM[@]}"'
    usage = ["Or from node 0 without NODE_RANK: DeepSpeed's launcher starts every node over ssh (the hostfile's "
             "names).",
             "DeepSpeed's launcher sets CUDA_VISIBLE_DEVICES to each host's --include slots."]
    return launch_script("DeepSpeed's launcher (TRAIN_SCRIPT: your script)", plan, cluster, runs, setup,
                         per_node, usage)
