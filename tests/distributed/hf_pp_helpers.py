"""Workers and references for HF models under pipelining (test_runtime_hf_pipeline.py).

Tiny configs built from config objects (no download), dropout 0 so runs are
deterministic. Every batch carries an attention mask with padding (a random
number of trailing pad positions per sample), so a stage that dropped the mask
would give a different loss; the loss covers every position.
"""

from __future__ import annotations

from typing import Any

from hetplan.plan.spec import Plan, uniform_stage
from hetplan.search.common.layer_splits import even_split

SEQ = 16
VOCAB = 128
DEC_SEQ = 12  # T5's decoder length (not the encoder's, so a mix-up shows)
IMAGE = 32
LABELS = 10


def config(name: str) -> Any:
    import transformers as t

    small = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=32)
    if name == "llama":
        return t.LlamaConfig(**small, num_key_value_heads=2)
    if name == "mistral":
        return t.MistralConfig(**small, num_key_value_heads=2, sliding_window=6)
    if name == "mixtral":
        return t.MixtralConfig(**{**small, "intermediate_size": 32}, num_key_value_heads=2, num_local_experts=4,
                               num_experts_per_tok=2)
    if name == "qwen2_moe":  # routed experts plus a gated shared expert in both layers
        return t.Qwen2MoeConfig(**small, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=32, shared_expert_intermediate_size=48)
    if name == "qwen3_moe":  # routed experts only, top-k weights renormalised (as Qwen3-30B-A3B's config)
        return t.Qwen3MoeConfig(**small, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=32, norm_topk_prob=True)
    if name == "deepseek_v3":  # layer 0 dense, layer 1 routed + shared experts (EP refuses its experts class)
        return t.DeepseekV3Config(**{**small, "num_key_value_heads": 4}, moe_intermediate_size=32,
                                  n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                  first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                                  qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1)
    if name == "qwen2":  # layer 0 full attention, layer 1 sliding-window
        return t.Qwen2Config(**small, num_key_value_heads=2, use_sliding_window=True, sliding_window=6,
                             max_window_layers=1)
    if name in ("gpt2", "gpt2-odd-vocab"):  # the second with a vocabulary no tp > 1 divides, as GPT-2's 50257
        return t.GPT2Config(vocab_size=VOCAB + (name != "gpt2"), n_embd=64, n_layer=2, n_head=4, n_positions=32,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    if name == "bert":
        return t.BertConfig(**small, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if name in ("t5", "t5-gated"):  # encoder-decoder, its shared embedding tied three ways (both stacks' inputs,
        # lm_head); "t5-gated": T5 v1.1 / Flan-T5's layout, a gated GELU MLP (wi_0, wi_1), decoder output unscaled
        gated = {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False} if name == "t5-gated" else {}
        return t.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                          num_heads=4, dropout_rate=0.0, **gated)
    if name == "vit":  # 32x32 images in 8x8 patches: 16 patches + CLS
        return t.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                           image_size=IMAGE, patch_size=8, num_labels=LABELS, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0, architectures=["ViTForImageClassification"])
    raise KeyError(name)


def spec(name: str) -> Any:
    from hetplan.model.hf import model_from_hf_config

    return model_from_hf_config(config(name), seq_len=SEQ, dtype_bytes=4)


def build(name: str) -> Any:
    import transformers

    return getattr(transformers, spec(name).source.hf_class)(config(name))


