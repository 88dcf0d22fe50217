"""The training step: ``RuntimeContext.train_step`` and ``clip_grad_norm_``.

One step, in order: this replica's rows of the global batch (and this CP
rank's tokens), checked once against the pipeline chain; all micro-batches
forward and backward -- a plain loop with one stage, torch pipelining's
schedule or hetplan's heterogeneous executor (hetplan.runtime.hetero) with
several -- each micro-batch's loss scaled so that the gradients equal the
global-batch mean (``b_r * dp / B``, also for uneven splits, times the fp16
loss scale); then the gradients the data-parallel wrappers do not sync: those
of a stage whose replicas differ in TP degree (hetplan.runtime.mixed), copies
of a weight tied across stages (summed, as Megatron's embedding group does)
and expert-parallel experts (summed over their expert-data-parallel group);
fp16 unscaling (an overflow skips the step); and the global mean loss,
its all-reduce left running until the loss is read (hetplan.runtime.pending).

Gradients held from earlier ``train_step`` calls (accumulation) are set aside
and added back at the end, so that only this call's are synced and scaled.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from hetplan.errors import HetplanError
from hetplan.plan.spec import Plan
from hetplan.runtime import dropout as rng
from hetplan.runtime import microbatch
from hetplan.runtime import parallelize as par
from hetplan.runtime import pending
from hetplan.model.chain import check_chain
from hetplan.plan.layout import PlanLayout, RankPosition
from hetplan.runtime.precision import LossScaler


@dataclass
class ModelInfo:
    """What ``parallelize`` records of the model it returns, for the steps and checkpoints."""

    model: nn.Module  # the model parallelize returned
    parts: list[nn.Module]
    stages: list[Any]
    sync_modules: list[tuple[nn.Module, bool]]
    tied_pairs: list[tuple[str, str]]
    schedule: Any = None
    loss_fn: Any = None
    loss_weight: float = 1.0  # this rank's loss scale (uneven data split x fp16 loss scaling)
    batch_shapes: tuple[Any, ...] | None = None
    aliases: dict[str, str] = field(default_factory=dict)  # parameter name -> first name of the same tensor
    chain_probe: nn.Module | None = None  # a meta copy whose forward the first train_step checks (pp > 1)
    step_inputs: dict[str, Any] = field(default_factory=dict)  # this train_step's keyword inputs (local rows)
    seed: int = 0  # parallelize's seed: initial values and dropout masks (hetplan.runtime.dropout)
    expert_fqns: list[str] = field(default_factory=list)  # expert-parallel experts (synced by the step)
    syncing: bool | None = None  # what set_accumulating last told sync_modules (one stage): set again on a change only
    mixed: Any = None  # runtime.mixed.MixedSync (which uses this module's all-reduce): replicas of mixed TP degrees


class TrainingRank(Protocol):
    """What the step needs of the RuntimeContext (hetplan.runtime.context)."""

    plan: Plan
    layout: PlanLayout
    position: RankPosition
    device: torch.device
    precision: str
    loss_scaler: LossScaler | None
    notes: list[str]
    step: int
    last_outputs: Any
    stage_dp: int
    ep_mesh: Any
    tie_groups: dict[tuple[int, int, int, int], Any]
    pending_loss: torch.Tensor | None  # the last step's loss, its all-reduce maybe in flight (pending.py)

    @property
    def distributed(self) -> bool: ...

    @property
    def is_first_stage(self) -> bool: ...

    @property
    def is_last_stage(self) -> bool: ...

    def local_batch(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def local_sequence(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def model_info(self, model: nn.Module) -> ModelInfo | None: ...


def train_step(ctx: TrainingRank, model: nn.Module, batch: Sequence[torch.Tensor],
               loss_fn: Callable[..., torch.Tensor], return_outputs: bool,
               inputs: dict[str, torch.Tensor] | None) -> torch.Tensor:
    """One step of ``model`` (see the module doc and ``RuntimeContext.train_step``);
    the global mean loss as a 0-dim tensor on the device: no host sync here
    (fp16's overflow verdict aside, :func:`unscale`)."""
    info = step_info(ctx, model)
    if len(batch) != 2:
        raise HetplanError("batch must be (inputs, targets)")
    x = ctx.local_sequence(ctx.local_batch(batch[0]).to(ctx.device))
    y = ctx.local_sequence(ctx.local_batch(batch[1]).to(ctx.device))
    info.step_inputs = local_inputs(ctx, inputs, batch[0])
    check_staged_inputs(info.parts[0], info.step_inputs)
    _check_batch_shapes(ctx, info, (tuple(x.shape), tuple(y.shape)))
    _check_chain_once(ctx, model, info, x)
    scale = ctx.layout.loss_scale(ctx.position.dp_index) if ctx.is_last_stage else 1.0
    total = torch.zeros((), device=ctx.device, dtype=torch.float32)
    fp16_scale = ctx.loss_scaler.scale if ctx.loss_scaler else 1.0
    earlier = take_grads(ctx, model, info, every=ctx.loss_scaler is not None or info.mixed is not None)
    samples = ctx.layout.local_sample_indices(ctx.position.dp_index, ctx.position.pp_index)
    with microbatch.step(ctx.device, ctx.precision), \
            rng.step_scope(info.seed, ctx.step, samples, ctx.position.samples_per_micro_batch):
        forward_backward(ctx, model, info, x, y, loss_fn, scale * fp16_scale, total, return_outputs)
    ctx.step += 1
    if info.mixed is not None:
        info.mixed.sync(model)
    if ctx.layout.pp > 1:
        sync_tied_grads(ctx, model, info)
    if info.expert_fqns:
        sync_expert_grads(ctx, model, info)
    if ctx.loss_scaler is not None and not unscale(ctx, model):
        earlier = {}  # overflow: the whole step is skipped (every gradient None)
    restore_grads(model, earlier)
    return global_loss(ctx, total / fp16_scale)


def step_info(ctx: TrainingRank, model: nn.Module) -> ModelInfo:
    """The parallelised model's record; also for ``torch.compile(model)`` of it
    (one stage: the compiled wrapper runs the forward)."""
    info = ctx.model_info(model)
    if info is None:
        raise HetplanError("train_step needs the model returned by ctx.parallelize")
    if info.model is not model and ctx.layout.num_chunks > 1:
        raise HetplanError(
            "a pipelined model runs each stage's layers, never the compiled whole model; compile each layer "
            "with ctx.parallelize(build_model, compile=True) instead of torch.compile(model)"
        )
    return info


def local_inputs(ctx: TrainingRank, inputs: dict[str, torch.Tensor] | None,
                 x: torch.Tensor) -> dict[str, torch.Tensor]:
    """This replica's rows of each keyword input, on this rank's device."""
    if not inputs:
        return {}
    out = {}
    for name, value in inputs.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.size(0) != x.size(0):
            raise HetplanError(f"keyword input {name!r} must be a tensor with the batch first "
                               f"({x.size(0)} rows, as the batch's inputs), sliced per micro-batch")
        out[name] = ctx.local_batch(value).to(ctx.device)
    return out


def check_staged_inputs(part: nn.Module, inputs: dict[str, Any]) -> None:
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


def _check_batch_shapes(ctx: TrainingRank, info: ModelInfo, shapes: tuple[Any, ...]) -> None:
    """Pipelined training keeps the batch shapes of its first step."""
    if info.batch_shapes is None:
        info.batch_shapes = shapes
    elif shapes != info.batch_shapes and ctx.layout.pp > 1:
        raise HetplanError(
            f"batch shapes changed from {info.batch_shapes} to {shapes}: pipelined training keeps the shapes "
            "of the first step (torch pipelining would hang); drop the last partial batch (drop_last=True)"
        )


def _check_chain_once(ctx: TrainingRank, model: nn.Module, info: ModelInfo, x: torch.Tensor) -> None:
    """The first step checks the pipeline chain on the meta copy with its own
    micro-batch and keyword inputs (every rank alike, before the pipeline's
    first message), and hands the keyword inputs' routes to the parts."""
    if info.chain_probe is None:
        return
    b = max(1, ctx.position.samples_per_micro_batch)
    routes = check_chain(info.chain_probe, ctx.layout.layer_names, (x[:b],),
                         {k: v[:b] for k, v in info.step_inputs.items()})
    for part in {id(p): p for p in [model, *info.parts]}.values():
        if isinstance(part, par.PipelinePart):
            part.kwarg_routes = routes
    info.chain_probe = None


def forward_backward(ctx: TrainingRank, model: nn.Module, info: ModelInfo, x: torch.Tensor, y: torch.Tensor,
                     loss_fn: Callable[..., torch.Tensor], scale: float, total: torch.Tensor,
                     return_outputs: bool) -> None:
    """All micro-batches of the step; their scaled losses are added to ``total``."""
    if ctx.layout.pp > 1:
        losses = pipeline_step(ctx, info, x, y, loss_fn, scale, return_outputs)
        if losses:
            total += torch.stack([t.detach().float() for t in losses]).sum()
        return
    m = ctx.plan.num_micro_batches
    b = ctx.position.samples_per_micro_batch
    outputs = []
    for k in range(m):
        _set_syncing(info, k == m - 1)
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
    ctx.last_outputs = outputs if return_outputs else None


def _set_syncing(info: ModelInfo, last: bool) -> None:
    """``set_accumulating`` only when the state changes (twice a step with
    micro-batches, once a run without), not a Python walk over every wrapped
    module per micro-batch; the flags persist on the FSDP2 modules."""
    if info.syncing is not last:
        par.set_accumulating(info.sync_modules, last)
        info.syncing = last


def pipeline_step(ctx: TrainingRank, info: ModelInfo, x: torch.Tensor, y: torch.Tensor,
                  loss_fn: Callable[..., Any], scale: float, return_outputs: bool) -> list[torch.Tensor]:
    """The micro-batches through the pipeline; this rank's micro-batch losses (last stage)."""
    info.loss_fn, info.loss_weight = loss_fn, scale
    if ctx.layout.heterogeneous:
        staged = getattr(info.parts[-1], "staged", None)
        if staged is not None:  # an HF model's loss sees its output class
            loss_fn = functools.partial(_loss_of_output, loss_fn, staged.wrap_output)
        losses, outputs = info.stages[0].step(x if ctx.is_first_stage else None,
                                              y if ctx.is_last_stage else None, loss_fn, scale,
                                              ctx.plan.num_micro_batches, ctx.layout.schedule,
                                              info.step_inputs, keep_outputs=return_outputs)
        ctx.last_outputs = outputs if ctx.is_last_stage and return_outputs else None
        return losses
    if info.schedule is None:
        info.schedule = _schedule(ctx, info)
    losses: list[torch.Tensor] = []
    args = (x,) if ctx.is_first_stage else ()
    target = y if ctx.is_last_stage else None
    out = info.schedule.step(*args, target=target, losses=losses if ctx.is_last_stage else None,
                             return_outputs=return_outputs, **info.step_inputs)
    ctx.last_outputs = out if return_outputs else None
    return losses


def _schedule(ctx: TrainingRank, info: ModelInfo) -> Any:
    """torch pipelining's schedule of the plan, with ``scale_grads=False``: the
    loss is scaled instead (on torch 2.13 ``scale_grads=True`` rescales earlier
    steps' gradients too when ``step()`` is called several times)."""
    from torch.distributed import pipelining as pl  # lazy: only pipelined runs need it

    staged = getattr(info.parts[-1], "staged", None)  # an HF model's loss sees its output class

    @microbatch.loss
    def scaled_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if staged is not None:
            output = staged.wrap_output(output)
        return info.loss_fn(output, target) * info.loss_weight

    m = ctx.plan.num_micro_batches
    kind = ctx.layout.schedule
    if kind == "interleaved-1f1b":
        return pl.ScheduleInterleaved1F1B(info.stages, m, loss_fn=scaled_loss, scale_grads=False)
    if kind == "1f1b":
        return pl.Schedule1F1B(info.stages[0], m, loss_fn=scaled_loss, scale_grads=False)
    return pl.ScheduleGPipe(info.stages[0], m, loss_fn=scaled_loss, scale_grads=False)


def _loss_of_output(loss_fn: Callable[..., torch.Tensor], wrap: Callable[[Any], Any], output: Any,
                    target: torch.Tensor) -> torch.Tensor:
    return loss_fn(wrap(output), target)


# --- gradients the data-parallel wrappers do not sync -----------------------------------------------
def _tied_fqns(ctx: TrainingRank, info: ModelInfo) -> list[str]:
    """This rank's copies of weights tied across stages."""
    names = ctx.layout.layer_names
    out = []
    for canon, alias in info.tied_pairs:
        for fqn in (canon, alias):
            if ctx.layout.pp_index_of_layer(par.owner_layer(fqn, names)) == ctx.position.pp_index:
                out.append(fqn)
    return out


def take_grads(ctx: TrainingRank, model: nn.Module, info: ModelInfo, every: bool) -> dict[str, torch.Tensor]:
    """Set aside gradients held from earlier ``train_step`` calls
    (accumulation), to add back at the end: those of tied copies, whose
    sync adds the two copies' gradients and must add only this call's (or an
    earlier call's would count twice); with ``every`` (fp16) all of them,
    since only this call's are loss-scaled (and a stage of mixed TP degrees,
    whose averaging of this call's gradients would divide earlier ones again)."""
    earlier = {}
    names = [n for n, _ in model.named_parameters()] if every else _tied_fqns(ctx, info) + info.expert_fqns
    for fqn in names:
        p = model.get_parameter(fqn)
        if p.grad is not None:
            earlier[fqn] = p.grad
            p.grad = None
    return earlier


def restore_grads(model: nn.Module, earlier: dict[str, torch.Tensor]) -> None:
    """Add the gradients :func:`take_grads` set aside back to this call's: one
    ``_foreach_add_`` per (device, dtype) over the local tensors, not a kernel per parameter."""
    into, add = [], []
    for fqn, grad in earlier.items():
        p = model.get_parameter(fqn)
        if p.grad is None:
            p.grad = grad
            continue
        if getattr(grad, "placements", None) != getattr(p.grad, "placements", None):
            grad = grad.redistribute(p.grad.device_mesh, p.grad.placements)
        into.append(_local(p.grad))
        add.append(_local(grad))
    for a, b in _by_device_dtype(into, add):
        torch._foreach_add_(a, b)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (grouped kernels take plain tensors of one device), else the tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def _by_device_dtype(*lists: list[torch.Tensor]) -> list[tuple[list[torch.Tensor], ...]]:
    """Parallel lists split by the first list's (device, dtype), as torch's grouped ``_foreach`` kernels need."""
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], ...]] = {}
    for items in zip(*lists):
        key = (items[0].device, items[0].dtype)
        for out, t in zip(groups.setdefault(key, tuple([] for _ in lists)), items):
            out.append(t)
    return list(groups.values())


