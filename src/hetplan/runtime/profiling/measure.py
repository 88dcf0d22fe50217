"""Measuring layer times and memory on this machine: what each process of
``hetplan profile`` runs.

Every process of the run (one per device of the cluster) measures the same
layer at the same moment, so caches, cores, memory bandwidth and links are as
contended as in training; the recorded time is the median across processes
of each process's median over the repeats.

What is measured is the model as ``hetplan train`` builds and shards it
(``subject.py``: the built-in GPT, a HF class, a ``pkg.mod:build`` model): each
distinct layer (layers sharing a ``profile_key`` once: the embedding, one
transformer block, the head) as a pipeline stage runs it, for each TP degree
and micro-batch size; the loss on the head's output at each micro-batch size
(``ProfileDB`` key ``loss``); and the host time to dispatch one operator
(``measure_host``), which the cost kernel takes for host-bound passes. With tp > 1 the layer is
sharded by the runtime's TP plans over a real process group of tp processes,
so its time includes the TP collectives as training runs them. Those
collectives are found by watching the layer run once (a dispatch mode sees
every ``_c10d_functional`` call) and then timed alone, with the same sizes on
the same group: the entry keeps both, and the cost model takes the
difference as compute time, as it adds TP communication itself.

Memory per micro-batch: on CPU, the bytes of the layer's (local) parameters,
as many again for their gradients, and the activations autograd saves for
backward (counted by ``saved_tensors_hooks``, each storage once, parameters
excluded); on CUDA, the parameters plus the allocator's peak above what was
allocated before the step (gradients, saved activations and temporaries).
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from hetplan.errors import HetplanError
from hetplan.model.spec import LayerSpec
from hetplan.profile.db import LOSS_KEY, ChainPoint, DataParallelPoint, HostPoint, ProfileDB, ProfileEntry
from hetplan.runtime.setup import gpu_matches
from hetplan.runtime.parallelize import apply_dp
from hetplan.runtime.precision import autocast, precision_of
from hetplan.runtime.profiling import collectives as coll
from hetplan.runtime.profiling.job import (ProfileJob, chain_layers, chain_measurements, collective_group_sizes,
                                           data_parallel_measurements, distinct_layers, link_class, measurements)
from hetplan.runtime.profiling.subject import LOSS_INPUT, ProfiledModel, profiled_model
from hetplan.runtime.profiling.timing import Stopwatch, iqr, median

# _c10d_functional ops (what DTensor's redistributions call) -> collectives.OPS
_FUNCTIONAL_OPS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
                   "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all"}


# --- inputs and outputs of a layer ------------------------------------------------------------------
def fresh_input(value: Any) -> Any:
    """A new leaf of each floating-point tensor of a layer's input (its gradient
    flows into it as from the previous stage); token ids and masks as they are."""
    if isinstance(value, tuple):
        return tuple(fresh_input(v) for v in value)
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().clone().requires_grad_(True)
    return value


def differentiable(value: Any) -> list[torch.Tensor]:
    """The tensors of a layer's output that backward starts from."""
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in differentiable(v)]
    if isinstance(value, torch.Tensor) and value.requires_grad:
        return [value]
    logits = getattr(value, "logits", None)
    return differentiable(logits) if logits is not None else []


class LossModule(nn.Module):
    """The training loss on the head's output (the runtime applies it outside the head's module)."""

    def __init__(self, loss: Any, targets: torch.Tensor) -> None:
        super().__init__()
        self.loss, self.targets = loss, targets

    def forward(self, output: torch.Tensor) -> torch.Tensor:
        return self.loss(output, self.targets)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of the parameters this process holds (its TP shards)."""
    return sum(_local(p).nbytes for p in module.parameters())


# --- watching one step ------------------------------------------------------------------------------
class SavedBytes:
    """Bytes of the tensors autograd saves for backward while active, each
    storage once, the layer's parameters not counted (they are counted as such)."""

    def __init__(self, module: nn.Module) -> None:
        self.exclude = {_local(p).untyped_storage().data_ptr() for p in module.parameters()}
        self.storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # looking at a DTensor's shard must not grow the graph
            local = _local(t)
        if local.device.type != "meta":
            storage = local.untyped_storage()
            if storage.data_ptr() not in self.exclude:
                self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