def plan(name: str, pp: int = 2, dp: int = 1, tp: int = 1, gbs: int = 8, micro: int = 2, cut: int = 0,
         ep: int = 1, zero: int = 0) -> Plan:
    """Stages of even layer splits (``cut``: two stages split before layer
    ``cut``), devices in order (TP innermost, then DP); ``ep``, ``zero`` in every stage."""
    s = spec(name)
    stages = []
    splits = [range(cut), range(cut, s.num_layers)] if cut else even_split(s.num_layers, pp)
    for j, layers in enumerate(splits):
        devices = list(range(j * dp * tp, (j + 1) * dp * tp))
        stages.append(uniform_stage(layers, devices, dp, tp, micro, zero=zero, ep=ep))
    return Plan(s.name, f"local-cpu-{pp * dp * tp}", gbs, micro, gbs // micro, "1f1b", tuple(stages), planner="test")


def recompute_plan(name: str, pp: int, dp: int = 1, tp: int = 1) -> Plan:
    """``plan(name, pp, dp, tp)`` (2 micro-batches) with recomputation: the blocks
    (layers with attention) alternate full and selective, the first full (at
    pp2 the first stage holds a full block, the second a selective one); the
    other layers (embeddings, head) selective, which recomputes nothing there."""
    from dataclasses import replace

    from hetplan.plan.spec import LayerStrategy

    layers = spec(name).layers
    blocks = [i for i, layer in enumerate(layers) if layer.attention_flops > 0]
    how = {i: "full" if blocks.index(i) % 2 == 0 else "selective" for i in blocks}
    base = plan(name, pp, dp, tp, micro=4)  # 2 micro-batches of the global batch of 8
    stages = tuple(replace(s, strategies=tuple(LayerStrategy(recompute=how.get(i, "selective")) for i in s.layers))
                   for s in base.stages)
    return replace(base, stages=stages)


def hetero_plan(name: str, gbs: int = 8, cut: int = 0) -> Plan:
    """A Metis-style plan: stage 0 two replicas with a 3:1 split of each
    micro-batch of 4, stage 1 one replica on tp=2 (4 processes); split before
    layer ``cut`` (0: half)."""
    from dataclasses import replace

    s = spec(name)
    half = cut or s.num_layers // 2
    first = replace(uniform_stage(range(half), [0, 1], 2, 1, 2), dp_split=(3, 1))
    second = replace(uniform_stage(range(half, s.num_layers), [2, 3], 1, 2, 1), dp_split=(4,))
    return Plan(s.name, "local-cpu-4", gbs, 4, gbs // 4, "1f1b", (first, second), planner="test")


def batch(step: int, gbs: int = 8, name: str = "") -> tuple[Any, Any, dict[str, Any]]:
    """Token ids, next-token targets, and an attention mask with trailing padding.
    T5: the targets are the decoder's labels, its inputs them shifted right, and
    its own padded mask; ViT: random images and class labels, no mask."""
    import torch

    from hetplan.runtime.reference import synthetic_batch

    g = torch.Generator().manual_seed(1000 + step)
    if name == "vit":
        return torch.randn(gbs, 3, IMAGE, IMAGE, generator=g), torch.randint(0, LABELS, (gbs,), generator=g), {}
    x, y = synthetic_batch(VOCAB, SEQ, gbs, step)
    valid = torch.randint(SEQ // 2, SEQ + 1, (gbs, 1), generator=g)
    mask = (torch.arange(SEQ)[None, :] < valid).long()
    if not name.startswith("t5"):
        return x, y, {"attention_mask": mask}
    labels = y[:, :DEC_SEQ]
    dec_valid = torch.randint(DEC_SEQ // 2, DEC_SEQ + 1, (gbs, 1), generator=g)
    return x, labels, {"attention_mask": mask, "decoder_input_ids": torch.cat([torch.zeros_like(labels[:, :1]),
                                                                              labels[:, :-1]], 1),
                       "decoder_attention_mask": (torch.arange(DEC_SEQ)[None, :] < dec_valid).long()}


def loss(output: Any, target: Any) -> Any:
    import torch.nn.functional as F

    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), target.reshape(-1))


def worker(plan_path: str, name: str, steps: int = 2, accumulate: bool = False, checkpoint: str = ""
           ) -> dict[str, Any]:
    """Train the tiny HF model under the plan; with ``accumulate`` two ``train_step``
    calls (batches 2k, 2k+1) per optimizer step; with ``checkpoint`` save there at the end."""
    from hetplan.runtime.context import init
    from hetplan.runtime.reference import make_optimizer

    ctx = init(plan_path, spec(name))
    model = ctx.parallelize(lambda: build(name), seed=0, meta_init=False)
    opt = make_optimizer(model.parameters())
    losses = []
    for step in range(steps):
        for k in ([2 * step, 2 * step + 1] if accumulate else [step]):
            x, y, inputs = batch(k, ctx.plan.global_batch_size, name)
            losses.append(float(ctx.train_step(model, (x, y), loss, inputs=inputs)))
        opt.step()
        opt.zero_grad()
    if checkpoint:
        ctx.save(checkpoint, model, opt)
    state = ctx.full_state_dict(model)
    notes = list(ctx.notes)
    layout = ctx.parameter_layout(model)
    ctx.close()
    return {"losses": losses, "state": state, "notes": notes, "parameters": layout}


def reference(name: str, steps: int = 2, gbs: int = 8, accumulate: bool = False, mask: bool = True,
              precision: str = "fp32") -> tuple[list[float], dict[str, Any]]:
    """The same training in one process on whole batches (the model's own
    forward, under autocast to ``precision`` as ``hetplan train --verify``'s reference)."""
    import torch

    from hetplan.runtime.precision import autocast
    from hetplan.runtime.reference import make_optimizer

    torch.manual_seed(0)
    model = build(name)
    opt = make_optimizer(model.parameters())
    losses = []
    for step in range(steps):
        for k in ([2 * step, 2 * step + 1] if accumulate else [step]):
            x, y, inputs = batch(k, gbs, name)
            kept = {key: v for key, v in inputs.items() if mask or not key.endswith("attention_mask")}
            with autocast(torch.device("cpu"), precision):
                value = loss(model(x, **kept), y)
            value.backward()
            losses.append(float(value.detach()))
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def several_workers(jobs: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """``worker`` for each (plan path, model name, more ``worker`` arguments) in
    turn, in one process group (plans of the same world size): one process
    start for several checks."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        return [worker(*job) for job in jobs]
    finally:
        dist.destroy_process_group()


# --- a user's own model with a keyword input (not HF) --------------------------------------------
def masked_model(vocab: int, hidden: int = 32, blocks: int = 4) -> Any:
    """embed -> layers.0..N-1 -> head, each block taking the model's ``mask`` as is:
    a masked mean over the sequence mixes tokens, so the mask changes every output."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mix = nn.Linear(hidden, hidden)
            self.mlp = nn.Linear(hidden, hidden)

        def forward(self, h: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
            w = torch.ones(h.shape[:2], device=h.device) if mask is None else mask.to(h.dtype)
            mean = (h * w[..., None]).sum(1, keepdim=True) / w.sum(1, keepdim=True)[..., None]
            return h + torch.tanh(self.mlp(h) + self.mix(mean))

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, hidden)
            self.layers = nn.ModuleDict({str(i): Block() for i in range(blocks)})
            self.head = nn.Linear(hidden, vocab)

        def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
            h = self.embed(x)
            for block in self.layers.values():
                h = block(h, mask=mask)
            return self.head(h)

    return Masked()


def masked_worker(plan_path: str, steps: int = 2) -> dict[str, Any]:
    """The keyword-input model under a plan for tiny-gpt's layer names."""
    from hetplan.model.presets import get_model
    from hetplan.runtime.context import init
    from hetplan.runtime.models import cross_entropy_loss
    from hetplan.runtime.reference import make_optimizer, synthetic_batch

    tiny = get_model("tiny-gpt")
    ctx = init(plan_path, tiny)
    model = ctx.parallelize(lambda: masked_model(tiny.vocab_size))
    opt = make_optimizer(model.parameters())
    losses = []
    for step in range(steps):
        x, y = synthetic_batch(tiny.vocab_size, tiny.seq_len, ctx.plan.global_batch_size, step)
        mask = _mask(step, x.shape)
        losses.append(float(ctx.train_step(model, (x, y), cross_entropy_loss, inputs={"mask": mask})))
        ctx.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
    state = ctx.full_state_dict(model)
    ctx.close()
    return {"losses": losses, "state": state}


def masked_reference(steps: int = 2, gbs: int = 8, mask: bool = True) -> tuple[list[float], dict[str, Any]]:
    from hetplan.model.presets import get_model
    from hetplan.runtime.models import cross_entropy_loss
    from hetplan.runtime.reference import build_reference, make_optimizer, synthetic_batch, train_reference

    tiny = get_model("tiny-gpt")
    model = build_reference(lambda: masked_model(tiny.vocab_size))
    opt = make_optimizer(model.parameters())
    batches = []
    for step in range(steps):
        x, y = synthetic_batch(tiny.vocab_size, tiny.seq_len, gbs, step)
        batches.append((x, y, {"mask": _mask(step, x.shape)} if mask else {}))
    losses = train_reference(model, batches, cross_entropy_loss, opt, clip=1.0)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _mask(step: int, shape: Any) -> Any:
    import torch

    g = torch.Generator().manual_seed(2000 + step)
    valid = torch.randint(1, shape[1] + 1, (shape[0], 1), generator=g)
    return (torch.arange(shape[1])[None, :] < valid).float()
