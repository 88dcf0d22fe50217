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
from hetplan.runtime import heartbeat as hb
from hetplan.runtime import precision as mp
from hetplan.runtime import parallelize as par
from hetplan.runtime.chain import check_chain, example_inputs as known_example_inputs
from hetplan.runtime.layout import PlanLayout, RankPosition

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
        return self._sub("dp")

    @property
    def tp_mesh(self) -> Any:
        return self._sub("tp")

    @property
    def pp_group(self) -> Any:
        """The pipeline group of this rank (None for heterogeneous plans, which have none)."""
        if self.mesh is None or self.layout.heterogeneous:
            return None
        return self.mesh["pp"].get_group()

    # --- model -----------------------------------------------------------------------
    def parallelize(self, build_model: Callable[[], nn.Module], *, seed: int = 0, meta_init: bool = True,
                    init_fn: par.InitFn | None = None, example_inputs: Sequence[Any] | None = None,
                    compile: bool = False) -> nn.Module:
        """Build this rank's part of the model and parallelise it as the plan says.

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
        positional inputs) here, or else with the first ``train_step``'s
        micro-batch, before any pipeline communication.

        ``compile=True`` compiles each layer with ``torch.compile`` (after TP
        and checkpointing, before FSDP; see ``parallelize.apply_compile``).
        Compiling the returned model yourself works with one pipeline stage
        (``train_step`` accepts the compiled wrapper), not with several.
        """
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
        if self.layout.num_chunks > 1:
            with torch.device("meta"):
                probe = build_model()
            _check_chain_early(probe, names, self.spec, example_inputs)
            if example_inputs is not None:
                probe = None  # checked with the user's inputs: nothing left for train_step
        self._preflight(full)
        init = init_fn or getattr(full, "init_parameter", None)
        values = par.InitialValues(copy.deepcopy(full), seed, init) if meta_init else None
        notes: list[str] = []
        local_chunks = list(self.position.chunks)
        if self.layout.num_chunks == 1:
            local: nn.Module = full
            parts = [full]
        else:
            local_names = [n for c in local_chunks for n in self.layout.chunk_names(c)]
            local = par.PipelinePart(full, local_names)
            parts = [par.PipelinePart(local, self.layout.chunk_names(c)) for c in local_chunks]
            if len(parts) == 1:
                parts = [local]
        aliases = par.param_aliases(full)
        tied = par.tied_layer_pairs(full, names) if self.layout.pp > 1 else []
        if not meta_init:
            local.to(self.device)
        recompute, zero = self._layer_strategies()
        sync_modules: list[tuple[nn.Module, bool]] = []
        for part, chunk in zip(parts, local_chunks):
            chunk_names = self.layout.chunk_names(chunk)
            if self.stage_tp > 1:
                par.apply_tp(part, chunk_names, self.tp_mesh, self.layout.sequence_parallel, notes,
                             model_tp_plan(full))
            par.apply_recompute(part, {n: recompute[n] for n in chunk_names}, notes)
            if compile:
                par.apply_compile(part, chunk_names)
            if self.stage_dp > 1:
                sync_modules += par.apply_dp(part, {n: zero[n] for n in chunk_names}, self.dp_mesh, notes)
        if self.stage_dp == 1 and any(zero[n] for c in local_chunks for n in self.layout.chunk_names(c)):
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
        for note in notes:
            if note not in self.notes:
                self.notes.append(note)
        self._models[id(local)] = _ModelInfo(parts, stages, sync_modules, tied, aliases=aliases, chain_probe=probe)
        why = self._why_torch_clipping_is_wrong()
        if why:
            self._guarded_params += list(local.parameters())
            clip_guard.guard(self._guarded_params, why)
        return local

    def _why_torch_clipping_is_wrong(self) -> str:
        if self.layout.num_chunks > 1:
            return "each pipeline stage would be clipped by the norm of its own gradients"
        if self.layout.max_tp > 1:
            return "it cannot take one norm over tensor-parallel shards"
        return ""

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
                   return_outputs: bool = True) -> float:
        """Forward and backward over all micro-batches of one step; returns the
        global-batch mean loss on every rank. Gradients (synchronised across
        data-parallel replicas and tied copies) are left in ``.grad`` for the
        user's optimizer. ``loss_fn(output, target)`` must return the *mean*
        loss of a micro-batch. With ``return_outputs`` the model outputs of the
        step are kept in ``ctx.last_outputs`` on last-stage ranks."""
        info = self._model_info(model)
        if len(batch) != 2:
            raise HetplanError("batch must be (inputs, targets)")
        x = self.local_batch(batch[0]).to(self.device)
        y = self.local_batch(batch[1]).to(self.device)
        shapes = (tuple(x.shape), tuple(y.shape))
        if info.batch_shapes is None:
            info.batch_shapes = shapes
        elif shapes != info.batch_shapes and self.layout.pp > 1:
            raise HetplanError(
                f"batch shapes changed from {info.batch_shapes} to {shapes}: pipelined training keeps the shapes "
                "of the first step (torch pipelining would hang); drop the last partial batch (drop_last=True)"
            )
        if info.chain_probe is not None:  # every rank alike, before the pipeline's first message
            check_chain(info.chain_probe, self.layout.layer_names, (x[:max(1, self.position.samples_per_micro_batch)],))
            info.chain_probe = None
        scale = self.layout.loss_scale(self.position.dp_index) if self.is_last_stage else 1.0
        total = torch.zeros((), device=self.device, dtype=torch.float32)
        fp16_scale = self.loss_scaler.scale if self.loss_scaler else 1.0
        earlier = self._take_grads(model, info, every=self.loss_scaler is not None)
        with mp.autocast(self.device, self.precision):
            self._forward_backward(model, info, x, y, loss_fn, scale * fp16_scale, total, return_outputs)
        if self.layout.pp > 1:
            self._sync_tied_grads(model, info)
        if self.loss_scaler is not None and not self._unscale(model):
            earlier = {}  # overflow: the whole step is skipped (every gradient None)
        self._restore_grads(model, earlier)
        return self._global_loss(total / fp16_scale)

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
                for module, every in info.sync_modules:
                    module.set_requires_gradient_sync(every or last, recurse=False)
                out = model(x[k * b:(k + 1) * b])
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
        names = [n for n, _ in model.named_parameters()] if every else self._tied_fqns(info)
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
            losses, outputs = info.stages[0].step(x if self.is_first_stage else None,
                                                  y if self.is_last_stage else None, loss_fn, scale,
                                                  self.plan.num_micro_batches, self.layout.schedule)
            self.last_outputs = outputs if self.is_last_stage and return_outputs else None
            return losses
        if info.schedule is None:
            def scaled_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
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
                                 return_outputs=return_outputs)
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
            dist.all_reduce(g, group=self._tie_groups[(min(a, b), max(a, b), pos.dp_index, pos.tp_index)])

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
        return float(total) / self.layout.stage_dp(self.layout.pp - 1)

    # --- gradient clipping ------------------------------------------------------------
    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> float:
        """Clip gradients by their global norm over the whole model (all stages,
        shards and replicas; a tied weight counted once). Returns the norm."""
        from torch.distributed.tensor import DTensor

        model = self._unwrap(model)
        info = self._models.get(id(model))
        aliases = info.aliases if info else {}
        sq = torch.zeros((), device=self.device, dtype=torch.float32)
        grads = []
        for fqn, p in model.named_parameters():
            if p.grad is None:
                continue
            grads.append(p.grad)
            if aliases.get(fqn, fqn) != fqn:
                continue  # the alias copy of a weight tied across stages
            g = p.grad
            if isinstance(g, DTensor):
                n = torch.linalg.vector_norm(g.float()).full_tensor()
            else:
                n = torch.linalg.vector_norm(g.float())
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
    if chain and layout.num_chunks > 1:
        _check_chain_early(full, names, spec, example_inputs)
    if layout.pp > 1:
        stray = par.uncovered_state(full, names)
        if stray:
            raise HetplanError(
                f"{stray[0]!r} is not inside any layer of the plan, so no pipeline stage would hold it; "
                "make the ModelSpec's layers cover every parameter"
            )
    if layout.max_tp > 1:
        from hetplan.runtime import tp as tpr

        tpr.ensure_builtins()
        model_plan = model_tp_plan(full)  # raises on styles hetplan cannot apply
        for name in names:
            tp = layout.stage_tp(layout.pp_index_of_layer(name))
            if tp > 1:
                _dry_run_tp(full.get_submodule(name), name, tp, layout.sequence_parallel)
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


