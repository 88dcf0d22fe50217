"""Per-rank bytes of parameters, gradients and optimizer states: what the cost
model says each device keeps between steps (``CostModel.resident_state_bytes``)
is what the runtime's local tensors hold, for every ZeRO stage (tiny-gpt,
fp32, AdamW, dp2 and dp4 on gloo); and ZeRO-1 (states sharded by
``ctx.optimizer``) trains as the single-process reference does."""

from __future__ import annotations


import pytest
from rt_helpers import assert_matches_reference, make_plan, run, train_worker, write_plan

pytestmark = pytest.mark.distributed


def bytes_worker(plan_path: str) -> dict[str, int]:
    """One step; this rank's local bytes of each kind."""
    import torch
    from torch.distributed.tensor import DTensor

    import hetplan.runtime as hr
    from hetplan.runtime.models import build_preset_model, cross_entropy_loss
    from hetplan.runtime.reference import synthetic_batch

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    ctx = hr.init(plan_path)
    model = ctx.parallelize(lambda: build_preset_model(ctx.spec))
    opt = ctx.optimizer(model, torch.optim.AdamW, lr=1e-3, foreach=False)
    x, y = synthetic_batch(ctx.spec.vocab_size, ctx.spec.seq_len, ctx.plan.global_batch_size, 0, 0)
    ctx.train_step(model, (x, y), cross_entropy_loss)
    params = list(model.parameters())
    grads = sum(local(p.grad).numel() * local(p.grad).element_size() for p in params if p.grad is not None)
    opt.step()
    states = sum(local(v).numel() * local(v).element_size() for s in opt.state.values() for k, v in s.items()
                 if k != "step")  # Adam's step counter is a scalar, not a per-parameter state
    out = {"rank": ctx.rank, "params": sum(local(p).numel() * local(p).element_size() for p in params),
           "grads": grads, "optimizer": states}
    ctx.close()
    return out


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_predicted_bytes_per_rank_are_the_local_tensors(zero: int, dp: int, tmp_path) -> None:
    from hetplan.cluster.io import load_cluster
    from hetplan.cost.model import CostModel
    from hetplan.plan.workload import Workload
    from hetplan.model.presets import get_model

    plan = make_plan(dp, zero=zero)
    workload = Workload(get_model("tiny-gpt"), load_cluster(plan.cluster), plan.global_batch_size,
                        optimizer="adam-fp32")
    predicted = CostModel(workload).resident_state_bytes(plan)
    for got in run(bytes_worker, dp, write_plan(tmp_path, plan)):
        want = predicted[plan.stages[0].devices[got["rank"]]]
        assert {k: got[k] for k in want} == want, (zero, dp, got, want)


def test_zero1_trains_as_the_reference(tmp_path) -> None:
    results = run(train_worker, 2, write_plan(tmp_path, make_plan(2, zero=1)))
    assert_matches_reference(results[0])


def gather_count_worker(plan_path: str) -> int:
    """All-gathers of a step's parameters (the second step: the first also initialises)."""
    import torch.distributed as dist

    import hetplan.runtime as hr
    from hetplan.runtime.models import build_preset_model, cross_entropy_loss
    from hetplan.runtime.reference import synthetic_batch

    calls = [0]
    gather = dist.all_gather_single  # what FSDP2 gathers a module's parameters with (DefaultAllGather)

    def counting(*args, **kwargs):
        calls[0] += 1
        return gather(*args, **kwargs)

    dist.all_gather_single = counting
    ctx = hr.init(plan_path)
    model = ctx.parallelize(lambda: build_preset_model(ctx.spec))
    x, y = synthetic_batch(ctx.spec.vocab_size, ctx.spec.seq_len, ctx.plan.global_batch_size, 0, 0)
    ctx.train_step(model, (x, y), cross_entropy_loss)
    calls[0] = 0
    ctx.train_step(model, (x, y), cross_entropy_loss)
    ctx.close()
    return calls[0]


def test_zero2_gathers_once_a_step_and_zero3_on_every_micro_batch(tmp_path) -> None:
    """ZeRO-2 keeps its gathered weights until the step's last backward (as the
    cost model charges: one all-gather a step); ZeRO-3 gathers on every micro-batch."""
    counts = {}
    for zero in (2, 3):
        for micro in (8, 2):  # 1 and 4 micro-batches of the 8 samples
            plan = make_plan(2, micro=micro, zero=zero)
            counts[zero, micro] = run(gather_count_worker, 2, write_plan(tmp_path, plan, f"z{zero}m{micro}.json"))[0]
    assert counts[2, 8] > 0 and counts[2, 2] == counts[2, 8], counts
    assert counts[3, 2] == 4 * counts[3, 8] > 0, counts


# ops that write a copy of tensor data (the bytes of their output): what ZeRO-1's gather may cost
COPY_OPS = frozenset({"aten.copy_", "aten.cat", "aten.clone", "aten._foreach_copy_", "aten._to_copy"})


def zero1_copy_worker(plan_path: str) -> tuple[int, int]:
    """(bytes the second ZeRO-1 optimizer step copies, bytes of this rank's
    parameters), the inner optimizer's own copies aside (SGD without momentum
    copies nothing)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import hetplan.runtime as hr
    from hetplan.runtime.models import build_preset_model, cross_entropy_loss
    from hetplan.runtime.reference import synthetic_batch

    class CopyBytes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if str(func.overloadpacket) in COPY_OPS:
                written = args[0] if func.overloadpacket is torch.ops.aten._foreach_copy_ else out
                self.bytes += sum(t.numel() * t.element_size() for t in
                                  (written if isinstance(written, (list, tuple)) else [written]))
            return out

    ctx = hr.init(plan_path)
    model = ctx.parallelize(lambda: build_preset_model(ctx.spec))
    opt = ctx.optimizer(model, torch.optim.SGD, lr=1e-3)
    x, y = synthetic_batch(ctx.spec.vocab_size, ctx.spec.seq_len, ctx.plan.global_batch_size, 0, 0)
    for step in range(2):
        ctx.train_step(model, (x, y), cross_entropy_loss, return_outputs=False)
        with CopyBytes() as counter:
            opt.step()
        opt.zero_grad(set_to_none=True)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    ctx.close()
    return counter.bytes, params


def test_zero1_step_copies_each_weight_once(tmp_path) -> None:
    """ZeRO-1's step copies the gathered slices into the weights, each byte
    once: no staging copy of the slice before the all-gather, no whole
    parameter put together before it is copied in."""
    for copied, params in run(zero1_copy_worker, 2, write_plan(tmp_path, make_plan(2, zero=1))):
        assert 0 < copied <= params, (copied, params)
