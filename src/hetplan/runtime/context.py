"""The runtime's user API: ``init(plan)`` -> :class:`RuntimeContext`.

A training script, in the spirit of SageMaker's ``smp.init`` /
``smp.DistributedModel`` / ``@smp.step``::

    import hetplan.runtime as hr

    ctx = hr.init("plan.json")                    # process groups + mesh from the plan
    model = ctx.parallelize(build_model)          # this rank's part: TP -> AC -> FSDP2
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step, (x, y) in enumerate(batches):       # the global batch, same on every rank
        loss = ctx.train_step(model, (x, y), loss_fn)   # all micro-batches, forward+backward
        ctx.clip_grad_norm_(model, 1.0)
        opt.step(); opt.zero_grad()
        if step % 100 == 0:
            ctx.save(f"ckpt/step_{step}", model, opt, step=step)
    ctx.close()

The user keeps the optimizer, learning-rate schedule, clipping and loop; the
context knows the plan: which samples of a batch this rank's replica takes, how
to scale each micro-batch's loss so that gradients equal the global-batch mean
(``b_r * dp / B``, also for uneven splits), the pipeline schedule, and the
tied-weight gradient sync between the first and last stage.
"""

from __future__ import annotations

import copy
import datetime
import functools
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hetplan.errors import HetplanError
from hetplan.plan import Plan
from hetplan.runtime import clip_guard
from hetplan.runtime import dropout as rng
from hetplan.runtime import heartbeat as hb
from hetplan.runtime import microbatch
from hetplan.runtime import precision as mp
from hetplan.runtime import parallelize as par
from hetplan.runtime.chain import check_chain, example_call, example_inputs as known_example_inputs
from hetplan.runtime.layout import PlanLayout, RankPosition
from hetplan.runtime.support import check_runs, support_of

# Collective / rendezvous timeout (init(timeout_s=...), `--timeout`, env HETPLAN_PG_TIMEOUT_S). 5 minutes:
# longer than the legitimate waits of a healthy run -- other ranks waiting while one compiles its first
# step (torch.compile) or loads a checkpoint -- and short enough that a wedged job is noticed within
# minutes, not after 30 (torch's gloo default, and this constant's old value). Raise it for runs whose
# first step or checkpoint load takes longer. The heartbeat (hetplan.runtime.heartbeat) names a stopped
# rank after 0.8 of it.
DEFAULT_TIMEOUT_S = 300.0

# FSDP2 warns when a wrapped module returns a view (in-place ops on it would skip a hook);
# the runtime never modifies outputs in place, and a model's logits are often a view.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def _load_cluster(plan: Plan) -> Any:
    """For a bare Plan object (no file): the named cluster, if this machine knows it."""
    from hetplan.cluster import load_cluster

    try:
        return load_cluster(plan.cluster)
    except (HetplanError, OSError):
        return None


@dataclass
class _ModelInfo:
    parts: list[nn.Module]
    stages: list[Any]
    sync_modules: list[tuple[nn.Module, bool]]
    tied_pairs: list[tuple[str, str]]
    schedule: Any = None
    loss_fn: Any = None
    loss_weight: float = 1.0  # this rank's loss scale (uneven data split x fp16 loss scaling)
    batch_shapes: tuple[Any, ...] | None = None
    aliases: dict[str, str] = field(default_factory=dict)
    chain_probe: nn.Module | None = None  # a meta copy whose forward the first train_step checks (pp > 1)
    step_inputs: dict[str, Any] = field(default_factory=dict)  # this train_step's keyword inputs (local rows)
    seed: int = 0  # parallelize's seed: initial values and dropout masks (hetplan.runtime.dropout)
    expert_fqns: list[str] = field(default_factory=list)  # expert-parallel experts (synced by the context)