class CollectiveLog(TorchDispatchMode):
    """The collectives a step calls: (op, input shape, dtype) in call order."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        namespace, _, rest = str(func).partition(".")
        op = _FUNCTIONAL_OPS.get(rest.split(".")[0]) if namespace == "_c10d_functional" else None
        if op is not None and isinstance(args[0], torch.Tensor):
            self.calls.append((op, tuple(args[0].shape), args[0].dtype))
        return func(*args, **(kwargs or {}))

    def take(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        calls, self.calls = self.calls, []
        return calls


# --- timing one layer ------------------------------------------------------------------------------
@dataclass
class LayerRecord:
    """One process's measurement of one (layer, tp, batch)."""

    layer: str
    gpu: str
    tp: int
    batch: int
    fwd: list[float]
    bwd: list[float]
    memory_bytes: int
    comm_fwd_s: float
    comm_bwd_s: float


class LayerBench:
    """Times one built layer on one input (see the module docstring)."""

    def __init__(self, module: nn.Module, example: Any, inputs: dict[str, Any], device: torch.device,
                 precision: str) -> None:
        self.module, self.example, self.inputs = module, example, inputs
        self.device, self.precision = device, precision
        self.grad: list[torch.Tensor] | None = None

    def new_input(self) -> Any:
        return fresh_input(self.example)

    def forward(self, x: Any) -> Any:
        with autocast(self.device, self.precision):
            out = self.module(*(x if isinstance(x, tuple) else (x,)), **self.inputs)
        if self.grad is None:
            self.grad = [torch.randn_like(t) for t in differentiable(out)]
        return out

    def backward(self, out: Any) -> None:
        torch.autograd.backward(differentiable(out), self.grad)

    def watch(self) -> tuple[int, list[Any], list[Any]]:
        """One step watched: (memory bytes, forward collectives, backward collectives)."""
        for p in self.module.parameters():
            p.grad = None
        params = parameter_bytes(self.module)
        x = self.new_input()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        with SavedBytes(self.module) as saved, CollectiveLog() as log:
            out = self.forward(x)
            fwd_calls = log.take()
            self.backward(out)
            bwd_calls = log.take()
        if cuda:
            torch.cuda.synchronize()
            return params + torch.cuda.max_memory_allocated() - base, fwd_calls, bwd_calls
        return 2 * params + saved.bytes, fwd_calls, bwd_calls

    def time(self, warmup: int, repeats: int, stopwatch: Stopwatch) -> tuple[list[float], list[float]]:
        """Forward and backward seconds of each repeat, all processes starting together."""
        for _ in range(warmup):
            self.backward(self.forward(self.new_input()))
        fwd, bwd = [], []
        for _ in range(repeats):
            x = self.new_input()
            dist.barrier()
            stopwatch.start()
            out = self.forward(x)
            stopwatch.mark()
            self.backward(out)
            stopwatch.mark()
            f, b = stopwatch.laps()
            fwd.append(f)
            bwd.append(b)
        return fwd, bwd


def time_tp_calls(calls: Sequence[tuple[str, tuple[int, ...], torch.dtype]], group: Any, tp: int,
                  device: torch.device, warmup: int, repeats: int, stopwatch: Stopwatch) -> float:
    """Median seconds of a layer pass's TP collectives run alone on its group."""
    if not calls:
        return 0.0
    runs = [coll.collective_call(op, torch.ones(shape, dtype=dtype, device=device), group, tp)
            for op, shape, dtype in calls]

    def run_all() -> None:
        for run in runs:
            run()
    return median(coll.time_call(run_all, warmup, repeats, stopwatch))


