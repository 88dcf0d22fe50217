"""Write a Plan in the formats of the tools users already run.

* ``modules``: module-name lists per pipeline stage — the split format of
  ``torch.distributed.pipelining`` and torchtitan's ``module_fqns_per_model_part``.
* ``torchtitan``: the ``[parallelism]``/``[activation_checkpoint]`` settings of a
  torchtitan job config (as a dict; the CLI prints TOML).
* ``megatron``: Megatron-LM command-line arguments.
* ``deepspeed``: a DeepSpeed config dict.

Each tool expresses less than a hetplan Plan: one (dp, tp) for all stages,
even data splits, one ZeRO stage. When a plan uses something a tool cannot
express, export raises a HetplanError naming it instead of silently dropping it.
"""

from __future__ import annotations

from typing import Any

from hetplan.errors import HetplanError
from hetplan.model.spec import ModelSpec
from hetplan.plan import Plan

FORMATS = ("modules", "torchtitan", "megatron", "deepspeed")


def stage_module_names(plan: Plan, model: ModelSpec) -> list[list[str]]:
    """Module names run by each stage, in order."""
    return [[model.layers[i].name for i in stage.layers] for stage in plan.stages]


def _uniform(plan: Plan, tool: str) -> tuple[int, int, int, str]:
    """(dp, tp, zero, recompute) shared by every stage and layer, or an error
    naming what the tool cannot express."""
    first = plan.stages[0]
    for j, stage in enumerate(plan.stages):
        if (stage.dp, stage.tp) != (first.dp, first.tp):
            raise HetplanError(f"{tool} runs one (dp, tp) on every stage; stage {j} has dp={stage.dp} tp={stage.tp} "
                               f"but stage 0 has dp={first.dp} tp={first.tp} — use the hetplan runtime for this plan")
        if len(set(stage.dp_split)) > 1:
            raise HetplanError(f"{tool} splits batches evenly; stage {j} splits {list(stage.dp_split)} — "
                               "use the hetplan runtime for uneven data splits")
        if stage.has_layer_degrees:
            raise HetplanError(f"{tool} cannot give single layers their own tp (stage {j}); use the hetplan runtime")
    zeros = {s.zero for st in plan.stages for s in st.strategies}
    recomputes = {s.recompute for st in plan.stages for s in st.strategies}
    if len(zeros) > 1:
        raise HetplanError(f"{tool} uses one ZeRO stage for the whole model; this plan mixes {sorted(zeros)}")
    if len(recomputes) > 1:
        raise HetplanError(f"{tool} exports one recompute setting here; this plan mixes {sorted(recomputes)}")
    return first.dp, first.tp, zeros.pop(), recomputes.pop()


def to_torchtitan(plan: Plan, model: ModelSpec) -> dict[str, Any]:
    dp, tp, zero, recompute = _uniform(plan, "torchtitan")
    if zero in (1, 2):
        raise HetplanError("torchtitan shards with FSDP2 (ZeRO-3) or replicates (ZeRO-0); ZeRO-1/2 have no setting")
    schedule = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved-1f1b": "Interleaved1F1B"}[plan.schedule]
    parallelism: dict[str, Any] = {
        "data_parallel_shard_degree": dp if zero == 3 else 1,
        "data_parallel_replicate_degree": 1 if zero == 3 else dp,
        "tensor_parallel_degree": tp,
        "enable_sequence_parallel": any(s.sequence_parallel for s in plan.stages),
        "pipeline_parallel_degree": plan.pp,
        "pipeline_parallel_schedule": schedule,
        "pipeline_parallel_microbatch_size": plan.micro_batch_size // dp,
        "module_fqns_per_model_part": stage_module_names(plan, model),
    }
    return {
        "parallelism": parallelism,
        "training": {"global_batch_size": plan.global_batch_size, "local_batch_size": plan.global_batch_size // dp},
        "activation_checkpoint": {"mode": recompute if recompute != "none" else "none"},
    }


def to_megatron_args(plan: Plan, model: ModelSpec) -> list[str]:
    dp, tp, zero, recompute = _uniform(plan, "Megatron-LM")
    if zero >= 2:
        raise HetplanError("Megatron-LM's distributed optimizer shards optimizer states (ZeRO-1) only; "
                           f"this plan uses ZeRO-{zero}")
    args = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(plan.pp),
            "--micro-batch-size", str(plan.micro_batch_size // dp),
            "--global-batch-size", str(plan.global_batch_size)]
    if zero == 1:
        args.append("--use-distributed-optimizer")
    if any(s.sequence_parallel for s in plan.stages):
        args.append("--sequence-parallel")
    if recompute == "selective":
        args += ["--recompute-granularity", "selective"]
    elif recompute == "full":
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    if plan.virtual_stages > 1:
        args += ["--num-virtual-stages-per-pipeline-rank", str(plan.virtual_stages)]
    if plan.pp > 1:
        # Megatron splits the blocks evenly, except that the first and last
        # stages may hold their own counts.
        blocks = [sum(1 for i in s.layers if model.layers[i].kind not in ("embedding", "head")) for s in plan.stages]
        middle = blocks[1:-1]
        if len(set(middle)) > 1:
            raise HetplanError(f"Megatron-LM cannot express blocks per stage {blocks}; use the hetplan runtime")
        if len(set(blocks)) > 1:
            args += ["--decoder-first-pipeline-num-layers", str(blocks[0]),
                     "--decoder-last-pipeline-num-layers", str(blocks[-1])]
    return args


def to_deepspeed_config(plan: Plan, model: ModelSpec) -> dict[str, Any]:
    dp, tp, zero, recompute = _uniform(plan, "DeepSpeed")
    if plan.pp > 1 and zero >= 2:
        raise HetplanError("DeepSpeed pipeline parallelism supports ZeRO-0/1 only; this plan uses ZeRO-%d" % zero)
    config: dict[str, Any] = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size // dp,
        "gradient_accumulation_steps": plan.num_micro_batches,
        "zero_optimization": {"stage": zero},
        "bf16": {"enabled": model.dtype_bytes == 2},
    }
    if recompute != "none":
        config["activation_checkpointing"] = {"partition_activations": tp > 1, "contiguous_memory_optimization": False}
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    return config


def deepspeed_pipeline_note(plan: Plan) -> str:
    """DeepSpeed sets pipeline stages in code, not in its JSON config."""
    bounds = [0]
    for stage in plan.stages:
        bounds.append(bounds[-1] + stage.num_layers)
    return (f"pipeline: build deepspeed.pipe.PipelineModule(layers, num_stages={plan.pp}) and partition the "
            f"layer list at {bounds} (hetplan's stage boundaries)")


def export_plan(plan: Plan, model: ModelSpec, fmt: str) -> Any:
    if fmt == "modules":
        return stage_module_names(plan, model)
    if fmt == "torchtitan":
        return to_torchtitan(plan, model)
    if fmt == "megatron":
        return to_megatron_args(plan, model)
    if fmt == "deepspeed":
        return to_deepspeed_config(plan, model)
    raise HetplanError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")


def to_toml(data: dict[str, Any]) -> str:
    """Minimal TOML writer for the torchtitan settings (tables of scalars/lists)."""
    import json

    lines: list[str] = []
    for section, values in data.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if isinstance(value, bool):
                text = "true" if value else "false"
            else:
                text = json.dumps(value)
            lines.append(f"{key} = {text}")
        lines.append("")
    return "\n".join(lines)