class RuntimeContext:
    """One process's view of a Plan: process groups, mesh, and training helpers.

    Attributes:
        plan, spec, layout: the plan, the ModelSpec, and the rank layout.
        position: this rank's stage, dp/tp index, and share of each micro-batch.
        rank, world_size, device: as in torch.distributed.
        mesh: the ``("pp", "dp", "tp")`` DeviceMesh (None in a one-process run).
        notes: what the runtime did differently from the plan's letter, and why.
        precision: "fp32", "bf16" or "fp16" (hetplan.runtime.precision);
            ``loss_scaler`` (fp16) counts skipped steps.
        last_outputs: outputs of the last step's micro-batches on last-stage ranks.
        step: the training step dropout masks are drawn for (hetplan.runtime.dropout);
            ``train_step`` counts it up; set it when resuming from a checkpoint.
    """

    def __init__(self, plan: Plan, spec: Any, layout: PlanLayout, position: RankPosition, device: torch.device,
                 mesh: Any, tie_groups: dict[tuple[int, int, int, int], Any], notes: list[str],
                 owns_process_group: bool, precision: str = "fp32") -> None:
        self.plan = plan
        self.spec = spec
        self.layout = layout
        self.position = position
        self.rank = position.rank
        self.world_size = layout.world_size
        self.device = device
        self.mesh = mesh
        self.notes = notes
        self.last_outputs: Any = None
        self.stage_dp = layout.stage_dp(position.pp_index)  # this rank's stage
        self.stage_tp = layout.stage_tp(position.pp_index)
        self._tie_groups = tie_groups
        self._owns_pg = owns_process_group
        self._models: dict[int, _ModelInfo] = {}
        self._guarded_params: list[nn.Parameter] = []  # see hetplan.runtime.clip_guard
        self.precision = precision
        self.loss_scaler = mp.LossScaler() if precision == "fp16" else None
        self._heartbeat: Any = None  # set by init for world > 1; stopped by close()
        self._dp_cp_mesh: Any = None  # dense-gradient mesh under context parallelism (dp_mesh)
        self.ep_mesh: Any = None  # ("pp", "edp", "ep", "tp") mesh of an expert-parallel plan (init)
        self.step = 0
        self._offload_pool: Any = None  # hetplan.runtime.offload.HostPool, made when a layer offloads
        self._zero1_params: set[int] = set()  # ids of parameters of ZeRO-1 layers (dp > 1)
        self._zero1_groups: dict[int, Any] = {}  # their groups where not dp_mesh's (expert-parallel experts)

    # --- groups ------------------------------------------------------------------
    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    @property
    def is_first_stage(self) -> bool:
        return 0 in self.position.chunks

    @property
    def is_last_stage(self) -> bool:
        return self.layout.num_chunks - 1 in self.position.chunks

    def _sub(self, name: str) -> Any:
        return self.mesh[name] if self.mesh is not None else None

    @property
    def dp_mesh(self) -> Any:
        """The mesh dense gradients are averaged over: the dp replicas, and with
        context parallelism also the cp ranks (``dp * cp``)."""
        if self.mesh is not None and self.layout.cp > 1:
            if self._dp_cp_mesh is None:
                self._dp_cp_mesh = self.mesh["dp", "cp"]._flatten("dp_cp")
            return self._dp_cp_mesh
        return self._sub("dp")

    @property
    def cp_mesh(self) -> Any:
        """The CP ranks of this rank's replica and TP rank (None without context parallelism)."""
        return self.mesh["cp"] if self.mesh is not None and self.layout.cp > 1 else None

    @property
    def tp_mesh(self) -> Any:
        return self._sub("tp")

    @property
    def model_build(self) -> Any:
        """How the plan's own model is built, trained and fed (a ``ModelBuild``,
        hetplan.runtime.models): ``build``, ``loss``, and for a ``pkg.mod:build``
        plan ``batch(batch_size, step, seed)``, the synthetic data of ``hetplan train``."""
        if getattr(self, "_model_build", None) is None:
            from hetplan.runtime.build import model_build

            self._model_build = model_build(self.spec)
        return self._model_build

    @property
    def pp_group(self) -> Any:
        """The pipeline group of this rank (None for heterogeneous plans, which have none)."""
        if self.mesh is None or self.layout.heterogeneous:
            return None
        return self.mesh["pp"].get_group()

    # --- model -----------------------------------------------------------------------
    def parallelize(self, build_model: Callable[[], nn.Module] | None = None, *, seed: int = 0,
                    meta_init: bool | None = None, init_fn: par.InitFn | None = None,
                    example_inputs: Sequence[Any] | None = None, compile: bool = False) -> nn.Module:
        """Build this rank's part of the model and parallelise it as the plan says.

        Without ``build_model``, the plan's own model (``ctx.model_build``: the
        built-in model of a preset, the HF class of a config, or the
        ``pkg.mod:build`` function a plan records, checked against the plan's).

        ``build_model()`` returns the full model (built on the meta device here,
        so it costs no memory) whose module names include the ModelSpec's layer
        names. Order per part: pipeline split -> TP -> checkpointing -> FSDP2 /
        replicate -> materialise on this rank's device -> plan-independent
        initial values (see hetplan.runtime.parallelize). ``init_fn(name, tensor,
        generator)`` overrides the model's ``init_parameter``; ``meta_init=False``
        builds the real model on CPU instead (for models with buffers, at the
        cost of the full model's memory on every rank).

        Returns the user's model itself when the plan has one pipeline stage,
        else a :class:`~hetplan.runtime.parallelize.PipelinePart` holding this
        rank's layers under their original names; use ``train_step`` to run it.

        With more than one stage the layers run chained, so the model's
        ``forward`` must be exactly that chain (hetplan.runtime.chain): it is
        checked on a meta copy with ``example_inputs`` (one micro-batch's
        inputs: the first passed positionally, the rest by the names of
        ``forward``'s parameters, as ``train_step(..., inputs=)`` passes them)
        here, or else with the first ``train_step``'s micro-batch, before any
        pipeline communication.

        ``compile=True`` compiles each layer with ``torch.compile`` (after TP
        and checkpointing, before FSDP; see ``parallelize.apply_compile``).
        Compiling the returned model yourself works with one pipeline stage
        (``train_step`` accepts the compiled wrapper), not with several.
        """
        if build_model is None:
            how = self.model_build
            build_model, meta_init = how.build, how.meta_init if meta_init is None else meta_init
            example_inputs = how.example_inputs if example_inputs is None else example_inputs
        meta_init = True if meta_init is None else meta_init
        torch.manual_seed(seed)
        names = list(self.layout.layer_names)
        if meta_init:
            with torch.device("meta"):
                full = build_model()
        else:
            full = build_model()
        if not isinstance(full, nn.Module):
            raise HetplanError("build_model() must return a torch.nn.Module")
        probe = None
        staged = self._staged_forward(full, names) if self.layout.num_chunks > 1 else None
        if self.layout.num_chunks > 1 and staged is None:
            with torch.device("meta"):
                probe = build_model()
            _check_chain_early(probe, names, self.spec, example_inputs)
            # the first train_step checks again with its micro-batch and keyword inputs (their routes)
        self._preflight(full)
        init = init_fn or getattr(full, "init_parameter", None)
        values = par.InitialValues(copy.deepcopy(full), seed, init) if meta_init else None
        notes: list[str] = rng.prepare(full)  # names dropout sites; nn.Dropout made plan-independent
        if self.layout.cp > 1 and self.mesh is not None:
            from hetplan.runtime.cp import ContextShard

            full.set_context_parallel(ContextShard(self.cp_mesh.get_group(), self.position.cp_index, self.layout.cp))
        local_chunks = list(self.position.chunks)
        if self.layout.num_chunks == 1:
            local: nn.Module = full
            parts = [full]
        else:
            local_names = [n for c in local_chunks for n in self.layout.chunk_names(c)]
            modules = _layer_modules(self.spec)
            local = par.PipelinePart(full, local_names, modules, staged)
            parts = [par.PipelinePart(local, self.layout.chunk_names(c), modules, staged) for c in local_chunks]
            if len(parts) == 1:
                parts = [local]
        aliases = par.param_aliases(full)
        tied = _one_pair_per_stage_pair(par.tied_layer_pairs(full, names), self.layout) if self.layout.pp > 1 else []
        if not meta_init:
            local.to(self.device)
        recompute, zero = self._layer_strategies()
        offloaded = self._offloaded_layers()
        sync_modules: list[tuple[nn.Module, bool]] = []
        experts: set[nn.Parameter] = set()
        for part, chunk in zip(parts, local_chunks):
            chunk_names = self.layout.chunk_names(chunk)
            if self.stage_tp > 1:
                par.apply_tp(part, chunk_names, self.tp_mesh, self.layout.sequence_parallel, notes,
                             model_tp_plan(full))
                rng.set_tp(part, self.position.tp_index, self.stage_tp, self.layout.sequence_parallel)
            if self.layout.ep > 1 and self.ep_mesh is not None:
                experts |= self._apply_ep(part, chunk_names, zero)
            elif self.stage_tp > 1:  # expert TP alone: the experts are TP-sharded weights like the dense ones
                par.apply_ep(part, chunk_names, self.tp_mesh, None, self.tp_mesh.get_group())
            par.apply_recompute(part, {n: recompute[n] for n in chunk_names}, notes,
                                {layer.name for layer in self.spec.layers if layer.attention_flops > 0})
            if any(n in offloaded for n in chunk_names):
                from hetplan.runtime.offload import apply_offload

                apply_offload(part, [n for n in chunk_names if n in offloaded], self.offload_pool)
            if compile:
                par.apply_compile(part, chunk_names)
            if self.layout.ep > 1 and self._expert_zero_sharded():
                sync_modules += par.apply_expert_zero(part, chunk_names, zero, self.ep_mesh["edp"],
                                                      self.stage_dp * self.layout.cp)
            if self.stage_dp * self.layout.cp > 1:
                sync_modules += par.apply_dp(part, {n: zero[n] for n in chunk_names}, self.dp_mesh, notes,
                                             ignored=experts or None)
        if self.stage_dp * self.layout.cp > 1:  # experts: over the ranks holding the same ones, if any
            zero1 = {id(p): p for c in local_chunks for n in self.layout.chunk_names(c)
                     if zero[n] == 1 for p in local.get_submodule(n).parameters()}
            self._zero1_params |= {i for i, p in zero1.items() if p not in experts or self._expert_zero_sharded()}
            self._zero1_groups.update({i: self.ep_mesh["edp"].get_group() for i, p in zero1.items()
                                       if p in experts and self._expert_zero_sharded()})
        if self.stage_dp * self.layout.cp == 1 and any(zero[n] for c in local_chunks for n in self.layout.chunk_names(c)):
            notes.append("ZeRO settings ignored where dp=1: nothing to shard across")
        if values is not None:
            for part in parts:
                par.materialize(part, self.device, values)
        stages: list[Any] = []
        if self.layout.heterogeneous:
            from hetplan.runtime.hetero import HeteroPipeline

            stages.append(HeteroPipeline(self.layout, self.position, parts[0], self.device, sync_modules))
        elif self.layout.pp > 1:
            from torch.distributed.pipelining import PipelineStage

            for part, chunk in zip(parts, local_chunks):
                stages.append(PipelineStage(part, chunk, self.layout.num_chunks, self.device, group=self.pp_group))
                microbatch.wrap_stage(stages[-1])  # each micro-batch's forward: own autocast region, own dropout rows
        for note in notes:
            if note not in self.notes:
                self.notes.append(note)
        self._models[id(local)] = _ModelInfo(parts, stages, sync_modules, tied, aliases=aliases, chain_probe=probe,
                                             seed=seed,
                                             expert_fqns=[n for n, p in local.named_parameters() if p in experts])
        why = self._why_torch_clipping_is_wrong()
        if why:
            self._guarded_params += list(local.parameters())
            clip_guard.guard(self._guarded_params, why)
        return local

    def _expert_zero_sharded(self) -> bool:
        """ZeRO shards expert-parallel experts over their expert-data-parallel
        ranks; there are none to shard over when ``ep = dp * cp``."""
        return self.ep_mesh is not None and self.ep_mesh["edp"].size() > 1

    def _apply_ep(self, part: nn.Module, chunk_names: Sequence[str], zero: dict[str, int]) -> set[nn.Parameter]:
        """Experts as DTensors on ``(edp, ep[, tp])`` (expert TP = the stage's tp,
        Megatron-Core's default), synced by the context; those of ZeRO-2/3
        layers on ``(ep[, tp])``, sharded over ``edp`` by FSDP later
        (``parallelize.apply_expert_zero``). Returns the context-synced ones."""
        etp = self.stage_tp > 1
        tp_group = self.ep_mesh["tp"].get_group() if etp else None
        synced: set[nn.Parameter] = set()
        for name in chunk_names:
            by_fsdp = zero[name] >= 2 and self._expert_zero_sharded()
            dims = ("ep", "tp") if etp else ("ep",)
            mesh = self.ep_mesh[dims if by_fsdp else ("edp", *dims)]
            params = par.apply_ep(part, [name], mesh, self.ep_mesh["ep"].get_group(), tp_group)
            if not by_fsdp:
                synced |= params
        return synced

    def _staged_forward(self, full: nn.Module, names: list[str]) -> Any:
        """An HF model's forward split at layer boundaries (hetplan.runtime.hf_stages),
        checked against the model's own forward on a padded batch before anything is
        split, on every rank alike; None for other models (they must be chains)."""
        from hetplan.runtime import hf_stages

        staged = hf_stages.staged_forward(full, names)
        if staged is None:
            return None
        if any(p.device.type == "meta" for p in full.parameters()):
            raise HetplanError(f"pipelining {type(full).__name__} checks its staged forward on the real model; "
                               "use ctx.parallelize(build_model, meta_init=False) (HF models need it for their "
                               "buffers anyway)")
        par.check_layer_names(full, names, getattr(self.spec, "name", ""))
        ids, inputs = hf_stages.example_model_inputs(full, self.spec.seq_len, self.spec.vocab_size)
        hf_stages.check_staged_forward(full, staged, names, ids, inputs)
        return staged

    def _why_torch_clipping_is_wrong(self) -> str:
        if self.layout.num_chunks > 1:
            return "each pipeline stage would be clipped by the norm of its own gradients"
        if self.layout.max_tp > 1:
            return "it cannot take one norm over tensor-parallel shards"
        if self.layout.ep > 1:
            return "it cannot take one norm over expert-parallel shards"
        return ""

    def optimizer(self, model: nn.Module, cls: Callable[..., torch.optim.Optimizer], **kwargs: Any
                  ) -> torch.optim.Optimizer:
        """``cls(model.parameters(), **kwargs)``, with the optimizer states of the
        plan's ZeRO-1 layers sharded over their data-parallel group
        (``hetplan.runtime.zero1``). A plain ``cls(model.parameters())`` also
        trains a ZeRO-1 plan correctly, but keeps every state on every rank."""
        params = list(self._unwrap(model).parameters())
        zero1 = {id(p) for p in params} & self._zero1_params
        if not zero1:
            return cls(params, **kwargs)
        from hetplan.runtime.zero1 import Zero1Optimizer

        return Zero1Optimizer(params, zero1, self.dp_mesh.get_group(), cls, groups=self._zero1_groups, **kwargs)

    def _offloaded_layers(self) -> set[str]:
        """Names of the layers whose saved activations go to host memory (``hetplan.runtime.offload``)."""
        return {self.layout.layer_names[index] for stage in self.plan.stages
                for index, strategy in zip(stage.layers, stage.strategies) if strategy.offload}

    @property
    def offload_pool(self) -> Any:
        """The ``HostPool`` holding this rank's offloaded activations (made on first use)."""
        if self._offload_pool is None:
            from hetplan.runtime.offload import HostPool

            self._offload_pool = HostPool(self.device)
        return self._offload_pool

    def _layer_strategies(self) -> tuple[dict[str, str], dict[str, int]]:
        recompute: dict[str, str] = {}
        zero: dict[str, int] = {}
        for stage in self.plan.stages:
            for index, strategy in zip(stage.layers, stage.strategies):
                name = self.layout.layer_names[index]
                recompute[name] = strategy.recompute
                zero[name] = strategy.zero
        if self.layout.pp > 1:  # a weight tied across stages needs the same sharding on both sides
            for group in _tied_groups(self.spec):
                z = max(zero[n] for n in group)
                for n in group:
                    zero[n] = z
        return recompute, zero

    def _preflight(self, full: nn.Module) -> None:
        preflight(self.layout, self.spec, full, chain=False)  # parallelize checks the chain on its meta probe

    # --- batches ----------------------------------------------------------------------
    def local_batch(self, tensor: torch.Tensor) -> torch.Tensor:
        """This replica's samples of a global batch (micro-batch after micro-batch)."""
        plan = self.plan
        local = self.position.samples_per_micro_batch * plan.num_micro_batches
        n = tensor.size(0)
        if n == plan.global_batch_size and (n != local or self.stage_dp == 1):
            if self.stage_dp == 1:
                return tensor
            index = torch.tensor(self.layout.local_sample_indices(self.position.dp_index, self.position.pp_index),
                                 device=tensor.device)
            return tensor.index_select(0, index)
        if n == local:
            return tensor
        raise HetplanError(
            f"a batch of {n} samples fits neither the plan's global batch ({plan.global_batch_size}) nor this "
            f"replica's share ({local}); pass the global batch or ctx.local_batch(...) of it"
        )

    # --- training ---------------------------------------------------------------------
    def train_step(self, model: nn.Module, batch: Sequence[torch.Tensor], loss_fn: Callable[..., torch.Tensor],
                   return_outputs: bool = True, *, inputs: dict[str, torch.Tensor] | None = None) -> float:
        """Forward and backward over all micro-batches of one step; returns the
        global-batch mean loss on every rank. Gradients (synchronised across
        data-parallel replicas and tied copies) are left in ``.grad`` for the
        user's optimizer. ``loss_fn(output, target)`` must return the *mean*
        loss of a micro-batch. With ``return_outputs`` the model outputs of the
        step are kept in ``ctx.last_outputs`` on last-stage ranks. With context
        parallelism this rank keeps its chunks of every sequence (dim 1) of
        ``batch`` (hetplan.runtime.cp); pass whole sequences.

        ``inputs``: the model's keyword inputs for this batch (``attention_mask``,
        ``token_type_ids``, ...), tensors with the batch first like ``batch[0]``:
        each micro-batch's forward gets its rows, ``model(x_mb, **inputs_mb)``,
        and under pipelining every stage gets them (an HF model's stages rebuild
        their masks from them; a layer of your own chain model gets those your
        forward passes to it unchanged)."""
        info = self._model_info(model)
        if len(batch) != 2:
            raise HetplanError("batch must be (inputs, targets)")
        x = self.local_sequence(self.local_batch(batch[0]).to(self.device))
        y = self.local_sequence(self.local_batch(batch[1]).to(self.device))
        info.step_inputs = self._local_inputs(inputs, batch[0])
        _check_staged_inputs(info.parts[0], info.step_inputs)
        shapes = (tuple(x.shape), tuple(y.shape))
        if info.batch_shapes is None:
            info.batch_shapes = shapes
        elif shapes != info.batch_shapes and self.layout.pp > 1:
            raise HetplanError(
                f"batch shapes changed from {info.batch_shapes} to {shapes}: pipelined training keeps the shapes "
                "of the first step (torch pipelining would hang); drop the last partial batch (drop_last=True)"
            )
        if info.chain_probe is not None:  # every rank alike, before the pipeline's first message
            b = max(1, self.position.samples_per_micro_batch)
            routes = check_chain(info.chain_probe, self.layout.layer_names, (x[:b],),
                                 {k: v[:b] for k, v in info.step_inputs.items()})
            for part in {id(p): p for p in [model, *info.parts]}.values():
                if isinstance(part, par.PipelinePart):
                    part.kwarg_routes = routes
            info.chain_probe = None
        scale = self.layout.loss_scale(self.position.dp_index) if self.is_last_stage else 1.0
        total = torch.zeros((), device=self.device, dtype=torch.float32)
        fp16_scale = self.loss_scaler.scale if self.loss_scaler else 1.0
        earlier = self._take_grads(model, info, every=self.loss_scaler is not None)
        samples = self.layout.local_sample_indices(self.position.dp_index, self.position.pp_index)
        with microbatch.step(self.device, self.precision), \
                rng.step_scope(info.seed, self.step, samples, self.position.samples_per_micro_batch):
            self._forward_backward(model, info, x, y, loss_fn, scale * fp16_scale, total, return_outputs)
        self.step += 1
        if self.layout.pp > 1:
            self._sync_tied_grads(model, info)
        if info.expert_fqns:
            self._sync_expert_grads(model, info)
        if self.loss_scaler is not None and not self._unscale(model):
            earlier = {}  # overflow: the whole step is skipped (every gradient None)
        self._restore_grads(model, earlier)
        return self._global_loss(total / fp16_scale)

    def local_sequence(self, tensor: torch.Tensor) -> torch.Tensor:
        """This CP rank's tokens of whole sequences (dim 1; the tensor itself without CP)."""
        if self.layout.cp == 1 or self.mesh is None:
            return tensor
        from hetplan.runtime.cp import ContextShard, check_sequence

        check_sequence(tensor.size(1), self.layout.cp)
        return ContextShard(None, self.position.cp_index, self.layout.cp).split(tensor, 1)

    def _sync_expert_grads(self, model: nn.Module, info: _ModelInfo) -> None:
        """Expert gradients: sum over the ranks holding the same experts (the
        expert-data-parallel group) and divide by ``dp * cp``, as FSDP averages
        the dense gradients over ``dp * cp`` (hetplan.runtime.ep)."""
        edp_group = self.ep_mesh["edp"].get_group() if self.ep_mesh["edp"].size() > 1 else None
        for fqn in info.expert_fqns:
            p = model.get_parameter(fqn)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            if edp_group is not None:
                dist.all_reduce(g, group=edp_group)
            g.div_(self.stage_dp * self.layout.cp)

    def _local_inputs(self, inputs: dict[str, torch.Tensor] | None, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """This replica's rows of each keyword input, on this rank's device."""
        if not inputs:
            return {}
        out = {}
        for name, value in inputs.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.size(0) != x.size(0):
                raise HetplanError(f"keyword input {name!r} must be a tensor with the batch first "
                                   f"({x.size(0)} rows, as the batch's inputs), sliced per micro-batch")
            out[name] = self.local_batch(value).to(self.device)
        return out

    def _unwrap(self, model: nn.Module) -> nn.Module:
        """The parallelised model behind a ``torch.compile`` wrapper of it (names without ``_orig_mod.``)."""
        inner = getattr(model, "_orig_mod", None)
        return inner if inner is not None and id(inner) in self._models else model

    def _model_info(self, model: nn.Module) -> _ModelInfo:
        """The parallelised model's record; also for ``torch.compile(model)`` of it
        (one stage: the compiled wrapper runs the forward)."""
        info = self._models.get(id(model))
        if info is not None:
            return info
        inner = getattr(model, "_orig_mod", None)
        info = self._models.get(id(inner)) if inner is not None else None
        if info is None:
            raise HetplanError("train_step needs the model returned by ctx.parallelize")
        if self.layout.num_chunks > 1:
            raise HetplanError(
                "a pipelined model runs each stage's layers, never the compiled whole model; compile each layer "
                "with ctx.parallelize(build_model, compile=True) instead of torch.compile(model)"
            )
        return info

    def _forward_backward(self, model: nn.Module, info: _ModelInfo, x: torch.Tensor, y: torch.Tensor,
                          loss_fn: Callable[..., torch.Tensor], scale: float, total: torch.Tensor,
                          return_outputs: bool) -> None:
        """All micro-batches of the step; their scaled losses are added to ``total``."""
        if self.layout.pp == 1:
            m = self.plan.num_micro_batches
            b = self.position.samples_per_micro_batch
            outputs = []
            for k in range(m):
                last = k == m - 1
                par.set_accumulating(info.sync_modules, last)
                kw = {name: v[k * b:(k + 1) * b] for name, v in info.step_inputs.items()}
                with microbatch.forward(k):  # its own autocast region (microbatch module doc)
                    out = model(x[k * b:(k + 1) * b], **kw)
                    loss = loss_fn(out, y[k * b:(k + 1) * b])
                if scale != 1.0:
                    loss = loss * scale
                loss.backward()
                total += loss.detach().float()
                if return_outputs:
                    outputs.append(out.detach() if isinstance(out, torch.Tensor) else out)
            self.last_outputs = outputs if return_outputs else None
        else:
            losses = self._pipeline_step(info, x, y, loss_fn, scale, return_outputs)
            if losses:
                total += torch.stack([t.detach().float() for t in losses]).sum()

    def _unscale(self, model: nn.Module) -> bool:
        """fp16: unscale this call's gradients; on overflow anywhere drop them all."""
        assert self.loss_scaler is not None
        params = [p for p in model.parameters() if p.grad is not None]
        if self.loss_scaler.unscale([p.grad for p in params], self.device):
            return True
        for p in model.parameters():
            p.grad = None
        note = "fp16 loss scaling: a step overflowed and was skipped (gradients left None)"
        if note not in self.notes:
            self.notes.append(note)
        return False

    def _tied_fqns(self, info: _ModelInfo) -> list[str]:
        """This rank's copies of weights tied across stages."""
        names = self.layout.layer_names
        out = []
        for canon, alias in info.tied_pairs:
            for fqn in (canon, alias):
                if self.layout.pp_index_of_layer(par.owner_layer(fqn, names)) == self.position.pp_index:
                    out.append(fqn)
        return out

    def _take_grads(self, model: nn.Module, info: _ModelInfo, every: bool) -> dict[str, torch.Tensor]:
        """Set aside gradients held from earlier ``train_step`` calls
        (accumulation), to add back at the end: those of tied copies, whose
        sync adds the two copies' gradients and must add only this call's (or an
        earlier call's would count twice); with ``every`` (fp16) all of them,
        since only this call's are loss-scaled."""
        earlier = {}
        names = [n for n, _ in model.named_parameters()] if every else self._tied_fqns(info) + info.expert_fqns
        for fqn in names:
            p = model.get_parameter(fqn)
            if p.grad is not None:
                earlier[fqn] = p.grad
                p.grad = None
        return earlier

    def _restore_grads(self, model: nn.Module, earlier: dict[str, torch.Tensor]) -> None:
        for fqn, grad in earlier.items():
            p = model.get_parameter(fqn)
            if p.grad is None:
                p.grad = grad
            else:
                if getattr(grad, "placements", None) != getattr(p.grad, "placements", None):
                    grad = grad.redistribute(p.grad.device_mesh, p.grad.placements)
                p.grad.add_(grad)

    def _pipeline_step(self, info: _ModelInfo, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable[..., Any],
                       scale: float, return_outputs: bool) -> list[torch.Tensor]:
        from torch.distributed import pipelining as pl

        info.loss_fn, info.loss_weight = loss_fn, scale
        if self.layout.heterogeneous:
            staged = getattr(info.parts[-1], "staged", None)
            if staged is not None:  # an HF model's loss sees its output class
                loss_fn = functools.partial(_loss_of_output, loss_fn, staged.wrap_output)
            losses, outputs = info.stages[0].step(x if self.is_first_stage else None,
                                                  y if self.is_last_stage else None, loss_fn, scale,
                                                  self.plan.num_micro_batches, self.layout.schedule,
                                                  info.step_inputs)
            self.last_outputs = outputs if self.is_last_stage and return_outputs else None
            return losses
        if info.schedule is None:
            staged = getattr(info.parts[-1], "staged", None)  # an HF model's loss sees its output class

            @microbatch.loss
            def scaled_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
                if staged is not None:
                    output = staged.wrap_output(output)
                return info.loss_fn(output, target) * info.loss_weight

            m = self.plan.num_micro_batches
            kind = self.layout.schedule
            if kind == "interleaved-1f1b":
                info.schedule = pl.ScheduleInterleaved1F1B(info.stages, m, loss_fn=scaled_loss, scale_grads=False)
            elif kind == "1f1b":
                info.schedule = pl.Schedule1F1B(info.stages[0], m, loss_fn=scaled_loss, scale_grads=False)
            else:
                info.schedule = pl.ScheduleGPipe(info.stages[0], m, loss_fn=scaled_loss, scale_grads=False)
        losses: list[torch.Tensor] = []
        args = (x,) if self.is_first_stage else ()
        target = y if self.is_last_stage else None
        out = info.schedule.step(*args, target=target, losses=losses if self.is_last_stage else None,
                                 return_outputs=return_outputs, **info.step_inputs)
        self.last_outputs = out if return_outputs else None
        return losses

    def _sync_tied_grads(self, model: nn.Module, info: _ModelInfo) -> None:
        """Copies of a weight tied across stages (embedding / LM head) get the
        sum of both gradients, as the single tied tensor would (Megatron's
        embedding group); equal values and equal updates keep them in sync."""
        if not info.tied_pairs:
            return
        from torch.distributed.tensor import DTensor

        if self.layout.heterogeneous:
            self._sync_tied_grads_full(model, info)
            return

        pos = self.position
        for canon, alias in info.tied_pairs:
            a = self.layout.pp_index_of_layer(par.owner_layer(canon, self.layout.layer_names))
            b = self.layout.pp_index_of_layer(par.owner_layer(alias, self.layout.layer_names))
            if a == b or pos.pp_index not in (a, b):
                continue
            fqn = canon if pos.pp_index == a else alias
            p = model.get_parameter(fqn)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                # e.g. a vocabulary-parallel embedding's gradient comes back replicated
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            row = pos.dp_index * self.layout.cp + pos.cp_index
            dist.all_reduce(g, group=self._tie_groups[(min(a, b), max(a, b), row, pos.tp_index)])

    def _sync_tied_grads_full(self, model: nn.Module, info: _ModelInfo) -> None:
        """Tied copies on stages of different (dp, tp) are sharded differently:
        sum the full gradients over both stages' ranks (each rank weighs its
        stage's copy by 1/ranks of the stage), then keep this rank's shard."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        pos = self.position
        for canon, alias in info.tied_pairs:
            a = self.layout.pp_index_of_layer(par.owner_layer(canon, self.layout.layer_names))
            b = self.layout.pp_index_of_layer(par.owner_layer(alias, self.layout.layer_names))
            if a == b or pos.pp_index not in (a, b):
                continue
            p = model.get_parameter(canon if pos.pp_index == a else alias)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
            full = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
            full /= len(self.layout.stage_ranks(pos.pp_index))
            dist.all_reduce(full, group=self._tie_groups[(min(a, b), max(a, b), -1, -1)])
            if isinstance(p.grad, DTensor):
                local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
                p.grad.to_local().copy_(local)
            else:
                p.grad.copy_(full)

    def _global_loss(self, total: torch.Tensor) -> float:
        if not self.distributed:
            return float(total)
        contributes = self.is_last_stage and self.position.tp_index == 0
        if not contributes:
            total = torch.zeros_like(total)
        dist.all_reduce(total)
        return float(total) / (self.layout.stage_dp(self.layout.pp - 1) * self.layout.cp)

    # --- gradient clipping ------------------------------------------------------------
    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> float:
        """Clip gradients by their global norm over the whole model (all stages,
        shards and replicas; a tied weight counted once). Returns the norm."""
        from torch.distributed.tensor import DTensor

        model = self._unwrap(model)
        info = self._models.get(id(model))
        aliases = info.aliases if info else {}
        grads = []
        # gradients laid out alike (one mesh, one placement) share one norm
        # and so one collective, not one per parameter (torchtitan's way)
        alike: dict[object, list[torch.Tensor]] = {}
        for fqn, p in model.named_parameters():
            if p.grad is None:
                continue
            grads.append(p.grad)
            if aliases.get(fqn, fqn) != fqn:
                continue  # the alias copy of a weight tied across stages
            g = p.grad
            key = (id(g.device_mesh), tuple(g.placements)) if isinstance(g, DTensor) else None
            alike.setdefault(key, []).append(g)
        sq = torch.zeros((), device=self.device, dtype=torch.float32)
        for group in alike.values():
            n = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in group]))
            if isinstance(n, DTensor):
                n = n.full_tensor()
            sq += n * n
        if self.distributed and self.layout.pp > 1:
            # every rank of a stage holds the same sum (norms of DTensors are global): add the stages up
            sq /= len(self.layout.stage_ranks(self.position.pp_index))
            dist.all_reduce(sq)
        norm = sq.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            if isinstance(g, DTensor):
                g.to_local().mul_(coef)
            else:
                g.mul_(coef)
        return float(norm)

    # --- checkpoints --------------------------------------------------------------------
    def save(self, path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
             **extra: Any) -> None:
        """Save model (+ optimizer) with torch.distributed.checkpoint; loads under any plan."""
        from hetplan.runtime import checkpoint

        checkpoint.save(self, path, self._unwrap(model), optimizer, extra)

    def load(self, path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """Load a checkpoint written by ``save`` under any plan; returns the extra values."""
        from hetplan.runtime import checkpoint

        return checkpoint.load(self, path, self._unwrap(model), optimizer)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state dict as plain CPU tensors on rank 0 ({} elsewhere)."""
        from hetplan.runtime import checkpoint

        return checkpoint.full_state_dict(self, self._unwrap(model))

    def export(self, path: str, model: nn.Module) -> None:
        """Write the full state dict to ``path`` (torch.save) from rank 0."""
        sd = self.full_state_dict(model)
        if self.rank == 0:
            torch.save(sd, path)
        self.barrier()

    # --- misc ---------------------------------------------------------------------------
    def parameter_layout(self, model: nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], str]]:
        """name -> (global shape, local shape, placements) of this rank's parameters."""
        from torch.distributed.tensor import DTensor

        model = self._unwrap(model)

        out = {}
        for name, p in model.named_parameters():
            if isinstance(p, DTensor):
                out[name] = (tuple(p.shape), tuple(p.to_local().shape), str(tuple(p.placements)))
            else:
                out[name] = (tuple(p.shape), tuple(p.shape), "")
        return out

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print on rank 0 only."""
        if self.rank == 0:
            print(*args, **kwargs, flush=True)

    def close(self, exit_process: bool = False) -> None:
        """Tear down the process group (if init created it). With
        ``exit_process`` also end the process at once (``os._exit(0)`` after
        flushing output): with torch 2.13 some distributed runs otherwise abort
        at interpreter exit ("terminate called without an active exception")."""
        clip_guard.release(self._guarded_params)
        self._guarded_params = []
        if self._heartbeat is not None:  # before the process group (and maybe the store) goes
            self._heartbeat.stop()
            self._heartbeat = None
        if self._owns_pg and dist.is_initialized():
            dist.destroy_process_group()
        self.mesh = None
        if exit_process:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def preflight(layout: PlanLayout, spec: Any, full: nn.Module, example_inputs: Sequence[Any] | None = None,
              chain: bool = True) -> None:
    """Checks every rank runs on the whole (meta) model before anything is split,
    so a bad plan fails the same way everywhere (no rank left waiting); also
    what ``hetplan train`` runs before it starts any process (with
    ``example_inputs``, also the pipeline chain check)."""
    names = list(layout.layer_names)
    par.check_layer_names(full, names, layout.plan.model)
    _check_dropout(layout, full)
    _check_cp_ep(layout, spec, full)
    if chain and layout.num_chunks > 1:
        _check_chain_early(full, names, spec, example_inputs)
    if layout.num_chunks > 1:
        _check_hf_split(layout, full)
    if layout.pp > 1:
        _check_tied_span(layout, spec)
        stray = par.uncovered_state(full, par.layer_paths(names, _layer_modules(spec)))
        if stray:
            raise HetplanError(
                f"{stray[0]!r} is not inside any layer of the plan, so no pipeline stage would hold it; "
                "make the ModelSpec's layers cover every parameter"
            )
    if layout.max_tp > 1:
        from hetplan.runtime import tp as tpr

        model_plan = model_tp_plan(full)  # raises on styles hetplan cannot apply
        layer_tp = {name: layout.stage_tp(layout.pp_index_of_layer(name)) for name in names}
        for name, tp in layer_tp.items():
            if tp > 1:
                _dry_run_tp(full.get_submodule(name), name, tp, layout.sequence_parallel)
        if not callable(getattr(full, "hetplan_tp_plan", None)):
            from hetplan.runtime.hf_tp import check_family_tp

            check_family_tp(full, layer_tp, layout.sequence_parallel)
        config = getattr(full, "config", None)
        heads = getattr(config, "num_attention_heads", 0)
        kv = getattr(config, "num_key_value_heads", 0) or heads
        for what, count in (("attention heads", heads), ("key/value heads", kv)):
            if model_plan and isinstance(count, int) and count and count % layout.max_tp:
                raise HetplanError(f"tp={layout.max_tp} does not divide the {count} {what} of the model; "
                                   f"use a tp that divides {count}")
        if layout.sequence_parallel and spec.seq_len % layout.tp:
            raise HetplanError(
                f"sequence parallelism splits the sequence of {spec.seq_len} over tp={layout.tp}; "
                "use a tp that divides the sequence length"
            )


def _check_hf_split(layout: PlanLayout, full: nn.Module) -> None:
    """An HF model's split points: what its staged forward cannot pass between
    these stages is refused (hetplan.runtime.hf_stages.StagedForward.split_refusal)."""
    from hetplan.runtime.hf_stages import staged_forward

    names = list(layout.layer_names)
    staged = staged_forward(full, names)
    if staged is None:
        return
    why = staged.split_refusal([layout.chunk_names(c) for c in range(layout.num_chunks)], layout.heterogeneous)
    if why:
        raise HetplanError(why)


def _check_cp_ep(layout: PlanLayout, spec: Any, full: nn.Module) -> None:
    """What context and expert parallelism need of the model (one line each).
    HF's fused experts count as MoE layers before ``apply_ep`` adapts them."""
    from hetplan.runtime import ep

    if layout.cp > 1:
        if not callable(getattr(full, "set_context_parallel", None)):
            raise HetplanError(
                f"the plan has cp={layout.cp}, but {type(full).__name__} does not declare context-parallel support "
                "(a set_context_parallel(shard) method; hetplan's GPT has one, see docs/runtime.md); "
                "use a plan with cp=1")
        from hetplan.runtime.cp import check_sequence

        check_sequence(spec.seq_len, layout.cp)
    hf = ep.hf_fused_experts(full)
    if layout.ep > 1:
        for fqn, module in hf:
            why = ep.hf_experts_refusal(fqn, module)
            if why:
                raise HetplanError(why)
        counts = [int(getattr(m, "num_experts", 0)) for m in [*par.moe_modules(full), *(m for _, m in hf)]]
        if not counts:
            raise HetplanError(f"the plan has ep={layout.ep}, but model {spec.name!r} has no mixture-of-experts "
                               "layers to split; use a plan with ep=1")
        for experts in counts:
            if experts % layout.ep:
                raise HetplanError(f"ep={layout.ep} does not divide the {experts} experts of the model's MoE layers; "
                                   f"use an ep that divides {experts}")
    for fqn, module in hf:  # expert TP = the stage's tp
        layer = par.owner_layer(fqn, layout.layer_names)
        tp = layout.stage_tp(layout.pp_index_of_layer(layer)) if layer else 1
        if tp > 1:
            raise HetplanError(ep.hf_tp_refusal(layer, type(module).__name__, tp))
    for fqn, module in full.named_modules():
        layer = par.owner_layer(fqn, layout.layer_names) if hasattr(module, "ep_group") else None
        tp = layout.stage_tp(layout.pp_index_of_layer(layer)) if layer and hasattr(module, "experts") else 1
        if tp > 1:
            par.check_expert_tp(module.experts, layer, tp)