# --- progress -------------------------------------------------------------------------------------------
class ProgressLines:
    """One line per measurement on stderr (rank 0): what, how many left, and
    about how long, from the time the finished ones took."""

    def __init__(self, enabled: bool, layer_weights: Sequence[float], comm_curves: int, comm_guess_s: float) -> None:
        self.enabled = enabled
        self.layer_left = float(sum(layer_weights))
        self.layer_done = 0.0
        self.comm_left, self.comm_done = comm_curves, 0
        self.comm_guess_s = comm_guess_s
        self.total = len(layer_weights) + comm_curves
        self.count = 0
        self.start = time.perf_counter()
        self.comm_start: float | None = None

    def _eta(self, now: float) -> float:
        if self.comm_start is None:
            rate = (now - self.start) / self.layer_done if self.layer_done else 0.0
            return rate * self.layer_left + (self.comm_guess_s if self.comm_left else 0.0)
        return (now - self.comm_start) / max(1, self.comm_done) * self.comm_left

    def say(self, text: str) -> None:
        if self.enabled:
            print(f"hetplan profile: {text}", file=sys.stderr, flush=True)

    def layer(self, text: str, weight: float) -> None:
        self.layer_done += weight
        self.layer_left -= weight
        self._step(text)

    def comm_begin(self) -> None:
        self.comm_start = time.perf_counter()

    def comm(self, text: str, _weight: float = 1.0) -> None:
        self.comm_done += 1
        self.comm_left -= 1
        self._step(f"collective {text}")

    def _step(self, text: str) -> None:
        self.count += 1
        left = self.total - self.count
        eta = f", ~{rough_duration(self._eta(time.perf_counter()))} to go" if left else ""
        self.say(f"[{self.count}/{self.total}] {text}; {left} left{eta}")


def rough_duration(seconds: float) -> str:
    """'2 min 5 s', '14 s', '0.8 s': an estimate's precision, no more."""
    seconds = max(0.0, seconds)
    if seconds >= 60:
        return f"{int(seconds // 60)} min {int(seconds % 60)} s"
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


# --- the run on every process -------------------------------------------------------------------------
def pick_device(job: ProfileJob, rank: int) -> torch.device:
    """CPU for a CPU cluster; else this process's GPU, checked against the cluster's type."""
    gpu = job.cluster.devices[rank].gpu
    if gpu.name.upper() == "CPU":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise HetplanError(f"cluster {job.cluster.name!r} has {gpu.name} GPUs but this process sees no CUDA "
                           "device; run the commands 'hetplan profile' prints on the cluster's nodes")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local >= torch.cuda.device_count():
        raise HetplanError(f"process {rank} should use GPU {local} of its node, but it has "
                           f"{torch.cuda.device_count()}; the node differs from cluster {job.cluster.name!r}")
    found = torch.cuda.get_device_name(local)
    if gpu.catalog_name and not os.environ.get("HETPLAN_SKIP_GPU_CHECK") and not gpu_matches(gpu.catalog_name, found):
        raise HetplanError(f"process {rank} should run on a {gpu.catalog_name} but sees a {found}; profile on the "
                           f"cluster's GPUs, or set HETPLAN_SKIP_GPU_CHECK=1")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def _check_world(job: ProfileJob) -> None:
    """One process per device of the cluster (ranks follow its devices, node by node)."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if world != job.cluster.num_devices:
        raise HetplanError(f"cluster {job.cluster.name!r} has {job.cluster.num_devices} devices but {world} "
                           f"processes were started; start one per device")


def _start_group(job: ProfileJob, device: torch.device) -> None:
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=job.timeout_s))


def _tp_mesh(device: torch.device, tp: int) -> Any:
    world = dist.get_world_size()
    return init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))["tp"]


@dataclass
class Session:
    """What every measurement of one process shares: the job, its device, the
    model as the runtime builds it, and each batch size's data (every distinct
    layer's input, the model's keyword inputs and targets)."""

    job: ProfileJob
    device: torch.device
    model: ProfiledModel
    precision: str
    gpu: str
    inputs: dict[int, dict[str, Any]]
    keywords: dict[int, dict[str, Any]]
    targets: dict[int, torch.Tensor]

    def bench(self, module: nn.Module, layer: str, batch: int) -> LayerBench:
        """A bench of ``module`` on the input layer ``layer`` takes at ``batch``."""
        return LayerBench(module, self.inputs[batch][layer], self.keywords[batch], self.device, self.precision)

    def loss_bench(self, batch: int) -> LayerBench:
        """A bench of the training loss on the head's output at ``batch``."""
        loss = LossModule(self.model.how.loss, self.targets[batch])
        return LayerBench(loss, self.inputs[batch][LOSS_INPUT], {}, self.device, self.precision)


