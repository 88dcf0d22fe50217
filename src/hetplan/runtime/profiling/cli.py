"""``hetplan profile``: measure layer times and collectives on your own hardware.

    hetplan profile --model tiny-gpt --cluster local-cpu-2 -o profile.json
        measure on this machine (one gloo process per device of local-cpu-N)
        and write the ProfileDB (docs/profiling.md) that ``hetplan plan
        --profile`` and ``hetplan estimate --profile`` read.

    hetplan profile --model gpt3-1.3b --cluster 16xA100-80GB -o profile.json
        print the torchrun command each node of the cluster runs (the run
        measures every GPU at once; rank 0 writes the file) and exit.

Importing this module does not import torch; the command does.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from typing import Any, Sequence

from hetplan.io.argtypes import at_most, finite_positive_float, name_or_path, positive_int, zero_or_at_most
from hetplan.cluster.io import load_cluster
from hetplan.cluster.presets import local_cpu_cluster
from hetplan.cost.constants import HOST_OP_S
from hetplan.errors import HetplanError
from hetplan.limits import MAX_GLOBAL_BATCH
from hetplan.model.load import load_model
from hetplan.profile.db import ProfileDB
from hetplan.report.text import table
from hetplan.runtime.launch import run_local
from hetplan.runtime.profiling.collectives import MIN_BYTES
from hetplan.runtime.profiling.job import ProfileJob, batch_sizes
from hetplan.units import format_bytes, parse_byte_size
from hetplan.io.userfiles import check_writable_file
from hetplan.runtime import tp as tpr

DEFAULT_MAX_MICRO_BATCH = 4
DEFAULT_REPEATS = 5
DEFAULT_WARMUP = 2
DEFAULT_TIMEOUT_S = 1800.0
CPU_COMM_MAX_BYTES = 64 * 2**20  # gloo over loopback: 64 MiB takes ~0.1 s a call
GPU_COMM_MAX_BYTES = 2**30  # nccl-tests' usual top size
MAX_COMM_BYTES = 64 * 2**30
MAX_REPEATS = 10_000


def _tp_list(text: str) -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4)."""
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected TP degrees such as 1,2,4, got {text!r}")
    return tuple(sorted({positive_int(t) for t in items}))


def _byte_size(text: str) -> int:
    """A message size: '64MiB', '1GiB', 0 (no collectives); else between 1 KiB and 64 GiB."""
    try:
        size = parse_byte_size(text)
    except HetplanError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if size and not MIN_BYTES <= size <= MAX_COMM_BYTES:
        raise argparse.ArgumentTypeError(f"{text!r} is {size:,} bytes; give 0 (no collectives) or a size "
                                         "from 1KiB to 64GiB")
    return size


