"""The single-process reference a parallel run must reproduce, and synthetic data.

``build_reference`` makes the full model on one device with exactly the
initial values ``ctx.parallelize`` gives (see hetplan.runtime.parallelize);
``train_reference`` trains it on the same batches with the same optimizer. In
fp32 a correct plan matches it to rounding (relative 1e-6 or so after a few
steps); ``compare`` measures the largest relative difference of the losses
and of each parameter tensor (``||p - p_ref|| / ||p_ref||``).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hetplan.errors import HetplanError
from hetplan.model.origin import HFSource
from hetplan.plan.runtime_facts import IMPLEMENTATIONS, OPTIMIZER_IMPLEMENTATION
from hetplan.runtime import dropout, hf_recompute
from hetplan.runtime import parallelize as par
from hetplan.runtime.precision import LossScaler, autocast


def synthetic_batch(vocab_size: int, seq_len: int, batch_size: int, step: int, seed: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable next-token batch, the same for a given (step, seed) on every
    rank: each sample counts up from a random start by a random stride (mod
    vocabulary), so a model can bring the loss well below log(vocab)."""
    g = torch.Generator().manual_seed(par.stable_seed(seed, f"data:{step}"))
    start = torch.randint(0, vocab_size, (batch_size, 1), generator=g)
    stride = torch.randint(1, 4, (batch_size, 1), generator=g)
    tokens = (start + stride * torch.arange(seq_len + 1)[None, :]) % vocab_size
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def synthetic_inputs(spec: Any, batch_size: int, step: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The keyword inputs ``hetplan train`` gives a model with each synthetic
    batch: for a HF model that takes one, an attention mask with trailing
    padding (each sample keeps a random length from half the sequence to all of
    it), so ``--verify`` also checks that masks reach every pipeline stage;
    nothing for other models. The same for a given (step, seed) on every rank."""
    source = getattr(spec, "source", None)
    if not isinstance(source, HFSource):
        return {}
    name = source.hf_class
    import inspect

    import transformers

    cls = getattr(transformers, name, None)
    if cls is None or "attention_mask" not in inspect.signature(cls.forward).parameters:
        return {}
    seq = spec.seq_len
    g = torch.Generator().manual_seed(par.stable_seed(seed, f"mask:{step}"))
    valid = torch.randint(max(1, seq // 2), seq + 1, (batch_size, 1), generator=g)
    return {"attention_mask": (torch.arange(seq)[None, :] < valid).long()}


def _padding_mask(length: int, batch_size: int, g: torch.Generator) -> torch.Tensor:
    valid = torch.randint(max(1, length // 2), length + 1, (batch_size, 1), generator=g)
    return (torch.arange(length)[None, :] < valid).long()


def seq2seq_batch(spec: Any, config: Any, batch_size: int, step: int, seed: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """An encoder-decoder batch (T5): the encoder reads a counting sequence, the
    decoder predicts its continuation (``meta["decoder_seq_len"]`` tokens) from
    those labels shifted right (starting at the pad id, as T5 does); both with
    trailing padding masks. The same for a given (step, seed) on every rank."""
    seq, dec = spec.seq_len, int(spec.meta.get("decoder_seq_len") or spec.seq_len)
    x, y = synthetic_batch(spec.vocab_size, max(seq, dec), batch_size, step, seed)
    labels = y[:, :dec].contiguous()
    start = getattr(config, "decoder_start_token_id", None)
    start = int(start if start is not None else getattr(config, "pad_token_id", 0) or 0)
    g = torch.Generator().manual_seed(par.stable_seed(seed, f"mask:{step}"))
    return x[:, :seq].contiguous(), labels, {
        "attention_mask": _padding_mask(seq, batch_size, g),
        "decoder_input_ids": torch.cat([torch.full_like(labels[:, :1], start), labels[:, :-1]], 1),
        "decoder_attention_mask": _padding_mask(dec, batch_size, g),
    }


def image_batch(config: Any, batch_size: int, step: int, seed: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Images and class labels for an image classifier (ViT): noise whose first
    channel is shifted by the label, so the label can be learnt. No mask."""
    size = config.image_size
    size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
    g = torch.Generator().manual_seed(par.stable_seed(seed, f"images:{step}"))
    labels = torch.randint(0, config.num_labels, (batch_size,), generator=g)
    images = torch.randn(batch_size, config.num_channels, *size, generator=g)
    images[:, 0] += (labels.float() / config.num_labels)[:, None, None]
    return images, labels, {}


def training_batch(spec: Any, how: Any, batch_size: int, step: int, seed: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(x, targets, keyword inputs) ``hetplan train`` feeds the plan's model at
    ``step``: the model's own batches (``how.batch``, a ``pkg.mod:build``
    model: hetplan.runtime.user_model), else the next-token batches above."""
    if getattr(how, "batch", None) is not None:
        return how.batch(batch_size, step, seed)
    x, y = synthetic_batch(spec.vocab_size, spec.seq_len, batch_size, step, seed)
    return x, y, synthetic_inputs(spec, batch_size, step, seed)


def build_reference(build_model: Callable[[], nn.Module], seed: int = 0,
                    init_fn: par.InitFn | None = None, device: str | torch.device = "cpu") -> nn.Module:
    """The full model on one device with the runtime's plan-independent initial values."""
    with torch.device("meta"):
        full = build_model()
    values = par.InitialValues(copy.deepcopy(full), seed, init_fn or getattr(full, "init_parameter", None))
    par.materialize(full, torch.device(device), values)
    return full


DEFAULT_LR = {"sgd": 0.1, "adamw": 1e-3}
# torch.optim ops a DTensor parameter supports with ``fused=True``: DTensor registers
# ``aten._fused_adam(w)_`` as pointwise ops (torch/distributed/tensor/_ops/_pointwise_ops.py,
# "fused optimizer ops"), but not ``aten._fused_sgd_`` ("does not have a sharding strategy
# registered" on torch 2.13); SGD over DTensors runs foreach instead. Checked on gloo: fused AdamW
# and foreach ops take DTensors of different meshes in one list (a dp x tp and a dp parameter).
FUSED_ON_DTENSOR = {"adamw": True, "sgd": False}


def optimizer_implementation(params: Sequence[torch.Tensor], name: str, wanted: str | None = None) -> str:
    """The implementation ``make_optimizer`` runs: ``wanted``, else the
    runtime's for the parameters' device (``OPTIMIZER_IMPLEMENTATION``, which the
    cost model costs). Where torch has no multi-tensor kernel for the
    parameters it falls back: fused SGD over DTensors to foreach; DTensors and
    plain tensors in one list (a ZeRO-1 optimizer's shards beside FSDP2 or TP
    parameters; layers without a TP plan) to the for-loop, since every foreach
    and fused op refuses "mixed torch.Tensor and DTensor" (torch 2.13)."""
    device = params[0].device.type if params else "cpu"
    # a device the table does not name: the for-loop, torch's own default where foreach kernels are
    # not known to exist (torch/optim/optimizer.py, _default_to_fused_or_foreach)
    choice = wanted or OPTIMIZER_IMPLEMENTATION.get(device, "for-loop")
    if choice not in IMPLEMENTATIONS:
        raise HetplanError(f"optimizer implementation {choice!r}: use one of {', '.join(IMPLEMENTATIONS)}")
    kinds = {isinstance(p, DTensor) for p in params}
    if choice != "for-loop" and len(kinds) > 1:
        return "for-loop"
    if choice == "fused" and kinds == {True} and not FUSED_ON_DTENSOR.get(name, False):
        return "foreach"
    return choice


def make_optimizer(params: Iterable[nn.Parameter], name: str = "sgd", lr: float | None = None,
                   implementation: str | None = None) -> torch.optim.Optimizer:
    """SGD with momentum (the default: its update is linear in the gradient, so
    rounding differences stay rounding-sized) or AdamW (which turns the
    rounding noise of zero-in-theory gradients into full-size steps; a run can
    then not be compared with a reference to 1e-5).

    ``implementation`` (``for-loop``, ``foreach``, ``fused``): default the
    runtime's for the device (:func:`optimizer_implementation`); the optimizer
    records it as ``hetplan_implementation``. Each implementation updates each
    element with the same formula whatever the sharding, so a plan and its
    ``--verify`` reference, both built here for the same device, step alike; the
    CPU's for-loop form also keeps the reference bit-identical to torch's default
    ``foreach=False`` loops the tests compare with."""
    params = list(params)
    lr = DEFAULT_LR.get(name, 1e-3) if lr is None else lr
    if name not in DEFAULT_LR:
        raise ValueError(f"unknown optimizer {name!r}")
    flat = [q for g in params for q in (g["params"] if isinstance(g, dict) else [g])]  # param groups too
    how = optimizer_implementation(flat, name, implementation)
    flags = {"fused": how == "fused", "foreach": how == "foreach"}
    if name == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, **flags)
    else:
        opt = torch.optim.SGD(params, lr=lr, momentum=0.9, **flags)
    opt.hetplan_implementation = how  # type: ignore[attr-defined]  # a marker torch does not declare
    return opt


