"""The steps that apply a Plan to a model: pipeline parts, TP, EP, activation
checkpointing, compilation, FSDP2 / replicate, materialisation and initial
values. hetplan.runtime.spine calls them in order, per pipeline part.

The order is torchtitan's and it matters: ``parallelize_module`` finds
submodules by name, so wrapping a layer for checkpointing *before* TP hides
them (``checkpoint_wrapper`` renames them and TP is then silently skipped);
FSDP must come last so that it shards the DTensors TP made.

Checkpointing here wraps the layer's ``forward`` in non-reentrant
``torch.utils.checkpoint`` instead of replacing the module with a
``CheckpointWrapper``: module and parameter names stay what the model calls
them, so a checkpoint written with recomputation on loads without it.

ZeRO stages as FSDP2 settings (per layer; ``zero`` from the plan):

* 0 -- ``replicate`` (FSDP2-based data parallelism: parameters replicated,
  gradients all-reduced). DDP is not used: it is silently wrong with TP/PP.
* 1 -- ``replicate`` as 0 (whole weights, gradients all-reduced); the optimizer
  from ``ctx.optimizer`` keeps states for a 1/dp slice of each parameter and
  all-gathers the updated slices (``hetplan.runtime.zero1``): FSDP2 has no ZeRO-1.
* 2 -- ``fully_shard(reshard_after_forward=False)``: parameters stay gathered
  from forward to backward (no second all-gather), gradients are
  reduce-scattered, optimizer states sharded; between steps FSDP2 keeps the
  weights sharded too (the cost model counts that: ``memory.resident_bytes_split``).
* 3 -- ``fully_shard(reshard_after_forward=True)``: parameters re-gathered in
  backward (ZeRO-3 / FSDP).

Initial values do not depend on the plan: every parameter is filled from a
generator seeded by (seed, its name in the full model), on the full tensor,
and this rank keeps its shard. So a plan and the single-process reference
start from the same weights, and so does a run under a different plan.
"""

from __future__ import annotations

import copy
import functools
import zlib
from typing import Any, Callable, Collection, Iterable, Sequence

import torch
from torch import nn

from hetplan.errors import HetplanError
from hetplan.runtime import dropout, hf_recompute
from hetplan.runtime import tp as tp_registry
from hetplan.runtime.ep import adapt_hf_experts

InitFn = Callable[[str, torch.Tensor, torch.Generator], None]


# --- model inspection ------------------------------------------------------------------
def check_layer_names(model: nn.Module, names: Sequence[str], model_name: str = "") -> None:
    """Every layer name of the ModelSpec must be a module of the model."""
    missing = []
    for name in names:
        try:
            model.get_submodule(name)
        except AttributeError:
            missing.append(name)
    if missing:
        top = ", ".join(n for n, _ in model.named_children())
        raise HetplanError(
            f"the plan's layer {missing[0]!r}{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''} "
            f"is not a module of the model{f' for {model_name!r}' if model_name else ''} (its top-level modules: "
            f"{top}); build the model whose module names match the plan's ModelSpec"
        )
    for a in names:
        for b in names:
            if a != b and b.startswith(a + "."):
                raise HetplanError(f"layer {b!r} lies inside layer {a!r}: layers must be disjoint modules")


