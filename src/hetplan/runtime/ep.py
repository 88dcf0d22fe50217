"""Expert parallelism: token dispatch and combine for a mixture-of-experts MLP.

Each token goes to ``top_k`` experts. Its copies are sorted by expert; with
expert parallelism (``group``: the EP ranks, each holding ``num_experts / ep``
consecutive experts) the copies travel to the rank of their expert with
``all_to_all_single`` (split sizes exchanged first, since they depend on the
routing), are processed there, and come back the same way (the reverse
split). ``torch.distributed.nn.functional.all_to_all_single`` is
autograd-aware: the backward sends the gradients of the outputs back along the
reverse path, so the router, the experts and everything before them get the
gradient of the single-process computation (DeepSpeed-MoE, Rajbhandari et al.
2022 §4; torchtitan's and Megatron-Core's "alltoall" dispatcher). Without a
group the same code runs every expert locally: the single-process model.

Gradients of the experts: a rank's expert gradient sums what every rank of its
EP group sent it; the runtime then sums it over the expert-data-parallel group
(the ranks holding the same experts) and divides by ``dp * cp``, as FSDP
averages the dense gradients (``step.sync_expert_grads``; under
ZeRO-2/3 FSDP does it, sharding the experts over that group:
``parallelize.apply_expert_zero``).

Expert tensor parallelism (tp > 1; Megatron-Core's default ETP = TP): every TP
rank of an EP rank sees the same tokens and holds a ``1/tp`` slice of each
expert's inner width; :func:`expert_tp_input` and :func:`expert_tp_output` are
the two TP collectives around the experts (Megatron-LM's "f" and "g",
Shoeybi et al. 2019 §3), written here because torch's autograd all-reduce
does something else (see :class:`_SumOverTP`).

HF transformers' MoE blocks (Mixtral, Qwen2-MoE, Qwen3-MoE) keep their own
router, top-k normalisation and shared experts; only their fused experts
module (``gate_up_proj`` [E, 2F, H], ``down_proj`` [E, H, F]) is replaced by
:class:`HFExperts`, which holds the same parameters under the same names and
runs the same per-expert math through :func:`moe_dispatch_combine`, so that
``parallelize.apply_ep`` splits it like hetplan's own MoE.
"""

from __future__ import annotations

from typing import Any, Callable

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hetplan.errors import HetplanError

# the autograd-aware all_to_all_single of torch.distributed.nn.functional runs on gloo and NCCL; its
# suggested replacement (functional collectives) is not autograd-aware in the same way: its warning is noise here
warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional\.all_to_all_single is deprecated")


