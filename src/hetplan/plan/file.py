"""Plan files that stand alone: the plans with the model, the cluster and the
settings they were made for.

A plan names layers by index and GPUs by number; without the model and
cluster those numbers mean nothing. Format 1 stored only their names, so a plan
made from a ``config.json`` and a cluster YAML could not be estimated, exported
or trained anywhere else ("unknown model preset"). Format 2 and later
(``hetplan plan`` / ``estimate --json`` write it) embed::

    {"format_version": 4,
     "plans": [{"plan": ..., "estimate": ...}, ...],
     "model_spec": ModelSpec.to_dict(),          # layers, costs, source (how to build it), meta (notes)
     "cluster_spec": cluster_to_dict(cluster),   # the cluster YAML's form
     "settings": {"precision": ..., "optimizer": ..., "fp8": ..., "zero_implementation": ...,
                  "memory_limit_bytes": ..., "overlap_grad_sync": ..., "target": ..., "compile": ...}}

Format 3 writes each plan's ``micro_batch_size`` per data-parallel replica
(Megatron's meaning) with the total in ``micro_batch_total``; older plans
stored the total under ``micro_batch_size`` and load as such.

Format 4 writes the model's typed ``source`` (``hetplan.model.origin``: a HF
class and its config values, or a ``pkg.mod:build`` function and its hash);
format 3 and older kept it in ``meta`` (``hf_class``, ``module_source``, ...),
which ``ModelSpec.from_dict`` still reads. Reading a plan file never imports
code: a plan whose model is Python code is built only when the user names the
function or trusts the file (docs/inputs.md, "What a plan file can do").

Every reader (``estimate``, ``export``, ``train``, ``run``, ``hetplan.runtime.init``)
takes the model and cluster from the file. ``--model`` / ``--cluster`` still
override, but must describe the same model (layer names, parameters, sequence)
and cluster (GPU types device by device): a different one is an error, not a
silently different plan. Format-1 files still load, by name.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from hetplan.io import fields
from hetplan.cost.constants import (
    ATTENTION_KERNELS, DEFAULT_ATTENTION_KERNEL, EXPERT_LOAD_IMBALANCE, PRECISION_BYTES, ZERO_IMPLEMENTATIONS,
)
from hetplan.plan.workload import TARGETS as WORKLOAD_TARGETS
from hetplan.errors import HetplanError
from hetplan.limits import MAX_EXPERT_IMBALANCE
from hetplan.plan.spec import Estimate, Plan
from hetplan.io.userfiles import read_json
from hetplan.plan.validate import validate_plan
from hetplan.model.origin import ModuleSource, is_reference, untrusted_message
from hetplan.model.spec import ModelSpec
from hetplan.model.load import load_model
from hetplan.cluster.io import cluster_to_dict
from hetplan.plan.workload import Workload
from hetplan.cluster.io import cluster_from_dict
from hetplan.cluster.io import is_cluster_path, load_cluster
from hetplan.cluster.presets import get_cluster

PLAN_FILE_VERSION = 4  # 4: ModelSpec.source typed (hetplan.model.origin); 3: meta held it
SETTING_KEYS = ("precision", "optimizer", "fp8", "zero_implementation", "attention_kernel", "memory_limit_bytes",
                "overlap_grad_sync", "expert_imbalance", "tp_comm_overlap", "target", "compile")


@dataclass(frozen=True)
class PlanFile:
    """A plan file's contents; ``model``/``cluster`` are None in format-1 files."""

    path: str
    plans: tuple[Plan, ...]
    model: Any = None
    cluster: Any = None
    settings: dict[str, Any] = field(default_factory=dict)
    version: int = 1
    planner: str = ""  # the planner 'hetplan plan' ran ("" in files that do not say)

    def plan(self, index: int = 1) -> Plan:
        """The ``index``-th plan (1 = the best), checked against the model and
        cluster the file embeds (a format-1 file's plan is checked by its user,
        once the model and cluster are known by name)."""
        if not 1 <= index <= len(self.plans):
            raise HetplanError(f"plan file {self.path} holds {len(self.plans)} plan(s); use --index 1.."
                               f"{len(self.plans)}")
        plan = self.plans[index - 1]
        if self.model is not None and self.cluster is not None:
            try:
                validate_plan(plan, self.model, self.cluster)
            except HetplanError as exc:
                raise HetplanError(f"plan file {self.path}, plan {index}: {exc}") from None
        return plan

    def workload(self, index: int = 1, profile: Any = None, calibration: Any = None) -> Any:
        """The Workload the ``index``-th plan was made for: the embedded model,
        cluster and settings, and the plan's own global batch."""
        if self.model is None or self.cluster is None:
            raise HetplanError(f"plan file {self.path} is format 1 (names only); regenerate it with "
                               "'hetplan plan --json' so it embeds its model and cluster")
        plan = self.plan(index)
        saved = self.settings
        return Workload(self.model, self.cluster, plan.global_batch_size, optimizer=saved.get("optimizer", ""),
                        memory_limit_bytes=saved.get("memory_limit_bytes", 0),
                        overlap_grad_sync=saved.get("overlap_grad_sync", True), profile=profile,
                        fp8=saved.get("fp8", False), zero_implementation=saved.get("zero_implementation", "fsdp"),
                        attention_kernel=saved.get("attention_kernel", DEFAULT_ATTENTION_KERNEL),
                        tp_comm_overlap=saved.get("tp_comm_overlap", False),
                        precision=saved.get("precision", ""),
                        expert_imbalance=saved.get("expert_imbalance", EXPERT_LOAD_IMBALANCE),
                        calibration=calibration if calibration is not None else self.cluster.meta.get("calibration"),
                        target=saved.get("target", ""), compile=saved.get("compile", False))


