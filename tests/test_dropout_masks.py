"""Layout-invariant dropout (hetplan.runtime.dropout) in one process: the hash,
the mask of a shard equals the shard of the mask, keep rates, the GPT's sites
under emulated TP/SP shards, recomputation, and the `--dropout` flag."""

from __future__ import annotations

import pytest

from hetplan.cli import main
from hetplan.errors import HetplanError
from hetplan.model.presets import get_model

torch = pytest.importorskip("torch")

from hetplan.runtime import dropout as rng
from hetplan.runtime.build import check_dropout
from hetplan.runtime.models import GPT, GPTConfig, cross_entropy_loss

M32 = 0xFFFFFFFF


def _lowbias32(x: int) -> int:
    """The hash in Python's unbounded integers, to check the int64 tensor version."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def _mask(p: float, shape: tuple[int, ...], key: int = 7) -> torch.Tensor:
    return rng.keep_mask(p, key, [torch.arange(n) for n in shape])


def test_hash_equals_lowbias32_without_overflow() -> None:
    values = [0, 1, 2, 3, 255, 65535, 65536, 12345678, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, M32]
    got = rng.mix32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [_lowbias32(v) for v in values]
    assert all(0 <= v <= M32 for v in got)


def test_mask_of_a_shard_is_the_shard_of_the_mask() -> None:
    full = _mask(0.3, (8, 12, 10))
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        samples = torch.randperm(8, generator=g)[:3]  # any rows, in any order (uneven splits, micro-batches)
        s0 = int(torch.randint(0, 11, (1,), generator=g))
        f0 = int(torch.randint(0, 9, (1,), generator=g))
        part = rng.keep_mask(0.3, 7, [samples, torch.arange(s0, 12), torch.arange(f0, 10)])
        assert torch.equal(part, full[samples][:, s0:, f0:])


def test_p_zero_keeps_all_and_p_near_one_drops_nearly_all() -> None:
    assert _mask(0.0, (4, 64, 64)).all()
    assert _mask(0.999, (4, 64, 64)).float().mean() < 0.005
    x = torch.ones(2, 3, 4)
    with rng.scope(0, 0, [0, 1]):
        assert torch.equal(rng.dropout(x, 1.0, "s"), torch.zeros_like(x))
        y = rng.dropout(x, 0.25, "s")
    assert set(y.unique().tolist()) <= {0.0, float(torch.tensor(1.0 / 0.75))}  # kept ones scaled by 1/(1-p)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_is_one_minus_p(p: float) -> None:
    n = 64 * 64 * 64
    rate = float(_mask(p, (64, 64, 64)).float().mean())
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(rate - (1 - p)) < 5 * sigma


def test_masks_of_other_sites_steps_and_seeds_are_independent() -> None:
    p, shape = 0.5, (16, 32, 64)
    idx = [torch.arange(n) for n in shape]
    base = rng.keep_mask(p, rng.site_key(0, 0, "layers.0.mlp.drop"), idx)
    n = base.numel()
    for seed, step, site in ((1, 0, "layers.0.mlp.drop"), (0, 1, "layers.0.mlp.drop"), (0, 0, "layers.1.mlp.drop")):
        other = rng.keep_mask(p, rng.site_key(seed, step, site), idx)
        agree = float((other == base).float().mean())  # independent masks agree with probability 1/2
        assert abs(agree - 0.5) < 5 * (0.25 / n) ** 0.5


def _gpt(dropout: float = 0.1, **kw) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(dropout=dropout, **kw))
    rng.prepare(model)
    return model


def test_gpt_sites_on_tp_and_sp_shards_draw_the_full_mask() -> None:
    """What each TP rank's Dropout computes on its shard equals the shard of
    the single-process result: attention probabilities split by heads, block
    outputs split by sequence under SP, the embedding output whole."""
    model = _gpt()
    core = model.layers["0"].attn.core.drop
    resid = model.layers["0"].attn.drop
    embed = model.embed.drop
    probs = torch.rand(4, 4, 32, 32)
    hidden = torch.rand(4, 32, 64)
    with rng.scope(3, 5, torch.arange(4)):
        full_probs, full_hidden, full_embed = core(probs), resid(hidden), embed(hidden)
        for t in range(2):
            for module in (core, resid, embed):
                module.tp_rank, module.sequence_parallel = (t, 2), True
            assert torch.equal(core(probs[:, 2 * t:2 * t + 2]), full_probs[:, 2 * t:2 * t + 2])
            assert torch.equal(resid(hidden[:, 16 * t:16 * t + 16]), full_hidden[:, 16 * t:16 * t + 16])
            assert torch.equal(embed(hidden), full_embed)  # replicated: every TP rank draws the same mask
    assert not torch.equal(full_hidden, full_embed)  # sites differ


def test_micro_batches_of_a_step_draw_the_whole_batch_mask() -> None:
    """Replica 1 of an uneven 3:1 split, two micro-batches of 4: rows 3 and 7 of the global batch."""
    model = _gpt()
    x = torch.randint(0, 256, (8, 32))
    with rng.scope(0, 2, torch.arange(8)):
        full = model(x)
    with rng.step_scope(0, 2, [3, 7], 1):
        for k, row in enumerate((3, 7)):
            with rng.micro_batch(k):
                assert torch.allclose(model(x[row:row + 1]), full[row:row + 1], atol=1e-6)


def test_recomputation_draws_the_forwards_masks() -> None:
    """Backward runs outside the scope (as a pipeline's backward of an earlier
    micro-batch does); checkpointed layers recompute with the captured scope."""
    from hetplan.runtime import parallelize as par

    x = torch.randint(0, 256, (4, 32))
    y = torch.randint(0, 256, (4, 32))
    grads = []
    for recompute in (False, True):
        model = _gpt()
        if recompute:
            for block in model.layers.values():
                par._checkpoint_forward(block)
        with rng.scope(0, 0, torch.arange(4)):
            loss = cross_entropy_loss(model(x), y)
        with rng.scope(9, 9, torch.arange(4)):  # another micro-batch's scope is open during backward
            loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], atol=1e-6), name


def test_dropout_saves_a_one_byte_mask() -> None:
    """The cost model counts dropout masks at 1 byte per element (docs/models.md)."""
    saved = []
    x = torch.rand(4, 32, 64, requires_grad=True)
    with rng.scope(0, 0, torch.arange(4)), torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t) or t, lambda t: t):
        rng.dropout(x, 0.1, "s")
    assert [(t.dtype, t.numel()) for t in saved] == [(torch.bool, x.numel())]


def test_torch_dropout_is_made_plan_independent_and_falls_back_outside_a_scope() -> None:
    from torch import nn

    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    assert rng.prepare(model) == []
    x = torch.ones(4, 8)
    with rng.scope(0, 0, torch.arange(4)):
        a = model(x)
    with rng.scope(0, 0, torch.arange(2, 4)):
        b = model(x[2:])
    assert torch.equal(a[2:], b)
    torch.manual_seed(1)
    c = model(x)
    torch.manual_seed(2)
    assert not torch.equal(c, model(x))  # no scope: torch's generator
    model.eval()
    assert torch.equal(model(x), model[0](x))


def test_unmanaged_dropout_is_noted_and_torch_dropout_under_tp_refused() -> None:
    from torch import nn

    model = nn.ModuleDict({"embed": nn.Dropout2d(0.2), "layer": nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))})
    notes = rng.prepare(model)
    assert len(notes) == 1 and "'embed' (Dropout2d, p=0.2)" in notes[0]
    rng.check_tensor_parallel(model, {"embed": 1, "layer": 1})
    with pytest.raises(HetplanError, match=r"'layer\.1' is a torch Dropout\(p=0\.1\) in a tensor-parallel stage"):
        rng.check_tensor_parallel(model, {"embed": 1, "layer": 2})
    with pytest.raises(HetplanError, match=r"'embed' is a torch Dropout2d\(p=0\.2\)"):
        rng.check_tensor_parallel(model, {"embed": 2, "layer": 1})


def test_dropout_flag_checks_model_and_range(tmp_path, capsys) -> None:
    check_dropout(get_model("tiny-gpt"), 0.1)
    with pytest.raises(HetplanError, match="costed without dropout"):
        check_dropout(get_model("tiny-llama-bf16"), 0.1)
    with pytest.raises(HetplanError, match="below 1"):
        check_dropout(get_model("tiny-gpt"), 1.0)
    with pytest.raises(HetplanError, match="below 1"):
        GPTConfig(dropout=1.0).check()
    path = str(tmp_path / "p.json")
    assert main(["estimate", "--model", "tiny-gpt", "--cluster", "local-cpu-1", "--global-batch", "4",
                 "--tp", "1", "--pp", "1", "--dp", "1", "--micro-batch", "2", "--json", path]) == 0
    assert main(["train", "--plan", path, "--dropout", "1.5"]) == 2
    assert "--dropout 1.5: give a probability below 1" in capsys.readouterr().err


def test_one_process_train_verify_with_dropout(tmp_path, capsys) -> None:
    path = str(tmp_path / "p.json")
    assert main(["estimate", "--model", "tiny-gpt", "--cluster", "local-cpu-1", "--global-batch", "4",
                 "--tp", "1", "--pp", "1", "--dp", "1", "--micro-batch", "2", "--json", path]) == 0
    assert main(["train", "--plan", path, "--steps", "2", "--dropout", "0.1", "--verify"]) == 0
    assert "verify: OK" in capsys.readouterr().out
