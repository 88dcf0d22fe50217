"""Build a ModelSpec from a HuggingFace ``transformers`` config, without weights.

``model_from_hf_config("path/to/config.json")`` reads the config, builds the
model with ``from_config`` under ``torch.device("meta")`` (shapes only, no
memory, no download) and returns one layer per embedding, block and head, in
execution order (T5: encoder, then decoder), named by the real module path in
the HF model (``transformer.h.3``, ``model.layers.0``, ``bert.encoder.layer.5``,
``encoder.block.0``) so a runtime can cut pipeline stages by those names.

* **Parameters are measured**: each layer's count is ``numel`` summed over the
  parameters of its modules on the meta model. A tied parameter (GPT-2's
  ``lm_head`` is ``transformer.wte``; T5's ``shared`` embedding is used by the
  encoder, the decoder and the LM head) is counted in every layer
  that uses it (each pipeline stage holding such a layer keeps a copy) and the
  layers get the same ``tied_group``; ``tied_params`` (or, if LayerSpec lacks
  that field, ``meta["tied_params"]``) says how much of a layer an earlier
  layer already counts, so ``ModelSpec.total_params`` equals
  ``sum(p.numel() for p in model.parameters())``.
* **Work and memory are analytic** (``hetplan.model.layers``, after Korthikanti
  et al. 2022): FLOPs, activation bytes (with the TP-replicated and
  attention-core parts), TP communication, from the config's shape: hidden
  size, heads, KV heads, head width, MLP width, gated MLP, biases, LayerNorm vs
  RMSNorm, dropout, vocabulary, T5's cross-attention and relative position bias.
  Attention is costed as fused (no score matrix kept) when the model is built
  with SDPA/FlashAttention, which transformers does by default; T5 gets the
  same HF-specific flags as the T5 presets (ReLU, MLP dropout, eager RMSNorm).
  ``hetplan.model.trace`` measures the same things on the meta model instead;
  ``docs/model-import.md`` compares the two.

Model types with analytic rules: GPT-2, BERT/RoBERTa/XLM-R/CamemBERT (masked
LM), T5/mT5 (seq2seq LM), Llama/Mistral/Qwen2/Qwen3 (causal LM), and the
mixture-of-experts decoders Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3
(routed top-k experts, shared experts, dense first layers, DeepSeek's latent
attention). Any other model type transformers knows is traced
(``hetplan.model.trace``) with token ids (or pixel values for vision models)
as the example input.

Analytic rules matter most for MoE models: on the meta device the router
routes no real tokens, so only an analytic count (or the tracer's count of
grouped expert GEMMs) gives a MoE layer its experts' FLOPs.

Sequence length: what the config states as its training length, else
``DEFAULT_SEQ_LEN``, never more than the model's positions (``_default_seq_len``).
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

from hetplan.errors import HetplanError
from hetplan.model.layers import (
    MASK_BYTES,
    BlockShape,
    MLAShape,
    MoEShape,
    embedding_layer,
    lm_head_layer,
    transformer_block,
)
from hetplan.model.origin import HFSource
from hetplan.model.spec import MAX_LAYERS, MAX_PARAMS, MAX_SEQ_LEN, LayerSpec, ModelSpec, show_number
from hetplan.runtime.support import inspect_model
from hetplan.model.trace import model_from_module

_FAMILIES = {
    "gpt2": "gpt",
    "bert": "bert",
    "roberta": "bert",
    "xlm-roberta": "bert",
    "camembert": "bert",
    "t5": "t5",
    "mt5": "t5",
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "mixtral": "moe",
    "qwen2_moe": "moe",
    "qwen3_moe": "moe",
    "deepseek_v2": "moe",
    "deepseek_v3": "moe",
}
_AUTO_CLASS = {
    "gpt": "AutoModelForCausalLM",
    "llama": "AutoModelForCausalLM",
    "moe": "AutoModelForCausalLM",
    "bert": "AutoModelForMaskedLM",
    "t5": "AutoModelForSeq2SeqLM",
}
# Shape fields a config.json must state: transformers would otherwise silently
# fill in its defaults (a config without "n_layer" becomes a 12-layer GPT-2).
# Each entry lists the accepted spellings.
_REQUIRED: dict[str, list[tuple[str, ...]]] = {
    "gpt": [("n_embd", "hidden_size"), ("n_layer", "num_hidden_layers"), ("n_head", "num_attention_heads"),
            ("vocab_size",)],
    "bert": [("hidden_size",), ("num_hidden_layers",), ("num_attention_heads",), ("intermediate_size",),
             ("vocab_size",)],
    "t5": [("d_model",), ("num_layers",), ("num_heads",), ("d_ff",), ("d_kv",), ("vocab_size",)],
    "llama": [("hidden_size",), ("num_hidden_layers",), ("num_attention_heads",), ("intermediate_size",),
              ("vocab_size",)],
    "moe": [("hidden_size",), ("num_hidden_layers",), ("num_attention_heads",), ("vocab_size",),
            ("num_experts_per_tok",)],
}
# MoE fields per model type on top of the family's (the expert count, widths, dense layers, MLA ranks).
_REQUIRED_MOE: dict[str, list[tuple[str, ...]]] = {
    "mixtral": [("intermediate_size",), ("num_local_experts",)],
    "qwen2_moe": [("num_experts",), ("moe_intermediate_size",), ("shared_expert_intermediate_size",),
                  ("intermediate_size",)],
    "qwen3_moe": [("num_experts",), ("moe_intermediate_size",), ("intermediate_size",)],
    "deepseek_v2": [("n_routed_experts",), ("moe_intermediate_size",), ("n_shared_experts",),
                    ("first_k_dense_replace",), ("intermediate_size",), ("kv_lora_rank",), ("q_lora_rank",),
                    ("qk_nope_head_dim",), ("qk_rope_head_dim",), ("v_head_dim",)],
}
_REQUIRED_MOE["deepseek_v3"] = _REQUIRED_MOE["deepseek_v2"]
T5_DEFAULT_SEQ_LEN = 512  # T5 has relative positions; 512 is the paper's input length (Raffel et al. 2020, §3.1.2)
# Sequence length when a config states no training length: the pre-training
# context of Llama 2 (Touvron et al. 2023, arXiv:2307.09288, Table 1: 4k) and
# of DeepSeek-V3 (DeepSeek-AI 2024, arXiv:2412.19437, §4.2: 4K in
# pre-training). A config's max_position_embeddings is its long-context limit
# (131,072 for Llama 3.1), not a length anyone pre-trains at.
DEFAULT_SEQ_LEN = 4096
# Config fields that state the length a model trains at, checked in this
# order: Megatron's "seq_length" (carried by ChatGLM and Qwen-1 configs),
# MPT's "max_seq_len", "max_sequence_length", and GPT-2/CTRL's "n_ctx" (CTRL
# trains on 256-token windows with 50,000 positions: Keskar et al. 2019,
# arXiv:1909.05858). RoPE scaling's original_max_position_embeddings (Llama
# 3.1: 8192, DeepSeek-V3: 4096) is the length before long-context extension.
_TRAINING_LENGTH_FIELDS = ("seq_length", "max_seq_len", "max_sequence_length", "n_ctx")
# Numeric config fields checked before transformers sees the config (any
# model type; absent or null fields are left to transformers' defaults,
# except the shape fields a family requires, _REQUIRED): a boolean, a string,
# a fraction, NaN or a value below the minimum is refused naming the key.
# Layer counts are also held to MAX_LAYERS: transformers builds every layer,
# even on the meta device, so 10^5 layers would take minutes.
_LAYER_COUNT_FIELDS = ("n_layer", "num_hidden_layers", "num_layers", "num_decoder_layers", "n_layers",
                       "encoder_layers", "decoder_layers")
_HIDDEN_FIELDS = ("n_embd", "hidden_size", "d_model")
_INT_FIELDS: dict[str, int] = {  # field: minimum
    **{key: 1 for key in _LAYER_COUNT_FIELDS + _HIDDEN_FIELDS + _TRAINING_LENGTH_FIELDS},
    **{key: 1 for key in (
        "n_head", "num_attention_heads", "num_heads", "num_key_value_heads", "intermediate_size", "n_inner", "d_ff",
        "d_kv", "head_dim", "vocab_size", "max_position_embeddings", "n_positions", "moe_intermediate_size",
        "num_local_experts", "num_experts_per_tok", "n_routed_experts", "kv_lora_rank", "q_lora_rank",
        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "decoder_sparse_step")},
    **{key: 0 for key in ("num_experts", "shared_expert_intermediate_size", "n_shared_experts",
                          "first_k_dense_replace", "type_vocab_size")},
}
_FLOAT_FIELDS: dict[str, tuple[float, float, bool]] = {  # field: (low, high, low allowed)
    **{key: (0.0, 1.0, True) for key in (
        "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout_prob", "attention_probs_dropout_prob",
        "dropout_rate", "attention_dropout", "hidden_dropout")},
    **{key: (0.0, math.inf, False) for key in ("layer_norm_epsilon", "layer_norm_eps", "rms_norm_eps", "rope_theta")},
}
# Model types whose head width is not hidden / heads when a config leaves
# head_dim out (Qwen3: 128; DeepSeek: latent attention's own widths).
_OWN_HEAD_DIM = ("qwen3", "deepseek_v2", "deepseek_v3")


def _import_transformers() -> tuple[Any, Any]:
    try:
        import torch
        import transformers
    except ImportError:
        raise HetplanError(
            "building a model from a HF config needs torch and transformers; run: pip install -e .[torch]"
        ) from None
    return torch, transformers


def load_hf_config(source: Any, where: str | None = None) -> tuple[Any, str]:
    """A ``transformers.PretrainedConfig`` and a description of where it came from.

    ``source`` is a config object, a dict of config values, or the path of a
    ``config.json`` (or of a directory holding one). Hub names are refused:
    nothing can be downloaded here. ``where`` names a dict in messages (the
    file it was read from). Sizes are checked (types, ranges, heads that
    divide, hetplan's limits) before any model is built.
    """
    _, transformers = _import_transformers()
    if isinstance(source, transformers.PretrainedConfig):
        where = where or f"{type(source).__name__} object"
        for key, value in check_config_values(source.to_dict(), source.model_type, where).items():
            setattr(source, key, value)
        return source, where
    if isinstance(source, dict):
        where = where or "config dict"
        return _config_from_dict(dict(source), where, transformers), where
    if not isinstance(source, (str, os.PathLike)):
        raise HetplanError(
            f"expected a config.json path or a transformers PretrainedConfig, got {type(source).__name__}"
        )
    path = Path(source)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise HetplanError(f"directory {str(path)!r} has no config.json; pass the config file itself")
        path = path / "config.json"
    elif not path.is_file():
        raise HetplanError(
            f"{str(source)!r} is not a local file or directory; hub model names cannot be downloaded here, "
            "pass the path of a local config.json (or of a directory holding one)"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise HetplanError(
            f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise HetplanError(f"{path}: cannot read it ({exc})") from None
    if not isinstance(data, dict):
        raise HetplanError(f"{path}: a config.json holds a JSON object, not {type(data).__name__}")
    return _config_from_dict(data, str(path), transformers), str(path)


def _config_from_dict(data: dict[str, Any], where: str, transformers: Any) -> Any:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = data.get("model_type")
    if not model_type or not isinstance(model_type, str):
        raise HetplanError(f"{where}: no \"model_type\" field; add one, e.g. \"model_type\": \"gpt2\"")
    if model_type not in CONFIG_MAPPING and model_type in _FAMILIES:
        raise HetplanError(
            f"{where}: transformers {transformers.__version__} predates model_type {model_type!r}; "
            "upgrade it (pip install -U transformers) to import this config"
        )
    if model_type not in CONFIG_MAPPING:
        raise HetplanError(
            f"{where}: unknown model_type {model_type!r}; transformers {transformers.__version__} has no such "
            "model (check the spelling, e.g. \"gpt2\", \"bert\", \"t5\", \"llama\")"
        )
    family = _FAMILIES.get(model_type)
    if family:
        for spellings in _REQUIRED[family] + _REQUIRED_MOE.get(model_type, []):
            if not any(s in data for s in spellings):
                raise HetplanError(
                    f"{where}: missing field {spellings[0]!r} (needed for a {model_type} model; "
                    "transformers would silently use its default)"
                )
    data.update(check_config_values(data, model_type, where))
    config_class = CONFIG_MAPPING[model_type]
    try:
        with _quiet(transformers):
            return config_class.from_dict({k: v for k, v in data.items() if k != "model_type"})
    except Exception as exc:
        raise HetplanError(f"{where}: invalid {model_type} config: {_first_line(exc)}") from None


def check_config_values(data: dict[str, Any], model_type: str, where: str) -> dict[str, Any]:
    """Check a HF config's sizes before transformers builds anything: types
    and ranges (``_INT_FIELDS``, ``_FLOAT_FIELDS``), heads that divide the
    hidden size, KV heads that divide the heads, and hetplan's limits on
    layers (``MAX_LAYERS``) and parameters (``MAX_PARAMS``, estimated from
    the widths). Returns the fields to change (integral floats as ints);
    raises a one-line HetplanError naming ``where`` and the key."""
    family = _FAMILIES.get(model_type)
    bad = f"{where}: invalid {model_type} config"
    required = {key for spellings in _REQUIRED.get(family or "", []) for key in spellings}  # null is no size
    fixed: dict[str, Any] = {}
    for key, minimum in _INT_FIELDS.items():
        value = data.get(key)
        if value is None and (key not in required or key not in data) or (
            family is None and isinstance(value, (list, dict))
        ):
            continue  # transformers' default; a list (Swin's num_heads per stage) in a model hetplan traces
        if isinstance(value, float) and not math.isfinite(value):
            raise HetplanError(f"{bad}: {key} is not a finite number ({value}); give a whole number >= {minimum}")
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or (
            not isinstance(value, numbers.Integral) and not float(value).is_integer()
        ):
            shown = json.dumps(value) if isinstance(value, (bool, type(None), str)) else repr(value)
            raise HetplanError(f"{bad}: {key} must be a whole number, got {shown}")
        if value < minimum:
            raise HetplanError(f"{bad}: {key} = {value} must be >= {minimum}")
        if not isinstance(value, numbers.Integral):
            fixed[key] = value = int(float(value))  # an integral float (checked above)
    for key, (low, high, low_ok) in _FLOAT_FIELDS.items():
        value = data.get(key)
        if value is None or family is None and isinstance(value, (list, dict)):
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            shown = json.dumps(value) if isinstance(value, (bool, str)) else repr(value)
            raise HetplanError(f"{bad}: {key} must be a finite number, got {shown}")
        real = float(value)  # a finite real (checked above)
        if not (low <= real if low_ok else low < real) or real > high:
            span = f"between {low:g} and {high:g}" if high < math.inf else f"above {low:g}"
            raise HetplanError(f"{bad}: {key} = {value} must be {span}")
    values = {**data, **fixed}

    def get(*keys: str) -> int:
        return next((v for k in keys if isinstance(v := values.get(k), int) and not isinstance(v, bool)), 0)

    layers = 0
    for key in _LAYER_COUNT_FIELDS:
        n = get(key)
        if n > MAX_LAYERS:
            raise HetplanError(
                f"{where}: {key} = {show_number(n)} is above hetplan's limit of {MAX_LAYERS} layers "
                "(the deepest models trained have a few hundred); check the value"
            )
        layers = max(layers, n)
    if family == "t5":
        layers = get("num_layers") + (get("num_decoder_layers") or get("num_layers"))
        if layers > MAX_LAYERS:
            raise HetplanError(f"{where}: num_layers + num_decoder_layers = {show_number(layers)} is above "
                               f"hetplan's limit of {MAX_LAYERS} layers; check the values")
    hidden_key = next((k for k in _HIDDEN_FIELDS if get(k)), "")
    heads_key = next((k for k in ("n_head", "num_attention_heads", "num_heads") if get(k)), "")
    hidden, heads, kv_heads = get(hidden_key), get(heads_key), get("num_key_value_heads")
    derived_head_dim = family in ("gpt", "bert") or family in ("llama", "moe") and (
        values.get("head_dim") is None and model_type not in _OWN_HEAD_DIM
    )
    if derived_head_dim and hidden and heads and hidden % heads:
        raise HetplanError(f"{bad}: {heads_key} = {heads} does not divide {hidden_key} = {hidden}; "
                           f"use a number of heads that divides {hidden}")
    if heads and kv_heads and heads % kv_heads:
        raise HetplanError(f"{bad}: num_key_value_heads = {kv_heads} does not divide {heads_key} = {heads}; "
                           f"use a divisor of {heads} (1 for multi-query, {heads} for multi-head attention)")
    # Parameters, estimated from the widths: every block holds at least its
    # attention output projection (hidden^2) and its MLP (2 x hidden x width
    # per expert); embedding and learned position tables hold hidden per row.
    sizes = {k: get(k) for k in (hidden_key, "intermediate_size", "n_inner", "d_ff", "moe_intermediate_size",
                                 "num_local_experts", "n_routed_experts", "num_experts", "vocab_size",
                                 "n_positions", "max_position_embeddings") if k and get(k)}
    ffn = get("intermediate_size", "n_inner", "d_ff") or (4 * hidden if family == "gpt" else 0)
    experts = get("num_local_experts", "n_routed_experts", "num_experts")
    expert_ffn = get("moe_intermediate_size") or ffn
    learned = get("n_positions", "max_position_embeddings") if family in ("gpt", "bert") else 0
    estimate = layers * (hidden * hidden + 2 * hidden * max(ffn, experts * expert_ffn))
    estimate += (get("vocab_size") + learned) * hidden
    if estimate > MAX_PARAMS:
        listed = ", ".join(f"{k} = {show_number(v)}" for k, v in sizes.items())
        raise HetplanError(
            f"{where}: {layers} layers with {listed} mean about {show_number(estimate)} parameters, above hetplan's "
            f"limit of {MAX_PARAMS:.0e}; check the sizes"
        )
    return fixed


@contextlib.contextmanager
def _quiet(transformers: Any) -> Iterator[None]:
    """Silence transformers' logger and Python warnings (config advice, meta-device notes)."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(verbosity)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:300]


def build_meta_model(config: Any, where: str = "config") -> Any:
    """The HF model for ``config`` with every tensor on the meta device."""
    torch, transformers = _import_transformers()
    family = _FAMILIES.get(config.model_type)
    candidates = [_AUTO_CLASS[family]] if family else []
    for arch in getattr(config, "architectures", None) or []:
        if hasattr(transformers, arch):
            candidates.append(arch)
    candidates += ["AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForSeq2SeqLM", "AutoModel"]
    last_error: Exception | None = None
    with _quiet(transformers):
        for cls_name in candidates:
            cls = getattr(transformers, cls_name)
            try:
                with torch.device("meta"):
                    if cls_name.startswith("Auto"):
                        return cls.from_config(config)
                    return cls._from_config(config)
            except ValueError as exc:
                if "Unrecognized configuration class" in str(exc):
                    last_error = exc
                    continue
                raise HetplanError(f"{where}: cannot build the {config.model_type} model: {_first_line(exc)}") from None
            except Exception as exc:
                raise HetplanError(f"{where}: cannot build the {config.model_type} model: {_first_line(exc)}") from None
    raise HetplanError(
        f"{where}: transformers has no model class for {config.model_type!r}"
        + (f" ({_first_line(last_error)})" if last_error else "")
    )


# --------------------------------------------------------------------------- layer modules


def hf_layer_modules(model: Any) -> list[tuple[str, list[str]]]:
    """The model's layers as (kind, module paths), in execution order.

    Blocks are the children of the model's block lists (``transformer.h``,
    ``model.layers``, ``encoder.block`` ...). The modules registered before the
    first list form the embedding layer, those after the last form the head.
    Between two lists (T5), modules of the first list's stack (its final norm)
    join its last block, and the rest (the decoder's embedding) form a layer.
    Kinds: "embedding", "block:<list index>", "head".
    """
    containers = _block_lists(model)
    if not containers:
        raise HetplanError(f"{type(model).__name__}: found no list of transformer blocks")
    items: list[tuple[str, Any]] = []  # ("free", path) or ("blocks", container index)
    taken: list[str] = []
    for path, _ in model.named_modules():
        if path == "":
            continue
        in_container = next((i for i, c in enumerate(containers) if path == c or path.startswith(c + ".")), None)
        if in_container is not None:
            if path == containers[in_container]:
                items.append(("blocks", in_container))
            continue
        if any(path.startswith(c + ".") for c in containers) or any(c.startswith(path + ".") for c in containers):
            continue  # an ancestor of a block list: structure, not a layer
        if any(path.startswith(t + ".") for t in taken):
            continue  # inside a module already taken whole
        taken.append(path)
        items.append(("free", path))

    layers: list[tuple[str, list[str]]] = []
    pending: list[str] = []
    prev_container: int | None = None
    modules = dict(model.named_modules())
    for kind, value in items:
        if kind == "free":
            pending.append(value)
            continue
        cpath = containers[value]
        if prev_container is None:
            layers.append(("embedding", pending))
        else:
            stack = containers[prev_container].rsplit(".", 1)[0] if "." in containers[prev_container] else ""
            tail = [p for p in pending if stack and p.startswith(stack + ".")]
            rest = [p for p in pending if p not in tail]
            layers[-1][1].extend(tail)
            layers.append(("embedding", rest))
        for child_name, _ in modules[cpath].named_children():
            layers.append((f"block:{value}", [f"{cpath}.{child_name}"]))
        pending = []
        prev_container = value
    layers.append(("head", pending))
    return layers


def _block_lists(model: Any) -> list[str]:
    """The top-most ModuleLists whose children are all blocks of one class
    (``transformer.h``, ``model.layers``, ``encoder.block``), even with a
    single block (1-layer configs)."""
    torch, _ = _import_transformers()
    found = []
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) >= 1:
            kids = list(module.children())
            if len({type(k) for k in kids}) == 1 and all(
                any(True for _ in k.parameters()) and any(True for _ in k.children()) for k in kids
            ):
                found.append(path)
    return [p for p in found if not any(p.startswith(q + ".") for q in found)]


