"""ModelSpecs from HF transformers configs (hetplan.model.hf) and from any
nn.Module traced on the meta device (hetplan.model.trace)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hetplan.errors import HetplanError
from hetplan.model.spec import ModelSpec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch import nn
from torch.nn import functional as F

from hetplan.model.hf import build_meta_model, load_hf_config, model_from_hf_config
from hetplan.model.trace import model_from_module

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"


def unique_params(spec: ModelSpec) -> int:
    """Parameters counted once: each layer's count minus what an earlier layer
    of its tied group already counts (LayerSpec.tied_params, else meta)."""
    return sum(layer.params - layer.tied_params for layer in spec.layers)


def numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() dedups tied weights


def assert_total_params(spec: ModelSpec, expected: int) -> None:
    assert unique_params(spec) == expected
    assert spec.total_params == expected


def small_configs() -> dict[str, object]:
    c = transformers
    return {
        "gpt2": c.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=96, n_positions=40),
        "bert": c.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                             vocab_size=96, max_position_embeddings=40),
        "t5": c.T5Config(num_layers=2, num_decoder_layers=3, d_model=64, num_heads=4, d_kv=16, d_ff=128,
                         vocab_size=96),
        "t5-v1.1": c.T5Config(num_layers=1, num_decoder_layers=1, d_model=64, num_heads=4, d_kv=32, d_ff=96,
                              vocab_size=96, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
        "llama": c.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=160, vocab_size=96, max_position_embeddings=40),
        "llama-tied": c.LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
                                    num_key_value_heads=1, intermediate_size=160, vocab_size=96,
                                    max_position_embeddings=40, tie_word_embeddings=True),
        "qwen2": c.Qwen2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=128, vocab_size=96, max_position_embeddings=40),
        "roberta": c.RobertaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                   intermediate_size=128, vocab_size=96, max_position_embeddings=42),
    }


# --------------------------------------------------------------------------- HF configs: parameters


@pytest.mark.parametrize("key", list(small_configs()))
def test_hf_params_equal_meta_model(key: str) -> None:
    config = small_configs()[key]
    spec = model_from_hf_config(config)
    model = build_meta_model(config)
    assert all(p.is_meta for p in model.parameters())
    modules = dict(model.named_modules())
    for layer in spec.layers:  # each layer's count is exactly its modules' parameters
        params = {id(p): p for path in spec.meta["layer_modules"][layer.name] for p in modules[path].parameters()}
        assert layer.params == sum(p.numel() for p in params.values())
        assert 0 <= layer.params_tp_replicated <= layer.params
    assert_total_params(spec, numel(model))


@pytest.mark.parametrize(
    "file,expected",
    [  # published parameter counts
        ("gpt2.json", 124_439_808),
        ("bert-base-uncased.json", 109_514_298),  # BertForMaskedLM
        ("t5-small.json", 60_506_624),
        ("tinyllama-1.1b.json", 1_100_048_384),
        ("llama-tiny.json", None),
    ],
)
def test_example_configs(file: str, expected: int | None) -> None:
    path = CONFIGS / file
    spec = model_from_hf_config(path)
    config, where = load_hf_config(path)
    assert where == str(path)
    n = numel(build_meta_model(config))
    if expected is not None:
        assert n == expected
    assert spec.name == path.stem
    assert_total_params(spec, n)
    json.dumps(spec.to_dict())  # serialisable, meta included


def test_directory_with_config_json(tmp_path: Path) -> None:
    (tmp_path / "my-llama").mkdir()
    (tmp_path / "my-llama" / "config.json").write_text((CONFIGS / "llama-tiny.json").read_text())
    spec = model_from_hf_config(tmp_path / "my-llama")
    assert spec.name == "my-llama"
    assert spec.layer_index("model.layers.3") == 4


def test_config_json_named_by_its_directory_however_the_path_is_spelled(tmp_path: Path, monkeypatch) -> None:
    """`--model config.json` run inside the model's directory names the model like
    `--model /abs/my-llama/config.json` does (was "config"), so a plan made one way
    is the same model for the runtime's name check when given the other way."""
    (tmp_path / "my-llama").mkdir()
    (tmp_path / "my-llama" / "config.json").write_text((CONFIGS / "llama-tiny.json").read_text())
    monkeypatch.chdir(tmp_path / "my-llama")
    assert model_from_hf_config("config.json").name == "my-llama"
    assert model_from_hf_config(str(tmp_path / "my-llama" / "config.json")).name == "my-llama"