def _check_chain_early(full: nn.Module, names: list[str], spec: Any, inputs: Sequence[Any] | None) -> None:
    """The pipeline chain check before anything is split. Without the user's
    inputs, try the ones hetplan knows (token ids, an HF image); if the model
    cannot run on those, the first ``train_step`` checks with the real batch."""
    if any(p.device.type != "meta" for p in full.parameters()):
        return  # a real model: parallelize checks its meta copy instead
    par.check_layer_names(full, names, getattr(spec, "name", ""))
    if inputs is not None:
        check_chain(full, names, tuple(inputs))
        return
    guess = known_example_inputs(spec, getattr(full, "config", None))
    if guess is None:
        return
    try:
        check_chain(full, names, guess)
    except HetplanError as e:
        if not str(e).startswith("cannot check"):
            raise


def _tied_groups(spec: Any) -> list[list[str]]:
    groups: dict[str, list[str]] = {}
    for layer in spec.layers:
        if layer.tied_group:
            groups.setdefault(layer.tied_group, []).append(layer.name)
    return [g for g in groups.values() if len(g) > 1]


def model_tp_plan(model: nn.Module) -> dict[str, Any] | None:
    """A whole-model TP plan: the model's ``hetplan_tp_plan()`` if it has one,
    else its HF config's ``base_model_tp_plan`` (transformers models)."""
    fn = getattr(model, "hetplan_tp_plan", None)
    if callable(fn):
        return fn()
    config = getattr(model, "config", None)
    if getattr(config, "base_model_tp_plan", None):
        from hetplan.runtime.tp import hf_tp_plan

        return hf_tp_plan(model)
    return None