def start_session(job: ProfileJob, device: torch.device) -> Session:
    """Build the model's data on this process (one forward of the distinct layers per batch size)."""
    model = profiled_model(job.spec)
    precision = precision_of({}, job.spec.dtype_bytes)
    inputs, keywords, targets = {}, {}, {}
    for b in job.batches:
        inputs[b] = model.layer_inputs(b, device, job.seed, precision)
        _, targets[b], keywords[b] = model.batch(b, device, job.seed)
    return Session(job, device, model, precision, job.cluster.devices[dist.get_rank()].gpu.name,
                   inputs, keywords, targets)


def measure_layers(run: Session, progress: ProgressLines) -> list[LayerRecord]:
    """This process's records of every (layer, tp, batch) of the job, and of the loss at tp 1."""
    job, device = run.job, run.device
    stopwatch = Stopwatch(device)
    records = []
    for tp in job.tps:
        mesh = _tp_mesh(device, tp) if tp > 1 else None
        group = mesh.get_group() if mesh is not None else None
        for layer in distinct_layers(job.spec):
            if not layer.supports_tp(tp):
                continue
            module = run.model.part(layer.name, mesh, device, job.seed)
            for batch in job.batches:
                bench = run.bench(module, layer.name, batch)
                memory, fwd_calls, bwd_calls = bench.watch()
                fwd, bwd = bench.time(job.warmup, job.repeats, stopwatch)
                comm_f = time_tp_calls(fwd_calls, group, tp, device, job.warmup, job.repeats, stopwatch) if mesh else 0.0
                comm_b = time_tp_calls(bwd_calls, group, tp, device, job.warmup, job.repeats, stopwatch) if mesh else 0.0
                records.append(LayerRecord(layer.profile_key, run.gpu, tp, batch, fwd, bwd, memory, comm_f, comm_b))
                progress.layer(f"{layer.name} ({layer.kind}) tp={tp} batch={batch}: fwd {median(fwd) * 1e3:.3g} ms, "
                               f"bwd {median(bwd) * 1e3:.3g} ms", layer_weight(layer, tp, batch))
            del module
    head = job.spec.layers[-1]
    for batch in job.batches:
        bench = run.loss_bench(batch)
        memory, _, _ = bench.watch()
        fwd, bwd = bench.time(job.warmup, job.repeats, stopwatch)
        records.append(LayerRecord(LOSS_KEY, run.gpu, 1, batch, fwd, bwd, memory, 0.0, 0.0))
        progress.layer(f"loss tp=1 batch={batch}: fwd {median(fwd) * 1e3:.3g} ms, bwd {median(bwd) * 1e3:.3g} ms",
                       loss_weight(head, batch))
    return records


def measure_chains(run: Session, progress: ProgressLines) -> list[ChainPoint]:
    """This process's times of a chain of layers run as one micro-batch
    (``chain_layers``: each layer kind, a repeated one twice), for each TP
    degree and batch: what the layers take together, without a barrier
    between them, against what they took one by one."""
    job, device = run.job, run.device
    stopwatch = Stopwatch(device)
    chain = chain_layers(job.spec)
    modules: dict[int, nn.Module] = {}
    points = []
    for tp, batch in chain_measurements(job):
        if tp not in modules:
            modules.clear()  # one TP degree's chain at a time
            modules[tp] = run.model.part([layer.name for layer in chain], _tp_mesh(device, tp) if tp > 1 else None,
                                         device, job.seed)
        fwd, bwd = run.bench(modules[tp], chain[0].name, batch).time(job.warmup, job.repeats, stopwatch)
        points.append(ChainPoint(run.gpu, tp, batch, tuple(layer.profile_key for layer in chain), median(fwd),
                                 median(bwd)))
        progress.layer(f"chain {'+'.join(layer.name for layer in chain)} tp={tp} batch={batch}: "
                       f"fwd {median(fwd) * 1e3:.3g} ms, bwd {median(bwd) * 1e3:.3g} ms", chain_weight(chain, tp, batch))
    return points