def param_aliases(model: nn.Module) -> dict[str, str]:
    """Every parameter name -> the first name of the same tensor (tied weights)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases[name] = first.setdefault(id(p), name)
    return aliases


def owner_layer(fqn: str, names: Iterable[str]) -> str | None:
    for n in names:
        if fqn.startswith(n + "."):
            return n
    return None


def uncovered_state(model: nn.Module, names: Sequence[str]) -> list[str]:
    """Parameters and buffers not inside any layer (a pipeline split would drop them)."""
    out = []
    for fqn, _ in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()):
        if owner_layer(fqn, names) is None:
            out.append(fqn)
    return out


def tied_layer_pairs(model: nn.Module, names: Sequence[str]) -> list[tuple[str, str]]:
    """(canonical fqn, alias fqn) for tied parameters owned by different layers.
    Names outside every layer's own module are skipped (T5's ``shared.weight``,
    held by the embedding layer besides ``encoder.embed_tokens.weight``, the
    same tensor): the canonical name is the first one inside a layer."""
    tensors: dict[str, list[str]] = {}
    for fqn, canon in param_aliases(model).items():
        if owner_layer(fqn, names) is not None:
            tensors.setdefault(canon, []).append(fqn)
    pairs = []
    for fqns in tensors.values():
        pairs += [(fqns[0], f) for f in fqns[1:] if owner_layer(f, names) != owner_layer(fqns[0], names)]
    return pairs


# --- pipeline parts -----------------------------------------------------------------------
def layer_paths(names: Sequence[str], modules: dict[str, Sequence[str]] | None = None) -> list[str]:
    """Every module path of the layers ``names``: a layer may span several
    modules (an HF import's ``meta["layer_modules"]``: Llama's head is
    ``lm_head`` + ``model.norm`` + ``model.rotary_emb``)."""
    out: list[str] = []
    for name in names:
        for path in (modules or {}).get(name) or [name]:
            if path not in out:
                out.append(path)
    return out


def spec_layer_modules(spec: Any) -> dict[str, list[str]]:
    """Layer name -> its module paths, where a layer spans several (HF imports'
    ``meta["layer_modules"]``); {} for models whose layers are one module each."""
    modules = (getattr(spec, "meta", None) or {}).get("layer_modules") or {}
    return {k: list(v) for k, v in modules.items() if isinstance(v, (list, tuple))}


class PipelinePart(nn.Module):
    """The layers one pipeline chunk (or one rank) runs, at their original
    module paths so parameter names equal the full model's.

    ``forward(*args, **inputs)`` runs the layers in order, each taking the
    previous one's output; ``inputs`` are this micro-batch's keyword inputs of
    the model (``train_step(..., inputs=...)``), which every stage gets. A
    layer takes those of them ``kwarg_routes`` names (keyword inputs the
    model's forward passes through unchanged, hetplan.model.chain). With
    ``staged`` (an HF model, hetplan.runtime.hf_stages) the stage runs that
    family's forward split at layer boundaries instead, and also holds its
    parameter-free helper modules (rotary embeddings)."""

    def __init__(self, source: nn.Module, names: Sequence[str], modules: dict[str, Sequence[str]] | None = None,
                 staged: Any = None, kwarg_routes: dict[str, dict[str, str]] | None = None) -> None:
        super().__init__()
        self.layer_names = list(names)
        self.staged = staged
        self.kwarg_routes = dict(kwarg_routes or {})
        paths = layer_paths(names, modules) + [h for h in (staged.helpers if staged else ()) if h]
        for path in dict.fromkeys(paths):
            parent: nn.Module = self
            parts = path.split(".")
            for p in parts[:-1]:
                child = parent._modules.get(p)
                if child is None:
                    child = nn.Module()
                    parent._modules[p] = child
                parent = child
            parent._modules[parts[-1]] = source.get_submodule(path)

    def forward(self, *args: Any, **inputs: Any) -> Any:
        if self.staged is not None:
            return self.staged.run(self, self.layer_names, args[0] if len(args) == 1 else args, inputs)
        x: Any = args
        for name in self.layer_names:
            layer = self.get_submodule(name)
            kw = {k: inputs[src] for k, src in self.kwarg_routes.get(name, {}).items() if src in inputs}
            x = layer(*x, **kw) if isinstance(x, tuple) else layer(x, **kw)
        return x

    def extra_repr(self) -> str:
        return f"layers={self.layer_names}"


# --- tensor parallelism --------------------------------------------------------------------
def apply_tp(root: nn.Module, layer_names: Sequence[str], tp_mesh: Any, sequence_parallel: bool,
             notes: list[str], model_plan: dict[str, Any] | None = None) -> None:
    """Apply the registered TP plan of every layer (see hetplan.runtime.tp);
    a layer without one takes the entries of ``model_plan`` (a whole-model
    plan with ``*`` wildcards, e.g. from an HF config) that fall inside it."""
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    aliases = param_aliases(root)
    unplanned = []
    for name in layer_names:
        layer = root.get_submodule(name)
        if not has_tp_plan(layer, name, model_plan):
            if any(True for _ in layer.parameters()):
                unplanned.append(f"{name} ({type(layer).__name__})")
            continue
        if not _apply_registered(layer, name, tp_mesh, tp, sequence_parallel, parallelize_module):
            sub = plan_inside(model_plan or {}, name)
            own = sub.pop("", None)
            if sub:
                parallelize_module(layer, tp_mesh, sub, src_data_rank=None)
            if own is not None:
                parallelize_module(layer, tp_mesh, own, src_data_rank=None)
    if model_plan:
        _apply_outside_layers(root, layer_names, model_plan, tp_mesh, parallelize_module)
    if unplanned:
        if sequence_parallel:
            raise HetplanError(
                f"layer {unplanned[0]} has no TP plan, and with sequence parallelism it would see only a slice "
                "of the sequence; register one with hetplan.runtime.register_tp_plan"
            )
        notes.append(f"no TP plan registered for {', '.join(unplanned)}: replicated on each TP group "
                     "(register one with hetplan.runtime.register_tp_plan)")
    _retie(root, aliases)


def has_tp_plan(layer: nn.Module, name: str, model_plan: dict[str, Any] | None) -> bool:
    """Whether ``apply_tp`` splits layer ``name``: a registered plan at or below
    it, else entries of the whole-model plan inside it. A layer with parameters
    and neither runs whole on every TP rank (``LayerSpec.tp_replicated``:
    costed so, ``hetplan.runtime.support``)."""
    return tp_registry.registered_plan_in(layer) or bool(model_plan and plan_inside(model_plan, name))


def _apply_outside_layers(root: nn.Module, layer_names: Sequence[str], model_plan: dict[str, Any], tp_mesh: Any,
                          parallelize_module: Any) -> None:
    """Entries of a whole-model plan for a module ``root`` holds outside every
    layer: T5's ``shared``, the embedding whose weight ``encoder.embed_tokens``
    (the plan's layer) shares, must be split alike or the two cannot be re-tied."""
    for path, style in model_plan.items():
        if any(c in path for c in "*?[") or owner_layer(path, layer_names) is not None or any(
                n == path or n.startswith(path + ".") for n in layer_names):
            continue
        try:
            root.get_submodule(path)
        except AttributeError:
            continue  # on another pipeline stage
        parallelize_module(root, tp_mesh, {path: style}, src_data_rank=None)


def plan_inside(model_plan: dict[str, Any], name: str) -> dict[str, Any]:
    """Entries of a whole-model TP plan under module ``name``, with keys relative
    to it (``""`` for the module itself); ``*`` matches one name component."""
    import fnmatch

    head = name.split(".")
    out = {}
    for pattern, style in model_plan.items():
        parts = pattern.split(".")
        if len(parts) >= len(head) and all(fnmatch.fnmatchcase(h, p) for h, p in zip(head, parts)):
            out[".".join(parts[len(head):])] = style
    return out


def _apply_registered(module: nn.Module, name: str, mesh: Any, tp: int, sp: bool, parallelize_module: Any) -> bool:
    fn = tp_registry.tp_plan_for(module)
    if fn is not None:
        plan = fn(module, tp_registry.TPSettings(tp=tp, sequence_parallel=sp, name=name))
        if "" in plan:
            plan = dict(plan)
            own = plan.pop("")
            if plan:
                parallelize_module(module, mesh, plan, src_data_rank=None)
            parallelize_module(module, mesh, own, src_data_rank=None)
        elif plan:
            parallelize_module(module, mesh, plan, src_data_rank=None)
        return True
    matched = False
    for child_name, child in module.named_children():
        matched |= _apply_registered(child, f"{name}.{child_name}", mesh, tp, sp, parallelize_module)
    return matched


def _retie(root: nn.Module, aliases: dict[str, str]) -> None:
    """parallelize_module replaces each module's parameters by new DTensor
    parameters, which unties shared weights; tie them again."""
    for fqn, canon in aliases.items():
        if fqn == canon:
            continue
        owner_name, _, pname = fqn.rpartition(".")
        canon_owner, _, cname = canon.rpartition(".")
        owner = root.get_submodule(owner_name)
        src = getattr(root.get_submodule(canon_owner), cname)
        cur = getattr(owner, pname)
        if cur is src:
            continue
        if type(cur) is not type(src) or getattr(cur, "placements", None) != getattr(src, "placements", None):
            raise HetplanError(
                f"tied parameters {canon!r} and {fqn!r} got different tensor-parallel layouts; "
                "give both modules TP plans that shard the shared weight the same way"
            )
        setattr(owner, pname, src)


# --- activation checkpointing ------------------------------------------------------------------
def _checkpoint_forward(module: nn.Module, layer: str = "") -> None:
    """Run ``module.forward`` under non-reentrant checkpointing (``layer``: its
    plan layer, for messages)."""
    from torch.utils.checkpoint import checkpoint

    inner = module.forward
    if dropout.has_dropout(module):  # recompute under the forward's dropout scope: the same masks
        options: dict[str, Any] = {"context_fn": dropout.checkpoint_context}
    else:
        options = {}

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        hf_recompute.refuse_cache(layer or type(module).__name__, args, kwargs)  # a replay writes a KV cache twice
        return checkpoint(inner, *args, use_reentrant=False, **options, **kwargs)

    module.forward = forward  # type: ignore[method-assign]  # wrapped in place


def apply_recompute(root: nn.Module, recompute: dict[str, str], notes: list[str],
                    core_layers: Collection[str]) -> None:
    """``full``: checkpoint the whole layer (keep only its input); ``selective``:
    checkpoint only its attention core (Korthikanti et al. 2022 §5): the
    submodules registered with ``register_selective_recompute``, or in a HF
    layer the attention function of each attention module
    (hetplan.runtime.hf_recompute). ``core_layers``: the layers the cost model
    charges an attention core for (``LayerSpec.attention_flops > 0``); selective
    on any other layer recomputes nothing, as it is costed. A HF layer with a
    costed core it cannot checkpoint is refused; another model's falls back to
    full recomputation, with a note. HF models train without their KV cache."""
    hf_recompute.no_kv_cache(root)
    hf_recompute.refuse_hf_checkpointing(root)
    fallback = []
    for name, how in recompute.items():
        if how == "none":
            continue
        layer = root.get_submodule(name)
        if how == "selective":
            if _checkpoint_core(layer, name) or name not in core_layers:
                continue
            if hf_recompute.is_hf_module(layer):
                raise HetplanError(f"selective recompute of layer {name!r}: none of its modules computes attention "
                                   "through transformers' attention interface; use recompute 'full' or 'none' for it")
            fallback.append(name)
        _checkpoint_forward(layer, name)
    if fallback:
        notes.append(f"selective recompute: no attention core registered in {', '.join(fallback)}; "
                     "recomputing those layers fully (hetplan.runtime.register_selective_recompute)")


def selective_refusal(layer: nn.Module, name: str) -> str:
    """Why ``apply_recompute`` cannot recompute only the attention core of layer
    ``name`` ("" if it can): no registered core and no HF attention module, or
    a HF attention module that computes its core inline."""
    if any(tp_registry.is_selective_target(m) for m in layer.modules()):
        return ""
    modules = hf_recompute.attention_modules(layer) if hf_recompute.is_hf_module(layer) else []
    why = next((w for w in map(hf_recompute.inline_attention, modules) if w), "")
    if modules and not why:
        return ""
    return (f"selective recompute of layer {name!r}: "
            + (why if why else "hetplan's runtime finds no attention core to recompute alone (register one with "
               "hetplan.runtime.register_selective_recompute)") + "; use recompute 'full' or 'none' for it")


def _checkpoint_core(layer: nn.Module, name: str) -> bool:
    """Checkpoint the layer's attention core (registered modules, else HF
    attention functions); False if it has none."""
    targets = [m for m in layer.modules() if tp_registry.is_selective_target(m)]
    for target in targets:
        _checkpoint_forward(target, name)
    return bool(targets) or (hf_recompute.is_hf_module(layer) and hf_recompute.checkpoint_attention_core(layer, name))


# --- compilation ----------------------------------------------------------------------------------
def apply_compile(root: nn.Module, layer_names: Sequence[str]) -> None:
    """``torch.compile`` each layer in place (``nn.Module.compile``), after TP and
    checkpointing and before FSDP, as torchtitan compiles per block: module and
    parameter names stay the model's, and identical blocks share one compiled
    graph."""
    for name in layer_names:
        root.get_submodule(name).compile()


# --- data parallelism ---------------------------------------------------------------------------
def apply_dp(root: nn.Module, zero: dict[str, int], dp_mesh: Any, notes: list[str],
             ignored: set[nn.Parameter] | None = None) -> list[tuple[nn.Module, bool]]:
    """Wrap each layer per its ZeRO stage, then the part itself (the FSDP root,
    which also takes parameters shared by two of its layers).

    Returns the wrapped modules with whether each reduces gradients on every
    micro-batch (ZeRO-3: yes, so unsharded gradients are freed at once) or
    only on the last one of a step (ZeRO-0/1/2: accumulate locally, reduce once).
    ``ignored``: parameters FSDP leaves alone (expert-parallel experts, synced
    over their own group by the runtime).
    """
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import fully_shard

    names = list(zero)
    shared: set[str | None] = set()
    for f, c in param_aliases(root).items():
        if f != c:
            shared |= {owner_layer(f, names), owner_layer(c, names)}
    shared.discard(None)
    wrapped: list[tuple[nn.Module, bool]] = []
    for name in names:
        if name in shared:
            continue
        layer = root.get_submodule(name)
        if not any(True for _ in layer.parameters()):
            continue
        z = zero[name]
        if z <= 1:  # ZeRO-1: whole weights and gradients; ctx.optimizer shards the states (runtime/zero1.py)
            replicate(layer, mesh=dp_mesh, ignored_params=ignored)
        else:
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=(z == 3), ignored_params=ignored)
        wrapped.append((layer, z == 3))
    if all(z <= 1 for z in zero.values()):
        replicate(root, mesh=dp_mesh, ignored_params=ignored)
        wrapped.append((root, False))
    else:
        fully_shard(root, mesh=dp_mesh, reshard_after_forward=False, ignored_params=ignored)
        wrapped.append((root, any(zero[n] == 3 for n in shared if n)))
    return wrapped


def apply_ddp(root: nn.Module, dp_mesh: Any) -> list[tuple[nn.Module, bool]]:
    """Plain data parallelism (every layer ZeRO-0, one stage, no TP/CP/EP): the
    whole part under DDP (torch's composable ``replicate``: bucketed all-reduces
    overlapping the backward, parameters plain tensors under their own names),
    which measured faster than FSDP2 ``replicate`` per layer (docs/runtime.md,
    "Speed"). DDP starts on the first forward, after the weights are materialised."""
    from torch.distributed._composable.replicate import replicate as ddp

    on_cuda = dp_mesh.device_type == "cuda"
    # the group, not the mesh: a mesh sliced from the run's larger one makes replicate add DDP+TP's
    # DTensor hooks to every forward (torch/distributed/_composable/replicate.py, "root_mesh != device_mesh")
    # gradient_as_bucket_view: the gradients are views into DDP's reduce buckets, so DDP keeps them once, as
    # FSDP2 and the cost model (model/runtime_memory.py) do, not once more in the buckets
    ddp(root, process_group=dp_mesh.get_group(), gradient_as_bucket_view=True,
        **({"device_id": torch.cuda.current_device()} if on_cuda else {}))
    return [(root, False)]


def set_accumulating(sync_modules: Sequence[tuple[nn.Module, bool]], last: bool) -> None:
    """Before a micro-batch's backward: wrapped modules that reduce on every
    micro-batch (ZeRO-3) do; the others reduce their gradients only on the
    step's ``last`` one and, until then, keep their gathered parameters
    (ZeRO-2: gathered once a step, as ZeRO keeps them and the cost model
    charges, not again for every micro-batch; torch pipelining does the same
    for its stages)."""
    from torch.distributed._composable.replicate import DDP

    for module, every in sync_modules:
        if isinstance(module, DDP):  # apply_ddp's whole part: no per-module flag
            module.set_requires_gradient_sync(every or last)
            continue
        module.set_requires_gradient_sync(every or last, recurse=False)
        if not every and hasattr(module, "set_reshard_after_backward"):
            module.set_reshard_after_backward(last, recurse=False)


# --- expert parallelism ---------------------------------------------------------------------------
def apply_ep(root: nn.Module, layer_names: Sequence[str], expert_mesh: Any, ep_group: Any,
             tp_group: Any = None) -> set[nn.Parameter]:
    """Shard the experts of every MoE module (a module with ``experts`` and
    ``ep_group``, as hetplan's :class:`~hetplan.runtime.models.MoE`; HF's fused
    experts are first made one, :func:`hetplan.runtime.ep.adapt_hf_experts`)
    over the mesh ``expert_mesh``, whose dims are some of ``edp`` (replicated:
    the expert-data-parallel copies), ``ep`` (``Shard(0)``: this rank holds
    ``num_experts / ep`` experts, tokens routed by all-to-all over ``ep_group``)
    and ``tp`` (expert tensor parallelism: each weight split along the dim its
    holder names in ``tp_shard_dims``, the others replicated; partial outputs
    summed over ``tp_group``). Returns the expert parameters."""
    from torch.distributed.tensor import distribute_tensor

    experts: set[nn.Parameter] = set()
    for name in layer_names:
        adapt_hf_experts(root.get_submodule(name))
        for module in root.get_submodule(name).modules():
            if not (hasattr(module, "experts") and hasattr(module, "ep_group")):
                continue
            module.ep_group = ep_group
            holder = module.experts
            if tp_group is not None:
                check_expert_tp(holder, name, expert_mesh["tp"].size())
                holder.tp_group = tp_group
            for pname, p in list(holder.named_parameters(recurse=False)):
                placements = _expert_placements(expert_mesh.mesh_dim_names, holder, pname)
                d = distribute_tensor(p.data, expert_mesh, placements, src_data_rank=None)
                new = nn.Parameter(d, requires_grad=p.requires_grad)
                setattr(holder, pname, new)
                experts.add(new)
    return experts


def _expert_placements(dims: Sequence[str], holder: nn.Module, pname: str) -> list[Any]:
    """One placement per expert-mesh dim (see :func:`apply_ep`)."""
    from torch.distributed.tensor import Replicate, Shard

    tp_dim = getattr(holder, "tp_shard_dims", {}).get(pname)
    rule = {"edp": Replicate(), "ep": Shard(0), "tp": Replicate() if tp_dim is None else Shard(tp_dim)}
    return [rule[d] for d in dims]


def check_expert_tp(holder: nn.Module, name: str, tp: int) -> None:
    """Expert TP needs the holder's own rule (``tp_shard_dims``) and a width ``tp``
    divides; a holder that cannot be split says why (``tp_refusal``)."""
    refusal = getattr(holder, "tp_refusal", None)
    if refusal is not None:
        raise HetplanError(refusal(name, tp))
    dims = getattr(holder, "tp_shard_dims", None)
    if dims is None or not hasattr(holder, "tp_group"):
        raise HetplanError(f"the experts of layer {name!r} ({type(holder).__name__}) say nothing of how tensor "
                           "parallelism splits them (tp_shard_dims, tp_group); use a plan with tp=1 there")
    for pname, dim in dims.items():
        p = getattr(holder, pname, None)
        if p is not None and p.size(dim) % tp:
            raise HetplanError(f"tp={tp} does not divide the expert width {p.size(dim)} of layer {name!r}; "
                               f"use a tp that divides {p.size(dim)}")


def moe_modules(model: nn.Module) -> list[nn.Module]:
    """The mixture-of-experts modules of a model (``experts`` and ``ep_group``)."""
    return [m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "ep_group")]