def _layer_name(kind: str, paths: list[str], model: Any) -> str:
    """Embedding layers are named by their first module with parameters that
    is not a mere alias (T5's unused ``shared``), heads by their last one."""
    modules = dict(model.named_modules())
    with_params = [p for p in paths if any(True for _ in modules[p].parameters())]
    if not with_params:
        return paths[0] if paths else kind
    if kind == "head":
        return with_params[-1]
    for p in with_params:
        own = {id(t) for t in modules[p].parameters()}
        others = {id(t) for q in with_params if q != p for t in modules[q].parameters()}
        if not own <= others:
            return p
    return with_params[-1]


# --------------------------------------------------------------------------- analytic costs


def _shape_facts(config: Any, family: str) -> dict[str, Any]:
    c = config
    if family == "gpt":
        h = c.n_embd
        return dict(
            hidden=h, heads=c.n_head, kv_heads=0, ffn=c.n_inner or 4 * h, vocab=c.vocab_size,
            max_seq=c.n_positions, positions=c.n_positions, gated=False, bias=True, rms=False,
            dropout=(c.attn_pdrop > 0 or c.resid_pdrop > 0), emb_dropout=c.embd_pdrop > 0, kv_channels=0,
        )
    if family == "bert":
        h = c.hidden_size
        max_seq = c.max_position_embeddings
        if c.model_type in ("roberta", "xlm-roberta", "camembert"):
            max_seq -= (c.pad_token_id or 0) + 1  # positions start after the padding index
        return dict(
            hidden=h, heads=c.num_attention_heads, kv_heads=0, ffn=c.intermediate_size, vocab=c.vocab_size,
            max_seq=max_seq, positions=c.max_position_embeddings, gated=False, bias=True, rms=False,
            dropout=(c.hidden_dropout_prob > 0 or c.attention_probs_dropout_prob > 0),
            emb_dropout=c.hidden_dropout_prob > 0, kv_channels=0,
        )
    if family == "t5":
        h, a, d = c.d_model, c.num_heads, c.d_kv
        return dict(
            hidden=h, heads=a, kv_heads=0, ffn=c.d_ff, vocab=c.vocab_size,
            max_seq=getattr(c, "n_positions", None) or T5_DEFAULT_SEQ_LEN, positions=0, gated=bool(c.is_gated_act),
            bias=False, rms=True, dropout=c.dropout_rate > 0, emb_dropout=c.dropout_rate > 0,
            kv_channels=d if a * d != h else 0,
            # HF T5: ReLU (v1.0) with dropout on the MLP hidden state, eager T5LayerNorm
            activation="relu" if c.dense_act_fn == "relu" and not c.is_gated_act else "gelu",
            mlp_dropout=c.dropout_rate > 0, norm_saves_normalized=True,
        )
    # llama-like (and the MoE decoders, whose attention and norms are Llama's)
    h, a = c.hidden_size, c.num_attention_heads
    d = getattr(c, "head_dim", None) or h // a
    facts = dict(
        hidden=h, heads=a, kv_heads=getattr(c, "num_key_value_heads", None) or a, ffn=c.intermediate_size,
        vocab=c.vocab_size, max_seq=c.max_position_embeddings, positions=0, gated=True,
        bias=bool(getattr(c, "attention_bias", False)), rms=True,
        dropout=(getattr(c, "attention_dropout", 0.0) or 0.0) > 0, emb_dropout=False,
        kv_channels=d if a * d != h else 0,
    )
    if family == "moe":
        facts.update(_moe_facts(c))
    return facts


