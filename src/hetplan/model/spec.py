"""ModelSpec: a model as an ordered list of layers, with what each costs.

Everything is *per sample* at the model's sequence length and training
precision; the cost model multiplies by the micro-batch size. Activation bytes
are split the way Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models", §4) and Galvatron-BMW (§III-C) split them, so that
tensor parallelism, sequence parallelism and (selective or full) recomputation
can each be costed:

* ``act_bytes``              everything one layer keeps for its backward pass;
* ``act_tp_replicated_bytes``  the part tensor parallelism does *not* divide
  (layer-norm inputs, dropout masks, the layer input: Korthikanti's ``10sbh``);
  sequence parallelism divides it too;
* ``act_attention_core_bytes`` the part selective recomputation drops
  (softmax output, its dropout mask and output: Korthikanti's ``5as²b``);
* ``act_linear_input_bytes``  the part that linear layers keep as their input
  for the weight gradient, which FP8 training keeps in one byte an element;
* ``input_bytes``            the layer's input, the only thing full
  recomputation (checkpointing) keeps — Galvatron's "boundary" activation.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any

from hetplan.errors import HetplanError
from hetplan.model.origin import LEGACY_META_KEYS, ModelSource, source_from_dict, source_from_meta

# Limits on what a model may be: generous but finite, so that a typo or a
# corrupt file (an extra zero, a stray exponent) is refused at once instead of
# hanging an import or a search for minutes. Checked before anything is built
# (ModelSpec JSON: here; HF configs: hetplan.model.hf, before transformers
# builds the model).
#
# Layers: the deepest models trained have a few hundred blocks (Llama 3.1 405B:
# 126, DeepSeek-V3: 61, GPT-3: 96); 10,000 is 50x that, while a model of 10^5
# layers would take minutes to build on the meta device and to partition.
MAX_LAYERS = 10_000
# Parameters: the largest published models hold about 1-2 trillion (Switch-C:
# 1.6T, Kimi K2: 1T); 100 trillion is 50x that (and 200 TB of bf16 weights).
MAX_PARAMS = 100 * 10**12
# Tokens per sample: the longest context windows today are about 10M tokens
# (Llama 4 Scout: 10,485,760 positions); 2^24 = 16,777,216 is above that.
MAX_SEQ_LEN = 2**24
# Per-sample FLOPs and bytes of one layer: 100T parameters x 16M tokens x 2 is
# about 3e21 FLOPs; 1e30 leaves room for any real layer while keeping products
# with batch sizes and GPU counts far from float overflow (1.8e308).
MAX_PER_SAMPLE = 1e30
# Bytes of one layer per sample (activations, input, output, traffic): Llama 3
# 405B at 128k tokens keeps about 7e10 (2^36) per layer (Korthikanti et al.
# 2022's 34sbh, s = 131,072, h = 16,384); 2^50 (1 PiB) is 16,000x that and
# keeps the planners' integer byte arrays (int64, 2^63) far from overflow
# (the step's total is bounded by hetplan.limits.MAX_STEP_BYTES).
MAX_LAYER_BYTES_PER_SAMPLE = float(2**50)
# Levels of lists and objects in a model's ``meta`` (where it came from: an HF
# config nests 3-4 levels deep, e.g. rope_scaling inside text_config); 32 is far
# above that and far below Python's recursion limit (1,000), which JSON writing
# and deep copies reach.
MAX_META_DEPTH = 32
# Routed experts per MoE layer: the most published are a few hundred
# (DeepSeek-V3: 256, Kimi K2: 384); 65,536 is far above that.
MAX_EXPERTS = 65_536
# Token copies per routed copy: GShard trains at 2, Switch at 1-2 (Fedus et
# al. 2022 §2.2); 64 leaves room and refuses a typo such as 125.
MAX_CAPACITY_FACTOR = 64.0
# Self-attention masks a layer may have ("" = no self-attention).
ATTENTION_KINDS = ("", "causal", "full", "sliding")


@dataclass(frozen=True)
class LayerSpec:
    """One layer of a model: its parameters, work and memory, per sample.

    Attributes:
        name: module name in the model (e.g. ``"transformer.h.3"``); pipeline
            splits are written as lists of these names.
        kind: what the layer is ("embedding", "decoder", "encoder", "head", ...);
            layers of the same kind and shape share a ``profile_key``.
        params: number of parameters this layer owns (tied ones counted here too).
        params_tp_replicated: parameters tensor parallelism does not split
            (layer norms, biases of row-parallel linears).
        fwd_flops: forward floating point operations per sample (a multiply-add
            is 2 FLOPs). Backward is costed as twice the forward.
        fwd_mem_bytes: bytes read and written by memory-bound (elementwise)
            kernels in the forward pass per sample; these run at memory
            bandwidth, not at tensor-core speed.
        attention_flops: the part of ``fwd_flops`` in the attention core
            (QK^T and scores·V), recomputed by selective recomputation.
        gemm_count: number of matrix multiplies in the forward pass, used to
            estimate the size of each one for the efficiency curve.
        act_bytes: activation bytes kept for backward, per sample (see module doc).
        act_tp_replicated_bytes: part of ``act_bytes`` not divided by TP.
        act_attention_core_bytes: part of ``act_bytes`` selective recompute drops.
        act_linear_input_bytes: part of ``act_bytes`` that linear layers keep
            as their input for the weight gradient; FP8 training keeps it in
            FP8 (one byte an element: Transformer Engine's ``Linear`` saves
            its quantized input, transformer_engine/pytorch/module/linear.py).
        act_linear_input_replicated_bytes: the part of it TP does not divide
            (inputs of column-parallel linears, the norm outputs).
        input_bytes: bytes of the layer's input per sample (checkpoint boundary).
        output_bytes: bytes sent to the next layer per sample (pipeline p2p).
        tp_comm_bytes: bytes all-reduced across the TP group per sample in the
            forward pass (Megatron: 2 per block, one after attention, one after
            the MLP); the backward pass all-reduces the same amount.
        tp_max: how many parallel units tensor parallelism splits (attention
            heads, or KV heads with GQA; filters of a convolution): a TP degree
            must not exceed it and, for a transformer block, must divide it.
            0 means no limit (embeddings, heads, layers TP splits by rows).
        tied_group: layers with the same non-empty tied_group share their
            parameters (e.g. input embedding and LM head).
        tied_params: parameters of this layer that an earlier layer of its
            tied_group already owns (counted once in the model's total; held
            again only by a stage that does not hold the earlier layer).
        profile_key: layers with equal keys have equal cost (profiled once).
        attention: the layer's self-attention mask: "causal" (decoders),
            "full" (encoders, vision), "sliding" (attends to the last
            ``attention_window`` tokens, or within windows of that many);
            "" for a layer without self-attention. Context parallelism's load
            balance and K/V exchange depend on it (cost/cp_ep.py).
        attention_window: tokens a "sliding" attention sees (0 otherwise).
        kv_bytes: bytes of the self-attention's keys and values per sample
            (K and V of every token, all heads): what context parallelism
            exchanges per pass (Llama 3 §3.3.2 all-gathers them).
        num_experts, top_k: routed experts of a mixture-of-experts layer and
            how many each token goes to (GShard §2.2); 0 for a dense layer.
        expert_ffn, shared_expert_ffn: inner width of one routed expert and of
            all shared experts together (DeepSeekMoE §3.2).
        capacity_factor: token copies the experts process per routed copy
            (1 for dropless MoE).
        expert_params: parameters of the routed experts (part of ``params``,
            split by TP): what expert parallelism divides by ``ep``.
        expert_flops: the part of ``fwd_flops`` in the routed experts.
        dispatch_bytes: bytes one all-to-all sends per sample: every token's
            ``top_k x capacity_factor`` copies of its hidden state.
        tp_replicated: hetplan's runtime runs the whole layer on every rank of
            its TP group (its model gives it no TP plan: a ``pkg.mod:build``
            module without ``register_tp_plan``), so TP divides none of its
            parameters, work or activations and it sends no TP collective; the
            cost kernel costs it that way (``cost.layers``).
    """

    name: str
    kind: str
    params: int
    fwd_flops: float
    act_bytes: float
    input_bytes: float
    output_bytes: float
    params_tp_replicated: int = 0
    fwd_mem_bytes: float = 0.0
    attention_flops: float = 0.0
    gemm_count: int = 1
    act_tp_replicated_bytes: float = 0.0
    act_attention_core_bytes: float = 0.0
    act_linear_input_bytes: float = 0.0
    act_linear_input_replicated_bytes: float = 0.0
    tp_comm_bytes: float = 0.0
    tp_max: int = 0
    tied_group: str = ""
    tied_params: int = 0
    profile_key: str = ""
    attention: str = ""
    attention_window: int = 0
    kv_bytes: float = 0.0
    num_experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_expert_ffn: int = 0
    capacity_factor: float = 1.0
    expert_params: int = 0
    expert_flops: float = 0.0
    dispatch_bytes: float = 0.0
    tp_replicated: bool = False

    def __post_init__(self) -> None:
        where = f"layer {self.name!r}" if isinstance(self.name, str) else "layer"
        for name, value in _checked_values(self, _LAYER_RULES, where).items():
            object.__setattr__(self, name, value)  # integral floats (1e9) become ints
        _check_layer_relations(self.__dict__, where)
        if not self.profile_key:
            object.__setattr__(self, "profile_key", self.default_profile_key())

    def default_profile_key(self) -> str:
        """Layers of the same kind and identical size cost the same."""
        return f"{self.kind}:{self.params}:{self.fwd_flops:.6g}:{self.act_bytes:.6g}"

    def supports_tp(self, tp: int) -> bool:
        """Can this layer run with TP degree ``tp``? The one rule every planner,
        the validator and the runtime use (see ``tp_max``)."""
        if tp == 1 or not self.tp_max:
            return True
        if tp > self.tp_max:
            return False
        return self.kind in ("embedding", "head") or self.tp_max % tp == 0

    @property
    def is_moe(self) -> bool:
        """A mixture-of-experts layer: expert parallelism applies to it."""
        return self.num_experts > 0

@dataclass(frozen=True)
class RuntimeSupport:
    """What hetplan's runtime can run of one model: "" where it can, else one
    line saying why not and what to use instead. Found by the runtime's own
    checks on the model when it is imported (``hetplan.runtime.support``), so
    the planners, ``estimate`` and the runtime read one truth.

    Attributes:
        build: the runtime cannot build the model at all ("" for models it
            builds: a HF class it knows, a ``pkg.mod:build`` function).
        pipeline: it cannot run the model in pipeline stages.
        tensor_parallel: it cannot split the model's layers over TP ranks as
            costed (a layer whose TP plan leaves part of it whole).
        sequence_parallel, context_parallel, expert_parallel: it cannot run
            the model with sequence, context or expert parallelism.
        selective_recompute: it cannot recompute only the attention core of
            the model's layers (Korthikanti's selective recomputation).
    """

    build: str = ""
    pipeline: str = ""
    tensor_parallel: str = ""
    sequence_parallel: str = ""
    context_parallel: str = ""
    expert_parallel: str = ""
    selective_recompute: str = ""

    @staticmethod
    def from_dict(data: Any, where: str) -> RuntimeSupport:
        """The facts ``asdict`` wrote (a model file): every key a string, none unknown."""
        if not isinstance(data, dict):
            raise HetplanError(f"{where} must be a JSON object, got {_describe(data)}")
        known = {f.name for f in fields(RuntimeSupport)}
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown:
            raise HetplanError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(known)}")
        for key, value in data.items():
            if not isinstance(value, str):
                raise HetplanError(f"{where}: {key} must be a string (empty: supported), got {_describe(value)}")
        return RuntimeSupport(**data)


@dataclass(frozen=True)
class ModelSpec:
    """A model as an ordered list of layers, in execution order.

    Attributes:
        name: preset or file name.
        family: "gpt", "llama", "bert", "vit", "swin", "t5", "moe", "wresnet", ...
        layers: the layers in forward order (encoder before decoder for T5).
        seq_len: tokens per sample (patches for vision transformers; 1 for CNNs).
        dtype_bytes: bytes per activation/parameter element in training
            (2 for fp16/bf16 mixed precision, 4 for fp32).
        hidden_size, num_heads: for TP checks and reports (0 if not a transformer).
        vocab_size: 0 where there is no vocabulary.
        meta: notes about where the spec came from (citations, how costs
            were found), and facts recorded at import that some code reads
            (not part of equality): ``architecture`` (the HF or preset shape
            facts the runtime's memory/time model and the exports read),
            ``layer_modules`` (a traced layer's module paths, for the runtime's
            TP/recompute on multi-module layers), ``decoder_seq_len`` (T5's
            target length), ``seq_len_default`` (no length was given),
            ``precision`` ("fp16" for exports), ``moe`` and
            ``latent_attention`` (export checks), ``tied_params``;
            ``runtime_pipeline``/``pipeline_blocker`` only in model files
            written before ``runtime`` existed (read by ``plan.support``).
        source: what the runtime builds the model from (a HF class and its
            config values, a ``pkg.mod:build`` function and its hash; None:
            the built-in model from the layers), ``hetplan.model.origin``.
        runtime: what hetplan's runtime can run of this model, found by the
            runtime's own checks when the model was imported (a HF config's
            class, a ``pkg.mod:build`` module); None for presets, which the
            runtime builds itself (``hetplan.runtime.support``).
    """

    name: str
    family: str
    layers: tuple[LayerSpec, ...]
    seq_len: int
    dtype_bytes: int = 2
    hidden_size: int = 0
    num_heads: int = 0
    vocab_size: int = 0
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    runtime: RuntimeSupport | None = field(default=None, compare=False, hash=False)
    source: ModelSource | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        where = f"model {self.name!r}" if isinstance(self.name, str) else "model"
        if isinstance(self.runtime, dict):  # from a model file (to_dict)
            object.__setattr__(self, "runtime", RuntimeSupport.from_dict(self.runtime, f"{where}: runtime"))
        if not self.layers:
            raise HetplanError(f"{where} has no layers")
        if len(self.layers) > MAX_LAYERS:
            raise HetplanError(f"{where} has {len(self.layers)} layers, above hetplan's limit of {MAX_LAYERS}")
        for name, value in _checked_values(self, _MODEL_RULES, where).items():
            object.__setattr__(self, name, value)
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            duplicate = next(n for n in names if names.count(n) > 1)
            raise HetplanError(f"{where}: layer names must be unique ({duplicate!r} appears twice or more)")
        object.__setattr__(self, "layers", tuple(self.layers))
        if self.total_params > MAX_PARAMS:
            raise HetplanError(f"{where} has {self.total_params:.3g} parameters, above hetplan's limit of "
                               f"{MAX_PARAMS:.0e}; check the layers' params")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def total_params(self) -> int:
        """Parameters of the model, counting tied parameters once."""
        return sum(layer.params - layer.tied_params for layer in self.layers)

    @property
    def fwd_flops_per_sample(self) -> float:
        return sum(layer.fwd_flops for layer in self.layers)

    @property
    def train_flops_per_sample(self) -> float:
        """Forward + backward (2x forward) FLOPs per sample: the MFU numerator."""
        return 3.0 * self.fwd_flops_per_sample

    @property
    def act_bytes_per_sample(self) -> float:
        """All activation bytes kept for backward for one sample (no TP, no recompute)."""
        return sum(layer.act_bytes for layer in self.layers)

    def layer_index(self, name: str) -> int:
        for i, layer in enumerate(self.layers):
            if layer.name == name:
                return i
        raise HetplanError(f"model {self.name!r} has no layer named {name!r}")

    def with_layers(self, layers: list[LayerSpec], **changes: Any) -> ModelSpec:
        return replace(self, layers=tuple(layers), **changes)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["layers"] = [asdict(layer) for layer in self.layers]
        data["source"] = self.source.to_dict() if self.source is not None else None
        return data

    @staticmethod
    def from_dict(data: Any, source: str = "model description") -> ModelSpec:
        """The ModelSpec ``to_dict`` wrote; ``source`` names it in messages
        ("model file m.json"). Every problem (a missing or unknown key, a value
        of the wrong type, out of range or above hetplan's limits) is one
        HetplanError naming the field and the layer, raised before any layer
        is built (``validate_model_dict``)."""
        values, layers = validate_model_dict(data, source)
        if "source" in values:
            stale = [k for k in LEGACY_META_KEYS if k in values.get("meta", {})]
            if stale:
                raise HetplanError(f"{source}: meta.{stale[0]} says how to build the model, which 'source' says now; "
                                   "remove it from meta")
            values["source"] = source_from_dict(values["source"], source)
        else:  # written before ModelSpec.source (plan file format <= 3): meta said it
            values["source"], values["meta"] = source_from_meta(values.get("meta", {}), source)
        return ModelSpec(layers=tuple(LayerSpec(**layer) for layer in layers), **values)


# --------------------------------------------------------------------------- validation
#
# One set of rules for both ways a model is made: ``ModelSpec.from_dict`` (a
# JSON file: every key and type checked before anything is built) and the
# dataclasses' ``__post_init__`` (presets, importers: the same value checks).


@dataclass(frozen=True)
class _Rule:
    kind: str  # "int", "float", "str" or "dict"
    minimum: float = 0
    maximum: float = MAX_PER_SAMPLE
    required: bool = False
    nonempty: bool = False  # strings
    unit: str = ""  # of the maximum, in messages ("tokens")
    choices: tuple[int, ...] = ()  # the only values allowed, if any


def _rules(cls: type, overrides: dict[str, _Rule]) -> dict[str, _Rule]:
    """A rule per dataclass field: its annotated type, >= 0, required where it has no default."""
    out = {}
    for f in fields(cls):
        required = f.default is MISSING and f.default_factory is MISSING
        kind = str(f.type).split("[")[0].split(".")[-1]
        rule = overrides.get(f.name, _Rule(kind))
        out[f.name] = replace(rule, required=required)
    return out


def show_number(value: Any) -> str:
    """A number for a message: ints in full up to 16 digits, else 3 significant digits."""
    if isinstance(value, numbers.Integral):
        whole = int(value)
        if abs(whole) < 10**16:
            return str(value)
        if abs(whole) >= 10**300:
            return f"{str(whole)[:1]}e+{len(str(abs(whole))) - 1}"
    return f"{value:.3g}" if abs(value) >= 1e6 or value != int(value) else str(int(value))


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return f"a JSON {'list' if isinstance(value, list) else 'object'}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _depth(value: Any) -> int:
    """How deeply ``value`` nests lists and objects (a number: 0), without recursion."""
    deepest, todo = 0, [(value, 0)]
    while todo:
        item, level = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level + 1)
        if deepest > MAX_META_DEPTH:
            break
        todo.extend((child, level + 1) for child in children)
    return deepest


def _check_value(value: Any, name: str, rule: _Rule, where: str) -> Any:
    """``value`` if it obeys ``rule`` (an integral float for an int field
    becomes an int), else a HetplanError naming ``where`` and ``name``."""
    if rule.kind == "str":
        if not isinstance(value, str) or (rule.nonempty and not value):
            raise HetplanError(f"{where}: {name} must be a {'non-empty ' if rule.nonempty else ''}string, "
                               f"got {_describe(value)}")
        return value
    if rule.kind == "dict":
        if not isinstance(value, dict):
            raise HetplanError(f"{where}: {name} must be a JSON object, got {_describe(value)}")
        if _depth(value) > MAX_META_DEPTH:
            raise HetplanError(f"{where}: {name} nests deeper than hetplan's limit of {MAX_META_DEPTH} levels; "
                               "flatten it")
        return value
    if rule.kind == "bool":
        if not isinstance(value, bool):
            raise HetplanError(f"{where}: {name} must be true or false, got {_describe(value)}")
        return value
    if rule.kind == "support":  # ModelSpec.runtime: checked by RuntimeSupport.from_dict
        if value is not None and not isinstance(value, (dict, RuntimeSupport)):
            raise HetplanError(f"{where}: {name} must be a JSON object or null, got {_describe(value)}")
        return value
    if rule.kind == "origin":
        return value
    whole = rule.kind == "int"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise HetplanError(f"{where}: {name} must be a {'whole number' if whole else 'number'}, "
                           f"got {_describe(value)}")
    if not isinstance(value, numbers.Integral) and not math.isfinite(value):  # ints may exceed floats
        raise HetplanError(f"{where}: {name} is not a finite number ({value}); give a number >= {rule.minimum:g}")
    if whole and not isinstance(value, numbers.Integral):
        if not float(value).is_integer():
            raise HetplanError(f"{where}: {name} must be a whole number, got {value!r}")
        value = int(float(value))  # an integral float (checked above)
    shown = show_number(value)
    if rule.choices and value not in rule.choices:
        raise HetplanError(f"{where}: {name} must be {' or '.join(map(str, rule.choices))}, got {shown}")
    if value < rule.minimum:
        raise HetplanError(f"{where}: {name} = {shown} must be >= {rule.minimum:g}")
    if value > rule.maximum:
        maximum = int(rule.maximum) if rule.maximum < 1e18 else f"{rule.maximum:.0e}"
        raise HetplanError(f"{where}: {name} = {shown} is above hetplan's limit of {maximum}"
                           f"{' ' + rule.unit if rule.unit else ''}; check the value")
    return value


def _checked_values(obj: Any, rules: dict[str, _Rule], where: str) -> dict[str, Any]:
    """The fields of ``obj`` whose checked value differs in type (int for 2.0)."""
    changed = {}
    for name, rule in rules.items():
        if rule.kind == "tuple":
            continue
        value = getattr(obj, name)
        checked = _check_value(value, name, rule, where)
        if type(checked) is not type(value):
            changed[name] = checked
    return changed


def _check_layer_relations(v: dict[str, Any], where: str) -> None:
    """The rules between a layer's fields (its values already checked one by one)."""
    if v["tied_params"] > v["params"]:
        raise HetplanError(f"{where}: tied_params must be between 0 and its {v['params']} params")
    if v["params_tp_replicated"] > v["params"]:
        raise HetplanError(f"{where}: params_tp_replicated must be between 0 and its {v['params']} params")
    if v["tied_params"] and not v["tied_group"]:
        raise HetplanError(f"{where}: tied_params needs a tied_group")
    if v["attention_flops"] > v["fwd_flops"] * 1.000001:
        raise HetplanError(f"{where}: attention_flops ({v['attention_flops']:.6g}) exceed fwd_flops "
                           f"({v['fwd_flops']:.6g}), of which they are a part")
    if v["act_tp_replicated_bytes"] + v["act_attention_core_bytes"] > v["act_bytes"] * 1.000001:
        raise HetplanError(f"{where}: act_tp_replicated_bytes + act_attention_core_bytes exceed act_bytes")
    if v["act_linear_input_bytes"] + v["act_attention_core_bytes"] > v["act_bytes"] * 1.000001:
        raise HetplanError(f"{where}: act_linear_input_bytes + act_attention_core_bytes exceed act_bytes")
    if v["act_linear_input_replicated_bytes"] > min(v["act_linear_input_bytes"],
                                                     v["act_tp_replicated_bytes"]) * 1.000001:
        raise HetplanError(f"{where}: act_linear_input_replicated_bytes exceed act_linear_input_bytes "
                           "or act_tp_replicated_bytes, of which they are a part")
    if v["attention"] not in ATTENTION_KINDS:
        raise HetplanError(f"{where}: attention must be one of {', '.join(repr(k) for k in ATTENTION_KINDS)}, "
                           f"got {v['attention']!r}")
    if v["attention_window"] and v["attention"] != "sliding":
        raise HetplanError(f"{where}: attention_window needs attention 'sliding'")
    if v["num_experts"] and not 1 <= v["top_k"] <= v["num_experts"]:
        raise HetplanError(f"{where}: top_k must be between 1 and num_experts ({v['num_experts']}), "
                           f"got {v['top_k']}")
    if not v["num_experts"] and (v["top_k"] or v["expert_params"] or v["expert_flops"] or v["dispatch_bytes"]):
        raise HetplanError(f"{where}: top_k, expert_params, expert_flops and dispatch_bytes need num_experts >= 1")
    if v["expert_params"] > v["params"] - v["params_tp_replicated"]:
        raise HetplanError(f"{where}: expert_params exceed the layer's TP-split params "
                           f"({v['params'] - v['params_tp_replicated']})")
    if v["expert_flops"] > v["fwd_flops"] * 1.000001:
        raise HetplanError(f"{where}: expert_flops ({v['expert_flops']:.6g}) exceed fwd_flops "
                           f"({v['fwd_flops']:.6g}), of which they are a part")


def _check_keys(data: Any, rules: dict[str, _Rule], where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise HetplanError(f"{where} must be a JSON object, got {_describe(data)}")
    unknown = sorted(str(k) for k in data if k not in rules)
    if unknown:
        raise HetplanError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(rules)}")
    missing = [k for k, rule in rules.items() if rule.required and k not in data]
    if missing:
        raise HetplanError(f"{where}: missing key(s) {missing}")
    return {k: _check_value(v, k, rules[k], where) if rules[k].kind != "tuple" else v for k, v in data.items()}


LAYER_BYTE_FIELDS = tuple(f.name for f in fields(LayerSpec) if f.name.endswith("_bytes"))
_LAYER_RULES = _rules(LayerSpec, {
    **{name: _Rule("float", maximum=MAX_LAYER_BYTES_PER_SAMPLE, unit="bytes per sample")
       for name in LAYER_BYTE_FIELDS},
    "name": _Rule("str", nonempty=True),
    "kind": _Rule("str", nonempty=True),
    "params": _Rule("int", maximum=MAX_PARAMS, unit="parameters"),
    "params_tp_replicated": _Rule("int", maximum=MAX_PARAMS, unit="parameters"),
    "tied_params": _Rule("int", maximum=MAX_PARAMS, unit="parameters"),
    "expert_params": _Rule("int", maximum=MAX_PARAMS, unit="parameters"),
    "attention_window": _Rule("int", maximum=MAX_SEQ_LEN, unit="tokens"),
    "num_experts": _Rule("int", maximum=MAX_EXPERTS, unit="experts"),
    "top_k": _Rule("int", maximum=MAX_EXPERTS, unit="experts"),
    "capacity_factor": _Rule("float", maximum=MAX_CAPACITY_FACTOR),
})
_MODEL_RULES = _rules(ModelSpec, {
    "layers": _Rule("tuple"),
    "runtime": _Rule("support"),
    "source": _Rule("origin"),  # checked by hetplan.model.origin.source_from_dict
    "seq_len": _Rule("int", minimum=1, maximum=MAX_SEQ_LEN, unit="tokens"),
    "dtype_bytes": _Rule("int", choices=(2, 4)),  # bf16/fp16 or fp32
})
_LAYER_DEFAULTS = {f.name: f.default for f in fields(LayerSpec) if f.default is not MISSING}


def validate_model_dict(data: Any, source: str = "model description") -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Check a ModelSpec JSON object (``ModelSpec.to_dict``) before anything is
    built: keys, types, finite and non-negative numbers, whole numbers where a
    count goes, hetplan's limits (``MAX_LAYERS``, ``MAX_PARAMS``,
    ``MAX_SEQ_LEN``). Returns the model's values (without layers) and the
    layers' values, integral floats made ints; raises a one-line
    HetplanError naming ``source``, the layer and the field."""
    values = _check_keys(data, _MODEL_RULES, source)
    raw_layers = values.pop("layers")
    if not isinstance(raw_layers, list):
        raise HetplanError(f"{source}: layers must be a list of layer objects, got {_describe(raw_layers)}")
    if not raw_layers:
        raise HetplanError(f"{source}: the model has no layers; a model needs at least one")
    if len(raw_layers) > MAX_LAYERS:
        raise HetplanError(f"{source}: {len(raw_layers)} layers is above hetplan's limit of {MAX_LAYERS} layers")
    layers = []
    total = 0
    seen: dict[str, int] = {}
    for i, raw in enumerate(raw_layers):
        name = raw.get("name") if isinstance(raw, dict) else None
        where = f"{source}: layer {i}" + (f" ({name!r})" if isinstance(name, str) and name else "")
        layer = _check_keys(raw, _LAYER_RULES, where)
        _check_layer_relations({**_LAYER_DEFAULTS, **layer}, where)
        if layer["name"] in seen:
            raise HetplanError(f"{where}: layer {seen[layer['name']]} has the same name; layer names must be unique")
        seen[layer["name"]] = i
        total += layer["params"] - layer.get("tied_params", 0)
        layers.append(layer)
    if total > MAX_PARAMS:
        raise HetplanError(f"{source}: {total:.3g} parameters in all is above hetplan's limit of {MAX_PARAMS:.0e}")
    return values, layers
