"""What hetplan's runtime keeps per layer (``hetplan.model.runtime_memory``)
equals what its modules really save for backward, counted by autograd's
saved-tensor hooks on fake tensors (CPU): the built-in GPT/Llama/MoE blocks
and head in bf16 autocast and fp32, and a tiny HF Llama with its padding
mask. A change to the runtime's models that the cost model misses fails here.

Counted per layer: the storages autograd saves, each once, less parameters,
split into the 16-bit weight copies autocast made (compared with
``cast_params``) and the rest (compared with ``saved``); the head adds the
logits the runtime holds until backward. On a CPU ``F.rms_norm`` runs its
composite form, so the analytic side is asked for a CPU (``cuda=False``)."""

from __future__ import annotations

import weakref

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hetplan.model.presets import get_model
from hetplan.model.families import moe_decoder
from hetplan.model.hf import model_from_hf_config
from hetplan.model.presets import gpt_decoder
from hetplan.model.runtime_memory import runtime_memory
from hetplan.runtime.models import build_preset_model, cross_entropy_loss

BATCH = 4
TOLERANCE = 0.02  # a few scalars (the loss, its weight) and fp32 rounding of shapes: well under 2%
VIEWS = ("TBackward0", "ViewBackward0", "TransposeBackward0", "SelectBackward0", "UnsafeViewBackward0",
         "UnbindBackward0")  # runtime/models.py Experts: one expert's slice of a stacked weight
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "head_dim": 16,
              "max_position_embeddings": 64, "tie_word_embeddings": True}


def _weight_copy(tensor: torch.Tensor, params: set[int]) -> bool:
    """A 16-bit copy autocast made of a parameter (or of one expert's slice of one)."""
    fn = tensor.grad_fn
    while fn is not None and fn.name() in VIEWS:
        fn = fn.next_functions[0][0]
    if fn is None or fn.name() != "ToCopyBackward0":
        return False
    fn = fn.next_functions[0][0]
    while fn is not None and fn.name() in VIEWS:
        fn = fn.next_functions[0][0]
    return fn is not None and id(getattr(fn, "variable", None)) in params


