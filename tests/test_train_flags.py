"""``hetplan train`` checks its flags together before any work: one line, exit status 2.

Every test runs ``hetplan.cli.main`` in this process with a real plan file; the
first step of real work (importing torch for the run) is replaced by an
exception, so a test whose flags got past the checks shows it at once, and no
training ever starts.
"""

from __future__ import annotations

import pytest

from hetplan.cli import main
from hetplan.runtime import cli as runtime_cli


class Started(Exception):
    """The flags passed the checks and the work began."""


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("plan") / "p.json"
    assert main(["estimate", "--model", "tiny-gpt", "--cluster", "local-cpu-2", "--tp", "1", "--pp", "1",
                 "--dp", "2", "--micro-batch", "1", "--global-batch", "4", "--json", str(path)]) == 0
    return str(path)


@pytest.fixture(autouse=True)
def no_work(monkeypatch) -> None:
    def start() -> None:
        raise Started

    monkeypatch.setattr(runtime_cli, "require_torch", start)


def _error(capsys, plan: str, *flags: str) -> str:
    """The one line ``hetplan: error: ...`` of a HetplanError (main returns 2)."""
    capsys.readouterr()
    assert main(["train", "--plan", plan, *flags]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hetplan: error: "), captured.err
    assert captured.out == ""
    return lines[0]


def _arg_error(capsys, plan: str, *flags: str) -> str:
    """argparse's ``error: argument --X: ...`` line (exit status 2)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["train", "--plan", plan, *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "error: argument" in last and "Traceback" not in err, err
    return last


def test_valid_flags_reach_the_work(plan, tmp_path) -> None:
    with pytest.raises(Started):
        main(["train", "--plan", plan, "--steps", "1", "--lr", "0.5", "--clip", "0",
              "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "1", "--resume",
              "--out", str(tmp_path / "new" / "out")])
    assert not (tmp_path / "new").exists()  # checked, not created


def test_resume_needs_checkpoint_dir(plan, capsys) -> None:
    assert "--resume needs --checkpoint-dir" in _error(capsys, plan, "--resume")


def test_checkpoint_every_needs_checkpoint_dir(plan, capsys) -> None:
    assert "--checkpoint-every needs --checkpoint-dir" in _error(capsys, plan, "--checkpoint-every", "2")


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_checkpoint_every_must_be_at_least_one(plan, tmp_path, capsys, value) -> None:
    line = _arg_error(capsys, plan, "--checkpoint-dir", str(tmp_path), "--checkpoint-every", value)
    assert "argument --checkpoint-every:" in line and value in line, line


@pytest.mark.parametrize("value, why", [("nan", "finite"), ("inf", "finite"), ("-inf", "finite"),
                                        ("-1", "> 0"), ("0", "> 0"), ("fast", "expected a number")])
def test_lr_must_be_finite_and_positive(plan, capsys, value, why) -> None:
    flags = [f"--lr={value}"] if value == "-inf" else ["--lr", value]  # as typed: --lr -1
    line = _arg_error(capsys, plan, *flags)
    assert "argument --lr:" in line and why in line and value in line, line


@pytest.mark.parametrize("value, why", [("nan", "finite"), ("inf", "finite"), ("-1", ">= 0"),
                                        ("off", "expected a number")])
def test_clip_must_be_finite_and_not_negative(plan, capsys, value, why) -> None:
    line = _arg_error(capsys, plan, "--clip", value)
    assert "argument --clip:" in line and why in line and value in line, line


def test_out_that_is_a_file(plan, tmp_path, capsys) -> None:
    target = tmp_path / "hostname"
    target.write_text("a file\n")
    line = _error(capsys, plan, "--out", str(target))
    assert f"--out {target}: it exists and is not a directory" in line


def test_out_that_cannot_be_created(plan, tmp_path, capsys) -> None:
    (tmp_path / "file").write_text("a file\n")
    line = _error(capsys, plan, "--out", str(tmp_path / "file" / "sub" / "out"))
    assert f"cannot create it, {tmp_path / 'file'} is not a directory" in line


def test_checkpoint_dir_that_is_a_file(plan, tmp_path, capsys) -> None:
    (tmp_path / "ck").write_text("a file\n")
    line = _error(capsys, plan, "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "1")
    assert "--checkpoint-dir" in line and "is not a directory" in line


def test_resume_and_load_exclude_each_other(plan, tmp_path, capsys) -> None:
    line = _error(capsys, plan, "--checkpoint-dir", str(tmp_path), "--resume", "--load", str(tmp_path))
    assert "--resume and --load exclude each other" in line


def test_load_of_a_missing_checkpoint(plan, tmp_path, capsys) -> None:
    line = _error(capsys, plan, "--load", str(tmp_path / "nowhere"))
    assert "no such checkpoint directory" in line
