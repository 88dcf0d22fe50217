"""A model's per-layer numbers as numpy arrays, built once per model.

The cost kernel works on whole layer vectors instead of one LayerSpec at a
time: a stage of layers ``[a, b)`` is a slice or a prefix-sum difference, and
a planner's table over every layer is one numpy expression.

Tied weights (an embedding and the LM head sharing one matrix) are described
here once for every cost: a stage that holds several layers of a tied group
holds, communicates and updates the shared weight once. ``tied_duplicate``
marks the layers whose ``tied_params`` an earlier layer of their group already
owns, and ``tied_previous`` names that nearest earlier layer, so "does layer
``l``'s group have an earlier member in ``[a, b)``" is ``a <= tied_previous[l]``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from hetplan.model.layers import CAUSAL_KINDS
from hetplan.model.runtime_memory import LayerMemory
from hetplan.model.runtime_time import LayerRun
from hetplan.model.spec import LayerSpec, ModelSpec


@dataclass(frozen=True)
class LayerArrays:
    """Per-layer attributes of a ModelSpec (per sample, see ``LayerSpec``)."""

    num_layers: int
    params: np.ndarray
    params_tp_replicated: np.ndarray
    tied_params: np.ndarray
    tied_previous: np.ndarray  # index of the nearest earlier layer of the same tied group, or -1
    fwd_flops: np.ndarray
    fwd_mem_bytes: np.ndarray
    attention_flops: np.ndarray
    gemm_count: np.ndarray
    act_bytes: np.ndarray
    act_tp_replicated_bytes: np.ndarray
    act_attention_core_bytes: np.ndarray
    input_bytes: np.ndarray
    output_bytes: np.ndarray
    tp_comm_bytes: np.ndarray
    profile_keys: tuple[str, ...]
    seq_len: int = 0  # tokens per sample: sets the attention kernel's efficiency
    attention_fused: np.ndarray | None = None  # FlashAttention-style kernel (no score matrix)
    attention_causal: np.ndarray | None = None  # a decoder's causal mask
    gemm_dim: np.ndarray | None = None  # typical dimension of a layer's weight matrices (TP 1)
    kv_bytes: np.ndarray | None = None  # self-attention K and V per sample (context parallelism)
    attention_window: np.ndarray | None = None  # tokens a sliding-window attention sees (0: whole sequence)
    expert_params: np.ndarray | None = None  # routed-expert parameters (expert parallelism divides them)
    expert_flops: np.ndarray | None = None  # routed-expert part of fwd_flops
    dispatch_bytes: np.ndarray | None = None  # bytes of one all-to-all per sample
    expert_tokens: np.ndarray | None = None  # tokens one routed expert gets per sample without EP
    act_linear_input_bytes: np.ndarray | None = None  # linear layers' saved inputs (FP8 under FP8 training)
    act_linear_input_replicated_bytes: np.ndarray | None = None  # the part TP does not divide
    tp_replicated: np.ndarray | None = None  # bool: the layer runs whole on every TP rank (LayerSpec.tp_replicated)
    # what the code that trains keeps beyond a ModelSpec's columns (``runtime_arrays``; None: nothing)
    act_undivided_bytes: np.ndarray | None = None  # part of act_tp_replicated_bytes sequence parallelism keeps whole
    act_outside_bytes: np.ndarray | None = None  # part of that a recomputed layer keeps too (its loss)
    act_held_bytes: np.ndarray | None = None  # part of that held until the micro-batch's backward ends (the logits)
    working_bytes: np.ndarray | None = None  # transient bytes per sample its backward adds (the loss's gradients)
    cast_params: np.ndarray | None = None  # dense weights autocast copies per micro-batch (TP divides them)
    act_fixed_bytes: np.ndarray | None = None  # kept once per micro-batch whatever its size (indices, tables)
    cast_expert_params: np.ndarray | None = None  # routed-expert weights copied alike (TP and EP divide them)
    largest_param: np.ndarray | None = None  # elements of the largest dense parameter tensor (TP divides it)
    largest_expert_param: np.ndarray | None = None  # elements of the stacked expert weights (TP and EP divide them)
    # how the code that trains spends time beyond a ModelSpec's columns (``runtime_time_arrays``; None: nothing)
    weight_fwd_bytes: np.ndarray | None = None  # per micro-batch: weight casts (forward)
    weight_bwd_bytes: np.ndarray | None = None  # per micro-batch: gradient casts and accumulation (backward)
    host_ops_fwd: np.ndarray | None = None  # operators the host dispatches per micro-batch, forward
    host_ops_bwd: np.ndarray | None = None  # and backward
    loss_traffic_bytes: np.ndarray | None = None  # per sample: the loss's part of fwd_mem_bytes
    recompute_traffic_bytes: np.ndarray | None = None  # per sample: the part of fwd_mem_bytes full recompute reruns
    recompute_gemm_share: np.ndarray | None = None  # share of the matmul FLOPs full recompute reruns
    host_ops_recompute: np.ndarray | None = None  # operators full recompute adds to the backward per micro-batch
    # how the target tool recomputes under "selective" (``cost.targets.target_arrays``; None: the attention core)
    op_ac_gemm_share: np.ndarray | None = None  # share of linear FLOPs torchtitan's op AC redoes (NaN: core)
    checkpointed: np.ndarray | None = None  # bool: the tool recomputes the layer when the plan says so (None: all)
    graph_kernels_fwd: np.ndarray | None = None  # kernels a compiled layer's graph launches per micro-batch, forward
    graph_kernels_bwd: np.ndarray | None = None  # and backward
    graph_kernels_recompute: np.ndarray | None = None  # and what full recompute reruns of them

    def column(self, name: str) -> np.ndarray:
        """An optional per-layer array, zeros where the model has none."""
        value = getattr(self, name)
        return value if value is not None else np.zeros(self.num_layers)

    def tp_share(self, tp: int) -> np.ndarray:
        """Share of each layer's work one rank of a TP group of ``tp`` does:
        1/tp, or all of it where the layer runs whole on every TP rank."""
        if self.tp_replicated is None:
            return np.full(self.num_layers, 1.0 / tp)
        return np.where(self.tp_replicated, 1.0, 1.0 / tp)

    @property
    def tied_duplicate(self) -> np.ndarray:
        return self.tied_previous >= 0

    def params_per_device(self, tp: int, ep: int = 1) -> np.ndarray:
        """Parameters one rank of a TP group of size ``tp`` holds for each
        layer; with expert parallelism ``ep`` it holds 1/ep of the routed experts."""
        held = (self.params - self.params_tp_replicated) / tp + self.params_tp_replicated
        if ep > 1:
            held = held - self.column("expert_params") * (1.0 - 1.0 / ep) / tp
        return held

    def expert_params_per_device(self, tp: int, ep: int) -> np.ndarray:
        """Routed-expert parameters one device holds per layer (part of ``params_per_device``)."""
        return self.column("expert_params") / (tp * ep)

    def tied_share_per_device(self, tp: int) -> np.ndarray:
        """Per layer: the parameters per device an earlier member of its tied
        group already holds when both sit on one stage (0 for other layers)."""
        return np.where(self.tied_duplicate, self.tied_params / tp, 0.0)



def layer_arrays(model: ModelSpec) -> LayerArrays:
    """The model's layers as arrays (see the module docstring)."""
    layers = model.layers

    def column(name: str) -> np.ndarray:
        return np.array([float(getattr(layer, name)) for layer in layers])

    replicated = np.array([layer.tp_replicated for layer in layers], dtype=bool)

    def whole_where_replicated(name: str, whole: str) -> np.ndarray:
        """A "TP does not divide" column: all of ``whole`` on layers that run whole on every TP rank."""
        return np.where(replicated, column(whole), column(name))

    previous: list[int] = []
    last_of_group: dict[str, int] = {}
    for i, layer in enumerate(layers):
        group = layer.tied_group
        previous.append(last_of_group.get(group, -1) if group else -1)
        if group:
            last_of_group[group] = i
    return LayerArrays(
        num_layers=len(layers),
        params=column("params"),
        params_tp_replicated=whole_where_replicated("params_tp_replicated", "params"),
        tied_params=column("tied_params"),
        tied_previous=np.array(previous, dtype=np.int64),
        fwd_flops=column("fwd_flops"),
        fwd_mem_bytes=column("fwd_mem_bytes"),
        attention_flops=column("attention_flops"),
        gemm_count=column("gemm_count"),
        act_bytes=column("act_bytes"),
        act_tp_replicated_bytes=whole_where_replicated("act_tp_replicated_bytes", "act_bytes"),
        act_attention_core_bytes=column("act_attention_core_bytes"),
        input_bytes=column("input_bytes"),
        output_bytes=column("output_bytes"),
        tp_comm_bytes=np.where(replicated, 0.0, column("tp_comm_bytes")),
        profile_keys=tuple(layer.profile_key for layer in layers),
        seq_len=int(model.seq_len or 0),
        attention_fused=np.array([_fused_attention(layer, model.seq_len) for layer in layers]),
        attention_causal=np.array([_causal(layer) for layer in layers]),
        gemm_dim=np.array([_gemm_dim(layer) for layer in layers]),
        kv_bytes=column("kv_bytes"),
        attention_window=column("attention_window"),
        expert_params=column("expert_params"),
        expert_flops=column("expert_flops"),
        dispatch_bytes=column("dispatch_bytes"),
        expert_tokens=np.array([_expert_tokens(layer, model.seq_len) for layer in layers]),
        act_linear_input_bytes=column("act_linear_input_bytes"),
        act_linear_input_replicated_bytes=whole_where_replicated("act_linear_input_replicated_bytes",
                                                                 "act_linear_input_bytes"),
        tp_replicated=replicated if replicated.any() else None,
    )


