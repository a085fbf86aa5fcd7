"""The command line refuses what would lose or mix runs, in one line and before loading a model."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rollwise.cli import app, os_error_message
from rollwise.compose.config import load_config, to_toml
from rollwise.pipeline.launch import config_changes
from rollwise.system.runlock import RunLock
from test_cli import QUICK, ROOT, rollwise

CONFIG = str(ROOT / "configs/tiny_arith.toml")


def one_line_error(out) -> str:
    """The error text; asserts there is no traceback."""
    text = out.stdout + out.stderr
    assert "Traceback" not in text, text[-3000:]
    lines = [x for x in text.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, text[-3000:]
    return " ".join(text[text.index("error:"):].split())


def test_overwrite_happens_only_after_the_config_is_valid(tmp_path):
    """Regression: run.overwrite deleted the old run before a typo'd algorithm was found."""
    old = tmp_path / "runs/tiny_arith"
    old.mkdir(parents=True)
    (old / "precious.txt").write_text("keep me")
    out = rollwise("train", CONFIG, "--set", "run.overwrite=true", "--set",
                   "algorithm.advantage='grpoo'", cwd=tmp_path)
    assert out.returncode == 2 and "algorithm.advantage" in one_line_error(out)
    assert (old / "precious.txt").read_text() == "keep me"


def test_bad_values_fail_before_a_run_directory_exists(tmp_path):
    """Regression: eval.max_tokens=-5 gave a misleading error and a half-made run dir."""
    for bad, key in (("eval.max_tokens=-5", "eval.max_tokens"),
                     ("run.device='cuda'", "CUDA is not available"),
                     ("run.name='../escape'", "run.name")):
        out = rollwise("train", CONFIG, "--set", bad, cwd=tmp_path)
        assert out.returncode == 2 and key in one_line_error(out), bad
    assert not (tmp_path / "runs").exists() and not (tmp_path / "escape").exists()


def test_an_output_dir_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "runs").write_text("a file")
    out = rollwise("train", CONFIG, cwd=tmp_path)
    assert out.returncode == 2 and "is a file, not a folder" in one_line_error(out)


def _stored_run(tmp_path: Path) -> Path:
    root = tmp_path / "runs/r"
    root.mkdir(parents=True)
    (root / "config.toml").write_text(to_toml(load_config(CONFIG, ["run.name='r'"])))
    return root


def test_resume_of_a_run_in_use_is_refused_with_the_holders_pid(tmp_path):
    root = _stored_run(tmp_path)
    lock = RunLock(root)
    out = rollwise("train", "--resume", str(root), cwd=tmp_path)
    lock.release()
    assert out.returncode == 2 and f"pid {os.getpid()}" in one_line_error(out)


def test_resume_refuses_a_set_that_changes_finished_steps(tmp_path):
    """Regression: `--resume --set ...` silently rewrote config.toml."""
    root = _stored_run(tmp_path)
    before = (root / "config.toml").read_text()
    out = rollwise("train", "--resume", str(root), "--set", "rollout.temperature=0.5",
                   cwd=tmp_path)
    text = one_line_error(out)
    assert out.returncode == 2 and "rollout.temperature: 1.0 -> 0.5" in text
    assert "--allow-changes" in text and (root / "config.toml").read_text() == before


def test_config_changes_lists_only_differences():
    a = load_config(CONFIG)
    b = load_config(CONFIG, ["run.num_steps=7", "task.options={ digits = 3, terms = 2 }"])
    assert config_changes(a, b) == {"run.num_steps": (150, 7),
                                    "task.options.digits": (2, 3)}


@pytest.mark.slow  # `make test` stays within 8 minutes on 2 cores
def test_allowed_changes_are_recorded_and_extending_needs_no_flag(tmp_path):
    first = rollwise("train", CONFIG, *QUICK, "--set", "run.num_steps=1",
                     "--set", "eval.before=false", cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-2000:]
    root = tmp_path / "runs/tiny_arith"
    out = rollwise("train", "--resume", str(root), "--set", "run.num_steps=2", "--set",
                   "rollout.temperature=0.9", "--allow-changes", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:]
    summary = json.loads((root / "summary.json").read_text())
    assert summary["steps"] == 2
    assert summary["config_changes"] == [{"at_step": 1, "changes": {
        "rollout.temperature": [1.0, 0.9], "run.num_steps": [1, 2]}}]
    assert load_config(root / "config.toml").rollout.temperature == 0.9


def test_a_full_disk_stops_the_run_in_one_line_and_keeps_the_last_checkpoint(tmp_path,
                                                                            monkeypatch):
    import rollwise.run.rundir

    real, calls = rollwise.run.rundir.save_checkpoint, []

    def fills_up(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", "checkpoints/.tmp_step_2")
        return real(*args, **kwargs)

    monkeypatch.setattr(rollwise.run.rundir, "save_checkpoint", fills_up)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ROLLWISE_NO_PROGRESS", "1")
    out = CliRunner().invoke(app, ["train", CONFIG, *QUICK, "--set", "run.checkpoint_every=1",
                                   "--set", "eval.before=false"])
    assert out.exit_code == 1, out.output[-2000:]
    text = " ".join(out.output.split())
    assert "disk full (checkpoints/.tmp_step_2)" in text and "--resume runs/tiny_arith" in text
    root = tmp_path / "runs/tiny_arith"
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["step_1"]
    monkeypatch.setattr(rollwise.run.rundir, "save_checkpoint", real)
    again = CliRunner().invoke(app, ["train", "--resume", str(root)])
    assert again.exit_code == 0, again.output[-2000:]
    assert json.loads((root / "summary.json").read_text())["steps"] == 3


def test_os_error_messages_say_what_to_do():
    full = os_error_message(OSError(errno.ENOSPC, "x", "/r/f"), Path("/r"))
    assert full == ("disk full (/r/f): the last complete checkpoint is kept; free some "
                    "space; then continue with --resume /r")
    assert "choose a run.output_dir" in os_error_message(OSError(errno.EACCES, "x", "/o"))


def test_help_tables_show_no_bool_value_and_whole_first_paragraphs():
    """Regression: `--help <bool>` and `--allow-changes <bool>` read as taking a value; a
    command's summary broke at its docstring's line break, mid-sentence."""
    wide = {"COLUMNS": "200"}
    for args in (["--help"], ["train", "--help"], ["bench", "--help"]):
        out = CliRunner().invoke(app, args, env=wide)
        assert out.exit_code == 0 and "<bool>" not in out.output, out.output
    rows = CliRunner().invoke(app, ["bench", "--help"], env=wide).output
    assert "busy fractions, staleness, held-out accuracy; the overlap" in rows


def test_a_new_run_refuses_a_directory_holding_another_runs_records(tmp_path):
    """Regression: `rollwise bench remote` ran a side again in the same directory; the new
    run appended to the old records and skipped its own evaluations at steps the old one
    had evaluated (a resumed run's rule), so its accuracy before was the old run's.
    A new run in such a directory is refused; claimed with overwrite it starts empty."""
    from rollwise.run.rundir import Run, claim_run_dir

    root = tmp_path / "r"
    root.mkdir()
    (root / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "step": 0}) + "\n")
    with pytest.raises(FileExistsError, match="holds a run already"):
        Run(root, resume=False, echo=lambda s: None)
    claimed, lock = claim_run_dir(root, overwrite=True)  # the refused run left no lock
    run = Run(claimed, resume=False, echo=lambda s: None, lock=lock)
    assert claimed == root and run.metrics.path.read_text() == ""
    run.close()
