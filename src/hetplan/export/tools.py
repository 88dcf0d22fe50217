"""Write a Plan in the formats of the tools users already run.

* ``modules``: module-name lists per pipeline stage — the split format of
  ``torch.distributed.pipelining`` and torchtitan's ``module_fqns_per_model_part``.
* ``torchtitan``: torchtitan's settings for the plan, for the version the user
  runs (``TORCHTITAN_VERSIONS``): ``0.3`` (the current release) takes a Python
  config (``config_registry`` functions building ``Trainer.Config``), ``0.2``
  the TOML job file of ``JobConfig``.
* ``megatron``: one ``torchrun ... pretrain_gpt.py`` command per node, with the
  model's shape and the plan's parallelism (Megatron-LM ``core_v0.16.1``).
* ``deepspeed``: a DeepSpeed config dict (DeepSpeed 0.19.8), plus the
  ``PipelineModule`` code a pipeline plan needs (DeepSpeed sets pipeline
  stages in code, not in its config).

Which tool version each export was checked against, and how, is in
docs/exports.md; tests/test_export_tools.py loads every export with the tools'
own loaders.

Each tool expresses less than a hetplan Plan: one (dp, tp) for all stages,
even data splits, one ZeRO stage, one recompute setting for its transformer
blocks. When a plan uses something a tool cannot express, export raises a
one-line HetplanError naming it and why instead of silently dropping it; where
the tool runs something close but not the same, the export says so in a note
(``Export.notes``).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any, Sequence

import tomli_w

from hetplan.cost.targets import UNWRAPPED_KINDS
from hetplan.errors import HetplanError
from hetplan.export.launch import (DEFAULT_MASTER_PORT, NodeRun, deepspeed_hostfile, deepspeed_launch_script,
                                   deepspeed_runs, launch_files, launch_note, local_ids, node_runs, sbatch_script,
                                   torchrun_command)
from hetplan.model.spec import ModelSpec
from hetplan.plan.spec import Plan
from hetplan.cluster.io import load_cluster

FORMATS = ("modules", "torchtitan", "megatron", "deepspeed")
# The tools a plan can be made for (``hetplan plan --target``), with the names they go by.
TARGETS = ("torchtitan", "megatron", "deepspeed")
TOOL_NAMES = {"torchtitan": "torchtitan", "megatron": "Megatron-LM", "deepspeed": "DeepSpeed", "modules": "modules"}
# torchtitan's config format changed between its releases: 0.2.x reads a TOML
# job file (JobConfig), 0.3 builds a Python Trainer.Config (config_registry).
TORCHTITAN_VERSIONS = ("0.3", "0.2")
DEFAULT_TORCHTITAN_VERSION = "0.3"
# The releases each export was checked against (docs/exports.md).
# tool -> version checked against (torchtitan: per config format, a dict)
VALIDATED: dict[str, Any] = {"torchtitan": {"0.3": "0.3.0", "0.2": "0.2.2"}, "megatron": "Megatron-LM core_v0.16.1",
             "deepspeed": "0.19.8"}



@dataclass(frozen=True)
class Export:
    """One export: ``text`` is what the CLI prints or writes; ``data`` the same
    as Python values; ``notes`` what the tool will run differently from the
    plan or what the user must add; ``files`` more files the export needs,
    by suffix (``".pipeline.py"``: DeepSpeed's PipelineModule code)."""

    text: str
    data: Any
    notes: tuple[str, ...] = ()
    files: dict[str, str] = field(default_factory=dict)


def stage_module_names(plan: Plan, model: ModelSpec) -> list[list[str]]:
    """Module names run by each stage, in order."""
    return [[model.layers[i].name for i in stage.layers] for stage in plan.stages]


# --------------------------------------------------------------------------- what every tool needs


@dataclass(frozen=True)
class _Uniform:
    dp: int
    tp: int
    per_replica: int
    zero: int
    recompute: str  # of the transformer blocks
    sequence_parallel: bool
    notes: tuple[str, ...]
    cp: int = 1
    ep: int = 1


def _is_block(model: ModelSpec, index: int) -> bool:
    return model.layers[index].kind not in UNWRAPPED_KINDS


def _uniform(plan: Plan, model: ModelSpec, tool: str) -> _Uniform:
    """What every stage and layer shares, or an error naming what ``tool``
    cannot express. Tools checkpoint transformer blocks only: the blocks must
    agree on recompute; an embedding or head recomputed in the plan is kept
    by the tool, which a note says."""
    first = plan.stages[0]
    for j, stage in enumerate(plan.stages):
        if (stage.dp, stage.tp) != (first.dp, first.tp):
            raise HetplanError(f"{tool} runs one (dp, tp) on every stage; stage {j} has dp={stage.dp} tp={stage.tp} "
                               f"but stage 0 has dp={first.dp} tp={first.tp} — use the hetplan runtime for this plan")
        if stage.replica_tp is not None:
            raise HetplanError(f"{tool} runs one tp on every replica; stage {j} gives its replicas tp "
                               f"{'/'.join(map(str, stage.replica_tp))} — make the plan with one tp per stage")
        if len(set(stage.dp_split)) > 1:
            raise HetplanError(f"{tool} splits batches evenly; stage {j} splits {list(stage.dp_split)} — "
                               "use the hetplan runtime for uneven data splits")
        if stage.has_layer_degrees:
            raise HetplanError(f"{tool} cannot give single layers their own tp (stage {j}), nor can hetplan's "
                               "runtime; make the plan with one tp per stage")
        if stage.ep_split is not None and len(set(stage.ep_split)) > 1:
            raise HetplanError(f"torchtitan/Megatron give every EP rank the same number of experts; stage {j} "
                               f"splits them {':'.join(map(str, stage.ep_split))} — make the plan with an even "
                               "expert split")
        if (stage.cp, stage.ep) != (first.cp, first.ep):
            raise HetplanError(f"{tool} runs one context- and expert-parallel degree on every stage; stage {j} has "
                               f"cp={stage.cp} ep={stage.ep} but stage 0 has cp={first.cp} ep={first.ep} — use the "
                               "hetplan runtime for this plan")
        if stage.sequence_parallel != first.sequence_parallel and first.tp > 1:
            raise HetplanError(f"{tool} uses sequence parallelism on every stage or none; stage {j} differs from "
                               "stage 0 — use the hetplan runtime for this plan")
    zeros = {s.zero for st in plan.stages for s in st.strategies}
    if len(zeros) > 1:
        raise HetplanError(f"{tool} uses one ZeRO stage for the whole model; this plan mixes {sorted(zeros)} "
                           "— use the hetplan runtime for this plan")
    layers = [(i, st.recompute) for stage in plan.stages for i, st in zip(stage.layers, stage.strategies)]
    blocks = {r for i, r in layers if _is_block(model, i)}
    if len(blocks) > 1:
        raise HetplanError(f"{tool} applies one activation-checkpointing setting to every transformer block; this "
                           f"plan mixes {sorted(blocks)} — use the hetplan runtime for this plan")
    recompute = blocks.pop() if blocks else "none"
    notes = []
    # selective recompute drops the attention core: nothing on a layer without one
    edges = sorted({model.layers[i].name for i, r in layers if not _is_block(model, i) and
                    (r == "full" or r == "selective" and model.layers[i].act_attention_core_bytes > 0)})
    if edges:
        notes.append(f"{tool} checkpoints transformer blocks only: {', '.join(edges)} keep their activations, "
                     "which the plan recomputes (more memory than estimated unless the plan was made with --target for "
                     "this tool, which costs them that way)")
    if first.dp_split[0] < 1:
        raise HetplanError(f"{tool} needs at least one sample per replica and micro-batch; the plan gives "
                           f"{first.dp_split[0]}")
    if first.cp > 1 and model.seq_len % (2 * first.cp):
        raise HetplanError(f"{tool} splits each sequence into 2 x cp chunks to balance causal attention; the sequence "
                           f"length {model.seq_len} is not divisible by 2 x cp = {2 * first.cp}")
    if first.cp > 1 and first.tp > 1 and first.sequence_parallel and (model.seq_len // first.cp) % first.tp:
        raise HetplanError(f"{tool} shards each context-parallel rank's {model.seq_len // first.cp} tokens over "
                           f"tp={first.tp} (sequence parallelism); they do not divide")
    return _Uniform(first.dp, first.tp, first.dp_split[0], zeros.pop(), recompute,
                    first.tp > 1 and first.sequence_parallel, tuple(notes), first.cp, first.ep)


def _offloaded(plan: Plan) -> int:
    """How many of the plan's layers keep their saved activations in host memory."""
    return sum(s.offload for stage in plan.stages for s in stage.strategies)


def _refuse_offload(plan: Plan, tool: str, why: str) -> None:
    """A plan that offloads activations, refused in one line (never silently dropped)."""
    count = _offloaded(plan)
    if count:
        raise HetplanError(f"{tool} {why}; this plan offloads the activations of {count} layers — make it with "
                           "'hetplan plan --offload never', or use the hetplan runtime")


def _deepspeed_offload(plan: Plan, model: ModelSpec, recompute: str) -> tuple[bool, list[str]]:
    """Whether DeepSpeed's ``cpu_checkpointing`` carries the plan's offloading
    (checkpointed block inputs to host memory: every block offloaded with full
    recompute), and notes; any other offloading is refused in one line."""
    layers = [(i, s.offload) for stage in plan.stages for i, s in zip(stage.layers, stage.strategies)]
    blocks = {off for i, off in layers if _is_block(model, i)}
    if not any(off for _, off in layers):
        return False, []
    if blocks != {True} or recompute != "full":
        _refuse_offload(plan, "DeepSpeed", "offloads only checkpointed layer inputs, of every checkpointed block "
                        "(activation_checkpointing.cpu_checkpointing): it needs every transformer block offloaded with "
                        "full recompute")
    edges = sorted(model.layers[i].name for i, off in layers if off and not _is_block(model, i))
    notes = [f"DeepSpeed checkpoints transformer blocks only: {', '.join(edges)} keep their activations on the GPU, "
             "which the plan offloads (more GPU memory than hetplan estimated for those stages)"] if edges else []
    return True, notes


@dataclass(frozen=True)
class Experts:
    """The mixture-of-experts facts a tool needs, read from the model's layers
    (every MoE layer must agree: the tools configure one expert shape)."""

    num_experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int
    capacity_factor: float
    pattern: tuple[int, ...]  # per transformer block: 1 = MoE, 0 = dense


def experts(model: ModelSpec, tool: str) -> Experts | None:
    """The model's expert configuration, or None for a dense model."""
    blocks = [layer for i, layer in enumerate(model.layers) if _is_block(model, i)]
    moe = [layer for layer in blocks if getattr(layer, "num_experts", 0)]
    if not moe:
        return None
    shapes = {(layer.num_experts, layer.top_k, layer.expert_ffn, layer.shared_expert_ffn, layer.capacity_factor)
              for layer in moe}
    if len(shapes) > 1:
        raise HetplanError(f"{tool} gives every MoE layer the same experts; model {model.name!r} has "
                           f"{len(shapes)} different expert shapes")
    num, top_k, ffn, shared, capacity = shapes.pop()
    return Experts(num, top_k, ffn, shared, capacity, tuple(int(bool(layer.num_experts)) for layer in blocks))


def _check_expert_degree(u: _Uniform, model: ModelSpec, tool: str) -> Experts | None:
    """The experts, with ``ep`` checked against them: EP needs MoE layers and
    an expert count it divides."""
    moe = experts(model, tool)
    if u.ep > 1 and moe is None:
        raise HetplanError(f"the plan uses ep={u.ep}, but model {model.name!r} has no MoE layer; make the plan "
                           "with ep 1")
    if moe is not None and u.ep > 1 and moe.num_experts % u.ep:
        raise HetplanError(f"{tool} gives every expert-parallel rank the same number of experts; ep={u.ep} does "
                           f"not divide the {moe.num_experts} experts")
    return moe


def _chunks(plan: Plan) -> list[tuple[int, ...]]:
    """Layer indices of each pipeline model chunk, in the order the tools list
    them (chunk ``c`` on pipeline rank ``c % pp``): the stages themselves, or
    with interleaved 1F1B the ``pp * v`` chunks the hetplan runtime cuts
    (hetplan.plan.layout: stage ``j``'s layers in ``v`` near-equal chunks)."""
    v = plan.virtual_stages if plan.schedule == "interleaved-1f1b" and plan.pp > 1 else 1
    if v == 1:
        return [tuple(s.layers) for s in plan.stages]
    counts = []
    for j, stage in enumerate(plan.stages):
        n = stage.num_layers
        if n < v:
            raise HetplanError(f"stage {j} has {n} layers, fewer than virtual_stages={v}: every chunk needs a layer")
        base, extra = divmod(n, v)
        counts.append([base + (1 if k < extra else 0) for k in range(v)])
    chunks, start = [], 0
    for c in range(plan.pp * v):
        k, j = divmod(c, plan.pp)
        chunks.append(tuple(range(start, start + counts[j][k])))
        start += counts[j][k]
    return chunks


def _virtual(plan: Plan) -> int:
    return plan.virtual_stages if plan.schedule == "interleaved-1f1b" and plan.pp > 1 else 1


# --------------------------------------------------------------------------- model architecture


@dataclass(frozen=True)
class Architecture:
    """The facts a tool needs to build the model (``ModelSpec.meta["architecture"]``,
    written by hetplan's GPT and Llama builders and HF importer)."""

    num_layers: int
    kv_heads: int
    ffn: int
    gated_mlp: bool  # SwiGLU
    norm: str  # "layernorm" | "rmsnorm"
    positions: str  # "learned" | "rope"
    max_positions: int
    bias: bool
    tied_embeddings: bool
    dropout: bool
    kv_channels: int = 0  # head dim when it is not hidden / heads
    rope_theta: float = 0.0
    qkv_bias: bool = False


_ARCH_TYPES: dict[str, Any] = {
    "kv_heads": int, "ffn": int, "gated_mlp": bool, "norm": ("layernorm", "rmsnorm"),
    "positions": ("learned", "rope"), "max_positions": int, "bias": bool, "tied_embeddings": bool,
    "dropout": bool, "kv_channels": int, "rope_theta": float, "qkv_bias": bool,
}
_ARCH_OPTIONAL = ("kv_channels", "rope_theta", "qkv_bias")


def architecture(model: ModelSpec, tool: str) -> Architecture:
    """The model's architecture facts, checked; a HetplanError naming what is
    missing for ``tool`` otherwise."""
    if model.family not in ("gpt", "llama", "moe"):
        raise HetplanError(f"{tool} export covers GPT and Llama decoders and their MoE forms (pretrain_gpt.py); "
                           f"model {model.name!r} is family {model.family!r}")
    kinds = [layer.kind for layer in model.layers]
    blocks = [k for k in kinds if k not in UNWRAPPED_KINDS]
    allowed = {"decoder", "moe"} if model.family == "moe" else {"decoder"}
    if kinds[0] != "embedding" or kinds[-1] != "head" or not blocks or not set(blocks) <= allowed or \
            "embedding" in kinds[1:] or "head" in kinds[:-1]:
        raise HetplanError(f"{tool} builds an embedding, decoder blocks and a head; model {model.name!r} has layers "
                           f"of kinds {sorted(set(kinds))} in another order")
    meta = model.meta if isinstance(model.meta, dict) else {}
    moe = meta.get("moe")
    moe_meta: dict[str, Any] = moe if isinstance(moe, dict) else {}
    if meta.get("latent_attention") or moe_meta.get("latent_attention"):
        raise HetplanError(f"{tool} export does not write multi-head latent attention (DeepSeek's MLA) yet; model "
                           f"{model.name!r} uses it — use the plan JSON and set the MLA ranks by hand")
    facts = meta.get("architecture")
    if not isinstance(facts, dict):
        raise HetplanError(f"model {model.name!r} gives no architecture (meta.architecture: kv_heads, ffn, norm, ...), "
                           f"which {tool} needs to build it; use a hetplan preset or HF config, or add it to the file")
    values: dict[str, Any] = {}
    for key, kind in _ARCH_TYPES.items():
        if key not in facts:
            if key in _ARCH_OPTIONAL:
                continue
            raise HetplanError(f"model {model.name!r}: meta.architecture has no {key!r}, which {tool} needs")
        value = facts[key]
        ok = (value in kind if isinstance(kind, tuple) else
              isinstance(value, bool) if kind is bool else
              isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 and
              (kind is float or float(value).is_integer()))
        if not ok or (kind is int and not 0 <= value <= 10**9):
            raise HetplanError(f"model {model.name!r}: meta.architecture.{key} = {value!r} is not "
                               f"{'one of ' + repr(kind) if isinstance(kind, tuple) else kind.__name__}")
        values[key] = int(value) if kind is int else value
    if not values["kv_heads"] or not values["ffn"] or not model.num_heads or not model.hidden_size or \
            model.num_heads % values["kv_heads"] or not model.vocab_size:
        raise HetplanError(f"model {model.name!r}: meta.architecture needs kv_heads dividing the {model.num_heads} "
                           f"heads, an ffn width, and the model a hidden size and vocabulary")
    return Architecture(num_layers=len(blocks), **values)


# --------------------------------------------------------------------------- torchtitan


@dataclass(frozen=True)
class TorchtitanPreset:
    """A torchtitan model (``torchtitan.models.<module>``, ``flavor``; 0.3's
    ``config_registry.<function>``) and its shape."""

    module: str
    flavor: str
    function: str
    hidden: int
    blocks: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    rope_theta: float


# torchtitan's Llama 3 flavors: torchtitan 0.3.0 torchtitan/models/llama3/__init__.py:236-310 (8B: dim 4096,
# 32 layers, 32 heads, 8 KV heads, ffn compute_ffn_hidden_dim(4096, multiple_of=1024, ffn_dim_multiplier=1.3)
# = 14336; 70B: 8192, 80, 64, 8, multiple_of=4096 -> 28672; vocab 128256, RoPE theta 500000), the same shapes
# as 0.2.2's llama3_args; checked against the installed torchtitan by tests/test_export_tools.py.
TORCHTITAN_PRESETS = {
    "llama3-8b": TorchtitanPreset("llama3", "8B", "llama3_8b", 4096, 32, 32, 8, 14336, 128256, 500000.0),
    "llama3-70b": TorchtitanPreset("llama3", "70B", "llama3_70b", 8192, 80, 64, 8, 28672, 128256, 500000.0),
}


def torchtitan_preset(model: ModelSpec) -> TorchtitanPreset | None:
    """torchtitan's own model for ``model``: hetplan's preset of that name,
    or a Llama model of the same shape (an HF Llama-3 config.json); None if
    torchtitan has none."""
    if model.name in TORCHTITAN_PRESETS:
        return TORCHTITAN_PRESETS[model.name]
    if model.family != "llama":
        return None
    try:
        arch = architecture(model, "torchtitan")
    except HetplanError:
        return None
    llama = (arch.gated_mlp and arch.norm == "rmsnorm" and arch.positions == "rope" and not arch.bias and
             not arch.tied_embeddings and not arch.qkv_bias and arch.kv_channels in (0, model.hidden_size //
                                                                                     model.num_heads))
    shape = (model.hidden_size, arch.num_layers, model.num_heads, arch.kv_heads, arch.ffn, model.vocab_size,
             float(arch.rope_theta))
    for preset in TORCHTITAN_PRESETS.values():
        if llama and shape == (preset.hidden, preset.blocks, preset.heads, preset.kv_heads, preset.ffn, preset.vocab,
                               preset.rope_theta):
            return preset
    return None


def torchtitan_module_names(plan: Plan, model: ModelSpec,
                            version: str = DEFAULT_TORCHTITAN_VERSION) -> list[list[str]]:
    """torchtitan's ``module_fqns_per_model_part``: its own module names for
    each model chunk, in order. Llama: ``tok_embeddings``, ``layers.N``,
    ``norm`` and the output projection, ``output`` in 0.2.x and ``lm_head``
    in 0.3 (its ``Decoder``)."""
    kinds = [layer.kind for layer in model.layers]
    if model.family != "llama" or kinds[0] != "embedding" or kinds[-1] != "head" or \
            set(kinds[1:-1]) != {"decoder"}:
        raise HetplanError(f"torchtitan splits its own models into pipeline stages (Llama: tok_embeddings, layers.N, "
                           f"norm, output); it has no model for {model.name!r} (family {model.family!r}) — "
                           "use --format modules with torch.distributed.pipelining, or the hetplan runtime")
    output = "output" if version == "0.2" else "lm_head"
    names: dict[int, list[str]] = {0: ["tok_embeddings"], len(kinds) - 1: ["norm", output]}
    for i in range(1, len(kinds) - 1):
        names[i] = [f"layers.{i - 1}"]
    return [[n for i in chunk for n in names[i]] for chunk in _chunks(plan)]


def to_torchtitan(plan: Plan, model: ModelSpec, version: str = DEFAULT_TORCHTITAN_VERSION) -> dict[str, Any]:
    """torchtitan's settings for the plan as {section: {field: value}}: the
    sections of a 0.2.x TOML job file, or the fields of 0.3's config objects
    (``parallelism``: ParallelismConfig, ``training``: TrainingConfig,
    ``activation_checkpoint``: the AC config class and its fields). Notes on
    what differs: ``torchtitan_notes``."""
    return _torchtitan(plan, model, version)[0]


def _torchtitan(plan: Plan, model: ModelSpec, version: str) -> tuple[dict[str, Any], list[str]]:
    _refuse_offload(plan, "torchtitan", "has no activation offloading to host memory (training.enable_cpu_offload "
                    "moves FSDP's parameters, gradients and optimizer states)")
    if version not in TORCHTITAN_VERSIONS:
        raise HetplanError(f"unknown torchtitan version {version!r}; choose one of {', '.join(TORCHTITAN_VERSIONS)}")
    u = _uniform(plan, model, "torchtitan")
    notes = list(u.notes)
    if u.zero in (1, 2):
        raise HetplanError(f"torchtitan shards with FSDP2 (ZeRO-3) or replicates (ZeRO-0); ZeRO-{u.zero} has no "
                           "setting — make the plan with --zero 0 or 3, or use the hetplan runtime")
    if u.zero == 0 and u.dp > 1 and (u.tp > 1 or plan.pp > 1) and version == "0.2":
        raise HetplanError("torchtitan 0.2.x replicates (ZeRO-0) with DDP, which it runs only without TP/PP "
                           "(\"DDP has not supported > 1D parallelism\"); export for torchtitan 0.3 (HSDP with "
                           "shard degree 1), or make the plan with ZeRO-3")
    if u.tp > 1 and model.seq_len % u.tp:
        raise HetplanError(f"torchtitan's tensor parallelism needs the sequence length ({model.seq_len}) divisible by "
                           f"tp={u.tp}")
    if model.dtype_bytes == 2 and model.meta.get("precision") == "fp16":
        raise HetplanError("torchtitan trains in bf16 or fp32; this model is fp16")
    _check_expert_degree(u, model, "torchtitan")
    notes += _torchtitan_cp_ep_checks(u, version)
    v = _virtual(plan)
    if plan.virtual_stages > 1 and v == 1 and plan.pp > 1:
        notes.append(f"virtual_stages={plan.virtual_stages} ignored: only interleaved-1f1b uses model chunks "
                     "(as in the hetplan runtime)")
    schedule = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved-1f1b": "Interleaved1F1B" if v > 1 else "1F1B"}
    parallelism: dict[str, Any] = {
        "data_parallel_replicate_degree": 1 if u.zero == 3 else u.dp,
        "data_parallel_shard_degree": u.dp if u.zero == 3 else 1,
        "tensor_parallel_degree": u.tp,
        "pipeline_parallel_degree": plan.pp,
    }
    if u.cp > 1:
        parallelism["context_parallel_degree"] = u.cp
    if u.ep > 1:
        parallelism["expert_parallel_degree"] = u.ep
        if version == "0.2":
            parallelism["expert_tensor_parallel_degree"] = u.tp
    if version == "0.3":
        parallelism["enable_sequence_parallel"] = u.sequence_parallel
    elif u.tp > 1 and not u.sequence_parallel:
        notes.append("torchtitan 0.2.x always shards norms and dropout along the sequence with TP (sequence "
                     "parallelism), which the plan does not: activation memory will be lower than hetplan estimated")
    if plan.pp > 1:
        parallelism.update({
            "pipeline_parallel_schedule": schedule[plan.schedule],
            "pipeline_parallel_microbatch_size": u.per_replica,
            "module_fqns_per_model_part": torchtitan_module_names(plan, model, version),
        })
    # local_batch_size: per data-parallel rank and step; with PP it is split into
    # micro-batches of pipeline_parallel_microbatch_size, else the rest of the
    # global batch is gradient accumulation.
    local = u.per_replica * (plan.num_micro_batches if plan.pp > 1 else 1)
    training: dict[str, Any] = {"local_batch_size": local, "global_batch_size": plan.global_batch_size,
                                "seq_len": model.seq_len,
                                "mixed_precision_param": "bfloat16" if model.dtype_bytes == 2 else "float32"}
    if version == "0.3" and (plan.pp > 1 or u.ep > 1):
        # Trainer.Config's __post_init__ (_validate_cuda_graphs, torchtitan 0.3.0 trainer.py:179-212) refuses
        # CUDA graphs with pipeline parallelism, and with EP unless the token dispatcher never waits on the CPU
        # (MinimalAsyncEP, or HybridEP with non_blocking_capacity_factor); the default dispatchers do.
        training["disable_cuda_graphs"] = True
        notes.append("CUDA graphs off (training.disable_cuda_graphs): torchtitan 0.3 refuses them with "
                     f"{'pipeline parallelism' if plan.pp > 1 else 'expert parallelism and its default dispatcher'}")
    if version == "0.2":
        ac: dict[str, Any] = {"mode": u.recompute}
        if u.recompute == "selective":
            ac["selective_ac_option"] = "op"  # per-op SAC: save matmuls, recompute the cheap ops
    else:
        ac = {"config": {"none": None, "selective": "SelectiveAC", "full": "FullAC"}[u.recompute]}
    data: dict[str, Any] = {}
    preset = torchtitan_preset(model)
    if preset is not None and version == "0.2":
        data["model"] = {"name": preset.module, "flavor": preset.flavor}
    if preset is None:
        notes.append(f"torchtitan has no preset for {model.name!r}: pick a torchtitan model of its shape "
                     f"({'[model] name/flavor' if version == '0.2' else 'the config_registry function apply_plan gets'})")
    elif model.name not in TORCHTITAN_PRESETS:
        notes.append(f"torchtitan builds its {preset.module} {preset.flavor}, which has the shape of {model.name!r} "
                     "(torchtitan's Llama 3 applies Llama 3.1's RoPE frequency scaling)")
    data.update({"parallelism": parallelism, "training": training, "activation_checkpoint": ac})
    if u.recompute == "selective":
        notes.append("torchtitan's selective AC is per-op (saves matmul and attention outputs, recomputes the rest), "
                     "close to but not the same as hetplan's attention-core recompute")
    return data, notes


def _torchtitan_cp_ep_checks(u: _Uniform, version: str) -> list[str]:
    """What torchtitan's meshes allow for CP and EP (ParallelDims): FSDP
    shards over dp_shard x cp, so a replicated (ZeRO-0) plan's weights get
    sharded over the CP ranks; EP borrows from dp_shard x cp (0.2.x with
    expert TP = tp) or from dp_shard x cp x tp (0.3, experts not TP-split)."""
    notes = []
    shard = u.dp if u.zero == 3 else 1
    if u.cp > 1 and u.zero == 0:
        notes.append(f"torchtitan shards weights over the {u.cp} context-parallel ranks (FSDP over dp_shard x cp) "
                     "even with data_parallel_shard_degree 1: less memory than hetplan estimated for ZeRO-0")
    if u.ep > 1 and version == "0.3" and u.tp > 1:
        raise HetplanError("torchtitan 0.3 runs the experts without tensor parallelism (EP borrows the TP ranks), "
                           f"but this plan TP-splits them (ep={u.ep} x tp={u.tp}); export for torchtitan 0.2 "
                           "(expert_tensor_parallel_degree) or Megatron-LM, or make the plan with tp 1")
    if u.ep > 1 and (shard * u.cp) % u.ep:
        raise HetplanError(f"torchtitan takes expert parallelism from the sharded data-parallel and context-parallel "
                           f"ranks (dp_shard x cp = {shard} x {u.cp}), which ep={u.ep} does not divide; make the plan "
                           "with ZeRO-3 or a smaller ep")
    return notes


def to_toml(data: dict[str, Any], comments: Sequence[str] = ()) -> str:
    """The torchtitan 0.2 job file: ``comments`` as ``#`` lines above the TOML
    that ``tomli_w`` writes of ``data`` (tables, nested tables, scalars, lists)."""
    header = "".join(f"# {line}\n" for comment in comments for line in comment.splitlines())
    return header + ("\n" if header else "") + tomli_w.dumps(data)


def torchtitan_python(plan: Plan, model: ModelSpec, data: dict[str, Any], notes: Sequence[str]) -> str:
    """torchtitan 0.3's Python config: ``apply_plan(config)`` sets the plan on
    a ``Trainer.Config``; with a torchtitan preset of the model, a
    ``config_registry`` function that starts from it."""
    ac = data["activation_checkpoint"]["config"]
    lines = [
        f'"""torchtitan {VALIDATED["torchtitan"]["0.3"]} config for the hetplan plan {plan.describe()!r}',
        f"of model {model.name!r} (hetplan export --format torchtitan --torchtitan-version 0.3).",
        "",
        "Put this file on PYTHONPATH and use config = apply_plan(config) on your Trainer.Config, or run",
        "torchtitan with --module <this module> --config <a function below> (the .launch.sh file beside it does).",
    ]
    lines += ["", "Notes:", *(f"- {n}" for n in notes)] if notes else []
    lines += ['"""', "", "import dataclasses", "", "from torchtitan.config import ParallelismConfig"]
    if ac:
        lines.append(f"from torchtitan.distributed.activation_checkpoint import {ac}")
    lines += ["", f"PARALLELISM = {_py(data['parallelism'])}", f"TRAINING = {_py(data['training'])}", "", "",
              "def apply_plan(config):",
              '    """The plan\'s parallelism, batch sizes and activation checkpointing on a Trainer.Config,',
              '    checked by torchtitan (Trainer.Config.__post_init__)."""',
              "    config.parallelism = ParallelismConfig(**PARALLELISM)",
              "    for name, value in TRAINING.items():",
              "        setattr(config.training, name, value)  # a slots dataclass: an unknown name raises",
              f"    config.activation_checkpoint = {f'{ac}.Config()' if ac else 'None'}",
              "    # a new Trainer.Config of these values: its __post_init__ runs torchtitan's checks on them",
              "    return dataclasses.replace(config)"]
    preset = torchtitan_preset(model)
    if preset is not None:
        fn = preset.function
        lines += ["", "", f"def hetplan_{fn}():",
                  f'    """torchtitan\'s {fn} with the plan: --config hetplan_{fn}"""',
                  f"    from torchtitan.models.{preset.module}.config_registry import {fn}", "",
                  f"    return apply_plan({fn}())"]
    return "\n".join(lines) + "\n"


def torchtitan_launch_files(plan: Plan, model: ModelSpec, cluster: Any, version: str) -> dict[str, str]:
    """torchtitan's per-node torchrun (``-m torchtitan.train``, its
    run_train.sh's entry point) as a launch script and an sbatch job. 0.3
    reads the exported module (``--module NAME --config hetplan_<preset>``),
    0.2 the TOML (``--job.config_file``). For a model torchtitan has no preset
    of, the user names torchtitan's model (0.2: ``TORCHTITAN_MODEL``) or a
    config function of theirs (0.3: ``TORCHTITAN_MODULE``/``TORCHTITAN_CONFIG``):
    the script never starts torchtitan's default model in its place."""
    runs = node_runs(plan, cluster, "torchtitan")
    preset = torchtitan_preset(model)
    if version == "0.2":
        setup = ['CONFIG="$HERE/$NAME.toml"']
        program = ["-m", "torchtitan.train", '--job.config_file "$CONFIG"']
        if preset is None:
            setup.append(': "${TORCHTITAN_MODEL:?set TORCHTITAN_MODEL to --model.name NAME --model.flavor FLAVOR '
                         'of the torchtitan model of this shape}"')
            program.append("$TORCHTITAN_MODEL")
    else:
        setup = ['CONFIG="$HERE/$NAME.py"', 'export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"']
        module, config = ('"$NAME"', f"hetplan_{preset.function}") if preset else (
            '"${TORCHTITAN_MODULE:-$NAME}"', '"${TORCHTITAN_CONFIG:?set TORCHTITAN_CONFIG (in TORCHTITAN_MODULE, '
            'default this export) to a function returning apply_plan of your Trainer.Config of this model}"')
        program = ["-m", "torchtitan.train", f"--module {module}", f"--config {config}"]
    setup.append('[ -f "$CONFIG" ] || { echo "no $CONFIG: write the export with --out $(basename "$CONFIG")" >&2; '
                 "exit 2; }")
    title = f"torchtitan {VALIDATED['torchtitan'][version]} (-m torchtitan.train)"
    return launch_files("torchtitan", title, plan, cluster, runs, setup, torchrun_command(runs, program))


def _py(value: Any) -> str:
    """A Python literal of JSON-like data."""
    import pprint

    return pprint.pformat(value, width=110, sort_dicts=False)


# --------------------------------------------------------------------------- Megatron-LM


def to_megatron_args(plan: Plan, model: ModelSpec) -> list[str]:
    """Megatron-LM ``pretrain_gpt.py`` arguments for the plan: the model's shape,
    precision, batch sizes and parallelism."""
    return _megatron(plan, model)[0]


def _megatron(plan: Plan, model: ModelSpec) -> tuple[list[str], list[str]]:
    u = _uniform(plan, model, "Megatron-LM")
    _refuse_offload(plan, "Megatron-LM", "offloads activations (--cpu-offloading-num-layers) only without pipeline "
                    "parallelism and recomputation and never on the last layer, and its fine-grained offloading "
                    "moves chosen module inputs, not hetplan's per-layer saved tensors")
    notes = list(u.notes)
    if u.zero >= 2:
        raise HetplanError("Megatron-LM's distributed optimizer shards optimizer states (ZeRO-1) only; "
                           f"this plan uses ZeRO-{u.zero} — make it with --zero 0 or 1, or use the hetplan runtime")
    arch = architecture(model, "Megatron-LM")
    moe = _check_expert_degree(u, model, "Megatron-LM")
    args = ["--num-layers", str(arch.num_layers), "--hidden-size", str(model.hidden_size),
            "--num-attention-heads", str(model.num_heads), "--ffn-hidden-size", str(arch.ffn),
            "--seq-length", str(model.seq_len), "--max-position-embeddings", str(max(arch.max_positions,
                                                                                      model.seq_len))]
    if arch.kv_heads != model.num_heads:
        args += ["--group-query-attention", "--num-query-groups", str(arch.kv_heads)]
    if arch.kv_channels:
        args += ["--kv-channels", str(arch.kv_channels)]
    if arch.gated_mlp:
        args.append("--swiglu")
    if arch.norm == "rmsnorm":
        args += ["--normalization", "RMSNorm"]
    if arch.positions == "rope":
        args += ["--position-embedding-type", "rope"]
        if arch.rope_theta:
            # an int option in Megatron's parser (1e6, not "1e+06")
            theta = arch.rope_theta
            args += ["--rotary-base", str(int(theta)) if float(theta).is_integer() else repr(theta)]
    if not arch.bias:
        args.append("--disable-bias-linear")
        if arch.qkv_bias:
            args.append("--add-qkv-bias")
    if not arch.tied_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if not arch.dropout:
        args += ["--attention-dropout", "0", "--hidden-dropout", "0"]
    # NullTokenizer's vocabulary is vocab_size + 1 (the end-of-document token).
    args += ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(model.vocab_size - 1)]
    notes.append("the command trains on --mock-data with NullTokenizer (the model's vocabulary size); give your "
                 "data (--data-path) and tokenizer (--tokenizer-type/--tokenizer-model) and --train-iters")
    if model.dtype_bytes == 2:
        args.append("--fp16" if model.meta.get("precision") == "fp16" else "--bf16")
    args += ["--micro-batch-size", str(u.per_replica), "--global-batch-size", str(plan.global_batch_size),
             "--tensor-model-parallel-size", str(u.tp), "--pipeline-model-parallel-size", str(plan.pp)]
    if u.cp > 1:
        # p2p: the ring exchange of K/V blocks overlapped with attention (Megatron-Core's default cp_comm_type)
        args += ["--context-parallel-size", str(u.cp)]
    if moe is not None:
        args += _megatron_moe(moe, u)
    if u.zero == 1:
        args.append("--use-distributed-optimizer")
    if u.sequence_parallel:
        args.append("--sequence-parallel")
    if u.recompute == "selective":
        args += ["--recompute-granularity", "selective"]
    elif u.recompute == "full":
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    if plan.pp > 1:
        if plan.schedule == "gpipe":
            raise HetplanError("Megatron-LM runs 1F1B (or interleaved 1F1B) pipelines, not GPipe; make the plan "
                               "with --schedule 1f1b, or use the hetplan runtime")
        args += _megatron_split(plan, model)
    elif plan.virtual_stages > 1:
        notes.append(f"virtual_stages={plan.virtual_stages} ignored: one pipeline stage")
    args.append("--mock-data")
    return args, notes


def _megatron_moe(moe: Experts, u: _Uniform) -> list[str]:
    """Megatron-Core's MoE flags: experts, top-k, expert width, which blocks
    are MoE (``--moe-layer-freq`` as a 0/1 list), the all-to-all token
    dispatcher (what hetplan costs), EP with the experts TP-split like the
    dense layers (expert TP = tp, Megatron's default, as the plan means).
    The experts use the dense MLP's activation (``--swiglu`` or GELU)."""
    args = ["--num-experts", str(moe.num_experts), "--moe-router-topk", str(moe.top_k),
            "--moe-ffn-hidden-size", str(moe.expert_ffn), "--moe-token-dispatcher-type", "alltoall",
            "--expert-model-parallel-size", str(u.ep), "--expert-tensor-parallel-size", str(u.tp)]
    if moe.shared_ffn:
        args += ["--moe-shared-expert-intermediate-size", str(moe.shared_ffn)]
    if any(flag == 0 for flag in moe.pattern):
        args += ["--moe-layer-freq", "[" + ",".join(map(str, moe.pattern)) + "]"]
    if moe.capacity_factor != 1.0:
        args += ["--moe-expert-capacity-factor", f"{moe.capacity_factor:g}"]
    return args


def _megatron_split(plan: Plan, model: ModelSpec) -> list[str]:
    """The pipeline split: Megatron's default (blocks evenly over the stages or
    chunks, embedding on the first, output on the last) when it is the plan's,
    else ``--pipeline-model-parallel-layout`` (E: embedding, t: block, L: loss)."""
    chunks = _chunks(plan)
    v = _virtual(plan)
    last = model.num_layers - 1
    blocks = [sum(1 for i in c if _is_block(model, i)) for c in chunks]
    if len(set(blocks)) == 1:
        return ["--num-virtual-stages-per-pipeline-rank", str(v)] if v > 1 else []
    layout = ["".join(("E" if i == 0 else "L" if i == last else "t") for i in c) for c in chunks]
    return ["--pipeline-model-parallel-layout", "|".join(layout)]


def _megatron_node_commands(args: Sequence[str], runs: Sequence[NodeRun], cluster: Any, master_addr: str,
                            master_port: int) -> list[tuple[int, str]]:
    commands = []
    for run in runs:
        local = ",".join(map(str, local_ids(cluster, run)))
        parts = [f"CUDA_VISIBLE_DEVICES={local}", "torchrun", f"--nnodes={len(runs)}", f"--node-rank={run.node_rank}",
                 f"--nproc-per-node={len(run.devices)}", f"--master-addr={master_addr}", f"--master-port={master_port}",
                 "pretrain_gpt.py", *(shlex.quote(a) for a in args)]
        commands.append((run.node, " ".join(parts)))
    return commands


def _uneven_note(runs: Sequence[NodeRun]) -> list[str]:
    if len({len(r.devices) for r in runs}) > 1:
        return ["nodes run different numbers of processes (--nproc-per-node per node); torchrun numbers ranks node "
                "by node"]
    return []


def megatron_launch_files(plan: Plan, args: Sequence[str], runs: Sequence[NodeRun], cluster: Any) -> dict[str, str]:
    """Megatron-LM's per-node torchrun as a launch script and an sbatch job
    (``MEGATRON_LM``: the checkout holding pretrain_gpt.py)."""
    setup = ['MEGATRON_LM="${MEGATRON_LM:-$PWD}"',
             '[ -f "$MEGATRON_LM/pretrain_gpt.py" ] || { echo "set MEGATRON_LM to your Megatron-LM checkout '
             '(no pretrain_gpt.py in $MEGATRON_LM)" >&2; exit 2; }']
    command = torchrun_command(runs, ['"$MEGATRON_LM/pretrain_gpt.py"', *(shlex.quote(a) for a in args)])
    return launch_files("Megatron-LM", f"Megatron-LM {VALIDATED['megatron']} pretrain_gpt.py", plan, cluster, runs,
                        setup, command, ["MEGATRON_LM: your Megatron-LM checkout (default: the current directory)."])


# --------------------------------------------------------------------------- DeepSpeed


def to_deepspeed_config(plan: Plan, model: ModelSpec) -> dict[str, Any]:
    """A DeepSpeed config (``deepspeed.initialize(config=...)``)."""
    return _deepspeed(plan, model)[0]


def _deepspeed(plan: Plan, model: ModelSpec) -> tuple[dict[str, Any], list[str]]:
    u = _uniform(plan, model, "DeepSpeed")
    notes = list(u.notes)
    if u.cp > 1:
        raise HetplanError(f"DeepSpeed has no ring/all-gather context parallelism (its sequence_parallel_size is "
                           f"Ulysses, another scheme); this plan uses cp={u.cp}: export it for torchtitan or Megatron")
    if u.ep > 1:
        raise HetplanError(f"DeepSpeed's expert parallelism lives in the model code (deepspeed.moe.layer.MoE(ep_size="
                           f"{u.ep})), not in its config; export this ep={u.ep} plan for torchtitan or Megatron-LM")
    if plan.pp > 1 and u.zero >= 2:
        raise HetplanError(f"DeepSpeed pipeline parallelism supports ZeRO-0/1 only; this plan uses ZeRO-{u.zero}")
    if plan.pp > 1 and u.tp > 1:
        raise HetplanError("DeepSpeed's AutoTP (tensor_parallel.autotp_size) shards a model given whole to "
                           "deepspeed.initialize, not a PipelineModule, whose TP must come from Megatron-style layers; "
                           "this plan uses tp and pp — use Megatron-LM or the hetplan runtime")
    if u.sequence_parallel:
        raise HetplanError("DeepSpeed has no Megatron-style sequence parallelism with TP (its sequence_parallel_size "
                           "is Ulysses, another scheme); make the plan without --sequence-parallel")
    if _virtual(plan) > 1:
        raise HetplanError("DeepSpeed's pipeline engine runs one model chunk per stage (1F1B), not interleaved "
                           "1F1B; make the plan with --schedule 1f1b")
    cpu_checkpointing, offload_notes = _deepspeed_offload(plan, model, u.recompute)
    notes += offload_notes
    config: dict[str, Any] = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": u.per_replica,
        "gradient_accumulation_steps": plan.num_micro_batches,
        "zero_optimization": {"stage": u.zero},
    }
    if model.dtype_bytes == 2:
        config["fp16" if model.meta.get("precision") == "fp16" else "bf16"] = {"enabled": True}
    if u.recompute != "none":
        config["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False,
                                              "cpu_checkpointing": cpu_checkpointing}
        if u.recompute == "full":
            where = ("PipelineModule(..., activation_checkpoint_interval=1)" if plan.pp > 1 else
                     "deepspeed.checkpointing.checkpoint(block, hidden_states) around each transformer block")
            notes.append(f"DeepSpeed's activation_checkpointing block turns nothing on: full recompute needs {where}, "
                         "after deepspeed.checkpointing.configure(None, deepspeed_config=CONFIG)")
            if cpu_checkpointing:
                notes.append("cpu_checkpointing keeps each checkpointed block's input in host memory, as the plan's "
                             "offload does (SageMaker's scheme); it acts on those checkpoint calls only")
        else:
            notes.append("DeepSpeed's activation_checkpointing block turns nothing on and DeepSpeed has no selective "
                         "recompute: the model code must call deepspeed.checkpointing.checkpoint(core_attention, q, k, "
                         "v) around the attention core (softmax(QK^T)V) of each block, after "
                         "deepspeed.checkpointing.configure(None, deepspeed_config=CONFIG)")
    if u.tp > 1:
        config["tensor_parallel"] = {"autotp_size": u.tp}
        # deepspeed.initialize builds DeepSpeedConfig before AutoTP's groups: without an mpu (its AutoTP tutorial,
        # HF Trainer) it counts every rank as data-parallel (runtime/config.py:467-471, deepspeed/__init__.py:554)
        # and asserts train_batch_size == micro x grad-accum x that count (runtime/config.py:602). Left out, it
        # derives it from the two (runtime/config.py:631-635): right with an mpu or without.
        del config["train_batch_size"]
        notes.append(f"train_batch_size left out: DeepSpeed derives it from the micro-batch and gradient accumulation "
                     f"(with AutoTP and no mpu it counts the tp={u.tp} ranks of a group as data-parallel, "
                     f"{u.tp}x the plan's {plan.global_batch_size}); each TP group reads one micro-batch, so a step "
                     f"trains {plan.global_batch_size} samples")
    return config, notes


