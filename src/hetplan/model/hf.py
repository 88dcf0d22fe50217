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
LM), T5/mT5 (seq2seq LM), Llama/Mistral/Qwen2/Qwen3 (causal LM). Any other
model type transformers knows is traced (``hetplan.model.trace``) with token
ids (or pixel values for vision models) as the example input.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

from hetplan.errors import HetplanError
from hetplan.model.layers import MASK_BYTES, BlockShape, embedding_layer, lm_head_layer, transformer_block
from hetplan.model.spec import LayerSpec, ModelSpec
from hetplan.model.trace import make_layer

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
}
_AUTO_CLASS = {
    "gpt": "AutoModelForCausalLM",
    "llama": "AutoModelForCausalLM",
    "bert": "AutoModelForMaskedLM",
    "t5": "AutoModelForSeq2SeqLM",
}
# Shape fields a config.json must state: transformers would otherwise silently
# fill in its defaults (a config without "n_layer" becomes a 12-layer GPT-2).
# Each entry lists the accepted spellings.
_REQUIRED = {
    "gpt": [("n_embd", "hidden_size"), ("n_layer", "num_hidden_layers"), ("n_head", "num_attention_heads"),
            ("vocab_size",)],
    "bert": [("hidden_size",), ("num_hidden_layers",), ("num_attention_heads",), ("intermediate_size",),
             ("vocab_size",)],
    "t5": [("d_model",), ("num_layers",), ("num_heads",), ("d_ff",), ("d_kv",), ("vocab_size",)],
    "llama": [("hidden_size",), ("num_hidden_layers",), ("num_attention_heads",), ("intermediate_size",),
              ("vocab_size",)],
}
T5_DEFAULT_SEQ_LEN = 512  # T5 has relative positions; 512 is the paper's input length (Raffel et al. 2020, §3.1.2)


def _import_transformers() -> tuple[Any, Any]:
    try:
        import torch
        import transformers
    except ImportError:
        raise HetplanError(
            "building a model from a HF config needs torch and transformers; run: pip install -e .[torch]"
        ) from None
    return torch, transformers


def load_hf_config(source: Any) -> tuple[Any, str]:
    """A ``transformers.PretrainedConfig`` and a description of where it came from.

    ``source`` is a config object, a dict of config values, or the path of a
    ``config.json`` (or of a directory holding one). Hub names are refused:
    nothing can be downloaded here.
    """
    _, transformers = _import_transformers()
    if isinstance(source, transformers.PretrainedConfig):
        return source, f"{type(source).__name__} object"
    if isinstance(source, dict):
        return _config_from_dict(dict(source), "config dict", transformers), "config dict"
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
    if model_type not in CONFIG_MAPPING:
        raise HetplanError(
            f"{where}: unknown model_type {model_type!r}; transformers {transformers.__version__} has no such "
            "model (check the spelling, e.g. \"gpt2\", \"bert\", \"t5\", \"llama\")"
        )
    family = _FAMILIES.get(model_type)
    if family:
        for spellings in _REQUIRED[family]:
            if not any(s in data for s in spellings):
                raise HetplanError(
                    f"{where}: missing field {spellings[0]!r} (needed for a {model_type} model; "
                    "transformers would silently use its default)"
                )
    config_class = CONFIG_MAPPING[model_type]
    try:
        with _quiet(transformers):
            return config_class.from_dict({k: v for k, v in data.items() if k != "model_type"})
    except Exception as exc:
        raise HetplanError(f"{where}: invalid {model_type} config: {_first_line(exc)}") from None


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
        f"{where}: transformers has no model class for {config.model_type!r} ({_first_line(last_error)})"
    )


# --------------------------------------------------------------------------- layout


def hf_layout(model: Any) -> list[tuple[str, list[str]]]:
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
    # llama-like
    h, a = c.hidden_size, c.num_attention_heads
    d = getattr(c, "head_dim", None) or h // a
    return dict(
        hidden=h, heads=a, kv_heads=getattr(c, "num_key_value_heads", None) or a, ffn=c.intermediate_size,
        vocab=c.vocab_size, max_seq=c.max_position_embeddings, positions=0, gated=True,
        bias=bool(getattr(c, "attention_bias", False)), rms=True,
        dropout=(getattr(c, "attention_dropout", 0.0) or 0.0) > 0, emb_dropout=False,
        kv_channels=d if a * d != h else 0,
    )


