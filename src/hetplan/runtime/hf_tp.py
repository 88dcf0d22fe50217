"""Tensor-parallel plans for the HF families whose configs carry none: GPT-2, BERT, T5 and ViT.

Llama, Mistral and Qwen configs name their own TP plan (``base_model_tp_plan``,
read by :func:`hetplan.runtime.tp.hf_tp_plan`); ``GPT2LMHeadModel``,
``BertForMaskedLM``, ``T5ForConditionalGeneration`` and
``ViTForImageClassification`` have none, so these plans split them as the cost
model charges a TP layer, Megatron-LM's way (Shoeybi et al. 2019, §3):

* attention: the query/key/value projections column-parallel, so each TP rank
  holds ``heads / tp`` whole heads and attends with them alone; the output
  projection row-parallel, its partial outputs all-reduced. T5's relative
  position bias (``relative_attention_bias``, one column per head) is split by
  heads too. An attention module that reshapes by a stored head count (GPT-2's
  ``split_size``, T5's ``n_heads``) is given this rank's count.
* MLP: the first linear(s) column-parallel, the second row-parallel.
* the token embedding vocabulary-parallel (output all-reduced) and the LM head
  column-parallel over the vocabulary with its logits gathered for the loss
  (a vocabulary tp does not divide, as GPT-2's 50257, split unevenly),
  as hetplan's own GPT (``runtime/tp.py``); both shard the tied weight alike.
* what Megatron keeps whole stays whole on every TP rank: norms, position and
  token-type embeddings, BERT's prediction transform, ViT's patch embedding and
  classifier (Megatron-LM's ViT backbone and classification head are plain
  ``torch.nn.Linear`` layers). The cost model counts the last three split
  (docs/runtime.md, "Tensor-parallel plans", says by how much).

GPT-2's projections are ``Conv1D`` (weight ``[in, out]``) and its attention
input projection ``c_attn`` is fused, ``[q | k | v]`` along the output: a
plain column split would hand rank 0 all of q and half of k. It is split
group by group instead (``_StridedShard(1, split_factor=3)``: rank r holds
its heads of q, of k and of v, side by side; its 3h bias stays whole, see
:class:`Conv1DColwise`), and the Conv1D modules compute on their local shards
between Megatron's two TP collectives (:func:`hetplan.runtime.ep.expert_tp_input`
/ ``expert_tp_output``). Checkpoints save such a tensor as plain ``Shard``
blocks (``hetplan.runtime.checkpoint``).

Parameter names stay the model's and every parameter is a DTensor of the full
shape, so initial values, ``full_state_dict``, checkpoints and ``--verify``
work by name as for the other plans. Sequence parallelism is refused for these
families (their staged forwards and post-norm blocks would need the sequence
whole between layers); so are models with cross-attention added to a decoder
or encoder (``add_cross_attention``). Tests: ``tests/distributed/test_hf_tp.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard

from hetplan.errors import HetplanError
from hetplan.runtime.ep import expert_tp_input, expert_tp_output
from hetplan.runtime.parallelize import owner_layer


@dataclass(frozen=True)
class _Entry:
    """One module's style and the counts the TP degree must divide there ((what, count) pairs)."""

    style: ParallelStyle
    needs: tuple[tuple[str, int], ...]


# --- styles ------------------------------------------------------------------------------------------
def _vocab_parallel() -> ParallelStyle:
    """A vocabulary-parallel embedding: rows split, lookups outside a rank's rows zero, output all-reduced."""
    return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())


def _gathered_head() -> ParallelStyle:
    """An LM head split over the vocabulary, its logits gathered whole for the loss."""
    return ColwiseParallel(output_layouts=Replicate())


def _distribute(module: nn.Module, name: str, mesh: Any, placement: Any, src: int | None) -> None:
    """Replace the module's parameter ``name`` by its DTensor with ``placement`` on ``mesh``."""
    param = getattr(module, name)
    d = distribute_tensor(param.data, mesh, [placement], src_data_rank=src)
    module.register_parameter(name, nn.Parameter(d, requires_grad=param.requires_grad))


