"""HF transformers models in pipeline stages: the model's forward, one stage at a time.

A HF decoder or encoder is not a chain of its layers: its forward turns the
2-D attention mask into a 4-D one, computes rotary embeddings or adds position
embeddings, and passes all of that to every layer as keyword inputs. A
pipeline of the bare layers would drop them (hetplan.model.chain refuses it).

A :class:`StagedForward` (one per HF family) says how that forward splits at
layer boundaries: ``embed`` (first stage), ``context`` (what every layer also
takes -- the 4-D mask, rotary embeddings, position ids -- recomputed on every
stage from the stage's micro-batch of the model's own inputs, which
``train_step`` gives every stage), ``block`` (one layer) and ``head`` (last
stage). Only the hidden state travels between stages, except in T5 (an
encoder-decoder: :class:`_T5` passes a tuple of what the rest of its forward
needs, and refuses the splits a plan cannot carry). Each piece calls the
HF modules and HF's own mask functions exactly as the model's forward does,
and :func:`check_staged_forward` proves it on the real model before training:
the staged forward over all layers must give the model's own logits, with a
padded attention mask, or the plan is refused with one line.

Why not ``torch.distributed.pipelining.pipeline`` (torch.export): on torch
2.13 with transformers 5 it fails on Llama and GPT-2 (their outputs hold a
``DynamicCache`` export cannot flatten), and the stages it makes hold graph
modules instead of ``nn.Linear`` (with batch and sequence sizes fixed at trace
time), so DTensor's ``ColwiseParallel``/``RowwiseParallel`` cannot apply TP to
them (docs/runtime.md, "Pipeline details").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import SimpleNamespace
from typing import Any, Sequence

import torch
from torch import nn

from hetplan.errors import HetplanError

# Relative difference allowed between the staged forward and the model's own (fp32, same ops: ~0)
STAGED_TOLERANCE = 1e-5


class StagedForward(ABC):
    """How one HF family's forward runs split at layer boundaries (module docstring).

    ``model_inputs``: the keyword inputs of the model a stage may need (each a
    tensor with the batch first). ``helpers``: parameter-free modules every
    stage needs besides its layers (rotary embeddings)."""

    family = ""
    model_inputs: tuple[str, ...] = ("attention_mask",)
    required_inputs: tuple[str, ...] = ()  # of model_inputs, those train_step must pass

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        self.config = model.config
        self.model_class = type(model).__name__
        self.prefix = getattr(model, "base_model_prefix", "") or ""
        self.embed_name, self.head_name = names[0], names[-1]
        self.output_class = _output_class(model)

    @property
    def helpers(self) -> tuple[str, ...]:
        return ()

    def sub(self, part: nn.Module, name: str) -> nn.Module:
        return part.get_submodule(f"{self.prefix}.{name}" if self.prefix else name)

    def wrap_output(self, logits: Any) -> Any:
        """The last stage sends a plain tensor; the loss sees what the model returns (``.logits``)."""
        if self.output_class is None or not isinstance(logits, torch.Tensor):
            return logits
        return self.output_class(logits=logits)

    # keyword arguments of the model's own forward in the check (no KV cache)
    own_kwargs: dict[str, Any] = {"use_cache": False}

    def example(self, model: nn.Module, seq_len: int, vocab_size: int, g: torch.Generator
                ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Two samples of the model's main input and its keyword inputs, with padding
        (row 0 ends in padding), on CPU, for :func:`check_staged_forward`."""
        seq = max(2, min(seq_len, 8))
        ids = torch.randint(0, vocab_size, (2, seq), generator=g)
        return ids, {"attention_mask": _padded_mask(seq)}

    def split_refusal(self, stage_layers: Sequence[Sequence[str]], heterogeneous: bool) -> str:
        """Why this model cannot run split into these stages (each stage's layer
        names in order); "" if it can. Only the hidden state crosses a boundary here."""
        return ""

    @abstractmethod
    def run(self, part: nn.Module, names: Sequence[str], x: Any, inputs: dict[str, Any]) -> Any:
        """This part's layers (``names``, in order) on what the previous stage sent
        (the model's main input on the first stage)."""


