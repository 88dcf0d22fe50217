"""Tensor parallelism for HF GPT-2, BERT, T5 and ViT (hetplan.runtime.hf_tp).

Their configs carry no ``base_model_tp_plan``; hetplan's plans split them as
Megatron-LM does. Under tp2 and pp2 x tp2 (2 micro-batches, padded masks, fp32)
each family must train as the single-process run of the model's own forward
(loss and every parameter within 1e-5), with its attention, MLP and embedding
weights really split in half (DTensor shards, no "replicated" note; a vocabulary
of 129 rows into 65 + 64, as GPT-2's 50257 must be). GPT-2's
fused ``c_attn`` is split head group by head group (``_StridedShard``), and a
checkpoint of it reads back whole in one process. Degrees the plans cannot
split by, and sequence parallelism, are refused before anything starts.
"""

from __future__ import annotations

import functools
import re

import pytest

pytest.importorskip("transformers")

import hf_pp_helpers as h
from rt_helpers import run, write_plan

from hetplan.runtime.reference import compare

TOL = 1e-5
FAMILIES = ("gpt2", "bert", "t5", "vit")
MICRO = 4  # 2 micro-batches of the global batch of 8
reference = functools.lru_cache(maxsize=None)(h.reference)  # each family's single-process run, once

# parameter name ending -> the dim TP splits (column-parallel weights [out, in] on 0, row-parallel on 1;
# GPT-2's Conv1D weights are [in, out]; embeddings by vocabulary rows; T5's position bias by heads)
SPLIT = {
    "gpt2": {"transformer.wte.weight": 0, "attn.c_attn.weight": 1, "attn.c_proj.weight": 0,
             "mlp.c_fc.weight": 1, "mlp.c_proj.weight": 0},
    "bert": {"word_embeddings.weight": 0, "self.query.weight": 0, "self.key.weight": 0, "self.value.weight": 0,
             "attention.output.dense.weight": 1, "intermediate.dense.weight": 0, "layer.0.output.dense.weight": 1,
             "cls.predictions.bias": 0},
    "t5": {"shared.weight": 0, "SelfAttention.q.weight": 0, "EncDecAttention.v.weight": 0,
           "SelfAttention.o.weight": 1, "relative_attention_bias.weight": 1, "wi.weight": 0, "wo.weight": 1},
    "t5-gated": {"SelfAttention.q.weight": 0, "wi_0.weight": 0, "wi_1.weight": 0, "wo.weight": 1},
    "vit": {"q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0, "o_proj.weight": 1, "fc1.weight": 0,
            "fc2.weight": 1},
}


def _jobs(tmp_path, pp: int, names: tuple[str, ...] = FAMILIES) -> list[tuple[str, str]]:
    jobs = []
    for name in names:
        (tmp_path / name).mkdir()
        jobs.append((write_plan(tmp_path / name, h.plan(name, pp, 1, 2, micro=MICRO)), name))
    return jobs


def _placements(text: str) -> list[tuple[str, int]]:
    """``"(Shard(dim=0), _StridedShard(dim=1, sf=3))"`` -> [("Shard", 0), ("_StridedShard", 1)] (-1: no dim)."""
    return [(kind, int(dim) if dim else -1)
            for kind, dim in re.findall(r"(_StridedShard|Shard|Replicate)\((?:dim=(\d+))?[^)]*\)", text)]


