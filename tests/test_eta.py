"""The step line's time estimate: mean step time of this process times the steps left."""

from __future__ import annotations

from rollwise.run.rundir import Run


def test_step_line_eta(tmp_path) -> None:
    run = Run(tmp_path / "r", resume=False, config_toml="", echo=lambda s: None)
    assert run._eta(10.0, 1, 5) == " | eta 0m40s"  # 10 s x 4 steps left
    assert run._eta(20.0, 2, 5) == " | eta 0m45s"  # mean 15 s x 3
    assert run._eta(200.0, 3, 5) == " | eta 2m33s"  # mean 76.7 s x 2 steps left
    assert run._eta(5.0, 5, 5) == ""  # nothing left
