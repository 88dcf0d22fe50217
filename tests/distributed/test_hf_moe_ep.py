"""Expert parallelism for HF transformers' MoE blocks (Mixtral, Qwen2-MoE, Qwen3-MoE).

Each run trains a tiny config (tests/distributed/hf_pp_helpers.py) for 2 steps
of 2 micro-batches with a padded attention mask and must equal the
single-process run of the model's own forward (loss and every parameter
within 1e-5, fp32). Each EP rank must hold only its ``E / ep`` experts (the
fused ``gate_up_proj`` [E, 2F, H] split along E), under the model's own
parameter names. Plans of one world size share one process group
(``hf_pp_helpers.several_workers``): one process start for several checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

import hf_pp_helpers as h
from rt_helpers import run, write_plan

from hetplan.cli import main
from hetplan.errors import HetplanError
from hetplan.runtime.reference import compare

TOL = 1e-5
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
EXPERTS, WIDTH, HIDDEN = 4, 32, 64  # the tiny configs' experts: gate_up_proj [4, 2 * 32, 64]


def _assert_matches(result: dict, name: str) -> None:
    ref = h.reference(name)
    cmp = compare(result["losses"], ref[0], result["state"], ref[1])
    assert not cmp["missing"], cmp["missing"]
    assert cmp["loss_rel_diff"] <= TOL and cmp["param_rel_diff"] <= TOL, cmp


def _expert_shards(result: dict) -> dict[str, tuple[list[int], list[int]]]:
    """(global shape, local shape) of this rank's fused expert weights, by name."""
    return {k: (list(v[0]), list(v[1])) for k, v in result["parameters"].items()
            if k.endswith(("experts.gate_up_proj", "experts.down_proj"))}


def _assert_experts_held(result: dict, layers: list[str], experts_per_rank: int) -> None:
    shards = _expert_shards(result)
    assert sorted(shards) == sorted(f"{layer}.mlp.experts.{w}" for layer in layers
                                    for w in ("gate_up_proj", "down_proj")), sorted(shards)
    for name, (glob, local) in shards.items():
        full = [EXPERTS, 2 * WIDTH, HIDDEN] if name.endswith("gate_up_proj") else [EXPERTS, HIDDEN, WIDTH]
        assert glob == full and local == [experts_per_rank, *full[1:]], (name, glob, local)


def _jobs(tmp_path, cases: list[tuple[str, dict]]) -> list[tuple[str, str]]:
    jobs = []
    for i, (name, degrees) in enumerate(cases):
        (tmp_path / str(i)).mkdir()
        jobs.append((write_plan(tmp_path / str(i), h.plan(name, **degrees)), name))
    return jobs


BOTH_LAYERS = ["model.layers.0", "model.layers.1"]