def deepspeed_partition(plan: Plan) -> list[int]:
    """The plan's stage boundaries over the model's layers: stage ``j`` runs
    layers ``[parts[j], parts[j+1])`` (DeepSpeed's ``PipelineModule.parts``)."""
    bounds = [0]
    for stage in plan.stages:
        bounds.append(bounds[-1] + stage.num_layers)
    return bounds


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """DeepSpeed's ``deepspeed.runtime.utils.partition_uniform`` (0.19.8):
    what ``PipelineModule(partition_method="uniform")`` splits."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    parts = [p * chunk for p in range(num_parts + 1)]
    for i in range(residual):
        parts[i + 1:] = [x + 1 for x in parts[i + 1:]]
    return parts


def deepspeed_pipeline_code(plan: Plan, model: ModelSpec) -> str:
    """Python for the plan's PipelineModule: its layers are the model's layers
    in order (hetplan's layer i is the PipelineModule's layer i). A split that
    ``partition_method="uniform"`` gives is written as that; any other split
    as a PipelineModule subclass that sets the plan's boundaries (DeepSpeed
    takes no explicit boundaries: ``_partition_layers`` of DeepSpeed 0.19.8)."""
    parts = deepspeed_partition(plan)
    names = [layer.name for layer in model.layers]
    interval = 1 if any(s.recompute == "full" for st in plan.stages for s in st.strategies) else 0
    head = [f'"""DeepSpeed {VALIDATED["deepspeed"]} pipeline for the hetplan plan {plan.describe()!r}',
            f"of model {model.name!r} (hetplan export --format deepspeed).",
            "",
            "LAYERS must list the model's layers in this order (LayerSpec or modules), one per hetplan layer:",
            *_layer_runs(model),
            "Stage j runs layers PARTS[j] to PARTS[j+1] - 1.", '"""', "",
            "from deepspeed.pipe import PipelineModule", "", f"PARTS = {parts}", ""]
    if interval:
        head += _checkpointable_code(model)
    if parts == partition_uniform(len(names), plan.pp):
        body = ["", "def build(layers, loss_fn=None, **kwargs):",
                f'    """partition_method="uniform" gives the plan\'s split {parts}."""',
                *(["    kwargs.setdefault(\"checkpointable_layers\", checkpointable_layers(layers))"] if interval else []),
                f"    return PipelineModule(layers=layers, num_stages={plan.pp}, partition_method=\"uniform\", "
                f"loss_fn=loss_fn, activation_checkpoint_interval={interval}, **kwargs)"]
    else:
        body = ["", "class PlanPipelineModule(PipelineModule):",
                '    """A PipelineModule split at the plan\'s boundaries, which no partition_method gives."""', "",
                "    def _partition_layers(self, method=\"uniform\"):",
                "        if len(self._layer_specs) != PARTS[-1] or self.num_stages != len(PARTS) - 1:",
                "            raise ValueError(f\"the plan splits {PARTS[-1]} layers into {len(PARTS) - 1} stages; \"",
                "                             f\"got {len(self._layer_specs)} layers and {self.num_stages} stages\")",
                "        self.parts = list(PARTS)",
                "        stage_id = self._topo.get_coord(self.global_rank).pipe",
                "        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])", "", "",
                "def build(layers, loss_fn=None, **kwargs):",
                *(["    kwargs.setdefault(\"checkpointable_layers\", checkpointable_layers(layers))"] if interval else []),
                f"    return PlanPipelineModule(layers=layers, num_stages={plan.pp}, loss_fn=loss_fn, "
                f"activation_checkpoint_interval={interval}, **kwargs)"]
    return "\n".join(head + body) + "\n"


