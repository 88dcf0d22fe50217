"""Build a ModelSpec from any ``torch.nn.Module`` by running it on the meta device.

The module's forward pass is run once on ``torch.device("meta")``: tensors have
shapes and dtypes but no data, so a 70B-parameter model traces in a second
without allocating memory. During that pass we measure, per layer:

* **parameters** — exact: every parameter the layer's modules own or that its
  operators read (found by storage, so ``lm_head.weight is wte.weight`` ties
  are seen), counted in each layer that uses it, with ``tied_group`` set;
* **forward FLOPs** — ``torch.utils.flop_counter.FlopCounterMode`` (matmuls,
  convolutions, attention kernels), plus ``aten._grouped_mm``, which the
  counter does not know (torch 2.13) and transformers' MoE experts run on
  (``experts_implementation="grouped_mm"``, its default): without it a
  mixture-of-experts layer would have no expert FLOPs. On the meta device
  ``scaled_dot_product_attention`` runs its math decomposition (two ``bmm``),
  so its FLOPs *are* counted (torch 2.13). Under ``FakeTensorMode`` on CPU it
  dispatches to a fused CPU kernel the counter does not know and counts 0;
  if a call to ``F.scaled_dot_product_attention`` ever counts 0 here we add
  ``4·B·H·Lq·Lk·E`` analytically (``meta["sdpa_flops_added"]`` says so);
* **activation bytes kept for backward** — every tensor autograd saves, via
  ``torch.autograd.graph.saved_tensors_hooks``; parameters and buffers are
  excluded, and a storage is counted once (views of one tensor, or one tensor
  saved by two layers, count once, in the first layer that saved it). The
  SDPA math path upcasts 16-bit inputs to fp32 internally; tensors it saves
  are counted at the input precision (what Megatron's unfused softmax keeps).
  Off CUDA, dropout multiplies by a mask drawn in the input's dtype; CUDA's
  fused dropout keeps a bool mask, so masks count 1 byte per element;
* **bytes in and out of each layer** (pipeline point-to-point), and an
  estimate of memory-bound (elementwise) traffic.

What the meta pass cannot know is how a tensor-parallel implementation would
split a layer; three fields are estimated from shapes assuming Megatron-style
TP (see ``docs/model-import.md``): ``act_tp_replicated_bytes`` (saved tensors
shaped like the layer's hidden state or a 2-D view of it), ``act_attention_core_bytes`` (saved
tensors shaped like attention scores, i.e. like a >=3-D softmax output) and
``tp_comm_bytes`` (one all-reduce of the hidden state per attention call and
one per MLP/embedding).

All numbers are divided by the example batch size: the spec is per sample.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from hetplan.errors import HetplanError
from hetplan.model.spec import LayerSpec, ModelSpec
from hetplan.progress import Progress

def _import_torch() -> Any:
    try:
        import torch
    except ImportError:
        raise HetplanError(
            "tracing an nn.Module needs torch, which is not installed; run: pip install -e .[torch]"
        ) from None
    return torch


# --------------------------------------------------------------------------- helpers


def _tensors(obj: Any, torch: Any) -> Iterator[Any]:
    """All tensors in a nested structure of tuples, lists and dicts (ModelOutput too)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value, torch)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value, torch)


def _storage_key(t: Any) -> int:
    try:
        return int(t.untyped_storage()._cdata)
    except Exception:  # tensor subclasses without a plain storage
        return id(t)


def _storage_nbytes(t: Any) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:
        return int(t.numel() * t.element_size())