def _dry_run_tp(module: nn.Module, name: str, tp: int, sp: bool) -> None:
    from hetplan.runtime import tp as tpr

    fn = tpr.tp_plan_for(module)
    if fn is not None:
        fn(module, tpr.TPSettings(tp=tp, sequence_parallel=sp, name=name))
        return
    for child_name, child in module.named_children():
        _dry_run_tp(child, f"{name}.{child_name}", tp, sp)


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
        else:
            mesh = DeviceMesh(device.type, torch.tensor(layout.mesh_ranks(), dtype=torch.int64),
                              mesh_dim_names=("pp", "dp", "tp"))
        tie_groups = _make_tie_groups(layout, spec)
    ctx = RuntimeContext(plan, spec, layout, position, device, mesh, tie_groups, notes, owns, precision)
    ctx._heartbeat = heartbeat
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
    if spec.name != plan.model:
        raise HetplanError(f"the plan was made for model {plan.model!r}, not {spec.name!r}; make a plan for this model")
    if cluster is not None:
        from hetplan.validate import validate_plan

        validate_plan(plan, spec, cluster)
    layout = PlanLayout.from_plan(plan, [layer.name for layer in spec.layers])
    return plan, spec, cluster, layout, mp.precision_of(settings, spec.dtype_bytes)


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
    ranks = layout.mesh_ranks()
    for a, b in sorted(pairs):
        for d in range(layout.dp):
            for t in range(layout.tp):
                groups[(a, b, d, t)] = dist.new_group([ranks[a][d][t], ranks[b][d][t]])
    return groups
