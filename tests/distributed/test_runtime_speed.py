"""The training step leaves the device alone: no host sync in ``train_step``
or clipping (fp16's overflow verdict aside, one a step as torch's GradScaler
reads it), for every plan kind; counted with a TorchDispatchMode on CPU (gloo),
which sees the same ops a GPU run dispatches; and a plain data-parallel step
issues no collective the host waits for (the global loss's all-reduce is waited
for when the loss is read)."""

from __future__ import annotations

from typing import Any

import pytest

from hetplan.plan.spec import LayerStrategy
from rt_helpers import make_plan, run
from rt_helpers import write_plan as write_plan_file
from speed_helpers import sync_count_worker, tied_sync_worker, write_plan

MIXED = {0: LayerStrategy(0), 1: LayerStrategy(1, "full"), 2: LayerStrategy(2), 3: LayerStrategy(3, "selective"),
         4: LayerStrategy(1), 5: LayerStrategy(3)}
# (plan, precision, train_step calls per optimizer step, the bound on host syncs per step)
CASES = {
    # ZeRO 0-3 and both recomputes in one dp2 plan, bf16, 2 micro-batches per replica, accumulation
    "dp2-zero0123-recompute-bf16-accumulate": (dict(dp=2, micro=2, strategies=MIXED), "bf16", 2, 0),
    # tensor parallelism with sequence parallelism, fp16 (the overflow verdict: one sync)
    "tp2-sp-fp16": (dict(tp=2, micro=1, sp=True), "fp16", 1, 1),
    # plain data parallelism (DDP), fp32, 2 micro-batches per replica
    "dp2-zero0-ddp-fp32": (dict(dp=2, micro=2), "fp32", 1, 0),
    # pipeline (tied embedding and head on two stages), fp32, 4 micro-batches
    "pp2-fp32": (dict(pp=2, micro=2), "fp32", 1, 0),
}
# plans whose step and clipping the host never waits in: DDP's all-reduces run in its reducer, the
# global loss's all-reduce is waited for when the loss is read (runtime/pending.py). (On gloo, FSDP2's
# all-reduces, the tied copies' and the pipelined clipping norm's block the host; on NCCL they are enqueued.)
UNBLOCKED = {"dp2-zero0-ddp-fp32"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_train_step_has_no_host_sync(case: str, tmp_path: Any) -> None:
    layout, precision, calls, bound = CASES[case]
    model = "tiny-gpt" if precision == "fp32" else "tiny-llama-bf16"
    plan = make_plan(model=model, **layout)
    path = write_plan(str(tmp_path), plan, precision)
    for rank, counts in enumerate(run(sync_count_worker, plan.num_devices, path, calls)):
        for step, syncs in enumerate(counts[1:], start=1):  # step 0 also checks the pipeline chain
            blocking = syncs.pop("blocking all_reduce")
            assert sum(syncs.values()) <= bound * calls, f"{case} rank {rank} step {step}: {syncs}"
            if case in UNBLOCKED:
                assert blocking == 0, f"{case} rank {rank} step {step}: {blocking} blocking all-reduce(s)"


# --- the optimizer ---------------------------------------------------------------------------------
def _params(n: int, device: str = "cpu") -> list[Any]:
    import torch

    return [torch.nn.Parameter(torch.randn(5, 3, device=device)) for _ in range(n)]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_optimizer_follows_the_runtime_table(device: str) -> None:
    """make_optimizer builds what OPTIMIZER_IMPLEMENTATION says for the device
    (CUDA faked with FakeTensorMode: no GPU needed), and records it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hetplan.plan.runtime_facts import OPTIMIZER_IMPLEMENTATION
    from hetplan.runtime.reference import make_optimizer

    with FakeTensorMode():
        for name in ("adamw", "sgd"):
            opt = make_optimizer(_params(2, device), name)
            want = OPTIMIZER_IMPLEMENTATION[device]
            assert opt.hetplan_implementation == want
            assert (bool(opt.defaults["fused"]), bool(opt.defaults["foreach"])) == (want == "fused", want == "foreach")


def test_optimizer_falls_back_where_torch_has_no_kernel() -> None:
    """Fused SGD has no DTensor rule (foreach instead); DTensors beside plain
    tensors fit no grouped kernel (the for-loop)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from hetplan.runtime.launch import free_port
    from hetplan.runtime.reference import optimizer_implementation

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        dt = torch.nn.Parameter(distribute_tensor(torch.randn(4), mesh, [Replicate()]))
        assert optimizer_implementation([dt], "sgd", "fused") == "foreach"
        assert optimizer_implementation([dt], "adamw", "fused") == "fused"
        assert optimizer_implementation([dt, *_params(1)], "adamw", "fused") == "for-loop"
        assert optimizer_implementation(_params(1), "adamw", "fused") == "fused"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["adamw", "sgd"])
@pytest.mark.parametrize("implementation", ["foreach", "fused"])
def test_optimizer_launches_do_not_grow_with_parameters(name: str, implementation: str) -> None:
    """optimizer.step() launches the same kernels for 4 and for 32 parameters
    (the for-loop form launches some per parameter: the control)."""
    from hetplan.runtime.reference import make_optimizer
    from speed_helpers import OpCounter

    def launches(n: int, how: str) -> int:
        params = _params(n)
        opt = make_optimizer(params, name, implementation=how)
        for p in params:
            p.grad = p.detach() * 0.1
        opt.step()  # the first step creates the states
        with OpCounter() as counter:
            opt.step()
        return counter.launches()

    assert launches(4, implementation) == launches(32, implementation)
    assert launches(4, "for-loop") < launches(32, "for-loop")


# --- weights tied across stages --------------------------------------------------------------------
def test_tied_sync_collectives_do_not_grow_with_tied_weights(tmp_path: Any) -> None:
    """The tied copies' gradients are summed in one all-reduce per tie group,
    not one per tied weight (each rank's copy ``i`` ends as the sum of both
    ranks' gradients: (1 + i) + (2 + i))."""
    path = write_plan_file(tmp_path, make_plan(pp=2))
    for rank, result in enumerate(run(tied_sync_worker, 2, path, (1, 3))):
        for pairs, got in result.items():
            assert got["grads"] == [[[3.0 + 2 * i] * 2] * 3 for i in range(pairs)], (rank, pairs, got)
        assert result[1]["calls"] == result[3]["calls"] == 1, (rank, result)