def _block_shape(f: dict[str, Any], seq: int, fused: bool, cross_seq: int = 0, save_cross: bool = True) -> BlockShape:
    return BlockShape(
        hidden=f["hidden"], heads=f["heads"], ffn=f["ffn"], seq=seq, kv_heads=f["kv_heads"],
        gated_mlp=f["gated"], bias=f["bias"], rms_norm=f["rms"], dropout=f["dropout"],
        cross_attention=cross_seq > 0, cross_seq=cross_seq, kv_channels=f["kv_channels"],
        activation=f.get("activation", "gelu"), mlp_dropout=f.get("mlp_dropout", False),
        norm_saves_normalized=f.get("norm_saves_normalized", False), fused_attention=fused,
        save_cross_input=save_cross,
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


def model_from_hf_config(
    source: Any,
    seq_len: int | None = None,
    dtype_bytes: int = 2,
    name: str | None = None,
    *,
    decoder_seq_len: int | None = None,
    fused_attention: bool | None = None,
) -> ModelSpec:
    """A per-sample ModelSpec for the HF model described by ``source``.

    Args:
        source: path of a ``config.json`` or of a directory holding one, a
            ``transformers.PretrainedConfig``, or a dict of config values. Hub
            names (``"meta-llama/Llama-2-7b-hf"``) are refused with a clear error.
        seq_len: tokens per sample; default: the config's maximum positions
            (``n_positions`` / ``max_position_embeddings``; T5: 512).
        dtype_bytes: 2 for bf16/fp16 mixed precision, 4 for fp32.
        name: ModelSpec name; default: the config's ``_name_or_path``, else the
            config file's directory or stem, else the model type.
        decoder_seq_len: T5 only: target length (default ``seq_len``), e.g. 4
            for Galvatron's T5-512/4.
        fused_attention: whether attention runs in a fused kernel that keeps
            no score matrix for backward (SDPA / FlashAttention on a GPU).
            Default: what the model is built with; transformers picks
            ``"sdpa"`` unless the config sets ``"_attn_implementation": "eager"``.

    Returns:
        A ModelSpec with one layer per embedding, block and head;
        ``meta["layer_modules"]`` lists the module paths in each layer.
    """
    config, where = load_hf_config(source)
    if dtype_bytes not in (2, 4):
        raise HetplanError(f"dtype_bytes must be 2 (bf16/fp16) or 4 (fp32), got {dtype_bytes}")
    family = _FAMILIES.get(config.model_type)
    model = build_meta_model(config, where)
    spec_name = name or _default_name(config, source, where)
    if family is None:
        return _traced(model, config, spec_name, seq_len, dtype_bytes, where)

    facts = _shape_facts(config, family)
    seq = int(seq_len or facts["max_seq"])
    dec_seq = int(decoder_seq_len or seq)
    if seq < 1 or dec_seq < 1:
        raise HetplanError(f"seq_len must be >= 1, got {seq_len}")
    if family in ("gpt", "bert") and seq > facts["max_seq"]:
        raise HetplanError(
            f"seq_len {seq} exceeds the {facts['max_seq']} learned positions of this {config.model_type} config; "
            "use a shorter seq_len or raise max_position_embeddings/n_positions"
        )
    layout = hf_layout(model)
    if fused_attention is None:
        fused_attention = _uses_fused_attention(model)
    analytic = _analytic_layers(config, family, layout, seq, dec_seq, dtype_bytes, fused_attention)
    layers, layer_modules, tied_meta = _measured_params(model, layout, analytic)
    meta: dict[str, Any] = {
        "source": where,
        "model_type": config.model_type,
        "hf_class": type(model).__name__,
        "layer_modules": layer_modules,
        "tied_params": tied_meta,
        "params": "measured on the meta-device model",
        "costs": "analytic (hetplan.model.layers, Korthikanti et al. 2022)",
    }
    meta["fused_attention"] = fused_attention
    if family == "t5":
        meta["decoder_seq_len"] = dec_seq
    return ModelSpec(
        name=spec_name,
        family=family,
        layers=tuple(layers),
        seq_len=seq,
        dtype_bytes=dtype_bytes,
        hidden_size=facts["hidden"],
        num_heads=facts["heads"],
        vocab_size=facts["vocab"],
        meta=meta,
    )


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
            modules=tuple(paths),
            profile_key="",
        )
        layers.append(make_layer(**values))
    return layers, layer_modules, tied_meta


def _uses_fused_attention(model: Any) -> bool:
    """SDPA and FlashAttention keep no score matrix on a GPU (``eager`` does)."""
    implementation = getattr(model.config, "_attn_implementation", None) or "eager"
    return implementation != "eager"


def _default_name(config: Any, source: Any, where: str) -> str:
    name_or_path = getattr(config, "_name_or_path", "") or getattr(config, "name_or_path", "")
    if name_or_path:
        return str(name_or_path).rstrip("/").split("/")[-1]
    if isinstance(source, (str, os.PathLike)):
        path = Path(where)
        return path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    return config.model_type


def _traced(model: Any, config: Any, name: str, seq_len: int | None, dtype_bytes: int, where: str) -> ModelSpec:
    """Model types without analytic rules: trace the meta model."""
    import torch

    from hetplan.model.trace import model_from_module

    main_input = getattr(model, "main_input_name", "input_ids")
    if main_input == "input_ids":
        seq = int(
            seq_len
            or getattr(config, "max_position_embeddings", None)
            or getattr(config, "n_positions", None)
            or T5_DEFAULT_SEQ_LEN
        )
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
    spec.meta.update(source=where, model_type=config.model_type, hf_class=type(model).__name__,
                     costs="traced on the meta device (hetplan.model.trace)")
    return spec