def _tied_copies(ctx: TrainingRank, model: nn.Module,
                 info: ModelInfo) -> Iterator[tuple[int, int, nn.Parameter]]:
    """This rank's copies of weights tied across stages: (the lower and the
    higher stage holding a copy, this rank's copy), its gradient set (zeros if
    none) and laid out as the parameter (a vocabulary-parallel embedding's
    gradient comes back replicated)."""
    names, pos = ctx.layout.layer_names, ctx.position
    for canon, alias in info.tied_pairs:
        a, b = (ctx.layout.pp_index_of_layer(par.owner_layer(fqn, names)) for fqn in (canon, alias))
        if a == b or pos.pp_index not in (a, b):
            continue
        p = model.get_parameter(canon if pos.pp_index == a else alias)
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        yield min(a, b), max(a, b), p


def sync_tied_grads(ctx: TrainingRank, model: nn.Module, info: ModelInfo) -> None:
    """Copies of a weight tied across stages (embedding / LM head) get the
    sum of both gradients, as the single tied tensor would (Megatron's
    embedding group); equal values and equal updates keep them in sync. One
    coalesced all-reduce per tie group (and dtype), however many weights it
    ties, the groups in one order on every rank (each rank's collectives a
    subsequence of one global order: no two ranks wait on each other)."""
    if not info.tied_pairs:
        return
    if ctx.layout.heterogeneous:
        _sync_tied_grads_full(ctx, model, info)
        return
    pos = ctx.position
    row = pos.dp_index * ctx.layout.cp + pos.cp_index
    for key, params in _by_tie_group(_tied_copies(ctx, model, info), (row, pos.tp_index)):
        for (grads,) in _by_device_dtype([_local(p.grad) for p in params]):
            all_reduce_coalesced(grads, ctx.tie_groups[key])


