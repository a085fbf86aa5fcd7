"""`rollwise train / eval / report` (also `python -m rollwise`)."""

from __future__ import annotations

import json
import os
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


def _claim_run_dir(cfg: Config):
    """(runs/<name>, its lock): an existing run is kept and a numbered sibling created, or,
    with run.overwrite, emptied (refused while another process holds it). Called only once
    the config has passed every check and the model has loaded."""
    from rollwise.runlock import RunLock

    base = Path(cfg.run.output_dir) / cfg.run.name
    if cfg.run.overwrite and base.is_dir():
        lock = RunLock(base)
        for child in base.iterdir():
            if child.name != ".lock":
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        return base, lock
    root, n = base, 2
    while True:  # mkdir is the atomic claim: two runs of one name get two directories
        try:
            root.mkdir(parents=True)
            return root, RunLock(root)
        except FileExistsError:
            root, n = base.with_name(f"{base.name}-{n}"), n + 1


def _fail(message: str, code: int = 2):
    console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def os_error_message(e: OSError, root: Path | None = None) -> str:
    """One line for an operating-system failure: what failed, on which file, what to do."""
    import errno

    where = f" ({e.filename})" if e.filename else ""
    resume = f"; then continue with --resume {root}" if root is not None else ""
    if e.errno == errno.ENOSPC:
        return (f"disk full{where}: the last complete checkpoint is kept; free some space"
                f"{resume}")
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied{where}: choose a run.output_dir you can write to"
    if e.errno == errno.EROFS:
        return f"read-only file system{where}: choose another run.output_dir"
    if e.errno in (errno.ENOTDIR, errno.EEXIST):
        return f"a file is in the way{where}: run.output_dir must be a folder"
    return f"{e.strerror or type(e).__name__}{where}{resume}"


FREE_TO_CHANGE = ("run.num_steps", "run.threads", "run.checkpoint_every",
                  "run.checkpoint_minutes", "run.keep_checkpoints", "run.loggers", "run.device",
                  "eval.", "health.")
# where the stages run, not what they compute (group numbering makes the samples the same)
FREE_TO_CHANGE += ("run.backend", "run.ray_address", "rollout.num_workers",
                   "rollout.worker_cpus")


def config_changes(old: Config, new: Config) -> dict[str, tuple]:
    """{dotted key: (old, new)} of the values that differ."""
    from rollwise.config import flatten

    a, b = flatten(old.model_dump()), flatten(new.model_dump())
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and not isinstance(a.get(k, b.get(k)), dict)}


def _resume_config(resume: Path, config: Path | None, set_: list[str],
                   allow_changes: bool) -> tuple[Config, dict]:
    """The config a resumed run continues with, and what changed from the stored one.
    Changes to what the finished steps used (model, task, algorithm, ...) are refused
    unless `allow_changes`: the resumed run would silently be a different experiment."""
    if not (resume / "config.toml").is_file():
        _fail(f"--resume {resume}: not a run directory (no config.toml)")
    stored = load_config(resume / "config.toml")
    cfg = load_config(config or resume / "config.toml", set_)
    changes = config_changes(stored, cfg)
    binding = [k for k in changes if not k.startswith(FREE_TO_CHANGE)]
    if binding and not allow_changes:
        shown = ", ".join(f"{k}: {changes[k][0]!r} -> {changes[k][1]!r}" for k in binding[:5])
        _fail(f"--resume {resume}: these changes alter what the finished steps used: {shown}; "
              "add --allow-changes to continue anyway (the change is recorded in summary.json)")
    return cfg, changes


@app.command()
def train(config: Annotated[Path | None, typer.Argument(help="TOML config file.")] = None,
          set_: Annotated[list[str] | None, typer.Option("--set", help=SET_HELP)] = None,
          resume: Annotated[Path | None, typer.Option(help="Continue this run directory.")] = None,
          allow_changes: Annotated[bool, typer.Option(
              "--allow-changes", help="With --resume: accept --set values that change what "
              "the finished steps used (recorded in summary.json).")] = False):
    """Train a policy with GRPO on a task; writes a run directory with metrics and report."""
    from rollwise.health import RunUnhealthy
    from rollwise.runlock import RunLockedError

    root = None
    try:
        try:
            cfg, root, opened = _open_run(config, set_ or [], resume, allow_changes)
        except (ConfigError, ValueError, FileNotFoundError, RunLockedError) as e:
            _fail(str(e))
        summary = _train(cfg, opened)
    except RunLockedError as e:
        _fail(str(e))
    except RunUnhealthy as e:
        _fail(f"{e} (run: {root})", code=3)
    except OSError as e:
        _fail(os_error_message(e, root), code=1)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    before = summary.get("eval_before", {}).get("accuracy")
    after = summary["eval_after"]["accuracy"]
    change = f"{before:.1%} -> {after:.1%}" if before is not None else f"{after:.1%}"
    problems, steps = summary.get("health_problem_steps", 0), summary.get("steps", 0)
    # a GRPO step whose groups all have equal rewards is normal now and then; the final
    # line warns only when a quarter of the steps or more had a problem
    warn = (f" | WARNING: {problems} of {steps} steps learned nothing (see the step lines)"
            if problems and 4 * problems >= max(steps, 1) else "")
    console.print(f"[bold green]done[/]: held-out greedy accuracy {change} in "
                  f"{summary['train_seconds']:.0f}s of training ({summary['steps']} steps) | "
                  f"run: {root} | report: {summary['report']}{warn}", highlight=False)