def _check_dropout(layout: PlanLayout, full: nn.Module) -> None:
    """Dropout hetplan cannot make plan-independent is refused, never run
    differently: torch dropout modules under TP, any dropout under context
    parallelism (hetplan.runtime.dropout)."""
    if not rng.has_dropout(full):
        return
    rng.check_tensor_parallel(full, {n: layout.stage_tp(layout.pp_index_of_layer(n)) for n in layout.layer_names})
    cp = max((getattr(stage, "cp", 1) for stage in layout.plan.stages), default=1)
    if cp > 1:
        raise HetplanError(f"dropout under context parallelism (cp={cp}) is not plan-independent yet; "
                           "set the model's dropout to 0 or use a plan with cp=1")


def _check_chain_early(full: nn.Module, names: list[str], spec: Any, inputs: Sequence[Any] | None) -> None:
    """The pipeline chain check before anything is split. Without the user's
    inputs, try the ones hetplan knows (token ids, an HF image); if the model
    cannot run on those, the first ``train_step`` checks with the real batch.
    The user's ``inputs`` are passed as ``train_step`` passes them: the first
    positionally, the rest by the names of ``forward``'s parameters."""
    from hetplan.runtime.hf_stages import staged_forward

    if staged_forward(full, names) is not None:
        return  # an HF model: runs its staged forward (raises if hetplan has none for it)
    if any(p.device.type != "meta" for p in full.parameters()):
        return  # a real model: parallelize checks its meta copy instead
    par.check_layer_names(full, names, getattr(spec, "name", ""))
    if inputs is not None:  # called as train_step calls the model: the first positional, the rest by name
        args, kwargs = example_call(full, inputs, f"model {getattr(spec, 'name', '')!r}")
        check_chain(full, names, args, kwargs)
        return
    guess = known_example_inputs(spec, getattr(full, "config", None))
    if guess is None:
        return
    try:
        check_chain(full, names, guess)
    except HetplanError as e:
        if not str(e).startswith("cannot check"):
            raise