def _checkpointable_code(model: ModelSpec) -> list[str]:
    """Code naming the transformer blocks' classes as the PipelineModule's
    ``checkpointable_layers``: by default DeepSpeed 0.19.8 checkpoints every
    layer with parameters (deepspeed/runtime/pipe/module.py:683-689), the
    embedding too, whose weights its reentrant checkpoint then leaves without
    a gradient (its comment at :673-675); the cost model checkpoints the blocks
    only (``cost.targets.UNWRAPPED_KINDS``)."""
    blocks = [i for i, layer in enumerate(model.layers) if layer.kind not in UNWRAPPED_KINDS]
    return ["# the transformer blocks: the layers activation checkpointing wraps (not the embedding or head)",
            f"BLOCKS = {_ranges_code(blocks)}", "", "",
            "def checkpointable_layers(layers):",
            '    """The class names of the blocks (a deepspeed.pipe.LayerSpec\'s typename, or a module\'s class)."""',
            '    return sorted({getattr(layers[i], "typename", type(layers[i])).__name__ for i in BLOCKS})', ""]


def _ranges_code(indices: list[int]) -> str:
    """``indices`` as Python: ``list(range(a, b))`` where they run without a gap."""
    if indices and indices == list(range(indices[0], indices[-1] + 1)):
        return f"list(range({indices[0]}, {indices[-1] + 1}))"
    return repr(indices)