# --------------------------------------------------------------------------- HF configs: structure


def test_layer_names_are_module_paths_in_execution_order() -> None:
    configs = small_configs()
    expected = {
        "gpt2": ["transformer.wte", "transformer.h.0", "transformer.h.1", "transformer.h.2", "lm_head"],
        "bert": ["bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1", "cls"],
        "llama": ["model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head"],
        "t5": ["encoder.embed_tokens", "encoder.block.0", "encoder.block.1", "decoder.embed_tokens",
               "decoder.block.0", "decoder.block.1", "decoder.block.2", "lm_head"],
    }
    for key, names in expected.items():
        spec = model_from_hf_config(configs[key])
        assert [layer.name for layer in spec.layers] == names
        model = build_meta_model(configs[key])
        for layer in spec.layers:
            model.get_submodule(layer.name)  # a real module path
            for path in spec.meta["layer_modules"][layer.name]:
                model.get_submodule(path)
    t5 = model_from_hf_config(configs["t5"])
    kinds = [layer.kind for layer in t5.layers]
    assert kinds == ["embedding", "encoder", "encoder", "embedding", "decoder", "decoder", "decoder", "head"]
    # the encoder's final norm runs after its last block and belongs to it
    assert "encoder.final_layer_norm" in t5.meta["layer_modules"]["encoder.block.1"]
    assert t5.meta["layer_modules"]["lm_head"][-1] == "lm_head"


def test_tied_groups() -> None:
    configs = small_configs()
    gpt2 = model_from_hf_config(configs["gpt2"])
    assert gpt2.layers[0].tied_group == gpt2.layers[-1].tied_group == "transformer.wte.weight"
    assert not any(layer.tied_group for layer in gpt2.layers[1:-1])
    assert gpt2.meta["tied_params"] == {"lm_head": 96 * 64}
    llama = model_from_hf_config(configs["llama"])  # untied LM head
    assert not any(layer.tied_group for layer in llama.layers)
    t5 = model_from_hf_config(configs["t5"])  # v1.0: shared embedding, both stacks and the LM head
    tied = [layer.name for layer in t5.layers if layer.tied_group == "shared.weight"]
    assert tied == ["encoder.embed_tokens", "decoder.embed_tokens", "lm_head"]
    # tied groups follow the built model (transformers 5 ties T5 v1.1's LM head too)
    for key in ("t5-v1.1", "llama-tied"):
        model = build_meta_model(configs[key])
        head_tied = model.lm_head.weight is model.get_input_embeddings().weight
        spec = model_from_hf_config(configs[key])
        assert bool(spec.layers[-1].tied_group) == head_tied


def test_hf_flops_and_activations_follow_the_analytic_formulas() -> None:
    s, h, a, v = 40, 64, 4, 96
    spec = model_from_hf_config(small_configs()["gpt2"], fused_attention=False)
    block = spec.layers[1]
    assert block.fwd_flops == pytest.approx(24 * s * h * h + 4 * s * s * h)  # Narayanan et al. 2021
    assert block.act_bytes == pytest.approx(s * h * (34 + 5 * a * s / h))  # Korthikanti et al. 2022, 16-bit
    assert block.act_tp_replicated_bytes == pytest.approx(10 * s * h)
    assert block.act_attention_core_bytes == pytest.approx(5 * a * s * s)
    assert spec.layers[-1].fwd_flops == pytest.approx(2 * s * h * v)
    assert block.params == 12 * h * h + 13 * h
    # by default transformers builds SDPA attention: fused on a GPU, no score matrix kept
    fused = model_from_hf_config(small_configs()["gpt2"])
    assert fused.meta["fused_attention"] is True
    assert fused.layers[1].act_attention_core_bytes < block.act_attention_core_bytes / 10
    assert fused.layers[1].fwd_flops == block.fwd_flops
    # grouped-query attention: K/V projections shrink with the KV heads
    gqa = model_from_hf_config(small_configs()["llama"]).layers[1]
    kv = 2 * 16  # 2 KV heads x head_dim 16
    assert gqa.fwd_flops == pytest.approx(2 * s * h * (2 * h + 2 * kv) + 4 * s * s * h + 2 * s * 3 * h * 160)
    assert gqa.tp_max == 2


