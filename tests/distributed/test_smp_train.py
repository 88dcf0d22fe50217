"""Plans of the ``smp`` planner train their models and match the single-process run (gloo, CPU).

Three module trees (tests/smp_models.py): hetplan's GPT (tied embedding and
head), a CNN with residual blocks and a transformer encoder-decoder, each
partitioned by SageMaker's tree algorithm into 2 pipeline stages x dp 2; the
encoder-decoder also into 4 stages. The same encoder-decoder called as
``forward(src, tgt)`` is no chain the runtime can pipeline: the planner keeps
it in one stage (dp 4).
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

torch = pytest.importorskip("torch")

import smp_workers
from rt_helpers import run

from hetplan.cluster.io import load_cluster
from hetplan.plan.workload import Workload
from hetplan.model.load import load_model
from hetplan.runtime.reference import compare
from hetplan.search.smp import SMPPlanner

TOL = 1e-5


def smp_plan(name: str, pp: int | None) -> tuple:
    spec = load_model(f"smp_models:{name}")
    workload = Workload(spec, load_cluster("local-cpu-4"), smp_workers.GBS)
    return SMPPlanner(pp=pp).plan(workload, top_k=1)[0].plan, spec


def check_against_reference(name: str, pp: int | None) -> object:
    plan, spec = smp_plan(name, pp)
    results = run(smp_workers.train_worker, 4, plan, spec, name, timeout_s=300)
    ref_losses, ref_state = smp_workers.reference(name)
    cmp = compare(results[0]["losses"], ref_losses, results[0]["state"], ref_state)
    assert not cmp["missing"], cmp["missing"]
    assert cmp["loss_rel_diff"] <= TOL, (results[0]["losses"], ref_losses, cmp)
    assert cmp["param_rel_diff"] <= TOL, cmp
    return plan


@pytest.mark.parametrize("name", ["gpt", "resnet", "encdec"])
def test_two_stage_plan_matches_reference(name: str) -> None:
    plan = check_against_reference(name, 2)
    assert len(plan.stages) == 2 and all(s.dp == 2 and s.tp == 1 for s in plan.stages)


def test_encoder_decoder_four_stages_cut_between_encoder_and_decoder() -> None:
    plan = check_against_reference("encdec", 4)
    spec = load_model("smp_models:encdec")
    names = [[spec.layers[i].name for i in s.layers] for s in plan.stages]
    assert len(names) == 4
    assert any(n[-1].startswith("encoder") and nxt[0].startswith("decoder") for n, nxt in zip(names, names[1:])), names


def test_two_input_encoder_decoder_stays_in_one_stage() -> None:
    plan = check_against_reference("encdec_two_inputs", None)
    assert len(plan.stages) == 1 and plan.stages[0].dp == 4
    assert any("cannot pipeline" in note for note in plan.notes)