def train_reference(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                    loss_fn: Callable[..., torch.Tensor], optimizer: torch.optim.Optimizer,
                    clip: float | None = None, precision: str = "fp32", seed: int = 0,
                    groups: Sequence[Sequence[int]] | None = None) -> list[float]:
    """Plain PyTorch training on the global batches in one process; returns the
    losses. ``groups``: the rows of the batch each forward takes together, as
    a plan runs them (``row_groups``: per micro-batch, each replica's share,
    gradients accumulated, each loss weighted by its share of the batch);
    default one forward over the whole batch. In fp32 the grouping changes
    nothing but rounding (1e-7); in 16 bits each forward's weight gradients are
    rounded to 16 bits before they add up, so a plan is compared with the
    same grouping (a tiny ViT's attention bias in bf16: 1.9e-3 apart with 4
    micro-batches against one whole batch in one process, 0 with them). The
    forward runs under the plan's precision (hetplan.runtime.precision), and
    fp16 scales each loss as the runtime's dynamic loss scaling does.
    Dropout draws the runtime's plan-independent masks for ``seed`` and step
    0, 1, ... (hetplan.runtime.dropout; ``seed`` as given to ``parallelize``).
    A HF model trains without its KV cache, as under ``parallelize``
    (hetplan.runtime.hf_recompute)."""
    dropout.prepare(model)
    hf_recompute.no_kv_cache(model)
    scaler = LossScaler() if precision == "fp16" else None
    losses = []
    for step, (x, y, *inputs) in enumerate(batches):  # (x, y) or (x, y, keyword inputs of the model)
        kwargs = inputs[0] if inputs else {}
        total = 0.0
        for rows in groups or [range(x.size(0))]:
            index = torch.as_tensor(list(rows), dtype=torch.int64)
            with autocast(x.device, precision), dropout.scope(seed, step, index):
                loss = loss_fn(model(x[index], **{k: v[index] for k, v in kwargs.items()}), y[index])
            loss = loss * (len(index) / x.size(0)) if groups else loss
            (loss * scaler.scale if scaler else loss).backward()
            total += float(loss.detach())
        if scaler and not scaler.unscale([p.grad for p in model.parameters() if p.grad is not None], x.device):
            optimizer.zero_grad(set_to_none=True)  # overflow: the step is skipped, as the runtime skips it
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def row_groups(layout: Any) -> list[list[int]]:
    """The rows of the global batch each forward of the plan's first stage
    takes together (``train_reference``'s ``groups``): per micro-batch, each
    data-parallel replica's share (``PlanLayout.local_sample_indices``)."""
    out = []
    shares = [(layout.local_sample_indices(r, 0), layout.stage_split(0)[r]) for r in range(layout.stage_dp(0))]
    for k in range(layout.plan.num_micro_batches):
        out += [rows[k * n:(k + 1) * n] for rows, n in shares]
    return out