def test_seq_len_defaults_and_overrides() -> None:
    configs = small_configs()
    assert model_from_hf_config(configs["gpt2"]).seq_len == 40  # n_positions
    assert model_from_hf_config(configs["bert"]).seq_len == 40  # max_position_embeddings
    assert model_from_hf_config(configs["roberta"]).seq_len == 40  # 42 minus RoBERTa's padding offset
    assert model_from_hf_config(configs["t5"]).seq_len == 512  # relative positions: T5's 512
    assert model_from_hf_config(configs["llama"], seq_len=16).seq_len == 16
    short = model_from_hf_config(configs["gpt2"], seq_len=20)
    full = model_from_hf_config(configs["gpt2"])
    assert short.layers[1].fwd_flops < full.layers[1].fwd_flops
    assert short.total_params == full.total_params
    with pytest.raises(HetplanError, match="exceeds the 40 learned positions"):
        model_from_hf_config(configs["gpt2"], seq_len=41)
    t5 = model_from_hf_config(configs["t5"], seq_len=64, decoder_seq_len=4)  # Galvatron's T5-512/4 shape
    assert t5.meta["decoder_seq_len"] == 4
    enc, dec = t5.layer_index("encoder.block.0"), t5.layer_index("decoder.block.1")
    assert t5.layers[dec].input_bytes == pytest.approx(2 * 64 * (4 + 64))  # decoder state + encoder output
    assert t5.layers[enc].fwd_flops > t5.layers[dec].fwd_flops


def test_hf_matches_presets_of_the_same_architecture() -> None:
    from hetplan.model.presets import get_model

    llama = model_from_hf_config(transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096), name="llama2-7b")
    preset = get_model("llama2-7b")
    assert llama.total_params == preset.total_params == 6_738_415_616  # Llama-2-7B
    assert llama.fwd_flops_per_sample == pytest.approx(preset.fwd_flops_per_sample)
    assert llama.act_bytes_per_sample == pytest.approx(preset.act_bytes_per_sample)
    gpt = model_from_hf_config(transformers.GPT2Config(n_layer=24, n_embd=1024, n_head=16, n_positions=1024),
                               fused_attention=False)
    amp = get_model("gpt2-amp")
    assert [layer.fwd_flops for layer in gpt.layers] == pytest.approx([layer.fwd_flops for layer in amp.layers])
    assert [layer.act_bytes for layer in gpt.layers] == pytest.approx([layer.act_bytes for layer in amp.layers])
    assert unique_params(gpt) == 354_823_168  # GPT-2 medium


def test_hf_t5_matches_the_t5_family_builder() -> None:
    from hetplan.model.families import t5_model

    config = transformers.T5Config(num_layers=2, num_decoder_layers=3, d_model=64, num_heads=4, d_kv=16, d_ff=128,
                                   vocab_size=96)
    hf = model_from_hf_config(config, seq_len=64, decoder_seq_len=16, dtype_bytes=4, fused_attention=False)
    built = t5_model("t5", 2, 3, hidden=64, heads=4, ffn=128, vocab=96, encoder_seq=64, decoder_seq=16,
                     dtype_bytes=4)
    assert unique_params(hf) == numel(build_meta_model(config))
    assert hf.fwd_flops_per_sample == pytest.approx(built.fwd_flops_per_sample)
    assert hf.act_bytes_per_sample == pytest.approx(built.act_bytes_per_sample)


def test_model_types_without_analytic_rules_are_traced() -> None:
    config = transformers.GPTNeoXConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                        intermediate_size=256, vocab_size=96, max_position_embeddings=32)
    spec = model_from_hf_config(config)
    assert spec.meta["costs"].startswith("traced")
    assert [layer.name for layer in spec.layers] == ["gpt_neox.embed_in", "gpt_neox.layers.0",
                                                     "gpt_neox.layers.1", "lm_head"]
    assert unique_params(spec) == numel(build_meta_model(config))
    assert spec.layers[1].fwd_flops == pytest.approx(24 * 32 * 64 * 64 + 4 * 32 * 32 * 64)