def _check_staged_inputs(part: nn.Module, inputs: dict[str, Any]) -> None:
    """An HF model's stages take only the keyword inputs their staged forward
    rebuilds from (before any pipeline message, on every rank alike)."""
    staged = getattr(part, "staged", None)
    unknown = sorted(set(inputs) - set(staged.model_inputs)) if staged is not None else []
    if unknown:
        raise HetplanError(f"keyword input {unknown[0]!r} does not reach the pipeline stages of "
                           f"{staged.model_class}, which take {', '.join(staged.model_inputs)}; "
                           "drop it or use a plan with one pipeline stage")
    missing = [k for k in getattr(staged, "required_inputs", ()) if k not in inputs]
    if missing:
        raise HetplanError(f"the pipeline stages of {staged.model_class} need the keyword input {missing[0]!r}; "
                           f"pass it with train_step(..., inputs={{{missing[0]!r}: ...}})")


def _loss_of_output(loss_fn: Callable[..., torch.Tensor], wrap: Callable[[Any], Any], output: Any,
                    target: torch.Tensor) -> torch.Tensor:
    return loss_fn(wrap(output), target)


def _layer_modules(spec: Any) -> dict[str, list[str]]:
    """Layer name -> its module paths, where a layer spans several (HF imports)."""
    modules = (getattr(spec, "meta", None) or {}).get("layer_modules") or {}
    return {k: list(v) for k, v in modules.items() if isinstance(v, (list, tuple))}


