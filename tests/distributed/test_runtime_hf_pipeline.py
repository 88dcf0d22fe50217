"""HF models and a user's keyword-input model under pipelining, with masks (issue 12, items 1-2).

Every run passes a padded attention mask through ``train_step(..., inputs=)``
and must equal the single-process run of the model's own forward on whole
batches (loss and every parameter within 1e-5, fp32, SGD with momentum).
Tiny configs built from config objects (tests/distributed/hf_pp_helpers.py),
world size <= 4.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

import hf_pp_helpers as h
from rt_helpers import make_plan, run, write_plan

from hetplan.runtime.reference import compare

TOL = 1e-5


def _assert_matches(result: dict, ref: tuple[list[float], dict]) -> dict:
    cmp = compare(result["losses"], ref[0], result["state"], ref[1])
    assert not cmp["missing"], cmp["missing"]
    assert cmp["loss_rel_diff"] <= TOL and cmp["param_rel_diff"] <= TOL, cmp
    return cmp


CASES = {  # name: (family, pp, dp, tp)
    "mistral-pp2": ("mistral", 2, 1, 1),
    "llama-pp2xtp2": ("llama", 2, 1, 2),
    "llama-pp2xdp2": ("llama", 2, 2, 1),
    "bert-pp2": ("bert", 2, 1, 1),
    "mixtral-pp2": ("mixtral", 2, 1, 1),
    "qwen2-pp2": ("qwen2", 2, 1, 1),  # one full-attention, one sliding-window layer
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_model_in_pipeline_stages_with_a_mask_equals_its_own_forward(case: str, tmp_path) -> None:
    family, pp, dp, tp = CASES[case]
    plan = h.plan(family, pp, dp, tp, micro=2 * dp)
    results = run(h.worker, plan.num_devices, write_plan(tmp_path, plan), family)
    _assert_matches(results[0], h.reference(family))
    unmasked = h.reference(family, mask=False)  # the mask mattered: without it the run is far off
    assert compare(results[0]["losses"], unmasked[0], results[0]["state"], unmasked[1])["param_rel_diff"] > 10 * TOL
    if tp > 1:  # the attention projections were really split
        for r in results:
            shapes = [v for k, v in r["parameters"].items() if k.endswith("q_proj.weight")]
            assert shapes and all(local[0] * tp == glob[0] for glob, local, _ in shapes), shapes


def _jobs(tmp_path, cases: list[tuple[str, int, int, int]]) -> list[tuple[str, str]]:
    """(plan path, model) per (model, cut, dp, tp) case: two stages split before layer ``cut`` (0: even)."""
    jobs = []
    for i, (name, cut, dp, tp) in enumerate(cases):
        (tmp_path / str(i)).mkdir()
        jobs.append((write_plan(tmp_path / str(i), h.plan(name, 2, dp, tp, micro=2 * dp, cut=cut)), name))
    return jobs


def _held_layers(result: dict, name: str) -> set[str]:
    """The plan's untied layers whose modules hold this rank's parameters (a rank
    lists a tied tensor once, under one of its names)."""
    spec = h.spec(name)
    owners = {path: layer.name for layer in spec.layers if not layer.tied_group
              for path in spec.meta["layer_modules"][layer.name]}
    return {owners[p] for fqn in result["parameters"] for p in owners if fqn.startswith(p + ".")}


T5_CUTS = {2: "inside the encoder (hidden state + position bias)", 3: "between encoder and decoder",
           5: "inside the decoder (encoder output + decoder state + position bias)"}


def test_t5_split_three_ways_and_vit_at_pp2_equal_their_own_forward(tmp_path) -> None:
    """T5 (padded encoder and decoder masks, shared embedding tied three ways) split
    inside the encoder, between the stacks and inside the decoder, and ViT at pp2:
    four plans trained one after another in one pair of processes."""
    cases = [("t5", cut, 1, 1) for cut in T5_CUTS] + [("vit", 0, 1, 1)]
    results = run(h.several_workers, 2, _jobs(tmp_path, cases))
    t5_ref, t5_unmasked = h.reference("t5"), h.reference("t5", mask=False)
    for (name, cut, _, _), first, second in zip(cases, results[0], results[1]):
        _assert_matches(first, t5_ref if name == "t5" else h.reference("vit"))
        layers = h.spec(name).layers
        cut = cut or len(layers) // 2
        untied = [{layer.name for layer in part if not layer.tied_group} for part in (layers[:cut], layers[cut:])]
        assert [_held_layers(first, name), _held_layers(second, name)] == untied
        if name == "t5":  # the masks reached the stages that needed them
            assert compare(first["losses"], t5_unmasked[0], first["state"], t5_unmasked[1])["param_rel_diff"] > 10 * TOL


def test_t5_and_vit_under_pp2xdp2_and_t5_in_a_metis_plan(tmp_path) -> None:
    """pp2 x dp2 (T5 split after the decoder's embedding: encoder output and decoder
    state cross), ViT at pp2 x dp2, and T5 in a Metis-style plan (3:1 rows, then
    tp2: the decoder and its tied embedding and LM head split by hetplan.runtime.hf_tp)
    split between the stacks (one tensor). ViT and the others under TP: test_hf_tp.py."""
    cases = [("t5", 4, 2, 1), ("vit", 0, 2, 1)]
    jobs = _jobs(tmp_path, cases)
    (tmp_path / "hetero").mkdir()
    jobs.append((write_plan(tmp_path / "hetero", h.hetero_plan("t5", cut=3)), "t5"))
    results = run(h.several_workers, 4, jobs)
    for (name, _, _, _), result in zip(cases, results[0]):
        _assert_matches(result, h.reference(name))
    _assert_matches(results[0][-1], h.reference("t5"))
    assert not any("no TP plan registered" in note for r in results for note in r[-1]["notes"])


def test_gpt2_weight_tied_across_stages_accumulates_over_two_train_steps(tmp_path) -> None:
    """GPT-2 ties wte and lm_head, which sit on different stages: two train_step
    calls before opt.step() must equal two backward passes in one process."""
    plan = h.plan("gpt2", 2, 1, 1)
    results = run(h.worker, 2, write_plan(tmp_path, plan), "gpt2", 2, True)
    _assert_matches(results[0], h.reference("gpt2", accumulate=True))
    assert "lm_head.weight" in results[0]["state"] and "transformer.wte.weight" in results[0]["state"]


def test_hf_model_in_a_metis_plan_with_uneven_split_and_a_mask(tmp_path) -> None:
    """Stages of different (dp, tp), replicas taking 3 and 1 rows: each gets its own rows of the mask."""
    plan = h.hetero_plan("llama")
    results = run(h.worker, 4, write_plan(tmp_path, plan), "llama")
    _assert_matches(results[0], h.reference("llama"))


def test_hf_one_stage_dp_zero3_tp_with_a_mask(tmp_path) -> None:
    """pp=1: the model's own forward gets each micro-batch's mask (DP x TP, ZeRO-3)."""
    from dataclasses import replace

    plan = h.plan("llama", 1, 2, 2, micro=4)
    stage = plan.stages[0]
    plan = replace(plan, stages=(replace(stage, strategies=tuple(replace(s, zero=3) for s in stage.strategies)),))
    results = run(h.worker, 4, write_plan(tmp_path, plan), "llama")
    _assert_matches(results[0], h.reference("llama"))


@pytest.mark.parametrize("kwargs", [dict(pp=2, dp=2, micro=2), dict(pp=2, tp=2, micro=2)],
                         ids=["pp2xdp2", "pp2xtp2"])
def test_users_model_with_a_keyword_input_trains_under_pipelining(kwargs, tmp_path) -> None:
    """Each block takes the model's ``mask`` unchanged: every stage gets it from train_step."""
    plan = make_plan(**kwargs)
    results = run(h.masked_worker, plan.num_devices, write_plan(tmp_path, plan))
    _assert_matches(results[0], h.masked_reference())
    assert abs(results[0]["losses"][0] - h.masked_reference(mask=False)[0][0]) > 1e-3


