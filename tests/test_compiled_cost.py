"""``--compile`` plans (issue 29 item 2, issue 30 item 4): the cost kernel costs
hetplan's runtime with each layer ``torch.compile``d (``runtime_time(compiled=True)``:
inductor's fused elementwise kernels and the kernels its graphs launch), the
setting is recorded in the plan file and ``hetplan train`` compiles such a plan;
eager costs are unchanged; what cannot be costed compiled is refused.
tests/test_h100_time.py holds the compiled H100 run to the issue's bounds."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from hetplan.app.estimate import UniformSetting, estimate
from hetplan.cli import main
from hetplan.cluster.presets import get_cluster
from hetplan.cost.constants import ELEMENTWISE_KERNELS_PER_GEMM, HOST_OP_S, KERNEL_LAUNCH_S
from hetplan.cost.kernel import CostKernel
from hetplan.errors import HetplanError
from hetplan.model.presets import get_model
from hetplan.model.runtime_memory import decoder_shape
from hetplan.model.runtime_time import block_traffic, compiled_block_traffic, runtime_time
from hetplan.plan.file import read_plan_file
from hetplan.plan.workload import Workload

DATA = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "h100"
# A GPT block's fused kernels at bf16, bytes per token and hidden unit (runtime_time's module
# docstring): norm + cast 4 + 2; add + norm + cast 4 + 2 + 2; GELU 2 + 2 over the 4h-wide MLP;
# last add 4 + 2 + 2 + 4
GPT_COMPILED_BYTES = 6 + 8 + 4 * 4 + 12
# eager: two norms 2 x 2 x 4, four casts x 6, two residual adds x 10, GELU 4 x 4
GPT_EAGER_BYTES = 16 + 24 + 20 + 16


def _workload(compile: bool, model: str = "gpt3-1.3b") -> Workload:
    return Workload(get_model(model), get_cluster("1xH100"), 16, target="hetplan", compile=compile)


def test_compiled_block_traffic_is_the_fused_kernels():
    shape = decoder_shape(get_model("gpt3-1.3b"))[1]
    tokens_hidden = shape.seq * shape.hidden
    assert compiled_block_traffic(shape, 2) == GPT_COMPILED_BYTES * tokens_hidden
    assert block_traffic(shape, 2) == GPT_EAGER_BYTES * tokens_hidden


def test_eager_costs_keep_their_launches_and_host_time():
    """Without --compile no layer has graph kernels: launches and host time as before."""
    kernel = CostKernel(_workload(False))
    gpu = kernel.cluster.devices[0].gpu
    unit = kernel.unit_work(gpu, 1, False)
    arrays = kernel.arrays
    assert not arrays.column("graph_kernels_fwd").any()
    assert np.allclose(unit.launch_s, arrays.gemm_count * (1 + ELEMENTWISE_KERNELS_PER_GEMM) * KERNEL_LAUNCH_S)
    assert np.allclose(unit.run.host_fwd_s, arrays.host_ops_fwd * HOST_OP_S)


def test_compiled_layers_launch_their_graphs_kernels():
    """Compiled, a block dispatches nothing eagerly (its graph's kernels at launch cost); the
    head still runs the loss eagerly; every layer moves fewer elementwise bytes or as many."""
    spec = get_model("gpt3-1.3b")
    eager, compiled = runtime_time(spec), runtime_time(spec, compiled=True)
    assert compiled[1].ops_fwd == 0 and compiled[1].kernels_fwd > 0 and compiled[-1].ops_fwd > 0
    assert all(c.traffic <= e.traffic for c, e in zip(compiled, eager))
    kernel = CostKernel(_workload(True))
    run = kernel.unit_work(kernel.cluster.devices[0].gpu, 1, False).run
    assert run.host_fwd_s[1] == pytest.approx(compiled[1].kernels_fwd * KERNEL_LAUNCH_S)


def test_compiled_plans_cost_less_most_where_the_host_bound():
    """Micro-batch 2 waits for the host's eager dispatch (tests/test_h100_time.py): compiling
    saves it a larger share than micro-batch 8, which only loses elementwise traffic."""
    def saved(micro_batch: int) -> float:
        setting = UniformSetting(dp=1, tp=1, pp=1, micro_batch=micro_batch)
        times = [estimate(setting, model="gpt3-1.3b", cluster="1xH100", global_batch=16, target="hetplan",
                          compile=c).ranked.estimate.iteration_time_s for c in (False, True)]
        return 1.0 - times[1] / times[0]
    assert saved(2) > saved(8) > 0.0


@pytest.mark.parametrize("target", ["", "torchtitan"])
def test_compile_for_another_target_is_refused(target):
    with pytest.raises(HetplanError, match="--compile costs hetplan's runtime's compiled layers: plan for "
                                           "--target hetplan"):
        dataclasses.replace(_workload(False), target=target, compile=True)


TINY_HF_LLAMA = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "max_position_embeddings": 128}


@pytest.mark.parametrize("model, why", [("moe-1.3b", "mixture-of-experts"), ("hf", "built-in models only")])
def test_compile_of_an_uncosted_model_is_refused(model, why, tmp_path):
    if model == "hf":
        pytest.importorskip("transformers")
        model = str(tmp_path / "config.json")
        Path(model).write_text(json.dumps(TINY_HF_LLAMA))
    with pytest.raises(HetplanError, match=why):
        estimate(UniformSetting(dp=1, tp=1, pp=1, micro_batch=1), model=model, cluster="1xH100",
                 global_batch=2, target="hetplan", compile=True, seq_len=64 if model.endswith(".json") else None)


def test_plan_file_records_compile_and_train_compiles_it(tmp_path, capsys):
    """``estimate --compile --json`` records the setting; estimating the file again costs it
    compiled, and ``hetplan train --plan`` passes ``--compile`` to its processes."""
    path = tmp_path / "plan.json"
    assert main(["estimate", "--model", "gpt3-1.3b", "--cluster", "1xH100", "--global-batch", "16",
                 "--tp", "1", "--pp", "1", "--dp", "1", "--micro-batch", "8", "--target", "hetplan", "--compile", "--json", str(path)]) == 0
    assert "layers torch.compiled" in capsys.readouterr().out
    assert read_plan_file(path).settings["compile"] is True
    again = estimate(path).ranked.estimate.iteration_time_s
    direct = estimate(UniformSetting(dp=1, tp=1, pp=1, micro_batch=8), model="gpt3-1.3b", cluster="1xH100",
                      global_batch=16, target="hetplan", compile=True).ranked.estimate.iteration_time_s
    assert again == pytest.approx(direct)
    runtime_cli = pytest.importorskip("hetplan.runtime.cli")
    assert runtime_cli.plan_compiles(str(path)) and not runtime_cli.plan_compiles(str(DATA / "A_g13_mb8.json"))