def _one_pair_per_stage_pair(pairs: list[tuple[str, str]], layout: PlanLayout) -> list[tuple[str, str]]:
    """A weight tied three ways (T5: encoder and decoder embeddings, LM head) with
    two copies on one stage is one tensor there: its gradient is summed with
    the other stage's once, so keep one pair per (weight, pair of stages)."""
    seen: set[tuple[str, int, int]] = set()
    out = []
    for canon, alias in pairs:
        a, b = (layout.pp_index_of_layer(par.owner_layer(f, layout.layer_names)) for f in (canon, alias))
        if (canon, a, b) not in seen:
            seen.add((canon, a, b))
            out.append((canon, alias))
    return out


def _check_tied_span(layout: PlanLayout, spec: Any) -> None:
    """The gradient of a tied weight is summed between two stages; one on three
    or more stages (T5's shared embedding at pp >= 3) is refused."""
    from hetplan.model.hf import tied_span_refusal

    why = tied_span_refusal(spec, {n: layout.pp_index_of_layer(n) for n in layout.layer_names})
    if why:
        raise HetplanError(why)


def _tied_groups(spec: Any) -> list[list[str]]:
    groups: dict[str, list[str]] = {}
    for layer in spec.layers:
        if layer.tied_group:
            groups.setdefault(layer.tied_group, []).append(layer.name)
    return [g for g in groups.values() if len(g) > 1]