def _layer_runs(model: ModelSpec) -> list[str]:
    """'  0: embed', '  1-32: layers.0 ... layers.31', '  33: head': runs of one kind."""
    lines, start = [], 0
    layers = model.layers
    for i in range(1, len(layers) + 1):
        if i == len(layers) or layers[i].kind != layers[start].kind:
            first, last = layers[start].name, layers[i - 1].name
            lines.append(f"  {start}: {first}" if i - 1 == start else f"  {start}-{i - 1}: {first} ... {last}")
            start = i
    return lines


def deepspeed_pipeline_note(plan: Plan) -> str:
    """DeepSpeed sets pipeline stages in code, not in its JSON config."""
    return (f"pipeline: build deepspeed.pipe.PipelineModule(layers, num_stages={plan.pp}) split at "
            f"{deepspeed_partition(plan)} (hetplan's stage boundaries): the .pipeline.py code does")


# --------------------------------------------------------------------------- entry points


def export_plan(plan: Plan, model: ModelSpec, fmt: str, torchtitan_version: str = DEFAULT_TORCHTITAN_VERSION) -> Any:
    """The export as Python values (see ``render``)."""
    if fmt == "modules":
        return stage_module_names(plan, model)
    if fmt == "torchtitan":
        return to_torchtitan(plan, model, torchtitan_version)
    if fmt == "megatron":
        return to_megatron_args(plan, model)
    if fmt == "deepspeed":
        return to_deepspeed_config(plan, model)
    raise HetplanError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")


