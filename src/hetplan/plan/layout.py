"""Where each rank sits in a Plan: pure Python, no torch.

A :class:`PlanLayout` turns a Plan (and the model's layer names) into what one
process needs to know before any process group exists: which physical GPU it
runs, its pipeline stage(s), its data- and tensor-parallel index, its share of
every micro-batch, and the module names of the model chunk(s) it owns. It also
checks that the runtime can execute the plan, with one clear line naming what
to change when it cannot. Every rank computes the same layout from the same
plan, so every rank fails the same way before any collective runs -- no hang.

Rank order: rank ``i`` runs the ``i``-th smallest device id the plan uses
(node by node, as ClusterSpec numbers devices). On several nodes the launcher
starts one process per plan device on each node; see :mod:`hetplan.runtime.launch`.

Interleaved 1F1B (``schedule == "interleaved-1f1b"`` with ``virtual_stages =
V > 1``): stage ``j`` of the plan says *how many* layers its devices run and on
which devices. The runtime cuts the model into ``pp * V`` chunks in order;
chunk ``c`` runs on the devices of stage ``c % pp`` and the chunks of one
device together hold exactly as many layers as the plan's stage ``j``
(Megatron's and torch pipelining's interleaved layout: device ``j`` owns chunks
``j, j + pp, ...``). With ``V == 1`` the interleaved schedule is plain 1F1B.

Stages may differ in (dp, tp) and in how they split a micro-batch (Metis):
the layout is then *heterogeneous* and the runtime runs its own pipeline
executor (hetplan.runtime.hetero) instead of torch.distributed.pipelining,
which connects stage k to stage k+1 one-to-one. Such plans run GPipe or 1F1B,
without sequence parallelism or interleaving. So do plans with a stage whose
replicas run different TP degrees (``Stage.replica_tp``, Sailor's; also with
one stage): ``stage_mesh_ranks`` then has one row of ``cp * replica_tp[r]``
ranks per replica and ``replica_tp(stage, r)`` says each replica's degree.

Context and expert parallelism (``cp``, ``ep``): a stage's devices are ``dp x
cp x tp``, TP innermost, then CP, then DP (hetplan.plan.spec). The runtime's mesh is
then ``(pp, dp, cp, tp)``; dense gradients are averaged over the ``dp * cp``
ranks of a TP rank. EP borrows from those ``dp * cp`` ranks: numbered
``i = dp_index * cp + cp_index``, EP rank ``i % ep`` of expert-data-parallel
index ``i // ep`` (consecutive ranks, CP innermost, share an EP group, as
torchtitan borrows EP from its data and context dimensions). Both need equal
(dp, cp, tp, ep) and equal data splits in every stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from hetplan.errors import HetplanError
from hetplan.plan.spec import Plan


class PlanNotSupportedError(HetplanError):
    """The plan is valid, but this runtime cannot execute it (the message says why)."""


@dataclass(frozen=True)
class RankPosition:
    """One process's place in the plan.

    Attributes:
        rank: global rank (torchrun's ``RANK``).
        device: physical GPU id in the plan's cluster.
        pp_index: the plan stage (= pipeline rank) this process runs.
        dp_index, tp_index: replica and tensor-parallel rank inside the stage.
        chunks: pipeline chunk ids this process runs (one, or ``V`` when interleaved).
        samples_per_micro_batch: this replica's share of each micro-batch.
        sample_offset: where that share starts inside a micro-batch.
        cp_index: context-parallel rank inside the replica (which chunk of each sequence).
    """

    rank: int
    device: int
    pp_index: int
    dp_index: int
    tp_index: int
    chunks: tuple[int, ...]
    samples_per_micro_batch: int
    sample_offset: int
    cp_index: int = 0

    def ep_index(self, cp: int, ep: int) -> tuple[int, int]:
        """(expert-data-parallel index, EP rank) of this process (see module doc)."""
        return divmod(self.dp_index * cp + self.cp_index, ep)


@dataclass(frozen=True)
class PlanLayout:
    """The rank layout of a plan the runtime can run (see module doc)."""

    plan: Plan
    layer_names: tuple[str, ...]
    devices: tuple[int, ...]  # plan devices in rank order
    pp: int
    dp: int  # of stage 0 (of every stage unless heterogeneous; see stage_dp)
    tp: int  # of stage 0 (see stage_tp)
    dp_split: tuple[int, ...]  # of stage 0 (see stage_split)
    sequence_parallel: bool
    virtual_stages: int
    schedule: str  # "gpipe", "1f1b" or "interleaved-1f1b" as the runtime runs it
    chunk_layers: tuple[tuple[int, ...], ...]  # layer indices per pipeline chunk, in order
    notes: tuple[str, ...] = ()
    heterogeneous: bool = False  # stages differ in (dp, tp) or dp_split (see module doc)
    cp: int = 1  # context-parallel degree (every stage)
    ep: int = 1  # expert-parallel degree (every stage)

    # --- construction ----------------------------------------------------------
    @staticmethod
    def from_plan(plan: Plan, layer_names: Sequence[str]) -> PlanLayout:
        """Check the plan against what the runtime supports and lay out ranks."""
        names = tuple(layer_names)
        covered = [i for s in plan.stages for i in s.layers]
        if not plan.stages:
            raise PlanNotSupportedError("the plan has no pipeline stages")
        if covered != list(range(len(names))):
            raise PlanNotSupportedError(
                f"the plan's stages cover layers {_ranges(covered)}, but model {plan.model!r} has "
                f"{len(names)} layers (0-{len(names) - 1}); make the plan for this model"
            )
        for j, s in enumerate(plan.stages):
            if len(s.devices) != s.cp * sum(replica_degrees(s)) or len(s.dp_split) != s.dp:
                raise PlanNotSupportedError(
                    f"stage {j}: devices/dp_split do not match dp={s.dp} cp={s.cp} tp={s.tp}")
            if sum(s.dp_split) != plan.micro_batch_size or any(b <= 0 for b in s.dp_split):
                raise PlanNotSupportedError(
                    f"stage {j}: dp_split {list(s.dp_split)} must give every replica >= 1 sample and sum to the "
                    f"micro-batch size {plan.micro_batch_size}"
                )
        first = plan.stages[0]
        heterogeneous = runs_heterogeneous(plan)
        _check_layer_degrees(plan)
        _check_replica_tp(plan)
        _check_plan_cp_ep(plan, heterogeneous)
        if heterogeneous:
            if any(s.sequence_parallel for s in plan.stages):
                raise PlanNotSupportedError(
                    "sequence parallelism in a plan whose stages differ in (dp, tp) or dp_split is not supported: "
                    "activations cross stage boundaries whole; turn sequence_parallel off"
                )
            if plan.schedule == "interleaved-1f1b" and plan.virtual_stages > 1:
                raise PlanNotSupportedError(
                    "interleaved 1F1B needs equal (dp, tp) and dp_split in every stage; use 1f1b or gpipe"
                )
        else:
            for j, s in enumerate(plan.stages):
                if s.sequence_parallel != first.sequence_parallel:
                    raise PlanNotSupportedError(
                        f"stage {j} has sequence_parallel={s.sequence_parallel} but stage 0 has "
                        f"{first.sequence_parallel}: use the same setting in every stage"
                    )
        if plan.micro_batch_size * plan.num_micro_batches != plan.global_batch_size:
            raise PlanNotSupportedError(
                f"micro-batch {plan.micro_batch_size} x {plan.num_micro_batches} micro-batches is not the "
                f"global batch {plan.global_batch_size}"
            )
        all_devices = [d for s in plan.stages for d in s.devices]
        if len(set(all_devices)) != len(all_devices):
            raise PlanNotSupportedError("the plan uses a device twice")
        pp = plan.pp
        notes: list[str] = []
        schedule = plan.schedule
        virtual = plan.virtual_stages if schedule == "interleaved-1f1b" else 1
        if plan.virtual_stages > 1 and schedule != "interleaved-1f1b":
            notes.append(f"virtual_stages={plan.virtual_stages} ignored: only interleaved-1f1b uses model chunks")
        if schedule == "interleaved-1f1b" and virtual == 1:
            schedule = "1f1b"
            notes.append("interleaved-1f1b with one chunk per device is 1F1B; running 1F1B")
        if pp == 1 and (schedule != "gpipe" or virtual > 1):
            schedule, virtual = "gpipe", 1  # one stage: micro-batches run one after another, the order does not matter
        if schedule == "1f1b" and plan.num_micro_batches < pp:
            notes.append(f"1F1B needs at least as many micro-batches as stages ({plan.num_micro_batches} < {pp}); "
                         "with so few it is GPipe, running GPipe")
            schedule = "gpipe"
        if schedule == "interleaved-1f1b":
            rounds = max(1, plan.num_micro_batches // pp)
            if plan.num_micro_batches % rounds:
                raise PlanNotSupportedError(
                    f"interleaved 1F1B needs the number of micro-batches ({plan.num_micro_batches}) to be a "
                    f"multiple of {rounds} (micro-batches // stages); use a multiple of {pp}"
                )
        chunk_layers = interleaved_chunks(plan, virtual)
        return PlanLayout(
            plan=plan, layer_names=names, devices=tuple(sorted(all_devices)), pp=pp, dp=first.dp, tp=first.tp,
            dp_split=tuple(first.dp_split), sequence_parallel=first.sequence_parallel, virtual_stages=virtual,
            schedule=schedule, chunk_layers=chunk_layers, notes=tuple(notes), heterogeneous=heterogeneous,
            cp=first.cp, ep=first.ep,
        )

    # --- queries ---------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_layers)

    def rank_of_device(self, device: int) -> int:
        return self.devices.index(device)

    def stage_dp(self, stage: int) -> int:
        return self.plan.stages[stage].dp

    def stage_tp(self, stage: int) -> int:
        return self.plan.stages[stage].tp

    def replica_tp(self, stage: int, replica: int) -> int:
        """The TP degree of replica ``replica`` of ``stage`` (the stage's tp unless its replicas differ)."""
        return replica_degrees(self.plan.stages[stage])[replica]

    def stage_split(self, stage: int) -> tuple[int, ...]:
        return tuple(self.plan.stages[stage].dp_split)

    @property
    def max_tp(self) -> int:
        return max(s.tp for s in self.plan.stages)

    def stage_mesh_ranks(self, stage: int) -> list[list[int]]:
        """Ranks of one stage as a ``[dp][cp * tp]`` nested list (TP innermost;
        ``cp * replica_tp[r]`` ranks in row ``r`` of a stage of mixed TP degrees)."""
        s = self.plan.stages[stage]
        return [[self.rank_of_device(d) for d in s.replica_devices(r)] for r in range(s.dp)]

    def stage_ranks(self, stage: int) -> list[int]:
        return [r for row in self.stage_mesh_ranks(stage) for r in row]

    def mesh_ranks(self) -> list[list[list[int]]]:
        """Ranks as a ``[pp][dp][tp]`` nested list (TP innermost), for DeviceMesh.
        Only for plans whose stages share (dp, tp)."""
        if self.heterogeneous:
            raise HetplanError("a heterogeneous plan has no single pp x dp x tp mesh; use stage_mesh_ranks")
        return [self.stage_mesh_ranks(j) for j in range(self.pp)]

    def mesh_ranks_cp(self) -> list[list[list[list[int]]]]:
        """Ranks as a ``[pp][dp][cp][tp]`` nested list, for the DeviceMesh of a CP/EP plan."""
        return [[[row[c * self.tp:(c + 1) * self.tp] for c in range(self.cp)] for row in stage]
                for stage in self.mesh_ranks()]

    def ep_mesh_ranks(self) -> list[list[list[list[int]]]]:
        """Ranks as ``[pp][edp][ep][tp]``: the ``dp * cp`` ranks of each TP rank
        (CP innermost) in groups of ``ep`` consecutive ones (module doc)."""
        out = []
        for stage in self.mesh_ranks_cp():
            flat = [cp_row for dp_row in stage for cp_row in dp_row]  # dp * cp rows of tp ranks
            out.append([flat[g * self.ep:(g + 1) * self.ep] for g in range(len(flat) // self.ep)])
        return out

    def sample_range(self, stage: int, dp_index: int) -> tuple[int, int]:
        """[start, end) of replica ``dp_index``'s samples inside each micro-batch of ``stage``."""
        split = self.stage_split(stage)
        start = sum(split[:dp_index])
        return start, start + split[dp_index]

    def position(self, rank: int) -> RankPosition:
        if not 0 <= rank < self.world_size:
            raise HetplanError(f"rank {rank} is outside the plan's {self.world_size} processes")
        device = self.devices[rank]
        for j, s in enumerate(self.plan.stages):
            if device in s.devices:
                dp_index = next(r for r in range(s.dp) if device in s.replica_devices(r))
                tp = replica_degrees(s)[dp_index]
                cp_index, tp_index = divmod(s.replica_devices(dp_index).index(device), tp)
                chunks = tuple(c for c in range(self.num_chunks) if c % self.pp == j)
                start, end = self.sample_range(j, dp_index)
                return RankPosition(rank, device, j, dp_index, tp_index, chunks, end - start, start, cp_index)
        raise AssertionError("device not in any stage")

    def pp_index_of_layer(self, name: str | None) -> int:
        """Pipeline rank (plan stage) running the layer called ``name``."""
        index = self.layer_names.index(name) if name is not None else -1
        for c, layers in enumerate(self.chunk_layers):
            if index in layers:
                return c % self.pp
        raise HetplanError(f"layer {name!r} is not in the plan")

    def chunk_names(self, chunk: int) -> list[str]:
        return [self.layer_names[i] for i in self.chunk_layers[chunk]]

    def loss_scale(self, dp_index: int, stage: int | None = None) -> float:
        """Factor on one micro-batch's mean loss (computed by replica
        ``dp_index`` of the last stage) so that gradients averaged over the dp
        group equal the gradient of the global-batch mean: ``b_r * dp / B``."""
        stage = self.pp - 1 if stage is None else stage
        return self.stage_split(stage)[dp_index] * self.stage_dp(stage) / self.plan.global_batch_size

    def local_sample_indices(self, dp_index: int, stage: int = 0) -> list[int]:
        """Indices into the global batch of the samples replica ``dp_index`` of
        ``stage`` processes in one step, micro-batch after micro-batch."""
        mbs = self.plan.micro_batch_size
        start, end = self.sample_range(stage, dp_index)
        return [k * mbs + i for k in range(self.plan.num_micro_batches) for i in range(start, end)]

    def run_settings(self) -> str:
        """The schedule as run and the plan's ZeRO stages: one stage runs its
        micro-batches in order whatever the plan's schedule says (``from_plan``),
        so the header names both rather than a bare "gpipe" for a 1f1b plan."""
        zeros = sorted({st.zero for s in self.plan.stages for st in s.strategies})
        schedule = self.schedule
        if self.pp == 1 and self.plan.schedule != self.schedule:
            schedule = f"{self.schedule} (plan: {self.plan.schedule}; one stage runs micro-batches in order)"
        return f"{schedule} zero={'/'.join(map(str, zeros))} micro-batches={self.plan.num_micro_batches}"

    def describe(self) -> str:
        chunks = " | ".join(f"{self.layer_names[c[0]]}..{self.layer_names[c[-1]]}" for c in self.chunk_layers)
        if self.heterogeneous:
            stages = " | ".join(
                f"dp{s.dp} tp{'+'.join(map(str, replica_degrees(s))) if s.replica_tp else s.tp}" + ("" if len(set(s.dp_split)) == 1 else f" split {':'.join(map(str, s.dp_split))}")
                for s in self.plan.stages)
            return f"{self.world_size} processes: pp={self.pp} heterogeneous [{stages}] {self.run_settings()} [{chunks}]"
        split = "" if len(set(self.dp_split)) == 1 else f" split {':'.join(map(str, self.dp_split))}"
        cp_ep = (f" cp={self.cp}" if self.cp > 1 else "") + (f" ep={self.ep}" if self.ep > 1 else "")
        return (f"{self.world_size} processes: pp={self.pp} dp={self.dp}{cp_ep} tp={self.tp}{split}"
                f"{' sp' if self.sequence_parallel else ''} {self.run_settings()}"
                f"{f' v={self.virtual_stages}' if self.virtual_stages > 1 else ''} [{chunks}]")


def _check_layer_degrees(plan: Plan) -> None:
    """A layer's own (dp, tp) inside a stage (Galvatron-BMW's per-layer
    strategies) would need its activations regathered between layers of
    different degrees; the runtime runs every layer of a stage at the stage's
    tp, so such a plan would run as another plan than the one costed."""
    for j, s in enumerate(plan.stages):
        for position, strategy in enumerate(s.strategies):
            if strategy.tp and strategy.tp != s.tp:
                raise PlanNotSupportedError(
                    f"stage {j} runs layer {s.layers[position]} at tp={strategy.tp} inside a tp={s.tp} stage, but "
                    "hetplan's runtime runs every layer of a stage at the stage's tp; make the plan with one tp per "
                    "stage")


def replica_degrees(stage: Any) -> tuple[int, ...]:
    """The TP degree of each dp replica of ``stage`` (``replica_tp``, else ``tp`` each)."""
    return tuple(stage.replica_tp) if stage.replica_tp is not None else (stage.tp,) * stage.dp


def _check_replica_tp(plan: Plan) -> None:
    """A stage whose replicas run different TP degrees (``Stage.replica_tp``):
    its shape, and what the runtime runs with it. Each replica builds its own
    TP mesh and the step averages gradients chunk by chunk of the stage's tp
    (hetplan.runtime.mixed); ZeRO, cp, ep, sequence parallelism and
    interleaving would need their shards or groups laid out per replica, which
    the runtime does not do."""
    for j, s in enumerate(plan.stages):
        if s.replica_tp is None:
            continue
        degrees = s.replica_tp
        if len(degrees) != s.dp or max(degrees) != s.tp or any(s.tp % t for t in degrees):
            raise PlanNotSupportedError(
                f"stage {j}: replica_tp {list(degrees)} must have dp={s.dp} entries, each dividing tp={s.tp}, the "
                "largest equal to tp")
        if any(st.zero for st in s.strategies):
            raise PlanNotSupportedError(
                f"stage {j} mixes TP degrees across replicas (replica_tp {list(degrees)}) with ZeRO > 0, which the "
                "runtime does not shard across differently sharded replicas; use zero 0 in that stage")
        uses = [name for name, used in (("cp > 1", s.cp > 1), ("ep > 1", s.ep > 1),
                                        ("sequence parallelism", s.sequence_parallel),
                                        ("interleaved 1F1B", plan.virtual_stages > 1
                                         and plan.schedule == "interleaved-1f1b")) if used]
        if uses:
            raise PlanNotSupportedError(
                f"stage {j} mixes TP degrees across replicas (replica_tp {list(degrees)}) with {uses[0]}, which the "
                "runtime does not run together; plan that stage with one TP degree or without it")


def runs_heterogeneous(plan: Plan) -> bool:
    """Whether the runtime runs ``plan`` on its own pipeline executor
    (``runtime/hetero.py``; module doc): its stages differ in (dp, tp) or
    ``dp_split``, or a stage's replicas mix TP degrees."""
    first = plan.stages[0]
    return any((s.dp, s.tp, tuple(s.dp_split)) != (first.dp, first.tp, tuple(first.dp_split)) or bool(s.replica_tp)
               for s in plan.stages)


def _check_plan_cp_ep(plan: Plan, heterogeneous: bool) -> None:
    """What the runtime's context and expert parallelism need of the plan (one
    line each); what they need of the model: ``preflight.check_model_cp_ep``."""
    first = plan.stages[0]
    if all(s.cp == 1 and s.ep == 1 for s in plan.stages):
        return
    for j, s in enumerate(plan.stages):
        if (s.cp, s.ep) != (first.cp, first.ep):
            raise PlanNotSupportedError(
                f"stage {j} has cp={s.cp} ep={s.ep} but stage 0 has cp={first.cp} ep={first.ep}: the runtime "
                "needs the same cp and ep in every stage")
        if (s.dp * s.cp) % s.ep:
            raise PlanNotSupportedError(f"stage {j}: ep={s.ep} must divide dp x cp = {s.dp * s.cp}")
        if len(set(s.dp_split)) > 1:
            raise PlanNotSupportedError(
                f"stage {j} splits micro-batches unevenly ({':'.join(map(str, s.dp_split))}); with cp or ep > 1 "
                "the runtime needs an even dp_split")
        if s.ep_split is not None and len(set(s.ep_split)) > 1:
            raise PlanNotSupportedError(
                f"stage {j} splits experts unevenly ({':'.join(map(str, s.ep_split))}); the runtime gives every EP "
                "rank the same number of experts: make the plan with an even expert split")
        if s.sequence_parallel:
            raise PlanNotSupportedError(
                "sequence parallelism together with cp or ep > 1 is not supported by the runtime; "
                "turn sequence_parallel off")
    if heterogeneous:
        raise PlanNotSupportedError(
            "cp or ep > 1 needs equal (dp, tp) and data splits in every stage; use one (dp, tp) for all stages")


def tied_layer_groups(spec: Any) -> list[list[str]]:
    """The layers of each tied group of the ModelSpec (``LayerSpec.tied_group``:
    an embedding and LM head sharing a weight) that has more than one layer."""
    groups: dict[str, list[str]] = {}
    for layer in spec.layers:
        if layer.tied_group:
            groups.setdefault(layer.tied_group, []).append(layer.name)
    return [g for g in groups.values() if len(g) > 1]


def interleaved_chunks(plan: Plan, virtual: int) -> tuple[tuple[int, ...], ...]:
    """Layer indices per pipeline chunk (see module doc); also what the cost model
    reads for the chunks' boundaries (``cost/pipeline_memory.py``)."""
    pp = plan.pp
    if virtual == 1:
        return tuple(tuple(s.layers) for s in plan.stages)
    counts = []
    for j, s in enumerate(plan.stages):
        n = len(s.layers)
        if n < virtual:
            raise PlanNotSupportedError(
                f"stage {j} has {n} layers, fewer than virtual_stages={virtual}: every chunk needs a layer"
            )
        base, extra = divmod(n, virtual)
        counts.append([base + (1 if v < extra else 0) for v in range(virtual)])
    chunks, start = [], 0
    for c in range(pp * virtual):
        v, j = divmod(c, pp)
        size = counts[j][v]
        chunks.append(tuple(range(start, start + size)))
        start += size
    return tuple(chunks)


def _ranges(indices: Sequence[int]) -> str:
    if not indices:
        return "none"
    return f"{min(indices)}-{max(indices)} ({len(indices)} entries)"