def compare(losses: Sequence[float | torch.Tensor], ref_losses: list[float], state: dict[str, torch.Tensor],
            ref_state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Largest relative loss difference, and the largest relative parameter difference.

    A parameter tensor's difference is ``||p - p_ref|| / max(||p_ref||, s)``
    where ``s = ||theta_ref|| * sqrt(numel(p) / numel(theta))`` is its share of
    the whole model's norm. The floor matters for tensors whose true gradient
    is zero (an attention key bias: softmax ignores a shift shared by all
    keys), which hold only accumulated rounding noise that no two correct runs
    share; any real error in a tensor shows up against its own norm.
    """
    losses = [float(v) for v in losses]  # train_step's losses may be device tensors
    if len(losses) != len(ref_losses):
        raise ValueError(f"{len(losses)} losses vs {len(ref_losses)} reference losses")
    loss_diff = max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses)), default=0.0)
    missing = sorted(set(ref_state) - set(state))
    extra = sorted(set(state) - set(ref_state))
    total_sq = sum(float(t.detach().double().pow(2).sum()) for t in ref_state.values())
    total_n = sum(t.numel() for t in ref_state.values())
    worst, worst_name = 0.0, ""
    for name, ref in ref_state.items():
        if name not in state:
            continue
        a, b = state[name].detach().double().cpu(), ref.detach().double().cpu()
        if a.shape != b.shape:
            worst, worst_name = float("inf"), f"{name} (shape {tuple(a.shape)} vs {tuple(b.shape)})"
            break
        share = (total_sq * b.numel() / max(total_n, 1)) ** 0.5
        d = float((a - b).norm()) / max(float(b.norm()), share, 1e-30)
        if d > worst:
            worst, worst_name = d, name
    if missing:
        worst, worst_name = float("inf"), f"{missing[0]} (missing)"
    return {"loss_rel_diff": loss_diff, "param_rel_diff": worst, "worst_param": worst_name,
            "missing": missing, "unexpected": extra}