def model_tp_plan(model: nn.Module) -> dict[str, Any] | None:
    """A whole-model TP plan: the model's ``hetplan_tp_plan()`` if it has one,
    else hetplan's plan for the HF families whose configs have none (GPT-2,
    BERT, T5, ViT: hetplan.runtime.hf_tp), else its HF config's
    ``base_model_tp_plan`` (transformers models: Llama, Mistral, Qwen, ...)."""
    fn = getattr(model, "hetplan_tp_plan", None)
    if callable(fn):
        return fn()
    from hetplan.runtime.hf_tp import family_tp_plan

    family = family_tp_plan(model)
    if family is not None:
        return family
    config = getattr(model, "config", None)
    if getattr(config, "base_model_tp_plan", None):
        from hetplan.runtime.tp import hf_tp_plan

        return hf_tp_plan(model)
    return None


def _dry_run_tp(module: nn.Module, name: str, tp: int, sp: bool) -> None:
    from hetplan.runtime import tp as tpr

    tpr.dry_run(module, name, tp, sp)


# --- init -------------------------------------------------------------------------------------
def init(plan: Plan | str | os.PathLike[str] | None = None, model: Any = None, *,
         timeout_s: float | None = None, backend: str | None = None) -> RuntimeContext:
    """Set up process groups and the device mesh for ``plan`` in this process.

    ``plan``: a Plan or a plan JSON path (default: ``$HETPLAN_PLAN``, which
    ``hetplan run`` sets). ``model``: the ModelSpec or preset name (default: the
    model a plan file embeds, else the plan's model name; one given must be
    the same model). Launch with one process per device the plan uses
    (``hetplan run plan.json -- script.py`` does). Every check that can fail
    runs before the first collective, on every rank, with the same message.
    """
    if plan is None:
        plan = os.environ.get("HETPLAN_PLAN")
        if not plan:
            raise HetplanError("no plan given: pass one to hetplan.runtime.init or set HETPLAN_PLAN")
    plan, spec, cluster, layout, precision = _check_plan(plan, model)
    notes = list(layout.notes)
    world = _env_int("WORLD_SIZE")
    rank = _env_int("RANK")
    already = dist.is_available() and dist.is_initialized()
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
    position = layout.position(rank)
    device = _pick_device(plan, cluster, position, notes)
    if timeout_s is None:
        timeout_s = _env_timeout()
    if cluster is not None and not os.environ.get("HETPLAN_ONE_MACHINE"):  # set by `hetplan train`
        _check_node_placement(layout, cluster, rank)
    torch.set_num_threads(int(os.environ.get("HETPLAN_NUM_THREADS", torch.get_num_threads())))
    mesh = None
    tie_groups: dict[tuple[int, int, int, int], Any] = {}
    owns = False
    heartbeat = None
    ep_mesh = None
    if layout.world_size > 1:
        if not already:
            be = backend or ("nccl" if device.type == "cuda" else "gloo")
            dist.init_process_group(be, timeout=datetime.timedelta(seconds=timeout_s))
            owns = True
        heartbeat = hb.start(layout, rank, timeout_s)  # names a rank that stops responding (world > 1)
        from torch.distributed.device_mesh import DeviceMesh

        if layout.heterogeneous:  # one (dp, tp) mesh per stage; every rank builds all of them
            meshes = [DeviceMesh(device.type, torch.tensor(layout.stage_mesh_ranks(j), dtype=torch.int64),
                                 mesh_dim_names=("dp", "tp")) for j in range(layout.pp)]
            mesh = meshes[position.pp_index]
        elif layout.cp > 1:  # TP innermost, then CP, then DP (hetplan.plan)
            mesh = DeviceMesh(device.type, torch.tensor(layout.mesh_ranks_cp(), dtype=torch.int64),
                              mesh_dim_names=("pp", "dp", "cp", "tp"))
        else:
            mesh = DeviceMesh(device.type, torch.tensor(layout.mesh_ranks(), dtype=torch.int64),
                              mesh_dim_names=("pp", "dp", "tp"))
        if layout.ep > 1:  # the dp * cp ranks of a TP rank in EP groups of ep (hetplan.runtime.layout)
            ep_mesh = DeviceMesh(device.type, torch.tensor(layout.ep_mesh_ranks(), dtype=torch.int64),
                                 mesh_dim_names=("pp", "edp", "ep", "tp"))
        tie_groups = _make_tie_groups(layout, spec)
    ctx = RuntimeContext(plan, spec, layout, position, device, mesh, tie_groups, notes, owns, precision)
    ctx._heartbeat = heartbeat
    ctx.ep_mesh = ep_mesh
    return ctx


