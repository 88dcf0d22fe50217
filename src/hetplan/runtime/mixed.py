"""Stages whose dp replicas run different TP degrees (``Stage.replica_tp``).

Sailor's plans put replicas of different GPU types in one stage, each with its
own TP degree: replica ``r`` runs ``replica_tp[r]`` ranks, and ``tp`` (the
largest degree) cuts every TP-sharded dimension into ``tp`` equal chunks;
rank ``i`` of replica ``r`` holds chunks ``i*k .. i*k + k - 1`` with ``k =
tp // replica_tp[r]`` (hetplan.plan.spec). Each replica builds its own TP
mesh and trains its ``dp_split`` share of each micro-batch with the loss
scaled by ``b_r * dp / B`` (hetplan.plan.layout.PlanLayout.loss_scale), as
an uneven data split does. No data-parallel wrapper can average gradients
sharded differently per replica, so the step does it here:

* a TP-sharded parameter: for each chunk ``c``, sum over the ``dp`` ranks
  holding it (one per replica, the *chunk group* of ``c``) and divide by
  ``dp``;
* a TP-replicated parameter: every rank of the stage holds a copy; each
  weighs its own by ``1 / replica_tp[r]`` before the sum over the stage, so
  each replica counts once.

Which dimension a parameter is sharded along is read from the DTensors of the
ranks that shard it and exchanged once over the stage (a replica at TP 1 holds
plain tensors); ranks that disagree, or a sharded dimension ``tp`` does not
divide, stop every rank of the stage with the same one-line error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from hetplan.errors import HetplanError
from hetplan.plan.layout import PlanLayout, RankPosition
from hetplan.runtime.step import all_reduce_coalesced

STAGE = -1  # key of a stage's whole group in MixedGroups (chunks are 0 .. tp - 1)

MixedGroups = dict[tuple[int, int], Any]  # (stage, chunk or STAGE) -> process group
LayoutView = dict[str, tuple[tuple[int, ...], tuple[int, ...], int | None]]  # name -> (full shape, local shape, TP dim)


def chunk_holders(layout: PlanLayout, stage: int, chunk: int) -> list[int]:
    """The ranks holding chunk ``chunk`` of the stage's TP-sharded dimensions, one per replica."""
    tp = layout.stage_tp(stage)
    rows = layout.stage_mesh_ranks(stage)
    return [row[chunk // (tp // layout.replica_tp(stage, r))] for r, row in enumerate(rows)]


def make_groups(layout: PlanLayout) -> MixedGroups:
    """The chunk groups and whole-stage group of every stage of mixed TP
    degrees; every rank makes every group, in one order (``dist.new_group`` is
    collective over the world)."""
    groups: MixedGroups = {}
    for j, stage in enumerate(layout.plan.stages):
        if stage.replica_tp is None:
            continue
        for c in range(stage.tp):
            groups[(j, c)] = dist.new_group(chunk_holders(layout, j, c))
        groups[(j, STAGE)] = dist.new_group(sorted(layout.stage_ranks(j)))
    return groups


@dataclass(frozen=True)
class ParamLayout:
    """How the stage lays out one parameter: its full shape and the dimension TP shards (None: replicated)."""

    shape: tuple[int, ...]
    dim: int | None


@dataclass
class MixedSync:
    """This rank's gradient averaging across replicas of different TP degrees (module doc)."""

    groups: MixedGroups
    stage: int
    tp: int  # the stage's tp: chunks per sharded dimension
    dp: int
    replica_tp: int  # this rank's replica's degree
    tp_index: int
    layouts: dict[str, ParamLayout]

    @property
    def held_chunks(self) -> range:
        """The chunks of every sharded dimension this rank holds, in order."""
        k = self.tp // self.replica_tp
        return range(self.tp_index * k, (self.tp_index + 1) * k)

    def sync(self, model: nn.Module) -> None:
        """Average this step's gradients over the stage's replicas (module doc);
        chunk groups in ascending order on every rank, then the stage group,
        so each rank's collectives follow one global order."""
        sharded: dict[int, list[torch.Tensor]] = {c: [] for c in self.held_chunks}
        replicated: list[torch.Tensor] = []
        for name, p in model.named_parameters():
            grad = _local_grad(p)
            where = self.layouts[name]
            if where.dim is None:
                replicated.append(grad)
                continue
            width = where.shape[where.dim] // self.tp
            for j, c in enumerate(self.held_chunks):
                sharded[c].append(grad.narrow(where.dim, j * width, width))
        for c, views in sharded.items():
            if views:
                all_reduce_coalesced(views, self.groups[(self.stage, c)])
                torch._foreach_div_(views, self.dp)
        if replicated:
            torch._foreach_div_(replicated, self.replica_tp * self.dp)
            all_reduce_coalesced(replicated, self.groups[(self.stage, STAGE)])


def _local_grad(p: nn.Parameter) -> torch.Tensor:
    """The local gradient of ``p`` (zeros where this step left none), laid out as the parameter."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    if isinstance(p.grad, DTensor):
        if p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        return p.grad.to_local()
    return p.grad


def param_layouts(model: nn.Module) -> LayoutView:
    """This rank's view of its parameters: name -> (full shape, local shape,
    TP-sharded dimension or None). A plain tensor is taken as replicated."""
    out: LayoutView = {}
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            out[name] = (tuple(p.shape), tuple(p.shape), None)
            continue
        placements = tuple(p.placements)
        if len(placements) != 1 or not isinstance(placements[0], (Shard, Replicate)):
            raise HetplanError(f"parameter {name!r} is laid out as {placements} on its TP mesh; a stage of mixed TP "
                               "degrees syncs only parameters sharded along one dimension or replicated")
        dim = placements[0].dim if isinstance(placements[0], Shard) else None
        out[name] = (tuple(p.shape), tuple(p.to_local().shape), dim)
    return out


def stage_views(layout: PlanLayout, stage: int, mine: LayoutView, group: Any) -> list[LayoutView]:
    """Every rank's :func:`param_layouts` of ``stage``, in rank order, from this
    rank's (``mine``): gathered over the stage's group (the replay, which runs
    one rank, answers it: ``runtime.replay.MixedViews``)."""
    views: list[Any] = [None] * len(layout.stage_ranks(stage))
    dist.all_gather_object(views, mine, group=group)
    return views


def view_at_degree(view: LayoutView, degree: int) -> LayoutView:
    """What a rank of a replica at TP ``degree`` holds, from the view of a rank
    that shards (TP > 1): each sharded parameter's dimension cut into ``degree``
    equal parts (``agree_layouts`` requires them equal), plain full tensors at degree 1."""
    out: LayoutView = {}
    for name, (shape, _, dim) in view.items():
        if dim is None or degree == 1:
            out[name] = (shape, shape, None)
        else:
            out[name] = (shape, shape[:dim] + (shape[dim] // degree,) + shape[dim + 1:], dim)
    return out


def agree_layouts(views: list[LayoutView],
                  degrees: list[int], tp: int) -> dict[str, ParamLayout]:
    """One layout per parameter from every rank's view (``degrees``: each
    view's replica TP degree): the sharded dimension as the ranks with TP > 1
    see it, checked to be the same on all of them and divisible by ``tp``;
    raises the same HetplanError on every rank otherwise."""
    layouts: dict[str, ParamLayout] = {}
    for name in views[0]:
        seen = {view[name][2] for view, t in zip(views, degrees) if t > 1 and name in view}
        shapes = {view[name][0] for view in views if name in view}
        if len(seen) > 1 or len(shapes) > 1 or any(name not in view for view in views):
            raise HetplanError(f"parameter {name!r} is laid out differently by the replicas of a stage of mixed "
                               "TP degrees; its TP plan must shard it the same way at every degree")
        dim = seen.pop() if seen else None
        shape = shapes.pop()
        if dim is None and any(view[name][1] != shape for view in views):
            raise HetplanError(f"parameter {name!r} is sharded outside DTensor (local shapes differ across "
                               "replicas); a stage of mixed TP degrees needs DTensor tensor parallelism")
        if dim is not None and shape[dim] % tp:
            raise HetplanError(f"parameter {name!r} has {shape[dim]} rows along its TP-sharded dimension {dim}, "
                               f"which tp={tp} does not divide; a stage of mixed TP degrees needs equal chunks")
        layouts[name] = ParamLayout(shape, dim)
    return layouts


def mixed_sync(layout: PlanLayout, position: RankPosition, groups: MixedGroups, model: nn.Module
               ) -> MixedSync | None:
    """This rank's :class:`MixedSync` if its stage mixes TP degrees (None
    otherwise); exchanges the parameter layouts over the stage (collective
    over the stage's ranks)."""
    j = position.pp_index
    if layout.plan.stages[j].replica_tp is None:
        return None
    ranks = sorted(layout.stage_ranks(j))
    views = stage_views(layout, j, param_layouts(model), groups[(j, STAGE)])
    degrees = [layout.replica_tp(j, layout.position(r).dp_index) for r in ranks]
    tp = layout.stage_tp(j)
    return MixedSync(groups, j, tp, layout.stage_dp(j), layout.replica_tp(j, position.dp_index), position.tp_index,
                     agree_layouts(views, degrees, tp))
