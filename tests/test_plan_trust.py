"""A plan file never makes hetplan import code by itself (issue 32 item 1; docs/inputs.md,
"What a plan file can do"), and plan files written before the typed model source (format 3,
tests/data/planfiles_v3, written by main before the change) still load with the same source.

A plan whose model is ``pkg.mod:build`` code runs it only when the user names it (``--model``,
``init(plan, model=...)``), its hash equal to the plan's, or trusts the file
(``--trust-plan-code``, ``trust_plan_code=True``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hetplan.errors import HetplanError
from hetplan.model.origin import HFSource, ModuleSource
from hetplan.model.spec import ModelSpec
from hetplan.plan.file import PLAN_FILE_VERSION, read_plan_file, resolve_model

ROOT = Path(__file__).resolve().parent.parent
OLD = ROOT / "tests" / "data" / "planfiles_v3"
UNTRUSTED = "imports only when you name it"


def _edited(tmp_path: Path, name: str, edit) -> str:
    data = json.loads((OLD / name).read_text())
    edit(data)
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("name", ["preset.json", "hf.json", "module.json"])
def test_format_3_plan_files_load_with_the_source_their_meta_said(name: str) -> None:
    old_meta = json.loads((OLD / name).read_text())["model_spec"]["meta"]
    pf = read_plan_file(OLD / name)
    assert pf.version == 3 and PLAN_FILE_VERSION == 4
    source = pf.model.source
    if name == "preset.json":
        assert source is None
    elif name == "hf.json":
        assert source == HFSource(old_meta["hf_class"], old_meta["model_type"], old_meta["hf_config"])
        assert source.config["num_hidden_layers"] == 2
    else:
        assert source == ModuleSource(old_meta["module_source"], old_meta["module_hash"])
        assert not source.trusted  # read from a file: never trusted
    assert not {"hf_class", "model_type", "hf_config", "module_source", "module_hash"} & set(pf.model.meta)
    again = ModelSpec.from_dict(json.loads(json.dumps(pf.model.to_dict())))  # format 4's form round-trips
    assert again.source == source and again == pf.model


def test_source_and_legacy_meta_together_are_refused() -> None:
    data = read_plan_file(OLD / "module.json").model.to_dict()
    data["meta"]["module_source"] = "os:abort"
    with pytest.raises(HetplanError, match="meta.module_source says how to build the model"):
        ModelSpec.from_dict(data)


def test_abort_reproducer_is_refused_before_any_import(tmp_path: Path) -> None:
    """issue 32: module_source "os:abort" made 'hetplan train' abort (exit 134)."""
    path = _edited(tmp_path, "module.json", lambda d: d["model_spec"]["meta"].update(module_source="os:abort"))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "hetplan", "train", "--plan", path, "--steps", "1"],
                          capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "hetplan: error: the plan's model is Python code (os:abort), which hetplan imports only when you name it: "
        "give --model os:abort (hetplan.runtime.init(plan, model='os:abort')), or --trust-plan-code "
        "(trust_plan_code=True) if you trust the plan file"]


def test_unnamed_code_is_refused_and_named_or_trusted_code_builds(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from hetplan.runtime.build import model_build
    from hetplan.runtime.setup import check_plan

    never = _edited(tmp_path, "module.json",
                    lambda d: d["model_spec"]["meta"].update(module_source="hetplan_never_imported.mod:build"))
    spec = check_plan(never)[1]
    with pytest.raises(HetplanError, match=UNTRUSTED):  # not "cannot import": refused before trying
        model_build(spec)
    assert "hetplan_never_imported" not in sys.modules
    plan = OLD / "module.json"
    named = check_plan(plan, "tests.smp_models:gpt_lm")[1]
    trusted = check_plan(plan, trust_plan_code=True)[1]
    for spec in (named, trusted):
        assert spec.source.trusted
        assert sum(p.numel() for p in model_build(spec).build().parameters()) == spec.total_params


def test_named_code_whose_hash_differs_from_the_plans_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    path = _edited(tmp_path, "module.json", lambda d: d["model_spec"]["meta"].update(module_hash="0123456789abcdef"))
    with pytest.raises(HetplanError, match="parameter names or shapes changed .hash 8d3a3ab0ee2265b1, the plan's "
                                           "0123456789abcdef."):
        resolve_model(read_plan_file(path), "tests.smp_models:gpt_lm")


def test_format_1_plan_or_bare_plan_naming_code_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from hetplan.runtime.setup import check_plan

    plan = read_plan_file(OLD / "module.json").plans[0]
    bare = replace(plan, model="os:abort")
    with pytest.raises(HetplanError, match=UNTRUSTED):
        check_plan(bare)
    path = tmp_path / "format1.json"
    path.write_text(json.dumps({"plan": bare.to_dict()}))
    with pytest.raises(HetplanError, match=UNTRUSTED):
        resolve_model(read_plan_file(path))


def test_hf_class_must_be_a_transformers_model_class() -> None:
    pytest.importorskip("transformers")
    from hetplan.runtime.build import model_build

    spec = read_plan_file(OLD / "hf.json").model
    with pytest.raises(HetplanError, match="'pipeline' is no transformers model class"):
        model_build(replace(spec, source=replace(spec.source, hf_class="pipeline")))