def test_mixtral_qwen2_moe_and_qwen3_moe_dp2_ep2_equal_their_own_forward(tmp_path) -> None:
    """dp2 ep2 (each rank 2 of the 4 experts): Mixtral with ZeRO-0, Qwen2-MoE
    (gated shared expert, data-parallel like the router; top-k weights not
    renormalised) with ZeRO-3 on the dense weights (the experts are synced by
    the runtime: no other rank holds them), Qwen3-MoE (renormalised) with ZeRO-1.
    Mixtral's checkpoint, saved from the expert shards, loads into one process."""
    cases = [("mixtral", dict(pp=1, dp=2, ep=2, micro=2)), ("qwen2_moe", dict(pp=1, dp=2, ep=2, micro=2, zero=3)),
             ("qwen3_moe", dict(pp=1, dp=2, ep=2, micro=2, zero=1))]
    checkpoint = str(tmp_path / "ckpt")
    jobs = _jobs(tmp_path, cases)
    jobs[0] = (*jobs[0], 2, False, checkpoint)
    results = run(h.several_workers, 2, jobs)
    for i, (name, _) in enumerate(cases):
        _assert_matches(results[0][i], name)
        for rank in results:
            _assert_experts_held(rank[i], BOTH_LAYERS, EXPERTS // 2)
    loaded = _load_in_one_process(tmp_path, "mixtral", checkpoint)
    assert sorted(loaded) == sorted(results[0][0]["state"])
    assert all(loaded[k].equal(v) for k, v in results[0][0]["state"].items())


def _load_in_one_process(tmp_path, name: str, checkpoint: str) -> dict:
    from hetplan.runtime.context import init

    ctx = init(write_plan(tmp_path, h.plan(name, pp=1), "one.json"), h.spec(name))
    model = ctx.parallelize(lambda: h.build(name), meta_init=False)
    ctx.load(checkpoint, model)
    state = ctx.full_state_dict(model)
    ctx.close()
    return state


def test_mixtral_pp2_dp2_ep2_and_qwen2_moe_dp4_ep2_zero3_equal_their_own_forward(tmp_path) -> None:
    """Four processes: Mixtral in two pipeline stages of dp2 ep2 (each stage's
    ranks hold 2 of its layer's 4 experts); Qwen2-MoE dp4 ep2 under ZeRO-3,
    whose experts FSDP also shards over their two expert-data-parallel copies
    (``parallelize.apply_expert_zero``): 1 expert's weights per rank."""
    cases = [("mixtral", dict(pp=2, dp=2, ep=2, micro=2)), ("qwen2_moe", dict(pp=1, dp=4, ep=2, micro=4, zero=3))]
    results = run(h.several_workers, 4, _jobs(tmp_path, cases))
    _assert_matches(results[0][0], "mixtral")
    for rank, result in enumerate(results):  # ranks 0-1: stage 0 (layer 0), ranks 2-3: stage 1 (layer 1)
        _assert_experts_held(result[0], [BOTH_LAYERS[rank // 2]], EXPERTS // 2)
    _assert_matches(results[0][1], "qwen2_moe")
    for result in results:
        _assert_experts_held(result[1], BOTH_LAYERS, EXPERTS // 4)


# --- refused before any process starts, with the true reason -------------------------------------------
def _preflight(name: str, **degrees) -> None:
    """The checks ``hetplan train`` runs before starting processes, on the meta model."""
    import torch

    from hetplan.runtime.preflight import preflight
    from hetplan.plan.layout import PlanLayout

    spec, plan = h.spec(name), h.plan(name, **degrees)
    with torch.device("meta"):
        model = h.build(name)
    preflight(PlanLayout.from_plan(plan, [layer.name for layer in spec.layers]), spec, model)


def test_mixtral_tp2_is_refused_for_its_packed_experts_and_its_tp_plan_leaves_them_to_ep() -> None:
    """Expert TP would split gate_up_proj into a gate piece and an up piece per
    TP rank, which no checkpoint can record: refused in one line, not replicated,
    and not refused for a style name (the HF plan's expert entries are EP's)."""
    import torch

    from hetplan.runtime.tp import hf_tp_plan

    with pytest.raises(HetplanError) as err:
        _preflight("mixtral", pp=1, tp=2)
    assert str(err.value) == (
        "tp=2 would split the experts of layer 'model.layers.0' (MixtralExperts) by width, but their packed "
        "gate_up_proj gives each TP rank two pieces of the tensor, which checkpoints cannot record; use tp=1 for "
        "that layer's stage (split its experts with ep instead)")
    with torch.device("meta"):
        plan = hf_tp_plan(h.build("mixtral"))
    assert "model.layers.*.self_attn.q_proj" in plan and not [k for k in plan if ".experts" in k], sorted(plan)


def test_ep_for_hf_experts_hetplan_cannot_split_names_them() -> None:
    """DeepSeek-V3's experts are MoE layers (not 'no mixture-of-experts layers'),
    but hetplan's EP does not cover them: the refusal says so."""
    with pytest.raises(HetplanError) as err:
        _preflight("deepseek_v3", pp=1, dp=2, ep=2)
    assert str(err.value) == (
        "hetplan's expert parallelism splits its own MoE and HF's MixtralExperts, Qwen2MoeExperts, "
        "Qwen3MoeExperts, not the DeepseekV3Experts of 'model.layers.1.mlp.experts'; use a plan with ep=1")


# --- from the command line: the plan estimate costs is the plan train runs ------------------------------
@pytest.mark.slow
def test_estimate_mixtral_ep2_then_train_verify(tmp_path) -> None:
    h.config("mixtral").save_pretrained(tmp_path)
    plan = str(tmp_path / "p.json")
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1"}

    def hetplan(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "hetplan.cli", *args], capture_output=True, text=True,
                              env=env, timeout=300, cwd=ROOT)

    # in this process, which has imported transformers already: a process start less
    assert main(["estimate", "--model", str(tmp_path / "config.json"), "--seq-len", str(h.SEQ), "--precision", "fp32",
                 "--cluster", "local-cpu-2", "--global-batch", "8", "--tp", "1", "--pp", "1", "--dp", "2", "--ep", "2",
                 "--micro-batch", "2", "--json", plan]) == 0
    out = tmp_path / "out"
    proc = hetplan("train", "--plan", plan, "--steps", "2", "--verify", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ep=2" in proc.stdout and "verify: OK" in proc.stdout, proc.stdout
    glob, local, _ = json.loads((out / "summary.json").read_text())["parameters"][
        "model.layers.0.mlp.experts.gate_up_proj"]
    assert glob == [EXPERTS, 2 * WIDTH, HIDDEN] and local == [EXPERTS // 2, 2 * WIDTH, HIDDEN], (glob, local)


def test_expert_outputs_in_16_bits_come_back_through_the_dispatch() -> None:
    """Under autocast the experts' outputs are bf16 while the token rows are
    fp32: they travel back in their own dtype and are added in the rows' one,
    exactly as the same experts run locally."""
    from rt_helpers import ep_dispatch_worker

    for result in run(ep_dispatch_worker, 2):
        assert result == {"dtype": "torch.float32", "out": 0.0, "grad": 0.0}, result
