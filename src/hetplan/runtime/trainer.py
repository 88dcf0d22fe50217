"""``hetplan train``'s worker: train the plan's model (a built-in preset, a HF
config's class or a ``pkg.mod:build`` model) on synthetic data under a plan.

Run by torchrun (``python -m hetplan.runtime.trainer --plan p.json ...``), or
in-process for a one-device plan, or by the tests through ``run_local``. Rank 0
prints one line per step (loss, step time) and writes a JSON summary (and,
for ``--verify``, the full state dict) to ``--out``. The summary holds the
losses, rank 0's ``step_times_s``, the ``stragglers`` (hetplan.app.straggler), ``peak_memory_bytes`` (the largest over the
ranks; on CPU the peak RSS, see ``peak_memory_bytes``) and the ``device`` type.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from hetplan.app.straggler import (
    EXIT_REPLAN, LAUNCHED_AT_ENV, RESTART_COST_ENV, STRAGGLER_FILE, Straggler, Verdict, find_stragglers,
    peer_groups, weigh_replan,
)
from hetplan.cluster.io import load_cluster
from hetplan.errors import HetplanError
from hetplan.plan.file import read_plan_file
from hetplan.runtime import checkpoint_dirs as dirs
from hetplan.runtime import launch
from hetplan.runtime.busy_clock import busy_clock
from hetplan.runtime.console import console, current_context, log_stderr
from hetplan.runtime.faults import fault_kills, fault_slowdown
from hetplan.runtime.profiling.timing import Stopwatch


@dataclass
class TrainConfig:
    plan_path: str
    model: str = ""  # preset name; default: the plan's model
    steps: int = 3
    seed: int = 0
    lr: float | None = None  # default per optimizer (sgd 0.1, adamw 1e-3)
    optimizer: str = "sgd"
    clip: float = 1.0
    out: str = ""  # directory for summary.json (+ state.pt with export)
    export: bool = False
    checkpoint_dir: str = ""  # save a DCP checkpoint here every checkpoint_every steps
    checkpoint_every: int = 0
    resume: bool = False  # continue from the newest complete checkpoint in checkpoint_dir (an error if none)
    load_from: str = ""  # start from this checkpoint (any plan)
    die_after: int = 0  # tests: SIGKILL every rank right after this step (and its checkpoint)
    quiet: bool = False
    compile: bool = False  # torch.compile each layer (RuntimeContext.parallelize)
    dropout: float = 0.0  # the built-in model's dropout (hetplan.runtime.dropout: plan-independent masks)
    resume_or_start: bool = False  # as resume, but start from step 0 when checkpoint_dir has none
    optimizer_impl: str = ""  # for-loop / foreach / fused; default the device's (reference.make_optimizer)
    trust_plan_code: bool = False  # import the plan's pkg.mod:build model unnamed (hetplan.model.origin)


def train(cfg: TrainConfig, spec: Any = None) -> dict[str, Any]:
    """Train and return {losses, step_times_s, notes, state (rank 0, if export)}.
    ``spec``: a ModelSpec to use instead of looking up ``cfg.model``."""
    import torch  # lazy, with the runtime below: main() sends stderr to the rank's log before torch loads

    from hetplan.runtime.build import model_build
    from hetplan.runtime.context import init
    from hetplan.runtime.reference import make_optimizer, training_batch

    ctx = init(cfg.plan_path, spec if spec is not None else (cfg.model or None), trust_plan_code=cfg.trust_plan_code)
    plan, spec = ctx.plan, ctx.spec
    how = model_build(spec, cfg.dropout)
    model = ctx.parallelize(how.build, seed=cfg.seed, compile=cfg.compile, meta_init=how.meta_init,
                            example_inputs=how.example_inputs)
    opt = ctx.optimizer(model, make_optimizer, name=cfg.optimizer, lr=cfg.lr,  # ZeRO-1: states sharded
                        implementation=cfg.optimizer_impl or None)
    impl = getattr(getattr(opt, "inner", opt), "hetplan_implementation", "")
    for note in ctx.notes:
        if not cfg.quiet:
            ctx.print(f"note: {note}")
    if not cfg.quiet:
        ctx.print(f"optimizer: {cfg.optimizer}, {impl} implementation (docs/runtime.md, \"Speed\")")
    start, extras = 0, {}
    if cfg.load_from:
        extras = ctx.load(cfg.load_from, model, opt)
        start = int(extras.get("step", 0))
    elif (cfg.resume or cfg.resume_or_start) and cfg.checkpoint_dir:
        # newest checkpoint with a manifest (newer incomplete ones: a note on rank 0's stderr), none: an
        # error unless resume_or_start; ctx.load verifies its files on every rank before reading them
        found = dirs.resume_checkpoint(cfg.checkpoint_dir, cfg.resume_or_start,
                                     note=lambda t: ctx.print(f"note: {t}", file=sys.stderr))
        if found:
            extras = ctx.load(found[0], model, opt)
            start = int(extras.get("step", found[1]))
            if not cfg.quiet:
                ctx.print(f"resumed from {found[0]} (step {start})")
        elif not cfg.quiet:
            ctx.print(f"note: no complete checkpoint in {cfg.checkpoint_dir}: starting from step 0", file=sys.stderr)
    if "samples" in extras and int(extras["samples"]) != start * plan.global_batch_size and not cfg.quiet:
        ctx.print(f"note: the checkpoint's run had drawn {int(extras['samples'])} samples in {start} steps, this plan "
                  f"draws {plan.global_batch_size} a step: the samples from here on are not those the saved run "
                  "would have seen (keep the global batch to keep them)", file=sys.stderr)
    ctx.step = start  # dropout masks of a resumed run continue where it stopped
    # step times without a host sync per step: CUDA events read once at the end (the host runs
    # ahead of the GPU, so the host clock would time the launches), the host clock on CPU
    losses, clock, busy, walls = [], Stopwatch(ctx.device), busy_clock(ctx.device), []
    slow = fault_slowdown(ctx.rank, ctx.world_size)
    watch = ElasticWatch.from_env()
    for step in range(start, cfg.steps):
        watch.first_step()
        # next-token batches (HF: with a padded attention mask), or a pkg.mod:build model's own (user_model)
        x, y, inputs = training_batch(spec, how, plan.global_batch_size, step, cfg.seed)
        t0 = time.perf_counter()
        busy.start()
        clock.mark()
        loss = ctx.train_step(model, (x, y), how.loss, return_outputs=False, inputs=inputs)
        if cfg.clip:
            ctx.clip_grad_norm_(model, cfg.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if slow > 1.0:  # HETPLAN_FAULT_SLOW: this rank's work takes `slow` times as long
            _busy_wait((slow - 1.0) * busy.elapsed())
        busy.stop()  # this rank's own work (CPU time; CUDA events on a GPU: runtime/busy_clock.py)
        walls.append(time.perf_counter() - t0)
        clock.mark()
        losses.append(loss)  # no grad; a detach would wait for its all-reduce (runtime/pending.py)
        if not cfg.quiet:  # the step's one host sync, for the printed loss (after it the step is done)
            value = float(loss)
            ctx.print(f"step {step + 1:>4}  loss {value:.6f}  time {(time.perf_counter() - t0) * 1e3:8.1f} ms")
        if cfg.checkpoint_dir and cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            # the sampler's position: step k's batch is drawn from (seed, k) with the global batch size
            ctx.save(dirs.checkpoint_dir(cfg.checkpoint_dir, step + 1), model, opt, step=step + 1,
                     samples=(step + 1) * plan.global_batch_size)
            if watch.stop_for_stragglers(ctx, cfg, busy.read(), walls, cfg.steps - step - 1):
                ctx.close()
                sys.stdout.flush()
                os._exit(EXIT_REPLAN)  # every rank, right after the checkpoint: the supervisor re-plans
        if cfg.die_after and step + 1 == cfg.die_after:
            ctx.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
        faults = fault_kills(ctx.world_size)
        if step + 1 in faults.values():  # a rank dies, the others see a peer gone (--elastic tests)
            ctx.barrier()  # its checkpoint complete on every rank first
            if faults.get(ctx.rank) == step + 1:
                os.kill(os.getpid(), signal.SIGKILL)
    losses = torch.stack(losses).tolist() if losses else []  # one sync for the whole run's losses
    times = clock.laps()[::2]  # each step's start to its end, not the batch making between steps
    rank_busy, stragglers = check_stragglers(ctx, cfg.plan_path, busy.drain())
    state = ctx.full_state_dict(model) if cfg.export else {}
    result = {"losses": losses, "step_times_s": times, "notes": list(ctx.notes), "start_step": start,
              "rank_busy_s": rank_busy, "stragglers": [s.record() for s in stragglers],
              "layout": ctx.layout.describe(), "parameters": ctx.parameter_layout(model),
              "peak_memory_bytes": peak_memory_bytes(ctx.device), "device": ctx.device.type,
              "optimizer_implementation": impl}
    if ctx.rank == 0 and cfg.out:
        os.makedirs(cfg.out, exist_ok=True)
        with open(os.path.join(cfg.out, "summary.json"), "w", encoding="utf-8") as f:
            json.dump({**result, "config": asdict(cfg)}, f, indent=2)
        if cfg.export:
            torch.save(state, os.path.join(cfg.out, "state.pt"))
    result["state"] = state
    ctx.close()
    return result


def _busy_wait(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU time (a slower device's work, for the straggler tests)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@dataclass
class ElasticWatch:
    """Under ``--elastic`` (the supervisor set ``LAUNCHED_AT_ENV``): what a restart costs, and the
    stragglers check at each checkpoint (hetplan.app.straggler)."""

    launched_at: float | None = None  # None: not under --elastic
    restart_s: float | None = None  # given (--restart-cost), else measured at the first step
    said: bool = False  # the "going on with this plan" line, once a launch

    @staticmethod
    def from_env() -> ElasticWatch:
        launched = os.environ.get(LAUNCHED_AT_ENV)
        given = os.environ.get(RESTART_COST_ENV)
        return ElasticWatch(float(launched) if launched else None, float(given) if given else None)

    def first_step(self) -> None:
        """The launch's start to its first step: processes, imports, model, checkpoint load."""
        if self.launched_at is not None and self.restart_s is None:
            self.restart_s = max(0.0, time.time() - self.launched_at)

    def stop_for_stragglers(self, ctx: Any, cfg: TrainConfig, busy: list[float], walls: list[float],
                            steps_left: int) -> bool:
        """After a checkpoint: whether every rank stops for a re-plan around the stragglers (the same
        answer on every rank: rank 0 weighs it and broadcasts; every rank must call it). Rank 0 then
        leaves ``STRAGGLER_FILE`` in the checkpoint directory for the supervisor."""
        import torch.distributed as dist

        if self.launched_at is None or not walls:
            return False
        found = check_stragglers(ctx, cfg.plan_path, busy, report=False)[1]
        if not found:
            return False
        verdict: list[Any] = [None]
        if ctx.rank == 0:
            try:
                verdict[0] = weigh_replan(cfg.plan_path, found, statistics.median(walls), steps_left,
                                          self.restart_s or 0.0)
            except HetplanError as exc:  # the run goes on as planned; the line says why
                verdict[0] = Verdict(False, f"--elastic: cannot re-plan around the straggler(s): {exc}")
        dist.broadcast_object_list(verdict, src=0)
        if ctx.rank == 0 and (verdict[0].replan or not self.said):
            for straggler in found:
                ctx.print(straggler.line())
            ctx.print(verdict[0].line)
            self.said = True
        if verdict[0].replan and ctx.rank == 0:
            with open(os.path.join(cfg.checkpoint_dir, STRAGGLER_FILE), "w", encoding="utf-8") as f:
                json.dump({"slow": {str(s.device): s.slowdown for s in found}, "line": verdict[0].line}, f)
        ctx.barrier()
        return bool(verdict[0].replan)


