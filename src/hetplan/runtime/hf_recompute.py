"""HF transformers models under recomputation: no KV cache, and the attention
core as what *selective* recomputation checkpoints.

KV cache. A HF decoder's forward makes a ``DynamicCache`` when
``config.use_cache`` is on (the default) and every layer appends its keys and
values to it. Recomputation replays a layer in the backward pass, so a
checkpointed layer would append them a second time and attend over twice the
keys (the shapes then disagree; a T5 cross-attention would instead reuse the
cached keys and lose their gradient). Training never reads the cache, so
:func:`no_kv_cache` turns it off on every HF config of the model -- the runtime
and the single-process reference (``reference.train_reference``) both -- and
:func:`refuse_cache` refuses a recomputed layer that is handed one anyway
(the model called with ``use_cache=True`` or a ``past_key_values`` cache).

Selective recomputation (Korthikanti et al. 2022 §5) drops what the attention
core softmax(QK^T)V saves and recomputes it in the backward pass; the cost
model charges exactly that (``LayerSpec.act_attention_core_bytes`` less, the
core's FLOPs again). Every family the runtime trains (Llama, Mistral, Mixtral,
Qwen2, GPT-2, BERT, T5, ViT in transformers 5.24) computes its core in one
call: ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation,
eager_attention_forward)(module, q, k, v, mask, ...)``, the attention module
first. :func:`checkpoint_attention_core` marks the attention modules of a
layer whose plan says selective, and ``AttentionInterface.get_interface``
(wrapped once per process) hands those modules their implementation --
eager, SDPA, flash -- inside a non-reentrant ``torch.utils.checkpoint``: the
core keeps only its inputs (Q, K, V, the mask), the projections around it are
saved as usual. Other modules call the implementation unchanged.

A layer whose attention does not go through that interface cannot be
recomputed selectively: GPT-2 with eager attention and
``reorder_and_upcast_attn`` computes it inline, and so might a user's own
class. The first is refused before training; :func:`guard_selective` refuses
any other at the layer's first forward, so selective never silently runs as
``none``.
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from typing import Any, Callable

from torch import nn

from hetplan.errors import HetplanError

# attention modules whose core is checkpointed, and how often each reached the interface
_CORE_MODULES: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_CORE_CALLS: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
# the name transformers' attention modules look their implementation up in
_INTERFACE = "ALL_ATTENTION_FUNCTIONS"


def _transformers_loaded() -> bool:
    """Whether transformers is imported (a model of it can only exist then; not
    importing it for other models saves seconds)."""
    return "transformers" in sys.modules


def is_hf_module(module: nn.Module) -> bool:
    """A module holding transformers modules (a HF layer, or a whole HF model)."""
    return _transformers_loaded() and any(type(m).__module__.startswith("transformers.") for m in module.modules())


# --- KV cache ----------------------------------------------------------------------------------
def no_kv_cache(model: nn.Module) -> None:
    """Turn a HF model's KV cache off for training: every config its modules
    read (T5's decoder stack reads a copy of the model's) says ``use_cache=False``."""
    if not _transformers_loaded():
        return
    from transformers import PretrainedConfig

    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig) and getattr(config, "use_cache", False):
            config.use_cache = False


def refuse_hf_checkpointing(model: nn.Module) -> None:
    """HF's own gradient checkpointing (``gradient_checkpointing_enable``) would
    recompute layers the plan keeps: refused."""
    for name, module in model.named_modules():
        if getattr(module, "gradient_checkpointing", False) is True and is_hf_module(module):
            where = repr(name) if name else type(module).__name__
            raise HetplanError(f"HF gradient checkpointing is on in {where}; call gradient_checkpointing_disable() "
                               "on the model: the plan's recompute settings decide what is recomputed")


def refuse_cache(layer: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A recomputed layer must not write a KV cache (module docstring)."""
    if not _transformers_loaded():
        return
    from transformers.cache_utils import Cache

    given = "use_cache=True" if kwargs.get("use_cache") else next(
        (f"a KV cache ({type(v).__name__})" for v in (*args, *kwargs.values()) if isinstance(v, Cache)), "")
    if given:
        raise HetplanError(f"layer {layer!r} is recomputed and was given {given}: its replay would write the keys "
                           "and values again; train without a cache (leave use_cache and past_key_values out of "
                           "the model's inputs)")