def apply_expert_zero(root: nn.Module, layer_names: Sequence[str], zero: dict[str, int], edp_mesh: Any,
                      divide_factor: int) -> list[tuple[nn.Module, bool]]:
    """ZeRO-2/3 for expert-parallel experts, as the cost model charges them:
    ``fully_shard`` each experts holder over the expert-data-parallel mesh (the
    ranks holding the same experts; torchtitan does the same), gradients summed
    there and divided by ``divide_factor`` (``dp * cp``, as the dense ones are
    averaged). Call before :func:`apply_dp`, which then leaves them alone.
    Returns the wrapped holders as :func:`apply_dp` does."""
    from torch.distributed.fsdp import fully_shard

    wrapped: list[tuple[nn.Module, bool]] = []
    for name in layer_names:
        if zero[name] < 2:
            continue
        for module in moe_modules(root.get_submodule(name)):
            fully_shard(module.experts, mesh=edp_mesh, reshard_after_forward=zero[name] == 3)
            module.experts.set_gradient_divide_factor(float(divide_factor))
            module.experts.set_force_sum_reduction_for_comms(True)  # sum, then divide: gloo has no PREMUL_SUM
            wrapped.append((module.experts, zero[name] == 3))
    return wrapped


# --- materialisation and initial values -----------------------------------------------------------
def stable_seed(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}:{name}".encode()) & 0x7FFFFFFF