def _by_tie_group(copies: Iterator[tuple[int, int, nn.Parameter]],
                  where: tuple[int, int]) -> list[tuple[tuple[int, int, int, int], list[nn.Parameter]]]:
    """This rank's tied copies by the tie group that joins them (the stages
    ``a < b`` and ``where``: this rank's (dp x cp row, tp index), or (-1, -1)),
    in sorted group order."""
    groups: dict[tuple[int, int, int, int], list[nn.Parameter]] = {}
    for a, b, p in copies:
        groups.setdefault((a, b, *where), []).append(p)
    return sorted(groups.items(), key=lambda item: item[0])


def _sync_tied_grads_full(ctx: TrainingRank, model: nn.Module, info: ModelInfo) -> None:
    """Tied copies on stages of different (dp, tp) are sharded differently:
    sum the full gradients over both stages' ranks (each rank weighs its
    stage's copy by 1/ranks of the stage), then keep this rank's shard; one
    coalesced all-reduce per tie group and dtype."""
    ranks = len(ctx.layout.stage_ranks(ctx.position.pp_index))
    for key, params in _by_tie_group(_tied_copies(ctx, model, info), (-1, -1)):
        fulls = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone() for p in params]
        torch._foreach_div_(fulls, ranks)
        for (group,) in _by_device_dtype(fulls):
            all_reduce_coalesced(group, ctx.tie_groups[key])
        for p, full in zip(params, fulls):
            if isinstance(p.grad, DTensor):
                local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
                p.grad.to_local().copy_(local)
            else:
                p.grad.copy_(full)