class _HiddenStateForward(StagedForward):
    """A family whose stages pass only the hidden state: an embedding, blocks
    that each take the hidden state and a per-stage context, and a head."""

    @abstractmethod
    def embed(self, part: nn.Module, input_ids: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        """The hidden state of the first layer from the model's main input."""

    @abstractmethod
    def context(self, part: nn.Module, hidden: torch.Tensor, inputs: dict[str, Any]) -> dict[str, Any]:
        """What every block of a stage needs besides the hidden state (masks, rotary embeddings)."""

    @abstractmethod
    def block(self, layer: nn.Module, hidden: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        """One layer on the hidden state."""

    @abstractmethod
    def head(self, part: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """The last layer: final norm and output projection."""

    def run(self, part: nn.Module, names: Sequence[str], x: Any, inputs: dict[str, Any]) -> Any:
        """This part's layers (``names``, in order) on ``x``: token ids if it holds the
        embedding, else the previous stage's hidden state."""
        hidden = self.embed(part, x, inputs) if names and names[0] == self.embed_name else x
        blocks = [n for n in names if n not in (self.embed_name, self.head_name)]
        if blocks:
            ctx = self.context(part, hidden, inputs)
            for name in blocks:
                hidden = self.block(part.get_submodule(name), hidden, ctx)
        if names and names[-1] == self.head_name:
            return self.head(part, hidden)
        return hidden


def _padded_mask(seq: int) -> torch.Tensor:
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[0, seq - seq // 2:] = 0
    return mask


def _positions(hidden: torch.Tensor) -> torch.Tensor:
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


class _RopeDecoder(_HiddenStateForward):
    """Llama, Mistral, Mixtral: ``LlamaModel.forward`` (causal or sliding-window mask,
    rotary embeddings from ``rotary_emb``), then ``lm_head(norm(h))``."""

    family = "llama"

    @property
    def helpers(self) -> tuple[str, ...]:
        return (f"{self.prefix}.rotary_emb",)

    def embed(self, part: nn.Module, input_ids: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        return self.sub(part, "embed_tokens")(input_ids)

    def context(self, part: nn.Module, hidden: torch.Tensor, inputs: dict[str, Any]) -> dict[str, Any]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        pos = _positions(hidden)
        make = create_causal_mask if getattr(self.config, "sliding_window", None) is None \
            else create_sliding_window_causal_mask
        mask = make(config=self.config, inputs_embeds=hidden, attention_mask=inputs.get("attention_mask"),
                    past_key_values=None, position_ids=pos)
        rope = self.sub(part, "rotary_emb")(hidden, position_ids=pos)
        return {"attention_mask": mask, "position_embeddings": rope, "position_ids": pos,
                "past_key_values": None, "use_cache": False}

    def block(self, layer: nn.Module, hidden: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        return layer(hidden, **ctx)

    def head(self, part: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return part.get_submodule(self.head_name)(self.sub(part, "norm")(hidden))


class _LayerTypedDecoder(_RopeDecoder):
    """Qwen2, Qwen3: ``config.layer_types`` gives each layer full or sliding-window
    attention; both masks are made (as the model's forward does) and each layer
    takes its own (its attention's ``layer_idx``)."""

    family = "qwen"

    def context(self, part: nn.Module, hidden: torch.Tensor, inputs: dict[str, Any]) -> dict[str, Any]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        pos = _positions(hidden)
        args = {"config": self.config, "inputs_embeds": hidden, "attention_mask": inputs.get("attention_mask"),
                "past_key_values": None, "position_ids": pos}
        masks = {"full_attention": create_causal_mask(**args)}
        if "sliding_attention" in self.config.layer_types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**args)
        rope = self.sub(part, "rotary_emb")(hidden, position_ids=pos)
        return {"masks": masks, "position_embeddings": rope, "position_ids": pos}

    def block(self, layer: nn.Module, hidden: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        kind = self.config.layer_types[layer.self_attn.layer_idx]
        return layer(hidden, attention_mask=ctx["masks"][kind], position_embeddings=ctx["position_embeddings"],
                     position_ids=ctx["position_ids"], past_key_values=None, use_cache=False)


class _GPT2(_HiddenStateForward):
    """``GPT2Model.forward``: token + position (+ token type) embeddings, dropout,
    causal mask; then ``lm_head(ln_f(h))``."""

    family = "gpt2"
    model_inputs = ("attention_mask", "token_type_ids")

    def embed(self, part: nn.Module, input_ids: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        wte = self.sub(part, "wte")
        hidden = wte(input_ids) + self.sub(part, "wpe")(torch.arange(input_ids.shape[1], device=input_ids.device))
        if inputs.get("token_type_ids") is not None:
            hidden = hidden + wte(inputs["token_type_ids"])
        return self.sub(part, "drop")(hidden)

    def context(self, part: nn.Module, hidden: torch.Tensor, inputs: dict[str, Any]) -> dict[str, Any]:
        from transformers.masking_utils import create_causal_mask

        mask = inputs.get("attention_mask")
        if mask is not None and mask.ndim < 4:
            mask = mask.view(hidden.shape[0], -1)
        pos = _positions(hidden)
        causal = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=mask,
                                    past_key_values=None, position_ids=pos)
        return {"mask": causal, "position_ids": pos}

    def block(self, layer: nn.Module, hidden: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        return layer(hidden, None, ctx["mask"], None, encoder_attention_mask=None, use_cache=False,
                     position_ids=ctx["position_ids"])

    def head(self, part: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return part.get_submodule(self.head_name)(self.sub(part, "ln_f")(hidden))


class _BertEncoder(_HiddenStateForward):
    """``BertModel.forward`` of an encoder (bidirectional mask) under a masked-LM
    head: ``embeddings``, the layers, then the head module (``cls`` / ``lm_head``)."""

    family = "bert"
    model_inputs = ("attention_mask", "token_type_ids")

    def embed(self, part: nn.Module, input_ids: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        # no cache offset argument: its name changed between transformers releases
        # (past_key_values_length in 5.23, cache_length in 5.24) and its default, 0, is ours
        return self.sub(part, "embeddings")(input_ids=input_ids, token_type_ids=inputs.get("token_type_ids"),
                                            position_ids=None, inputs_embeds=None)

    def context(self, part: nn.Module, hidden: torch.Tensor, inputs: dict[str, Any]) -> dict[str, Any]:
        from transformers.masking_utils import create_bidirectional_mask

        mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden,
                                         attention_mask=inputs.get("attention_mask"))
        return {"mask": mask}

    def block(self, layer: nn.Module, hidden: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        return layer(hidden, ctx["mask"], None, encoder_attention_mask=None, past_key_values=None)

    def head(self, part: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return part.get_submodule(self.head_name)(hidden)


class _ViT(_HiddenStateForward):
    """``ViTForImageClassification.forward``: ``embeddings`` (patches, the CLS token,
    position embeddings, dropout), the layers with HF's bidirectional mask (none
    for whole images; an ``attention_mask`` over CLS + patches is honoured), then
    ``classifier(layernorm(h)[:, 0])``. The first stage takes ``pixel_values``."""

    family = "vit"
    own_kwargs: dict[str, Any] = {}

    def example(self, model: nn.Module, seq_len: int, vocab_size: int, g: torch.Generator
                ) -> tuple[torch.Tensor, dict[str, Any]]:
        size = self.config.image_size
        size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
        return torch.randn(2, self.config.num_channels, *size, generator=g), {}

    def embed(self, part: nn.Module, pixels: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        emb = self.sub(part, "embeddings")
        return emb(pixels.to(emb.patch_embeddings.projection.weight.dtype), bool_masked_pos=None,
                   interpolate_pos_encoding=False)

    def context(self, part: nn.Module, hidden: torch.Tensor, inputs: dict[str, Any]) -> dict[str, Any]:
        from transformers.masking_utils import create_bidirectional_mask

        return {"mask": create_bidirectional_mask(config=self.config, inputs_embeds=hidden,
                                                  attention_mask=inputs.get("attention_mask"))}

    def block(self, layer: nn.Module, hidden: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        return layer(hidden, ctx["mask"])

    def head(self, part: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return part.get_submodule(self.head_name)(self.sub(part, "layernorm")(hidden)[:, 0, :])


class _T5(StagedForward):
    """``T5ForConditionalGeneration.forward``: the encoder stack on ``input_ids``
    (bidirectional mask), then the decoder stack on ``decoder_input_ids`` (causal
    mask; cross-attention over the encoder output with the encoder's mask), then
    ``lm_head`` (after the decoder's final norm and, with
    ``scale_decoder_outputs``, the ``d_model ** -0.5`` scale).

    What crosses a stage boundary is what the rest of the forward needs:
    the encoder's hidden state; once its first block ran, the relative position
    bias that block computed (every later block of the stack adds it, so its
    gradient flows back to the first block's ``relative_attention_bias``
    weight on the stage that owns it); inside the decoder, also the encoder's
    output. The masks are rebuilt on every stage from the model's keyword
    inputs; the cross-attention bias is zeros (that attention has no relative
    bias) and is recomputed by each block."""

    family = "t5"
    model_inputs = ("attention_mask", "decoder_input_ids", "decoder_attention_mask")
    required_inputs = ("decoder_input_ids",)  # the labels shifted right; the model's forward would make them

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        super().__init__(model, names)
        self.names = list(names)
        self.enc_config, self.dec_config = model.encoder.config, model.decoder.config
        self.dec_embed = next(n for n in names if n.startswith("decoder.") and ".block." not in n + ".")
        self.last_enc = max((n for n in names if n.startswith("encoder.block.")), key=self.names.index)
        self.last_dec = max((n for n in names if n.startswith("decoder.block.")), key=self.names.index)

    @property
    def helpers(self) -> tuple[str, ...]:
        return ("encoder.dropout", "decoder.dropout")

    def example(self, model: nn.Module, seq_len: int, vocab_size: int, g: torch.Generator
                ) -> tuple[torch.Tensor, dict[str, Any]]:
        ids, inputs = super().example(model, seq_len, vocab_size, g)
        seq = ids.shape[1] - 1  # a decoder length other than the encoder's
        dec = torch.randint(0, vocab_size, (2, seq), generator=g)
        return ids, {**inputs, "decoder_input_ids": dec, "decoder_attention_mask": _padded_mask(seq).flip(0)}

    def carried(self, name: str) -> tuple[str, ...]:
        """What crosses a boundary right after layer ``name`` (the module docstring)."""
        if name == self.head_name:
            return ("logits",)
        if name == self.last_dec:
            return ("dec",)
        if name.startswith("decoder."):
            return ("enc", "dec") if name == self.dec_embed else ("enc", "dec", "dec_bias")
        if name == self.last_enc or not name.startswith("encoder.block."):
            return ("enc",)
        return ("enc", "enc_bias")

    def split_refusal(self, stage_layers: Sequence[Sequence[str]], heterogeneous: bool) -> str:
        if not heterogeneous:
            return ""
        for layers in stage_layers[:-1]:
            if layers and len(self.carried(layers[-1])) > 1:
                return (f"a T5 pipeline split after {layers[-1]} passes {' + '.join(self.carried(layers[-1]))} to "
                        "the next stage, and a plan with stages of different (dp, tp) passes one tensor; split "
                        "T5 after its embedding or between encoder and decoder, or use stages of equal (dp, tp)")
        return ""

    def run(self, part: nn.Module, names: Sequence[str], x: Any, inputs: dict[str, Any]) -> Any:
        k = self.names.index(names[0])
        if k == 0:
            state: dict[str, Any] = {"ids": x}
        else:
            keys = self.carried(self.names[k - 1])
            state = dict(zip(keys, x if isinstance(x, tuple) else (x,)))
        for name in names:
            self._layer(part, name, state, inputs)
        out = tuple(state[key].contiguous() for key in self.carried(names[-1]))  # gloo sends contiguous tensors
        return out[0] if len(out) == 1 else out

    def _layer(self, part: nn.Module, name: str, state: dict[str, Any], inputs: dict[str, Any]) -> None:
        """One layer of the plan, as T5Stack / T5ForConditionalGeneration run it."""
        from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

        if name == self.embed_name:
            emb = part.get_submodule(name)(state.pop("ids"))
            state["enc"] = part.get_submodule("encoder.dropout")(emb)
        elif name == self.dec_embed:
            emb = part.get_submodule(name)(inputs["decoder_input_ids"])
            state["dec"] = part.get_submodule("decoder.dropout")(emb)
        elif name.startswith("encoder."):
            mask = create_bidirectional_mask(config=self.enc_config, inputs_embeds=state["enc"],
                                             attention_mask=inputs.get("attention_mask"))
            h, state["enc_bias"], _ = part.get_submodule(name)(state["enc"], mask, state.get("enc_bias"), None, None,
                                                               None, past_key_values=None)
            if name == self.last_enc:
                h = part.get_submodule("encoder.dropout")(part.get_submodule("encoder.final_layer_norm")(h))
            state["enc"] = h
        elif name.startswith("decoder."):
            dec, enc = state["dec"], state["enc"]
            mask = create_causal_mask(config=self.dec_config, inputs_embeds=dec,
                                      attention_mask=inputs.get("decoder_attention_mask"), past_key_values=None)
            cross = create_bidirectional_mask(config=self.dec_config, inputs_embeds=dec,
                                              attention_mask=inputs.get("attention_mask"), encoder_hidden_states=enc)
            state["dec"], state["dec_bias"], _ = part.get_submodule(name)(dec, mask, state.get("dec_bias"), enc,
                                                                          cross, None, past_key_values=None)
        else:  # the head
            h = part.get_submodule("decoder.dropout")(part.get_submodule("decoder.final_layer_norm")(state["dec"]))
            if getattr(self.config, "scale_decoder_outputs", False):
                h = h * (self.config.d_model ** -0.5)
            state["logits"] = part.get_submodule(name)(h)


# HF class -> its staged forward. Each entry is checked against the model's own
# forward (check_staged_forward) before it trains; tests/distributed/test_runtime_hf_pipeline.py.
STAGED: dict[str, type[StagedForward]] = {
    "LlamaForCausalLM": _RopeDecoder,
    "MistralForCausalLM": _RopeDecoder,
    "MixtralForCausalLM": _RopeDecoder,
    "Qwen2ForCausalLM": _LayerTypedDecoder,
    "Qwen3ForCausalLM": _LayerTypedDecoder,
    "GPT2LMHeadModel": _GPT2,
    "BertForMaskedLM": _BertEncoder,
    "RobertaForMaskedLM": _BertEncoder,
    "ViTForImageClassification": _ViT,
    "T5ForConditionalGeneration": _T5,
}


def _output_class(model: nn.Module) -> Any:
    """The ModelOutput class the model's forward returns (for ``.logits`` in a loss)."""
    import inspect

    ret = inspect.signature(type(model).forward).return_annotation
    for candidate in getattr(ret, "__args__", (ret,)):
        if isinstance(candidate, type) and "logits" in getattr(candidate, "__dataclass_fields__", {}):
            return candidate
    return None


def unsupported_reason(model: nn.Module) -> str:
    """Why hetplan cannot pipeline this HF model ("" if it can): the class and what is missing."""
    name = type(model).__name__
    if name not in STAGED:
        known = ", ".join(sorted(STAGED))
        return (f"hetplan has no staged forward for {name} (pipelining a HF model needs one; it has {known}); "
                "use a plan with one pipeline stage")
    config = model.config
    if getattr(config, "is_decoder", False) and STAGED[name] is _BertEncoder:
        return f"{name} configured as a decoder (is_decoder=True) has no staged forward; use one pipeline stage"
    if name == "MixtralForCausalLM" and getattr(config, "output_router_logits", False):
        return ("MixtralForCausalLM with output_router_logits=True adds the router's auxiliary loss over all layers, "
                "which a pipeline stage cannot see; set output_router_logits=False or use one pipeline stage")
    return ""


def staged_forward(model: nn.Module, names: Sequence[str]) -> StagedForward | None:
    """The staged forward of a HF model (None for other models); raises with the
    reason for a HF model hetplan cannot pipeline."""
    if not _is_hf(model):
        return None
    why = unsupported_reason(model)
    if why:
        raise HetplanError(why)
    return STAGED[type(model).__name__](model, names)


def _is_hf(model: nn.Module) -> bool:
    """A transformers model (without importing transformers for other models: seconds)."""
    import sys

    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def example_model_inputs(model: nn.Module, seq_len: int, vocab_size: int) -> tuple[torch.Tensor, dict[str, Any]]:
    """Two samples of the model's main input (token ids, an image) and its keyword
    inputs with padding (row 0 of an attention mask ends in padding), on the
    model's device (:meth:`StagedForward.example`)."""
    device = next(iter(model.parameters())).device
    g = torch.Generator().manual_seed(0)
    cls = STAGED.get(type(model).__name__)
    if cls is None:  # no staged forward: token ids and a padded mask, what the base class makes
        x, inputs = StagedForward.example(SimpleNamespace(config=model.config), model,  # type: ignore[arg-type]  # a stand-in: only .config is read
                                          seq_len, vocab_size, g)
    else:  # example() reads only the config: the family's forward needs no layer names for it
        staged = cls.__new__(cls)
        staged.config = model.config
        x, inputs = staged.example(model, seq_len, vocab_size, g)
    return x.to(device), {k: v.to(device) for k, v in inputs.items()}


def check_staged_forward(model: nn.Module, stages: StagedForward, names: Sequence[str],
                         ids: torch.Tensor, inputs: dict[str, Any]) -> None:
    """Run the staged forward over all layers and the model's own forward on the
    same inputs (dropout off); refuse, with one line, a difference in shape or
    value. Needs the real model: HF's mask code reads values, so neither forward
    runs on the meta device."""
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            own = model(ids, **inputs, **stages.own_kwargs).logits
            staged = stages.run(model, list(names), ids, inputs)
    except HetplanError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the HF code on these inputs
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HetplanError(f"the staged forward of {type(model).__name__} failed ({type(e).__name__}: {first}); "
                           "use a plan with one pipeline stage") from None
    finally:
        model.train(training)
    if tuple(own.shape) != tuple(staged.shape):
        raise HetplanError(f"the staged forward of {type(model).__name__} gives logits of shape "
                           f"{tuple(staged.shape)}, its own forward {tuple(own.shape)}; use one pipeline stage")
    diff = float((own.float() - staged.float()).abs().max()) / max(float(own.float().abs().max()), 1e-30)
    if diff > STAGED_TOLERANCE:
        raise HetplanError(
            f"the staged forward of {type(model).__name__} differs from the model's own forward by {diff:.1e} "
            f"(relative) with this config, so its pipeline would train a different model; use one pipeline stage"
        )