def render(plan: Plan, model: ModelSpec, fmt: str, cluster: Any = None,
           torchtitan_version: str = DEFAULT_TORCHTITAN_VERSION) -> Export:
    """The export as the text the tool reads, with notes and extra files:
    the launch script and sbatch job (and DeepSpeed's hostfile) that put the
    plan's ranks on its GPUs (``export.launch``). ``cluster``: the plan's;
    loaded by name if not given."""
    if fmt == "modules":
        names = stage_module_names(plan, model)
        return Export(json.dumps(names, indent=2), names)
    if fmt not in FORMATS:
        raise HetplanError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if cluster is None:
        cluster = load_cluster(plan.cluster)
    if fmt == "torchtitan":
        data, notes = _torchtitan(plan, model, torchtitan_version)
        files = torchtitan_launch_files(plan, model, cluster, torchtitan_version)
        notes.append(launch_note(".toml" if torchtitan_version == "0.2" else ".py"))
        if torchtitan_version == "0.2":
            header = [f"torchtitan {VALIDATED['torchtitan']['0.2']} job config for the hetplan plan "
                      f"{plan.describe()!r} of model {model.name!r}", *(f"note: {n}" for n in notes)]
            return Export(to_toml(data, header), data, tuple(notes), files)
        return Export(torchtitan_python(plan, model, data, notes), data, tuple(notes), files)
    if fmt == "megatron":
        args, notes = _megatron(plan, model)
        runs = node_runs(plan, cluster, "Megatron-LM")
        commands = _megatron_node_commands(args, runs, cluster, "NODE0_ADDRESS", DEFAULT_MASTER_PORT)
        lines = []
        for node, command in commands:
            lines += [f"# node {node}", command]
        notes += [*_uneven_note(runs), launch_note()]
        return Export("\n".join(lines), commands, tuple(notes), megatron_launch_files(plan, args, runs, cluster))
    config, notes = _deepspeed(plan, model)
    runs = deepspeed_runs(plan, cluster)
    files = {".hostfile": deepspeed_hostfile(plan, cluster, runs),
             ".launch.sh": deepspeed_launch_script(plan, cluster, runs),
             ".sbatch": sbatch_script("DeepSpeed", plan, cluster, runs)}
    if plan.pp > 1:
        files[".pipeline.py"] = deepspeed_pipeline_code(plan, model)
        notes.append(deepspeed_pipeline_note(plan))
    notes.append(launch_note(".json", "; NAME.hostfile lists the nodes in rank order (replace the names with your "
                             "hosts'); set TRAIN_SCRIPT to your script"))
    return Export(json.dumps(config, indent=2), config, tuple(notes), files)