def workload_record(workload: Any) -> dict[str, Any]:
    """What a plan file embeds about the workload its plans were made for."""
    return {
        "format_version": PLAN_FILE_VERSION,
        "model_spec": workload.model.to_dict(),
        "cluster_spec": cluster_to_dict(workload.cluster),
        "settings": {key: getattr(workload, key) for key in SETTING_KEYS},
    }


def read_plan_file(path: str | os.PathLike[str]) -> PlanFile:
    """Read a plan file of either format (a ranked list or a single plan)."""
    path = os.fspath(path)
    return plan_file_from_data(path, read_json(path, "plan file", "fix or regenerate it"))


def plan_file_from_data(path: str, data: Any) -> PlanFile:
    """A plan file's parsed JSON (``path`` names it in errors): what
    measurement files embed."""
    try:
        return _plan_file(path, data)
    except HetplanError as exc:
        raise HetplanError(f"plan file {path}: {exc}") from None


def _plan_file(path: str, data: Any) -> PlanFile:
    if isinstance(data, dict) and "plans" in data:
        top = fields.mapping("the file", data, _FILE_KEYS, ("plans",))
        version = fields.whole("format_version", top.get("format_version", 1))
        if version > PLAN_FILE_VERSION:
            raise HetplanError(f"format {version} is newer than this hetplan reads ({PLAN_FILE_VERSION}); "
                               "upgrade hetplan")
        entries = fields.listing("plans", top["plans"])
        if "planner" in top:
            fields.text("planner", top["planner"])
        if "search_time_s" in top:
            fields.number("search_time_s", top["search_time_s"], 0.0, strict=False)
    else:  # one plan, or one {"plan": ..., "estimate": ...} entry, or a list of them (format 1)
        top, version = {}, 1
        entries = data if isinstance(data, list) else [data]
    if not entries:
        raise HetplanError("holds no plans")
    plans = tuple(Plan.from_dict(_plan_of(f"plans[{k}]", e)) for k, e in enumerate(entries))
    model = ModelSpec.from_dict(top["model_spec"], "model_spec") if top.get("model_spec") is not None else None
    cluster = cluster_from_dict(top["cluster_spec"], "cluster_spec") if top.get("cluster_spec") is not None else None
    _check_embedded_names(plans, model, cluster)
    return PlanFile(path, plans, model, cluster, _settings(top.get("settings") or {}), version,
                    str(top.get("planner", "")))


def _check_embedded_names(plans: tuple[Plan, ...], model: ModelSpec | None, cluster: Any) -> None:
    """Each plan's ``model`` and ``cluster`` name the specs the file embeds, and
    an embedded cluster named like a preset has that preset's GPUs: an edited
    name would be ignored (and copied into --json beside the real one), an
    edited GPU type re-costed on another GPU under the old name."""
    for k, plan in enumerate(plans):
        for what, named, spec in (("model", plan.model, model), ("cluster", plan.cluster, cluster)):
            if spec is not None and named != spec.name:
                raise HetplanError(f"plans[{k}].{what} is {named!r} but the file embeds the {what} {spec.name!r} "
                                   f"({what}_spec.name); make a new plan rather than editing the names")
    if cluster is not None and not is_cluster_path(cluster.name):
        try:
            preset = get_cluster(cluster.name)
        except HetplanError:  # a cluster of the user's own, not a preset
            return
        if [d.gpu.name for d in preset.devices] != [d.gpu.name for d in cluster.devices]:
            raise HetplanError(f"cluster_spec is named {cluster.name!r} like a preset ({preset.summary()}) but holds "
                               f"{cluster.summary()}; make a new plan for the cluster you mean")


# "planner" and "search_time_s": what 'hetplan plan --json' adds about the search; "target" to
# "torchtitan_version": what it adds with --target (hetplan.export.target.target_json)
_FILE_KEYS = ("format_version", "plans", "model_spec", "cluster_spec", "settings", "planner", "search_time_s",
              "target", "slowdown", "best_overall", "target_notes", "torchtitan_version")