def _moe_facts(c: Any) -> dict[str, Any]:
    """Experts, dense layers and attention of a MoE decoder config, by the
    rules of its transformers implementation (``*DecoderLayer.__init__``)."""
    try:
        return _moe_rules(c)
    except ValueError as exc:  # MoEShape's check: 1 <= top_k <= experts
        raise HetplanError(
            f"{c.model_type} config: {exc}; set num_experts_per_tok between 1 and the number of experts"
        ) from None


def _moe_rules(c: Any) -> dict[str, Any]:
    n = c.num_hidden_layers
    mla = None
    if c.model_type == "mixtral":  # every layer: num_local_experts SwiGLU experts of intermediate_size
        moe = MoEShape(c.num_local_experts, c.num_experts_per_tok, c.intermediate_size)
        moe_layers = list(range(n))
    elif c.model_type in ("qwen2_moe", "qwen3_moe"):
        shared = c.shared_expert_intermediate_size if c.model_type == "qwen2_moe" else 0
        moe = MoEShape(c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                       shared_ffn=shared, shared_gate=shared > 0)
        skip = set(getattr(c, "mlp_only_layers", None) or [])
        step = getattr(c, "decoder_sparse_step", 1) or 1
        moe_layers = [i for i in range(n) if i not in skip and c.num_experts > 0 and (i + 1) % step == 0]
    else:  # deepseek_v2 / deepseek_v3: dense MLPs before first_k_dense_replace, then routed + shared experts
        # (transformers builds MoE in every later layer; no DeepSeek release sets moe_layer_freq != 1)
        moe = MoEShape(c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                       shared_ffn=(c.n_shared_experts or 0) * c.moe_intermediate_size)
        moe_layers = [i for i in range(n) if i >= (c.first_k_dense_replace or 0)]
        mla = MLAShape(kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
                       qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
                       q_lora_rank=c.q_lora_rank or 0)
    return dict(moe=moe, moe_layers=moe_layers, mla=mla)


