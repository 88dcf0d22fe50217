"""The runtime's user API: ``init(plan)`` -> :class:`RuntimeContext`.

A training script, in the spirit of SageMaker's ``smp.init`` /
``smp.DistributedModel`` / ``@smp.step``::

    import hetplan.runtime as hr

    ctx = hr.init("plan.json")                    # process groups + mesh from the plan
    model = ctx.parallelize(build_model)          # this rank's part: TP -> EP -> AC -> FSDP2
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

The context is a facade over four parts, each a module: process setup
(hetplan.runtime.setup: the plan checks, device, meshes, heartbeat), the
checks of a model before it is split (hetplan.runtime.preflight), the
parallelisation spine (hetplan.runtime.spine: what ``parallelize`` applies to
each pipeline part, in order) and the training step (hetplan.runtime.step).
"""

from __future__ import annotations

import copy
import os
import sys
import warnings
from typing import Any, Callable, ContextManager, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hetplan.errors import HetplanError
from hetplan.plan.spec import Plan
from hetplan.runtime import checkpoint, clip_guard, mixed, preflight, setup, spine
from hetplan.runtime import dropout as rng
from hetplan.runtime import parallelize as par
from hetplan.runtime import precision as mp
from hetplan.runtime import step as steps
from hetplan.runtime.build import ModelBuild, model_build
from hetplan.runtime.cp import ContextShard, check_sequence
from hetplan.plan.layout import PlanLayout, RankPosition
from hetplan.runtime.offload import HostPool
from hetplan.runtime.pending import PendingLoss
from hetplan.runtime.console import remember_context
from hetplan.runtime.step import ModelInfo
from hetplan.runtime.zero1 import Zero1Optimizer

# FSDP2 warns when a wrapped module returns a view (in-place ops on it would skip a hook);
# the runtime never modifies outputs in place, and a model's logits are often a view.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