class Whole(ParallelStyle):
    """Keep the module whole on every TP rank (what Megatron does not split)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        return module


class LocalHeads(ParallelStyle):
    """Divide an attention module's stored head counts (and widths made of
    heads) by tp: its forward reshapes by them, and sees this rank's heads."""

    def __init__(self, attrs: tuple[str, ...]) -> None:
        self.attrs = attrs

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        for attr in self.attrs:
            setattr(module, attr, getattr(module, attr) // device_mesh.size())
        return module


class ShardedBias(ParallelStyle):
    """Split a module's own ``bias`` parameter over the vocabulary (BERT's
    prediction bias, tied to the column-parallel decoder's bias)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        _distribute(module, "bias", device_mesh, Shard(0), self.src_data_rank)
        return module


class Conv1DColwise(ParallelStyle):
    """GPT-2's ``Conv1D`` (``x @ weight + bias``, weight ``[in, out]``) split by
    output columns. With ``groups`` > 1 (the fused ``[q | k | v]``) each of the
    equal groups is split and a rank's shard is its part of every group
    (``_StridedShard``); the bias then stays whole on every TP rank, each rank
    adding its part and the gradient summed over the TP ranks: FSDP2 (ZeRO-2/3)
    cannot describe a strided 1-D shard split again along the same dim, so its
    gathered values would be out of order."""

    def __init__(self, groups: int = 1) -> None:
        self.groups = groups

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        g, tp, rank = self.groups, device_mesh.size(), device_mesh.get_local_rank()
        _distribute(module, "weight", device_mesh, _StridedShard(1, split_factor=g) if g > 1 else Shard(1),
                    self.src_data_rank)
        _distribute(module, "bias", device_mesh, Replicate() if g > 1 else Shard(0), self.src_data_rank)
        group = device_mesh.get_group()

        def bias() -> torch.Tensor:
            b = module.bias.to_local()
            if g == 1:
                return b
            return expert_tp_input(b, group).view(g, tp, -1)[:, rank].reshape(-1)

        def forward(x: torch.Tensor) -> torch.Tensor:
            w = module.weight.to_local()
            x = expert_tp_input(x, group)  # input gradients summed over the TP ranks' columns
            out = torch.addmm(bias(), x.reshape(-1, x.size(-1)), w)
            return out.view(*x.shape[:-1], w.size(1))

        module.forward = forward  # type: ignore[method-assign]  # wrapped in place
        return module


class Conv1DRowwise(ParallelStyle):
    """GPT-2's ``Conv1D`` split by input rows: each rank multiplies its slice of
    the features, the partial products are all-reduced, then the (whole) bias added."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        _distribute(module, "weight", device_mesh, Shard(0), self.src_data_rank)
        _distribute(module, "bias", device_mesh, Replicate(), self.src_data_rank)
        group = device_mesh.get_group()

        def forward(x: torch.Tensor) -> torch.Tensor:
            w = module.weight.to_local()
            out = expert_tp_output(x.reshape(-1, x.size(-1)) @ w, group)
            return (out + module.bias.to_local()).view(*x.shape[:-1], w.size(1))

        module.forward = forward  # type: ignore[method-assign]  # wrapped in place
        return module


# --- the modules of each family --------------------------------------------------------------------
def _heads(n: int) -> tuple[tuple[str, int], ...]:
    return (("attention heads", n),)


def _width(n: int) -> tuple[tuple[str, int], ...]:
    return (("MLP width", n),)


def _linear_attention(path: str, heads: int, cols: tuple[str, ...], row: str, head_attrs: tuple[str, ...],
                      holder: str = "") -> dict[str, _Entry]:
    """Q/K/V column-parallel by heads, the output projection row-parallel; the
    module ``holder`` (relative to ``path``) keeps the head counts ``head_attrs``."""
    need = _heads(heads)
    out = {f"{path}.{holder}" if holder else path: _Entry(LocalHeads(head_attrs), need)}
    out.update({f"{path}.{c}": _Entry(ColwiseParallel(), need) for c in cols})
    out[f"{path}.{row}"] = _Entry(RowwiseParallel(), need)
    return out


def _gpt2_attention(path: str, m: nn.Module) -> dict[str, _Entry]:
    if m.is_cross_attention:
        raise HetplanError(f"hetplan's TP plan for GPT-2 has no cross-attention ({path!r}, add_cross_attention); "
                           "use a plan with tp=1 for this model")
    need = _heads(m.num_heads)
    return {path: _Entry(LocalHeads(("num_heads", "embed_dim", "split_size")), need),
            f"{path}.c_attn": _Entry(Conv1DColwise(3), need),
            f"{path}.c_proj": _Entry(Conv1DRowwise(), need)}


def _gpt2_mlp(path: str, m: nn.Module) -> dict[str, _Entry]:
    need = _width(m.c_fc.nf)
    return {f"{path}.c_fc": _Entry(Conv1DColwise(), need),
            f"{path}.c_proj": _Entry(Conv1DRowwise(), need)}


def _bert_attention(path: str, m: nn.Module) -> dict[str, _Entry]:
    """``BertAttention``: ``self`` (query/key/value) and ``output.dense``."""
    return _linear_attention(path, m.self.num_attention_heads, ("self.query", "self.key", "self.value"),
                             "output.dense", ("num_attention_heads", "all_head_size"), holder="self")


def _bert_layer(path: str, m: nn.Module) -> dict[str, _Entry]:
    if getattr(m, "add_cross_attention", False):
        raise HetplanError(f"hetplan's TP plan for BERT has no cross-attention ({path!r}, add_cross_attention); "
                           "use a plan with tp=1 for this model")
    need = _width(m.intermediate.dense.out_features)
    return {**_bert_attention(f"{path}.attention", m.attention),
            f"{path}.intermediate.dense": _Entry(ColwiseParallel(), need),
            f"{path}.output.dense": _Entry(RowwiseParallel(), need)}


def _t5_attention(path: str, m: nn.Module) -> dict[str, _Entry]:
    out = _linear_attention(path, m.n_heads, ("q", "k", "v"), "o", ("n_heads", "inner_dim"))
    if m.has_relative_attention_bias:  # Embedding(buckets, heads): one column per head, split with them
        out[f"{path}.relative_attention_bias"] = _Entry(ColwiseParallel(), _heads(m.n_heads))
    return out


def _t5_mlp(path: str, m: nn.Module) -> dict[str, _Entry]:
    """``T5DenseActDense`` (wi) and ``T5DenseGatedActDense`` (wi_0, wi_1), then wo."""
    need = _width(m.wo.in_features)
    cols = ("wi",) if hasattr(m, "wi") else ("wi_0", "wi_1")
    out = {f"{path}.{c}": _Entry(ColwiseParallel(), need) for c in cols}
    out[f"{path}.wo"] = _Entry(RowwiseParallel(), need)
    return out


def _vit_attention(path: str, m: nn.Module) -> dict[str, _Entry]:
    return _linear_attention(path, m.num_attention_heads, ("q_proj", "k_proj", "v_proj"), "o_proj",
                             ("num_attention_heads",))


def _vit_mlp(path: str, m: nn.Module) -> dict[str, _Entry]:
    need = _width(m.fc1.out_features)
    return {f"{path}.fc1": _Entry(ColwiseParallel(), need), f"{path}.fc2": _Entry(RowwiseParallel(), need)}


# module class name -> its entries; a match stops the walk below it
_BLOCK_PARTS: dict[str, Callable[[str, nn.Module], dict[str, _Entry]]] = {
    "GPT2Attention": _gpt2_attention,
    "GPT2MLP": _gpt2_mlp,
    "BertLayer": _bert_layer,
    "T5Attention": _t5_attention,
    "T5DenseActDense": _t5_mlp,
    "T5DenseGatedActDense": _t5_mlp,
    "ViTAttention": _vit_attention,
    "ViTMLP": _vit_mlp,
}


def _ends(model: nn.Module) -> dict[str, _Entry]:
    """The embedding and head entries of each family (module paths of the HF class).
    A vocabulary tp does not divide is split unevenly (DTensor's ``Shard``: the
    last ranks hold fewer rows), GPT-2's 50257 included; Megatron pads it
    instead, which would change the model's shapes here."""
    name = type(model).__name__
    vocab: tuple[tuple[str, int], ...] = ()  # no count tp must divide
    if name == "GPT2LMHeadModel":
        return {"transformer.wte": _Entry(_vocab_parallel(), vocab), "lm_head": _Entry(_gathered_head(), vocab)}
    if name == "BertForMaskedLM":
        return {"bert.embeddings.word_embeddings": _Entry(_vocab_parallel(), vocab),
                "cls.predictions": _Entry(ShardedBias(), vocab),
                "cls.predictions.decoder": _Entry(_gathered_head(), vocab)}
    if name == "T5ForConditionalGeneration":  # `shared` is the same weight as both stacks' embed_tokens
        return {**{p: _Entry(_vocab_parallel(), vocab) for p in ("shared", "encoder.embed_tokens",
                                                                   "decoder.embed_tokens")},
                "lm_head": _Entry(_gathered_head(), vocab)}
    return {"vit.embeddings": _Entry(Whole(), ()), "classifier": _Entry(Whole(), ())}


# each family's model class -> the block parts (module class names, one of each group) its layers must have
FAMILIES: dict[str, tuple[tuple[str, ...], ...]] = {
    "GPT2LMHeadModel": (("GPT2Attention",), ("GPT2MLP",)),
    "BertForMaskedLM": (("BertLayer",),),
    "T5ForConditionalGeneration": (("T5Attention",), ("T5DenseActDense", "T5DenseGatedActDense")),
    "ViTForImageClassification": (("ViTAttention",), ("ViTMLP",)),
}


def _entries(model: nn.Module) -> dict[str, _Entry] | None:
    """Every module path of the model with its style and needs (None: not one of these families)."""
    family = FAMILIES.get(type(model).__name__)
    if family is None:
        return None
    entries: dict[str, _Entry] = {}  # the blocks first: a bad degree is named at its heads
    found: set[str] = set()
    stack: list[tuple[str, nn.Module]] = [("", model)]
    while stack:
        path, module = stack.pop()
        fn = _BLOCK_PARTS.get(type(module).__name__)
        if fn is not None:
            entries.update(fn(path, module))
            found.add(type(module).__name__)
            continue
        stack += [(f"{path}.{n}" if path else n, c) for n, c in reversed(list(module.named_children()))]
    entries.update(_ends(model))
    modules = dict(model.named_modules())
    absent = [" or ".join(group) for group in family if not found & set(group)]
    absent += [repr(p) for p in entries if p not in modules]
    if absent:
        raise HetplanError(f"{type(model).__name__} of this transformers release has no module {absent[0]}, which "
                           "hetplan's TP plan for it splits; use a plan with tp=1, or transformers 5.24")
    return entries


# --- the runtime's entry points ------------------------------------------------------------------------
def family_tp_plan(model: nn.Module) -> dict[str, Any] | None:
    """A whole-model ``parallelize_module`` plan (module path -> style) for a
    GPT-2, BERT, T5 or ViT model of the classes in :data:`FAMILIES`; None for other models."""
    entries = _entries(model)
    return None if entries is None else {path: e.style for path, e in entries.items()}


def check_family_tp(model: nn.Module, layer_tp: Mapping[str, int], sequence_parallel: bool) -> None:
    """Refuse, in one line, a TP degree the family plan cannot split by (it must
    divide the heads and MLP width of every layer it applies to) and sequence
    parallelism. ``layer_tp``: the plan's layer names -> their tp."""
    entries = _entries(model)
    if entries is None or max(layer_tp.values(), default=1) <= 1:
        return
    if sequence_parallel:
        raise HetplanError(f"sequence parallelism is not supported for {type(model).__name__} (hetplan's TP plan "
                           "for it splits heads and MLP widths only); turn sequence_parallel off")
    names = list(layer_tp)
    for path, entry in entries.items():
        layer = path if path in layer_tp else owner_layer(path, names)
        tp = layer_tp.get(layer, 1) if layer is not None else 1
        for what, count in entry.needs:
            if count % tp:
                raise HetplanError(f"tp={tp} does not divide the {count} {what} of {path!r}; "
                                   f"use a tp that divides {count}")