def _positions(config: Any, family: str | None) -> int:
    """How many positions the model has (0: no limit it states): learned
    tables can hold no more; RoPE models state their long-context limit."""
    if family in ("gpt", "bert", "llama", "moe"):
        return int(_shape_facts(config, family)["max_seq"])
    if family == "t5":
        return 0
    for attr in ("max_position_embeddings", "n_positions"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def _default_seq_len(config: Any, family: str | None) -> tuple[int, str]:
    """The sequence length to cost when none is given, and where it came from.

    The training length the config states (``_TRAINING_LENGTH_FIELDS``, then
    RoPE scaling's ``original_max_position_embeddings``), else
    ``DEFAULT_SEQ_LEN``; never more than the model's positions. T5: 512.
    """
    if family == "t5":
        n = getattr(config, "n_positions", None)
        return (int(n), "n_positions") if n else (T5_DEFAULT_SEQ_LEN, "T5's 512")
    positions = _positions(config, family)
    stated: tuple[int, str] | None = None
    for attr in _TRAINING_LENGTH_FIELDS:
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            stated = (value, attr)
            break
    if stated is None:
        stated = _pretraining_length(config, positions)
    if stated is not None:
        length, field = stated
        return (min(length, positions), field) if positions else (length, field)
    if positions and positions < DEFAULT_SEQ_LEN:
        return positions, "positions"
    return DEFAULT_SEQ_LEN, "default"


def _pretraining_length(config: Any, positions: int) -> tuple[int, str] | None:
    """RoPE scaling's ``original_max_position_embeddings`` when it is below
    the model's positions (transformers fills it in with
    ``max_position_embeddings`` when a config leaves it out: no information)."""
    candidates = [("original_max_position_embeddings", getattr(config, "original_max_position_embeddings", None))]
    for attr in ("rope_scaling", "rope_parameters"):
        rope = getattr(config, attr, None)
        if isinstance(rope, dict):
            candidates.append((f"{attr}.original_max_position_embeddings",
                               rope.get("original_max_position_embeddings")))
    for field, value in candidates:
        if isinstance(value, int) and 0 < value and (not positions or value < positions):
            return value, field
    return None


def _block_shape(f: dict[str, Any], seq: int, fused: bool, cross_seq: int = 0, save_cross: bool = True) -> BlockShape:
    return BlockShape(
        hidden=f["hidden"], heads=f["heads"], ffn=f["ffn"], seq=seq, kv_heads=f["kv_heads"],
        gated_mlp=f["gated"], bias=f["bias"], rms_norm=f["rms"], dropout=f["dropout"],
        cross_attention=cross_seq > 0, cross_seq=cross_seq, kv_channels=f["kv_channels"],
        activation=f.get("activation", "gelu"), mlp_dropout=f.get("mlp_dropout", False),
        norm_saves_normalized=f.get("norm_saves_normalized", False), fused_attention=fused,
        save_cross_input=save_cross,
    )


def _moe_block(name: str, f: dict[str, Any], index: int, shape: BlockShape, p: int) -> LayerSpec:
    """Block ``index`` of a MoE decoder: routed experts where the config puts
    them, a dense SwiGLU MLP of ``intermediate_size`` elsewhere."""
    if index in f["moe_layers"]:
        return transformer_block(name, "moe", shape, p, moe=f["moe"], mla=f["mla"])
    return transformer_block(name, "decoder", shape, p, mla=f["mla"])


def _check_moe_layout(model: Any, layout: list[tuple[str, list[str]]], f: dict[str, Any], where: str) -> None:
    """The config's dense/MoE rule must match the built model, or the FLOPs
    would describe another model than the measured parameters."""
    modules = dict(model.named_modules())
    blocks = [paths[0] for kind, paths in layout if kind.startswith("block:")]
    for index, path in enumerate(blocks):
        built = any(".experts." in f".{name}" for name, _ in modules[path].named_parameters())
        if built != (index in f["moe_layers"]):
            raise HetplanError(
                f"{where}: {path} is {'a MoE' if built else 'a dense'} layer in this transformers' "
                f"{type(model).__name__}, unlike hetplan's rule for {model.config.model_type}; trace the model "
                "instead (hetplan.model.trace.model_from_module)"
            )


def _with_final_norm(layer: LayerSpec, f: dict[str, Any], seq: int, p: int) -> LayerSpec:
    """A block followed by its stack's final norm and dropout (T5 encoder)."""
    h = f["hidden"]
    kept = 2 if f.get("norm_saves_normalized") else 1  # norm input (and normalized tensor)
    extra = kept * p * seq * h + (MASK_BYTES * seq * h if f["dropout"] else 0)
    return replace(
        layer,
        params_tp_replicated=layer.params_tp_replicated + (h if f["rms"] else 2 * h),
        act_bytes=layer.act_bytes + extra,
        act_tp_replicated_bytes=layer.act_tp_replicated_bytes + extra,
        fwd_mem_bytes=layer.fwd_mem_bytes + p * seq * h * (2 + (2 if f["dropout"] else 0)),
        profile_key="",
    )


def _analytic_layers(
    config: Any, family: str, layout: list[tuple[str, list[str]]], seq: int, dec_seq: int, p: int, fused: bool
) -> list[LayerSpec]:
    """Analytic LayerSpecs in layout order (names and params are set later)."""
    f = _shape_facts(config, family)
    h, vocab = f["hidden"], f["vocab"]
    kinds = [k for k, _ in layout]
    n_stacks = len({k for k in kinds if k.startswith("block:")})
    if family == "t5" and n_stacks != 2 or family != "t5" and n_stacks != 1:
        raise HetplanError(f"{config.model_type}: unexpected module structure ({n_stacks} block lists)")
    out: list[LayerSpec] = []
    blocks_seen: dict[str, int] = {}
    for i, kind in enumerate(kinds):
        decoder_side = family == "t5" and (kind == "block:1" or (kind == "embedding" and i > 0) or kind == "head")
        s = dec_seq if decoder_side else seq
        if kind == "embedding":
            layer = embedding_layer(
                f"layer{i}", vocab, h, s, p,
                positions=f["positions"],
                token_types=getattr(config, "type_vocab_size", 0) if family == "bert" else 0,
                norm=family == "bert", dropout=f["emb_dropout"],
            )
            if decoder_side:  # in a pipeline the decoder embedding also receives and passes on the encoder output
                layer = replace(
                    layer, input_bytes=layer.input_bytes + p * seq * h, output_bytes=layer.output_bytes + p * seq * h
                )
        elif kind.startswith("block:"):
            nth = blocks_seen.get(kind, 0)
            blocks_seen[kind] = nth + 1
            if family == "moe":
                out.append(_moe_block(f"layer{i}", f, nth, _block_shape(f, s, fused), p))
                continue
            if family == "t5":
                block_kind = "decoder" if decoder_side else "encoder"
                # the encoder output read by every cross-attention is one tensor: count it once
                shape = _block_shape(f, s, fused, cross_seq=seq if decoder_side else 0, save_cross=nth == 0)
            else:
                block_kind = "encoder" if family == "bert" else "decoder"
                shape = _block_shape(f, s, fused)
            layer = transformer_block(f"layer{i}", block_kind, shape, p)
            if family == "t5":
                if nth == 0:  # relative position bias: gather the bias (write) and add it to the scores (r+w)
                    extra = p * f["heads"] * s * s * 3
                    layer = replace(layer, fwd_mem_bytes=layer.fwd_mem_bytes + extra, profile_key="")
                if decoder_side:  # every decoder block receives and passes on the encoder output
                    layer = replace(
                        layer,
                        input_bytes=layer.input_bytes + p * seq * h,
                        output_bytes=layer.output_bytes + p * seq * h,
                    )
                elif i + 1 < len(kinds) and kinds[i + 1] == "embedding":
                    layer = _with_final_norm(layer, f, s, p)
        else:
            layer = lm_head_layer(
                f"layer{i}", vocab, h, s, p, norm=family != "bert", rms_norm=f["rms"], transform=family == "bert"
            )
            if family == "t5":  # eager final norm keeps the normalized tensor; dropout after it
                extra = (p if f["norm_saves_normalized"] else 0) * s * h + (MASK_BYTES * s * h if f["dropout"] else 0)
                layer = replace(
                    layer,
                    act_bytes=layer.act_bytes + extra,
                    act_tp_replicated_bytes=layer.act_tp_replicated_bytes + extra,
                    profile_key="",
                )
        out.append(layer)
    return out


# --------------------------------------------------------------------------- public API


def _json_config(config: Any) -> dict[str, Any] | None:
    """The config's non-default values as JSON (``AutoConfig.for_model(**values)``
    rebuilds it), or None when a value is not JSON (then the plan cannot be
    trained by 'hetplan train' and says so)."""
    import json

    values = config.to_diff_dict()
    values["model_type"] = config.model_type
    try:
        return json.loads(json.dumps(values, allow_nan=False))
    except (TypeError, ValueError):
        return None


def model_from_hf_config(
    source: Any,
    seq_len: int | None = None,
    dtype_bytes: int = 2,
    name: str | None = None,
    *,
    decoder_seq_len: int | None = None,
    fused_attention: bool | None = None,
    where: str | None = None,
) -> ModelSpec:
    """A per-sample ModelSpec for the HF model described by ``source``.

    Args:
        source: path of a ``config.json`` or of a directory holding one, a
            ``transformers.PretrainedConfig``, or a dict of config values. Hub
            names (``"meta-llama/Llama-2-7b-hf"``) are refused with a clear error.
        seq_len: tokens per sample; default: the training length the config
            states (``seq_length``, ``n_ctx``, RoPE scaling's
            ``original_max_position_embeddings`` ...), else
            ``DEFAULT_SEQ_LEN`` (4096), never more than the model's positions
            (T5: 512). ``meta["seq_len_default"]`` says a default was used.
        dtype_bytes: 2 for bf16/fp16 mixed precision, 4 for fp32.
        name: ModelSpec name; default: the config's ``_name_or_path``, else the
            config file's directory or stem, else the model type.
        decoder_seq_len: T5 only: target length (default ``seq_len``), e.g. 4
            for Galvatron's T5-512/4.
        fused_attention: whether attention runs in a fused kernel that keeps
            no score matrix for backward (SDPA / FlashAttention on a GPU).
            Default: what the model is built with; transformers picks
            ``"sdpa"`` unless the config sets ``"_attn_implementation": "eager"``.
        where: the file a dict ``source`` was read from (``load_model``
            reads it once); names the config in messages and the model.

    Returns:
        A ModelSpec with one layer per embedding, block and head;
        ``meta["layer_modules"]`` lists the module paths in each layer. MoE
        decoders have family ``"moe"``, kind ``"moe"`` for their expert layers
        and ``meta["moe"]`` (experts, top-k, widths, ``active_params``).
    """
    from_file = isinstance(source, (str, os.PathLike)) or where is not None
    config, where = load_hf_config(source, where)
    if dtype_bytes not in (2, 4):
        raise HetplanError(f"dtype_bytes must be 2 (bf16/fp16) or 4 (fp32), got {dtype_bytes}")
    family = _FAMILIES.get(config.model_type)
    if family is not None:  # checked before building the model
        _check_seq_len(*((int(seq_len), "seq_len") if seq_len is not None else _default_seq_len(config, family)),
                       where)
    model = build_meta_model(config, where)
    spec_name = name or _default_name(config, from_file, where)
    if family is None:
        return _traced(model, config, spec_name, seq_len, dtype_bytes, where)

    facts = _shape_facts(config, family)
    seq_from = "seq_len"
    if seq_len is None:
        seq_len, seq_from = _default_seq_len(config, family)
    seq = int(seq_len)
    dec_seq = int(decoder_seq_len or seq)
    if seq < 1 or dec_seq < 1:
        raise HetplanError(f"seq_len must be >= 1, got {seq_len}")
    _check_seq_len(seq, seq_from, where)
    _check_seq_len(dec_seq, "decoder_seq_len", where)
    if family in ("gpt", "bert") and seq > facts["max_seq"]:
        raise HetplanError(
            f"seq_len {seq} exceeds the {facts['max_seq']} learned positions of this {config.model_type} config; "
            "use a shorter seq_len or raise max_position_embeddings/n_positions"
        )
    layout = hf_layer_modules(model)
    if family == "moe":
        _check_moe_layout(model, layout, facts, where)
    if fused_attention is None:
        fused_attention = _uses_fused_attention(model)
    analytic = _analytic_layers(config, family, layout, seq, dec_seq, dtype_bytes, fused_attention)
    layers, layer_modules, tied_meta = _measured_params(model, layout, analytic)
    meta: dict[str, Any] = {
        "source": where,
        "layer_modules": layer_modules,
        "tied_params": tied_meta,
        "params": "measured on the meta-device model",
        "costs": "analytic (hetplan.model.layers, Korthikanti et al. 2022)",
    }
    meta["fused_attention"] = fused_attention
    meta.update(_seq_meta(seq_from))
    if family == "t5":
        meta["decoder_seq_len"] = dec_seq
    if family == "moe":
        meta["moe"] = _moe_meta(facts, sum(layer.params - layer.tied_params for layer in layers))
    architecture = _architecture(config, family, facts)
    if architecture:
        meta["architecture"] = architecture
    spec = ModelSpec(
        name=spec_name,
        family=family,
        layers=tuple(layers),
        seq_len=seq,
        dtype_bytes=dtype_bytes,
        hidden_size=facts["hidden"],
        num_heads=facts["heads"],
        vocab_size=facts["vocab"],
        meta=meta,
        source=_hf_source(config, model),
    )
    return _with_runtime_support(model, spec)


def _architecture(config: Any, family: str, f: dict[str, Any]) -> dict[str, Any]:
    """What a tool needs to build the same decoder (hetplan.export.tools.architecture);
    empty where its exports cannot say it (other families, Llama-style
    attention with biases: Megatron has qkv biases or biases everywhere)."""
    if family == "gpt":
        return {"kv_heads": f["heads"], "ffn": f["ffn"], "gated_mlp": False, "norm": "layernorm",
                "positions": "learned", "max_positions": f["max_seq"], "bias": True,
                "tied_embeddings": bool(getattr(config, "tie_word_embeddings", True)), "dropout": f["dropout"]}
    # Mixtral's blocks are Llama's with the MLP made experts; other MoE types
    # (Qwen's qkv biases, DeepSeek's MLA) have no exact Megatron/torchtitan form here
    llama_like = family == "llama" or family == "moe" and config.model_type == "mixtral"
    if not llama_like or f["bias"]:
        return {}
    rope = getattr(config, "rope_parameters", None) or {}
    theta = (rope.get("rope_theta") if isinstance(rope, dict) else None) or getattr(config, "rope_theta", None)
    facts = {"kv_heads": f["kv_heads"], "ffn": f["ffn"], "gated_mlp": True, "norm": "rmsnorm", "positions": "rope",
             "max_positions": f["max_seq"], "bias": False,
             "tied_embeddings": bool(getattr(config, "tie_word_embeddings", False)), "dropout": f["dropout"],
             "kv_channels": f["kv_channels"]}
    if isinstance(theta, (int, float)) and theta > 0:
        facts["rope_theta"] = float(theta)
    return facts


def _with_runtime_support(model: Any, spec: ModelSpec) -> ModelSpec:
    """``spec`` with what hetplan's runtime can run of the HF ``model``
    (``hetplan.runtime.support``); it pipelines a HF model through its
    family's staged forward (``hetplan.runtime.hf_stages``) or not at all."""
    from hetplan.runtime.hf_stages import unsupported_reason

    return inspect_model(model, spec, pipeline=unsupported_reason(model))


def _measured_params(
    model: Any, layout: list[tuple[str, list[str]]], analytic: list[LayerSpec]
) -> tuple[list[LayerSpec], dict[str, list[str]], dict[str, int]]:
    """Replace analytic parameter counts by the meta model's, and mark ties."""
    modules = dict(model.named_modules())
    canonical: dict[int, str] = {}
    for pname, param in model.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(param), pname)
    per_layer: list[dict[int, Any]] = []
    for _, paths in layout:
        params: dict[int, Any] = {}
        for path in paths:
            for param in modules[path].parameters():
                params[id(param)] = param
        per_layer.append(params)
    first_user: dict[int, int] = {}
    users: dict[int, int] = {}
    for k, params in enumerate(per_layer):
        for pid in params:
            first_user.setdefault(pid, k)
            users[pid] = users.get(pid, 0) + 1
    layers: list[LayerSpec] = []
    layer_modules: dict[str, list[str]] = {}
    tied_meta: dict[str, int] = {}
    for k, ((kind, paths), base, params) in enumerate(zip(layout, analytic, per_layer)):
        name = _layer_name(kind.split(":")[0], paths, model) if not kind.startswith("block:") else paths[0]
        count = sum(p.numel() for p in params.values())
        tied = sorted(canonical[pid] for pid in params if users[pid] > 1)
        tied_params = sum(p.numel() for pid, p in params.items() if users[pid] > 1 and first_user[pid] != k)
        layer_modules[name] = list(paths)
        if tied_params:
            tied_meta[name] = tied_params
        values = {f: getattr(base, f) for f in LayerSpec.__dataclass_fields__}
        values.update(
            name=name,
            params=count,
            params_tp_replicated=min(base.params_tp_replicated, count),
            tied_group="+".join(tied),
            tied_params=tied_params,
            profile_key="",
        )
        layers.append(LayerSpec(**values))
    return layers, layer_modules, tied_meta


