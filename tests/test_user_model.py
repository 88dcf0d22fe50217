"""``pkg.mod:build`` models in the runtime (hetplan.runtime.user_model), in one process.

The plan's spec records the build function and a hash of the parameter names
and shapes; the runtime rebuilds the model from it, refuses a function that now
builds another model, and draws synthetic batches like the example inputs.
"""

from __future__ import annotations

import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from hetplan.errors import HetplanError
from hetplan.model.load import load_model
from hetplan.runtime.build import model_build
from hetplan.runtime.reference import build_reference, training_batch
from hetplan.runtime.user_model import default_loss, user_model


@pytest.fixture(scope="module")
def specs() -> dict:
    return {name: load_model(f"tests.smp_models:{name}") for name in ("gpt_lm", "resnet_classes", "encdec",
                                                                      "encdec_two_inputs")}


def test_plan_spec_records_source_and_hash(specs: dict) -> None:
    spec = specs["gpt_lm"]
    assert spec.source.reference == "tests.smp_models:gpt_lm"
    assert len(spec.source.module_hash) == 16
    again = load_model("tests.smp_models:gpt_lm")
    assert again.source.module_hash == spec.source.module_hash  # no dependence on run or hash seed
    assert specs["encdec"].source.module_hash != spec.source.module_hash


def test_integer_inputs_drawn_below_the_embedding_they_feed(specs: dict) -> None:
    user = user_model(specs["gpt_lm"])
    (draw,) = user.inputs
    assert (draw.kind, draw.low, draw.high, draw.dtype) == ("integer", 0, 31, torch.long)  # tok: 32, not pos: 8
    x, y, kw = user.batch(64, 0, 0)
    assert x.shape == (64, 8) and x.dtype == torch.long and y is x and kw == {}
    assert int(x.min()) == 0 and int(x.max()) == 31
    # encdec slices its input before the embedding: a view of the input still counts
    assert (user_model(specs["encdec"]).inputs[0].high) == 31


def test_example_targets_drawn_in_their_observed_range_and_floats_normal(specs: dict) -> None:
    user = user_model(specs["resnet_classes"])
    assert user.inputs[0].kind == "normal" and user.inputs[0].shape == (3, 8, 8)
    assert user.targets is not None and (user.targets.low, user.targets.high) == (0, 9)
    x, y, _ = user.batch(200, 3, 7)
    assert x.dtype == torch.float32 and abs(float(x.mean())) < 0.05 and abs(float(x.std()) - 1) < 0.05
    assert y.shape == (200,) and set(y.tolist()) == set(range(10))


def test_batches_depend_on_step_and_seed_only(specs: dict) -> None:
    a = user_model(specs["resnet_classes"])
    b = user_model(specs["resnet_classes"])
    assert all(torch.equal(u, v) for u, v in zip(a.batch(8, 2, 0)[:2], b.batch(8, 2, 0)[:2]))
    assert not torch.equal(a.batch(8, 2, 0)[0], a.batch(8, 3, 0)[0])
    assert not torch.equal(a.batch(8, 2, 0)[0], a.batch(8, 2, 1)[0])


def test_later_inputs_passed_by_the_forward_parameter_names(specs: dict) -> None:
    user = user_model(specs["encdec_two_inputs"])
    assert user.input_names == ("tgt",)
    x, y, kw = user.batch(4, 0, 0)
    assert x.shape == (4, 6) and set(kw) == {"tgt"} and kw["tgt"].shape == (4, 6)


def test_loss_is_hetplan_loss_else_mean_square(specs: dict) -> None:
    how = model_build(specs["gpt_lm"])
    model = build_reference(how.build, 0)
    x, y, _ = training_batch(specs["gpt_lm"], how, 4, 0, 0)
    logits = model(x)
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 32), x[:, 1:].reshape(-1))
    assert torch.allclose(how.loss(logits, y), expected)
    out = torch.tensor([[1.0, -2.0], [3.0, 0.5]])
    assert float(default_loss(out, out)) == pytest.approx((1 + 4 + 9 + 0.25) / 4)
    assert float(default_loss((out, "aux"), out)) == pytest.approx(3.5625)
    assert model_build(specs["encdec"]).loss is default_loss


def _write(path, hidden: int, inputs: str = "torch.zeros(2, 4)", first: str = "") -> None:
    first = first or f"nn.Linear(4, {hidden})"
    path.write_text(textwrap.dedent(f"""
        import torch
        from torch import nn

        def build():
            return nn.Sequential({first}, nn.ReLU(), nn.Linear({hidden}, 2)), {inputs}
    """))


def test_changed_build_function_is_refused_in_one_line(tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    _write(tmp_path / "um_changed.py", 8)
    spec = load_model("um_changed:build")
    model_build(spec)  # unchanged: fine

    def refusal(hidden: int, first: str = "") -> str:
        _write(tmp_path / "um_changed.py", hidden, first=first)
        sys.modules.pop("um_changed", None)
        with pytest.raises(HetplanError) as err:
            model_build(spec)
        msg = str(err.value)
        assert "\n" not in msg
        assert msg.startswith("the model built by um_changed:build differs from the one the plan was made for: ")
        return msg

    assert "114 parameters, the plan's model 58" in refusal(16)  # 4*16+16 + 16*2+2 vs 4*8+8 + 8*2+2
    assert "parameter names or shapes changed" in refusal(8, "nn.Linear(4, 8).double()")  # same count, dtype


def test_integer_input_of_unknown_range_is_refused() -> None:
    """Made on meta (no values) and feeding no nn.Embedding: no range to draw from."""
    from hetplan.runtime.user_model import _draw_of

    with pytest.raises(HetplanError, match="integers of unknown range"):
        _draw_of(torch.zeros(2, 4, dtype=torch.long, device="meta"), "example input 0", None, "m:build")
    draw = _draw_of(torch.tensor([[3, 9]]), "example input 0", None, "m:build")  # values: the observed range
    assert (draw.low, draw.high) == (3, 9)
    assert _draw_of(torch.zeros(2, 4, dtype=torch.long, device="meta"), "x", 50, "m:build").high == 49


def test_build_function_that_cannot_be_imported_says_pythonpath(specs: dict) -> None:
    from dataclasses import replace

    spec = specs["gpt_lm"]
    moved = replace(spec, source=replace(spec.source, reference="no_such_pkg.models:gpt_lm"))
    with pytest.raises(HetplanError, match="put it on PYTHONPATH"):
        model_build(moved)