class RuntimeContext:
    """One process's view of a Plan: process groups, mesh, and training helpers.

    Attributes:
        plan, spec, layout: the plan, the ModelSpec, and the rank layout.
        position: this rank's stage, dp/tp index, and share of each micro-batch.
        rank, world_size, device: as in torch.distributed.
        mesh: the ``("pp", "dp", "tp")`` DeviceMesh (None in a one-process run).
        ep_mesh: the ``("pp", "edp", "ep", "tp")`` mesh of an expert-parallel plan.
        tie_groups: the process groups joining copies of weights tied across stages.
        notes: what the runtime did differently from the plan's letter, and why.
        precision: "fp32", "bf16" or "fp16" (hetplan.runtime.precision);
            ``loss_scaler`` (fp16) counts skipped steps.
        last_outputs: outputs of the last step's micro-batches on last-stage ranks.
        step: the training step dropout masks are drawn for (hetplan.runtime.dropout);
            ``train_step`` counts it up; set it when resuming from a checkpoint.
    """

    def __init__(self, plan: Plan, spec: Any, layout: PlanLayout, position: RankPosition, device: torch.device,
                 mesh: Any, tie_groups: dict[tuple[int, int, int, int], Any], notes: list[str],
                 owns_process_group: bool, precision: str = "fp32", *, ep_mesh: Any = None,
                 heartbeat: Any = None, mixed_groups: mixed.MixedGroups | None = None) -> None:
        self.plan = plan
        self.spec = spec
        self.layout = layout
        self.position = position
        self.rank = position.rank
        self.world_size = layout.world_size
        self.device = device
        self.mesh = mesh
        self.ep_mesh = ep_mesh
        self.tie_groups = tie_groups
        self.mixed_groups = mixed_groups or {}  # stages whose replicas differ in TP degree (runtime.mixed)
        self.pending_loss: torch.Tensor | None = None  # the last train_step's loss (hetplan.runtime.pending)
        self.notes = notes
        self.last_outputs: Any = None
        self.stage_dp = layout.stage_dp(position.pp_index)  # this rank's stage
        self.stage_tp = layout.replica_tp(position.pp_index, position.dp_index)  # this rank's replica's
        self.precision = precision
        self.loss_scaler = mp.LossScaler() if precision == "fp16" else None
        self.step = 0
        self._owns_pg = owns_process_group
        self._heartbeat = heartbeat  # world > 1; stopped by close()
        self._models: dict[int, ModelInfo] = {}
        self._model_build: ModelBuild | None = None
        self._guarded_params: list[nn.Parameter] = []  # see hetplan.runtime.clip_guard
        self._dp_cp_mesh: Any = None  # dense-gradient mesh under context parallelism (dp_mesh)
        self._offload_pool: HostPool | None = None  # made when a layer offloads
        # where a CPU device's offloaded copies are made when it stands for a GPU (the replay; HostPool)
        self.offload_host_side: Callable[[], ContextManager[Any]] | None = None
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
    def pp_group(self) -> Any:
        """The pipeline group of this rank (None for heterogeneous plans, which have none)."""
        if self.mesh is None or self.layout.heterogeneous:
            return None
        return self.mesh["pp"].get_group()

    @property
    def model_build(self) -> ModelBuild:
        """How the plan's own model is built, trained and fed (a ``ModelBuild``,
        hetplan.runtime.build): ``build``, ``loss``, and for a ``pkg.mod:build``
        plan ``batch(batch_size, step, seed)``, the synthetic data of ``hetplan train``."""
        if self._model_build is None:
            self._model_build = model_build(self.spec)
        return self._model_build

    @property
    def offload_pool(self) -> HostPool:
        """The ``HostPool`` holding this rank's offloaded activations (made on first use)."""
        if self._offload_pool is None:
            self._offload_pool = HostPool(self.device, self.offload_host_side)
        return self._offload_pool

    # --- model -----------------------------------------------------------------------
    def parallelize(self, build_model: Callable[[], nn.Module] | None = None, *, seed: int = 0,
                    meta_init: bool | None = None, init_fn: par.InitFn | None = None,
                    example_inputs: Sequence[Any] | None = None, compile: bool = False) -> nn.Module:
        """Build this rank's part of the model and parallelise it as the plan says.

        ``build_model()`` returns the full model, whose module names include the
        ModelSpec's layer names; without it, the plan's own (``ctx.model_build``).
        It is built on the meta device (no memory), or for real on CPU with
        ``meta_init=False`` (models with buffers; the full model's memory on every
        rank). In order: checks (hetplan.runtime.preflight) -> CP -> pipeline
        split -> per part TP -> EP -> checkpointing / offload -> compile (with
        ``compile=True``, each layer) -> ZeRO / FSDP2 (hetplan.runtime.spine) ->
        materialise with plan-independent initial values (hetplan.runtime.parallelize;
        ``init_fn(name, tensor, generator)`` overrides the model's ``init_parameter``).

        Returns the user's model itself with one pipeline stage, else a
        :class:`~hetplan.runtime.parallelize.PipelinePart` holding this rank's
        layers under their original names; use ``train_step`` to run it. With
        several stages the model's ``forward`` must be exactly the chain of its
        layers (hetplan.model.chain), checked on a meta copy with
        ``example_inputs`` (one micro-batch's inputs, the first positional, the
        rest by name, as ``train_step(..., inputs=)`` passes them) here, or else
        with the first ``train_step``'s micro-batch, before any pipeline message.
        Compiling the returned model yourself works with one stage (``train_step``
        accepts the compiled wrapper), not with several.
        """
        if build_model is None:
            how = self.model_build
            build_model, meta_init = how.build, how.meta_init if meta_init is None else meta_init
            example_inputs = how.example_inputs if example_inputs is None else example_inputs
        meta_init = True if meta_init is None else meta_init
        torch.manual_seed(seed)
        full = spine.build_whole(build_model, meta_init)
        staged, probe = preflight.check_before_split(self.layout, self.spec, full, build_model, example_inputs)
        init = init_fn or getattr(full, "init_parameter", None)
        values = par.InitialValues(copy.deepcopy(full), seed, init) if meta_init else None
        notes: list[str] = rng.prepare(full)  # names dropout sites; nn.Dropout made plan-independent
        if self.cp_mesh is not None:
            spine.apply_cp(full, self.cp_mesh.get_group(), self.position.cp_index, self.layout.cp)
        local, parts = spine.split_pipeline(full, self.layout, self.position, self.spec, staged)
        aliases, tied = par.param_aliases(full), spine.tied_pairs(full, self.layout)
        if not meta_init:
            spine.move_to(local, self.device)
        how = self._part_settings(full, compile)
        done = [spine.parallelize_part(part, self.layout.chunk_names(chunk), how, notes)
                for part, chunk in zip(parts, self.position.chunks)]
        sync_modules = [module for d in done for module in d.sync_modules]
        experts = set().union(*(d.experts for d in done))
        self._track_zero(local, how, experts, notes)
        if values is not None:
            for part in parts:
                par.materialize(part, self.device, values)
        stages = spine.pipeline_stages(parts, self.layout, self.position, self.device, self.pp_group, sync_modules)
        self._record(ModelInfo(local, parts, stages, sync_modules, tied, aliases=aliases, chain_probe=probe,
                               seed=seed, expert_fqns=[n for n, p in local.named_parameters() if p in experts],
                               mixed=mixed.mixed_sync(self.layout, self.position, self.mixed_groups, local)),
                     notes)
        return local

    def _part_settings(self, full: nn.Module, compile: bool) -> spine.PartSettings:
        """What ``parallelize_part`` applies to each of this rank's parts, and on which meshes."""
        recompute, zero = spine.layer_strategies(self.plan, self.layout, self.spec)
        # replicas of different TP degrees: no data-parallel wrapper, the step averages (runtime.mixed)
        mixed_tp = self.plan.stages[self.position.pp_index].replica_tp is not None
        dp = 1 if mixed_tp else self.stage_dp * self.layout.cp
        return spine.PartSettings(
            recompute, zero, lambda: self.offload_pool, tp=self.stage_tp, tp_mesh=self.tp_mesh,
            tp_index=self.position.tp_index, sequence_parallel=self.layout.sequence_parallel,
            tp_plan=preflight.model_tp_plan(full) if self.stage_tp > 1 else None, ep_mesh=self.ep_mesh,
            expert_zero_sharded=self.ep_mesh is not None and self.ep_mesh["edp"].size() > 1,
            core_layers=frozenset(layer.name for layer in self.spec.layers if layer.attention_flops > 0),
            offloaded=spine.offloaded_layers(self.plan, self.layout), compile=compile, dp=dp,
            dp_mesh=self.dp_mesh if dp > 1 else None, plain_ddp=self._plain_ddp(dp, zero))

    def _plain_ddp(self, dp: int, zero: dict[str, int]) -> bool:
        """Plain data parallelism (ZeRO-0 everywhere, no TP, PP, CP or EP) runs on
        DDP: measured faster than FSDP2 ``replicate`` (docs/runtime.md, "Speed")."""
        lay = self.layout
        plain = dp > 1 and lay.pp == 1 and lay.max_tp == 1 and lay.cp == 1 and lay.ep == 1
        return plain and all(z == 0 for z in zero.values())

    def _track_zero(self, local: nn.Module, how: spine.PartSettings, experts: set[nn.Parameter],
                    notes: list[str]) -> None:
        """Remember the parameters of ZeRO-1 layers for ``ctx.optimizer`` (experts
        with their expert-data-parallel group, where ZeRO shards them there);
        with ``dp * cp = 1`` say that the ZeRO settings do nothing."""
        names = [n for c in self.position.chunks for n in self.layout.chunk_names(c)]
        if how.dp == 1:
            if any(how.zero[n] for n in names):
                notes.append("ZeRO settings ignored where dp=1: nothing to shard across")
            return
        zero1 = {id(p): p for n in names if how.zero[n] == 1 for p in local.get_submodule(n).parameters()}
        sharded = how.expert_zero_sharded
        self._zero1_params |= {i for i, p in zero1.items() if p not in experts or sharded}
        self._zero1_groups.update({i: self.ep_mesh["edp"].get_group() for i, p in zero1.items()
                                   if p in experts and sharded})

    def _record(self, info: ModelInfo, notes: list[str]) -> None:
        """Keep what parallelize made of the model (for the steps and checkpoints)
        and its notes; guard torch's clipping where it would be wrong."""
        for note in notes:
            if note not in self.notes:
                self.notes.append(note)
        self._models[id(info.model)] = info
        why = steps.why_torch_clipping_is_wrong(self.layout)
        if why:
            self._guarded_params += list(info.model.parameters())
            clip_guard.guard(self._guarded_params, why)

    def model_info(self, model: nn.Module) -> ModelInfo | None:
        """What ``parallelize`` recorded of ``model`` (also of a ``torch.compile``
        wrapper of it): its parts, pipeline stages, tied weights and parameter
        aliases; None for a model ``parallelize`` did not return."""
        return self._models.get(id(self._unwrap(model)))

    def _unwrap(self, model: nn.Module) -> nn.Module:
        """The parallelised model behind a ``torch.compile`` wrapper of it (names without ``_orig_mod.``)."""
        inner = getattr(model, "_orig_mod", None)
        return inner if inner is not None and id(inner) in self._models else model

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
        return Zero1Optimizer(params, zero1, self.dp_mesh.get_group(), cls, groups=self._zero1_groups, **kwargs)

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

    def local_sequence(self, tensor: torch.Tensor) -> torch.Tensor:
        """This CP rank's tokens of whole sequences (dim 1; the tensor itself without CP)."""
        if self.layout.cp == 1 or self.mesh is None:
            return tensor
        check_sequence(tensor.size(1), self.layout.cp)
        return ContextShard(None, self.position.cp_index, self.layout.cp).split(tensor, 1)

    # --- training ---------------------------------------------------------------------
    def train_step(self, model: nn.Module, batch: Sequence[torch.Tensor], loss_fn: Callable[..., torch.Tensor],
                   return_outputs: bool = True, *, inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Forward and backward over all micro-batches of one step; returns the
        global-batch mean loss on every rank, a 0-dim tensor on this rank's
        device: the step does not wait for the device (no host sync, fp16's
        overflow check aside), so ``float(loss)`` or ``f"{loss:.4f}"`` only on
        the steps you print. Gradients (synchronised across
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
        forward passes to it unchanged). See hetplan.runtime.step."""
        return steps.train_step(self, model, batch, loss_fn, return_outputs, inputs)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip gradients by their global norm over the whole model (all stages,
        shards and replicas; a tied weight counted once). Returns the norm, a
        0-dim tensor on the device as ``torch.nn.utils.clip_grad_norm_`` does (no host sync)."""
        info = self.model_info(model)
        return steps.clip_grad_norm_(self, self._unwrap(model), info.aliases if info else {}, max_norm)

    # --- checkpoints --------------------------------------------------------------------
    def save(self, path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
             **extra: Any) -> None:
        """Save model (+ optimizer) with torch.distributed.checkpoint; loads under any plan."""
        checkpoint.save(self, path, self._unwrap(model), optimizer, extra)

    def load(self, path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """Load a checkpoint written by ``save`` under any plan; returns the extra values."""
        return checkpoint.load(self, path, self._unwrap(model), optimizer)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state dict as plain CPU tensors on rank 0 ({} elsewhere)."""
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
        from torch.distributed.tensor import DTensor  # lazy: a one-process run never loads it

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
        if isinstance(self.pending_loss, PendingLoss):  # its all-reduce done before the group goes
            self.pending_loss.settle()
        self.pending_loss = None
        if self._owns_pg and dist.is_initialized():
            dist.destroy_process_group()
        self.mesh = None
        if exit_process:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def init(plan: Plan | str | os.PathLike[str] | None = None, model: Any = None, *,
         timeout_s: float | None = None, backend: str | None = None, trust_plan_code: bool = False
         ) -> RuntimeContext:
    """Set up process groups and the device mesh for ``plan`` in this process.

    ``plan``: a Plan or a plan JSON path (default: ``$HETPLAN_PLAN``, which
    ``hetplan run`` sets). ``model``: the ModelSpec or preset name (default: the
    model a plan file embeds, else the plan's model name; one given must be
    the same model; a ``pkg.mod:build`` reference equal to the plan's lets
    ``parallelize()`` import that code). ``trust_plan_code``: import the
    plan's model code without naming it (docs/inputs.md, "What a plan file
    can do"). Launch with one process per device the plan uses
    (``hetplan run plan.json -- script.py`` does). Every check that can fail
    runs before the first collective, on every rank, with the same message
    (hetplan.runtime.setup).
    """
    s = setup.set_up(plan, model, timeout_s=timeout_s, backend=backend, trust_plan_code=trust_plan_code)
    ctx = RuntimeContext(s.plan, s.spec, s.layout, s.position, s.device, s.mesh, s.tie_groups, s.notes,
                         s.owns_process_group, s.precision, ep_mesh=s.ep_mesh, heartbeat=s.heartbeat,
                         mixed_groups=s.mixed_groups)
    remember_context(ctx)  # for the one-line out-of-memory error (hetplan.runtime.launch.out_of_memory_line)
    return ctx