class _Saved:
    """Bytes autograd saves, by the layer running (``layer``), each storage once."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.params = {id(p) for p in module.parameters()}
        self.param_storages = {id(p.untyped_storage()) for p in module.parameters()}
        self.seen: set[int] = set()
        self.kept: list[object] = []  # keep storages alive so their ids stay theirs
        self.layer = ""
        self.bytes: dict[tuple[str, str], int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key not in self.seen and key not in self.param_storages:
            self.seen.add(key)
            self.kept.append(storage)
            kind = "copies" if _weight_copy(tensor, self.params) else "saved"
            self.bytes[(self.layer, kind)] = self.bytes.get((self.layer, kind), 0) + storage.nbytes()
        return tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def of(self, layer: str, kind: str) -> int:
        return self.bytes.get((layer, kind), 0)


def _autocast(dtype_bytes: int):
    return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False) if dtype_bytes == 2 \
        else torch.autocast("cpu", enabled=False)


def _builtin_saved(spec, fake: bool = True) -> tuple[_Saved, int]:
    """The built-in model of ``spec``, run layer by layer on a batch and its
    loss (the runtime's ``cross_entropy_loss``); the logits' bytes."""
    mode = FakeTensorMode() if fake else torch.autocast("cpu", enabled=False)
    with mode:
        torch.manual_seed(0)
        model = build_preset_model(spec)
        if not fake:  # real tensors (the MoE's routing is data-dependent): small random weights
            for p in model.parameters():
                torch.nn.init.normal_(p, 0.0, 0.02)
        saved = _Saved(model)
        x = torch.randint(0, spec.vocab_size, (BATCH, spec.seq_len))
        with saved.hooks(), _autocast(spec.dtype_bytes):
            for layer in spec.layers:
                saved.layer = layer.name
                x = model.get_submodule(layer.name)(x)
                if layer.kind == "head":
                    cross_entropy_loss(x, torch.randint(0, spec.vocab_size, (BATCH, spec.seq_len)))
        return saved, x.untyped_storage().nbytes()


def _check(spec, saved: _Saved, logits: int, names=None) -> None:
    memory = runtime_memory(spec, cuda=False)
    assert memory is not None
    for layer, m in zip(spec.layers, memory):
        if names is not None and layer.name not in names:
            continue
        held = logits if layer.kind == "head" else 0
        expected = m.saved * BATCH + m.fixed  # per sample, and once per micro-batch
        assert saved.of(layer.name, "saved") + held == pytest.approx(expected, rel=TOLERANCE), layer.name
        copies = (m.cast_params + m.cast_expert_params) * spec.dtype_bytes if spec.dtype_bytes == 2 else 0
        assert saved.of(layer.name, "copies") == pytest.approx(copies, rel=TOLERANCE), layer.name


@pytest.mark.parametrize("name", ["gpt-bf16", "tiny-gpt", "tiny-llama-bf16"])
def test_builtin_layers_keep_what_the_model_says(name):
    spec = gpt_decoder("gpt-bf16", num_layers=2, hidden=64, heads=4, seq=32, vocab=512) if name == "gpt-bf16" \
        else get_model(name)
    saved, logits = _builtin_saved(spec)
    _check(spec, saved, logits)


@pytest.mark.parametrize("dtype_bytes", [2, 4])
def test_builtin_moe_block_keeps_what_the_model_says(dtype_bytes):
    """The MoE routes by data (``bincount``), so it runs on real (tiny) tensors."""
    spec = moe_decoder("tiny-moe", 2, 64, heads=4, num_experts=4, seq=16, vocab=256, ffn_mult=4, top_k=2,
                       dtype_bytes=dtype_bytes)
    saved, logits = _builtin_saved(spec, fake=False)
    _check(spec, saved, logits, names={"layers.1"})


def test_hf_llama_layers_keep_what_the_model_says():
    """A tiny HF Llama as ``hetplan train`` runs it: bf16 autocast, a padding
    mask (K and V repeated to every head, the mask converted in each layer)."""
    spec = model_from_hf_config(dict(TINY_LLAMA), seq_len=32)
    config = transformers.AutoConfig.for_model(**TINY_LLAMA)
    with FakeTensorMode():
        model = transformers.LlamaForCausalLM(config)
        saved = _Saved(model)
        for layer in spec.layers:
            for path in spec.meta["layer_modules"][layer.name]:
                model.get_submodule(path).register_forward_pre_hook(
                    lambda module, args, name=layer.name: setattr(saved, "layer", name))
        x = torch.randint(0, config.vocab_size, (BATCH, spec.seq_len))
        mask = (torch.arange(spec.seq_len)[None, :] < torch.full((BATCH, 1), spec.seq_len // 2)).long()
        with saved.hooks(), _autocast(2):
            out = model(x, attention_mask=mask, use_cache=False)
            saved.layer = spec.layers[-1].name
            cross_entropy_loss(out.logits, x)
        logits = out.logits.untyped_storage().nbytes()
    _check(spec, saved, logits)


class _Live(TorchDispatchMode):
    """Live bytes of the tensors made while it is on, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and id(tensor.untyped_storage()) not in self.seen:
                storage = tensor.untyped_storage()
                self.seen.add(id(storage))
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, storage.nbytes())
        return out

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes


def test_loss_backward_adds_its_working_set():
    """The loss's backward holds two fp32 logits-sized gradients beyond what
    the head saved (``working``), at the start of backward."""
    spec = gpt_decoder("wide-vocab", num_layers=1, hidden=32, heads=4, seq=32, vocab=4096)
    memory = runtime_memory(spec, cuda=False)
    with FakeTensorMode():
        model = build_preset_model(spec)
        h = torch.randn(BATCH, spec.seq_len, spec.hidden_size, requires_grad=True)
        live = _Live()
        with live:
            with _autocast(2):
                logits = model.head(h)  # held, as the runtime holds it, until backward
                loss = cross_entropy_loss(logits, torch.randint(0, spec.vocab_size, (BATCH, spec.seq_len)))
            kept, live.peak = live.live, live.live
            loss.backward()
    assert live.peak - kept == pytest.approx(memory[-1].working * BATCH, rel=TOLERANCE)