def _seq_meta(source: str) -> dict[str, Any]:
    """``seq_len_default``: no seq_len was given (reports say so and point
    to ``--seq-len``); ``seq_len_source``: the config field or rule used."""
    return {"seq_len_default": source != "seq_len", "seq_len_source": source}


def _moe_meta(f: dict[str, Any], total_params: int) -> dict[str, Any]:
    """Expert facts, and the parameters one token passes through: all but
    the ``num_experts - top_k`` routed experts it skips in each MoE layer."""
    moe: MoEShape = f["moe"]
    per_expert = (3 if moe.gated else 2) * f["hidden"] * moe.expert_ffn
    skipped = len(f["moe_layers"]) * (moe.num_experts - moe.top_k) * per_expert
    return {
        "num_experts": moe.num_experts,
        "top_k": moe.top_k,
        "expert_ffn": moe.expert_ffn,
        "shared_ffn": moe.shared_ffn,
        "moe_layers": len(f["moe_layers"]),
        "latent_attention": f["mla"] is not None,
        "active_params": total_params - skipped,
    }


def _uses_fused_attention(model: Any) -> bool:
    """SDPA and FlashAttention keep no score matrix on a GPU (``eager`` does)."""
    implementation = getattr(model.config, "_attn_implementation", None) or "eager"
    return implementation != "eager"