# --- host time per operator ----------------------------------------------------------------------------
# The host probe: two rows of width 8 through a linear, GELU, LayerNorm and a linear, forward and
# backward under the runtime's autocast. Each kernel's device work (a few hundred FLOPs) is far below
# the ~5 us launch (KERNEL_LAUNCH_S), so a run takes what the host takes to dispatch its operators.
HOST_PROBE_WIDTH = 8
HOST_PROBE_RUNS = 20  # forward+backward runs per timed repeat: a repeat spans thousands of operators


class OpCount(TorchDispatchMode):
    """How many ATen operators run while active (views and casts included,
    as ``hetplan.model.runtime_time`` counts a layer's operators)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_host(run: Session) -> tuple[float, int]:
    """(host seconds per dispatched operator, operators per probe run): the
    median over repeats of a run of tiny operators' wall-clock time, all
    processes at once, over the operators it dispatches (counted in one run)."""
    job, device = run.job, run.device
    width = HOST_PROBE_WIDTH
    module = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width), nn.Linear(width, width)).to(device)
    x = torch.randn(2, width, device=device)

    def step() -> None:
        with autocast(device, run.precision):
            out = module(x.detach().requires_grad_(True))
        out.float().sum().backward()

    with OpCount() as count:
        step()
    for _ in range(job.warmup):
        step()
    samples = []
    for _ in range(job.repeats):
        dist.barrier()
        _synchronize(device)
        start = time.perf_counter()
        for _ in range(HOST_PROBE_RUNS):
            step()
        _synchronize(device)
        samples.append((time.perf_counter() - start) / (HOST_PROBE_RUNS * count.ops))
    return median(samples), count.ops


def combine_host(per_rank: Sequence[tuple[str, float, int]]) -> list[HostPoint]:
    """One point per GPU type: the median across its processes."""
    grouped: dict[str, list[tuple[str, float, int]]] = {}
    for record in per_rank:
        grouped.setdefault(record[0], []).append(record)
    return [HostPoint(gpu, median([r[1] for r in rs]), rs[0][2]) for gpu, rs in sorted(grouped.items())]


def combine_chains(per_rank: Sequence[Sequence[ChainPoint]]) -> list[ChainPoint]:
    """One point per (GPU type, TP degree, batch): the median across processes."""
    grouped: dict[tuple[str, int, int], list[ChainPoint]] = {}
    for points in per_rank:
        for p in points:
            grouped.setdefault((p.gpu, p.tp, p.batch), []).append(p)
    return [ChainPoint(*key, ps[0].layers, median([p.fwd_s for p in ps]), median([p.bwd_s for p in ps]))
            for key, ps in sorted(grouped.items())]


def measure_data_parallel(run: Session, progress: ProgressLines) -> list[DataParallelPoint]:
    """This process's records of what the runtime's data-parallel wrappers
    (``parallelize.apply_dp``: ZeRO-0 ``replicate``, ZeRO-2 and ZeRO-3
    ``fully_shard``) add to each layer's pass over groups of each size, every
    group busy at once: the plain layer timed once, right before its wrapped
    runs, at the smallest batch, with gradients synchronised on every backward
    as on a step's last micro-batch (ZeRO-3: on every one)."""
    job, device = run.job, run.device
    stopwatch = Stopwatch(device)
    batch = job.batches[0]
    world = dist.get_world_size()
    meshes: dict[tuple[int, int], Any] = {}
    plain: dict[tuple[str, int, int], tuple[int, float, float]] = {}  # (layer, tp, ranks) -> params, fwd, bwd
    points = []

    def timed(layer: LayerSpec, mesh: Any, tp: int, zero: int | None) -> tuple[int, float, float]:
        """(parameters, median fwd, median bwd) of the layer, wrapped for ZeRO-``zero`` (None: plain)."""
        module = run.model.part(layer.name, mesh["tp"] if tp > 1 else None, device, job.seed)
        params = sum(_local(p).numel() for p in module.parameters())
        if zero is not None:
            apply_dp(module, {layer.name: zero}, mesh["dp"], [])
        fwd, bwd = run.bench(module, layer.name, batch).time(job.warmup, job.repeats, stopwatch)
        return params, median(fwd), median(bwd)

    for layer, tp, ranks, zero in data_parallel_measurements(job):
        if (tp, ranks) not in meshes:
            meshes[tp, ranks] = init_device_mesh(device.type, (world // (ranks * tp), ranks, tp),
                                                 mesh_dim_names=("rep", "dp", "tp"))
        key = (layer.name, tp, ranks)
        if key not in plain:  # timed once, right before its wrapped runs
            plain[key] = timed(layer, meshes[tp, ranks], tp, None)
        params, plain_f, plain_b = plain[key]
        _, f, b = timed(layer, meshes[tp, ranks], tp, zero)
        points.append(DataParallelPoint(layer.profile_key, run.gpu, tp, ranks, zero, params,
                                        max(0.0, f - plain_f), max(0.0, b - plain_b)))
        progress.layer(f"{layer.name} ({layer.kind}) tp={tp} ZeRO-{zero} over {ranks} processes: adds "
                       f"{points[-1].fwd_extra_s * 1e3:.3g} ms fwd, {points[-1].bwd_extra_s * 1e3:.3g} ms bwd",
                       wrapper_weight(layer, tp, batch))
    return points


def combine_data_parallel(per_rank: Sequence[Sequence[DataParallelPoint]]) -> list[DataParallelPoint]:
    """One point per (layer, GPU type, TP degree, group size, ZeRO stage): the median across processes."""
    grouped: dict[tuple[str, str, int, int, int], list[DataParallelPoint]] = {}
    for points in per_rank:
        for p in points:
            grouped.setdefault((p.layer, p.gpu, p.tp, p.ranks, p.zero), []).append(p)
    return [DataParallelPoint(*key, ps[0].params, median([p.fwd_extra_s for p in ps]),
                              median([p.bwd_extra_s for p in ps]))
            for key, ps in sorted(grouped.items())]


def layer_weight(layer: LayerSpec, tp: int, batch: int) -> float:
    """A guess of a measurement's relative duration, for the time-left estimate:
    its FLOPs plus a fixed cost per run (a few kernel launches)."""
    return layer.fwd_flops * batch / tp + 5e6


def loss_weight(head: LayerSpec, batch: int) -> float:
    """A guess of the loss's duration: a few elementwise passes over the logits,
    a tenth of the head's matmul."""
    return layer_weight(head, 1, batch) / 10


def chain_weight(chain: Sequence[LayerSpec], tp: int, batch: int) -> float:
    return sum(layer_weight(layer, tp, batch) for layer in chain)


def wrapper_weight(layer: LayerSpec, tp: int, batch: int) -> float:
    """A data-parallel wrapper measurement: the wrapped run and the plain run
    it is compared with (a guess: one plain run serves every ZeRO stage)."""
    return 2 * layer_weight(layer, tp, batch)


def combine(per_rank: Sequence[Sequence[LayerRecord]]) -> list[ProfileEntry]:
    """One entry per (layer, GPU type, tp, batch): the median across processes
    of each one's median, the interquartile range of all their repeats, the
    most memory any held."""
    grouped: dict[tuple[str, str, int, int], list[LayerRecord]] = {}
    for records in per_rank:
        for r in records:
            grouped.setdefault((r.layer, r.gpu, r.tp, r.batch), []).append(r)
    entries = []
    for (layer, gpu, tp, batch), recs in sorted(grouped.items()):
        entries.append(ProfileEntry(
            layer, gpu, tp, batch,
            fwd_s=median([median(r.fwd) for r in recs]), bwd_s=median([median(r.bwd) for r in recs]),
            memory_bytes=max(r.memory_bytes for r in recs),
            fwd_spread_s=iqr([t for r in recs for t in r.fwd]), bwd_spread_s=iqr([t for r in recs for t in r.bwd]),
            tp_comm_fwd_s=median([r.comm_fwd_s for r in recs]), tp_comm_bwd_s=median([r.comm_bwd_s for r in recs]),
        ))
    return entries


def machine_info(device: torch.device) -> dict[str, Any]:
    """Where the profile was measured (recorded in the file, never used to plan)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = _cpu_name()
    return {"hostname": socket.gethostname(), "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "device": name, "backend": dist.get_backend(),
            "threads": torch.get_num_threads(), "processes": dist.get_world_size(), "cores": usable_cores()}


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity; all of them where the
    system does not say): what processes of a CPU run share."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def settings_info(job: ProfileJob, stopwatch: Stopwatch) -> dict[str, Any]:
    return {"model": job.spec.name, "seq_len": job.spec.seq_len, "cluster": job.cluster.name,
            "precision": precision_of({}, job.spec.dtype_bytes), "tp": list(job.tps), "batches": list(job.batches),
            "warmup": job.warmup, "repeats": job.repeats, "comm_max_bytes": job.comm_max_bytes,
            "timer": stopwatch.name,
            "statistic": "median of repeats per process, median across processes; spread: IQR of all repeats"}


def run_profile(job: ProfileJob, progress_enabled: bool = True) -> dict[str, Any] | None:
    """Measure everything the job asks on this process, together with the
    others; rank 0 returns the ProfileDB as a JSON object, the others None."""
    _check_world(job)
    device = pick_device(job, int(os.environ.get("RANK", "0")))
    _start_group(job, device)
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = measurements(job)
    sizes = collective_group_sizes(job) if job.comm_max_bytes else []
    curves = len(coll.curve_list(sizes, world, coll.OPS)) if job.comm_max_bytes else 0
    guess = coll.predicted_seconds(sizes, world, job.comm_max_bytes, job.warmup, job.repeats,
                                   job.cluster.nodes[0].intra_bandwidth_gbps) if curves else 0.0
    dp_plan = data_parallel_measurements(job)
    chains = chain_measurements(job)
    weights = ([layer_weight(*m) for m in plan] + [loss_weight(job.spec.layers[-1], b) for b in job.batches]
               + [chain_weight(chain_layers(job.spec), *c) for c in chains]
               + [wrapper_weight(layer, tp, job.batches[0]) for layer, tp, _, _ in dp_plan])
    progress = ProgressLines(progress_enabled and rank == 0, weights, curves, guess)
    progress.say(f"{job.spec.name} on {job.cluster.name} ({world} process{'es' if world > 1 else ''}, "
                 f"{device.type}): {len(distinct_layers(job.spec))} layer kinds x tp {','.join(map(str, job.tps))} "
                 f"x batch {','.join(map(str, job.batches))} = {len(plan)} measurements, the loss at each batch"
                 + (f", {len(chains)} of layer chains" if chains else "")
                 + (f", {len(dp_plan)} of data-parallel wrappers" if dp_plan else "")
                 + (f", then {curves} collective curves up to {job.comm_max_bytes:,} bytes" if curves else ""))
    run = start_session(job, device)
    host = (run.gpu, *measure_host(run))
    progress.say(f"host dispatch: {host[1] * 1e6:.3g} us per operator ({host[2]} operators a run)")
    records = measure_layers(run, progress)
    chain_points = measure_chains(run, progress) if chains else []
    dp_points = measure_data_parallel(run, progress) if dp_plan else []
    points, fits, refused = [], [], []
    if curves:
        progress.comm_begin()
        points, fits, refused = coll.measure_curves(sizes, job.comm_max_bytes, job.warmup, job.repeats, device,
                                                    lambda n: link_class(job.cluster, n), progress.comm)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (records, chain_points, dp_points, host))
    if rank != 0:
        return None
    db = ProfileDB(combine([g[0] for g in gathered]), collectives=points, fits=fits, unsupported=refused,
                   chains=combine_chains([g[1] for g in gathered]),
                   data_parallel=combine_data_parallel([g[2] for g in gathered]),
                   host=combine_host([g[3] for g in gathered]),
                   machine=machine_info(device), settings=settings_info(job, Stopwatch(device)))
    return db.to_dict()


def local_worker(job: ProfileJob) -> dict[str, Any] | None:
    """``run_profile`` for ``hetplan.runtime.launch.run_local`` (a module-level function)."""
    return run_profile(job)