def register(subparsers: Any) -> None:
    """Add ``profile`` to the hetplan CLI's subparsers."""
    p = subparsers.add_parser("profile", help="measure layer times and collectives on your hardware (needs torch)")
    p.add_argument("--model", type=name_or_path, required=True, help="preset name, HF config.json, pkg.mod:build or ModelSpec .json: "
                   "measured as hetplan train builds it")
    p.add_argument("--cluster", type=name_or_path, required=True,
                   help="local-cpu-N (measured here) or a GPU cluster (prints the command per node)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="sequence length for HF configs")
    p.add_argument("--tp", type=_tp_list, default=None,
                   help="TP degrees, e.g. 1,2 (default: powers of two dividing the node size and the heads)")
    p.add_argument("--max-micro-batch", type=at_most(MAX_GLOBAL_BATCH), default=DEFAULT_MAX_MICRO_BATCH,
                   help=f"micro-batch sizes 1, 2, 4, ... up to this (default {DEFAULT_MAX_MICRO_BATCH})")
    p.add_argument("--comm-max-bytes", type=_byte_size, default=None,
                   help="largest collective message, e.g. 64MiB; 0 skips collectives "
                   "(default 64MiB on CPU, 1GiB on GPUs)")
    p.add_argument("--repeats", type=at_most(MAX_REPEATS), default=DEFAULT_REPEATS,
                   help=f"timed runs per measurement (default {DEFAULT_REPEATS}; the median is kept)")
    p.add_argument("--warmup", type=zero_or_at_most(MAX_REPEATS), default=DEFAULT_WARMUP,
                   help=f"untimed runs first (default {DEFAULT_WARMUP})")
    p.add_argument("-o", "--out", required=True, help="write the profile JSON here")
    p.add_argument("--timeout", type=finite_positive_float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help=f"give up after this long (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--master-addr", default="NODE0_ADDRESS", help="address of the first node (printed commands)")
    p.add_argument("--master-port", type=at_most(65535), default=29500)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a process torchrun started
    p.set_defaults(func=cmd_profile)


# --- the job ---------------------------------------------------------------------------------------------
def is_local(cluster: Any) -> bool:
    """A local-cpu-N cluster: measured by processes on this machine."""
    name = cluster.name
    return name.startswith("local-cpu-") and cluster == local_cpu_cluster(cluster.num_devices)


def _torch_available() -> bool:
    try:
        import torch  # noqa: F401 -- only to see that torch is installed
    except ImportError:
        return False
    return True


def built_in(spec: Any) -> bool:
    """A hetplan preset, built by the runtime's own GPT (no HF class, no ``pkg.mod:build``)."""
    return spec.source is None


def tp_problem(spec: Any, tp: int) -> str:
    """Why the runtime cannot shard the model's layers ``tp`` ways ('' if it can)."""
    for layer in spec.layers:
        if not layer.supports_tp(tp) and layer.kind not in ("embedding", "head"):
            return f"layer {layer.name!r} supports TP degrees up to {layer.tp_max} dividing it, not {tp}"
    if not built_in(spec):
        return (f"hetplan profile measures HF and pkg.mod:build models at tp 1 ({spec.name!r} is one); "
                "drop --tp (layers at tp > 1 keep the model's times)")
    if not _torch_available():
        return ""
    import torch  # torch-optional: the command prints launch commands on machines without torch

    from hetplan.runtime.models import GPT, config_from_spec

    with torch.device("meta"):
        full = GPT(config_from_spec(spec))
    seen = set()
    for layer in spec.layers:
        if layer.profile_key in seen:
            continue
        seen.add(layer.profile_key)
        try:
            tpr.dry_run(full.get_submodule(layer.name), layer.name, tp, False)
        except HetplanError as exc:
            return str(exc)
    return ""


def default_tps(spec: Any, node_sizes: Sequence[int]) -> tuple[int, ...]:
    """Powers of two that divide every node's size and that the model's layers take."""
    smallest = min(node_sizes)
    out = []
    tp = 1
    while tp <= smallest:
        if all(n % tp == 0 for n in node_sizes) and (tp == 1 or not tp_problem(spec, tp)):
            out.append(tp)
        tp *= 2
    return tuple(out)


def check_tps(tps: Sequence[int], spec: Any, cluster: Any, local: bool) -> None:
    """Each TP degree fills whole nodes with groups of consecutive processes and shards the model."""
    sizes = [n.num_gpus for n in cluster.nodes]
    where = f"the {cluster.num_devices} processes of {cluster.name}" if local else \
        f"the {min(sizes)} GPUs of the smallest node of {cluster.name}"
    for tp in tps:
        if tp > min(sizes):
            raise HetplanError(f"--tp {tp} is more than {where}; use TP degrees up to {min(sizes)}")
        bad = next((n for n in sizes if n % tp), None)
        if bad is not None:
            raise HetplanError(f"--tp {tp} does not divide the {bad} {'processes' if local else 'GPUs'} of a node of "
                               f"{cluster.name}; TP groups must fill each node")
        problem = tp_problem(spec, tp) if tp > 1 else ""
        if problem:
            raise HetplanError(f"--tp {tp}: {problem}")


def check_buildable(spec: Any) -> None:
    """Refuse, before any process starts, a model the runtime cannot build or
    whose layers cannot be measured one at a time (one line saying why)."""
    if built_in(spec):
        from hetplan.runtime.models import config_from_spec  # torch-optional (see _torch_available)

        try:
            config_from_spec(spec)  # a preset is measured as the runtime's own module
        except HetplanError as exc:
            raise HetplanError(f"cannot profile {spec.name!r} with the runtime's built-in model: {exc}") from None
        return
    from hetplan.runtime.profiling.subject import profiled_model  # torch-optional (see _torch_available)

    profiled_model(spec)


def build_job(args: argparse.Namespace) -> tuple[Any, bool]:
    """The ProfileJob the flags ask for (every check before any process
    starts) and whether it runs here (local-cpu-N)."""
    spec = load_model(args.model, seq_len=args.seq_len)
    cluster = load_cluster(args.cluster)
    local = is_local(cluster)
    if local and not _torch_available():
        raise HetplanError("hetplan profile measures with torch: pip install 'hetplan[torch]'")
    if _torch_available():
        check_buildable(spec)
    sizes = [n.num_gpus for n in cluster.nodes]
    tps = args.tp or default_tps(spec, sizes)
    check_tps(tps, spec, cluster, local)
    comm = args.comm_max_bytes
    if comm is None:
        comm = CPU_COMM_MAX_BYTES if all(n.gpu.name.upper() == "CPU" for n in cluster.nodes) else GPU_COMM_MAX_BYTES
    job = ProfileJob(spec, cluster, tuple(tps), batch_sizes(args.max_micro_batch), args.warmup, args.repeats,
                     comm, timeout_s=args.timeout, out=args.out)
    return job, local


# --- the command ----------------------------------------------------------------------------------------
def cmd_profile(args: argparse.Namespace) -> int:
    if args.worker:
        if os.environ.get("RANK", "0") == "0":  # only rank 0 writes
            check_writable_file("-o", args.out)
        return _run_worker(args)
    check_writable_file("-o", args.out)
    job, local = build_job(args)
    if not local:
        _print_commands(args, job)
        return 0
    return _run_here(job)


def _run_here(job: Any) -> int:
    """Measure with one process per device of local-cpu-N, write the file."""
    from hetplan.runtime.profiling.measure import local_worker  # torch-optional: build_job refused a run without it

    start = time.perf_counter()
    env = {"HETPLAN_NUM_THREADS": os.environ.get("HETPLAN_NUM_THREADS", "1")}
    results = run_local(local_worker, job.cluster.num_devices, (job,), timeout_s=job.timeout_s, env=env)
    _raise_first_failure(results)
    _write(job, results[0].value, time.perf_counter() - start)
    return 0


def _raise_first_failure(results: Sequence[Any]) -> None:
    """One line for the first process that failed on its own (not because a peer died)."""
    bad = [r for r in results if r.exitcode != 0 or r.error]
    if not bad:
        return
    secondary = ("Connection reset", "Connection closed", "killed by signal", "timed out", "Timeout")
    bad.sort(key=lambda r: (any(s in r.error for s in secondary), not r.error, r.rank))
    r = bad[0]
    if r.error.startswith("HetplanError: "):
        raise HetplanError(r.error[len("HetplanError: "):])
    if r.traceback:
        print(r.traceback, file=sys.stderr)
    raise HetplanError(f"profiling failed in process {r.rank} (exit {r.exitcode}): {r.error or 'no result'}")


def _run_worker(args: argparse.Namespace) -> int:
    """One process of a torchrun launch (the printed commands); rank 0 writes the file."""
    import torch.distributed as dist  # torch-optional: a worker is a process torchrun started

    from hetplan.runtime.profiling.measure import run_profile

    start = time.perf_counter()
    job, _ = build_job(args)
    try:
        data = run_profile(job)
        if data is not None:
            _write(job, data, time.perf_counter() - start)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _write(job: Any, data: dict[str, Any], seconds: float) -> None:
    db = ProfileDB.from_dict(data, "measured profile")  # the file will load: it passed the loader's checks
    text = db.to_json()
    try:
        with open(job.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    except OSError as exc:
        raise HetplanError(f"cannot write {job.out}: {exc.strerror}") from None
    print(summary(db, job.spec))
    print(f"wrote {job.out}: {len(db)} layer entries, {len(db.collectives)} collective points, "
          f"{len(db.data_parallel)} data-parallel wrapper points "
          f"(measured in {seconds:.1f} s)")


def summary(db: Any, spec: Any) -> str:
    """The measured numbers as tables."""
    names: dict[str, str] = {}
    for layer in spec.layers:
        names.setdefault(layer.profile_key, layer.name)
    rows = [[names.get(e.layer, e.layer), e.gpu, e.tp, e.batch, f"{e.fwd_s * 1e3:.3f}", f"{e.bwd_s * 1e3:.3f}",
             f"{e.fwd_spread_s * 1e3:.3f}/{e.bwd_spread_s * 1e3:.3f}",
             f"{e.tp_comm_fwd_s * 1e3:.3f}/{e.tp_comm_bwd_s * 1e3:.3f}", format_bytes(e.memory_bytes)]
            for e in sorted(db.entries(), key=lambda e: (e.tp, list(names).index(e.layer) if e.layer in names
                                                          else len(names), e.gpu, e.batch))]
    text = table(["layer", "gpu", "tp", "batch", "fwd ms", "bwd ms", "IQR ms", "TP comm ms", "memory"], rows,
                 [False, False, True, True, True, True, True, True, True])
    if db.fits:
        fit_rows = [[f.op, f.ranks, f.link, f"{f.alpha_s * 1e6:.1f}", f"{f.bandwidth_gbps:.3g}", f"{f.busbw_gbps:.3g}"]
                    for f in db.fits]
        text += "\n\n" + table(["collective", "ranks", "link", "alpha us", "bandwidth Gb/s", "busbw Gb/s"], fit_rows,
                               [False, True, False, True, True, True])
    if db.chains:
        chain_rows = [[c.gpu, c.tp, c.batch, f"{c.fwd_s * 1e3:.3f}", f"{c.bwd_s * 1e3:.3f}",
                       f"{db.chain_factor(c.gpu, c.tp, c.batch):.3f}"] for c in db.chains]
        text += (f"\n\nlayers chained in one micro-batch ({', '.join(names.get(k, k) for k in db.chains[0].layers)}):\n"
                 + table(["gpu", "tp", "batch", "fwd ms", "bwd ms", "x layers alone"], chain_rows,
                         [False, True, True, True, True, True]))
    if db.data_parallel:
        dp_rows = [[names.get(d.layer, d.layer), d.gpu, d.tp, d.ranks, d.zero, f"{d.fwd_extra_s * 1e3:.3f}",
                    f"{d.bwd_extra_s * 1e3:.3f}"] for d in db.data_parallel]
        text += "\n\n" + table(["layer", "gpu", "tp", "dp ranks", "ZeRO", "adds fwd ms", "adds bwd ms"], dp_rows,
                               [False, False, True, True, True, True, True])
    for h in db.host:
        text += (f"\nhost dispatch on {h.gpu}: {h.op_s * 1e6:.3g} us per operator ({h.ops} operators a probe run); "
                 f"the cost kernel takes it for host-bound passes (default {HOST_OP_S * 1e6:.3g} us)")
    for u in db.unsupported:
        text += f"\n{u.op} over {u.ranks} ranks: not supported by the backend ({u.reason})"
    return text


def _print_commands(args: argparse.Namespace, job: Any) -> None:
    """The torchrun command per node (like 'hetplan run --print')."""
    cluster = job.cluster
    nodes = cluster.nodes
    flags = _worker_flags(args, job)
    python = shlex.quote(sys.executable)
    print(f"# hetplan profile: {cluster.name} ({cluster.num_devices} GPUs on {len(nodes)} node"
          f"{'s' if len(nodes) > 1 else ''}) is profiled by one process per GPU, all at once;")
    print(f"# run on each node (rank 0, on node 0, writes {os.path.abspath(args.out)}):")
    for k, node in enumerate(nodes):
        launch = ["--standalone"] if len(nodes) == 1 else [
            f"--nnodes={len(nodes)}", f"--node-rank={k}", f"--master-addr={args.master_addr}",
            f"--master-port={args.master_port}"]
        print(f"# node {k} ({node.name or 'node'}: {node.num_gpus} x {node.gpu.name})")
        print(" ".join([python, "-m", "torch.distributed.run", *launch, f"--nproc-per-node={node.num_gpus}",
                        "-m", "hetplan", "profile", "--worker", *flags]))


def _worker_flags(args: argparse.Namespace, job: Any) -> list[str]:
    """The flags a worker needs, settled (defaults resolved, files absolute)."""
    def where(value: str) -> str:
        return os.path.abspath(value) if os.path.exists(value) else value

    flags = ["--model", where(args.model), "--cluster", where(args.cluster)]
    if args.seq_len:
        flags += ["--seq-len", str(args.seq_len)]
    flags += ["--tp", ",".join(map(str, job.tps)), "--max-micro-batch", str(args.max_micro_batch),
              "--comm-max-bytes", str(job.comm_max_bytes), "--repeats", str(job.repeats),
              "--warmup", str(job.warmup), "--timeout", repr(job.timeout_s), "-o", os.path.abspath(args.out)]
    return [shlex.quote(f) for f in flags]