def default_init(fqn: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
    """Biases 0, 1-D weights (norms) 1, everything else N(0, 0.02)."""
    with torch.no_grad():
        if fqn.endswith("bias"):
            tensor.zero_()
        elif tensor.dim() <= 1:
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, 0.02, generator=generator)


class InitialValues:
    """Full initial value of any parameter of the model, by name, independent of the plan.

    With ``init_fn`` (the model's ``init_parameter(fqn, tensor, generator)``),
    each tensor is filled by it from a generator seeded by (seed, name).
    Without, the parameter's own module runs ``reset_parameters()`` on a CPU
    copy under a torch seed derived from (seed, module name) -- PyTorch's
    default initialisation, made independent of the split -- and parameters of
    modules without ``reset_parameters`` get :func:`default_init`.
    """

    def __init__(self, meta_model: nn.Module, seed: int, init_fn: InitFn | None) -> None:
        self.meta = meta_model
        self.seed = seed
        self.init_fn = init_fn
        self.aliases = param_aliases(meta_model)
        self._leaf_cache: dict[str, dict[str, torch.Tensor]] = {}

    def _reset_leaf(self, owner: str, module: nn.Module) -> dict[str, torch.Tensor]:
        return _reset_leaf_values(module, stable_seed(self.seed, owner))

    def value(self, fqn: str) -> torch.Tensor:
        canon = self.aliases.get(fqn, fqn)
        owner, _, pname = canon.rpartition(".")
        meta_param = self.meta.get_parameter(canon)
        if self.init_fn is not None:
            t = torch.empty(meta_param.shape, dtype=meta_param.dtype)
            g = torch.Generator().manual_seed(stable_seed(self.seed, canon))
            self.init_fn(canon, t, g)
            return t
        module = self.meta.get_submodule(owner) if owner else self.meta
        if hasattr(module, "reset_parameters") or hasattr(module, "_reset_parameters"):
            if owner not in self._leaf_cache:
                self._leaf_cache = {owner: self._reset_leaf(owner, module)}  # one module's values at a time
            if pname in self._leaf_cache[owner]:
                return self._leaf_cache[owner][pname]
        t = torch.empty(meta_param.shape, dtype=meta_param.dtype)
        default_init(canon, t, torch.Generator().manual_seed(stable_seed(self.seed, canon)))
        return t


