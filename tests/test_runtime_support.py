"""One truth for what runs: the planners, ``estimate`` and the runtime read the
same facts about what hetplan's runtime can run (hetplan.runtime.support).

A plan is costed as it will run or refused at plan time in one line: plans of
every planner are ones the runtime runs (the default target), ``estimate``
refuses one it would refuse, and a layer the runtime runs whole on each TP
rank (no TP plan) is costed whole.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from hetplan.cli import main
from hetplan.cluster.io import load_cluster
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError
from hetplan.model.load import load_model
from hetplan.plan.spec import LayerStrategy, Plan
from hetplan.plan.file import read_plan_file
from hetplan.plan.layout import PlanLayout
from hetplan.plan.support import runtime_refusal
from hetplan.plan.support import support_of
from hetplan.search.baselines.uniform import uniform_plan

ADAPTER = "tests.support_models:gpt_with_adapter"
TWO_INPUTS = "tests.smp_models:encdec_two_inputs"  # its forward is no chain: the runtime cannot pipeline it


def _plan_json(tmp_path, *args: str) -> list[Plan]:
    out = tmp_path / "p.json"
    assert main(["plan", *args, "--json", str(out), "--quiet"]) == 0
    return list(read_plan_file(out).plans)


@pytest.mark.parametrize("planner, model, cluster, batch", [
    ("auto", "llama3-8b", "64xH100", "512"),       # auto mixed tp stages with sequence parallelism
    ("galvatron", "gpt2-amp", "amp-heterogeneous", "32"),  # per-layer tp inside a stage
    ("galvatron-bmw", "gpt3-1.3b", "metis-t4-v100-16", "64"),
    ("metis", "gpt3-1.3b", "metis-t4-v100-16", "64"),
    ("auto", "examples/configs/llama-tiny.json", "16xA100-80GB", "64"),
])
def test_every_plan_made_is_one_the_runtime_runs(planner: str, model: str, cluster: str, batch: str,
                                                 tmp_path) -> None:
    plans = _plan_json(tmp_path, "--planner", planner, "--model", model, "--cluster", cluster,
                       "--global-batch", batch, "--top", "5")
    spec = load_model(model)
    assert plans
    for plan in plans:
        assert runtime_refusal(plan, spec) == "", plan.describe()


def test_target_any_keeps_the_papers_plans_the_runtime_cannot_run(tmp_path) -> None:
    """Galvatron's per-layer tp is what the runtime refuses; --target any shows it was searched."""
    spec = load_model("gpt2-amp")
    plans = _plan_json(tmp_path, "--planner", "galvatron", "--model", "gpt2-amp", "--cluster",
                       "amp-heterogeneous", "--global-batch", "32", "--top", "5", "--target", "any")
    refused = [runtime_refusal(p, spec) for p in plans]
    assert any("runs every layer of a stage at the stage's tp" in why for why in refused), refused


def test_per_layer_tp_is_refused_by_the_runtime() -> None:
    w = Workload(load_model("tiny-gpt"), load_cluster("local-cpu-2"), 8)
    plan = uniform_plan(w, 1, 2, 1, 2)
    stage = plan.stages[0]
    odd = plan.with_changes(stages=(stage.__class__(**{**stage.__dict__, "strategies": (
        LayerStrategy(tp=1),) + stage.strategies[1:]}),))
    with pytest.raises(HetplanError, match="runs every layer of a stage at the stage's tp"):
        PlanLayout.from_plan(odd, [layer.name for layer in w.model.layers])


def test_estimate_refuses_pipelining_a_model_the_runtime_cannot_split(capsys) -> None:
    args = ["estimate", "--model", TWO_INPUTS, "--cluster", "local-cpu-2", "--global-batch", "4",
            "--tp", "1", "--pp", "2", "--dp", "1", "--micro-batch", "1"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hetplan: error: hetplan's runtime cannot run this plan as costed:") and "\n" not in err
    assert "--target" in err
    assert main([*args, "--target", "any"]) == 0  # the cost model still costs it, for no particular runtime


def test_hf_model_without_context_parallelism_is_refused_with_cp() -> None:
    spec = load_model("examples/configs/llama-tiny.json", seq_len=64)
    w = Workload(spec, load_cluster("local-cpu-4"), 8)
    plan = uniform_plan(w, 2, 1, 1, 2, cp=2)
    assert "does not declare context-parallel support" in runtime_refusal(plan, spec)
    assert runtime_refusal(uniform_plan(w, 4, 1, 1, 2), spec) == ""


def test_a_layer_without_tp_plan_is_costed_whole_on_every_tp_rank() -> None:
    """The adapter has no TP plan: at tp=2 every rank holds all of it and does all
    of its work; the blocks around it are split. With a TP plan registered for
    it the same model is costed split."""
    whole, split = load_model(ADAPTER), load_model("tests.support_models:gpt_with_adapter_tp")
    assert [layer.name for layer in whole.layers if layer.tp_replicated][0] == "adapter"
    assert not next(layer for layer in split.layers if layer.name == "adapter").tp_replicated
    adapter = [layer.name for layer in whole.layers].index("adapter")
    held = {}
    for name, spec in (("whole", whole), ("split", split)):
        kernel = CostModel(Workload(spec, load_cluster("local-cpu-2"), 4)).kernel
        held[name] = kernel.arrays.params_per_device(2)[adapter]
        time_tp1 = kernel.arrays.tp_share(1)[adapter]
        assert time_tp1 == 1.0
    assert held["whole"] == whole.layers[adapter].params
    assert held["split"] < split.layers[adapter].params


def test_support_facts_survive_the_plan_file(tmp_path) -> None:
    out = tmp_path / "p.json"
    assert main(["estimate", "--model", ADAPTER, "--cluster", "local-cpu-2", "--global-batch", "4", "--tp", "2",
                 "--pp", "1", "--dp", "1", "--micro-batch", "2", "--json", str(out)]) == 0
    spec = read_plan_file(out).model
    assert spec.runtime == load_model(ADAPTER).runtime
    assert [layer.tp_replicated for layer in spec.layers] == [layer.tp_replicated for layer in load_model(ADAPTER).layers]
    data = json.loads(out.read_text())
    assert data["model_spec"]["runtime"]["context_parallel"]


def test_presets_are_the_built_in_model_and_others_are_for_the_tools() -> None:
    assert support_of(load_model("gpt3-1.3b")).build == ""
    assert support_of(load_model("tiny-moe")).sequence_parallel  # its MoE blocks run without SP
    why = support_of(load_model("bert-huge-32")).build
    assert "built-in runtime model" in why
