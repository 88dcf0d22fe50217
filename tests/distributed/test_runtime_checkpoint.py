"""Checkpoints: save under one plan, load under another; kill a run and resume it.

The uninterrupted run is the single-process reference (every correct plan
reproduces it to 1e-5), so "the same loss as the uninterrupted run" is checked
against it, step by step, and on the final parameters. SGD with momentum:
a resumed run only matches if the optimizer state was restored too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from types import SimpleNamespace

import pytest

from hetplan.errors import HetplanError
from hetplan.runtime.checkpoint import verify
from hetplan.runtime.checkpoint_dirs import MANIFEST, checkpoint_dir, latest_checkpoint
from rt_helpers import TOL, assert_matches_reference, hetero_plan, make_plan, reference, run, run_raw, train_worker, write_plan


def _assert_continues(result: dict, steps: int, start: int) -> None:
    ref_losses, _ = reference(steps)
    assert result["start_step"] == start
    assert len(result["losses"]) == steps - start
    for got, want in zip(result["losses"], ref_losses[start:]):
        assert abs(got - want) <= TOL * abs(want), (result["losses"], ref_losses)
    assert_matches_reference({**result, "losses": ref_losses[:start] + result["losses"]}, steps)


@pytest.mark.slow
def test_checkpoint_saved_under_one_plan_loads_under_others(tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    saver = make_plan(pp=2, dp=2, micro=2, zero=3)  # 4 processes: pipelined, ZeRO-3 sharded, tied copies
    run(train_worker, 4, write_plan(tmp_path, saver, "a.json"), 2,
        dict(checkpoint_dir=ckpt, checkpoint_every=2, export=False))
    assert latest_checkpoint(ckpt) == (checkpoint_dir(ckpt, 2), 2)
    # a different dp/tp/pp/ZeRO continues with the loss of the uninterrupted run
    loader = make_plan(tp=2, micro=4, recompute="full")
    results = run(train_worker, 2, write_plan(tmp_path, loader, "b.json"), 3,
                  dict(load_from=checkpoint_dir(ckpt, 2)))
    _assert_continues(results[0], 3, 2)
    # a Metis-style plan too (stage 0: 2 replicas taking 3:1 of each micro-batch, stage 1: tp=2)
    het = hetero_plan([(range(0, 3), 2, 1, (3, 1), 0), (range(3, 6), 1, 2, (4,), 0)], micro=4)
    results = run(train_worker, 4, write_plan(tmp_path, het, "h.json"), 3, dict(load_from=checkpoint_dir(ckpt, 2)))
    _assert_continues(results[0], 3, 2)
    # and so does a single process
    results = run(train_worker, 1, write_plan(tmp_path, make_plan(micro=2), "c.json"), 3,
                  dict(load_from=checkpoint_dir(ckpt, 2)))
    _assert_continues(results[0], 3, 2)


@pytest.mark.slow
def test_killed_run_resumes_with_the_same_loss_curve(tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    path = write_plan(tmp_path, make_plan(pp=2, tp=2, micro=2))
    killed = run_raw(train_worker, 4, path, 4, dict(checkpoint_dir=ckpt, checkpoint_every=1, die_after=2,
                                                    export=False))
    assert all(r.exitcode == -9 for r in killed), [(r.rank, r.exitcode, r.error) for r in killed]
    assert latest_checkpoint(ckpt) == (checkpoint_dir(ckpt, 2), 2)
    resumed = run(train_worker, 4, path, 4, dict(checkpoint_dir=ckpt, checkpoint_every=1, resume=True))
    _assert_continues(resumed[0], 4, 2)


# --- checkpoints that cannot silently corrupt a run: the manifest --------------------------------
ONE_PROCESS = SimpleNamespace(distributed=False)  # verify() in this process
LIMIT_S = 90.0  # a rank left waiting would hit the collective timeout, far beyond this


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """Checkpoints step_1 and step_2 of a 2-process ZeRO-3 run (each rank writes a shard file)."""
    root = tmp_path_factory.mktemp("saved")
    run(train_worker, 2, write_plan(root, make_plan(dp=2, micro=2, zero=3)), 2,
        dict(checkpoint_dir=str(root / "ckpt"), checkpoint_every=1, export=False))
    return str(root / "ckpt")


def _copy(saved: str, tmp_path, step: int | None = 2) -> str:
    """A private copy of the saved checkpoints (one step, or all of them) to damage."""
    if step is None:
        return shutil.copytree(saved, tmp_path / "ckpt")
    return shutil.copytree(checkpoint_dir(saved, step), tmp_path / f"step_{step}")


def _refused(path: str) -> str:
    with pytest.raises(HetplanError) as exc:
        verify(ONE_PROCESS, path)
    msg = str(exc.value)
    assert "\n" not in msg and path in msg, msg
    return msg


def _load_everywhere(tmp_path, path: str) -> list:
    """Load ``path`` with 2 processes; every rank must fail, none may hang."""
    t0 = time.monotonic()
    results = run_raw(train_worker, 2, write_plan(tmp_path, make_plan(dp=2, micro=2)), 3,
                      dict(load_from=path, export=False), timeout_s=LIMIT_S)
    assert time.monotonic() - t0 < LIMIT_S
    assert all(r.exitcode not in (0, None) for r in results), [(r.rank, r.exitcode, r.error) for r in results]
    errors = {r.error for r in results}
    assert len(errors) == 1, errors  # the same message on every rank
    msg = errors.pop()
    assert msg.startswith("HetplanError: ") and "\n" not in msg, msg
    return msg


def test_manifest_lists_every_file_with_size_and_sha256(saved) -> None:
    path = checkpoint_dir(saved, 2)
    with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
        manifest = json.load(f)
    assert manifest["version"] == 1
    names = sorted(n for n in os.listdir(path) if n != MANIFEST)
    assert sorted(manifest["files"]) == names and ".metadata" in names
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(names)  # a shard file per rank
    for name in names:
        with open(os.path.join(path, name), "rb") as f:
            data = f.read()
        assert manifest["files"][name] == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    verify(ONE_PROCESS, path)  # intact: accepted
    assert latest_checkpoint(saved) == (path, 2)


def test_truncated_shard_is_refused_on_every_rank(saved, tmp_path) -> None:
    path = str(_copy(saved, tmp_path))
    shard = os.path.join(path, "__1_0.distcp")
    size = os.path.getsize(shard)
    os.truncate(shard, size // 2)
    msg = _load_everywhere(tmp_path, path)
    assert f"checkpoint {path}: file __1_0.distcp is {size // 2} bytes, the manifest says {size} (truncated)" in msg
    assert "resume from an earlier checkpoint or delete this one" in msg


def test_one_flipped_byte_is_refused_on_every_rank(saved, tmp_path) -> None:
    path = str(_copy(saved, tmp_path))
    shard = os.path.join(path, "__1_0.distcp")  # hashed by rank 1: rank 0 must fail with its message too
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    msg = _load_everywhere(tmp_path, path)
    assert f"checkpoint {path}: file __1_0.distcp has sha256 " in msg and "(corrupted)" in msg, msg


def test_incomplete_or_altered_checkpoints_are_refused(saved, tmp_path) -> None:
    path = str(_copy(saved, tmp_path))
    with open(os.path.join(path, ".nfs000123"), "wb") as f:  # hidden droppings are not data: ignored
        f.write(b"x")
    verify(ONE_PROCESS, path)
    with open(os.path.join(path, "__7_0.distcp"), "wb") as f:
        f.write(b"stray")
    assert "file __7_0.distcp is not in the manifest" in _refused(path)
    os.remove(os.path.join(path, "__7_0.distcp"))
    os.remove(os.path.join(path, "__0_0.distcp"))
    assert "file __0_0.distcp is missing" in _refused(path)
    os.remove(os.path.join(path, MANIFEST))
    assert f"checkpoint {path} is incomplete: it has no {MANIFEST}" in _refused(path)
    assert "does not exist" in _refused(str(tmp_path / "nowhere"))


def test_resume_skips_a_newer_checkpoint_without_manifest(saved, tmp_path, capsys) -> None:
    root = str(_copy(saved, tmp_path, None))
    os.remove(os.path.join(checkpoint_dir(root, 2), MANIFEST))  # as if killed while saving step 2
    assert latest_checkpoint(root) == (checkpoint_dir(root, 1), 1)
    err = capsys.readouterr().err
    assert f"skipping checkpoint {checkpoint_dir(root, 2)}: it is incomplete" in err, err
    resumed = run(train_worker, 2, write_plan(tmp_path, make_plan(dp=2, micro=2, zero=3)), 3,
                  dict(checkpoint_dir=root, resume=True))
    _assert_continues(resumed[0], 3, 1)


# --- hetplan train --resume / --load: checked before any process starts ------------------------
def _no_processes(*args, **kwargs):
    raise AssertionError("hetplan train started processes")


def _train_refused(tmp_path, capsys, monkeypatch, *flags: str) -> str:
    """``hetplan train FLAGS`` in this process: one line ``hetplan: error: ...``,
    exit status 2, and no process started (nor the run announced)."""
    from hetplan.cli import main
    from hetplan.runtime import cli as runtime_cli

    monkeypatch.setattr(runtime_cli.subprocess, "call", _no_processes)
    plan = write_plan(tmp_path, make_plan(dp=2, micro=2), "refused.json")
    capsys.readouterr()
    assert main(["train", "--plan", plan, "--steps", "3", *flags]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hetplan: error: "), captured.err
    assert "hetplan train:" not in captured.out, captured.out
    return lines[0]


@pytest.mark.parametrize("state", ["missing", "empty", "incomplete"])
def test_resume_without_a_complete_checkpoint_is_an_error(state, saved, tmp_path, capsys, monkeypatch) -> None:
    """Not a silent start from step 0 (a restarted job would retrain from scratch)."""
    root = str(tmp_path / "ckpt")
    if state == "empty":
        os.mkdir(root)
    elif state == "incomplete":  # killed while saving its first checkpoint
        shutil.copytree(checkpoint_dir(saved, 1), checkpoint_dir(root, 1))
        os.remove(os.path.join(checkpoint_dir(root, 1), MANIFEST))
    line = _train_refused(tmp_path, capsys, monkeypatch, "--checkpoint-dir", root, "--resume")
    why = {"missing": "it does not exist", "empty": "it holds no step_N checkpoint",
           "incomplete": f"1 incomplete: no {MANIFEST}, its save did not finish"}[state]
    assert line == (f"hetplan: error: --resume: no complete checkpoint in {root} ({why}); drop --resume to start "
                    "from step 0, or use --resume-or-start, which starts from step 0 when there is none"), line


def test_damaged_checkpoint_is_refused_before_any_process_starts(saved, tmp_path, capsys, monkeypatch) -> None:
    root = str(_copy(saved, tmp_path, None))
    newest = checkpoint_dir(root, 2)
    shard = os.path.join(newest, "__1_0.distcp")
    size = os.path.getsize(shard)
    os.truncate(shard, size - 1)
    line = _train_refused(tmp_path, capsys, monkeypatch, "--checkpoint-dir", root, "--resume")
    assert f"checkpoint {newest}: file __1_0.distcp is {size - 1} bytes, the manifest says {size} (truncated)" in line
    step1 = checkpoint_dir(root, 1)
    with open(os.path.join(step1, MANIFEST), "w", encoding="utf-8") as f:
        f.write("{not json")
    line = _train_refused(tmp_path, capsys, monkeypatch, "--load", step1)
    assert f"checkpoint {step1}: its {MANIFEST} is unreadable" in line, line
    assert line.endswith("resume from an earlier checkpoint or delete this one"), line


def test_resume_or_start_starts_from_step_0_only_when_there_is_no_checkpoint(tmp_path, capsys) -> None:
    """``hetplan train --resume-or-start`` (a restart script's flag), with a
    one-process plan (trained in this process): an empty directory starts from
    step 0 with a note; the checkpoint that run saved is resumed the next time."""
    from hetplan.cli import main

    plan = write_plan(tmp_path, make_plan(micro=2, cluster="local-cpu-1"))
    root = str(tmp_path / "ckpt")
    os.mkdir(root)

    def train(steps: int):
        capsys.readouterr()
        assert main(["train", "--plan", plan, "--steps", str(steps), "--checkpoint-dir", root,
                     "--checkpoint-every", "1", "--resume-or-start"]) == 0
        return capsys.readouterr()

    first = train(1)
    assert f"note: no complete checkpoint in {root}: starting from step 0 (--resume-or-start)" in first.err
    assert "step    1" in first.out
    second = train(2)
    assert f"resuming from {checkpoint_dir(root, 1)} (step 1)" in second.out, second.out
    assert "step    1" not in second.out and "step    2" in second.out, second.out