def _check_seq_len(seq: int, source: str, where: str) -> None:
    if seq > MAX_SEQ_LEN:
        named = f"seq_len {seq}" if source == "seq_len" else f"{source} = {seq} (the sequence length)"
        raise HetplanError(f"{where}: {named} is above hetplan's limit of {MAX_SEQ_LEN} tokens; "
                           "use a shorter sequence length (--seq-len)")


def _default_name(config: Any, from_file: bool, where: str) -> str:
    name_or_path = getattr(config, "_name_or_path", "") or getattr(config, "name_or_path", "")
    if name_or_path:
        return str(name_or_path).rstrip("/").split("/")[-1]
    if from_file:
        path = Path(os.path.abspath(where))  # "config.json" in the current directory: that directory's name
        return path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    return config.model_type


def _traced(model: Any, config: Any, name: str, seq_len: int | None, dtype_bytes: int, where: str) -> ModelSpec:
    """Model types without analytic rules: trace the meta model."""
    import torch

    main_input = getattr(model, "main_input_name", "input_ids")
    seq_meta: dict[str, Any] = {}
    if main_input == "input_ids":
        seq_from = "seq_len"
        if seq_len is None:
            seq_len, seq_from = _default_seq_len(config, None)
        seq = int(seq_len)
        _check_seq_len(seq, seq_from, where)
        seq_meta = _seq_meta(seq_from)
        inputs: dict[str, Any] = {"input_ids": torch.zeros(1, seq, dtype=torch.long, device="meta")}
        if getattr(config, "is_encoder_decoder", False):
            inputs["decoder_input_ids"] = torch.zeros(1, seq, dtype=torch.long, device="meta")
    elif main_input == "pixel_values":
        size = getattr(config, "image_size", 224)
        size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
        channels = getattr(config, "num_channels", 3)
        inputs = {"pixel_values": torch.zeros(1, channels, *size, device="meta")}
        patch = getattr(config, "patch_size", None)
        if seq_len is None and isinstance(patch, int) and patch > 0:
            seq_len = (size[0] // patch) * (size[1] // patch)
        seq = int(seq_len or 1)
    else:
        raise HetplanError(
            f"{where}: hetplan has no analytic rules for model_type {config.model_type!r} and cannot make an "
            f"example {main_input!r}; build the model and call hetplan.model.trace.model_from_module"
        )
    spec = model_from_module(model, inputs, name=name, dtype_bytes=dtype_bytes, family=config.model_type, seq_len=seq)
    spec.meta.update(source=where, costs="traced on the meta device (hetplan.model.trace)", **seq_meta)
    return _with_runtime_support(model, replace(spec, source=_hf_source(config, model)))


def _hf_source(config: Any, model: Any) -> HFSource:
    """What 'hetplan train' builds the model from, the config file deleted or not."""
    return HFSource(type(model).__name__, config.model_type, _json_config(config))