def runtime_arrays(arrays: LayerArrays, memory: Sequence[LayerMemory]) -> LayerArrays:
    """``arrays`` with the activation columns of what the training code keeps
    (``hetplan.model.runtime_memory``) in place of the ModelSpec's: saved
    bytes and their TP/SP/recompute parts, the layer inputs a fully
    recomputed layer keeps, the loss's working set and the weights autocast
    copies. Layers that run whole on every TP rank keep all of it whole."""
    def column(name: str) -> np.ndarray:
        return np.array([float(getattr(m, name)) for m in memory])

    saved = column("saved")
    whole = arrays.tp_replicated if arrays.tp_replicated is not None else np.zeros(arrays.num_layers, bool)
    return replace(
        arrays, act_bytes=saved, act_tp_replicated_bytes=np.where(whole, saved, column("replicated")),
        act_attention_core_bytes=column("core"), input_bytes=column("boundary"),
        act_linear_input_bytes=None, act_linear_input_replicated_bytes=None,
        act_undivided_bytes=column("undivided"), act_outside_bytes=column("outside"),
        act_held_bytes=column("held"), working_bytes=column("working"), cast_params=column("cast_params"), act_fixed_bytes=column("fixed"),
        cast_expert_params=column("cast_expert_params"), largest_param=column("largest_param"),
        largest_expert_param=column("largest_expert_param"),
    )