# How each tool turns on what a plan file's settings assumed when it was costed
# (the exports carry the parallel layout; these the user sets in the tool):
# setting -> (what the estimate assumed, {tool: how to turn it on}).
_SETTING_FLAGS = {
    "fp8": ("FP8 matmuls", {"megatron": "turn on --fp8-format hybrid (Transformer Engine)",
                            "torchtitan": "turn on Float8 training (torchao)",
                            "deepspeed": "turn on Transformer Engine FP8 layers"}),
    "tp_comm_overlap": ("TP communication overlapped with the matmuls",
                        {"megatron": "turn on --tp-comm-overlap", "torchtitan": "turn on async TP (with torch.compile)",
                         "deepspeed": "no equivalent: expect the TP communication exposed"}),
}


def settings_notes(settings: dict[str, Any], tool: str) -> list[str]:
    """One note per cost-model setting of a plan file that the export does not
    carry, saying how ``tool`` turns it on: an estimate assumed it, so a run
    without it would not match the estimate."""
    return [f"the plan was costed with {what}: {how[tool]}"
            for key, (what, how) in _SETTING_FLAGS.items() if settings.get(key) and tool in how]


def try_render(plan: Plan, model: ModelSpec, tool: str, cluster: Any = None,
               torchtitan_version: str = DEFAULT_TORCHTITAN_VERSION) -> tuple[Export | None, str]:
    """(the export, "") if ``tool`` can run the plan, else (None, why not: the
    one-line refusal ``hetplan export`` prints)."""
    if tool not in FORMATS:
        raise HetplanError(f"unknown export format {tool!r}; choose one of {', '.join(FORMATS)}")
    try:
        return render(plan, model, tool, cluster, torchtitan_version), ""
    except HetplanError as exc:
        return None, str(exc)


def exportable(plan: Plan, model: ModelSpec, tool: str, cluster: Any = None,
               torchtitan_version: str = DEFAULT_TORCHTITAN_VERSION) -> str:
    """``""`` if ``tool`` can run the plan, else why not (the one-line refusal
    ``hetplan export`` prints). It runs the export itself (``render``, which
    writes nothing), so what a tool accepts is decided in one place.
    ``cluster``: the plan's (Megatron-LM's ranks per node); loaded by name if
    not given."""
    return try_render(plan, model, tool, cluster, torchtitan_version)[1]
