"""The plan's precision: the workload checks it against the model, plan files
record it, the runtime trains in it, fp16 loss scaling skips overflowing steps."""

from __future__ import annotations

import json

import pytest

from hetplan.cli import main
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError
from hetplan.model.presets import get_model
from hetplan.cluster.io import load_cluster

torch = pytest.importorskip("torch")


def test_precision_defaults_to_the_model_and_must_match_it():
    cluster = load_cluster("local-cpu-1")
    assert Workload(get_model("tiny-gpt"), cluster, 8).precision == "fp32"
    assert Workload(get_model("tiny-llama-bf16"), cluster, 8).precision == "bf16"
    assert Workload(get_model("tiny-llama-bf16"), cluster, 8, precision="fp16").precision == "fp16"
    with pytest.raises(HetplanError, match="costed in 4-byte elements, not bf16"):
        Workload(get_model("tiny-gpt"), cluster, 8, precision="bf16")
    with pytest.raises(HetplanError, match="unknown precision"):
        Workload(get_model("tiny-gpt"), cluster, 8, precision="fp64")


def test_plan_file_records_the_precision(tmp_path, capsys):
    path = tmp_path / "p.json"
    assert main(["estimate", "--model", "tiny-llama-bf16", "--cluster", "local-cpu-1", "--global-batch", "4",
                 "--precision", "fp16", "--tp", "1", "--pp", "1", "--dp", "1", "--micro-batch", "4",
                 "--json", str(path)]) == 0
    assert "4 samples/step, fp16" in capsys.readouterr().out
    assert json.loads(path.read_text())["settings"]["precision"] == "fp16"
    from hetplan.runtime.setup import check_plan_precision

    assert check_plan_precision(str(path))[4] == "fp16"
    assert main(["estimate", "--model", "tiny-gpt", "--cluster", "local-cpu-1", "--global-batch", "4",
                 "--precision", "bf16", "--tp", "1", "--pp", "1", "--dp", "1", "--micro-batch", "4"]) == 2


def test_loss_scaler_halves_on_overflow_and_grows_after_the_interval():
    from hetplan.runtime.precision import GROWTH_INTERVAL, INITIAL_LOSS_SCALE, LossScaler

    s = LossScaler()
    g = torch.full((3,), INITIAL_LOSS_SCALE)
    assert s.unscale([g], torch.device("cpu")) and torch.equal(g, torch.ones(3))
    assert not s.unscale([torch.tensor([1.0, float("inf")])], torch.device("cpu"))
    assert s.scale == INITIAL_LOSS_SCALE / 2 and s.skipped_steps == 1
    for _ in range(GROWTH_INTERVAL):
        s._update(True)
    assert s.scale == INITIAL_LOSS_SCALE


def _fp16_context(tmp_path):
    from hetplan.runtime.context import init

    path = tmp_path / "p.json"
    assert main(["estimate", "--model", "tiny-llama-bf16", "--cluster", "local-cpu-1", "--global-batch", "4",
                 "--precision", "fp16", "--tp", "1", "--pp", "1", "--dp", "1", "--micro-batch", "4",
                 "--json", str(path)]) == 0
    return init(str(path))


def test_fp16_overflow_skips_the_step_and_a_normal_step_is_unscaled(tmp_path, capsys):
    from hetplan.runtime.models import build_preset_model, cross_entropy_loss
    from hetplan.runtime.reference import build_reference, synthetic_batch

    ctx = _fp16_context(tmp_path)
    spec = ctx.spec
    model = ctx.parallelize(lambda: build_preset_model(spec))
    batch = synthetic_batch(spec.vocab_size, spec.seq_len, 4, 0)
    loss = ctx.train_step(model, batch, cross_entropy_loss)
    # gradients are those of the unscaled loss: compare with a plain fp16-autocast backward
    ref = build_reference(lambda: build_preset_model(spec))
    with torch.autocast("cpu", dtype=torch.float16):
        ref_loss = cross_entropy_loss(ref(batch[0]), batch[1])
    ref_loss.backward()
    assert loss == pytest.approx(float(ref_loss.detach()), rel=1e-6)
    g, rg = model.get_parameter("layers.0.mlp.proj.weight").grad, ref.get_parameter("layers.0.mlp.proj.weight").grad
    # equal up to fp16 rounding (the unscaled reference's small gradients lose bits); unscaling
    # forgotten would be off by the scale, 65536
    assert float((g - rg).norm() / rg.norm()) < 5e-3
    model.zero_grad(set_to_none=True)

    def exploding(out, target):
        return cross_entropy_loss(out, target) * 1e30

    ctx.train_step(model, batch, exploding)
    assert all(p.grad is None for p in model.parameters())
    assert ctx.loss_scaler.skipped_steps == 1 and any("skipped" in n for n in ctx.notes)
    ctx.close()