def sync_expert_grads(ctx: TrainingRank, model: nn.Module, info: ModelInfo) -> None:
    """Expert gradients: sum over the ranks holding the same experts (the
    expert-data-parallel group) and divide by ``dp * cp``, as FSDP averages
    the dense gradients over ``dp * cp`` (hetplan.runtime.ep)."""
    edp_group = ctx.ep_mesh["edp"].get_group() if ctx.ep_mesh["edp"].size() > 1 else None
    grads = []
    for fqn in info.expert_fqns:
        p = model.get_parameter(fqn)
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(_local(p.grad))
    for (group,) in _by_device_dtype(grads):
        if edp_group is not None:
            all_reduce_coalesced(group, edp_group)
        torch._foreach_div_(group, ctx.stage_dp * ctx.layout.cp)


def all_reduce_coalesced(tensors: list[torch.Tensor], group: Any) -> None:
    """Sum ``tensors`` over ``group`` in one collective: flattened into one
    buffer and copied back (as DDP's buckets do), not one all-reduce per tensor,
    which pays the group's latency once per tensor. One contiguous tensor is
    reduced in place (no copy)."""
    if len(tensors) == 1 and tensors[0].is_contiguous():
        dist.all_reduce(tensors[0], group=group)
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    torch._foreach_copy_(tensors, [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in tensors]), tensors)])