def test_hetplan_train_verify_runs_a_pipelined_gpt2_config(tmp_path, capsys) -> None:
    """`hetplan estimate --model config.json --pp 2` then `hetplan train --verify`:
    synthetic data with a padded attention mask, against the single-process run."""
    from hetplan.cli import main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(h.config("gpt2").to_dict()))
    plan = str(tmp_path / "p.json")
    assert main(["estimate", "--model", str(cfg), "--cluster", "local-cpu-2", "--pp", "2", "--tp", "1", "--dp", "1",
                 "--micro-batch", "2", "--global-batch", "8", "--precision", "fp32", "--json", plan]) == 0
    assert "would refuse" not in capsys.readouterr().out
    code = main(["train", "--plan", plan, "--model", str(cfg), "--steps", "2", "--verify"])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    assert "pp=2" in out.out and "verify: OK" in out.out


def test_hetplan_train_verify_runs_a_pipelined_t5_config(tmp_path, capsys) -> None:
    """Encoder-decoder synthetic data (labels, decoder inputs shifted right, both
    masks padded) through `hetplan train --verify` at pp2."""
    from hetplan.cli import main

    cfg = tmp_path / "t5.json"
    cfg.write_text(json.dumps({"model_type": "t5", "vocab_size": 128, "d_model": 64, "d_kv": 16, "d_ff": 128,
                               "num_layers": 2, "num_heads": 4, "dropout_rate": 0.0}))
    plan = str(tmp_path / "p.json")
    assert main(["estimate", "--model", str(cfg), "--cluster", "local-cpu-2", "--pp", "2", "--tp", "1", "--dp", "1",
                 "--micro-batch", "2", "--global-batch", "8", "--seq-len", "16", "--precision", "fp32",
                 "--json", plan]) == 0
    assert "would refuse" not in capsys.readouterr().out
    code = main(["train", "--plan", plan, "--steps", "2", "--verify"])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    assert "pp=2" in out.out and "verify: OK" in out.out


