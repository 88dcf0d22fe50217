"""Activation offloading (SageMaker model parallelism, Karakus et al. 2021, App. H.3).

A layer the plan marks ``offload`` keeps the tensors autograd saves for its
backward in host memory: while it runs forward, ``saved_tensors_hooks`` copy
each saved tensor to the host (pinned memory, on a copy stream beside compute,
on CUDA); in backward, the first use of any of the layer's tensors fetches
all of them back, and those of the layer that ran before it in the same
forward (the next one backward needs), so the copies overlap the backward of
the layer in between -- a prefetch horizon of one layer, SageMaker's
"activation loading horizon". With ``recompute="full"`` the hooks see only the
checkpoint's saved input (torch.utils.checkpoint saves it as a saved tensor
under the hooks around it), so only that is moved, as in SageMaker.

Parameters the layer's ops save (a linear layer saves its weight) are not
activations: they stay where they are; they are told apart by storage, not by
data pointer, which a fake tensor (the replay, ``runtime/replay.py``) lacks. On
CPU the "host" copy is a second CPU tensor, so the saved-activation bytes that
stay on the device and those moved are still counted apart (``HostPool``),
which is what the tests measure. The replay runs a GPU's path on its CPU
device (``HostPool(host_side=...)``): host copies are made where the replay
counts them as host bytes, and fetched back as device copies one layer ahead.

A call's record holds its saved tensors weakly: autograd's saved-tensor slots
own them, so a fetched device copy is freed when the backward that used it
releases its slot, not at the next garbage collection (a reference cycle
between a call and its tensors kept every fetched copy to then).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable, Sequence

import torch
from torch import nn


@dataclass
class _Call:
    """The storages one forward call of an offloaded layer moved (weakly:
    module doc), their host bytes, and the call of the layer before it in the
    same forward (fetched one layer ahead)."""

    copies: list[weakref.ref[_Copy]] = field(default_factory=list)
    previous: _Call | None = None
    fetched: bool = False
    host_bytes: int = 0

    def alive(self) -> list[_Copy]:
        """The moved storages some backward still holds."""
        return [c for c in (ref() for ref in self.copies) if c is not None]


@dataclass
class _Copy:
    """One moved storage: all of it, flat, in host memory, and its device copy
    once fetched. Tensors saved as views of one storage (the q, k and v
    projections each save their own view of the norm's output) share it: the
    storage moves once, as the device held it once."""

    host: torch.Tensor
    device: torch.device
    dtype: torch.dtype
    storage: Any  # weak reference to the device storage moved
    back: torch.Tensor | None = None  # the fetched device copy
    ready: Any = None  # CUDA event of the fetch


@dataclass
class _Packed:
    """One saved tensor: its storage's copy, the call that saved it and where in the storage it lies."""

    copy: _Copy
    call: _Call
    view: tuple[torch.Size, tuple[int, ...], int]  # size, stride, storage offset
    dtensor: tuple[Any, Any, torch.Size, tuple[int, ...]] | None = None  # (mesh, placements, shape, stride)


class HostPool:
    """Saved activations kept in host memory, counted: bytes moved in total
    (``moved_bytes``), moved and not yet fetched back (``held_bytes``) and the
    most of those at once (``peak_bytes``).

    ``host_side``: for a CPU device standing for a GPU (the replay), a context
    under which host copies are made (the replay counts what is made under it
    as host bytes); they are then fetched back as device copies, as on CUDA.
    None: on CPU the host copy is used where it is."""

    def __init__(self, device: torch.device, host_side: Callable[[], ContextManager[Any]] | None = None) -> None:
        self.device = device
        self._host_side = host_side
        self.moved_bytes = 0
        self.held_bytes = 0
        self.peak_bytes = 0
        self._call: _Call | None = None  # the call running forward now
        self._last: tuple[_Call, int] | None = None  # the last finished call and id of its output
        cuda = device.type == "cuda" and torch.cuda.is_available()
        self._stream = torch.cuda.Stream(device) if cuda else None

    # --- forward ----------------------------------------------------------------
    def run(self, forward: Any, params: set[int], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``forward(*args, **kwargs)`` with its saved tensors offloaded (parameters' storages in ``params`` kept)."""
        previous = None
        if self._last is not None and any(id(a) == self._last[1] for a in _tensors(args, kwargs)):
            previous = self._last[0]  # this layer takes that layer's output: the same forward
        call = _Call(previous=previous)
        outer, self._call = self._call, call
        try:
            with torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, params), self._unpack):
                out = forward(*args, **kwargs)
        finally:
            self._call = outer
        first = next(iter(_tensors((out,), {})), None)
        self._last = (call, id(first)) if first is not None and call.copies else None
        return out

    def _pack(self, params: set[int], tensor: torch.Tensor) -> Any:
        from torch.distributed.tensor import DTensor

        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if self._call is None or _storage(local) in params or local.device.type == "meta" \
                or local.layout != torch.strided:
            return tensor
        copy = self._copy(local)
        spec = (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride()) \
            if isinstance(tensor, DTensor) else None
        return _Packed(copy, self._call, (local.size(), local.stride(), local.storage_offset()), spec)

    def _copy(self, local: torch.Tensor) -> _Copy:
        """The host copy of ``local``'s storage, made on its first save in this call."""
        assert self._call is not None
        storage = local.untyped_storage()
        for earlier in self._call.alive():
            if earlier.storage() is storage and earlier.dtype == local.dtype:
                return earlier
        whole = local.detach().as_strided((storage.nbytes() // local.element_size(),), (1,), 0)
        copy = _Copy(self._to_host(whole), local.device, local.dtype, weakref.ref(storage))
        self._call.copies.append(weakref.ref(copy))
        size = copy.host.untyped_storage().nbytes()
        self._call.host_bytes += size
        self.moved_bytes += size
        self.held_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return copy

    def _to_host(self, local: torch.Tensor) -> torch.Tensor:
        if self._stream is None:  # CPU: a separate copy, so the bytes are counted as moved
            with self._host_side() if self._host_side is not None else contextlib.nullcontext():
                return local.clone()
        host = torch.empty(local.size(), dtype=local.dtype, layout=local.layout, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(local.device))
        with torch.cuda.stream(self._stream):
            host.copy_(local, non_blocking=True)
        local.record_stream(self._stream)  # the allocator keeps it until the copy is done
        return host

    # --- backward ---------------------------------------------------------------
    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        self._fetch(packed.call)
        if packed.call.previous is not None:
            self._fetch(packed.call.previous)  # one layer ahead
        copy = packed.copy
        if copy.ready is not None:
            torch.cuda.current_stream(copy.device).wait_event(copy.ready)
        value = (copy.back if copy.back is not None else copy.host).as_strided(*packed.view)
        if packed.dtensor is not None:
            from torch.distributed.tensor import DTensor

            mesh, placements, shape, stride = packed.dtensor
            value = DTensor.from_local(value, mesh, placements, run_check=False, shape=shape, stride=stride)
        return value

    def _fetch(self, call: _Call) -> None:
        if call.fetched:
            return
        call.fetched = True
        self.held_bytes -= call.host_bytes
        for copy in call.alive():
            if self._stream is None:
                if self._host_side is not None:  # the replay's GPU path: a device copy of the host one
                    copy.back = copy.host.clone()
                continue
            with torch.cuda.stream(self._stream):
                copy.back = copy.host.to(copy.device, non_blocking=True)
                copy.ready = torch.cuda.Event()
                copy.ready.record(self._stream)


def _storage(tensor: torch.Tensor) -> int:
    """The identity of ``tensor``'s storage: its C++ storage object, the same for
    every view of it, real or fake (a fake tensor has no data pointer)."""
    return tensor.untyped_storage()._cdata


def _tensors(args: Iterable[Any], kwargs: dict[str, Any]) -> Iterable[torch.Tensor]:
    for value in [*args, *kwargs.values()]:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (tuple, list)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def parameter_storages(module: nn.Module) -> set[int]:
    """Storages of the module's parameters as they are now (FSDP2 swaps in
    the gathered ones for forward; a TP parameter's local shard)."""
    from torch.distributed.tensor import DTensor

    out = set()
    for p in module.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if local.device.type != "meta":
            out.add(_storage(local))
    return out


def apply_offload(root: nn.Module, names: Sequence[str], pool: HostPool) -> None:
    """Wrap each named layer's ``forward`` (after checkpointing, so the
    checkpoint's saved input is moved too) to run under ``pool``'s hooks."""
    for name in names:
        module = root.get_submodule(name)
        inner = module.forward

        @functools.wraps(inner)
        def forward(*args: Any, _inner: Any = inner, _module: nn.Module = module, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return pool.run(_inner, parameter_storages(_module), args, kwargs)

        module.forward = forward  # type: ignore[method-assign]  # wrapped in place
