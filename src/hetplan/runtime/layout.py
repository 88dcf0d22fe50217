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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hetplan.errors import HetplanError
from hetplan.plan import Plan


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
    """

    rank: int
    device: int
    pp_index: int
    dp_index: int
    tp_index: int
    chunks: tuple[int, ...]
    samples_per_micro_batch: int
    sample_offset: int


@dataclass(frozen=True)
class PlanLayout:
    """The rank layout of a plan the runtime can run (see module doc)."""

    plan: Plan
    layer_names: tuple[str, ...]
    devices: tuple[int, ...]  # plan devices in rank order
    pp: int
    dp: int
    tp: int
    dp_split: tuple[int, ...]
    sequence_parallel: bool
    virtual_stages: int
    schedule: str  # "gpipe", "1f1b" or "interleaved-1f1b" as the runtime runs it
    chunk_layers: tuple[tuple[int, ...], ...]  # layer indices per pipeline chunk, in order
    notes: tuple[str, ...] = ()

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
        first = plan.stages[0]
        for j, s in enumerate(plan.stages):
            if (s.dp, s.tp) != (first.dp, first.tp):
                raise PlanNotSupportedError(
                    f"stage {j} uses dp={s.dp} tp={s.tp} but stage 0 uses dp={first.dp} tp={first.tp}: the runtime "
                    "runs one (dp, tp) for all stages, because torch.distributed.pipelining connects stage k to "
                    "stage k+1 one-to-one inside a pipeline group and cannot re-split activations between stages "
                    "of different widths (see docs/runtime.md); use a plan with equal (dp, tp) in every stage"
                )
            if tuple(s.dp_split) != tuple(first.dp_split):
                raise PlanNotSupportedError(
                    f"stage {j} splits each micro-batch {list(s.dp_split)} over its replicas but stage 0 splits it "
                    f"{list(first.dp_split)}: one replica's samples must flow through the same pipeline, so every "
                    "stage needs the same dp_split"
                )
            if s.sequence_parallel != first.sequence_parallel:
                raise PlanNotSupportedError(
                    f"stage {j} has sequence_parallel={s.sequence_parallel} but stage 0 has "
                    f"{first.sequence_parallel}: use the same setting in every stage"
                )
            if len(s.devices) != s.dp * s.tp or len(s.dp_split) != s.dp:
                raise PlanNotSupportedError(f"stage {j}: devices/dp_split do not match dp={s.dp} tp={s.tp}")
        if plan.micro_batch_size * plan.num_micro_batches != plan.global_batch_size:
            raise PlanNotSupportedError(
                f"micro-batch {plan.micro_batch_size} x {plan.num_micro_batches} micro-batches is not the "
                f"global batch {plan.global_batch_size}"
            )
        if sum(first.dp_split) != plan.micro_batch_size or any(b <= 0 for b in first.dp_split):
            raise PlanNotSupportedError(
                f"dp_split {list(first.dp_split)} must give every replica >= 1 sample and sum to the "
                f"micro-batch size {plan.micro_batch_size}"
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
        if pp == 1 and schedule != "gpipe":
            schedule = "gpipe"  # one stage: micro-batches run one after another, the order does not matter
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
        chunk_layers = _interleave(plan, virtual)
        return PlanLayout(
            plan=plan, layer_names=names, devices=tuple(sorted(all_devices)), pp=pp, dp=first.dp, tp=first.tp,
            dp_split=tuple(first.dp_split), sequence_parallel=first.sequence_parallel, virtual_stages=virtual,
            schedule=schedule, chunk_layers=chunk_layers, notes=tuple(notes),
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

    def mesh_ranks(self) -> list[list[list[int]]]:
        """Ranks as a ``[pp][dp][tp]`` nested list (TP innermost), for DeviceMesh."""
        return [[[self.rank_of_device(d) for d in s.replica_devices(r)] for r in range(s.dp)]
                for s in self.plan.stages]

    def position(self, rank: int) -> RankPosition:
        if not 0 <= rank < self.world_size:
            raise HetplanError(f"rank {rank} is outside the plan's {self.world_size} processes")
        device = self.devices[rank]
        for j, s in enumerate(self.plan.stages):
            if device in s.devices:
                k = s.devices.index(device)
                dp_index, tp_index = divmod(k, s.tp)
                chunks = tuple(c for c in range(self.num_chunks) if c % self.pp == j)
                offset = sum(self.dp_split[:dp_index])
                return RankPosition(rank, device, j, dp_index, tp_index, chunks,
                                    self.dp_split[dp_index], offset)
        raise AssertionError("device not in any stage")

    def chunk_names(self, chunk: int) -> list[str]:
        return [self.layer_names[i] for i in self.chunk_layers[chunk]]

    def loss_scale(self, dp_index: int) -> float:
        """Factor on one micro-batch's mean loss so that gradients averaged over
        the dp group equal the gradient of the global-batch mean: ``b_r * dp / B``."""
        return self.dp_split[dp_index] * self.dp / self.plan.global_batch_size

    def local_sample_indices(self, dp_index: int) -> list[int]:
        """Indices into the global batch of the samples replica ``dp_index``
        processes in one step, micro-batch after micro-batch."""
        mbs, b = self.plan.micro_batch_size, self.dp_split[dp_index]
        off = sum(self.dp_split[:dp_index])
        return [k * mbs + off + i for k in range(self.plan.num_micro_batches) for i in range(b)]

    def describe(self) -> str:
        chunks = " | ".join(f"{self.layer_names[c[0]]}..{self.layer_names[c[-1]]}" for c in self.chunk_layers)
        split = "" if len(set(self.dp_split)) == 1 else f" split {':'.join(map(str, self.dp_split))}"
        return (f"{self.world_size} processes: pp={self.pp} dp={self.dp} tp={self.tp}{split}"
                f"{' sp' if self.sequence_parallel else ''} {self.schedule}"
                f"{f' v={self.virtual_stages}' if self.virtual_stages > 1 else ''} "
                f"m={self.plan.num_micro_batches} [{chunks}]")


def _interleave(plan: Plan, virtual: int) -> tuple[tuple[int, ...], ...]:
    """Layer indices per pipeline chunk (see module doc)."""
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
