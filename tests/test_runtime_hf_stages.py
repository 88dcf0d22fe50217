"""HF models split at layer boundaries (hetplan.runtime.hf_stages), in one process.

The staged forward of each supported family must give the model's own logits
with a padded attention mask, also when run as two pipeline parts in sequence
(only the hidden state passed between them, each part rebuilding the mask);
a staged forward that differs is refused; families without one are refused
with the class named, at import (the note of ``hetplan estimate``) and in the
runtime's checks.
"""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "distributed"))
import hf_pp_helpers as h

from hetplan.errors import HetplanError
from hetplan.runtime import hf_stages
from hetplan.runtime.parallelize import PipelinePart

FAMILIES = ["llama", "mistral", "mixtral", "qwen2", "gpt2", "bert"]


def _model(name: str):
    torch.manual_seed(0)
    model = h.build(name)
    model.eval()
    return model


@pytest.mark.parametrize("name", FAMILIES)
def test_two_parts_in_sequence_give_the_models_own_logits(name):
    spec = h.spec(name)
    names = [layer.name for layer in spec.layers]
    model = _model(name)
    staged = hf_stages.staged_forward(model, names)
    x, _, inputs = h.batch(0, 4)
    assert int(inputs["attention_mask"].sum()) < inputs["attention_mask"].numel()  # there is padding
    modules = spec.meta["layer_modules"]
    first = PipelinePart(model, names[:2], modules, staged)
    second = PipelinePart(model, names[2:], modules, staged)
    with torch.no_grad():
        own = model(x, **inputs).logits
        hidden = first(x, **inputs)
        assert hidden.shape == (4, h.SEQ, 64)  # only the hidden state crosses the boundary
        logits = second(hidden, **inputs)
        unmasked = second(first(x), **{})
    assert torch.allclose(logits, own, rtol=0, atol=1e-6), float((logits - own).abs().max())
    assert float((unmasked - own).abs().max()) > 1e-4  # the mask matters: dropping it would show


def test_a_staged_forward_that_differs_from_the_model_is_refused():
    names = [layer.name for layer in h.spec("llama").layers]
    model = _model("llama")

    class DropsTheMask(hf_stages._RopeDecoder):
        def context(self, part, hidden, inputs):
            return super().context(part, hidden, {})

    ids, inputs = hf_stages.example_model_inputs(model, h.SEQ, h.VOCAB)
    hf_stages.check_staged_forward(model, hf_stages._RopeDecoder(model, names), names, ids, inputs)
    with pytest.raises(HetplanError, match="differs from the model's own forward by") as e:
        hf_stages.check_staged_forward(model, DropsTheMask(model, names), names, ids, inputs)
    assert "\n" not in str(e.value) and "one pipeline stage" in str(e.value)


@pytest.mark.parametrize("name", ["t5", "vit"])
def test_every_split_of_t5_and_vit_gives_the_models_own_logits(name):
    """Two parts split before each layer: what the first passes on (T5: the
    encoder state, the stack's position bias once its first block ran, inside
    the decoder also the encoder output) must be all the second needs."""
    spec = h.spec(name)
    names = [layer.name for layer in spec.layers]
    model = _model(name)
    staged = hf_stages.staged_forward(model, names)
    x, _, inputs = h.batch(0, 4, name)
    modules = spec.meta["layer_modules"]
    with torch.no_grad():
        own = model(x, **inputs).logits
        carried = []
        for cut in range(1, len(names)):
            mid = PipelinePart(model, names[:cut], modules, staged)(x, **inputs)
            mid = mid if isinstance(mid, tuple) else (mid,)
            carried.append(len(mid))
            logits = PipelinePart(model, names[cut:], modules, staged)(*mid, **inputs)
            assert torch.allclose(logits, own, rtol=0, atol=1e-6), (cut, float((logits - own).abs().max()))
    if name == "vit":
        assert own.shape == (4, h.LABELS) and carried == [1, 1, 1]
        return
    # enc.embed | enc.block.0 (+bias) | enc.block.1 | dec.embed (+enc) | dec.block.0 (+enc, bias) | dec.block.1
    assert carried == [1, 2, 1, 2, 3, 1]
    assert own.shape == (4, h.DEC_SEQ, h.VOCAB)
    unmasked = {k: v for k, v in inputs.items() if not k.endswith("attention_mask")}
    with torch.no_grad():
        assert float((staged.run(model, names, x, unmasked) - own).abs().max()) > 1e-4  # the masks matter


def test_a_t5_split_passing_several_tensors_is_refused_in_a_heterogeneous_plan():
    names = [layer.name for layer in h.spec("t5").layers]
    staged = hf_stages.staged_forward(_model("t5"), names)
    for cut in range(1, len(names)):
        stages = [names[:cut], names[cut:]]
        assert staged.split_refusal(stages, heterogeneous=False) == ""
        why = staged.split_refusal(stages, heterogeneous=True)
        assert (why == "") == (cut in (1, 3, 6)), (cut, why)  # one tensor after enc.embed, enc.block.1, dec.block.1
    why = staged.split_refusal([names[:2], names[2:]], heterogeneous=True)
    assert why.startswith("a T5 pipeline split after encoder.block.0 passes enc + enc_bias") and "\n" not in why