def _open_run(config: Path | None, set_: list[str], resume: Path | None, allow_changes: bool):
    """Validate, build the stages (the model loads), then claim and open the run directory;
    (cfg, root, (stages, Run)). Nothing on disk changes before the config has passed."""
    from rollwise.build import build_run
    from rollwise.health import HealthCheck
    from rollwise.observe.loggers import check_loggers, make_loggers
    from rollwise.preflight import check_config
    from rollwise.rundir import Run
    from rollwise.runlock import RunLock

    changes: dict = {}
    if resume is not None:
        cfg, changes = _resume_config(resume, config, set_, allow_changes)
        root = resume
    else:
        if config is None:
            _fail("give a config file, e.g. rollwise train configs/tiny_arith.toml")
        cfg = load_config(config, set_)
        root = Path(cfg.run.output_dir) / cfg.run.name
        _check_output_dir(Path(cfg.run.output_dir))
    check_config(cfg)
    check_loggers(cfg.run.loggers)  # a missing extra is named before the model loads
    lock = RunLock(root) if resume is not None else None  # refuse a live run before loading
    console.print(f"[bold]rollwise[/] {cfg.run.name}: model {cfg.model.name}, task "
                  f"{cfg.task.name}, {cfg.run.num_steps} steps -> "
                  f"{root if resume is not None else Path(cfg.run.output_dir)}", highlight=False)
    stages = build_run(cfg)
    console.print(stages.info["precision_line"], highlight=False, soft_wrap=True)
    if "sandbox" in stages.info:  # code tasks: what isolates model-written code here
        box = stages.info["sandbox"]
        console.print(f"sandbox: {box['isolation']}"
                      + ("" if box["security_boundary"] else " (limits only: NOT a security "
                         "boundary, docs/rewards.md)"), highlight=False,
                      style=None if box["security_boundary"] else "yellow")
    if lock is None:
        root, lock = _claim_run_dir(cfg)
    loggers = make_loggers(cfg.run.loggers, root, cfg.run.name, cfg.model_dump(),
                           echo=lambda s: console.print(s, style="yellow", highlight=False))
    echo = lambda s: console.print(s, highlight=False, soft_wrap=True)
    run = Run(root, resume=resume is not None, config_toml=to_toml(cfg), lock=lock, echo=echo,
              keep_checkpoints=cfg.run.keep_checkpoints, loggers=loggers,
              health=HealthCheck(cfg.health.patience, cfg.health.max_loss, cfg.health.max_kl))
    run.summary.update({"model": cfg.model.name, "task": cfg.task.name, **stages.info})
    run.config_changes = {k: list(v) for k, v in changes.items()}
    skipped = stages.info["skipped_train_prompts"] + stages.info["skipped_eval_prompts"]
    if skipped:
        console.print(f"skipped {skipped} prompts longer than the context "
                      f"budget (counted in summary.json)", style="yellow")
    return cfg, root, (stages, run)


def _check_output_dir(out: Path) -> None:
    """Fail now, not after the model has loaded, when runs cannot be created under `out`."""
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"run.output_dir = '{out}': {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"run.output_dir = '{out}': {existing} is not writable")


def _train(cfg: Config, opened) -> dict:
    from rollwise.build import run_steps
    from rollwise.loop import train as train_loop

    stages, run = opened
    try:
        return train_loop(stages, run, cfg.run.num_steps, eval_every=cfg.eval.every,
                          eval_before=cfg.eval.before, checkpoint_every=cfg.run.checkpoint_every,
                          checkpoint_seconds=cfg.run.checkpoint_minutes * 60,
                          steps=run_steps(cfg))
    finally:
        if hasattr(stages, "shutdown"):  # the Ray backend's actors
            stages.shutdown()


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
        try:
            load_checkpoint(found[-1], stages.model)
        except ValueError as e:
            _fail(str(e))
        stages.engine.publish(stages.engine.version)  # a converted (rollout.dtype) copy
        console.print(f"evaluating {found[-1]}")
    result = stages.evaluate()
    from rich.table import Table

    from rollwise.evaluate import task_table

    rows = task_table(result)
    table = Table(title="held-out evaluation by task")
    columns = list(dict.fromkeys(k for row in rows for k in row))
    for c in columns:
        table.add_column(c, justify="left" if c == "task" else "right")
    for row in rows:
        table.add_row(*[f"{row[c]:.3f}" if isinstance(row.get(c), float) and c != "n"
                        else str(row.get(c, "")) for c in columns])
    console.print(table)
    console.print_json(json.dumps(result))  # last, so the output ends with one JSON object


