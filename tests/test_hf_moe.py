"""Mixture-of-experts HF configs (Mixtral, Qwen-MoE, DeepSeek-V2/V3) and the
sequence length an HF config is costed at when none is given.

On the meta device a router routes no real tokens, so before analytic MoE
rules a Mixtral layer was costed as its attention alone. These tests check
that a MoE layer's FLOPs are its attention + router + top-k routed experts +
shared experts, while its parameters are every expert's, exactly as the
transformers model holds them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hetplan.errors import HetplanError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hetplan.model import hf
from hetplan.model.hf import build_meta_model, load_hf_config, model_from_hf_config
from hetplan.model.trace import model_from_module

# Shapes of the public config.json files (mistralai/Mixtral-8x7B-v0.1,
# deepseek-ai/DeepSeek-V3, meta-llama/Llama-3.1-405B), written inline.
MIXTRAL_8X7B: dict[str, Any] = {
    "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 4096,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
    "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 32768,
    "rope_theta": 1e6, "sliding_window": None, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}
DEEPSEEK_V3: dict[str, Any] = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "intermediate_size": 18432, "vocab_size": 129280,
    "max_position_embeddings": 163840, "n_group": 8, "topk_group": 4, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "tie_word_embeddings": False,
}
LLAMA_31_405B: dict[str, Any] = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 16384, "num_hidden_layers": 126,
    "num_attention_heads": 128, "num_key_value_heads": 8, "intermediate_size": 53248, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}

# Scaled-down configs of each MoE model type: same structure, tiny widths.
SMALL: dict[str, dict[str, Any]] = {
    "mixtral": dict(model_type="mixtral", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                    vocab_size=100, max_position_embeddings=64),
    "deepseek_v3": dict(model_type="deepseek_v3", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=16, moe_intermediate_size=32, n_routed_experts=8,
                        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, intermediate_size=96,
                        vocab_size=100, max_position_embeddings=64, n_group=2, topk_group=1),
    "deepseek_v2-lite": dict(model_type="deepseek_v2", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                             num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                             qk_nope_head_dim=16, v_head_dim=16, moe_intermediate_size=32, n_routed_experts=8,
                             num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1,
                             intermediate_size=96, vocab_size=100, max_position_embeddings=64),
    "qwen2_moe": dict(model_type="qwen2_moe", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      shared_expert_intermediate_size=48, intermediate_size=96, vocab_size=100,
                      max_position_embeddings=64, decoder_sparse_step=2, mlp_only_layers=[3]),
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, intermediate_size=96, vocab_size=100, max_position_embeddings=64),
}


def numel(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def routed_expert_params(model: Any) -> int:
    """Parameters of the routed experts (transformers stores each layer's
    experts as 3-D ``mlp.experts.*`` tensors; shared experts are apart)."""
    return sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)


# --------------------------------------------------------------------------- full-size FLOPs vs active params


@pytest.mark.parametrize(
    "config,published_active",
    [
        # Jiang et al. 2024, "Mixtral of Experts": 13B active of 47B (12.9B on the model card)
        (MIXTRAL_8X7B, 12.9e9),
        # DeepSeek-V3 technical report (arXiv:2412.19437), abstract: 37B activated of 671B
        (DEEPSEEK_V3, 37e9),
    ],
    ids=["mixtral-8x7b", "deepseek-v3"],
)
def test_training_flops_per_token_are_six_times_active_params(config: dict[str, Any], published_active: float) -> None:
    """Training FLOPs per token (3 x the forward's, fwd + bwd) against 6 x
    active parameters, the usual dense-equivalent count (Kaplan et al. 2020;
    for MoE the parameters a token passes through).

    * active = every parameter of the meta-built HF model except the routed
      experts a token skips: non-expert + top-k routed + shared experts.
    * Embeddings excluded from the comparison: a lookup does no FLOPs (the
      LM head's matrix is a real GEMM and counts).
    * Attention-score FLOPs (QK^T and scores·V, ``attention_flops``) are not
      parameter FLOPs: excluded from the comparison and checked separately
      against their own formula.
    """
    spec = model_from_hf_config(config)
    model = build_meta_model(load_hf_config(config)[0])
    k, e = config["num_experts_per_tok"], config.get("num_local_experts") or config["n_routed_experts"]
    total = numel(model)
    routed = routed_expert_params(model)
    active = total - routed + routed * k // e
    embedding = model.get_input_embeddings().weight.numel()

    assert spec.total_params == total  # every expert counted in the parameters
    assert spec.meta["moe"]["active_params"] == active
    assert active == pytest.approx(published_active, rel=0.02)

    s = spec.seq_len
    assert s == 4096 and spec.meta["seq_len_default"]
    score_flops = sum(layer.attention_flops for layer in spec.layers) / s
    train_per_token = 3 * (spec.fwd_flops_per_sample / s - score_flops)
    assert train_per_token == pytest.approx(6 * (active - embedding), rel=0.10)  # the required 10 %
    assert train_per_token == pytest.approx(6 * (active - embedding), rel=1e-3)  # only norm weights differ

    # attention scores, per token: 2·s·heads·(qk width + v width) per layer (Narayanan et al. 2021)
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    if "kv_lora_rank" in config:
        qk, v = config["qk_nope_head_dim"] + config["qk_rope_head_dim"], config["v_head_dim"]
    else:
        qk = v = config["hidden_size"] // heads
    assert score_flops == pytest.approx(layers * 2 * s * heads * (qk + v))


def test_mixtral_layer_flops_by_hand() -> None:
    """One Mixtral-8x7B layer at seq s, per sample: Q/K/V/O projections
    (GQA), attention scores, router, and 2 of 8 SwiGLU experts."""
    s = 1024
    h, a, kv, f, e, k = 4096, 32, 8, 14336, 8, 2
    d = h // a
    spec = model_from_hf_config(MIXTRAL_8X7B, seq_len=s)
    layer = spec.layers[spec.layer_index("model.layers.0")]
    assert layer.kind == "moe"
    projections = 2 * s * (h * h + 2 * h * kv * d + h * h)
    scores = 2 * 2 * s * s * h
    router = 2 * s * h * e
    experts = 2 * (k * s) * 3 * h * f
    assert layer.fwd_flops == pytest.approx(projections + scores + router + experts)
    assert layer.params == 2 * h + (2 * h * h + 2 * h * kv * d) + h * e + e * 3 * h * f  # all 8 experts
    assert not spec.meta["seq_len_default"]


# --------------------------------------------------------------------------- small configs of each type


@pytest.mark.parametrize("key", list(SMALL))
def test_moe_params_equal_the_meta_model(key: str) -> None:
    config = load_hf_config(SMALL[key])[0]
    spec = model_from_hf_config(config)
    model = build_meta_model(config)
    assert spec.family == "moe" and spec.meta["costs"].startswith("analytic")
    modules = dict(model.named_modules())
    for layer in spec.layers:
        params = {id(p): p for path in spec.meta["layer_modules"][layer.name] for p in modules[path].parameters()}
        assert layer.params == sum(p.numel() for p in params.values())
        assert 0 <= layer.params_tp_replicated <= layer.params
    assert spec.total_params == numel(model)
    # the analytic rules describe the same model: their own parameter count is
    # exact where no small term is left out (Qwen's Q/K/V biases and Q/K norms are)
    analytic = hf._analytic_layers(config, "moe", hf.hf_layer_modules(model), 64, 64, 2, True)
    for built, rule in zip(spec.layers, analytic):
        if key.startswith(("mixtral", "deepseek")):
            assert rule.params == built.params, built.name
        else:
            assert 0 <= built.params - rule.params <= 2 * config.hidden_size, built.name


def test_dense_and_moe_layers_follow_the_config() -> None:
    ds = model_from_hf_config(SMALL["deepseek_v3"])  # first_k_dense_replace=1
    assert [layer.kind for layer in ds.layers] == ["embedding", "decoder", "moe", "moe", "head"]
    assert ds.meta["moe"]["latent_attention"] and ds.meta["moe"]["moe_layers"] == 2
    qwen = model_from_hf_config(SMALL["qwen2_moe"])  # every 2nd layer sparse, layer 3 forced dense
    assert [layer.kind for layer in qwen.layers] == ["embedding", "decoder", "moe", "decoder", "decoder", "head"]
    full = model_from_hf_config(DEEPSEEK_V3)
    kinds = [layer.kind for layer in full.layers]
    assert kinds[1:4] == ["decoder"] * 3 and kinds[4:-1] == ["moe"] * 58
    assert full.layers[1].tp_max == 128  # latent attention: TP splits the 128 heads


@pytest.mark.parametrize("key", ["mixtral", "deepseek_v3", "qwen2_moe"])
def test_traced_moe_counts_expert_flops_like_the_analytic_rules(key: str) -> None:
    """The tracer counts transformers' grouped expert GEMMs (``aten._grouped_mm``),
    so a traced MoE model gets the same FLOPs per layer as the analytic rules."""
    config = load_hf_config(SMALL[key])[0]
    analytic = model_from_hf_config(config, seq_len=32)
    traced = model_from_module(build_meta_model(config), {"input_ids": torch.zeros(2, 32, dtype=torch.long)},
                               dtype_bytes=2, family=config.model_type)
    assert [layer.name for layer in traced.layers] == [layer.name for layer in analytic.layers]
    assert [layer.fwd_flops for layer in traced.layers] == pytest.approx(
        [layer.fwd_flops for layer in analytic.layers], rel=1e-9)
    assert traced.total_params == analytic.total_params


# --------------------------------------------------------------------------- bad input


def test_transformers_without_the_model_type_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.models.auto import configuration_auto

    real = configuration_auto.CONFIG_MAPPING

    class Older:  # the lazy mapping of a transformers release without DeepSeek-V3
        def __contains__(self, model_type: str) -> bool:
            return model_type != "deepseek_v3" and model_type in real

        def __getitem__(self, model_type: str) -> Any:
            if model_type not in self:
                raise KeyError(model_type)
            return real[model_type]

    monkeypatch.setattr(configuration_auto, "CONFIG_MAPPING", Older())
    with pytest.raises(HetplanError, match=r"predates model_type 'deepseek_v3'.*pip install -U transformers") as err:
        model_from_hf_config(DEEPSEEK_V3)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("field", ["num_local_experts", "num_experts_per_tok"])
def test_missing_expert_fields_are_errors(field: str) -> None:
    config = {k: v for k, v in SMALL["mixtral"].items() if k != field}
    with pytest.raises(HetplanError, match=f"missing field '{field}'"):
        model_from_hf_config(config)


def test_top_k_beyond_the_experts_is_an_error() -> None:
    with pytest.raises(HetplanError, match="set num_experts_per_tok between 1 and the number of experts"):
        model_from_hf_config(dict(SMALL["mixtral"], num_experts_per_tok=5))


# --------------------------------------------------------------------------- default sequence length


def small_llama(**extra: Any) -> dict[str, Any]:
    return dict(model_type="llama", hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                intermediate_size=128, vocab_size=96, **extra)


@pytest.mark.parametrize(
    "config,seq,source",
    [
        # Llama 3.1: 128K positions by RoPE scaling from an 8K pre-training length
        (small_llama(max_position_embeddings=131072,
                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
         8192, "rope_scaling.original_max_position_embeddings"),
        # yarn without original_max_position_embeddings: transformers fills in the maximum; not a training length
        (small_llama(max_position_embeddings=32768, rope_scaling={"type": "yarn", "factor": 4.0}), 4096, "default"),
        (small_llama(max_position_embeddings=32768), 4096, "default"),  # Mistral/Qwen2-style: no stated length
        (small_llama(max_position_embeddings=2048), 2048, "positions"),  # never past the model's positions
        (small_llama(max_position_embeddings=32768, seq_length=8192), 8192, "seq_length"),
        (dict(SMALL["mixtral"], max_position_embeddings=32768), 4096, "default"),
        (dict(model_type="gpt2", n_layer=1, n_embd=64, n_head=4, vocab_size=96, n_positions=40), 40, "positions"),
    ],
)
def test_default_seq_len(config: dict[str, Any], seq: int, source: str) -> None:
    spec = model_from_hf_config(config)
    assert (spec.seq_len, spec.meta["seq_len_source"], spec.meta["seq_len_default"]) == (seq, source, True)
    given = model_from_hf_config(config, seq_len=16)
    assert given.seq_len == 16 and given.meta["seq_len_default"] is False


def test_default_seq_len_of_traced_model_types() -> None:
    """Model types without analytic rules get the same rule (BLOOM has ALiBi,
    no positions: it used to be costed at 512 without a word)."""
    bloom = dict(model_type="bloom", n_layer=1, hidden_size=32, n_head=4, vocab_size=96)
    spec = model_from_hf_config(bloom)
    assert spec.meta["costs"].startswith("traced")
    assert (spec.seq_len, spec.meta["seq_len_source"], spec.meta["seq_len_default"]) == (4096, "default", True)
    neox = dict(model_type="gpt_neox", num_hidden_layers=1, hidden_size=32, num_attention_heads=4,
                intermediate_size=64, vocab_size=96, max_position_embeddings=32)
    assert model_from_hf_config(neox).seq_len == 32


def hetplan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hetplan.cli", *args], capture_output=True, text=True, timeout=120)


def test_llama_405b_plans_at_its_pretraining_length_without_seq_len(tmp_path: Path) -> None:
    """At 131,072 tokens (max_position_embeddings, the old default) no plan
    fits 512 H100s; at the 8,192-token pre-training length one does, and the
    header says the length was a default."""
    path = tmp_path / "llama-3.1-405b.json"
    path.write_text(json.dumps(LLAMA_31_405B))
    result = hetplan("plan", "--model", str(path), "--cluster", "512xH100", "--planner", "uniform", "--quiet")
    assert result.returncode == 0, result.stderr
    header = result.stdout.splitlines()[0]
    assert "406B params" in header and "seq 8192 (default; set --seq-len)" in header


def test_no_fit_error_hints_at_seq_len_for_hf_configs(capsys: pytest.CaptureFixture[str]) -> None:
    from hetplan.cli import main

    config = str(Path(__file__).resolve().parent.parent / "examples" / "configs" / "llama-tiny.json")
    common = ["--cluster", "2xA100-80GB", "--planner", "uniform", "--memory-limit", "1GB", "--global-batch", "8",
              "--quiet"]
    assert main(["plan", "--model", config, *common]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hetplan: error: no plan fits") and "\n" not in err
    assert "a shorter --seq-len (now 512, the default for this HF config)" in err
    assert main(["plan", "--model", "gpt2-amp", *common]) == 2  # presets have no --seq-len: no hint
    assert "--seq-len" not in capsys.readouterr().err


def test_fine_grained_experts_get_a_fidelity_note(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Routed experts narrower than the hidden size (Qwen3-30B-A3B: 768 <
    2048) are the one kind of model whose published runs hetplan costs far too
    fast: ``hetplan estimate`` says so. Mixtral's experts (14336 > 4096) and
    dense models get no such note."""
    from hetplan.cli import main
    from hetplan.app.explain import fine_grained_moe_note

    data = json.loads((Path(__file__).parents[1] / "benchmarks/data/megatron_bridge_h100.json").read_text())
    qwen = model_from_hf_config(data["hf_configs"]["qwen3-30b-a3b"], seq_len=4096)
    note = fine_grained_moe_note(qwen)
    assert "768 < hidden 2048" in note and "optimistic" in note
    assert fine_grained_moe_note(model_from_hf_config(MIXTRAL_8X7B, seq_len=4096)) == ""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(data["hf_configs"]["qwen3-30b-a3b"]))
    assert main(["estimate", "--model", str(config), "--cluster", "16xH100", "--seq-len", "4096", "--tp", "1",
                 "--pp", "2", "--dp", "8", "--ep", "8", "--micro-batch", "1", "--global-batch", "64",
                 "--target", "any"]) == 0  # a Megatron-Bridge run: not hetplan's runtime
    assert "note: this model's routed experts are fine-grained" in capsys.readouterr().out