def _assert_split_and_equal(name: str, results: list[dict]) -> None:
    """Rank 0 (the whole model, gathered) equals the reference; on every rank the
    attention/MLP/embedding weights are split on the TP mesh dim (the last one;
    halves where there is no data parallelism), and no note says "replicated"."""
    ref_losses, ref_state = reference(name)
    cmp = compare(results[0]["losses"], ref_losses, results[0]["state"], ref_state)
    assert not cmp["missing"], cmp["missing"]
    assert cmp["loss_rel_diff"] <= TOL and cmp["param_rel_diff"] <= TOL, (name, cmp)
    split = SPLIT.get(name) or SPLIT[name.split("-")[0]]
    seen = set()
    for result in results:
        assert not any("replicated on each TP group" in note for note in result["notes"]), result["notes"]
        for param, (glob, local, placements) in result["parameters"].items():
            for end, dim in split.items():
                if param.endswith(end):
                    kinds = _placements(placements)
                    assert kinds and kinds[-1][0].endswith("Shard") and kinds[-1][1] == dim, (param, placements)
                    assert len(kinds) > 1 or local[dim] in (glob[dim] // 2, -(-glob[dim] // 2)), (param, glob, local)
                    seen.add(end)
            if name.startswith("gpt2") and param.endswith("c_attn.weight"):  # its heads of q, of k and of v
                assert "_StridedShard(dim=1, sf=3)" in placements, placements
    assert seen == set(split), f"{name}: no split parameter ends with {set(split) - seen}"


def tp2_worker(jobs: list[tuple[str, str]], checkpoint: str) -> dict:
    """Every family under its tp2 plan, then GPT-2's checkpoint round trip, in one process group."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        return {"runs": [h.worker(path, name) for path, name in jobs],
                "checkpoint": _checkpoint_round_trip(jobs[0][0], checkpoint)}
    finally:
        dist.destroy_process_group()


def _checkpoint_round_trip(plan_path: str, directory: str) -> dict:
    """One GPT-2 step, save (the strided c_attn included), load into a model built
    from another seed: the whole state before saving and after loading."""
    from hetplan.runtime.context import init
    from hetplan.runtime.reference import make_optimizer

    ctx = init(plan_path, h.spec("gpt2"))
    model = ctx.parallelize(lambda: h.build("gpt2"), seed=0, meta_init=False)
    opt = make_optimizer(model.parameters())
    x, y, inputs = h.batch(0, ctx.plan.global_batch_size, "gpt2")
    ctx.train_step(model, (x, y), h.loss, inputs=inputs)
    opt.step()
    ctx.save(directory, model, opt, step=1)
    saved = ctx.full_state_dict(model)
    other = ctx.parallelize(lambda: h.build("gpt2"), seed=1, meta_init=False)
    ctx.load(directory, other)
    loaded = ctx.full_state_dict(other)
    ctx.close()
    return {"saved": saved, "loaded": loaded}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the one-process read below, on purpose
def test_gpt2_bert_t5_vit_under_tp2_are_split_and_equal_their_own_forward(tmp_path) -> None:
    """Each family, and GPT-2 with a vocabulary tp does not divide, at tp2; then
    GPT-2's checkpoint (strided c_attn) loaded back and read whole in one process."""
    import torch
    import torch.distributed.checkpoint as dcp

    directory = str(tmp_path / "checkpoint")
    names = FAMILIES + ("gpt2-odd-vocab",)  # its 129 token rows split 65 + 64
    results = run(tp2_worker, 2, _jobs(tmp_path, pp=1, names=names), directory)
    for i, name in enumerate(names):
        _assert_split_and_equal(name, [r["runs"][i] for r in results])
    saved, loaded = results[0]["checkpoint"]["saved"], results[0]["checkpoint"]["loaded"]
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    # read in one process, the checkpoint holds the whole tensors at their places (strided c_attn too)
    keys = [k for k in dcp.FileSystemReader(directory).read_metadata().state_dict_metadata if k.startswith("model.")]
    whole = {k: torch.zeros_like(saved[k[len("model."):]]) for k in keys}
    dcp.load(whole, checkpoint_id=directory, no_dist=True)
    assert "model.transformer.h.0.attn.c_attn.weight" in whole
    assert all(torch.equal(v, saved[k[len("model."):]]) for k, v in whole.items())


def test_gpt2_bert_t5_vit_under_pp2_x_tp2_and_gpt2_under_dp2_x_tp2_zero3_are_split_and_equal(tmp_path) -> None:
    """pp2 x tp2 for each family and for T5 with Flan-T5's gated MLP; and GPT-2 at
    dp2 x tp2 with ZeRO-3, where FSDP2 splits the TP shards again (its fused c_attn
    bias stays whole on the TP ranks: FSDP2 would gather a strided 1-D shard out of order)."""
    from dataclasses import replace

    zero3 = h.plan("gpt2", 1, 2, 2, micro=MICRO)
    zero3 = replace(zero3, stages=tuple(replace(s, strategies=tuple(replace(t, zero=3) for t in s.strategies))
                                        for s in zero3.stages))
    (tmp_path / "zero3").mkdir()
    names = FAMILIES + ("t5-gated",)
    jobs = _jobs(tmp_path, pp=2, names=names) + [(write_plan(tmp_path / "zero3", zero3), "gpt2")]
    results = run(h.several_workers, 4, jobs)
    for i, name in enumerate(names + ("gpt2",)):
        _assert_split_and_equal(name, [r[i] for r in results])


@pytest.mark.parametrize(("name", "tp", "sp", "message"), [
    ("gpt2", 3, False, "tp=3 does not divide the 4 attention heads of 'transformer.h.0.attn'; "
                       "use a tp that divides 4"),
    ("t5", 2, True, "sequence parallelism is not supported for T5ForConditionalGeneration (hetplan's TP plan for "
                    "it splits heads and MLP widths only); turn sequence_parallel off"),
])
def test_a_degree_the_plan_cannot_split_by_is_refused_before_start(name: str, tp: int, sp: bool,
                                                                   message: str) -> None:
    from dataclasses import replace

    from hetplan.errors import HetplanError
    from hetplan.runtime.preflight import preflight
    from hetplan.plan.layout import PlanLayout

    plan = h.plan(name, 1, 1, tp, micro=MICRO)
    plan = replace(plan, stages=tuple(replace(s, sequence_parallel=sp) for s in plan.stages))
    spec = h.spec(name)
    layout = PlanLayout.from_plan(plan, [layer.name for layer in spec.layers])
    with pytest.raises(HetplanError) as err:
        preflight(layout, spec, h.build(name))
    assert str(err.value) == message