# --------------------------------------------------------------------------- HF configs: bad input


def test_hub_name_is_refused_with_one_line() -> None:
    with pytest.raises(HetplanError) as err:
        model_from_hf_config("meta-llama/Llama-2-7b-hf")
    message = str(err.value)
    assert "hub model names cannot be downloaded" in message and "config.json" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "text,match",
    [
        ('{"model_type": "gpt2", "n_layer": 2,', "not valid JSON .* line 1"),
        ('[1, 2]', "holds a JSON object"),
        ('{"n_layer": 2}', 'no "model_type" field'),
        ('{"model_type": "gpt9", "n_layer": 2}', "unknown model_type 'gpt9'"),
        ('{"model_type": "gpt2", "n_embd": 64, "n_head": 4, "vocab_size": 10}', "missing field 'n_layer'"),
        ('{"model_type": "gpt2", "n_layer": 1, "n_embd": 64, "n_head": 5, "vocab_size": 10}',
         "cannot build the gpt2 model|invalid gpt2 config"),
        ('{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": "two", "num_attention_heads": 4, '
         '"intermediate_size": 128, "vocab_size": 10}', "cannot build the llama model|invalid llama config"),
    ],
)
def test_bad_config_files_give_one_line_errors(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(HetplanError, match=match) as err:
        model_from_hf_config(path)
    assert "\n" not in str(err.value)


def test_directory_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(HetplanError, match="has no config.json"):
        model_from_hf_config(tmp_path)


def test_missing_transformers_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(HetplanError, match=r"pip install -e \.\[torch\]"):
        model_from_hf_config(CONFIGS / "gpt2.json")


def test_importers_do_not_import_torch() -> None:
    code = "import sys, hetplan.model, hetplan.model.hf, hetplan.model.trace; assert 'torch' not in sys.modules"
    src = str(Path(__file__).resolve().parent.parent / "src")
    subprocess.run([sys.executable, "-c", code], check=True, env={"PYTHONPATH": src})


# --------------------------------------------------------------------------- tracing nn.Modules


def mlp_stack() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 10))


def test_trace_mlp_stack_exact_params_and_flops() -> None:
    small = model_from_module(mlp_stack(), torch.zeros(2, 32), name="mlp")
    big = model_from_module(mlp_stack(), torch.zeros(16, 32), name="mlp")
    assert [layer.name for layer in small.layers] == ["0", "2", "4"]  # ReLUs join the Linear before them
    assert [layer.params for layer in small.layers] == [32 * 64 + 64, 64 * 48 + 48, 48 * 10 + 10]
    assert [layer.fwd_flops for layer in small.layers] == [2 * 32 * 64, 2 * 64 * 48, 2 * 48 * 10]  # per sample
    assert small.total_params == numel(mlp_stack())
    assert small.seq_len == 1 and small.dtype_bytes == 4
    # activations are per sample: the same at any batch size, so memory is proportional to batch
    assert all(layer.act_bytes > 0 for layer in small.layers[:2])
    assert [layer.act_bytes for layer in big.layers] == [layer.act_bytes for layer in small.layers]
    # first layer keeps its input (32 floats) and its ReLU output (64 floats)
    assert small.layers[0].act_bytes == 4 * (32 + 64)
    assert small.layers[0].input_bytes == 4 * 32 and small.layers[0].output_bytes == 4 * 64
    assert small.layers[-1].output_bytes == 4 * 10
    # bf16 training halves every saved float tensor
    half = model_from_module(mlp_stack(), torch.zeros(2, 32), dtype_bytes=2)
    assert [2 * layer.act_bytes for layer in half.layers] == [layer.act_bytes for layer in small.layers]