def check_stragglers(ctx: Any, plan_path: str, busy: list[float], report: bool = True
                     ) -> tuple[list[float], list[Straggler]]:
    """Each rank's median busy seconds a step, and the ranks slower than the plan says
    (hetplan.app.straggler), the same on every rank (an all-gather of each rank's busy times; every rank
    must call it); rank 0 prints a line for each straggler (``report``). ``busy``: this rank's steps read so
    far (runtime/busy_clock.py: CPU time, or CUDA events; the ranks may have read different numbers of
    steps, and the check compares the last steps all of them have)."""
    import torch.distributed as dist

    if ctx.device.type not in ("cpu", "cuda") or not ctx.distributed:
        return [], []
    everyone: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(everyone, busy)
    try:  # a plan file of the old format names its cluster; without it, peers are not told apart by type
        cluster = read_plan_file(plan_path).cluster or load_cluster(ctx.plan.cluster)
    except (HetplanError, OSError):
        cluster = None
    devices = [ctx.layout.position(r).device for r in range(ctx.world_size)]
    found = find_stragglers(everyone, devices, peer_groups(ctx.layout, cluster))
    for straggler in found if report else []:
        ctx.print(straggler.line())
    return [statistics.median(b) if b else 0.0 for b in everyone], found


def peak_memory_bytes(device: Any) -> int:
    """The run's peak memory of one process, the largest over the ranks (a
    MAX all-reduce when a process group is up; every rank must call it).

    On CUDA: ``torch.cuda.max_memory_allocated`` (tensor bytes from the
    caching allocator, what the cost model predicts). On CPU: the process's
    peak resident set size (``getrusage`` ``ru_maxrss``), which also counts the
    interpreter, torch's libraries and freed-but-kept heap, so it is well above
    the tensors' bytes. ``hetplan tune`` records it per trial."""
    import torch
    import torch.distributed as dist

    if device.type == "cuda":
        local = int(torch.cuda.max_memory_allocated(device))
    else:
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        local = int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux
    if dist.is_available() and dist.is_initialized():
        peak = torch.tensor([local], dtype=torch.int64, device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        local = int(peak.item())
    return local


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    p = argparse.ArgumentParser(prog="python -m hetplan.runtime.trainer")
    p.add_argument("--plan", required=True)
    p.add_argument("--model", default="")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--out", default="")
    p.add_argument("--export", action="store_true")
    p.add_argument("--checkpoint-dir", default="")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--resume-or-start", action="store_true")
    p.add_argument("--load-from", default="")
    p.add_argument("--die-after", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--optimizer-impl", default="")
    p.add_argument("--trust-plan-code", action="store_true")
    a = p.parse_args(argv)
    return TrainConfig(a.plan, a.model, a.steps, a.seed, a.lr, a.optimizer, a.clip, a.out, a.export,
                       a.checkpoint_dir, a.checkpoint_every, a.resume, a.load_from, a.die_after, a.quiet,
                       a.compile, a.dropout, resume_or_start=a.resume_or_start,
                       optimizer_impl=a.optimizer_impl, trust_plan_code=a.trust_plan_code)


def main(argv: list[str] | None = None) -> int:
    rank = os.environ.get("RANK", "0")
    if os.environ.get(launch.RANK_LOG_ENV):  # hetplan train: this rank's tracebacks and warnings go to its log
        log_stderr(os.environ[launch.RANK_LOG_ENV], int(rank))
    try:
        import torch

        torch.set_num_threads(int(os.environ.get("HETPLAN_NUM_THREADS", "1")))
        cfg = parse_args(argv)
        train(cfg)
        code = 0
    except HetplanError as exc:
        console(f"hetplan: error (rank {rank}): {exc}")
        code = 2
    except Exception as exc:  # noqa: BLE001 - all but CUDA's out-of-memory error are raised again
        if not launch.is_out_of_memory(exc):
            raise
        console(f"hetplan: error: {launch.out_of_memory_line(exc, current_context(), cfg.plan_path)}")
        code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown ("terminate called without an active exception")


if __name__ == "__main__":
    main()