def moe_dispatch_combine(tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                         expert_fn: Callable[[torch.Tensor, list[int]], torch.Tensor], num_experts: int,
                         group: Any = None) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * expert_{experts[t, j]}(tokens[t])``.

    ``tokens``: (T, h); ``experts``, ``weights``: (T, k). ``expert_fn(rows,
    counts)`` runs this rank's experts on ``rows`` sorted by (local) expert,
    ``counts[e]`` rows each.
    """
    k = experts.size(1)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # token copies sorted by expert
    source = order // k  # the token of each sorted copy
    counts = torch.bincount(flat, minlength=num_experts)
    rows = tokens.index_select(0, source)
    if group is None:
        out_rows = expert_fn(rows, counts.tolist())
    else:
        out_rows = _through_expert_ranks(rows, counts, expert_fn, num_experts, group)
    scaled = out_rows * weights.reshape(-1).index_select(0, order).unsqueeze(-1)
    # in the tokens' dtype, as HF's experts add theirs (16-bit expert outputs times fp32 router weights)
    return torch.zeros_like(tokens).index_add(0, source, scaled.to(tokens.dtype))


def _through_expert_ranks(rows: torch.Tensor, counts: torch.Tensor,
                          expert_fn: Callable[[torch.Tensor, list[int]], torch.Tensor], num_experts: int,
                          group: Any) -> torch.Tensor:
    """Send ``rows`` (sorted by expert, ``counts`` per expert) to their experts' ranks,
    run them there, and bring the outputs back in the same order."""
    from torch.distributed.nn.functional import all_to_all_single

    ep = dist.get_world_size(group)
    local = num_experts // ep
    received = torch.empty_like(counts)  # [source rank][local expert] counts
    dist.all_to_all_single(received, counts, group=group)
    send_splits = counts.view(ep, local).sum(dim=1).tolist()
    recv_splits = received.view(ep, local).sum(dim=1).tolist()
    got = all_to_all_single(rows.new_empty(sum(recv_splits), rows.size(1)), rows, recv_splits, send_splits,
                            group=group)
    # received copies are ordered by source rank, then expert: regroup by local expert
    expert_of_row = torch.repeat_interleave(torch.arange(local, device=rows.device).repeat(ep), received)
    by_expert = torch.argsort(expert_of_row, stable=True)
    out = expert_fn(got.index_select(0, by_expert), received.view(ep, local).sum(dim=0).tolist())
    back = torch.empty_like(out).index_copy(0, by_expert, out)  # undo the regrouping (autograd-aware)
    # outputs come back in the experts' dtype (16-bit under autocast), not the rows' (fp32 residual stream)
    return all_to_all_single(back.new_empty(rows.size(0), back.size(1)), back, send_splits, recv_splits, group=group)


# --- expert tensor parallelism ---------------------------------------------------------------------
class _SumOverTP(torch.autograd.Function):
    """Forward: the sum of the TP ranks' partial expert outputs (all-reduce).
    Backward: the gradient unchanged. Megatron's "g" operator: every TP rank
    computes the same loss from the summed output, so the gradient arriving
    here is already the whole one on each rank. torch 2.13's
    ``torch.distributed.nn.functional.all_reduce`` is not this: its backward
    all-reduces the gradient again, which makes every expert gradient ``tp``
    times too large (it is right only when each rank's output feeds a loss of
    its own that is summed)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any) -> torch.Tensor:
        t = t.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GradSumOverTP(torch.autograd.Function):
    """Forward: the input unchanged (every TP rank holds the same token rows).
    Backward: the sum of the TP ranks' input gradients, each of which comes
    through this rank's slice of the expert width only (Megatron's "f")."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """A parameter's local shard (the tensor itself unless it is a DTensor)."""
    to_local = getattr(p, "to_local", None)
    return to_local() if to_local is not None else p


def expert_tp_input(rows: torch.Tensor, group: Any) -> torch.Tensor:
    """Token rows entering width-split experts (identity; input gradients summed over ``group``)."""
    return rows if group is None else _GradSumOverTP.apply(rows, group)


def expert_tp_output(partial: torch.Tensor, group: Any) -> torch.Tensor:
    """The experts' outputs summed over the TP ranks' width slices (gradient passed through)."""
    return partial if group is None else _SumOverTP.apply(partial, group)


# --- HF transformers' fused experts ------------------------------------------------------------------
# The experts classes whose forward hetplan reproduces: transformers 5.24's MixtralExperts,
# Qwen2MoeExperts and Qwen3MoeExperts (models/{mixtral,qwen2_moe,qwen3_moe}/modeling_*.py), whose eager
# forward is, per expert, ``gate, up = linear(x, gate_up_proj[e]).chunk(2); linear(act(gate) * up,
# down_proj[e])``, each output scaled by the token's routing weight and added up in the tokens' dtype.
HF_EXPERTS = ("MixtralExperts", "Qwen2MoeExperts", "Qwen3MoeExperts")