def _unique_bytes(tensors: list[Any]) -> float:
    seen: set[int] = set()
    total = 0.0
    for t in tensors:
        key = _storage_key(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _activation_inputs(tensors: list[Any]) -> list[Any]:
    """The tensors that carry activations into a layer: those that require grad
    (they depend on earlier parameters); failing that the floating ones (a
    model's raw input); failing that all (token ids)."""
    grad = [t for t in tensors if t.requires_grad]
    if grad:
        return grad
    floating = [t for t in tensors if t.is_floating_point()]
    return floating or tensors


def _main_shape(tensors: list[Any]) -> tuple[int, ...]:
    if not tensors:
        return ()
    return tuple(max(tensors, key=lambda t: t.numel()).shape)


def _is_ancestor(parent: str, child: str) -> bool:
    """``parent`` is a proper ancestor of module path ``child`` ("" is the root)."""
    return parent != child and (parent == "" or child.startswith(parent + "."))


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _owns_params(module: Any) -> bool:
    return any(True for _ in module.parameters())


def block_containers(root: Any) -> list[str]:
    """Paths of the ModuleLists/Sequentials that hold the model's repeated blocks.

    A container qualifies when at least two of its children with parameters
    are of the same class. Containers whose repeated children are composite
    (blocks made of several modules) win over containers of plain leaf layers
    (a Sequential MLP stack); among the winners only the top-most are kept,
    so the MLP ``Sequential`` inside each transformer block is not a container.
    """
    torch = _import_torch()
    nn = torch.nn
    composite: list[str] = []
    leafy: list[str] = []
    for path, module in root.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        kids = [c for c in module.children() if _owns_params(c)]
        counts = Counter(type(c) for c in kids)
        repeated = [c for c in kids if counts[type(c)] >= 2]
        if len(repeated) < 2:
            continue
        if any(any(True for _ in c.children()) for c in repeated):
            composite.append(path)
        else:
            leafy.append(path)
    chosen = composite or leafy
    return [p for p in chosen if not any(_is_ancestor(q, p) for q in chosen)]


def expand_layer_names(root: Any, names: list[str]) -> list[str]:
    """Resolve user layer names; ``*`` matches one path segment
    (``"layers.*.blocks.*"``). Errors name the first bad entry."""
    all_paths = [p for p, _ in root.named_modules() if p]
    out: list[str] = []
    for name in names:
        if "*" in name:
            depth = name.count(".")
            hits = [
                p
                for p in all_paths
                if p.count(".") == depth
                and all(fnmatch.fnmatchcase(a, b) for a, b in zip(p.split("."), name.split(".")))
            ]
            if not hits:
                raise HetplanError(f"layer pattern {name!r} matches no submodule of {type(root).__name__}")
            out.extend(hits)
        else:
            try:
                root.get_submodule(name)
            except AttributeError:
                examples = ", ".join(all_paths[:6])
                raise HetplanError(
                    f"{type(root).__name__} has no submodule {name!r}; module names look like: {examples}"
                ) from None
            out.append(name)
    if len(set(out)) != len(out):
        dup = next(n for n in out if out.count(n) > 1)
        raise HetplanError(f"layer {dup!r} is listed twice in layer_names")
    for a in out:
        for b in out:
            if _is_ancestor(a, b):
                raise HetplanError(f"layer_names lists both {a!r} and its submodule {b!r}; keep one")
    return out


# --------------------------------------------------------------------------- tracing state


@dataclass
class _Segment:
    """Work done while one layer anchor (or no anchor) was running."""

    anchor: int | None  # index into anchors, None for work between/around anchors
    after: int | None = None  # free segments: the anchor that ran last before this one
    interlude: bool = False  # free segment started by a module outside the previous stack
    flops: float = 0.0
    attention_flops: float = 0.0
    gemms: int = 0
    param_gemms: int = 0
    embeddings: int = 0
    attention_calls: int = 0
    mem_bytes: float = 0.0
    params_used: set[str] = field(default_factory=set)
    modules: list[str] = field(default_factory=list)
    saved: list[tuple[tuple[int, ...], float, bool]] = field(default_factory=list)  # shape, bytes, linear input
    scores_dims: set[tuple[int, int]] = field(default_factory=set)
    heads: int = 0
    vocab: int = 0


@dataclass
class _Anchor:
    path: str
    group: int  # container index; anchors in one group are consecutive blocks
    calls: int = 0
    input_bytes: float = 0.0
    input_shape: tuple[int, ...] = ()
    output_bytes: float = 0.0


class _Tracer:
    def __init__(self, torch: Any, param_names: dict[int, str], buffer_keys: set[int]) -> None:
        self.torch = torch
        self.param_names = param_names  # storage key -> canonical parameter name
        self.buffer_keys = buffer_keys
        self.anchors: list[_Anchor] = []
        self.structural: set[str] = {""}
        self.segments: list[_Segment] = [_Segment(anchor=None)]
        self.module_stack: list[str] = []
        self.saved_seen: set[int] = set()
        self.keep_alive: list[Any] = []
        self.in_sdpa_dtype: Any = None
        self.in_linear = False  # inside F.linear: what autograd saves now is the linear's input
        self.sdpa_added = 0.0
        self.flop_counter: Any = None
        self.group_parent: dict[int, str] = {}
        self.anchor_paths: set[str] = set()
        self.mask_keys: set[int] = set()  # storages of dropout masks
        self.progress: Progress | None = None  # one step per layer entered (long traces show where they are)

    @property
    def seg(self) -> _Segment:
        return self.segments[-1]

    # -- module hooks
    def enter_module(self, path: str) -> None:
        seg = self.seg
        if path in self.anchor_paths:
            self.module_stack.append(path)
            return
        top_level = all(p in self.structural for p in self.module_stack) and path not in self.structural
        if seg.anchor is None and top_level:
            # After a block stack, modules of that stack (T5's encoder.final_layer_norm)
            # stay with its last block; the first module outside it starts an interlude.
            if seg.after is not None and not seg.interlude:
                stack_parent = self.group_parent.get(self.anchors[seg.after].group, "")
                if not _is_ancestor(stack_parent, path):
                    if _has_work(seg):
                        seg = _Segment(anchor=None, after=seg.after, interlude=True)
                        self.segments.append(seg)
                    else:
                        seg.interlude = True
            seg.modules.append(path)
        self.module_stack.append(path)

    def exit_module(self, path: str) -> None:
        if self.module_stack and self.module_stack[-1] == path:
            self.module_stack.pop()

    def enter_anchor(self, index: int, args: tuple, kwargs: dict) -> None:
        anchor = self.anchors[index]
        if anchor.calls == 0:
            tensors = _activation_inputs(list(_tensors((args, kwargs), self.torch)))
            anchor.input_bytes = _unique_bytes(tensors)
            # the hidden state: by convention the first positional argument
            # (T5 blocks also take a larger position-bias tensor)
            first = next(_tensors(args, self.torch), None)
            floating = first is not None and first.is_floating_point()
            anchor.input_shape = tuple(first.shape) if first is not None and floating else _main_shape(tensors)
        anchor.calls += 1
        self.segments.append(_Segment(anchor=index))
        if self.progress is not None:
            self.progress.advance(note=anchor.path)

    def exit_anchor(self, index: int, output: Any) -> None:
        tensors = _activation_inputs(list(_tensors(output, self.torch)))
        self.anchors[index].output_bytes = _unique_bytes(tensors)
        self.segments.append(_Segment(anchor=None, after=index))

    # -- autograd saved tensors
    def on_saved(self, t: Any) -> Any:
        key = _storage_key(t)
        if key in self.param_names or key in self.buffer_keys or key in self.saved_seen:
            return t
        self.saved_seen.add(key)
        self.keep_alive.append(t)  # storage addresses stay unique while tracing
        nbytes = float(_storage_nbytes(t))
        if key in self.mask_keys:  # a dropout mask: 1 byte per element, as CUDA's fused dropout keeps it
            nbytes = float(t.untyped_storage().nbytes() // max(t.element_size(), 1))
        low = self.in_sdpa_dtype
        if low is not None and t.is_floating_point() and t.element_size() > low.itemsize:
            nbytes *= low.itemsize / t.element_size()  # the math path's fp32 upcast
        # a block's linear input, kept for the weight gradient (FP8 training keeps it in one byte);
        # heads outside the blocks stay 16-bit, as Megatron's output layer does
        linear = self.in_linear and self.seg.anchor is not None and t.is_floating_point()
        self.seg.saved.append((tuple(t.shape), nbytes, linear))
        return t

    # -- operators
    def on_op(self, func: Any, args: tuple, kwargs: dict, run: Callable[[], Any]) -> Any:
        torch = self.torch
        before = self.flop_counter.get_total_flops()
        out = run()
        flops = self.flop_counter.get_total_flops() - before
        seg = self.seg
        inputs = list(_tensors((args, kwargs), torch))
        uses_param = False
        for t in inputs:
            name = self.param_names.get(_storage_key(t))
            if name is not None:
                seg.params_used.add(name)
                uses_param = True
        packet = func.overloadpacket
        aten = torch.ops.aten
        if flops > 0:
            seg.flops += flops
            seg.gemms += 1
            if uses_param:
                seg.param_gemms += 1
            else:
                seg.attention_flops += flops  # activation x activation: attention core
        elif not func.is_view:
            outs = list(_tensors(out, torch))
            out_bytes = sum(t.numel() * t.element_size() for t in outs)
            cap = max((t.numel() * t.element_size() for t in outs), default=0)
            in_bytes = sum(min(t.numel() * t.element_size(), cap) for t in inputs)
            seg.mem_bytes += out_bytes + in_bytes
        if packet in (aten.bernoulli_, aten.bernoulli):
            # dropout off CUDA draws a mask in the input's dtype and multiplies by it;
            # CUDA's fused native_dropout keeps a bool mask
            self.mask_keys.update(_storage_key(t) for t in _tensors(out, torch))
        elif packet is aten.native_dropout and isinstance(out, tuple) and len(out) == 2:
            self.mask_keys.add(_storage_key(out[1]))
        if packet is aten.embedding and uses_param:
            seg.embeddings += 1
            if not seg.vocab and inputs:
                seg.vocab = int(inputs[0].shape[0])
        if packet in (aten._softmax, aten._safe_softmax) and isinstance(out, torch.Tensor) and out.dim() >= 3:
            seg.scores_dims.add(tuple(out.shape[-2:]))
            seg.attention_calls += 1
            if out.dim() >= 4:
                heads = int(out.shape[-3])
                seg.heads = min(seg.heads, heads) if seg.heads else heads
        return out


def _make_modes(tracer: _Tracer) -> tuple[Any, Any]:
    torch = tracer.torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    sdpa = torch.nn.functional.scaled_dot_product_attention
    linear = torch.nn.functional.linear

    class _FunctionMode(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func is linear:
                outer_linear, tracer.in_linear = tracer.in_linear, True
                try:
                    return func(*args, **kwargs)
                finally:
                    tracer.in_linear = outer_linear
            if func is not sdpa:
                return func(*args, **kwargs)
            q, k = args[0], args[1]
            v = args[2] if len(args) > 2 else kwargs["value"]
            before = tracer.flop_counter.get_total_flops()
            outer = tracer.in_sdpa_dtype
            tracer.in_sdpa_dtype = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else None
            try:
                out = func(*args, **kwargs)
            finally:
                tracer.in_sdpa_dtype = outer
            if tracer.flop_counter.get_total_flops() == before:
                # the kernel was not counted (e.g. a fused CPU kernel): QK^T and scores·V
                batch = 1
                for d in q.shape[:-2]:
                    batch *= int(d)
                added = 2.0 * batch * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])
                seg = tracer.seg
                seg.flops += added
                seg.attention_flops += added
                seg.gemms += 2
                seg.attention_calls += 1
                if q.dim() >= 3:
                    seg.heads = min(seg.heads, int(q.shape[-3])) if seg.heads else int(q.shape[-3])
                tracer.sdpa_added += added
            return out

    class _DispatchMode(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            return tracer.on_op(func, args, kwargs, lambda: func(*args, **kwargs))

    return _FunctionMode(), _DispatchMode()


# --------------------------------------------------------------------------- public API


def model_from_module(
    module_or_factory: Any,
    example_inputs: Any,
    name: str = "custom",
    layer_names: list[str] | None = None,
    dtype_bytes: int | None = None,
    *,
    family: str = "custom",
    seq_len: int | None = None,
) -> ModelSpec:
    """Trace ``module_or_factory`` on the meta device into a per-sample ModelSpec.

    Args:
        module_or_factory: an ``nn.Module`` (on any device: its parameters are
            replaced by meta tensors for the trace, the module is not changed)
            or a zero-argument callable returning one, which is called under
            ``torch.device("meta")`` so nothing is allocated.
        example_inputs: what the forward takes: a tensor, a tuple/list of
            positional arguments, or a dict of keyword arguments. Dim 0 of the
            first tensor is the batch size; results are divided by it.
        name: the ModelSpec name.
        layer_names: module paths to use as layers (``*`` matches one path
            segment, e.g. ``"layers.*.blocks.*"``). Default: the blocks of the
            model's ModuleList/Sequential block stacks, with the modules before
            them as the first layer and those after as the last.
        dtype_bytes: training precision (2 = bf16, 4 = fp32); default: that of
            the module's floating-point parameters.
        family: ModelSpec family label.
        seq_len: tokens per sample; default: dim 1 of the first input if it
            has one, else 1.

    Returns:
        A ModelSpec whose layers are in execution order; ``meta["layer_modules"]``
        lists, per layer, the module paths that ran in it.
    """
    torch = _import_torch()
    module = _materialize(module_or_factory, torch)
    dtype = _target_dtype(module, dtype_bytes, torch)
    args, kwargs, batch = _meta_inputs(example_inputs, dtype, torch)
    params = _meta_state(module, dtype, torch)
    tracer = _Tracer(torch, params.names, params.buffer_keys)
    user_mode = _set_anchors(tracer, module, layer_names)
    with Progress(f"tracing {name or type(module).__name__}", total=len(tracer.anchors) or None) as progress:
        tracer.progress = progress
        output = _traced_forward(module, params.state, args, kwargs, tracer, torch)
    tracer.progress = None
    trace = _Trace(
        tracer=tracer,
        module=module,
        batch=batch,
        dtype=dtype,
        user_mode=user_mode,
        params=params,
        output_bytes=_output_bytes(output, torch),
        input_bytes=_unique_bytes(list(_tensors((args, kwargs), torch))),
    )
    return _assemble(trace, name, family, seq_len if seq_len is not None else _infer_seq_len(args, kwargs, torch))


@dataclass
class _Params:
    """Meta copies of a module's parameters and buffers, and who holds each parameter."""

    state: dict[str, Any] = field(default_factory=dict)  # every name, tied ones included -> meta tensor
    names: dict[int, str] = field(default_factory=dict)  # storage key -> canonical name
    numel: dict[str, int] = field(default_factory=dict)
    holders: dict[str, set[str]] = field(default_factory=dict)  # canonical name -> every module path holding it
    buffer_keys: set[int] = field(default_factory=set)


def _meta_state(module: Any, dtype: Any, torch: Any) -> _Params:
    """Meta copies of parameters and buffers (ties preserved by identity), so the trace allocates nothing."""
    nn = torch.nn
    out = _Params()
    by_identity: dict[int, Any] = {}
    canonical: dict[int, str] = {}
    for pname, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in by_identity:
            new_dtype = dtype if p.is_floating_point() else p.dtype
            meta_p = nn.Parameter(torch.empty(p.shape, dtype=new_dtype, device="meta"), requires_grad=p.requires_grad)
            by_identity[id(p)] = meta_p
            canonical[id(p)] = pname
            out.names[_storage_key(meta_p)] = pname
            out.numel[pname] = p.numel()
        out.holders.setdefault(canonical[id(p)], set()).add(_parent(pname))
        out.state[pname] = by_identity[id(p)]
    for bname, b in module.named_buffers(remove_duplicate=False):
        if id(b) not in by_identity:
            new_dtype = dtype if b.is_floating_point() else b.dtype
            by_identity[id(b)] = torch.empty(b.shape, dtype=new_dtype, device="meta")
            out.buffer_keys.add(_storage_key(by_identity[id(b)]))
        out.state[bname] = by_identity[id(b)]
    return out


def _set_anchors(tracer: _Tracer, module: Any, layer_names: list[str] | None) -> bool:
    """Tell the tracer which modules are layers, so it can credit work to them; True for user layer_names."""
    modules = dict(module.named_modules())
    paths, groups = _anchor_paths(tracer, module, modules, layer_names)
    tracer.anchors = [_Anchor(path=p, group=g) for p, g in zip(paths, groups)]
    tracer.anchor_paths = set(paths)
    for p in paths:
        tracer.structural.update(q for q in modules if _is_ancestor(q, p))
    return bool(layer_names)


def _anchor_paths(
    tracer: _Tracer, module: Any, modules: dict[str, Any], layer_names: list[str] | None
) -> tuple[list[str], list[int]]:
    """Pick the layer modules and their block-stack groups: the user's, else the blocks of each stack."""
    if layer_names:
        named = expand_layer_names(module, list(layer_names))
        return named, [0] * len(named)
    paths: list[str] = []
    groups: list[int] = []
    for gi, cpath in enumerate(block_containers(module)):
        tracer.group_parent[gi] = _parent(cpath) if cpath else ""
        for child_name, child in modules[cpath].named_children():
            if _owns_params(child):
                paths.append(f"{cpath}.{child_name}" if cpath else child_name)
                groups.append(gi)
    if not paths:  # no block stack: the root's children with parameters
        for child_name, child in module.named_children():
            if _owns_params(child):
                paths.append(child_name)
                groups.append(len(groups))
    if not paths:
        return [""], [0]
    return paths, groups


def _traced_forward(module: Any, state: dict, args: tuple, kwargs: dict, tracer: _Tracer, torch: Any) -> Any:
    """Run the traced forward with module hooks installed, and always take the hooks off again."""
    handles: list[Any] = []
    try:
        _add_hooks(module, tracer, handles)
        return _run(module, state, args, kwargs, tracer, torch)
    finally:
        for h in handles:
            h.remove()


def _add_hooks(module: Any, tracer: _Tracer, handles: list[Any]) -> None:
    """Hook every submodule so the tracer knows which module, and which layer, each operator runs in."""
    anchor_index = {a.path: i for i, a in enumerate(tracer.anchors)}
    for mpath, sub in dict(module.named_modules()).items():
        handles.append(sub.register_forward_pre_hook(lambda m, a, path=mpath: tracer.enter_module(path)))
        handles.append(sub.register_forward_hook(lambda m, a, o, path=mpath: tracer.exit_module(path)))
        if mpath in anchor_index:
            i = anchor_index[mpath]
            handles.append(
                sub.register_forward_pre_hook(lambda m, a, kw, i=i: tracer.enter_anchor(i, a, kw), with_kwargs=True)
            )
            handles.append(sub.register_forward_hook(lambda m, a, o, i=i: tracer.exit_anchor(i, o)))


def _output_bytes(output: Any, torch: Any) -> float:
    """Bytes the model hands to the loss: its floating-point outputs (all outputs if none are)."""
    out_tensors = [t for t in _tensors(output, torch) if t.is_floating_point()] or list(_tensors(output, torch))
    return _unique_bytes(out_tensors)


def _materialize(module_or_factory: Any, torch: Any) -> Any:
    nn = torch.nn
    if isinstance(module_or_factory, nn.Module):
        return module_or_factory
    if not callable(module_or_factory):
        raise HetplanError(
            f"model_from_module needs an nn.Module or a factory returning one, got {type(module_or_factory).__name__}"
        )
    try:
        with torch.device("meta"):
            module = module_or_factory()
    except HetplanError:
        raise
    except Exception as exc:  # the user's factory failed: say where, not a deep traceback
        raise HetplanError(f"the model factory raised {type(exc).__name__}: {_first_line(exc)}") from exc
    if not isinstance(module, nn.Module):
        raise HetplanError(f"the model factory returned {type(module).__name__}, not an nn.Module")
    return module


def _target_dtype(module: Any, dtype_bytes: int | None, torch: Any) -> Any:
    floats = [p.dtype for p in module.parameters() if p.is_floating_point()]
    current = floats[0] if floats else torch.float32
    if dtype_bytes is None:
        if current.itemsize not in (2, 4):
            raise HetplanError(f"parameters are {current}; pass dtype_bytes=2 (bf16) or 4 (fp32)")
        return current
    if dtype_bytes not in (2, 4):
        raise HetplanError(f"dtype_bytes must be 2 (bf16/fp16) or 4 (fp32), got {dtype_bytes}")
    if current.itemsize == dtype_bytes:
        return current
    return torch.bfloat16 if dtype_bytes == 2 else torch.float32


def _meta_inputs(example_inputs: Any, dtype: Any, torch: Any) -> tuple[tuple, dict, int]:
    def to_meta(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            new_dtype = dtype if x.is_floating_point() else x.dtype
            return torch.empty(x.shape, dtype=new_dtype, device="meta")
        if isinstance(x, dict):
            return {k: to_meta(v) for k, v in x.items()}
        if type(x) in (list, tuple):
            return type(x)(to_meta(v) for v in x)
        return x

    args: tuple[Any, ...]
    if isinstance(example_inputs, dict):
        args, kwargs = (), to_meta(example_inputs)
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(to_meta(v) for v in example_inputs), {}
    else:
        args, kwargs = (to_meta(example_inputs),), {}
    first = next(_tensors((args, kwargs), torch), None)
    if first is None:
        raise HetplanError("example_inputs holds no tensor; pass e.g. torch.zeros(batch, seq, dtype=torch.long)")
    if first.dim() == 0 or first.shape[0] < 1:
        raise HetplanError(
            f"the first example input has shape {tuple(first.shape)}; its dim 0 must be a batch size >= 1"
        )
    return args, kwargs, int(first.shape[0])


def _infer_seq_len(args: tuple, kwargs: dict, torch: Any) -> int:
    """Token ids (B, S) and hidden states (B, S, H) have a sequence; feature
    vectors (B, D) and images (B, C, H, W) count as one position."""
    first = next(_tensors((args, kwargs), torch))
    if first.is_floating_point():
        return int(first.shape[1]) if first.dim() == 3 else 1
    return int(first.shape[1]) if first.dim() >= 2 else 1


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def grouped_mm_flops(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """FLOPs of ``torch._grouped_mm(a, b, offs)``: one matmul per group, 2 per
    multiply-add. 2-D ``a`` (rows of all groups) x 3-D ``b`` (one matrix per
    group) is the MoE case: every row meets one ``K x N`` matrix."""
    a, b = list(a_shape), list(b_shape)
    if len(a) == 2 and len(b) == 3:  # (S, K) x (G, K, N): rows split by offs
        return 2 * a[0] * a[1] * b[2]
    if len(a) == 3 and len(b) == 3:  # (G, M, K) x (G, K, N): batched
        return 2 * a[0] * a[1] * a[2] * b[2]
    if len(a) == 2 and len(b) == 2:  # (M, K) x (K, N): K split by offs, one output per group
        return 2 * a[0] * a[1] * b[1]
    if len(a) == 3 and len(b) == 2:  # (G, M, K) x (K, N): N split by offs
        return 2 * a[1] * a[2] * b[1]
    return 0


def _run(module: Any, state: dict, args: tuple, kwargs: dict, tracer: _Tracer, torch: Any) -> Any:
    from torch.func import functional_call
    from torch.utils.flop_counter import FlopCounterMode

    modes = {m: m.training for m in module.modules()}
    module.train()  # training costs: dropout masks and everything backward needs
    function_mode, dispatch_mode = _make_modes(tracer)
    extra = {torch.ops.aten._grouped_mm: grouped_mm_flops}
    try:
        with torch.device("meta"), torch.enable_grad(), FlopCounterMode(display=False, custom_mapping=extra) as counter:
            tracer.flop_counter = counter
            with function_mode, dispatch_mode, torch.autograd.graph.saved_tensors_hooks(tracer.on_saved, lambda t: t):
                return functional_call(module, state, args, kwargs, tie_weights=True, strict=False)
    except HetplanError:
        raise
    except Exception as exc:
        hint = ""
        text = str(exc)
        if "meta" in text.lower() or isinstance(exc, NotImplementedError):
            hint = (
                " (the forward reads tensor values, e.g. .item() or data-dependent control flow,"
                " which the meta device cannot provide)"
            )
        raise HetplanError(
            f"tracing {type(module).__name__} on the meta device failed: {type(exc).__name__}: {_first_line(exc)}{hint}"
        ) from exc
    finally:
        for m, training in modes.items():
            m.training = training


@dataclass
class _Trace:
    """What one traced forward pass measured: everything ``_assemble`` needs besides the spec's labels."""

    tracer: _Tracer
    module: Any
    batch: int
    dtype: Any
    user_mode: bool  # layers are the user's layer_names, not found block stacks
    params: _Params
    output_bytes: float  # the model's output, for the last layer
    input_bytes: float  # the model's input, for the first layer


@dataclass
class _Layer:
    name: str
    kind: str
    segments: list[_Segment]
    anchor: int | None
    modules: list[str]
    input_bytes: float = 0.0
    output_bytes: float = 0.0
    hidden_shape: tuple[int, ...] = ()
    params_used: set[str] = field(default_factory=set)


@dataclass
class _FreeSegments:
    """Work that ran outside every layer module and may become a layer of its own."""

    prologue: list[_Segment] = field(default_factory=list)
    epilogue: list[_Segment] = field(default_factory=list)
    interludes: dict[int, list[_Segment]] = field(default_factory=dict)  # keyed by the previous anchor


@dataclass
class _Place:
    """What a layer's LayerSpec needs from the other layers: a unique name and its share of tied parameters."""

    name: str
    tied_group: list[str]
    tied_params: int  # tied parameters an earlier layer already counts
    is_last: bool


def _assemble(trace: _Trace, name: str, family: str, seq_len: int) -> ModelSpec:
    """Turn what the traced forward pass measured into a per-sample ModelSpec."""
    tracer = trace.tracer
    _check_anchors_ran(tracer.anchors, trace.user_mode)
    order, anchor_layers = _anchor_layers(tracer, trace.user_mode)
    free = _place_segments(tracer, order, anchor_layers, trace.user_mode)
    layers = _layer_sequence(order, anchor_layers, free, trace)
    _set_boundaries(layers, trace)
    _fill_hidden_shapes(layers)
    unused = _assign_params(layers, trace)
    places = _places(layers, trace.params.numel)
    specs = [_layer_spec(layer, place, trace) for layer, place in zip(layers, places)]
    hidden, heads, vocab = _model_dims(layers, tracer.segments)
    return ModelSpec(
        name=name,
        family=family,
        layers=tuple(specs),
        seq_len=int(seq_len),
        dtype_bytes=trace.dtype.itemsize,
        hidden_size=hidden,
        num_heads=heads,
        vocab_size=vocab,
        meta=_model_meta(trace, layers, places, unused),
    )


def _check_anchors_ran(anchors: list[_Anchor], user_mode: bool) -> None:
    """Fail early, naming the module, when a layer module never ran: its layer would be empty."""
    ran = [i for i, a in enumerate(anchors) if a.calls > 0]
    if not ran:
        raise HetplanError(
            f"none of the layer modules ({', '.join(a.path or '<root>' for a in anchors[:4])}) ran in the forward pass"
        )
    if user_mode:
        missing = [a.path for a in anchors if a.calls == 0]
        if missing:
            raise HetplanError(f"layer {missing[0]!r} was not called in the forward pass; remove it from layer_names")


def _anchor_layers(tracer: _Tracer, user_mode: bool) -> tuple[list[int], dict[int, _Layer]]:
    """One layer per layer module, in order of first execution (not of registration)."""
    anchors = tracer.anchors
    order: list[int] = []
    for s in tracer.segments:
        if s.anchor is not None and s.anchor not in order:
            order.append(s.anchor)
    anchor_layers: dict[int, _Layer] = {}
    for i in order:
        path = anchors[i].path
        anchor_layers[i] = _Layer(
            name=path or "model",
            kind="layer" if user_mode else "block",
            segments=[],
            anchor=i,
            modules=[path],
            hidden_shape=anchors[i].input_shape,
        )
    return order, anchor_layers


def _place_segments(
    tracer: _Tracer, order: list[int], anchor_layers: dict[int, _Layer], user_mode: bool
) -> _FreeSegments:
    """Give each layer its segments; glue joins the block before it, prologue/epilogue/interludes are set aside."""
    anchors = tracer.anchors
    segments = [s for s in tracer.segments if s.anchor is not None or _has_work(s)]
    position = {i: k for k, i in enumerate(order)}
    last_anchor_pos = max(position.values())
    free = _FreeSegments()
    for s in segments:
        if s.anchor is not None:
            anchor_layers[s.anchor].segments.append(s)
            continue
        if s.after is None:
            free.prologue.append(s)
        elif position[s.after] == last_anchor_pos and not _anchor_follows(tracer.segments, s):
            free.epilogue.append(s)
        else:
            nxt = _next_anchor(tracer.segments, s)
            different_stack = nxt is not None and anchors[nxt].group != anchors[s.after].group
            if not user_mode and different_stack and s.interlude:
                free.interludes.setdefault(s.after, []).append(s)
            else:
                prev = anchor_layers[s.after]
                prev.segments.append(s)
                prev.modules.extend(m for m in s.modules if m not in prev.modules)
    return free


def _layer_sequence(
    order: list[int], anchor_layers: dict[int, _Layer], free: _FreeSegments, trace: _Trace
) -> list[_Layer]:
    """The layers in execution order: free work with parameters (embeddings, heads) becomes its own layer."""
    user_mode, holders = trace.user_mode, trace.params.holders
    layers: list[_Layer] = []
    first = anchor_layers[order[0]]
    if free.prologue and not user_mode and _uses_params(free.prologue):
        layers.append(_free_layer(free.prologue, "embedding", first_name=True, holders=holders))
    elif free.prologue:
        first.segments[:0] = free.prologue
        first.modules[:0] = [m for s in free.prologue for m in s.modules]
    for i in order:
        layers.append(anchor_layers[i])
        if i in free.interludes:
            segs = free.interludes[i]
            if _uses_params(segs):
                layers.append(_free_layer(segs, "embedding", first_name=True, holders=holders))
            else:
                anchor_layers[i].segments.extend(segs)
    if free.epilogue and not user_mode and _uses_params(free.epilogue):
        layers.append(_free_layer(free.epilogue, "head", first_name=False, holders=holders))
    elif free.epilogue:
        last = anchor_layers[order[-1]]
        last.segments.extend(free.epilogue)
        last.modules.extend(m for s in free.epilogue for m in s.modules if m not in last.modules)
    return layers


def _set_boundaries(layers: list[_Layer], trace: _Trace) -> None:
    """Bytes into and out of each layer: what a pipeline stage boundary there would send."""
    anchors = trace.tracer.anchors
    for k, layer in enumerate(layers):
        if k == 0:
            layer.input_bytes = trace.input_bytes
        elif layer.anchor is not None:
            layer.input_bytes = anchors[layer.anchor].input_bytes
        else:
            prev = layers[k - 1]
            layer.input_bytes = anchors[prev.anchor].output_bytes if prev.anchor is not None else prev.output_bytes
    for k, layer in enumerate(layers):
        layer.output_bytes = trace.output_bytes if k == len(layers) - 1 else layers[k + 1].input_bytes


def _fill_hidden_shapes(layers: list[_Layer]) -> None:
    """Free layers borrow a neighbouring block's hidden shape, which the TP estimates are based on."""
    for k, layer in enumerate(layers):
        if not layer.hidden_shape:
            neighbours = layers[k + 1 :] if layer.kind == "embedding" else layers[:k][::-1]
            layer.hidden_shape = next((n.hidden_shape for n in neighbours if n.hidden_shape), ())


def _assign_params(layers: list[_Layer], trace: _Trace) -> list[str]:
    """Credit each layer the parameters it read or its module holds; return those the forward never read."""
    anchors = trace.tracer.anchors
    used_anywhere: set[str] = set()
    for layer in layers:
        layer.params_used = set().union(*(s.params_used for s in layer.segments)) if layer.segments else set()
        if layer.anchor is not None:
            prefix = anchors[layer.anchor].path
            layer.params_used |= {
                n
                for n, holders in trace.params.holders.items()
                if any(h == prefix or _is_ancestor(prefix, h) for h in holders)
            }
        used_anywhere |= layer.params_used
    unused = [n for n in trace.params.numel if n not in used_anywhere]
    for n in unused:  # never read in the forward pass: keep them countable, say so in meta
        target = layers[-1]
        for layer in layers:
            if layer.anchor is not None and _is_ancestor(anchors[layer.anchor].path, n):
                target = layer
        target.params_used.add(n)
    return unused


def _places(layers: list[_Layer], param_numel: dict[str, int]) -> list[_Place]:
    """Name layers uniquely and find tied parameters, so a shared weight is counted once in the model total."""
    users: dict[str, list[int]] = {}
    for k, layer in enumerate(layers):
        for n in layer.params_used:
            users.setdefault(n, []).append(k)
    tied_names = {n for n, ks in users.items() if len(ks) > 1}
    places: list[_Place] = []
    names_seen: set[str] = set()
    for k, layer in enumerate(layers):
        lname = layer.name
        if lname in names_seen:
            lname = f"{lname}#{k}"
        names_seen.add(lname)
        tied_here = sorted(n for n in layer.params_used if n in tied_names)
        tied_params = sum(param_numel[n] for n in tied_here if users[n][0] != k)
        places.append(_Place(name=lname, tied_group=tied_here, tied_params=tied_params, is_last=k == len(layers) - 1))
    return places


def _layer_spec(layer: _Layer, place: _Place, trace: _Trace) -> LayerSpec:
    """The per-sample LayerSpec of one layer: its segments' totals divided by the example batch."""
    stats = _sum_segments(layer.segments)
    numel, batch = trace.params.numel, trace.batch
    act, repl, core, lin, lin_repl = _split_saved(stats, layer.hidden_shape)
    return LayerSpec(
        name=place.name,
        kind=layer.kind,
        params=sum(numel[n] for n in layer.params_used),
        params_tp_replicated=sum(
            numel[n] for n in layer.params_used if _looks_replicated(n, numel, layer.hidden_shape)
        ),
        fwd_flops=stats["flops"] / batch,
        fwd_mem_bytes=stats["mem_bytes"] / batch,
        attention_flops=stats["attention_flops"] / batch,
        gemm_count=max(1, stats["gemms"]),
        act_bytes=act / batch,
        act_tp_replicated_bytes=repl / batch,
        act_attention_core_bytes=core / batch,
        act_linear_input_bytes=lin / batch,
        act_linear_input_replicated_bytes=lin_repl / batch,
        input_bytes=layer.input_bytes / batch,
        output_bytes=layer.output_bytes / batch,
        tp_comm_bytes=_tp_comm_bytes(stats, layer.hidden_shape, trace.dtype.itemsize, place.is_last) / batch,
        tp_max=stats["heads"],
        tied_group="+".join(place.tied_group),
        tied_params=place.tied_params,
    )


def _split_saved(stats: dict[str, Any], hidden_shape: tuple[int, ...]
                 ) -> tuple[float, float, float, float, float]:
    """Saved bytes: all, hidden-state shaped (whole on every TP rank), attention-score shaped (split by TP),
    linear inputs and those of them hidden-state shaped."""
    act = repl = core = lin = lin_repl = 0.0
    hidden_numel = _numel(hidden_shape)
    for shape, nbytes, linear in stats["saved"]:
        act += nbytes
        lin += nbytes if linear else 0.0
        # the hidden state or a 2-D view of it, e.g. (B*S, H) for a linear
        if hidden_numel and _numel(shape) == hidden_numel and shape[-1:] == hidden_shape[-1:]:
            repl += nbytes
            lin_repl += nbytes if linear else 0.0
        elif len(shape) >= 3 and tuple(shape[-2:]) in stats["scores_dims"]:
            core += nbytes
    return act, repl, core, lin, lin_repl


def _tp_comm_bytes(stats: dict[str, Any], hidden_shape: tuple[int, ...], p_bytes: int, is_last: bool) -> float:
    """Megatron TP all-reduces the hidden state once per attention call and once per MLP/embedding."""
    hidden_bytes = float(_numel(hidden_shape) * p_bytes)
    allreduces = stats["attention_calls"] + (1 if stats["param_gemms"] or stats["embeddings"] else 0)
    return 0.0 if is_last else allreduces * hidden_bytes


def _model_dims(layers: list[_Layer], segments: list[_Segment]) -> tuple[int, int, int]:
    """Hidden size (from the first block's input), head count and vocabulary size seen in the trace."""
    hidden = 0
    first_block = next((layer for layer in layers if layer.anchor is not None), None)
    if first_block is not None and len(first_block.hidden_shape) >= 2:
        hidden = int(first_block.hidden_shape[-1])
    heads = min((s.heads for s in segments if s.heads), default=0)
    vocab = next((s.vocab for s in segments if s.vocab), 0)
    return hidden, heads, vocab


def _model_meta(trace: _Trace, layers: list[_Layer], places: list[_Place], unused: list[str]) -> dict[str, Any]:
    """ModelSpec.meta: where each layer came from and which fields are estimates rather than measurements."""
    return {
        "source": "traced nn.Module",
        "module_class": type(trace.module).__name__,
        "example_batch": trace.batch,
        "layer_modules": {place.name: layer.modules for layer, place in zip(layers, places)},
        "tied_params": {place.name: place.tied_params for place in places if place.tied_params},
        "unused_params": unused,
        "sdpa_flops_added": trace.tracer.sdpa_added / trace.batch,
        "estimated_fields": [
            "act_tp_replicated_bytes",
            "act_attention_core_bytes",
            "act_linear_input_bytes",
            "act_linear_input_replicated_bytes",
            "tp_comm_bytes",
            "params_tp_replicated",
        ],
    }


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n if shape else 0


def _has_work(s: _Segment) -> bool:
    return bool(s.flops or s.mem_bytes or s.saved or s.params_used or s.modules)


def _uses_params(segs: list[_Segment]) -> bool:
    return any(s.params_used for s in segs)


def _anchor_follows(all_segments: list[_Segment], s: _Segment) -> bool:
    return _next_anchor(all_segments, s) is not None


def _next_anchor(all_segments: list[_Segment], s: _Segment) -> int | None:
    idx = next(i for i, x in enumerate(all_segments) if x is s)
    return next((x.anchor for x in all_segments[idx + 1 :] if x.anchor is not None), None)


def _free_layer(segs: list[_Segment], kind: str, first_name: bool, holders: dict[str, set[str]]) -> _Layer:
    modules: list[str] = []
    for s in segs:
        modules.extend(m for m in s.modules if m not in modules)
    used = set().union(*(s.params_used for s in segs))
    with_params = [m for m in modules if any(h == m or _is_ancestor(m, h) for n in used for h in holders[n])]
    if with_params:
        name = with_params[0] if first_name else with_params[-1]
    else:  # parameters read by functional code in a parent module
        name = sorted(min(holders[n]) for n in used)[0] if used else (modules[0] if modules else kind)
    return _Layer(name=name, kind=kind, segments=list(segs), anchor=None, modules=modules or [name])


def _sum_segments(segs: list[_Segment]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "flops": 0.0,
        "attention_flops": 0.0,
        "gemms": 0,
        "param_gemms": 0,
        "embeddings": 0,
        "attention_calls": 0,
        "mem_bytes": 0.0,
        "saved": [],
        "scores_dims": set(),
        "heads": 0,
    }
    for s in segs:
        for key in ("flops", "attention_flops", "gemms", "param_gemms", "embeddings", "attention_calls", "mem_bytes"):
            out[key] += getattr(s, key)
        out["saved"].extend(s.saved)
        out["scores_dims"] |= s.scores_dims
        if s.heads:
            out["heads"] = min(out["heads"], s.heads) if out["heads"] else s.heads
    return out


def _looks_replicated(pname: str, numel: dict[str, int], hidden_shape: tuple[int, ...]) -> bool:
    """Megatron keeps norms and row-parallel biases whole on every TP rank: the
    1-D parameters as wide as the hidden state."""
    return bool(hidden_shape) and numel[pname] == hidden_shape[-1] and not pname.endswith("embeddings.weight")
