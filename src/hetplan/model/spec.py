"""ModelSpec: a model as an ordered list of layers, with what each costs.

Everything is *per sample* at the model's sequence length and training
precision; the cost model multiplies by the micro-batch size. Activation bytes
are split the way Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models", §4) and Galvatron-BMW (§III-C) split them, so that
tensor parallelism, sequence parallelism and (selective or full) recomputation
can each be costed:

* ``act_bytes``              everything one layer keeps for its backward pass;
* ``act_tp_replicated_bytes``  the part tensor parallelism does *not* divide
  (layer-norm inputs, dropout masks, the layer input: Korthikanti's ``10sbh``);
  sequence parallelism divides it too;
* ``act_attention_core_bytes`` the part selective recomputation drops
  (softmax output, its dropout mask and output: Korthikanti's ``5as²b``);
* ``input_bytes``            the layer's input, the only thing full
  recomputation (checkpointing) keeps — Galvatron's "boundary" activation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from hetplan.errors import HetplanError


@dataclass(frozen=True)
class LayerSpec:
    """One layer of a model: its parameters, work and memory, per sample.

    Attributes:
        name: module name in the model (e.g. ``"transformer.h.3"``); pipeline
            splits are written as lists of these names.
        kind: what the layer is ("embedding", "decoder", "encoder", "head", ...);
            layers of the same kind and shape share a ``profile_key``.
        params: number of parameters this layer owns (tied ones counted here too).
        params_tp_replicated: parameters tensor parallelism does not split
            (layer norms, biases of row-parallel linears).
        fwd_flops: forward floating point operations per sample (a multiply-add
            is 2 FLOPs). Backward is costed as twice the forward.
        fwd_mem_bytes: bytes read and written by memory-bound (elementwise)
            kernels in the forward pass per sample; these run at memory
            bandwidth, not at tensor-core speed.
        attention_flops: the part of ``fwd_flops`` in the attention core
            (QK^T and scores·V), recomputed by selective recomputation.
        gemm_count: number of matrix multiplies in the forward pass, used to
            estimate the size of each one for the efficiency curve.
        act_bytes: activation bytes kept for backward, per sample (see module doc).
        act_tp_replicated_bytes: part of ``act_bytes`` not divided by TP.
        act_attention_core_bytes: part of ``act_bytes`` selective recompute drops.
        input_bytes: bytes of the layer's input per sample (checkpoint boundary).
        output_bytes: bytes sent to the next layer per sample (pipeline p2p).
        tp_comm_bytes: bytes all-reduced across the TP group per sample in the
            forward pass (Megatron: 2 per block, one after attention, one after
            the MLP); the backward pass all-reduces the same amount.
        tp_max: how many parallel units tensor parallelism splits (attention
            heads, or KV heads with GQA; filters of a convolution): a TP degree
            must not exceed it and, for a transformer block, must divide it.
            0 means no limit (embeddings, heads, layers TP splits by rows).
        tied_group: layers with the same non-empty tied_group share their
            parameters (e.g. input embedding and LM head).
        tied_params: parameters of this layer that an earlier layer of its
            tied_group already owns (counted once in the model's total; held
            again only by a stage that does not hold the earlier layer).
        profile_key: layers with equal keys have equal cost (profiled once).
    """

    name: str
    kind: str
    params: int
    fwd_flops: float
    act_bytes: float
    input_bytes: float
    output_bytes: float
    params_tp_replicated: int = 0
    fwd_mem_bytes: float = 0.0
    attention_flops: float = 0.0
    gemm_count: int = 1
    act_tp_replicated_bytes: float = 0.0
    act_attention_core_bytes: float = 0.0
    tp_comm_bytes: float = 0.0
    tp_max: int = 0
    tied_group: str = ""
    tied_params: int = 0
    profile_key: str = ""

    def __post_init__(self) -> None:
        for attr in ("params", "fwd_flops", "act_bytes", "input_bytes", "output_bytes"):
            if getattr(self, attr) < 0:
                raise HetplanError(f"layer {self.name!r}: {attr} must be >= 0")
        if self.tp_max < 0:
            raise HetplanError(f"layer {self.name!r}: tp_max must be >= 0 (0: no limit)")
        if not 0 <= self.tied_params <= self.params:
            raise HetplanError(f"layer {self.name!r}: tied_params must be between 0 and its {self.params} params")
        if self.tied_params and not self.tied_group:
            raise HetplanError(f"layer {self.name!r}: tied_params needs a tied_group")
        if self.act_tp_replicated_bytes + self.act_attention_core_bytes > self.act_bytes * 1.000001:
            raise HetplanError(
                f"layer {self.name!r}: replicated + attention-core activations exceed the total"
            )
        if not self.profile_key:
            object.__setattr__(self, "profile_key", self.default_profile_key())

    def default_profile_key(self) -> str:
        """Layers of the same kind and identical size cost the same."""
        return f"{self.kind}:{self.params}:{self.fwd_flops:.6g}:{self.act_bytes:.6g}"

    def supports_tp(self, tp: int) -> bool:
        """Can this layer run with TP degree ``tp``? The one rule every planner,
        the validator and the runtime use (see ``tp_max``)."""
        if tp == 1 or not self.tp_max:
            return True
        if tp > self.tp_max:
            return False
        return self.kind in ("embedding", "head") or self.tp_max % tp == 0

    @property
    def params_tp_sharded(self) -> int:
        """Parameters that tensor parallelism splits across the TP group."""
        return self.params - self.params_tp_replicated


@dataclass(frozen=True)
class ModelSpec:
    """A model as an ordered list of layers, in execution order.

    Attributes:
        name: preset or file name.
        family: "gpt", "llama", "bert", "vit", "swin", "t5", "moe", "wresnet", ...
        layers: the layers in forward order (encoder before decoder for T5).
        seq_len: tokens per sample (patches for vision transformers; 1 for CNNs).
        dtype_bytes: bytes per activation/parameter element in training
            (2 for fp16/bf16 mixed precision, 4 for fp32).
        hidden_size, num_heads: for TP checks and reports (0 if not a transformer).
        vocab_size: 0 where there is no vocabulary.
        meta: free-form facts about where the spec came from (config, source).
    """

    name: str
    family: str
    layers: tuple[LayerSpec, ...]
    seq_len: int
    dtype_bytes: int = 2
    hidden_size: int = 0
    num_heads: int = 0
    vocab_size: int = 0
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.layers:
            raise HetplanError(f"model {self.name!r} has no layers")
        if self.dtype_bytes not in (2, 4):
            raise HetplanError(f"model {self.name!r}: dtype_bytes must be 2 or 4")
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            raise HetplanError(f"model {self.name!r}: layer names must be unique")
        object.__setattr__(self, "layers", tuple(self.layers))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def total_params(self) -> int:
        """Parameters of the model, counting tied parameters once."""
        return sum(layer.params - layer.tied_params for layer in self.layers)

    @property
    def fwd_flops_per_sample(self) -> float:
        return sum(layer.fwd_flops for layer in self.layers)

    @property
    def train_flops_per_sample(self) -> float:
        """Forward + backward (2x forward) FLOPs per sample: the MFU numerator."""
        return 3.0 * self.fwd_flops_per_sample

    @property
    def act_bytes_per_sample(self) -> float:
        """All activation bytes kept for backward for one sample (no TP, no recompute)."""
        return sum(layer.act_bytes for layer in self.layers)

    def layer_index(self, name: str) -> int:
        for i, layer in enumerate(self.layers):
            if layer.name == name:
                return i
        raise HetplanError(f"model {self.name!r} has no layer named {name!r}")

    def with_layers(self, layers: list[LayerSpec], **changes: Any) -> ModelSpec:
        return replace(self, layers=tuple(layers), **changes)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["layers"] = [asdict(layer) for layer in self.layers]
        return data

    @staticmethod
    def from_dict(data: dict[str, Any]) -> ModelSpec:
        try:
            layers = tuple(LayerSpec(**layer) for layer in data["layers"])
            rest = {k: v for k, v in data.items() if k != "layers"}
            return ModelSpec(layers=layers, **rest)
        except (KeyError, TypeError) as exc:
            raise HetplanError(f"malformed model description: {exc}") from None