def test_preflight_refuses_a_heterogeneous_t5_plan_split_inside_the_encoder():
    """What `hetplan train` runs before it starts any process (and parallelize on every rank)."""
    import transformers

    from hetplan.runtime.preflight import preflight
    from hetplan.plan.layout import PlanLayout

    spec = h.spec("t5")
    names = [layer.name for layer in spec.layers]
    with torch.device("meta"):
        model = transformers.T5ForConditionalGeneration(h.config("t5"))
    preflight(PlanLayout.from_plan(h.hetero_plan("t5", cut=3), names), spec, model)
    with pytest.raises(HetplanError, match="a T5 pipeline split after encoder.block.0 passes enc . enc_bias"):
        preflight(PlanLayout.from_plan(h.hetero_plan("t5", cut=2), names), spec, model)


def test_t5s_shared_embedding_on_three_stages_is_refused():
    from hetplan.plan.support import tied_span_refusal

    spec = h.spec("t5")
    names = [layer.name for layer in spec.layers]
    two = {n: int(i >= 4) for i, n in enumerate(names)}
    three = {n: 0 if i < 3 else 1 if i < 6 else 2 for i, n in enumerate(names)}
    assert tied_span_refusal(spec, two) == ""
    assert tied_span_refusal(spec, three).startswith(
        "layers encoder.embed_tokens, decoder.embed_tokens, lm_head share one weight and this plan puts them on 3")


def test_t5s_three_way_tie_is_summed_once_between_two_stages():
    """encoder.embed_tokens, decoder.embed_tokens and lm_head are one tensor (with
    ``shared``): split inside the encoder, the second stage holds two copies of one
    tensor, so one pair (one all-reduce) per pair of stages."""
    from hetplan.runtime.spine import one_pair_per_stage_pair
    from hetplan.plan.layout import PlanLayout
    from hetplan.runtime.parallelize import tied_layer_pairs

    spec = h.spec("t5")
    names = [layer.name for layer in spec.layers]
    pairs = tied_layer_pairs(_model("t5"), names)
    assert pairs == [("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"),
                     ("encoder.embed_tokens.weight", "lm_head.weight")]
    inside_encoder = PlanLayout.from_plan(h.plan("t5", cut=2), names)
    assert one_pair_per_stage_pair(pairs, inside_encoder) == pairs[:1]
    inside_decoder = PlanLayout.from_plan(h.plan("t5", cut=5), names)  # both embeddings on stage 0: one pair crosses
    kept = one_pair_per_stage_pair(pairs, inside_decoder)
    stage = inside_decoder.pp_index_of_layer
    assert [(c, a) for c, a in kept if stage(c.rpartition(".")[0]) != stage(a.rpartition(".")[0])] == pairs[1:]


def test_a_bare_vit_model_is_refused_naming_the_class():
    """ViTModel (a ViT config naming no task class) has no head to train and no staged forward."""
    import transformers

    from hetplan.model.hf import model_from_hf_config

    vit = {"model_type": "vit", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 128, "image_size": 32, "patch_size": 8}
    spec = model_from_hf_config(dict(vit))
    why = spec.runtime.pipeline
    assert "hetplan has no staged forward for ViTModel" in why and "one pipeline stage" in why
    with torch.device("meta"):
        model = transformers.ViTModel(transformers.AutoConfig.for_model(**vit))
    with pytest.raises(HetplanError, match="no staged forward"):
        hf_stages.staged_forward(model, [layer.name for layer in spec.layers])


def test_supported_families_carry_no_pipeline_blocker():
    for name in [*FAMILIES, "t5", "vit"]:
        assert h.spec(name).runtime.pipeline == "", name


def test_mixtral_router_loss_is_refused():
    import transformers

    config = h.config("mixtral")
    config.output_router_logits = True
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(config)
    assert "output_router_logits" in hf_stages.unsupported_reason(model)


def test_estimate_gives_no_refusal_note_for_a_pipelined_llama(tmp_path, capsys):
    """A 2-stage plan of a HF Llama trains; notes that remain: test_runtime_chain."""
    import json

    from hetplan.cli import main

    llama = tmp_path / "llama.json"
    llama.write_text(json.dumps(h.config("llama").to_dict()))
    assert main(["estimate", "--cluster", "4xA100-80GB", "--tp", "1", "--dp", "2", "--micro-batch", "1",
                 "--global-batch", "8", "--seq-len", "16", "--pp", "2", "--model", str(llama)]) == 0
    assert "hetplan.runtime would refuse" not in capsys.readouterr().out


def test_a_keyword_input_the_stages_do_not_take_is_refused_before_the_pipeline():
    from hetplan.runtime.step import check_staged_inputs

    names = [layer.name for layer in h.spec("llama").layers]
    model = _model("llama")
    part = PipelinePart(model, names[:2], h.spec("llama").meta["layer_modules"],
                        hf_stages.staged_forward(model, names))
    check_staged_inputs(part, {"attention_mask": torch.ones(2, 4)})
    with pytest.raises(HetplanError, match="keyword input 'token_type_ids' does not reach the pipeline stages of "
                                           "LlamaForCausalLM, which take attention_mask"):
        check_staged_inputs(part, {"attention_mask": torch.ones(2, 4), "token_type_ids": torch.ones(2, 4)})


def test_t5_stages_without_decoder_inputs_are_refused_before_the_pipeline():
    from hetplan.runtime.step import check_staged_inputs

    spec = h.spec("t5")
    names = [layer.name for layer in spec.layers]
    model = _model("t5")
    part = PipelinePart(model, names[:3], spec.meta["layer_modules"], hf_stages.staged_forward(model, names))
    _, _, inputs = h.batch(0, 2, "t5")
    check_staged_inputs(part, inputs)
    with pytest.raises(HetplanError, match="need the keyword input 'decoder_input_ids'; pass it with train_step"):
        check_staged_inputs(part, {"attention_mask": inputs["attention_mask"]})
