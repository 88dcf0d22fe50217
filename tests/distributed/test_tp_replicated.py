"""A layer without a TP plan runs whole on every TP rank, and is costed so.

``tests.support_models:gpt_with_adapter`` puts a plain adapter (no TP plan)
between hetplan's GPT blocks (TP plans built in). Under tp=2 each rank holds
exactly the parameters the cost model charges it -- the blocks halved, the
adapter whole (``LayerSpec.tp_replicated``) -- and the run equals one process.
"""

from __future__ import annotations


from hetplan.plan.spec import Plan, uniform_stage
from rt_helpers import run, write_plan

MODEL = "tests.support_models:gpt_with_adapter"


def adapter_worker(plan_path: str) -> dict:
    from hetplan.model.load import load_model
    from hetplan.runtime.trainer import TrainConfig, train

    return train(TrainConfig(plan_path, steps=2, export=True, quiet=True), load_model(MODEL))


def test_layer_without_tp_plan_holds_what_it_is_charged(tmp_path) -> None:
    import torch

    from hetplan.cluster.io import load_cluster
    from hetplan.cost.model import CostModel
    from hetplan.plan.workload import Workload
    from hetplan.model.load import load_model
    from hetplan.runtime.build import model_build
    from hetplan.runtime.reference import build_reference, compare, make_optimizer, train_reference, training_batch

    spec = load_model(MODEL)
    assert [layer.name for layer in spec.layers if layer.tp_replicated] == ["adapter", "head.norm", "head.proj"]
    plan = Plan(spec.name, "local-cpu-2", 4, 2, 2, "1f1b",
                (uniform_stage(range(spec.num_layers), [0, 1], 1, 2, 2),), planner="test")
    results = run(adapter_worker, 2, write_plan(tmp_path, plan))
    charged = CostModel(Workload(spec, load_cluster("local-cpu-2"), 4)).resident_state_bytes(plan)
    for rank, result in enumerate(results):
        held = sum(torch.Size(local).numel() for _, local, _ in result["parameters"].values())
        assert held * 4 == charged[rank]["params"], (rank, held, charged[rank])
    adapter = {k: v for k, v in results[0]["parameters"].items() if k.startswith("adapter.")}
    assert adapter and all(glob == local for glob, local, _ in adapter.values())  # whole on the rank
    how = model_build(spec)
    ref = build_reference(how.build)
    batches = [training_batch(spec, how, 4, s) for s in range(2)]
    ref_losses = train_reference(ref, batches, how.loss, make_optimizer(ref.parameters()), clip=1.0)
    cmp = compare(results[0]["losses"], ref_losses, results[0]["state"], ref.state_dict())
    assert cmp["loss_rel_diff"] <= 1e-5 and cmp["param_rel_diff"] <= 1e-5, cmp
    assert any("no TP plan registered for adapter" in note for note in results[0]["notes"])
