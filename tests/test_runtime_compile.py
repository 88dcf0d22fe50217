"""parallelize(compile=True) compiles every layer of the plan in place (names
kept); the distributed tests check the compiled run matches the reference."""

from __future__ import annotations

import pytest

from hetplan.cli import main

torch = pytest.importorskip("torch")


def test_every_layer_is_compiled_in_place(tmp_path):
    from hetplan.runtime.context import init
    from hetplan.runtime.models import build_preset_model

    path = tmp_path / "p.json"
    assert main(["estimate", "--model", "tiny-gpt", "--cluster", "local-cpu-1", "--global-batch", "4", "--tp", "1",
                 "--pp", "1", "--dp", "1", "--micro-batch", "4", "--json", str(path)]) == 0
    ctx = init(str(path))
    plain = ctx.parallelize(lambda: build_preset_model(ctx.spec))
    compiled = ctx.parallelize(lambda: build_preset_model(ctx.spec), compile=True)
    names = ctx.layout.layer_names
    assert all(plain.get_submodule(n)._compiled_call_impl is None for n in names)
    assert all(compiled.get_submodule(n)._compiled_call_impl is not None for n in names)
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in plain.named_parameters()]
    ctx.close()
