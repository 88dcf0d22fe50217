"""The pipeline chain check: a model whose forward is not a chain of the plan's
layers is refused with one line naming the layer, and a chain passes.

Each model here differs from a chain in one way a pipeline of its layers would
silently lose (issue: "pipeline parallelism ignores the model's own forward")."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn

from hetplan.errors import HetplanError
from hetplan.model.chain import check_chain

NAMES = ["embed", "blocks.0", "blocks.1", "head"]
X = torch.zeros(2, 8, dtype=torch.long)


class Chain(nn.Module):
    """embed -> blocks -> head: exactly a chain."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 16)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class LongSkip(Chain):
    """The embedding output is added again before the head (an MLP-mixer-like long skip)."""

    def forward(self, x):
        e = self.embed(x)
        h = e
        for b in self.blocks:
            h = b(h)
        return self.head(h + e)


class Reuse(Chain):
    def forward(self, x):
        h = self.embed(x)
        h = self.blocks[0](h)
        h = self.blocks[0](h)
        return self.head(self.blocks[1](h))


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)
        self.blocks = nn.ModuleList([MaskedBlock(), MaskedBlock()])
        self.head = nn.Linear(4, 16)

    def forward(self, x, mask=None):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h, mask=mask)
        return self.head(h)


class MaskedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, h, mask=None, scale=1.0):
        return self.lin(h if mask is None else h * mask[..., None]) * scale


class BetweenLayers(Chain):
    def forward(self, x):
        h = self.blocks[0](self.embed(x))
        return self.head(self.blocks[1](h * 2.0))


class InPlaceBetween(Chain):
    def forward(self, x):
        h = self.blocks[0](self.embed(x))
        h.mul_(2.0)
        return self.head(self.blocks[1](h))


class AfterLast(Chain):
    def forward(self, x):
        return super().forward(x).float() * 0.5


class Swapped(Chain):
    def forward(self, x):
        h = self.embed(x)
        h = self.blocks[1](self.blocks[0](h))
        return self.head(h)

    # the plan below lists blocks.1 before blocks.0


def meta(cls: type) -> nn.Module:
    """check_chain runs a meta-device copy of the model, as the runtime builds one."""
    with torch.device("meta"):
        return cls()


def test_a_chain_passes():
    check_chain(meta(Chain), NAMES, (X,))


def test_the_built_in_gpt_is_a_chain():
    from hetplan.model.presets import get_model
    from hetplan.runtime.models import build_preset_model

    spec = get_model("tiny-gpt")
    with torch.device("meta"):
        model = build_preset_model(spec)
    check_chain(model, [layer.name for layer in spec.layers], (torch.zeros(2, spec.seq_len, dtype=torch.long),))


def test_default_valued_keyword_arguments_are_kept():
    check_chain(meta(Masked), NAMES, (X,))  # mask=None is the block's default: nothing is lost


@pytest.mark.parametrize("model, names, kwargs, needle", [
    (LongSkip, NAMES, {}, "the input of layer 'head' is not exactly the output of layer 'blocks.1'"),
    (Reuse, NAMES, {}, "layer 'blocks.0' is called 2 times"),
    (BetweenLayers, NAMES, {}, "the input of layer 'blocks.1' is not exactly the output of layer 'blocks.0'"),
    (InPlaceBetween, NAMES, {}, "the output of layer 'blocks.0' is modified in place before layer 'blocks.1'"),
    (AfterLast, NAMES, {}, "the model's output is not exactly the output of layer 'head'"),
    (Swapped, ["embed", "blocks.1", "blocks.0", "head"], {}, "calls layer 'blocks.0' where the plan has 'blocks.1'"),
], ids=["long-skip", "reuse", "op-between", "in-place", "after-last", "order"])
def test_non_chains_are_refused_with_one_line(model, names, kwargs, needle):
    with pytest.raises(HetplanError) as e:
        check_chain(meta(model), names, (X,), kwargs)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg
    assert "one pipeline stage" in msg


def test_keyword_inputs_of_the_model_passed_on_unchanged_are_routed_to_their_layers():
    """A mask given to the model and handed to each block as is: every pipeline
    stage gets the model's keyword inputs, so the chain holds; the routes say
    which layer takes which."""
    routes = check_chain(meta(Masked), NAMES, (X,), {"mask": torch.ones(2, 8)})
    assert routes == {"blocks.0": {"mask": "mask"}, "blocks.1": {"mask": "mask"}}
    assert check_chain(meta(Chain), NAMES, (X,)) == {}


def test_a_keyword_input_used_between_layers_is_refused():
    class MaskBetween(Masked):
        def forward(self, x, mask=None):
            h = self.blocks[0](self.embed(x))
            return self.head(self.blocks[1](h * mask[..., None]))

    with pytest.raises(HetplanError, match="the input of layer 'blocks.1' is not exactly the output of layer"):
        check_chain(meta(MaskBetween), NAMES, (X,), {"mask": torch.ones(2, 8)})