class Block(nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.mlp = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 50, h: int = 32, heads: int = 4, layers: int = 3, seq: int = 24) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, h)
        self.pos = nn.Parameter(torch.zeros(seq, h))
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(h)
        self.head = nn.Linear(h, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def test_trace_tiny_transformer() -> None:
    v, h, s, heads = 50, 32, 24, 4
    spec = model_from_module(TinyTransformer, torch.zeros(2, s, dtype=torch.long), name="tiny")
    assert [layer.name for layer in spec.layers] == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    assert [layer.kind for layer in spec.layers] == ["embedding", "block", "block", "block", "head"]
    assert spec.meta["layer_modules"]["head"] == ["norm", "head"]
    block_params = 12 * h * h + 13 * h
    assert spec.layers[1].params == block_params
    assert spec.layers[0].params == v * h + s * h  # the position table is read by the root's forward
    assert spec.layers[-1].params == v * h + 2 * h  # the tied copy and the final norm
    assert spec.layers[0].tied_group == spec.layers[-1].tied_group == "embed.weight"
    assert unique_params(spec) == numel(TinyTransformer())
    # FLOPs: the four linears (24sh^2) and attention (QK^T, scores.V: 4s^2h), counted on meta
    assert spec.layers[1].fwd_flops == pytest.approx(24 * s * h * h + 4 * s * s * h)
    assert spec.layers[1].attention_flops == pytest.approx(4 * s * s * h)
    assert spec.layers[-1].fwd_flops == pytest.approx(2 * s * h * v)
    assert spec.meta["sdpa_flops_added"] == 0.0
    assert spec.num_heads == heads and spec.hidden_size == h and spec.vocab_size == v and spec.seq_len == s
    block = spec.layers[1]
    assert block.tp_max == heads
    assert 0 < block.act_attention_core_bytes < block.act_bytes
    assert 0 < block.act_tp_replicated_bytes < block.act_bytes
    assert block.input_bytes == block.output_bytes == 4 * s * h
    assert block.tp_comm_bytes == 2 * 4 * s * h  # Megatron: after attention and after the MLP
    # linear inputs kept for the weight gradients (4-byte elements): the QKV, projection and first MLP
    # inputs (s x h, hidden-shaped) and the GELU output the second MLP linear reads (s x 4h); the head's
    # linear stays out (FP8 training keeps only the blocks' linear inputs in one byte)
    assert block.act_linear_input_bytes == 4 * s * h * 3 + 4 * s * 4 * h
    assert block.act_linear_input_replicated_bytes == 4 * s * h * 3
    assert spec.layers[-1].act_linear_input_bytes == 0.0


def test_trace_adds_sdpa_flops_when_the_counter_misses_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under FakeTensorMode on CPU, SDPA dispatches to a kernel FlopCounterMode does
    not know (0 FLOPs). Simulate that by hiding bmm from the counter."""
    from torch.utils import flop_counter

    monkeypatch.delitem(flop_counter.flop_registry, torch.ops.aten.bmm)
    s, h = 24, 32
    spec = model_from_module(TinyTransformer, torch.zeros(2, s, dtype=torch.long))
    assert spec.layers[1].fwd_flops == pytest.approx(24 * s * h * h + 4 * s * s * h)
    assert spec.meta["sdpa_flops_added"] == pytest.approx(3 * 4 * s * s * h)


def test_trace_layer_names_and_their_errors() -> None:
    ids = torch.zeros(1, 24, dtype=torch.long)
    spec = model_from_module(TinyTransformer, ids, layer_names=["embed", "blocks.*", "head"])
    assert [layer.name for layer in spec.layers] == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    assert "norm" in spec.meta["layer_modules"]["blocks.2"]  # unlisted work joins the layer before it
    assert unique_params(spec) == numel(TinyTransformer())
    with pytest.raises(HetplanError, match="has no submodule 'blocks.9'"):
        model_from_module(TinyTransformer, ids, layer_names=["blocks.9"])
    with pytest.raises(HetplanError, match="both 'blocks' and its submodule 'blocks.0'"):
        model_from_module(TinyTransformer, ids, layer_names=["blocks", "blocks.0"])
    with pytest.raises(HetplanError, match="matches no submodule"):
        model_from_module(TinyTransformer, ids, layer_names=["decoder.*"])


def test_trace_allocates_nothing_and_leaves_the_module_alone() -> None:
    # 4e10 parameters: 160 GB if allocated; the factory runs under torch.device("meta")
    spec = model_from_module(lambda: nn.Sequential(nn.Linear(200_000, 200_000), nn.Linear(200_000, 8)),
                             torch.zeros(2, 200_000))
    assert spec.total_params == 200_000 * 200_000 + 200_000 + 200_000 * 8 + 8
    real = mlp_stack()
    before = real[0].weight.detach().clone()
    model_from_module(real, torch.ones(2, 32), dtype_bytes=2)
    assert real[0].weight.device.type == "cpu" and real[0].weight.dtype == torch.float32
    assert torch.equal(real[0].weight.detach(), before)


def test_trace_bad_input() -> None:
    class Peeks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.lin(x).sum().item() > 0:  # needs data: impossible on meta
                return x
            return -x

    with pytest.raises(HetplanError, match="meta device cannot provide") as err:
        model_from_module(Peeks(), torch.zeros(2, 4))
    assert "\n" not in str(err.value)
    with pytest.raises(HetplanError, match="not an nn.Module"):
        model_from_module(lambda: 3, torch.zeros(2, 4))
    with pytest.raises(HetplanError, match="factory raised"):
        model_from_module(lambda: nn.Linear(-1, 2), torch.zeros(2, 4))
    with pytest.raises(HetplanError, match="holds no tensor"):
        model_from_module(mlp_stack(), {"x": 3})


# --------------------------------------------------------------------------- traced vs analytic


@pytest.mark.parametrize(
    "key,block_ratio",
    [("gpt2", (0.97, 1.0)), ("bert", (0.97, 1.0)), ("t5", (0.75, 0.95)), ("llama", (0.4, 0.7))],
)
def test_traced_hf_model_agrees_with_the_analytic_path(key: str, block_ratio: tuple[float, float]) -> None:
    """The same HF model, two ways: per-layer names, parameters, tied groups and
    FLOPs are equal (FlopCounterMode counts exactly the analytic matmuls). A
    block's measured activations match the analytic count for BERT and GPT-2
    with a fused GELU, and exceed it where HF code keeps extra copies (T5 and
    Llama: fp32 norm internals; Llama: fp32 softmax, SiLU, repeat_kv); see
    docs/model-import.md."""
    config = small_configs()[key]
    config._attn_implementation = "eager"
    if key == "gpt2":
        config.activation_function = "gelu"  # nn.GELU; the default gelu_new keeps three more tensors
    s = 32
    analytic = model_from_hf_config(config, seq_len=s)
    assert analytic.meta["fused_attention"] is False
    ids = torch.zeros(2, s, dtype=torch.long)
    inputs = {"input_ids": ids, "labels": ids}
    if key == "t5":
        inputs["decoder_input_ids"] = ids
    traced = model_from_module(build_meta_model(config), inputs, dtype_bytes=2)
    assert [layer.name for layer in traced.layers] == [layer.name for layer in analytic.layers]
    assert [layer.params for layer in traced.layers] == [layer.params for layer in analytic.layers]
    assert [layer.tied_group for layer in traced.layers] == [layer.tied_group for layer in analytic.layers]
    assert [layer.fwd_flops for layer in traced.layers] == pytest.approx(
        [layer.fwd_flops for layer in analytic.layers], rel=1e-9
    )
    a, t = analytic.layers[1], traced.layers[1]
    assert block_ratio[0] < a.act_bytes / t.act_bytes <= block_ratio[1]
    if key != "llama":  # with dropout, eager attention keeps exactly Korthikanti's 5as^2 bytes
        assert t.act_attention_core_bytes == pytest.approx(a.act_attention_core_bytes)


def test_tracing_reports_progress_per_layer(monkeypatch) -> None:
    """A long trace (a large HF model on the meta device) says where it is: one
    progress step per layer entered, named by its module path."""
    import hetplan.model.trace as trace_module
    from hetplan.progress import Progress

    seen: list[tuple[str, int | None, str]] = []

    class Recording(Progress):
        def advance(self, steps: int = 1, note: str = "") -> None:
            super().advance(steps, note)
            seen.append((self.label, self.total, note))

    monkeypatch.setattr(trace_module, "Progress", Recording)
    spec = model_from_module(mlp_stack(), torch.zeros(2, 32), name="mlp")
    assert [note for _, _, note in seen] == [layer.name for layer in spec.layers]
    assert {(label, total) for label, total, _ in seen} == {("tracing mlp", 3)}
