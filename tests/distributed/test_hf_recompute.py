"""HF models under recomputation (issue "Never silently wrong, round 2", item 2).

Every family the runtime trains, with full and selective recomputation at one
pipeline stage (dp2) and at pp2, equals the single-process run of its own
forward (loss and every parameter within 1e-5, fp32, 2 micro-batches): a
recomputed layer replays without the model's KV cache, and selective
checkpoints the attention core only -- the projections around it are not
recomputed, and selective on a layer without attention recomputes nothing.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any

import pytest

pytest.importorskip("transformers")

import hf_pp_helpers as h
from rt_helpers import run, write_plan

from hetplan.errors import HetplanError
from hetplan.plan.spec import LayerStrategy
from hetplan.runtime.reference import compare

TOL = 1e-5
FAMILIES = ("llama", "qwen2", "mistral", "mixtral", "gpt2", "bert", "t5", "vit")


def test_every_hf_family_with_full_and_selective_recompute_equals_its_own_forward(tmp_path) -> None:
    """17 plans (8 families x {pp1 x dp2, pp2}, and Llama at tp2: the core of a
    rank's heads) trained one after another in one pair of processes."""
    cases = [(name, pp, dp, 1) for name in FAMILIES for pp, dp in ((1, 2), (2, 1))] + [("llama", 1, 1, 2)]
    jobs = []
    for name, pp, dp, tp in cases:
        directory = tmp_path / f"{name}-pp{pp}-dp{dp}-tp{tp}"
        directory.mkdir()
        jobs.append((write_plan(directory, h.recompute_plan(name, pp, dp, tp)), name))
    results = run(h.several_workers, 2, jobs)
    for case, result in zip(cases, results[0]):
        ref = h.reference(case[0])
        cmp = compare(result["losses"], ref[0], result["state"], ref[1])
        assert not cmp["missing"] and cmp["loss_rel_diff"] <= TOL and cmp["param_rel_diff"] <= TOL, (case, cmp)
        assert not [n for n in result["notes"] if "recompute" in n], (case, result["notes"])  # nothing fell back


# --- in one process: what selective recomputes and keeps ----------------------------------------------
@pytest.fixture
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    torch.set_num_threads(1)


def _llama(implementation: str) -> Any:
    config = h.config("llama")
    config._attn_implementation = implementation
    return config


def _one_process_model(recompute: dict[int, str], implementation: str = "sdpa") -> tuple[Any, Any, Any]:
    """(ctx, model, spec): tiny Llama on one device, layer i recomputed as ``recompute[i]``
    (0 embed, 1-2 the blocks, 3 head), 2 micro-batches of 4."""
    import transformers

    from hetplan.model.hf import model_from_hf_config
    from hetplan.runtime.context import init

    spec = model_from_hf_config(_llama(implementation), seq_len=h.SEQ, dtype_bytes=4, name="llama")
    base = h.plan("llama", 1, micro=4)
    stage = replace(base.stages[0], strategies=tuple(LayerStrategy(recompute=recompute.get(i, "none"))
                                                     for i in base.stages[0].layers))
    ctx = init(replace(base, cluster="local-cpu-1", stages=(stage,)), spec)
    model = ctx.parallelize(lambda: transformers.LlamaForCausalLM(_llama(implementation)), meta_init=False)
    return ctx, model, spec


def _calls(module: Any) -> list[int]:
    calls: list[int] = []
    module.register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.usefixtures("_single_process")
def test_selective_recomputes_the_attention_core_and_not_the_projections(monkeypatch) -> None:
    """One train_step of 2 micro-batches: block 0 full, block 1 selective, the head
    selective (no attention: nothing to recompute). The attention function runs
    again in backward for both blocks; the projections and the head only for the
    full block."""
    from transformers.modeling_utils import AttentionInterface

    ctx, model, _ = _one_process_model({1: "full", 2: "selective", 3: "selective"})
    core_calls: dict[int, int] = {}
    sdpa = AttentionInterface._global_mapping["sdpa"]

    def counted(module: Any, *args: Any, **kwargs: Any) -> Any:
        core_calls[id(module)] = core_calls.get(id(module), 0) + 1
        return sdpa(module, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", counted)
    full, selective = model.model.layers
    projections = [_calls(full.self_attn.q_proj), _calls(selective.self_attn.q_proj), _calls(selective.mlp.up_proj),
                   _calls(model.lm_head)]
    x, y, inputs = h.batch(0, 8, "llama")
    ctx.train_step(model, (x, y), h.loss, inputs=inputs)
    assert [core_calls.get(id(b.self_attn), 0) for b in (full, selective)] == [4, 4]
    assert [len(c) for c in projections] == [4, 2, 2, 2]
    ctx.close()


def _saved_bytes(model: Any, layers: list[str], monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Bytes of the tensors (not parameters) each layer's forward saves for
    backward, each storage once, as autograd sees them (a checkpointed region
    saves its inputs, nothing inside); ``<layer>:core``: those saved inside
    its eager attention function."""
    import torch
    from transformers.models.llama import modeling_llama

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    current: list[str | None] = [None]
    seen: set[int] = set()
    saved = {key: 0 for name in layers for key in (name, f"{name}:core")}
    for name in layers:
        module = model.get_submodule(name)
        module.register_forward_pre_hook(lambda _m, _a, n=name: current.__setitem__(0, n))
        module.register_forward_hook(lambda *_: current.__setitem__(0, None))
    eager = modeling_llama.eager_attention_forward

    def core(*args: Any, **kwargs: Any) -> Any:
        layer, current[0] = current[0], f"{current[0]}:core"
        try:
            return eager(*args, **kwargs)
        finally:
            current[0] = layer

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if current[0] is not None and ptr not in seen and ptr not in params:
            seen.add(ptr)
            saved[current[0]] += t.untyped_storage().nbytes()
        return t

    monkeypatch.setattr(modeling_llama, "eager_attention_forward", core)
    x, _, inputs = h.batch(0, 4, "llama")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, **inputs)
    return saved


@pytest.mark.usefixtures("_single_process")
def test_selective_drops_only_what_the_attention_core_saves(monkeypatch) -> None:
    """Eager attention (the costed core: the score matrix), 4 samples: the full
    block keeps only its input, as costed; the selective block keeps nothing
    inside its attention function and everything outside it, and what that
    function saves without recomputation is at least the costed
    act_attention_core_bytes."""
    blocks = ["model.layers.0", "model.layers.1"]
    ctx, model, _ = _one_process_model({}, "eager")
    plain = _saved_bytes(model, blocks, monkeypatch)
    ctx.close()
    ctx, model, spec = _one_process_model({1: "full", 2: "selective"}, "eager")
    recomputed = _saved_bytes(model, blocks, monkeypatch)
    ctx.close()
    full, selective = blocks
    assert recomputed[full] == spec.layers[1].input_bytes * 4 and recomputed[f"{full}:core"] == 0
    assert recomputed[f"{selective}:core"] == 0 and recomputed[selective] >= plain[selective]
    assert plain[f"{selective}:core"] >= spec.layers[2].act_attention_core_bytes * 4 > 0


# --- refusals ---------------------------------------------------------------------------------------
@pytest.mark.usefixtures("_single_process")
def test_a_kv_cache_in_a_recomputed_layer_is_refused_with_one_line() -> None:
    """parallelize turns the cache off; a forward that asks for it anyway is refused."""
    ctx, model, _ = _one_process_model({1: "full"})
    assert model.config.use_cache is False
    x, _, inputs = h.batch(0, 4, "llama")
    with pytest.raises(HetplanError, match=r"^layer 'model.layers.0' is recomputed and was given use_cache=True: "
                                           r"its replay would write the keys and values again; train without"):
        model(x, use_cache=True, **inputs)
    ctx.close()


@pytest.mark.usefixtures("_single_process")
def test_hf_gradient_checkpointing_of_the_model_itself_is_refused() -> None:
    """It would recompute every layer whatever the plan says."""
    import transformers

    from hetplan.runtime.context import init

    def build() -> Any:
        model = transformers.LlamaForCausalLM(h.config("llama"))
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    ctx = init(replace(h.plan("llama", 1), cluster="local-cpu-1"), h.spec("llama"))
    with pytest.raises(HetplanError, match=r"^HF gradient checkpointing is on in 'model'; call "
                                           r"gradient_checkpointing_disable\(\) on the model: the plan's"):
        ctx.parallelize(build, meta_init=False)
    ctx.close()


def _gpt2_upcast(recompute: str) -> tuple[Any, Any, Any]:
    """(ctx, config, spec): GPT-2 with eager attention and reorder_and_upcast_attn,
    every layer recomputed as ``recompute``, on one device."""
    from hetplan.model.hf import model_from_hf_config
    from hetplan.runtime.context import init

    config = h.config("gpt2")
    config.reorder_and_upcast_attn = True
    config._attn_implementation = "eager"
    spec = model_from_hf_config(config, seq_len=h.SEQ, dtype_bytes=4, name="gpt2")
    base = h.plan("gpt2", 1)
    stage = replace(base.stages[0], strategies=tuple(LayerStrategy(recompute=recompute) for _ in base.stages[0].layers))
    return init(replace(base, cluster="local-cpu-1", stages=(stage,)), spec), config, spec


@pytest.mark.usefixtures("_single_process")
def test_selective_on_attention_computed_inline_is_refused_before_training() -> None:
    """GPT-2 with eager attention and reorder_and_upcast_attn computes its core
    outside the attention interface: selective cannot checkpoint it."""
    why = r"^selective recompute of layer 'transformer.h.0': GPT2Attention with eager attention and " \
          r"reorder_and_upcast_attn computes its attention core inline"
    with pytest.raises(HetplanError, match=why):  # at plan time: the model's facts (hetplan.runtime.support)
        _gpt2_upcast("selective")


@pytest.mark.usefixtures("_single_process")
def test_a_core_that_bypasses_the_interface_is_refused_at_its_first_forward(monkeypatch) -> None:
    """The same GPT-2 with the check before training skipped: its first forward
    finds the core never reached the interface (so nothing was recomputed)."""
    import transformers

    from hetplan.runtime import hf_recompute

    monkeypatch.setattr(hf_recompute, "inline_attention", lambda module: "")
    ctx, config, _ = _gpt2_upcast("selective")
    model = ctx.parallelize(lambda: transformers.GPT2LMHeadModel(config), meta_init=False)
    x, _, inputs = h.batch(0, 4, "gpt2")
    with pytest.raises(HetplanError, match=r"^selective recompute of layer 'transformer.h.0': GPT2Attention computed "
                                           r"attention without transformers' attention interface, so nothing was "
                                           r"recomputed; use recompute 'full' or 'none' for it$"):
        model(x, **inputs)
    ctx.close()


# --- hetplan train --verify with recomputation (the reference: train_reference) ------------------------
def test_hetplan_train_verify_a_llama_config_with_full_recompute(tmp_path, capsys) -> None:
    from hetplan.cli import main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(h.config("llama").to_dict()))
    plan = os.fspath(tmp_path / "p.json")
    assert main(["estimate", "--model", str(cfg), "--cluster", "local-cpu-1", "--pp", "1", "--tp", "1", "--dp", "1",
                 "--micro-batch", "4", "--global-batch", "8", "--seq-len", str(h.SEQ), "--precision", "fp32",
                 "--recompute", "full", "--json", plan]) == 0
    capsys.readouterr()
    code = main(["train", "--plan", plan, "--steps", "2", "--verify"])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    assert "verify: OK" in out.out