_ENTRY_KEYS = ("plan", "estimate", "planner_cost_s", "training", "replay")
# "replay": the replay check's record ('hetplan plan --json' with torch, hetplan.app.replay.replay_record),
# what was found when the file was written ("replicas": each replayed replica of a stage of mixed TP
# degrees, hetplan.app.replay.ReplicaPeak); it is costed again, not trusted, when the file is read
_REPLAY_KEYS = ("peak_memory_bytes", "capacity_bytes", "host_peak_memory_bytes", "fits", "seconds", "replicas")


def _plan_of(where: str, entry: Any) -> Any:
    """The plan of a ranked entry ({"plan": ..., "estimate": ...}) or a bare plan."""
    if isinstance(entry, dict) and "plan" in entry:
        entry = fields.mapping(where, entry, _ENTRY_KEYS)
        if "planner_cost_s" in entry:
            fields.number(f"{where}.planner_cost_s", entry["planner_cost_s"], 0.0, strict=False)
        if entry.get("replay") is not None:
            fields.mapping(f"{where}.replay", entry["replay"], _REPLAY_KEYS)
        return entry["plan"]
    return entry


def _imbalance(where: str, value: Any) -> float:
    """The busiest EP rank's load over the average: 1 (balanced) up to MAX_EXPERT_IMBALANCE."""
    number = fields.number(where, value, 1.0, strict=False)
    if number > MAX_EXPERT_IMBALANCE:
        raise HetplanError(f"{where} must be at most {MAX_EXPERT_IMBALANCE:g}, got {number:g}")
    return number


def _settings(data: Any) -> dict[str, Any]:
    """The workload settings, each with its exact type (a typo is an error, not a default)."""
    raw = fields.mapping("settings", data, SETTING_KEYS)
    readers = {
        "precision": lambda w, v: fields.text(w, v, ("", *PRECISION_BYTES)),
        "optimizer": fields.text,
        "fp8": fields.flag,
        "zero_implementation": lambda w, v: fields.text(w, v, ZERO_IMPLEMENTATIONS),
        "attention_kernel": lambda w, v: fields.text(w, v, ATTENTION_KERNELS),
        "memory_limit_bytes": lambda w, v: fields.whole(w, v, 0),
        "overlap_grad_sync": fields.flag,
        "tp_comm_overlap": fields.flag,
        "expert_imbalance": _imbalance,
        "target": lambda w, v: fields.text(w, v, WORKLOAD_TARGETS),
        "compile": fields.flag,
    }
    return {key: readers[key](f"settings.{key}", value) for key, value in raw.items()}


def resolve_model(pf: PlanFile, override: Any = None, seq_len: int | None = None,
                  dtype_bytes: int | None = None) -> Any:
    """The model of the plan file; ``override`` (a name/path or ModelSpec) must be the same model."""

    if override is None and pf.model is not None:
        if seq_len is not None and seq_len != pf.model.seq_len:
            raise HetplanError(f"the plan was made for sequence length {pf.model.seq_len}, not {seq_len}; "
                               "drop --seq-len or make a new plan")
        return pf.model
    if isinstance(override, ModelSpec):
        model = override
    else:
        if override is None and is_reference(pf.plans[0].model):  # a format-1 file naming code: never imported
            raise HetplanError(untrusted_message(pf.plans[0].model))
        model = load_model(override or pf.plans[0].model, seq_len=seq_len, dtype_bytes=dtype_bytes)
    if pf.model is not None:
        _check_same_model(model, pf.model)
    return model


def resolve_cluster(pf: PlanFile, override: str | None = None) -> Any:
    """The cluster of the plan file; ``override`` (a name or YAML) must have the same GPUs."""

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
    if isinstance(given.source, ModuleSource) and isinstance(made_for.source, ModuleSource) \
            and made_for.source.module_hash and given.source.module_hash != made_for.source.module_hash:
        raise HetplanError(
            f"the model built by {given.source.reference} differs from the one the plan was made for: its parameter "
            f"names or shapes changed (hash {given.source.module_hash}, the plan's {made_for.source.module_hash}); "
            f"make the plan again ('hetplan plan --model {given.source.reference} ...') or restore the function")
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



def save_plan(path: str | os.PathLike[str], plan: Plan, estimate: Estimate | None = None) -> None:
    """Write a minimal plan file: ``plan`` (and its ``estimate``) without the model and cluster."""
    data: dict[str, Any] = {"plan": plan.to_dict()}
    if estimate is not None:
        data["estimate"] = estimate.to_dict()
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)


def load_plan(path: str | os.PathLike[str], index: int = 1) -> Plan:
    """The ``index``-th plan of a plan file (``read_plan_file`` also gives the
    model and cluster the file embeds)."""
    return read_plan_file(path).plan(index)