def _reset_leaf_values(module: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """The module's own parameters after its ``reset_parameters()`` on a CPU
    copy (children's parameters empty: a reset that needs them falls back)."""
    clone = copy.copy(module)
    clone._parameters = {k: (None if v is None else nn.Parameter(torch.empty_like(v, device="cpu")))
                         for k, v in module._parameters.items()}
    clone._modules = {k: (copy.deepcopy(v).to_empty(device="cpu") if v is not None else None)
                      for k, v in module._modules.items()}
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            with torch.no_grad():
                (getattr(clone, "reset_parameters", None) or clone._reset_parameters)()
    except Exception:  # noqa: BLE001 - a reset that cannot run on a bare copy: use the default rule
        return {}
    return {k: v.detach() for k, v in clone._parameters.items() if v is not None}


def materialize(root: nn.Module, device: torch.device, values: InitialValues) -> None:
    """Allocate the (sharded) parameters on ``device`` and fill each with its
    slice of the plan-independent initial value."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    buffers = [n for n, _ in root.named_buffers()]
    if buffers:
        raise HetplanError(
            f"the model has buffers ({', '.join(buffers[:3])}), which building on the meta device loses; "
            "compute them in forward, or use ctx.parallelize(..., meta_init=False)"
        )
    aliases = param_aliases(root)
    root.to_empty(device=device)
    _retie(root, aliases)  # to_empty makes a new tensor for each module's reference to a shared one
    with torch.no_grad():
        for fqn, p in root.named_parameters():
            full = values.value(fqn).to(device=device, dtype=p.dtype)
            if isinstance(p, DTensor):
                local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
                p.to_local().copy_(local)
            else:
                p.copy_(full)
