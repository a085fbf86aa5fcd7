"""`rollwise train / eval / report` (also `python -m rollwise`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Annotated

import rich
import typer

from rollwise.config import Config, ConfigError, load_config, to_toml

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="RL post-training of language models with verifiable rewards.")
console = rich.get_console()  # the console progress bars draw on
SET_HELP = "Override a config key, e.g. --set rollout.temperature=0.7 (repeatable)."


def _bench_app() -> typer.Typer:
    from rollwise.bench.cli import bench_app

    return bench_app


app.add_typer(_bench_app(), name="bench")


def _run_dir(cfg: Config) -> Path:
    """runs/<name>; an existing one is kept and a numbered sibling used (or replaced if
    run.overwrite is true)."""
    root = Path(cfg.run.output_dir) / cfg.run.name
    if root.exists() and cfg.run.overwrite:
        shutil.rmtree(root)
    n = 2
    base = root
    while root.exists():
        root = base.with_name(f"{base.name}-{n}")
        n += 1
    return root


def _fail(message: str, code: int = 2):
    console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


@app.command()
def train(config: Annotated[Path | None, typer.Argument(help="TOML config file.")] = None,
          set_: Annotated[list[str] | None, typer.Option("--set", help=SET_HELP)] = None,
          resume: Annotated[Path | None, typer.Option(help="Continue this run directory.")] = None):
    """Train a policy with GRPO on a task; writes a run directory with metrics and report."""
    from rollwise.build import build
    from rollwise.loop import train as train_loop
    from rollwise.rundir import Run

    try:
        if resume is not None:
            if not (resume / "config.toml").is_file():
                _fail(f"--resume {resume}: not a run directory (no config.toml)")
            cfg = load_config(config or resume / "config.toml", set_ or [])
            root = resume
        else:
            if config is None:
                _fail("give a config file, e.g. rollwise train configs/tiny_arith.toml")
            cfg = load_config(config, set_ or [])
            root = _run_dir(cfg)
        console.print(f"[bold]rollwise[/] {cfg.run.name}: model {cfg.model.name}, task "
                      f"{cfg.task.name}, {cfg.run.num_steps} steps -> {root}", highlight=False)
        stages = build(cfg)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        _fail(str(e))
    run = Run(root, resume=resume is not None, config_toml=to_toml(cfg),
              keep_checkpoints=cfg.run.keep_checkpoints,
              echo=lambda s: console.print(s, highlight=False, soft_wrap=True))
    run.summary.update({"model": cfg.model.name, "task": cfg.task.name, **stages.info})
    skipped = stages.info["skipped_train_prompts"] + stages.info["skipped_eval_prompts"]
    if skipped:
        console.print(f"skipped {skipped} prompts longer than the context "
                      f"budget (counted in summary.json)", style="yellow")
    try:
        summary = train_loop(stages, run, cfg.run.num_steps, eval_every=cfg.eval.every,
                             eval_before=cfg.eval.before,
                             checkpoint_every=cfg.run.checkpoint_every)
    except KeyboardInterrupt:
        raise typer.Exit(130)
    before = summary.get("eval_before", {}).get("accuracy")
    after = summary["eval_after"]["accuracy"]
    change = f"{before:.1%} -> {after:.1%}" if before is not None else f"{after:.1%}"
    console.print(f"[bold green]done[/]: held-out greedy accuracy {change} in "
                  f"{summary['train_seconds']:.0f}s of training ({summary['steps']} steps) | "
                  f"run: {root} | report: {summary['report']}", highlight=False)


@app.command("eval")
def evaluate(target: Annotated[Path, typer.Argument(help="A config file or a run directory.")],
             set_: Annotated[list[str] | None, typer.Option("--set", help=SET_HELP)] = None):
    """Greedy accuracy (and pass@k if eval.pass_k > 0) on the held-out split."""
    from rollwise.build import build
    from rollwise.learner.checkpoint import list_checkpoints, load_checkpoint

    is_run = target.is_dir()
    try:
        cfg = load_config(target / "config.toml" if is_run else target, set_ or [])
        stages = build(cfg)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        _fail(str(e))
    if is_run:
        found = list_checkpoints(target / "checkpoints")
        if not found:
            _fail(f"{target} has no checkpoint to evaluate")
        load_checkpoint(found[-1], stages.model)
        stages.engine.publish(stages.engine.version)  # a converted (rollout.dtype) copy
        console.print(f"evaluating {found[-1]}")
    result = stages.evaluate()
    console.print_json(json.dumps(result))


@app.command()
def report(path: Annotated[Path, typer.Argument(help="A run directory or a benchmark JSON.")]):
    """Write the HTML report of a run directory or a benchmark JSON file."""
    from rollwise.observe import write_bench_report, write_report

    if path.is_dir():
        out = write_report(path)
    elif path.suffix == ".json" and path.is_file():
        out = write_bench_report(path)
    else:
        _fail(f"{path}: expected a run directory or a benchmark .json file")
    console.print(f"report: {out}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
