"""hetplan profile for every model the runtime trains (issue 29 item 3): a HF
config and a ``pkg.mod:build`` model are measured layer by layer as the
runtime builds them, with the loss and the host time per operator, and the
cost kernel takes that host time in place of its default ``HOST_OP_S``."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from hetplan.cli import main
from hetplan.cluster.io import load_cluster
from hetplan.cost.constants import HOST_OP_S
from hetplan.cost.kernel import CostKernel
from hetplan.model.load import load_model
from hetplan.plan.workload import Workload
from hetplan.profile import load_profile
from hetplan.profile.db import LOSS_KEY, HostPoint, ProfileDB
from hetplan.runtime.profiling.job import distinct_layers

# A tiny Llama (tests/distributed/hf_pp_helpers.py sizes): 2 decoder layers, tied embeddings
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 64,
         "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
SEQ = 8

QUICK = ["--cluster", "local-cpu-1", "--max-micro-batch", "1", "--repeats", "1", "--warmup", "0",
         "--comm-max-bytes", "0"]


def _llama_config(tmp_path) -> str:
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(LLAMA))
    return str(path)


def _assert_profiles_every_layer(db: ProfileDB, spec) -> None:
    """A row per distinct layer and the loss, each measured; the host time per operator."""
    keys = {layer.profile_key for layer in distinct_layers(spec)}
    assert db.layers() == keys | {LOSS_KEY}
    for e in db.entries():
        assert (e.gpu, e.tp, e.batch) == ("CPU", 1, 1) and e.fwd_s > 0 and e.bwd_s > 0
    assert [h.gpu for h in db.host] == ["CPU"] and 0 < db.host[0].op_s < 1e-2 and db.host[0].ops > 10


@pytest.fixture(scope="module")
def llama_profile(tmp_path_factory) -> tuple[str, str]:
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("llama")
    config, out = _llama_config(tmp), str(tmp / "profile.json")
    assert main(["profile", "--model", config, "--seq-len", str(SEQ), *QUICK, "-o", out]) == 0
    return config, out


@pytest.mark.distributed
def test_hf_config_profile_has_every_layer_the_loss_and_the_host_time(llama_profile, capsys) -> None:
    config, out = llama_profile
    spec = load_model(config, seq_len=SEQ)
    db = load_profile(out)
    _assert_profiles_every_layer(db, spec)
    assert [layer.name for layer in distinct_layers(spec)] == ["model.embed_tokens", "model.layers.0", "lm_head"]
    # estimate reads it: at tp 2 (not profiled) every layer is modelled, with the measured host time
    assert main(["estimate", "--profile", out, "--model", config, "--seq-len", str(SEQ), "--cluster", "local-cpu-2",
                 "--tp", "2", "--pp", "1", "--dp", "1", "--micro-batch", "1", "--global-batch", "2",
                 "--no-replay"]) == 0
    text = capsys.readouterr().out
    assert f"dispatch measured: {db.host[0].op_s * 1e6:.3g} us per operator on CPU" in text


@pytest.mark.distributed
def test_build_function_profile_measures_each_layer_on_what_the_one_before_gives(tmp_path) -> None:
    """An encoder-decoder whose layers hand tuples on (tests/smp_models.py), with its default loss."""
    pytest.importorskip("torch")
    out = str(tmp_path / "p.json")
    assert main(["profile", "--model", "tests.smp_models:encdec", *QUICK, "-o", out]) == 0
    _assert_profiles_every_layer(load_profile(out), load_model("tests.smp_models:encdec"))


def test_the_cost_kernel_takes_the_profiles_host_time(tmp_path) -> None:
    """A pass costs at least its operators times the host time per operator:
    the profile's where it has one for the GPU type (the layers it did not
    measure stay modelled), the default ``HOST_OP_S`` elsewhere."""
    spec = load_model(_llama_config(tmp_path), seq_len=SEQ)
    cluster = load_cluster("local-cpu-1")
    gpu = cluster.devices[0].gpu
    slow = 1e-3  # far above any device time of this tiny model: every pass with operators is host-bound
    base = Workload(spec, cluster, 2, target="hetplan")
    measured = dataclasses.replace(base, profile=ProfileDB(host=[HostPoint("CPU", slow, 40)]))
    other = dataclasses.replace(base, profile=ProfileDB(host=[HostPoint("H100", slow, 40)]))
    kernel = CostKernel(measured)
    ops = kernel.arrays.host_ops_fwd
    assert ops is not None and (ops > 0).any()
    fwd = kernel.layer_times(gpu, 1).fwd_s
    np.testing.assert_allclose(fwd[ops > 0], ops[ops > 0] * slow)
    assert kernel.host_op_s(gpu) == slow
    assert CostKernel(other).host_op_s(gpu) == CostKernel(base).host_op_s(gpu) == HOST_OP_S
    assert (CostKernel(base).layer_times(gpu, 1).fwd_s[ops > 0] < fwd[ops > 0] / 10).all()


@pytest.mark.parametrize("argv, says", [
    (["--tp", "2", "--cluster", "local-cpu-2"], "measures HF and pkg.mod:build models at tp 1"),
    (["--model", "examples/configs/t5-small.json"], "pass more than one tensor on"),
])
def test_models_it_cannot_measure_are_one_error_line(argv, says, tmp_path, capsys) -> None:
    pytest.importorskip("transformers")
    base = {"--model": _llama_config(tmp_path), "--cluster": "local-cpu-1", "--seq-len": str(SEQ),
            "-o": str(tmp_path / "p.json")}
    for flag, value in zip(argv[::2], argv[1::2]):
        base[flag] = value
    assert main(["profile", *[x for kv in base.items() for x in kv]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hetplan: error:") and says in err[0], err
