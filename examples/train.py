"""Train a model the way a hetplan Plan says: a user's own training script.

    hetplan plan --model tiny-gpt --cluster local-cpu-4 --global-batch 8 --json plan.json
    hetplan run plan.json -- examples/train.py --steps 20 --checkpoint-dir ckpt

``hetplan run`` starts one process per device of the plan (torchrun) and tells
``hetplan.runtime.init()`` where the plan is. The script keeps its own
optimizer, learning-rate schedule, gradient clipping and loop; the runtime
splits the model (pipeline stages, tensor parallelism, FSDP2, recomputation),
feeds each rank its share of every batch and returns the global loss on every
rank. Run it again with --checkpoint-dir after killing it, or with another
plan: it resumes from the newest complete checkpoint. ``hetplan run --elastic
--checkpoint-dir DIR`` does that by itself when a process dies, with a plan for
the devices left (docs/elastic.md).
"""

from __future__ import annotations

import argparse
import os

import torch

import hetplan.runtime as hr


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.1)
    # hetplan run --checkpoint-dir DIR (and --elastic, which restarts this script with a new plan) passes DIR here
    p.add_argument("--checkpoint-dir", default=os.environ.get("HETPLAN_CHECKPOINT_DIR", ""))
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--export", default="", help="write the full state dict here at the end")
    args = p.parse_args()
    torch.set_num_threads(1)

    ctx = hr.init()  # the plan from $HETPLAN_PLAN; process groups and device mesh
    spec = ctx.spec  # the plan's model (a hetplan ModelSpec): its layer names are the modules to split by
    ctx.print(f"{ctx.layout.describe()}")
    for note in ctx.notes:
        ctx.print(f"note: {note}")

    # Any nn.Module whose module names match the ModelSpec's layers works here; this is hetplan's GPT.
    model = ctx.parallelize(lambda: hr.build_preset_model(spec), seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))

    start = 0
    found = hr.latest_checkpoint(args.checkpoint_dir, note=lambda text: ctx.print(f"note: {text}")) if args.checkpoint_dir else None
    if found:
        start = ctx.load(found[0], model, opt)["step"]
        for _ in range(start):
            schedule.step()
        ctx.print(f"resumed from {found[0]}")

    for step in range(start, args.steps):
        # the global batch, identical on every rank; each replica takes its share
        x, y = hr.synthetic_batch(spec.vocab_size, spec.seq_len, ctx.plan.global_batch_size, step)
        loss = ctx.train_step(model, (x, y), hr.cross_entropy_loss)
        norm = ctx.clip_grad_norm_(model, 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        ctx.print(f"step {step + 1:>4}  loss {loss:.4f}  grad norm {norm:.3f}")
        if args.checkpoint_dir and (step + 1) % args.checkpoint_every == 0:
            ctx.save(hr.checkpoint_dir(args.checkpoint_dir, step + 1), model, opt, step=step + 1)

    if args.export:
        ctx.export(args.export, model)  # one plain state dict, loadable into the unsplit model
    ctx.close(exit_process=True)


if __name__ == "__main__":
    main()
