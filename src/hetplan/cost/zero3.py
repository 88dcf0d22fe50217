"""ZeRO-3's backward peak on hetplan's runtime, layer by layer.

FSDP2 gathers a ZeRO-3 layer's parameters just before it runs and frees them
after, and reduce-scatters its gradients right after its backward, so what a
ZeRO-3 stage holds at its peak depends on which layer is running: the stage's
peak is the largest over the moments of its layers' backward
(``memory.zero3_backward_moment``), each with what is alive then. The layers
sharing a tied weight are wrapped with the stage's root module, whose
parameters stay gathered for the whole step (``runtime/parallelize.py``
``apply_dp``: ``fully_shard(root, reshard_after_forward=False)``).

``Zero3Layers`` holds a stage's layers as the moments need them, per sample
(what scales with the micro-batch) and per micro-batch (what does not);
``zero3_moment`` evaluates them at a batch size. ``StageCosts`` (one recompute
mode for the stage) and ``mixed.stage_peak_terms`` (per-layer strategies) use
the same two functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from hetplan.cost.memory import Zero3Moment, zero3_backward_moment
from hetplan.cost.ranges import RangeMax

if TYPE_CHECKING:  # the kernel builds the stages that call this module
    from hetplan.cost.kernel import CostKernel


@dataclass(frozen=True)
class Zero3Layers:
    """A ZeRO-3 stage's layers ``[a, b)`` in forward order: per sample what
    each stores for backward (``stored``; of which the loss's, ``loss``, and
    what is still held after its backward, ``held``) and its backward's working
    set (``work``: recomputed activations, the loss's gradients, its MLP's
    activation gradients, ``CostKernel.activation_gradient_bytes``; the loss's
    part ``loss_work``); per micro-batch the 16-bit
    weight copies and indices it keeps (``kept``) or rebuilds with its
    activations (``rebuilt``); in bytes its unsharded gradients and parameters
    (``grads``, ``gathered``: 0 for root layers) and the root's gradients it
    makes (``root_grads``). ``root_weights``: the root layers' parameters,
    gathered for the whole step."""

    stored: np.ndarray
    held: np.ndarray
    work: np.ndarray
    loss: np.ndarray
    loss_work: np.ndarray
    kept: np.ndarray
    rebuilt: np.ndarray
    grads: np.ndarray
    gathered: np.ndarray
    root_grads: np.ndarray
    root_weights: float

    @property
    def one_per_sample(self) -> float:
        """What one micro-batch in flight stores, per sample."""
        return float(self.stored.sum())

    @property
    def one_fixed(self) -> float:
        """And whatever its size."""
        return float(self.kept.sum())


def runs_zero3_moments(kernel: CostKernel, zeros: Sequence[int], group: int, offload: bool,
                       split: Sequence[int]) -> bool:
    """The stage's peak is ZeRO-3's per-layer moments: hetplan's runtime, every
    layer ZeRO-3 over a data-parallel group of more than one, nothing offloaded
    (an offloaded layer's working set is ``CostKernel.offload_working_bytes``),
    every replica taking the same share of a micro-batch (``split``). Uneven
    shares keep the whole-stage terms: replayed on the heterogeneous executor
    (``runtime/hetero.py``), the moments put a 1-sample replica 7.7% below its
    replay, where those terms are within 1%."""
    return kernel.runtime and group > 1 and not offload and all(z >= 3 for z in zeros) and len(set(split)) <= 1


def zero3_layers(kernel: CostKernel, a: int, b: int, tp: int, ep: int, recompute: Sequence[str],
                 sequence_parallel: bool, cp: int, tied: bool = True) -> Zero3Layers:
    """``Zero3Layers`` of layers ``[a, b)`` with recomputation ``recompute``
    per layer (one mode for all: a sequence of one); ``tied=False``: every
    layer wrapped on its own, as where no tied group has two layers in the range."""
    modes = list(recompute) if len(recompute) > 1 else [recompute[0]] * (b - a)
    index = np.arange(a, b)

    def per_mode(table: Callable[[str], np.ndarray]) -> np.ndarray:
        if len(recompute) == 1:
            return table(recompute[0])[a:b]
        return np.array([float(table(mode)[i]) for i, mode in zip(index, modes)])

    stored = per_mode(lambda m: kernel.rank_activation_bytes(tp, m, sequence_parallel, cp))
    work = per_mode(lambda m: kernel.backward_working_bytes(tp, m, sequence_parallel, cp)) \
        + kernel.activation_gradient_bytes(tp, sequence_parallel, cp)[a:b]
    loss, loss_work = (x[a:b] for x in kernel.loss_bytes(cp))
    held = kernel.memory_arrays.column("act_held_bytes")[a:b] / cp
    per_mb = kernel.micro_batch_bytes(tp, ep)[a:b]
    full = np.array([m == "full" for m in modes])
    params = kernel.params_per_device(tp, ep)[a:b]
    if ep > 1:  # routed experts are not FSDP's (apply_dp's ignored_params)
        params = params - kernel.expert_params_per_device(tp, ep)[a:b]
    own, rooted, root_params = _root_split(kernel, a, b, tp, params) if tied else \
        (params, np.zeros(b - a, dtype=bool), np.zeros(b - a))
    return Zero3Layers(stored=stored, held=held, work=work, loss=loss, loss_work=loss_work,
                       kept=np.where(full, 0.0, per_mb), rebuilt=np.where(full, per_mb, 0.0),
                       grads=np.where(rooted, 0.0, own * kernel.grad_bytes),
                       gathered=np.where(rooted, 0.0, own * kernel.weight_bytes),
                       root_grads=root_params * kernel.grad_bytes,
                       root_weights=float(np.where(rooted, own, 0.0).sum() * kernel.weight_bytes))


def _root_split(kernel: CostKernel, a: int, b: int, tp: int,
                params: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(parameters each layer holds, a tied weight once: at its first layer;
    which layers are the root's: those of a tied group with another member in
    ``[a, b)``; the root's parameters whose gradients each layer's backward
    makes, a tied weight's at its last layer, whose backward runs first)."""
    own = params.copy()
    rooted = np.zeros(b - a, dtype=bool)
    share = kernel.tied_share(tp)
    pairs = [(i - a, int(p) - a, float(share[i])) for i, p in enumerate(kernel.arrays.tied_previous)
             if a <= p and i < b]
    for later, first, tied in pairs:
        own[later] -= tied
        rooted[later] = rooted[first] = True
    grads = np.where(rooted, own, 0.0)
    for later, first, tied in pairs:
        grads[later] += tied
        grads[first] -= tied
    return own, rooted, grads


def zero3_moment(layers: Zero3Layers, batch: float) -> Zero3Moment:
    """``memory.zero3_backward_moment`` of ``layers`` for a micro-batch of ``batch`` samples."""
    return zero3_backward_moment(layers.stored * batch + layers.kept, layers.held * batch,
                                 layers.work * batch + layers.rebuilt, layers.loss * batch,
                                 layers.loss_work * batch, layers.grads, layers.gathered, layers.root_grads)


def zero3_moment_table(layers: Zero3Layers, batch: float, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """For every range ``[a, b)`` (``a`` in ``rows``, ``b`` in ``cols``: a matrix) of the model's ``layers`` (built with ``tied=False``): the total of
    ``zero3_moment`` over that range, as ``zero3_backward_moment`` computes it
    (0 where ``a >= b``). A layer's moment depends on the range only through
    the layer after it (its reduce-scatter input; none after the range's last),
    the layer before it (prefetched; none before the range's first), what the
    layers before it in the range stored and what the layers after it hold, so
    the interior layers' largest is one range-maximum table (``RangeMax``) and
    the first and last layer are taken apart."""
    stored = layers.stored * batch + layers.kept
    through = np.cumsum(stored)
    held = np.concatenate(([0.0], np.cumsum(layers.held * batch)))
    work = layers.work * batch + layers.rebuilt
    grads, gathered = layers.grads, layers.gathered
    following = np.append(grads[1:], 0.0)
    previous = np.insert(gathered[:-1], 0, 0.0)

    def moment(after: np.ndarray) -> np.ndarray:  # the larger of a layer's start and end, less what it holds after
        return np.maximum(through + work + gathered + after,
                          through - stored + np.maximum(gathered + grads + after, 2 * grads)) - held[1:]

    inner, last = moment(following) + previous, moment(np.zeros_like(grads)) + previous
    first, alone = inner - previous, last - previous
    starts, ends = np.broadcast_arrays(rows[:, None], cols[None, :])
    valid = ends > starts
    a, z = np.where(valid, starts, 0), np.where(valid, ends - 1, 0)  # the range's first and last layer
    edges = np.where(a == z, alone[a], np.maximum(first[a], last[z]))
    best = np.maximum(RangeMax(inner)[rows + 1, cols - 1], edges)
    prefix = np.concatenate(([0.0], through))
    return np.where(valid, best - prefix[a] + held[np.where(valid, ends, 0)], 0.0)