# --- selective: the attention core -----------------------------------------------------------------
def calls_attention_interface(module: nn.Module) -> bool:
    """Whether the module's forward looks its attention function up in
    ``ALL_ATTENTION_FUNCTIONS`` (decorators unwrapped)."""
    code = getattr(inspect.unwrap(type(module).forward), "__code__", None)
    return code is not None and _INTERFACE in code.co_names


def attention_modules(layer: nn.Module) -> list[nn.Module]:
    """The modules of a layer that compute attention through the interface."""
    return [m for m in layer.modules() if calls_attention_interface(m)]


def inline_attention(module: nn.Module) -> str:
    """Why this attention module computes its core without the interface ("" if it does not)."""
    config = getattr(module, "config", None)
    if getattr(module, "reorder_and_upcast_attn", False) and getattr(config, "_attn_implementation", "") == "eager":
        return (f"{type(module).__name__} with eager attention and reorder_and_upcast_attn computes its attention "
                "core inline")
    return ""


def checkpoint_attention_core(layer: nn.Module, name: str) -> bool:
    """Checkpoint the attention core of every attention module of a HF layer;
    False if the layer has none. Refuses a layer whose core cannot be."""
    modules = attention_modules(layer)
    for module in modules:
        why = inline_attention(module)
        if why:
            raise HetplanError(f"selective recompute of layer {name!r}: {why}, which cannot be checkpointed alone; "
                               "use recompute 'full' or 'none' for it")
        _CORE_MODULES.add(module)
    if modules:
        _wrap_interface()
        guard_selective(layer, name, modules)
    return bool(modules)


def guard_selective(layer: nn.Module, name: str, modules: list[nn.Module]) -> None:
    """After each forward of ``layer``, every marked attention module must have
    gone through the interface (so its core was checkpointed), or the layer
    ran as if not recomputed: refused with one line."""
    inner = layer.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        before = [_CORE_CALLS.get(m, 0) for m in modules]
        out = inner(*args, **kwargs)
        for module, count in zip(modules, before):
            if _CORE_CALLS.get(module, 0) == count:
                raise HetplanError(f"selective recompute of layer {name!r}: {type(module).__name__} computed "
                                   "attention without transformers' attention interface, so nothing was "
                                   "recomputed; use recompute 'full' or 'none' for it")
        return out

    layer.forward = forward  # type: ignore[method-assign]  # wrapped in place


def _checkpointed_core(fn: Callable[..., Any], module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The attention implementation ``fn``, checkpointed for marked modules in training."""
    import torch
    from torch.utils.checkpoint import checkpoint

    if module not in _CORE_MODULES:
        return fn(module, *args, **kwargs)
    _CORE_CALLS[module] = _CORE_CALLS.get(module, 0) + 1
    if not (torch.is_grad_enabled() and module.training):
        return fn(module, *args, **kwargs)
    # preserve_rng_state (the default) replays the implementation's own attention dropout
    return checkpoint(fn, module, *args, use_reentrant=False, **kwargs)


def _wrap_interface() -> None:
    """Make ``AttentionInterface.get_interface`` return implementations that
    checkpoint the marked modules (once per process; others see no change)."""
    from transformers.modeling_utils import AttentionInterface

    original = AttentionInterface.get_interface
    if getattr(original, "_hetplan_selective", False):
        return

    @functools.wraps(original)
    def get_interface(self: Any, attn_implementation: str, default: Callable[..., Any]) -> Callable[..., Any]:
        return functools.partial(_checkpointed_core, original(self, attn_implementation, default))

    get_interface._hetplan_selective = True  # type: ignore[attr-defined]  # a marker torch does not declare
    AttentionInterface.get_interface = get_interface  # type: ignore[method-assign]  # wrapped in place