def test_keyword_input_of_a_layer_is_refused():
    class PassesMask(Masked):
        def forward(self, x):
            h = self.embed(x)
            mask = torch.ones(x.shape, device=x.device)
            for b in self.blocks:
                h = b(h, mask=mask)
            return self.head(h)

    with pytest.raises(HetplanError, match="layer 'blocks.0' is called with keyword input"):
        check_chain(meta(PassesMask), NAMES, (X,))


def test_a_forward_that_cannot_run_on_meta_is_refused_not_skipped():
    class DataDependent(Chain):
        def forward(self, x):
            if int(x.sum()) > 0:  # needs real data
                x = x - 1
            return super().forward(x)

    with pytest.raises(HetplanError, match="cannot check that the model's forward is a chain"):
        check_chain(meta(DataDependent), NAMES, (X,))


LLAMA = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32}


def test_hf_import_records_whether_the_runtime_can_pipeline_it():
    """HF Llama and T5 pipeline through their staged forwards (hetplan.runtime.hf_stages);
    a bare ViTModel (a ViT config naming no task class) has none."""
    pytest.importorskip("transformers")
    from hetplan.model.hf import model_from_hf_config

    assert model_from_hf_config(dict(LLAMA), seq_len=16).runtime.pipeline == ""
    t5 = {"model_type": "t5", "vocab_size": 128, "d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2,
          "num_heads": 4}
    assert model_from_hf_config(t5, seq_len=16).runtime.pipeline == ""
    vit = {"model_type": "vit", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 128, "image_size": 32, "patch_size": 8}
    why = model_from_hf_config(vit).runtime.pipeline
    assert why.startswith("hetplan has no staged forward for ViTModel")


def test_estimate_of_a_pipelined_hf_plan_the_runtime_would_refuse_is_refused(tmp_path, capsys):
    pytest.importorskip("transformers")
    import json

    from hetplan.cli import main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "t5", "vocab_size": 128, "d_model": 64, "d_kv": 16, "d_ff": 128,
                               "num_layers": 2, "num_heads": 4}))
    base = ["estimate", "--model", str(cfg), "--cluster", "4xA100-80GB", "--tp", "1", "--dp", "1",
            "--micro-batch", "1", "--global-batch", "8", "--seq-len", "16"]
    assert main([*base, "--pp", "4"]) == 2  # T5's shared embedding on 3 of the 4 stages
    err = capsys.readouterr().err
    assert err.startswith("hetplan: error: hetplan's runtime cannot run this plan as costed: layers "
                          "encoder.embed_tokens, decoder.embed_tokens, lm_head share one weight")
    assert main([*base, "--pp", "4", "--target", "any"]) == 0  # costed for no runtime in particular: a note
    out = capsys.readouterr().out
    assert "note: hetplan.runtime would refuse this plan's 4 pipeline stages for this model: layers " \
           "encoder.embed_tokens, decoder.embed_tokens, lm_head share one weight" in out
    assert main([*base[:-8], "--dp", "2", "--micro-batch", "1", "--global-batch", "8", "--seq-len", "16",
                 "--pp", "2"]) == 0  # T5 at pp2 now trains
    assert "hetplan.runtime would refuse" not in capsys.readouterr().out
    assert main([*base[:-8], "--dp", "4", "--micro-batch", "1", "--global-batch", "8", "--seq-len", "16",
                 "--pp", "1"]) == 0
    assert "hetplan.runtime would refuse" not in capsys.readouterr().out


def test_example_inputs_after_the_first_are_passed_by_name():
    """A ``pkg.mod:build`` model's example inputs (x, mask): the planner's and
    the runtime's chain checks call the model as train_step does,
    ``model(x, mask=mask)``, so a mask handed on to each block is a chain
    (passed positionally it looked derived, and pp > 1 was refused)."""
    from hetplan.model.source import module_spec
    from hetplan.runtime.preflight import check_chain_early

    mask = torch.ones(2, 8)
    spec = module_spec(Masked(), (X, mask), name="masked")
    assert "pipeline_blocker" not in spec.meta and [layer.name for layer in spec.layers] == NAMES
    check_chain_early(meta(Masked), NAMES, spec, (X, mask))


def test_example_inputs_without_forward_parameter_names_are_refused():
    from hetplan.model.chain import example_call

    class Unnamed(Masked):
        def forward(self, *inputs):
            return super().forward(inputs[0], mask=inputs[1])

    with pytest.raises(HetplanError) as e:
        example_call(meta(Unnamed), (X, torch.ones(2, 8)), "model 'm:build'")
    assert str(e.value).startswith("model 'm:build': forward takes 2 example inputs but names only 0 parameters; ")
    assert "\n" not in str(e.value)