def _env_timeout() -> float:
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


def check_plan(plan: Plan | str | os.PathLike[str], model: Any = None) -> tuple[Plan, Any, Any, PlanLayout]:
    """Load and check a plan without torch.distributed: (plan, ModelSpec,
    ClusterSpec or None, PlanLayout). Raises HetplanError naming the problem."""
    return _check_plan(plan, model)[:4]


def check_plan_precision(plan: Plan | str | os.PathLike[str], model: Any = None
                         ) -> tuple[Plan, Any, Any, PlanLayout, str]:
    """``check_plan`` and the precision the plan trains in ("fp32", "bf16" or "fp16")."""
    return _check_plan(plan, model)


def _check_plan(plan: Plan | str | os.PathLike[str], model: Any = None
                ) -> tuple[Plan, Any, Any, PlanLayout, str]:
    from hetplan.model import load_model
    from hetplan.model.spec import ModelSpec

    settings: dict[str, Any] = {}
    if isinstance(plan, Plan):
        spec = model if isinstance(model, ModelSpec) else load_model(model or plan.model)
        cluster = _load_cluster(plan)
    else:  # a plan file: the model and cluster it embeds (format 2), or their names
        from hetplan.planfile import read_plan_file, resolve_cluster, resolve_model

        plan_file = read_plan_file(plan)
        plan = plan_file.plan()
        spec = resolve_model(plan_file, model)
        cluster = resolve_cluster(plan_file) if plan_file.cluster is not None else _load_cluster(plan)
        settings = plan_file.settings
        _refuse_unrun_settings(settings)
    if spec.name != plan.model:
        raise HetplanError(f"the plan was made for model {plan.model!r}, not {spec.name!r}; make a plan for this model")
    if cluster is not None:
        from hetplan.validate import validate_plan

        validate_plan(plan, spec, cluster)
    layout = PlanLayout.from_plan(plan, [layer.name for layer in spec.layers])
    if not support_of(spec).build:  # a model the runtime builds: what it can run of it (a script may build its own)
        check_runs(plan, spec)
    return plan, spec, cluster, layout, mp.precision_of(settings, spec.dtype_bytes)