def test_hetplan_train_verify_runs_a_vit_classifier_config(tmp_path, capsys) -> None:
    """Images and class labels (hetplan.runtime.reference.image_batch), one process."""
    from hetplan.cli import main

    cfg = tmp_path / "vit.json"
    cfg.write_text(json.dumps(h.config("vit").to_dict()))
    plan = str(tmp_path / "p.json")
    assert main(["estimate", "--model", str(cfg), "--cluster", "local-cpu-1", "--pp", "1", "--tp", "1", "--dp", "1",
                 "--micro-batch", "2", "--global-batch", "4", "--precision", "fp32", "--json", plan]) == 0
    capsys.readouterr()
    code = main(["train", "--plan", plan, "--steps", "2", "--verify"])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    assert "verify: OK" in out.out


def test_hetplan_train_refuses_t5_on_three_stages_before_starting_processes(tmp_path, capsys) -> None:
    """pp4 puts T5's shared embedding on three stages: refused with one line before any process."""
    from hetplan.cli import main

    cfg = tmp_path / "t5.json"
    cfg.write_text(json.dumps({"model_type": "t5", "vocab_size": 128, "d_model": 64, "d_kv": 16, "d_ff": 128,
                               "num_layers": 2, "num_heads": 4}))
    plan = str(tmp_path / "p.json")
    assert main(["estimate", "--model", str(cfg), "--cluster", "local-cpu-4", "--pp", "4", "--tp", "1", "--dp", "1",
                 "--micro-batch", "1", "--global-batch", "8", "--seq-len", "16", "--precision", "fp32",
                 "--json", plan, "--target", "any"]) == 0  # costed for no particular runtime: hetplan's refuses it
    assert "hetplan.runtime would refuse this plan's 4 pipeline stages" in capsys.readouterr().out
    assert main(["train", "--plan", plan, "--steps", "1"]) == 2
    out = capsys.readouterr()
    line = out.err.strip().splitlines()[-1]
    assert line.startswith("hetplan: error: layers encoder.embed_tokens, decoder.embed_tokens, lm_head share one "
                           "weight and this plan puts them on 3 pipeline stages"), line
    assert "hetplan train:" not in out.out  # refused before the header, so before any process