def unscale(ctx: TrainingRank, model: nn.Module) -> bool:
    """fp16: unscale this call's gradients; on overflow anywhere drop them all.
    The step's one host sync: whether to skip the step is decided on the host,
    as torch's GradScaler.step decides it (``found_inf.item()``)."""
    assert ctx.loss_scaler is not None
    params = [p for p in model.parameters() if p.grad is not None]
    if ctx.loss_scaler.unscale([p.grad for p in params], ctx.device):
        return True
    for p in model.parameters():
        p.grad = None
    note = "fp16 loss scaling: a step overflowed and was skipped (gradients left None)"
    if note not in ctx.notes:
        ctx.notes.append(note)
    return False


def global_loss(ctx: TrainingRank, total: torch.Tensor) -> torch.Tensor:
    """The global-batch mean loss, on every rank: the last stage's replicas'
    sums added up. It stays on the device (a 0-dim tensor): reading it is the
    caller's sync. The all-reduce is not waited for here (a blocking one stops
    the host every step, which a plain DDP loop does not): the loss waits for
    it when first used (hetplan.runtime.pending), and ``ctx.close`` at the latest."""
    if not ctx.distributed:
        return total
    contributes = ctx.is_last_stage and ctx.position.tp_index == 0
    if not contributes:
        total = torch.zeros_like(total)
    ctx.pending_loss = pending.mean_over(total, ctx.layout.stage_dp(ctx.layout.pp - 1) * ctx.layout.cp)
    return ctx.pending_loss


