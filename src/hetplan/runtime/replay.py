"""The replay check: one real training step of a plan's ranks on fake tensors.

For each distinct pipeline stage of a plan, one of its ranks runs the
runtime's own code -- ``init`` -> ``ctx.parallelize`` (TP, EP, recompute,
offload, ZeRO / FSDP2, pipelining) -> ``ctx.train_step`` (the model's real
forward and loss, every micro-batch) -> the optimizer's step -- in this one
process, under ``torch._subclasses.FakeTensorMode`` (tensors with shapes,
dtypes and devices but no data) on a fake process group of the plan's world
size (``torch.testing._internal.distributed.fake_pg``: collectives return at
once, buffers keep their shapes). A dispatch mode above the fake mode counts
the bytes of every storage an op makes while it lives (a weak reference per
storage), so the peak is the runtime's own live tensor bytes, the quantity
``torch.cuda.max_memory_allocated`` reports on a GPU, less the allocator's
rounding.

What the replay does differently from ``hetplan train``, and why:

* the model is built for real under the fake mode (``meta_init=False``), not
  on meta and then materialised: ``Module.to_empty`` swaps each parameter,
  which torch 2.13 refuses for a fake tensor its converter's memo refers to
  ("Couldn't swap Embedding.weight"); the parameters end up the same shapes,
  so the step holds the same bytes. The peak is counted over the second
  step (:data:`REPLAY_STEPS`): building the whole model is transient, and the
  first step has no optimizer states yet; a plan of one TP degree per stage
  makes those states (and initializes its pipeline stages) first and replays
  one step (:func:`replay_rank`).
* host reads of device values (``float(loss)``, AdamW's step count, torch
  pipelining's warm-up vote ``result.item() == 1``) have no value on a fake
  tensor: the replay answers 1 (:data:`HOST_READ`), which decides no
  allocation. fp16 loss scaling's overflow vote would decide one (an overflow
  drops the step's gradients), so the replay runs an fp16 plan's step without
  the scaler: the same tensors less one transient finite-check of a gradient.
  Mixture-of-experts routing sizes its buffers by the data (``bincount`` of
  the tokens per expert, then host reads of the counts): the replay routes as
  evenly as the analytic model assumes, each expert ``rows / experts``, and
  runs every op on those counts on real values too (``LiveBytes._routing``),
  so the sizes they decide are those of a balanced real step.
* plain data parallelism's DDP runs with three reads of values skipped
  (:func:`ddp_on_fake_tensors`): its buckets and gradient views are the
  runtime's.
* the fake device is the CPU: a CPU-only torch makes no fake CUDA tensors
  (random initialisation needs the CUDA generator); the bytes of a tensor
  do not depend on the device. Autocast's CPU op lists decide the 16-bit
  casts.
* activation offload runs a GPU's path on the CPU device: the offload pool
  makes its host copies under :meth:`LiveBytes.on_host`, counted apart from
  the device's bytes, and fetches them back as device copies
  (``runtime/offload.py`` ``HostPool(host_side=...)``).
* a heterogeneous pipeline's stages send their input shapes as data: the
  replay answers them (:class:`StageMetadata`). Each share of a micro-batch
  a stage's replicas take, and each TP degree where they run their own
  (``Stage.replica_tp``), is replayed (:func:`replayed_ranks`).
* a stage of mixed TP degrees gathers its ranks' parameter layouts with
  ``all_gather_object``, data a fake process group does not carry: the
  replay answers it from a sharding rank's layout (:class:`MixedViews`).
* the meshes are made, sliced and joined from real rank tensors
  (:func:`real_meshes`), and a host read of a real tensor (or of a fake one
  holding its value) reads its value: a DeviceMesh finds this rank's
  coordinate by ``nonzero`` on its rank map. Each rank replayed after another
  forgets DTensor's cached sharding decisions, which hold the last rank's
  meshes (``forget_sharding_decisions``).
* an interleaved schedule's later chunk takes the shapes the nearest earlier
  chunk received (:class:`StageMetadata`); in-place storage resizes (FSDP2
  frees and regrows its gathered parameters so) are counted
  (``LiveBytes.storage_resizes``); the runtime's heartbeat is off.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Sequence

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensor, \
    unset_fake_temporarily
from torch.distributed.fsdp._fully_shard import _fsdp_param
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from hetplan.errors import HetplanError
from hetplan.plan.layout import PlanLayout, runs_heterogeneous
from hetplan.plan.spec import Plan
from hetplan.runtime import mixed
from hetplan.runtime.hetero import HeteroPipeline
from hetplan.runtime.step import global_loss

# The optimizer the replay steps with: AdamW, whose two fp32 states per parameter the cost model
# charges, in its for-loop form (runtime/reference.py ``make_optimizer``): its temporaries are one
# parameter's size, as the fused kernel the runtime runs on a GPU keeps none
# (hetplan.plan.runtime_facts.OPTIMIZER_IMPLEMENTATION); the fused form refuses FSDP2's DTensor
# parameters next to its plain step counts on torch 2.13 ("got mixed torch.Tensor and DTensor").
REPLAY_OPTIMIZER = "adamw"
# What a host read of a fake value returns (module doc): a loss of 1, AdamW's step count 1 (its bias
# correction divides by 1 - beta ** step: 0 would divide by zero), torch pipelining's vote for static shapes.
HOST_READ = 1
# An integer host read returns 0: torch pipelining's warm-up vote (torch 2.13,
# distributed/pipelining/schedules.py ``_warmup_p2p``: 1 only when every stage was given its
# shapes) then picks the shape inference the runtime's stages run, which gives none.
HOST_READ_INT = 0
# Steps replayed; the peak is the last one's. The first step makes the optimizer's states in its
# ``opt.step()``, after its backward; from the second on they are held through forward and backward
# too, which is the peak every later step repeats (hetplan.cost.memory.PeakTerms).
REPLAY_STEPS = 2
# The ops with which MoE routing's valued tensors begin (``LiveBytes._routing``: ``bincount`` of the
# tokens per expert, ``arange`` of expert indices, ``torch.tensor`` of host counts); before one of
# them has run, no other op is routing, so the mode passes it on without looking at its arguments.
ROUTING_STARTS = frozenset({torch.ops.aten.bincount.default, torch.ops.aten.arange.default, torch.ops.aten.arange.start,
                            torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default})


@dataclass(frozen=True)
class StageReplay:
    """One replayed rank: its pipeline stage, its rank, the plan's device it
    runs on, its live-bytes peak on that device and, apart, the peak of its
    offloaded activations in host memory."""

    stage: int
    rank: int
    device: int
    peak_bytes: int
    host_peak_bytes: int = 0
    devices: tuple[int, ...] = ()  # the plan's devices whose ranks hold what this one holds (replayed_ranks)


@dataclass(frozen=True)
class PlanReplay:
    """The replay of a plan: each distinct stage's peak and the seconds it took."""

    stages: tuple[StageReplay, ...]
    seconds: float

    @property
    def peak_bytes(self) -> int:
        """The largest peak over the plan's ranks."""
        return max(s.peak_bytes for s in self.stages)


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the fake-tensor storages alive now, and their peak:
    device bytes (``now``, ``peak``) and, apart, host bytes (``host_now``,
    ``host_peak``: storages made under :meth:`on_host`, the offload pool's host
    copies), which do not count against the GPU."""

    def __init__(self) -> None:
        super().__init__()
        self._bytes: dict[int, int] = {}
        self._host: dict[int, int] = {}  # host storages' bytes
        self._on_host = 0  # depth of on_host contexts
        self.now = 0
        self.peak = 0
        self.host_now = 0
        self.host_peak = 0
        self._values = WeakTensorKeyDictionary()  # fake tensors of MoE routing and their real values
        self._valued_ids: set[int] = set()  # ids of _values' live keys (an id is reused after its tensor dies)
        self._fake_mode: Any = None  # the fake mode under this one (set by ``under``)

    def under(self, fake_mode: Any) -> LiveBytes:
        """Record the fake mode this one runs above (routing values become its tensors)."""
        self._fake_mode = fake_mode
        return self

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now (after a garbage collection)."""
        gc.collect()
        self.peak = self.now
        self.host_peak = self.host_now

    @contextlib.contextmanager
    def on_host(self) -> Iterator[None]:
        """Storages made inside are host memory (``HostPool``'s ``host_side``)."""
        self._on_host += 1
        try:
            yield
        finally:
            self._on_host -= 1

    def _count(self, tensor: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(tensor):  # a DTensor: its local tensor, made with this mode off
            for name in tensor.__tensor_flatten__()[0]:
                self._count(getattr(tensor, name))
            return
        if not isinstance(tensor, FakeTensor):
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._bytes or key in self._host:
            return
        if self._on_host:
            self._host[key] = storage.nbytes()
            self.host_now += self._host[key]
            self.host_peak = max(self.host_peak, self.host_now)
        else:
            self._bytes[key] = storage.nbytes()
            self.now += self._bytes[key]
            self.peak = max(self.peak, self.now)
        self.grew()
        weakref.finalize(storage, self._free, key)

    def grew(self) -> None:
        """Called each time the live bytes have grown: nothing here; a subclass that keeps more
        peaks than the step's (``runtime/replay_micro.PhasePeaks``) reads ``now`` and ``host_now``."""

    def _routing(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """An op on the expert counts of MoE routing, which size buffers by value: the
        counts of tokens per expert (``bincount``) are those of balanced routing, each
        expert ``rows / experts`` (the analytic model's assumption, ``model/runtime_memory.py``
        ``_moe``), and every op on them (and on small integer tensors made from nothing or
        from host values: ``arange``, ``torch.tensor(counts)``) runs on real values too,
        so their host reads and the sizes they decide are those of a real balanced step.
        None for any other op."""
        if func not in ROUTING_STARTS and not self._valued_ids:
            return None  # no valued tensor alive (most ops of a dense model): no need to look at the arguments
        tensors = _tensors_in((args, kwargs))
        if func not in ROUTING_STARTS and not any(id(t) in self._valued_ids for t in tensors):
            return None  # no valued tensor among them: none of the cases below (a reused id: looked at below)
        if func is torch.ops.aten.bincount.default and _valueless(args[0]):
            bins = int(kwargs.get("minlength", args[2] if len(args) > 2 else 0))
            rows = args[0].numel()
            with unset_fake_temporarily():
                real = torch.tensor([rows // bins + (e < rows % bins) for e in range(bins)], dtype=torch.int64)
        elif (any(t in self._values for t in tensors) and all(t in self._values or not _valueless(t) for t in tensors)) \
                or (not tensors and _small_integer_factory(func, kwargs)) \
                or (func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)
                    and not args[0].is_floating_point()):
            real_args, real_kwargs = (_real(x, self._values) for x in (args, kwargs))
            with unset_fake_temporarily(), _disable_current_modes():
                real = func(*real_args, **real_kwargs)
            if not all(isinstance(t, torch.Tensor) for t in tree_leaves(real)):
                return None
            try:  # the fake op where its output's shape does not depend on the values (device, strides kept)
                out = func(*args, **kwargs)
            except (DynamicOutputShapeException, DataDependentOutputException):
                out = None
            if out is not None:
                for fake, value in zip(tree_leaves(out), tree_leaves(real)):
                    self._remember(fake, value)
                return out
        else:
            return None
        return tree_map(self._valued, real)

    def _valued(self, real: torch.Tensor) -> torch.Tensor:
        """A fake tensor of ``real``'s shape (on the replay's CPU device) that reads as ``real``."""
        with unset_fake_temporarily(), _disable_current_modes():
            out = self._fake_mode.from_tensor(real.clone())
        self._remember(out, real)
        self._count(out)
        return out

    def _collective(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """A c10d collective on the fake group, past the fake mode's dispatch cache: its
        keys hold the process group, which torch 2.13 cannot compare ("'__eq__' is not
        implemented for ... ProcessGroup") when two keys' hashes meet."""
        saved, self._fake_mode.cache_enabled = self._fake_mode.cache_enabled, False
        try:
            return func(*args, **kwargs)
        finally:
            self._fake_mode.cache_enabled = saved

    def _free(self, key: int) -> None:
        self.now -= self._bytes.pop(key, 0)
        self.host_now -= self._host.pop(key, 0)

    def resized(self, storage: Any) -> None:
        """A counted storage resized in place: its bytes now."""
        key = storage._cdata
        if key in self._bytes:
            self.now += storage.nbytes() - self._bytes[key]
            self._bytes[key] = storage.nbytes()
            self.peak = max(self.peak, self.now)
            self.grew()

    @contextlib.contextmanager
    def storage_resizes(self) -> Iterator[None]:
        """Count in-place storage resizes, which no dispatch mode sees: FSDP2
        frees each unsharded parameter after use by resizing its storage to 0
        and regrows it before the next all-gather (torch 2.13,
        ``distributed/fsdp/_fully_shard/_fsdp_param.py`` ``free_storage`` /
        ``alloc_storage``), the CUDA memory a GPU run frees and takes back."""
        original = torch.UntypedStorage.resize_
        live = self

        def resize(storage: Any, size: int) -> Any:
            out = original(storage, size)
            live.resized(storage)
            return out

        torch.UntypedStorage.resize_ = resize  # type: ignore[method-assign]  # patched only during a replay, put back after
        try:
            yield
        finally:
            torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]  # patched only during a replay, put back after

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args[0] in self._values:
            with unset_fake_temporarily():
                return self._values[args[0]].item()
        if func is torch.ops.aten._local_scalar_dense.default and _valueless(args[0]):
            return float(HOST_READ) if args[0].is_floating_point() else HOST_READ_INT
        out = self._routing(func, args, kwargs)
        if out is None and func.namespace == "c10d":
            out = self._collective(func, args, kwargs)
        elif out is None:
            out = func(*args, **kwargs)
        if func is torch.ops.c10d.alltoall_base_.default and args[1] in self._values:
            self._remember(args[0], self._values[args[1]])  # balanced routing: every rank sends the same counts
        for leaf in _tensors_in(out):
            self._count(leaf)
        return out

    def _remember(self, fake: torch.Tensor, value: torch.Tensor) -> None:
        """``fake`` reads as ``value`` (``_routing``)."""
        self._values[fake] = value
        self._valued_ids.add(id(fake))
        weakref.finalize(fake, self._valued_ids.discard, id(fake))  # the set holds live tensors' ids only


def _tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors in an operator's arguments or outputs: ``tree_leaves``'s tensors for the lists and tuples
    of tensors an operator schema takes and returns (c10d's lists of lists included), without its checks
    of every node's type, which cost a sixth of a replay's time."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    out: list[torch.Tensor] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            out.append(node)
        elif isinstance(node, (list, tuple)):
            stack.extend(reversed(node))
        elif isinstance(node, dict):
            stack.extend(reversed(list(node.values())))
    return out


def _small_integer_factory(func: Any, kwargs: dict[str, Any]) -> bool:
    """``arange`` of integers: the expert indices routing repeats by its counts."""
    return func in (torch.ops.aten.arange.default, torch.ops.aten.arange.start) and \
        kwargs.get("dtype") in (None, torch.int64, torch.int32)


def _real(tree: Any, values: Any) -> Any:
    """``tree`` with each valued fake tensor replaced by its value, on the CPU."""
    def swap(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x in values:
            return values[x]
        if isinstance(x, torch.device):
            return torch.device("cpu")
        return x

    return tree_map(swap, tree)


def _valueless(tensor: torch.Tensor) -> bool:
    """A fake tensor with no value to read. A real tensor (a DeviceMesh's rank
    map, read under the fake mode by ``DeviceMesh._compute_coordinates_from_mesh``
    when the runtime slices a mesh) and a fake tensor holding its real value
    (``FakeTensor.constant``: torch 2.13 ``fake_tensor.py`` keeps one for small
    real tensors it converts) read as themselves: answering 0 there put a later
    pipeline stage's rank outside its own data-parallel mesh."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor) and tensor.constant is None


@contextlib.contextmanager
def real_meshes() -> Iterator[None]:
    """A DeviceMesh's rank tensor and this rank's place in it computed outside the fake mode: the runtime
    slices, flattens and joins meshes while it parallelises (FSDP2's
    ``replicate`` over a dp x cp mesh with TP joins two), and each new mesh
    finds this rank in its rank tensor by ``nonzero`` (torch 2.13,
    ``device_mesh.py`` ``_get_mesh_tensor_from_full_mesh``), whose output size
    a fake tensor does not know. The rank tensors are the plan's ranks, never
    model data."""
    from torch.distributed.device_mesh import DeviceMesh

    prop, coordinate = DeviceMesh.mesh, DeviceMesh._compute_coordinate_on_dim

    def mesh(self: Any) -> torch.Tensor:
        with unset_fake_temporarily():
            return prop.fget(self)

    def real_coordinate(self: Any) -> Any:
        with unset_fake_temporarily():
            return coordinate(self)

    DeviceMesh.mesh = property(mesh)  # type: ignore[method-assign,assignment]  # patched only during a replay, put back after
    DeviceMesh._compute_coordinate_on_dim = real_coordinate  # type: ignore[method-assign]  # patched only during a replay, put back after
    try:
        yield
    finally:
        DeviceMesh.mesh, DeviceMesh._compute_coordinate_on_dim = prop, coordinate  # type: ignore[method-assign]  # patched only during a replay, put back after


class ChunkViews(Sequence[torch.Tensor]):
    """``torch.chunk(tensor, chunks, dim)`` padded with empty tensors to ``chunks`` items, as FSDP2's
    ``_chunk_with_empty`` returns it (torch 2.13, ``_fsdp_common.py``), each view made when it is asked
    for: FSDP2 cuts every parameter into the data-parallel world's chunks to keep this rank's and read
    the first's size (``_fsdp_param.py`` ``_init_sharded_param``, ``_init_sharded_post_forward_param_metadata``),
    and on a fake tensor each of the other chunks is an operator call through the fake mode (Llama-3-70B
    at dp64: about 92,000 calls, 15% of a replay's). A view holds no storage, so the bytes are the same."""

    def __init__(self, tensor: torch.Tensor, chunks: int, dim: int) -> None:
        self._tensor, self._chunks, self._dim = tensor, chunks, dim
        size = tensor.size(dim)
        self._step = -(-size // chunks)  # torch.chunk's chunk size: the size / chunks, rounded up
        self._nonempty = -(-size // self._step) if size else chunks  # chunks torch.chunk returns

    def __len__(self) -> int:
        return self._chunks

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._chunks))]
        if not -self._chunks <= index < self._chunks:
            raise IndexError(index)
        index %= self._chunks
        if index >= self._nonempty:
            return self[0].new_empty(0)
        start = index * self._step
        return self._tensor.narrow(self._dim, start, min(self._step, self._tensor.size(self._dim) - start))


@contextlib.contextmanager
def fsdp_chunk_views() -> Iterator[None]:
    """FSDP2 cuts parameters into :class:`ChunkViews` while a replay runs."""
    saved = _fsdp_param._chunk_with_empty
    _fsdp_param._chunk_with_empty = ChunkViews  # patched only during a replay, put back after
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = saved


def replay_plan(plan: Plan, spec: Any, states_first: bool = True) -> PlanReplay:
    """Replay one rank of each distinct pipeline stage, micro-batch share and replica TP degree of ``plan``
    (:func:`replayed_ranks`; ``states_first``: :func:`replay_rank`)."""
    start = time.perf_counter()
    stages = tuple(stage for stage, _ in replay_counted(plan, spec, LiveBytes, states_first))
    return PlanReplay(stages, time.perf_counter() - start)


def replay_counted(plan: Plan, spec: Any, counter: Callable[[], LiveBytes], states_first: bool = True,
                   stage_shapes: dict[tuple[int, int], Any] | None = None) -> list[tuple[StageReplay, LiveBytes]]:
    """Each replayed rank of ``plan`` (:func:`replayed_ranks`) with the ``counter()`` that counted its
    bytes (``runtime/replay_micro.py`` passes one that also keeps each phase's peaks, and
    ``stage_shapes``: :class:`StageMetadata`)."""
    layout = PlanLayout.from_plan(plan, [layer.name for layer in spec.layers])
    out = []
    with StageMetadata(stage_shapes) as shapes, MixedViews(), chains_checked_once():  # stage by stage, first to last: each receives what the one before sent
        for rank, devices in replayed_ranks(layout):
            position = layout.position(rank)
            shapes.share = position.samples_per_micro_batch
            live = counter()
            device_peak, host_peak = replay_rank(plan, spec, rank, states_first, live)
            out.append((StageReplay(position.pp_index, rank, position.device, device_peak, host_peak, devices), live))
    return out


def replayed_ranks(layout: PlanLayout) -> list[tuple[int, tuple[int, ...]]]:
    """The ranks replayed, first stage to last, each with the plan devices whose ranks
    hold what it holds: per stage, the first rank of the first replica of each share of
    a micro-batch (``dp_split``) and TP degree (``Stage.replica_tp``: a stage's replicas
    may run their own), standing for every rank of the replicas of that share and degree
    (they, and the TP, CP and EP ranks of a replica, hold tensors of the same sizes; the
    GPU type changes no tensor, and each device is checked against its own memory).
    A stage's replicas of the largest degree come first: a replica at TP 1 learns how
    its stage shards each parameter from one that shards it (:class:`MixedViews`)."""
    out = []
    for j in range(layout.pp):
        kinds: dict[tuple[int, int], list[int]] = {}
        for r, replica in enumerate(layout.stage_mesh_ranks(j)):
            kind = (layout.position(replica[0]).samples_per_micro_batch, layout.replica_tp(j, r))
            kinds.setdefault(kind, []).extend(replica)
        ordered = sorted(kinds.items(), key=lambda item: -item[0][1])  # stable: the plan's order within a degree
        out.extend((ranks[0], tuple(layout.devices[r] for r in ranks)) for _, ranks in ordered)
    return out


@contextlib.contextmanager
def chains_checked_once() -> Iterator[None]:
    """The runtime's pipeline chain checks (``preflight.check_chain_early`` before the model is
    split, ``step._check_chain_once`` in the first step: each the whole model's forward on
    meta tensors, seconds at 70B, outside the counted step) run once per model, layer names
    and input shapes while inside, not once per rank replayed: every rank checks the same
    model, and the routes a check returns are data about the model. Nested uses share the
    outer's."""
    from hetplan.model.chain import check_chain
    from hetplan.runtime import preflight, step

    if step.check_chain is not check_chain:  # inside another: its memo holds
        yield
        return
    seen: dict[tuple[Any, ...], dict[str, dict[str, str]]] = {}

    def check(model: Any, names: Sequence[str], args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> Any:
        key = (type(model), tuple(names), *((tuple(t.shape), t.dtype) for t in args),
               *((k, tuple(v.shape), v.dtype) for k, v in sorted((kwargs or {}).items())))
        if key not in seen:
            seen[key] = check_chain(model, names, args, kwargs)
        return seen[key]

    step.check_chain = preflight.check_chain = check
    try:
        yield
    finally:
        step.check_chain = preflight.check_chain = check_chain


class MixedViews:
    """How every rank of a stage of mixed TP degrees lays out its parameters,
    for a replay that runs one rank at a time: the runtime gathers each rank's
    :func:`runtime.mixed.param_layouts` over the stage (``mixed.stage_views``,
    an ``all_gather_object`` a fake process group does not carry). A replayed
    rank whose replica shards (TP > 1) records its own view; each rank of the
    stage then holds that view at its own replica's degree
    (``mixed.view_at_degree``), as the real gather would give. The stage's
    replicas of the largest degree are replayed first (:func:`replayed_ranks`)."""

    def __init__(self) -> None:
        self._sharded: dict[int, mixed.LayoutView] = {}  # stage -> the view of a rank that shards

    def __enter__(self) -> MixedViews:
        self._saved = mixed.stage_views
        mixed.stage_views = self.stage_views
        return self

    def stage_views(self, layout: PlanLayout, stage: int, mine: mixed.LayoutView, group: Any) -> list[mixed.LayoutView]:
        """The views the stage's gather returns (class doc)."""
        ranks = sorted(layout.stage_ranks(stage))
        degrees = [layout.replica_tp(stage, layout.position(r).dp_index) for r in ranks]
        if layout.replica_tp(stage, layout.position(torch.distributed.get_rank()).dp_index) > 1:
            self._sharded[stage] = mine
        if stage not in self._sharded:
            raise HetplanError(f"the replay has no sharded layout for stage {stage}'s replicas of mixed TP degrees")
        return [mixed.view_at_degree(self._sharded[stage], t) for t in degrees]

    def __exit__(self, *exc: Any) -> None:
        mixed.stage_views = self._saved


class StageMetadata:
    """The shapes torch pipelining's stages exchange in their first step, for a
    replay that runs one stage at a time in this process (torch 2.13,
    ``distributed/pipelining/stage.py``: ``_send_meta`` / ``_recv_meta`` over
    ``send_object_list``, which a fake process group does not carry). A stage
    receives the forward shapes the stage before it sent; the gradient shapes
    from the stage after it, not replayed yet, are those of its own outputs
    (``_derive_grad_metas``, as torch derives them where no gradient is sent).
    Replicas of different shares of a micro-batch (an uneven ``dp_split``, the
    same in every stage) send to the replica of their share (``share``: that of
    the rank replayed now).

    A heterogeneous pipeline's executor (``runtime/hetero.py``) sends a header
    tensor with each input's shape once; its receiver reads it as data, which a
    fake tensor has none of. Its stages take the row count of their own link
    from the sender (``HeteroPipeline.recv_fwd``, the plan's ``dp_split``) and
    the trailing shape and dtype of what the stage before sent, as the header
    would say.

    ``known`` (a dict, by stage index and share of a micro-batch) carries the
    shapes torch pipelining's shape inference found (its ``_stage_meta``) from
    one replay to another of stages with the same inputs and outputs
    (``runtime/replay_micro.py``: a copy with fewer blocks): a stage whose
    shapes are not there yet records them; one whose shapes are there runs in
    torch's STATIC mode with them as its user-given shapes, which skips the
    inference's forward and backward of a micro-batch (the step after it holds
    the same tensors: ``tests/test_replay_micro.py``)."""

    def __init__(self, known: dict[tuple[int, int], Any] | None = None) -> None:
        self._sent: dict[tuple[int, int], Any] = {}
        self._hetero_sent: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
        self.share = 0
        self._known = known

    def __enter__(self) -> StageMetadata:
        from torch.distributed.pipelining import stage as pipeline_stage

        self._module = pipeline_stage
        self._saved = (pipeline_stage.PipelineStage._send_meta, pipeline_stage.PipelineStage._recv_meta)
        self._hetero_saved = (HeteroPipeline._send_header, HeteroPipeline._recv_header)
        mailbox = self

        def send(stage: Any, meta: Any, dst_stage: int) -> None:
            if dst_stage > stage.stage_index:  # forward shapes; gradient shapes are derived (class doc)
                mailbox._sent[(dst_stage, mailbox.share)] = meta

        def recv(stage: Any, src_stage: int) -> Any:
            if src_stage < stage.stage_index:
                return mailbox.forward_meta(stage.stage_index)
            return pipeline_stage._StageBackwardMeta(
                backward_metas=pipeline_stage._derive_grad_metas(stage._stage_meta.outputs))

        def send_header(pipeline: Any, tensor: torch.Tensor, peer: int) -> None:
            mailbox._hetero_sent[pipeline.stage + 1] = (tuple(tensor.shape[1:]), tensor.dtype)

        def recv_header(pipeline: Any, peer: int) -> tuple[tuple[int, ...], torch.dtype]:
            return mailbox.hetero_header(pipeline, peer)

        pipeline_stage.PipelineStage._send_meta, pipeline_stage.PipelineStage._recv_meta = send, recv
        HeteroPipeline._send_header, HeteroPipeline._recv_header = send_header, recv_header  # type: ignore[method-assign]  # patched only during a replay, put back after
        self._infra_saved = (pipeline_stage.PipelineStage._prepare_forward_infra,
                             pipeline_stage.PipelineStage._prepare_backward_infra)
        if self._known is not None:
            self._hand_over_shapes(pipeline_stage, self._known)
        return self

    def _hand_over_shapes(self, pipeline_stage: Any, known: dict[tuple[int, int], Any]) -> None:
        """Record each stage's inferred shapes, or run it on those recorded (class doc)."""
        forward, backward = self._infra_saved
        mailbox = self

        def prepare_forward(stage: Any, *args: Any, **kwargs: Any) -> Any:
            given = known.get((stage.stage_index, mailbox.share))
            if given is not None:
                stage._inference_mode, stage._user_meta = pipeline_stage.InferenceMode.STATIC, given
            return forward(stage, *args, **kwargs)

        def prepare_backward(stage: Any, *args: Any, **kwargs: Any) -> Any:
            out = backward(stage, *args, **kwargs)
            if not stage._stage_meta.has_dtensors():  # a DTensor's shape names this replay's mesh
                known.setdefault((stage.stage_index, mailbox.share), replace(stage._stage_meta))
            return out

        pipeline_stage.PipelineStage._prepare_forward_infra = prepare_forward
        pipeline_stage.PipelineStage._prepare_backward_infra = prepare_backward

    def hetero_header(self, pipeline: Any, peer: int) -> tuple[tuple[int, ...], torch.dtype]:
        """The (shape, dtype) header ``pipeline``'s stage would receive from ``peer`` (class doc)."""
        if pipeline.stage not in self._hetero_sent:
            raise HetplanError(f"the replay has no shapes for pipeline stage {pipeline.stage}'s input")
        trailing, dtype = self._hetero_sent[pipeline.stage]
        link = next(link for link in pipeline.recv_fwd if link.peer == peer)
        return (link.hi - link.lo, *trailing), dtype

    def forward_meta(self, stage_index: int) -> Any:
        """The forward shapes stage ``stage_index`` receives: those sent to it,
        else (an interleaved schedule's later chunk, whose sender runs on a rank
        replayed after this one) those the nearest earlier stage received: the
        chunks between the first and the last are runs of decoder blocks, which
        keep the hidden states' shape (``runtime/parallelize.py`` ``PipelinePart``)."""
        earlier = [k for k, share in self._sent if k <= stage_index and share == self.share]
        if not earlier:
            raise HetplanError(f"the replay has no shapes for pipeline stage {stage_index}'s input")
        return self._sent[(max(earlier), self.share)]

    def __exit__(self, *exc: Any) -> None:
        self._module.PipelineStage._send_meta, self._module.PipelineStage._recv_meta = self._saved
        self._module.PipelineStage._prepare_forward_infra, self._module.PipelineStage._prepare_backward_infra = \
            self._infra_saved
        HeteroPipeline._send_header, HeteroPipeline._recv_header = self._hetero_saved  # type: ignore[method-assign]  # patched only during a replay, put back after


def replay_rank(plan: Plan, spec: Any, rank: int, states_first: bool = True,
                live: LiveBytes | None = None) -> tuple[int, int]:
    """The live-bytes peaks of ``rank`` over one training step (module doc), on
    its device and of its offloaded activations in host memory. ``states_first``
    (where :func:`replays_one_step`): what the step before would have left is
    made first (:func:`steady_before_the_step`) and one step is replayed; else
    the step is replayed twice and the peak is the second's (:data:`REPLAY_STEPS`).
    The peaks are the same to the byte (``tests/test_replay.py``), the first in
    about half the operator calls. A pipeline's stages must be initialized
    before the counted step: torch pipelining's first step infers and sends its
    shapes, which raised a bf16 stage's peak above the second step's
    (tiny-llama-bf16 pp2 x tp2: 1,396,300 B against 1,302,644 B). ``live`` counts
    the bytes (a fresh :class:`LiveBytes` unless given)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hetplan.runtime.context import init
    from hetplan.runtime.reference import make_optimizer, training_batch

    if dist.is_initialized():  # the replay's fake group would replace (and then end) this process's own
        raise HetplanError("this process already has a torch.distributed process group; replay plans from a "
                           "process without one (or pass replay=0)")
    world = plan_world_size(plan)
    with _process_env(rank, world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            ctx = init(plan, spec)  # meshes from real rank tensors: outside the fake mode
            ctx.dp_mesh  # CP's flattened dp x cp mesh too: flattening makes process groups (``RuntimeContext.dp_mesh``)
            live = live if live is not None else LiveBytes()
            ctx.offload_host_side = live.on_host  # offloaded copies are host bytes, fetched back as on a GPU
            try:
                how = ctx.model_build  # a pkg.mod:build model's checks read its example inputs' values
                fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
                with fake_mode, live.under(fake_mode), live.storage_resizes(), real_meshes(), ddp_on_fake_tensors(), \
                        fsdp_chunk_views():
                    model = ctx.parallelize(how.build, meta_init=False, example_inputs=how.example_inputs)
                    opt = ctx.optimizer(model, make_optimizer, name=REPLAY_OPTIMIZER)
                    ctx.loss_scaler = None  # fp16: no overflow vote to read (module doc)
                    one_step = states_first and replays_one_step(plan)
                    if one_step:
                        steady_before_the_step(ctx, model, opt, spec, how, plan)
                    for step in range(1 if one_step else REPLAY_STEPS):
                        x, y, inputs = training_batch(spec, how, plan.global_batch_size, step, 0)
                        live.reset_peak()
                        ctx.train_step(model, (x, y), how.loss, return_outputs=False, inputs=inputs)
                        opt.step()
                        opt.zero_grad(set_to_none=True)
            finally:
                ctx.close()
            return live.peak, live.host_peak
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            forget_sharding_decisions()


def replays_one_step(plan: Plan) -> bool:
    """Whether ``plan``'s ranks are replayed in one step after :func:`steady_before_the_step`:
    checked equal to the second of two steps (``tests/test_replay.py``) for stages of one TP
    degree, one-stage or on torch pipelining's executor; a stage of mixed degrees or a
    heterogeneous pipeline (``runtime/hetero.py``) keeps the two steps."""
    return all(stage.replica_tp is None for stage in plan.stages) and \
        (len(plan.stages) == 1 or not runs_heterogeneous(plan))


def steady_before_the_step(ctx: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, spec: Any, how: Any,
                           plan: Plan) -> None:
    """Make what a first step leaves the second, without the first step's micro-batches: a
    pipeline's stages initialized by a step that runs none (:func:`stages_initialized_only`:
    torch pipelining's shape inference and receive buffers; the runtime's chain check), the
    optimizer's states (:func:`make_optimizer_states`) and the loss the step before leaves
    (``ctx.pending_loss``: ``step.global_loss`` of a 0-dim fp32 sum, as ``step.train_step``
    starts it)."""
    from hetplan.runtime.reference import training_batch

    if len(plan.stages) > 1:
        x, y, inputs = training_batch(spec, how, plan.global_batch_size, 0, 0)
        with stages_initialized_only():
            ctx.train_step(model, (x, y), how.loss, return_outputs=False, inputs=inputs)
    make_optimizer_states(opt, model.parameters())
    global_loss(ctx, torch.zeros((), device=ctx.device, dtype=torch.float32))


@contextlib.contextmanager
def stages_initialized_only() -> Iterator[None]:
    """torch pipelining's schedules, whose ``step`` initializes their stages (the warm-up vote,
    shape inference on the first micro-batch, receive buffers: torch 2.13 ``schedules.py``, the
    first lines of each ``_step_microbatches``) and runs no micro-batch."""
    from torch.distributed.pipelining import schedules

    kinds = (schedules.Schedule1F1B, schedules.ScheduleGPipe, schedules.ScheduleInterleaved1F1B)
    saved = [(kind, kind.__dict__.get("_step_microbatches")) for kind in kinds]

    def initialize(self: Any, arg_mbs: Any = None, kwarg_mbs: Any = None, target_mbs: Any = None,
                   losses: Any = None, return_outputs: bool = True, loss_kwargs: Any = None) -> None:
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        target = target_mbs[0] if target_mbs is not None else None
        init = self._initialize_stages if hasattr(self, "_initialize_stages") else self._initialize_stage
        init(arg_mbs[0], kwarg_mbs[0], target, loss_kwargs)

    for kind in kinds:
        kind._step_microbatches = initialize  # type: ignore[method-assign]  # patched only while warming, put back after
    try:
        yield
    finally:
        for kind, method in saved:
            if method is None:
                del kind._step_microbatches
            else:
                kind._step_microbatches = method  # type: ignore[method-assign]  # put back as it was


def make_optimizer_states(opt: torch.optim.Optimizer, params: Iterator[torch.nn.Parameter]) -> None:
    """Make ``opt``'s states as its first step does, without a forward and backward: one step on
    zero gradients of the model's trainable ``params`` (the shapes the step's backward gives them;
    a ZeRO-1 optimizer takes its shards' from them), dropped after as ``zero_grad`` drops them. What the first of two replayed steps
    left for the second is these states, the parameters and the runtime's buffers made once, which
    the one replayed step then makes before its peak as the first step did; so its peak is the second
    step's (``tests/test_replay.py`` holds them equal to the byte over the plan kinds)."""
    for param in params:
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    opt.step()
    opt.zero_grad(set_to_none=True)


@contextlib.contextmanager
def ddp_on_fake_tensors() -> Iterator[None]:
    """Plain data parallelism replayed on the DDP ``hetplan train`` runs (``parallelize.apply_ddp``),
    its buckets and gradient views as they are, less three reads of values a fake group or a fake
    tensor does not have (torch 2.13, ``nn/parallel/distributed.py``): DDP's check that every rank
    has the same parameter shapes (``_verify_param_shape_across_processes``: one rank here, nothing
    to compare), the built-in all-reduce hook's result (the fake group's future holds None where the
    reducer expects the bucket: :func:`_bucket_all_reduce` all-reduces the bucket in place and
    returns it, as the built-in hook does) and the bucket rebuild after the first step
    (``Reducer._rebuild_buckets`` reads the new bucket order's indices on the host; the rebuilt
    buckets hold the same gradients, so the same bytes: :class:`_KeptBuckets`)."""
    from torch.nn.parallel import DistributedDataParallel
    from torch.nn.parallel import distributed as ddp_module

    saved = ddp_module._verify_param_shape_across_processes, DistributedDataParallel.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        saved[1](self, *args, **kwargs)
        self.register_comm_hook(self.process_group, _bucket_all_reduce)
        self.reducer = _KeptBuckets(self.reducer)

    def same_shapes(*args: Any, **kwargs: Any) -> None:
        return None

    ddp_module._verify_param_shape_across_processes = same_shapes
    DistributedDataParallel.__init__ = init  # type: ignore[method-assign]  # patched only during a replay, put back after
    try:
        yield
    finally:
        ddp_module._verify_param_shape_across_processes = saved[0]
        DistributedDataParallel.__init__ = saved[1]  # type: ignore[method-assign]  # patched only during a replay, put back after


class _KeptBuckets:
    """A DDP reducer whose buckets stay as first built (``ddp_on_fake_tensors``)."""

    def __init__(self, reducer: Any) -> None:
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        """No rebuild: DDP's ``_pre_forward`` asks before every forward."""
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)


def _bucket_all_reduce(group: Any, bucket):  # type: ignore[no-untyped-def]  # DDP compares the annotations with its types, which postponed (string) annotations fail
    """DDP's default all-reduce of a bucket (torch 2.13, ``ddp_comm_hooks/default_hooks.py``
    ``allreduce_hook``: divide by the group's size, all-reduce in place) with its result the bucket."""
    import torch.distributed as dist

    buffer = bucket.buffer()
    buffer.div_(group.size())
    dist.all_reduce(buffer, group=group)
    done: Any = torch.futures.Future()
    done.set_result(buffer)
    return done


def forget_sharding_decisions() -> None:
    """Clear DTensor's caches of sharding decisions: they are keyed by meshes
    equal across ranks (torch 2.13, ``DeviceMesh.__eq__`` compares the ranks'
    layout, not this process's place in it), so the next rank replayed in this
    process would reuse a decision made for the last, and with it the last
    rank's mesh and its destroyed process groups ("Could not resolve the
    process group"). ``torch.distributed.tensor.debug``'s
    ``_clear_sharding_prop_cache`` clears the same two sharding caches, the
    Python one and the C++ fast path's."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()
    _gen_transform_infos.cache_clear()


def plan_world_size(plan: Plan) -> int:
    """The number of processes the plan runs on."""
    return len({d for stage in plan.stages for d in stage.devices})


@contextlib.contextmanager
def _process_env(rank: int, world: int) -> Iterator[None]:
    """The environment ``init`` reads, as one rank of the plan on one machine's CPU, without the
    heartbeat (runtime/heartbeat.py): the fake store has no other rank to watch, and a replay that runs
    longer than the heartbeat's timeout would end this process as a hung run."""
    values = {"RANK": str(rank), "WORLD_SIZE": str(world), "HETPLAN_DEVICE": "cpu", "HETPLAN_ONE_MACHINE": "1",
              "HETPLAN_HEARTBEAT": "0"}
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
