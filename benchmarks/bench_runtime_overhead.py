"""Runtime overhead: a one-stage, one-device plan vs a plain PyTorch loop.

Both train the same GPT (same initial values, data, SGD) for the same steps;
the only difference is ``ctx.train_step`` (batch checks, loss scaling,
micro-batch loop, global loss) instead of ``loss = loss_fn(model(x), y);
loss.backward()``. Steps of the two loops alternate one by one, so load from
other processes hits both alike; the overhead is the median over adjacent
step pairs of (runtime time / plain time) - 1. Exit status 1 if it exceeds 5%
(the issue's bound).

    python benchmarks/bench_runtime_overhead.py [--steps 60] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402

from hetplan.model.presets import gpt_decoder  # noqa: E402
from hetplan.plan.spec import Plan, uniform_stage  # noqa: E402
from hetplan.runtime.context import init  # noqa: E402
from hetplan.runtime.models import build_preset_model, cross_entropy_loss  # noqa: E402
from hetplan.runtime.reference import build_reference, make_optimizer, synthetic_batch  # noqa: E402

LIMIT = 0.05


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="timed steps per loop")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    for var in ("WORLD_SIZE", "RANK"):
        os.environ.pop(var, None)
    torch.set_num_threads(args.threads)

    spec = gpt_decoder("bench-gpt", args.layers, args.hidden, 4, args.seq, vocab=1024, dtype_bytes=4)
    plan = Plan(spec.name, "local-cpu-1", args.batch, args.batch, 1, "1f1b",
                (uniform_stage(range(spec.num_layers), [0], 1, 1, args.batch),), planner="bench")
    ctx = init(plan, spec)
    runtime_model = ctx.parallelize(lambda: build_preset_model(spec))
    plain_model = build_reference(lambda: build_preset_model(spec))
    runtime_opt = make_optimizer(runtime_model.parameters())
    plain_opt = make_optimizer(plain_model.parameters())
    batches = [synthetic_batch(spec.vocab_size, spec.seq_len, args.batch, s) for s in range(4)]

    def plain_step(i: int) -> float:
        x, y = batches[i % len(batches)]
        loss = cross_entropy_loss(plain_model(x), y)
        loss.backward()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def runtime_step(i: int) -> float:
        loss = ctx.train_step(runtime_model, batches[i % len(batches)], cross_entropy_loss)
        runtime_opt.step()
        runtime_opt.zero_grad(set_to_none=True)
        return loss

    for i in range(3):  # warm-up
        plain_step(i)
        runtime_step(i)
    names = ("plain PyTorch loop", "hetplan runtime (1 stage, 1 device)")
    times: dict[str, list[float]] = {n: [] for n in names}
    ratios = []
    for i in range(args.steps):
        pair = {}
        order = ((names[0], plain_step), (names[1], runtime_step))
        for name, fn in (order if i % 2 == 0 else order[::-1]):
            t0 = time.perf_counter()
            fn(i)
            pair[name] = time.perf_counter() - t0
            times[name].append(pair[name])
        ratios.append(pair[names[1]] / pair[names[0]])
    overhead = statistics.median(ratios) - 1
    plain_med = statistics.median(times[names[0]])
    print(f"model: GPT {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.batch}, fp32, "
          f"{spec.total_params / 1e6:.1f} M parameters; {args.threads} thread(s); {args.steps} steps each, "
          "alternating")
    print(f"{'loop':<38} {'median step':>12} {'mean':>10} {'min':>10} {'vs plain':>9}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<38} {med * 1e3:>9.2f} ms {statistics.mean(ts) * 1e3:>7.2f} ms {min(ts) * 1e3:>7.2f} ms "
              f"{(med / plain_med - 1) * 100:>+8.1f}%")
    print(f"overhead = median over step pairs of (runtime / plain) - 1 = {overhead * 100:+.1f}%")
    if overhead > LIMIT:
        print(f"FAIL: runtime overhead {overhead * 100:.1f}% > {LIMIT * 100:.0f}%", file=sys.stderr)
        return 1
    print(f"OK: runtime overhead {overhead * 100:+.1f}% <= {LIMIT * 100:.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
