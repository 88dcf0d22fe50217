"""Plan files that stand alone: the plans with the model, the cluster and the
settings they were made for.

A plan names layers by index and GPUs by number; without the model and
cluster those numbers mean nothing. Format 1 stored only their names, so a plan
made from a ``config.json`` and a cluster YAML could not be estimated, exported
or trained anywhere else ("unknown model preset"). Format 2 and later
(``hetplan plan`` / ``estimate --json`` write it) embed::

    {"format_version": 3,
     "plans": [{"plan": ..., "estimate": ...}, ...],
     "model_spec": ModelSpec.to_dict(),          # layers, costs, meta (source)
     "cluster_spec": cluster_to_dict(cluster),   # the cluster YAML's form
     "settings": {"precision": ..., "optimizer": ..., "fp8": ..., "zero_implementation": ...,
                  "memory_limit_bytes": ..., "overlap_grad_sync": ...}}

Format 3 writes each plan's ``micro_batch_size`` per data-parallel replica
(Megatron's meaning) with the total in ``micro_batch_total``; older plans
stored the total under ``micro_batch_size`` and load as such.

Every reader (``estimate``, ``export``, ``train``, ``run``, ``hetplan.runtime.init``)
takes the model and cluster from the file. ``--model`` / ``--cluster`` still
override, but must describe the same model (layer names, parameters, sequence)
and cluster (GPU types device by device): a different one is an error, not a
silently different plan. Format-1 files still load, by name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from hetplan.errors import HetplanError
from hetplan.jsonfile import read_json
from hetplan.plan import Plan

PLAN_FILE_VERSION = 3
SETTING_KEYS = ("precision", "optimizer", "fp8", "zero_implementation", "memory_limit_bytes", "overlap_grad_sync")


@dataclass(frozen=True)
class PlanFile:
    """A plan file's contents; ``model``/``cluster`` are None in format-1 files."""

    path: str
    plans: tuple[Plan, ...]
    model: Any = None
    cluster: Any = None
    settings: dict[str, Any] = field(default_factory=dict)
    version: int = 1

    def plan(self, index: int = 1) -> Plan:
        """The ``index``-th plan (1 = the best)."""
        if not 1 <= index <= len(self.plans):
            raise HetplanError(f"plan file {self.path} holds {len(self.plans)} plan(s); use --index 1.."
                               f"{len(self.plans)}")
        return self.plans[index - 1]


def workload_record(workload: Any) -> dict[str, Any]:
    """What a plan file embeds about the workload its plans were made for."""
    from hetplan.cluster import cluster_to_dict

    return {
        "format_version": PLAN_FILE_VERSION,
        "model_spec": workload.model.to_dict(),
        "cluster_spec": cluster_to_dict(workload.cluster),
        "settings": {key: getattr(workload, key) for key in SETTING_KEYS},
    }


def read_plan_file(path: str | os.PathLike[str]) -> PlanFile:
    """Read a plan file of either format (a ranked list or a single plan)."""
    from hetplan.cluster import cluster_from_dict
    from hetplan.model.spec import ModelSpec

    path = os.fspath(path)
    data = read_json(path, "plan file", "fix or regenerate it")
    version = int(data.get("format_version", 1)) if isinstance(data, dict) else 1
    if version > PLAN_FILE_VERSION:
        raise HetplanError(f"plan file {path} has format {version}, newer than this hetplan reads "
                           f"({PLAN_FILE_VERSION}); upgrade hetplan")
    plans = tuple(Plan.from_dict(entry) for entry in _plan_entries(data, path))
    model = cluster = None
    if isinstance(data, dict) and data.get("model_spec") is not None:
        model = ModelSpec.from_dict(data["model_spec"])
    if isinstance(data, dict) and data.get("cluster_spec") is not None:
        cluster = cluster_from_dict(data["cluster_spec"], f"plan file {path}")
    settings = dict(data.get("settings") or {}) if isinstance(data, dict) else {}
    unknown = sorted(set(settings) - set(SETTING_KEYS))
    if unknown:
        raise HetplanError(f"plan file {path}: unknown setting(s) {', '.join(unknown)}")
    return PlanFile(path, plans, model, cluster, settings, version)


def _plan_entries(data: Any, path: str) -> list[dict[str, Any]]:
    if isinstance(data, dict) and "plans" in data:
        data = data["plans"]
    entries = data if isinstance(data, list) else [data]
    if not entries:
        raise HetplanError(f"plan file {path} holds no plans")
    return [e["plan"] if isinstance(e, dict) and "plan" in e else e for e in entries]


def resolve_model(pf: PlanFile, override: Any = None, seq_len: int | None = None,
                  dtype_bytes: int | None = None) -> Any:
    """The model of the plan file; ``override`` (a name/path or ModelSpec) must be the same model."""
    from hetplan.model import load_model
    from hetplan.model.spec import ModelSpec

    if override is None and pf.model is not None:
        if seq_len is not None and seq_len != pf.model.seq_len:
            raise HetplanError(f"the plan was made for sequence length {pf.model.seq_len}, not {seq_len}; "
                               "drop --seq-len or make a new plan")
        return pf.model
    if isinstance(override, ModelSpec):
        model = override
    else:
        model = load_model(override or pf.plans[0].model, seq_len=seq_len, dtype_bytes=dtype_bytes)
    if pf.model is not None:
        _check_same_model(model, pf.model)
    return model


def resolve_cluster(pf: PlanFile, override: str | None = None) -> Any:
    """The cluster of the plan file; ``override`` (a name or YAML) must have the same GPUs."""
    from hetplan.cluster import load_cluster

    if override is None and pf.cluster is not None:
        return pf.cluster
    cluster = load_cluster(override or pf.plans[0].cluster)
    if pf.cluster is not None:
        _check_same_cluster(cluster, pf.cluster)
    return cluster


def _check_same_model(given: Any, made_for: Any) -> None:
    what = [(a, b, label) for a, b, label in (
        ([layer.name for layer in given.layers], [layer.name for layer in made_for.layers], "layers"),
        (given.total_params, made_for.total_params, "parameters"),
        (given.seq_len, made_for.seq_len, "sequence length"),
    ) if a != b]
    if what:
        label = what[0][2]
        detail = "" if label == "layers" else f" ({what[0][0]:,} vs {what[0][1]:,})"
        raise HetplanError(
            f"model {given.name!r} differs from the model the plan was made for ({made_for.name!r}) in its "
            f"{label}{detail}; drop --model to use the plan's own, or make a new plan"
        )


def _check_same_cluster(given: Any, made_for: Any) -> None:
    a = [d.gpu.name for d in given.devices]
    b = [d.gpu.name for d in made_for.devices]
    if a != b:
        raise HetplanError(
            f"cluster {given.name!r} ({given.summary()}) differs from the cluster the plan was made for "
            f"({made_for.summary()}); drop --cluster to use the plan's own, or make a new plan"
        )