# --- gradient clipping ----------------------------------------------------------------------------
def clip_grad_norm_(ctx: TrainingRank, model: nn.Module, aliases: dict[str, str], max_norm: float
                    ) -> torch.Tensor:
    """Clip gradients by their global norm over the whole model (all stages,
    shards and replicas; a tied weight counted once: ``aliases``). Returns the
    norm, a 0-dim tensor on the device (no host sync), as
    ``torch.nn.utils.clip_grad_norm_(foreach=True)`` computes it: one grouped
    norm kernel per layout and one grouped multiply, the clip coefficient
    clamped to 1 instead of a branch on its value."""
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
    sq = torch.zeros((), device=ctx.device, dtype=torch.float32)
    for group in alike.values():
        n = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(group, 2, dtype=torch.float32)))
        if isinstance(n, DTensor):
            n = n.full_tensor()
        sq += n * n
    if ctx.distributed and ctx.layout.pp > 1:
        # every rank of a stage holds the same sum (norms of DTensors are global): add the stages up
        sq /= len(ctx.layout.stage_ranks(ctx.position.pp_index))
        dist.all_reduce(sq)
    norm = sq.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # 1e-6: torch.nn.utils.clip_grad_norm_'s own
    for (group,) in _by_device_dtype([_local(g) for g in grads]):
        torch._foreach_mul_(group, coef.to(group[0].device))
    return norm


def why_torch_clipping_is_wrong(layout: PlanLayout) -> str:
    """Why ``torch.nn.utils.clip_grad_norm_`` would clip this plan's model
    wrongly ("" when it would not; hetplan.runtime.clip_guard)."""
    if layout.num_chunks > 1:
        return "each pipeline stage would be clipped by the norm of its own gradients"
    if layout.max_tp > 1:
        return "it cannot take one norm over tensor-parallel shards"
    if layout.ep > 1:
        return "it cannot take one norm over expert-parallel shards"
    return ""
