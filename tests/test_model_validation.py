"""Bad model input is one line, ``hetplan: error: ...``, naming what to change:
ModelSpec JSON files (types, ranges, unknown keys, limits), HF config.json
files (types, heads that do not divide, limits checked before transformers
builds anything) and files that are not UTF-8 JSON objects."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from hetplan.cli import main
from hetplan.errors import HetplanError
from hetplan.model.presets import get_model, model_names
from hetplan.model.load import load_model
from hetplan.model.spec import MAX_LAYERS, MAX_PARAMS, MAX_SEQ_LEN, ModelSpec

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"


def spec_dict() -> dict[str, Any]:
    """A valid ModelSpec JSON object (what ``hetplan estimate --json`` writes as "model_spec")."""
    return json.loads(json.dumps(get_model("tiny-gpt").to_dict()))


def cli_error(capsys: pytest.CaptureFixture[str], path: Path) -> str:
    """The one stderr line of ``hetplan plan --model path``, which must exit 2."""
    code = main(["plan", "--model", str(path), "--cluster", "local-cpu-2", "--global-batch", "8", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hetplan: error: "), err
    assert "Traceback" not in err
    return lines[0]


def not_json(data: Any) -> bool:
    """Whether ``data`` holds NaN or an infinity, which JSON cannot write."""
    text = json.dumps(data)
    return "NaN" in text or "Infinity" in text


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], Any]:
    def edit(d: dict[str, Any]) -> Any:
        target = d
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return d
    return edit


def _delete(layer: int, key: str) -> Callable[[dict[str, Any]], Any]:
    def edit(d: dict[str, Any]) -> Any:
        del d["layers"][layer][key]
        return d
    return edit


# (edit of the valid spec, words the message must hold)
SPEC_CASES: dict[str, tuple[Callable[[dict[str, Any]], Any], list[str]]] = {
    "bool params": (_set(("layers", 0, "params"), True), ["layer 0 ('embed')", "params", "whole number", "true"]),
    "null seq_len": (_set(("seq_len",), None), ["seq_len", "whole number", "null"]),
    "string seq_len": (_set(("seq_len",), "32"), ["seq_len", "whole number", "'32'"]),
    "string flops": (_set(("layers", 2, "fwd_flops"), "1e9"), ["layer 2 ('layers.1')", "fwd_flops", "a number"]),
    "nan flops": (_set(("layers", 1, "fwd_flops"), math.nan), ["layer 1 ('layers.0')", "fwd_flops",
                                                                "not a finite number"]),
    "inf tied_params": (_set(("layers", 5, "tied_params"), math.inf), ["layer 5 ('head')", "tied_params",
                                                                       "not a finite number"]),
    "negative act_bytes": (_set(("layers", 2, "act_bytes"), -1), ["layer 2", "act_bytes", ">= 0"]),
    "negative hidden_size": (_set(("hidden_size",), -64), ["hidden_size", ">= 0"]),
    "zero seq_len": (_set(("seq_len",), 0), ["seq_len = 0", ">= 1"]),
    "fractional params": (_set(("layers", 3, "params"), 1.5), ["layer 3", "params", "whole number", "1.5"]),
    "fractional tp_max": (_set(("layers", 3, "tp_max"), 2.5), ["layer 3", "tp_max", "whole number"]),
    "dtype 3": (_set(("dtype_bytes",), 3), ["dtype_bytes", "2 or 4"]),
    "unknown layer key": (_set(("layers", 3, "bogus"), 1), ["layer 3 ('layers.2')", "unknown key(s) ['bogus']",
                                                            "allowed", "fwd_flops"]),
    "unknown model key": (_set(("bogus",), 1), ["unknown key(s) ['bogus']", "allowed", "seq_len"]),
    "missing layer key": (_delete(2, "act_bytes"), ["layer 2", "missing key(s) ['act_bytes']"]),
    "no layers": (_set(("layers",), []), ["no layers"]),
    "layers not a list": (_set(("layers",), {"a": 1}), ["layers must be a list"]),
    "layer not an object": (_set(("layers", 2), 3), ["layer 2 must be a JSON object"]),
    "empty layer name": (_set(("layers", 2, "name"), ""), ["layer 2", "name", "non-empty string"]),
    "duplicate layer name": (_set(("layers", 2, "name"), "layers.0"), ["layer 2", "names must be unique"]),
    "meta not an object": (_set(("meta",), [1]), ["meta", "JSON object"]),
    "tied above params": (_set(("layers", 5, "tied_params"), 10**6), ["layer 5", "tied_params"]),
    "replicated above params": (_set(("layers", 1, "params_tp_replicated"), 10**6), ["params_tp_replicated"]),
    "attention above flops": (_set(("layers", 1, "attention_flops"), 1e12), ["attention_flops", "fwd_flops"]),
    "linear inputs above activations": (_set(("layers", 1, "act_linear_input_bytes"), 1e15),
                                        ["layer 1", "act_linear_input_bytes", "exceed act_bytes"]),
    "replicated linear inputs above linear inputs": (_set(("layers", 1, "act_linear_input_replicated_bytes"), 1e14),
                                                     ["act_linear_input_replicated_bytes", "part"]),
    "seq_len above limit": (_set(("seq_len",), MAX_SEQ_LEN + 1), ["seq_len", "limit", str(MAX_SEQ_LEN), "tokens"]),
    "params above limit": (_set(("layers", 1, "params"), MAX_PARAMS + 1), ["layer 1", "params", "limit"]),
    "too many layers": (lambda d: {**d, "layers": [dict(d["layers"][1], name=f"b{i}")
                                                   for i in range(MAX_LAYERS + 1)]},
                        [f"{MAX_LAYERS + 1} layers", f"limit of {MAX_LAYERS}"]),
    "too many params in all": (lambda d: {**d, "layers": [dict(d["layers"][1], name=f"b{i}", params=MAX_PARAMS // 2)
                                                          for i in range(3)]}, ["parameters in all", "limit"]),
    "flops overflow": (_set(("layers", 1, "fwd_flops"), 1e300), ["fwd_flops", "limit"]),
    "top level list": (lambda d: [d], ["holds a JSON list, not an object"]),
    "top level number": (lambda d: 3, ["holds a JSON number"]),
}


@pytest.mark.parametrize("case", list(SPEC_CASES))
def test_bad_model_spec_file_is_one_line(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    edit, words = SPEC_CASES[case]
    path = tmp_path / "model.json"
    data = edit(spec_dict())
    if not_json(data):  # NaN / Infinity: JSON has none (the file reader may refuse them first)
        with pytest.raises(HetplanError) as err:
            ModelSpec.from_dict(data, f"model file {path}")
        line = str(err.value)
        assert "\n" not in line
    else:
        path.write_text(json.dumps(data))
        line = cli_error(capsys, path)
    for word in words:
        assert word in line, line
    if case not in ("top level list", "top level number"):
        assert f"model file {path}" in line


def test_integral_floats_are_whole_numbers(tmp_path: Path) -> None:
    data = spec_dict()
    data["seq_len"] = 32.0
    data["layers"][1]["params"] = float(data["layers"][1]["params"])
    path = tmp_path / "model.json"
    path.write_text(json.dumps(data))
    spec = load_model(str(path))
    assert spec.seq_len == 32 and isinstance(spec.seq_len, int)
    assert isinstance(spec.layers[1].params, int)
    assert spec == get_model("tiny-gpt")


def test_from_dict_names_its_source() -> None:
    data = spec_dict()
    data["layers"][0]["params"] = True
    with pytest.raises(HetplanError, match=r"^plan file p\.json: layer 0 \('embed'\): params must be a whole"):
        ModelSpec.from_dict(data, "plan file p.json")
    with pytest.raises(HetplanError, match="^model description: "):
        ModelSpec.from_dict(data)


def test_model_spec_round_trips() -> None:
    for name in model_names():
        spec = get_model(name)
        assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


# --------------------------------------------------------------------------- HF configs

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100}
GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 100}
T5 = {"model_type": "t5", "num_layers": 2, "d_model": 64, "num_heads": 4, "d_ff": 128, "d_kv": 16,
      "vocab_size": 100}

HF_CASES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "kv heads do not divide": ({**LLAMA, "num_key_value_heads": 3},
                               ["num_key_value_heads = 3", "does not divide num_attention_heads = 4"]),
    "heads do not divide": ({**LLAMA, "num_attention_heads": 5, "num_key_value_heads": 5},
                            ["num_attention_heads = 5 does not divide hidden_size = 64"]),
    "gpt2 heads do not divide": ({**GPT2, "n_head": 5}, ["n_head = 5 does not divide n_embd = 64"]),
    "bool layers": ({**LLAMA, "num_hidden_layers": True}, ["num_hidden_layers", "whole number", "true"]),
    "string layers": ({**LLAMA, "num_hidden_layers": "two"}, ["num_hidden_layers", "whole number", '"two"']),
    "nan hidden": ({**LLAMA, "hidden_size": math.nan}, ["hidden_size", "not a finite number"]),
    "zero hidden": ({**LLAMA, "hidden_size": 0}, ["hidden_size = 0", ">= 1"]),
    "negative vocab": ({**GPT2, "vocab_size": -5}, ["vocab_size = -5", ">= 1"]),
    "fractional heads": ({**LLAMA, "num_attention_heads": 4.5}, ["num_attention_heads", "whole number", "4.5"]),
    "null hidden": ({**LLAMA, "hidden_size": None}, ["hidden_size", "null"]),
    "zero kv heads": ({**LLAMA, "num_key_value_heads": 0}, ["num_key_value_heads = 0"]),
    "string eps": ({**LLAMA, "rms_norm_eps": "1e-5"}, ["rms_norm_eps", "finite number"]),
    "dropout above 1": ({**GPT2, "attn_pdrop": 2}, ["attn_pdrop = 2", "between 0 and 1"]),
    "too many layers": ({**LLAMA, "num_hidden_layers": 100_000},
                        ["num_hidden_layers = 100000", f"limit of {MAX_LAYERS} layers"]),
    "too many gpt2 layers": ({**GPT2, "n_layer": 100_000}, ["n_layer = 100000", f"limit of {MAX_LAYERS}"]),
    "too many t5 layers": ({**T5, "num_layers": 6000}, ["num_layers + num_decoder_layers = 12000", "limit"]),
    "too wide": ({**LLAMA, "hidden_size": 10**9, "num_attention_heads": 1, "num_key_value_heads": 1},
                 ["hidden_size = 1000000000", "parameters", "limit"]),
    "huge vocab": ({**GPT2, "vocab_size": 10**14}, ["vocab_size = 100000000000000", "parameters", "limit"]),
    "huge int": ({**GPT2, "n_embd": 10**400, "n_head": 1}, ["n_embd = 1e+400", "parameters"]),
    "training length above limit": ({**LLAMA, "seq_length": 10**9, "max_position_embeddings": 10**9},
                                    ["seq_length = 1000000000", f"limit of {MAX_SEQ_LEN} tokens"]),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_bad_hf_config_is_one_line(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    config, words = HF_CASES[case]
    path = tmp_path / "config.json"
    if not_json(config):  # NaN: JSON has none (the file reader may refuse it first)
        from hetplan.model.hf import model_from_hf_config

        with pytest.raises(HetplanError) as err:
            model_from_hf_config(config, where=str(path))
        line = str(err.value)
        assert "\n" not in line
    else:
        path.write_text(json.dumps(config))
        line = cli_error(capsys, path)
    assert str(path) in line
    for word in words:
        assert word in line, line


def test_hf_limits_are_checked_before_building(tmp_path: Path) -> None:
    """100,000 layers would take minutes to build on the meta device: refused at once."""
    pytest.importorskip("transformers")
    from hetplan.model.hf import model_from_hf_config

    model_from_hf_config({**GPT2, "n_layer": 1})  # imports transformers' GPT-2 code outside the timing
    for config in ({**GPT2, "n_layer": 100_000}, {**LLAMA, "num_hidden_layers": 100_000}):
        path = tmp_path / "config.json"
        path.write_text(json.dumps(config))
        start = time.perf_counter()
        with pytest.raises(HetplanError, match=f"above hetplan's limit of {MAX_LAYERS} layers"):
            load_model(str(path))
        assert time.perf_counter() - start < 0.5
    start = time.perf_counter()
    with pytest.raises(HetplanError, match="num_key_value_heads = 3 does not divide"):
        model_from_hf_config({**LLAMA, "num_key_value_heads": 3})
    assert time.perf_counter() - start < 0.5


def test_hf_config_objects_are_checked_too() -> None:
    transformers = pytest.importorskip("transformers")
    from hetplan.model.hf import model_from_hf_config

    config = transformers.LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "model_type"})
    config.num_key_value_heads = 3
    with pytest.raises(HetplanError, match="LlamaConfig object: invalid llama config: num_key_value_heads = 3"):
        model_from_hf_config(config)


# --------------------------------------------------------------------------- files


@pytest.mark.parametrize("content", [b'{"model_type": "gpt2", "name": "\xff\xfe"}', b"\xff\xfe{\x00}\x00"])
def test_model_file_not_utf8_is_one_line(content: bytes, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "model.json"
    path.write_bytes(content)
    line = cli_error(capsys, path)
    assert str(path) in line


def test_model_loading_reads_through_read_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hetplan.model.load as model_pkg

    calls: list[str] = []
    real = model_pkg.read_json

    def spy(path: Any, what: str, fix: str = "") -> Any:
        calls.append(str(path))
        return real(path, what, fix)

    monkeypatch.setattr(model_pkg, "read_json", spy)
    path = tmp_path / "model.json"
    path.write_text(json.dumps(spec_dict()))
    assert load_model(str(path)) == get_model("tiny-gpt")
    assert calls == [str(path)]


# --------------------------------------------------------------------------- valid input still loads


@pytest.mark.parametrize("name", model_names())
def test_presets_load(name: str) -> None:
    assert get_model(name).num_layers >= 1


@pytest.mark.parametrize("name", ["gpt2.json", "bert-base-uncased.json", "t5-small.json", "tinyllama-1.1b.json",
                                  "llama-tiny.json"])
def test_example_hf_configs_load(name: str) -> None:
    pytest.importorskip("transformers")
    spec = load_model(str(CONFIGS / name))
    assert spec.num_layers >= 3 and spec.total_params > 0


def test_real_shapes_are_within_the_limits() -> None:
    """The largest public configs pass the checks (checked without building them)."""
    pytest.importorskip("transformers")
    from hetplan.model.hf import check_config_values

    llama_405b = {"model_type": "llama", "hidden_size": 16384, "num_hidden_layers": 126, "num_attention_heads": 128,
                  "num_key_value_heads": 8, "intermediate_size": 53248, "vocab_size": 128256,
                  "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5}
    deepseek_v3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
                   "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
                   "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "moe_intermediate_size": 2048,
                   "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
                   "first_k_dense_replace": 3, "intermediate_size": 18432, "vocab_size": 129280,
                   "max_position_embeddings": 163840}
    deepseek_v2_lite = {**deepseek_v3, "model_type": "deepseek_v2", "q_lora_rank": None}
    qwen3 = {"model_type": "qwen3", "hidden_size": 1000, "num_attention_heads": 16, "num_key_value_heads": 8,
             "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100}  # head_dim defaults to 128
    for config in (llama_405b, deepseek_v3, deepseek_v2_lite, qwen3):
        assert check_config_values(config, config["model_type"], "config") == {}
    scout_context = {**LLAMA, "max_position_embeddings": 10_485_760}  # Llama 4 Scout's positions
    assert check_config_values(scout_context, "llama", "config") == {}