class HFExperts(nn.Module):
    """A HF fused experts module run through :func:`moe_dispatch_combine`.

    Called as HF's block calls its experts, ``(hidden_states, top_k_index,
    top_k_weights)``, with HF's own parameters (``gate_up_proj``,
    ``down_proj``: same tensors, same names). It is both the MoE module and
    its experts holder of ``parallelize.apply_ep``'s protocol: ``ep_group``
    routes its token copies to the EP ranks holding their experts."""

    def __init__(self, source: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj = source.gate_up_proj
        self.down_proj = source.down_proj
        self.act_fn = source.act_fn
        self.num_experts = int(source.num_experts)
        self.hf_class = type(source).__name__
        self.ep_group: Any = None

    @property
    def experts(self) -> nn.Module:
        """The holder of the stacked expert weights: this module itself."""
        return self

    def tp_refusal(self, name: str, tp: int) -> str:
        """Why expert TP cannot split these experts (``parallelize.check_expert_tp`` raises it)."""
        return hf_tp_refusal(name, self.hf_class, tp)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return moe_dispatch_combine(hidden_states, top_k_index, top_k_weights, self._run, self.num_experts,
                                    self.ep_group)

    def _run(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's experts on ``rows`` (sorted by local expert, ``counts[e]`` each)."""
        gate_up, down = local_tensor(self.gate_up_proj), local_tensor(self.down_proj)
        outs, start = [], 0
        for e, n in enumerate(counts):
            gate, up = F.linear(rows[start:start + n], gate_up[e]).chunk(2, dim=-1)
            outs.append(F.linear(self.act_fn(gate) * up, down[e]))
            start += n
        return torch.cat(outs)

    def extra_repr(self) -> str:
        return f"{self.hf_class}, num_experts={self.num_experts}"


def hf_fused_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """HF transformers experts modules (a ``num_experts`` and stacked, 3-D,
    weights; not ViT's 3-D position table), not yet adapted, by name."""
    return [(fqn, m) for fqn, m in model.named_modules()
            if type(m).__module__.startswith("transformers.") and hasattr(m, "num_experts")
            and any(p.dim() == 3 for p in m.parameters(recurse=False))]


def hf_experts_refusal(fqn: str, module: nn.Module) -> str:
    """Why hetplan cannot split these HF experts over EP ranks ("" when it can)."""
    cls = type(module).__name__
    if cls not in HF_EXPERTS:
        return (f"hetplan's expert parallelism splits its own MoE and HF's {', '.join(HF_EXPERTS)}, not the "
                f"{cls} of {fqn!r}; use a plan with ep=1")
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    e = getattr(module, "num_experts", 0)
    if gate_up is None or down is None or gate_up.dim() != 3 or tuple(down.shape) != (
            e, gate_up.size(2), gate_up.size(1) // 2) or gate_up.size(0) != e:
        return (f"the {cls} of {fqn!r} does not hold gate_up_proj [E, 2F, H] and down_proj [E, H, F] as in "
                "transformers 5.24; install transformers 5.24 or use a plan with ep=1")
    return ""


def adapt_hf_experts(model: nn.Module) -> int:
    """Replace every HF fused experts module of ``model`` by an :class:`HFExperts`
    over the same parameters (those it cannot split raise); returns how many."""
    found = hf_fused_experts(model)
    for fqn, module in found:
        why = hf_experts_refusal(fqn, module)
        if why:
            raise HetplanError(why)
        parent, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent), child, HFExperts(module))
    return len(found)


def hf_tp_refusal(name: str, hf_class: str, tp: int | None) -> str:
    """Why the stage's tp cannot split these HF experts. Expert TP of HF's
    packed experts would give a TP rank the columns of its slice of the
    gate rows and of the up rows of ``gate_up_proj`` (gate above up): two
    pieces of the tensor, which a checkpoint cannot record (torch's DCP takes
    one offset per shard: saving such a ``_StridedShard`` fails with
    "overlapping chunks")."""
    split = f"tp={tp}" if tp else "tensor parallelism"
    if hf_class not in HF_EXPERTS:
        return (f"{split} would split the experts of layer {name!r} ({hf_class}), which hetplan's expert tensor "
                "parallelism does not know; use tp=1 for that layer's stage")
    return (f"{split} would split the experts of layer {name!r} ({hf_class}) by width, but their packed "
            "gate_up_proj gives each TP rank two pieces of the tensor, which checkpoints cannot record; use tp=1 "
            "for that layer's stage (split its experts with ep instead)")