def _refuse_unrun_settings(settings: dict[str, Any]) -> None:
    """A plan costed with FP8 matmuls counted FP8's speed and its one-byte saved
    linear inputs; hetplan's runtime trains in the plan's 16-bit precision, so
    such a plan could run out of memory here: refuse it rather than train it
    as a different plan than the one costed."""
    if settings.get("fp8"):
        raise HetplanError("the plan was costed with FP8 matmuls (--fp8), which hetplan's runtime does not run: "
                           "make the plan without --fp8 to train it here, or export it to a tool with "
                           "Transformer Engine FP8 (hetplan export PLAN --format megatron)")


def _pick_device(plan: Plan, cluster: Any, position: RankPosition, notes: list[str]) -> torch.device:
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
    import re

    def tokens(text: str) -> set[str]:
        return {t for t in re.split(r"[\s\-_]+", text.upper()) if t}

    want = {t for t in tokens(catalog_name) if not re.fullmatch(r"\d+GB", t)}
    return want <= tokens(cuda_name)


def _check_node_placement(layout: PlanLayout, cluster: Any, rank: int) -> None:
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


def _make_tie_groups(layout: PlanLayout, spec: Any) -> dict[tuple[int, int, int, int], Any]:
    """Process groups joining the copies of weights tied across stages (same dp/tp index)."""
    pairs: set[tuple[int, int]] = set()
    for group in _tied_groups(spec):
        idx = sorted({layout.pp_index_of_layer(n) for n in group})
        for a in idx:
            for b in idx:
                if a < b:
                    pairs.add((a, b))
    groups: dict[tuple[int, int, int, int], Any] = {}
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