def runtime_time_arrays(arrays: LayerArrays, runs: Sequence[LayerRun]) -> LayerArrays:
    """``arrays`` with the time columns of how the training code runs each
    layer (``hetplan.model.runtime_time``): its elementwise traffic, SDPA for
    every attention core, the per-micro-batch weight traffic, the operators
    its host dispatches and, compiled, the kernels its graphs launch."""
    def column(name: str) -> np.ndarray:
        return np.array([float(getattr(r, name)) for r in runs])

    fused = np.array([r.fused for r in runs]) | (arrays.column("attention_fused") > 0)
    return replace(arrays, fwd_mem_bytes=column("traffic"), attention_fused=fused,
                   weight_fwd_bytes=column("weight_fwd"), weight_bwd_bytes=column("weight_bwd"),
                   host_ops_fwd=column("ops_fwd"), host_ops_bwd=column("ops_bwd"),
                   loss_traffic_bytes=column("loss_traffic"), recompute_traffic_bytes=column("recompute_traffic"),
                   recompute_gemm_share=column("recompute_gemm_share"), host_ops_recompute=column("ops_recompute"),
                   graph_kernels_fwd=column("kernels_fwd"), graph_kernels_bwd=column("kernels_bwd"),
                   graph_kernels_recompute=column("kernels_recompute"))


def _expert_tokens(layer: LayerSpec, seq_len: int) -> float:
    """Token copies one routed expert processes per sample when every rank
    runs all experts on its own tokens: ``seq · top_k · capacity / experts``
    (the rows of its matmuls, ``model.layers._moe_mlp``)."""
    if not layer.is_moe or seq_len <= 0:
        return 0.0
    return seq_len * layer.top_k * layer.capacity_factor / layer.num_experts


def _causal(layer: LayerSpec) -> bool:
    """The layer's own mask, or (model files written before LayerSpec.attention) its kind."""
    return layer.attention == "causal" if layer.attention else layer.kind in CAUSAL_KINDS


def _fused_attention(layer: LayerSpec, seq_len: int) -> bool:
    """Whether a layer's attention runs as one fused kernel (FlashAttention /
    SDPA). A fused kernel keeps no score matrix: its saved core activations (a
    log-sum-exp per query row) are far smaller than one score per token pair,
    which is how a fused layer is told from an eager one here."""
    if layer.attention_flops <= 0 or seq_len <= 0:
        return False
    return layer.act_attention_core_bytes * seq_len < layer.attention_flops


def _gemm_dim(layer: LayerSpec) -> float:
    """Geometric-mean side of a layer's weight matrices: sqrt(weights per matmul).
    The attention core's two matmuls (QK^T, scores·V) hold no weights."""
    linear = layer.gemm_count - (2 if layer.attention_flops > 0 else 0)
    weights = layer.params if layer.tp_replicated else layer.params - layer.params_tp_replicated
    if linear <= 0 or weights <= 0:
        return 0.0
    return float(np.sqrt(weights / linear))