@app.command()
def report(path: Annotated[Path, typer.Argument(help="A run directory or a benchmark JSON.")],
           compare: Annotated[list[Path] | None, typer.Option(
               "--compare", help="Other run directories to overlay with PATH (repeatable); "
               "writes compare.html (see --out).")] = None,
           out: Annotated[Path, typer.Option(help="Where --compare writes its page.")] = Path(
               "compare.html")):
    """Write the HTML report of a run directory or a benchmark JSON file, or (--compare) one
    page overlaying the accuracy and reward of several runs vs step and wall time."""
    from rollwise.observe import write_bench_report, write_report

    if compare:
        from rollwise.observe.completions import write_compare

        runs = [path, *compare]
        missing = [r for r in runs if not (r / "metrics.jsonl").is_file()]
        if missing:
            _fail(f"{missing[0]}: not a run directory (no metrics.jsonl)")
        console.print(f"comparison: {write_compare(runs, out)}")
        return
    if path.is_dir():
        out = write_report(path)
    elif path.suffix == ".json" and path.is_file():
        out = write_bench_report(path)
    else:
        _fail(f"{path}: expected a run directory or a benchmark .json file")
    console.print(f"report: {out}")


@app.command("export")
def export_model(run_dir: Annotated[Path, typer.Argument(help="A run directory.")],
                 out_dir: Annotated[Path, typer.Argument(help="A new folder to write.")],
                 step: Annotated[int | None, typer.Option(
                     help="The checkpoint's step (default: the latest).")] = None):
    """Write a run's model as a Hugging Face folder (config.json, safetensors, tokenizer,
    chat template; LoRA merged) that AutoModelForCausalLM.from_pretrained loads."""
    from rollwise.export import export

    if not (run_dir / "config.toml").is_file():
        _fail(f"{run_dir}: not a run directory (no config.toml)")
    try:
        checkpoint = export(run_dir, out_dir, step)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        _fail(str(e))
    console.print(f"exported {checkpoint} -> {out_dir} (load it with "
                  f"AutoModelForCausalLM.from_pretrained('{out_dir}'))", highlight=False)


@app.command("serve")
def serve(model: Annotated[str, typer.Option(
              help="'tiny', 'smollm2-135m', a Hugging Face folder, or a run directory (its "
              "latest checkpoint).")],
          host: Annotated[str, typer.Option(help="Interface to bind (localhost by default).")
                          ] = "127.0.0.1",
          port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
          api_key: Annotated[str | None, typer.Option(
              envvar="ROLLWISE_API_KEY",
              help="Require 'Authorization: Bearer KEY' (or set $ROLLWISE_API_KEY).")] = None,
          step: Annotated[int | None, typer.Option(
              help="Run directory: the checkpoint's step (default: the latest).")] = None,
          dtype: Annotated[str, typer.Option(help="Engine precision: float32 or bfloat16.")
                           ] = "float32",
          max_tokens: Annotated[int, typer.Option(help="Most max_tokens one choice may ask.")
                                ] = 4096,
          max_body_bytes: Annotated[int, typer.Option(help="Largest request body.")] = 1 << 20,
          max_n: Annotated[int, typer.Option(help="Most choices per prompt (n).")] = 16,
          max_num_seqs: Annotated[int, typer.Option(help="Sequences decoded at once.")] = 64,
          kv_budget_tokens: Annotated[int, typer.Option(help="KV cache size in tokens.")
                                      ] = 65536,
          threads: Annotated[int, typer.Option(help="Torch CPU threads (0: all cores).")] = 0):
    """Serve a model over an OpenAI-compatible HTTP API (docs/serve.md)."""
    import uvicorn

    from rollwise.runtime import configure
    from rollwise.serve import Limits, make_server

    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        console.print(f"[bold yellow]warning:[/] serving on {host} without --api-key: anyone "
                      "who can reach this port can use the model", highlight=False)
    configure(threads)
    limits = Limits(max_body_bytes=max_body_bytes, max_tokens=max_tokens, max_n=max_n)
    try:
        server = make_server(model, step=step, dtype=dtype, api_key=api_key, limits=limits,
                             max_num_seqs=max_num_seqs, kv_budget_tokens=kv_budget_tokens)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        _fail(str(e))
    console.print(f"serving '{server.name}' (policy version {server.engine.version}) on "
                  f"http://{host}:{port}/v1" + (" (API key required)" if api_key else ""),
                  highlight=False)
    uvicorn.run(server.app, host=host, port=port, log_level="warning")


def main() -> None:
    """The console entry point: an operating-system failure anywhere (disk full, permission,
    a file in the way) is one line with what to do, not a traceback."""
    try:
        app()
    except OSError as e:
        console.print(f"[bold red]error:[/] {os_error_message(e)}", highlight=False)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
