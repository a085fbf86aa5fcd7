"""`rollwise train / eval / report` (also `python -m rollwise`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import rich
import typer
from typer.core import TyperGroup

from rollwise.compose.config import ConfigError, load_config
from rollwise.system.preload import allow_rerun, preload_allocator


def _tidy_help(command) -> None:
    """Help that reads well in its tables: a flag (`--help` too) shows no `<bool>` value,
    and a command's line in its group's table is its whole first paragraph on one line
    (the docstring's own line breaks would cut it mid-sentence)."""
    helper = command.get_help_option(typer.Context(command))
    for param in [*command.params, helper]:
        if param is not None and getattr(param, "is_flag", False):
            param.metavar = ""
    if command.help and not command.short_help:
        command.short_help = " ".join(command.help.split("\n\n")[0].split())
    for sub in getattr(command, "commands", {}).values():
        _tidy_help(sub)


class _Group(TyperGroup):
    """The `rollwise` command group: every command's help is tidied before it parses."""

    def main(self, *args, **kwargs):
        _tidy_help(self)
        return super().main(*args, **kwargs)


app = typer.Typer(add_completion=False, no_args_is_help=True, cls=_Group,
                  help="RL post-training of language models with verifiable rewards.")
console = rich.get_console()  # the console progress bars draw on
SET_HELP = "Override a config key, e.g. --set rollout.temperature=0.7 (repeatable)."


def _bench_app() -> typer.Typer:
    from rollwise.bench.cli import bench_app

    return bench_app


app.add_typer(_bench_app(), name="bench")


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


@app.command()
def train(config: Annotated[Path | None, typer.Argument(help="TOML config file.")] = None,
          set_: Annotated[list[str] | None, typer.Option("--set", help=SET_HELP)] = None,
          resume: Annotated[Path | None, typer.Option(help="Continue this run directory.")] = None,
          allow_changes: Annotated[bool, typer.Option(
              "--allow-changes", help="With --resume: accept --set values that change what "
              "the finished steps used (recorded in summary.json).")] = False):
    """Train a policy with GRPO on a task; writes a run directory with metrics and report."""
    from rollwise.pipeline.launch import RunFinished, train_run
    from rollwise.rollout.servers import RemoteError
    from rollwise.run.health import RunUnhealthy
    from rollwise.system.runlock import RunLockedError
    from rollwise.types import LearnerDied

    root = None
    try:
        try:
            root, opened = _open_run(config, set_ or [], resume, allow_changes)
        except RunFinished as done:
            console.print(str(done), highlight=False, soft_wrap=True)
            return
        except (ConfigError, ValueError, FileNotFoundError, RunLockedError, RemoteError) as e:
            _fail(str(e))  # before the first step: the servers checked (docs/remote.md)
        summary = train_run(opened)
    except RunLockedError as e:
        _fail(str(e))
    except RemoteError as e:  # a server failed for good: the last checkpoint is whole
        _fail(f"{e} (run: {root}; resume it with --resume once the servers are up)", code=1)
    except LearnerDied as e:  # a learner actor or rank gone: one line, the way on
        _fail(f"{e} (run: {root})", code=1)
    except RunUnhealthy as e:
        _fail(f"{e} (run: {root})", code=3)
    except OSError as e:
        _fail(os_error_message(e, root), code=1)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    # soft_wrap: a long line is not broken at the console width (a "|" left at a line's end)
    console.print(_done_line(summary, root), highlight=False, soft_wrap=True)


@app.command()
def sft(config: Annotated[Path, typer.Argument(help="TOML config file with an [sft] path.")],
        set_: Annotated[list[str] | None, typer.Option("--set", help=SET_HELP)] = None):
    """Only the warm start ([sft]) into a new run directory, then one held-out evaluation;
    `rollwise train --resume DIR --set run.num_steps=N` continues it with RL."""
    overrides = [*(set_ or []), "run.num_steps=0", "eval.before=false"]
    try:
        if not load_config(config, overrides).sft.path:
            _fail(f"{config}: sft.path is not set; nothing to warm-start from")
    except ConfigError as e:
        _fail(str(e))
    train(config, overrides)


def _done_line(summary: dict, root: Path) -> str:
    """The last line of `rollwise train`: accuracy before -> after, time, where it all is."""
    before = summary.get("eval_before", {}).get("accuracy")
    after = summary["eval_after"]["accuracy"]
    change = f"{before:.1%} -> {after:.1%}" if before is not None else f"{after:.1%}"
    problems, steps = summary.get("health_problem_steps", 0), summary.get("steps", 0)
    # a GRPO step whose groups all have equal rewards is normal now and then; the final
    # line warns only when a quarter of the steps or more had a problem
    warn = (f" | WARNING: {problems} of {steps} steps learned nothing (see the step lines)"
            if problems and 4 * problems >= max(steps, 1) else "")
    return (f"[bold green]done[/]: held-out greedy accuracy {change} in "
            f"{summary['train_seconds']:.0f}s of training ({summary['steps']} steps) | "
            f"run: {root} | report: {summary['report']}{warn}")


def _open_run(config: Path | None, set_: list[str], resume: Path | None, allow_changes: bool):
    """The config, then `launch.open_run`: every check, the model, the run directory;
    (root, opened). Nothing on disk changes before the config has passed."""
    from rollwise.pipeline.launch import open_run

    if resume is not None:
        if not (resume / "config.toml").is_file():
            _fail(f"--resume {resume}: not a run directory (no config.toml)")
        cfg = load_config(config or resume / "config.toml", set_)
    else:
        if config is None:
            _fail("give a config file, e.g. rollwise train configs/tiny_arith.toml")
        cfg = load_config(config, set_)
    from rollwise.pipeline.launch import serve_learner_rank

    if serve_learner_rank(cfg):  # a torchrun rank other than 0: it served rank 0's learner
        raise typer.Exit(0)
    preload_allocator(cfg.run.allocator)  # may run this command again, with jemalloc
    opened = open_run(cfg, resume=resume, allow_changes=allow_changes,
                      echo=lambda s: console.print(s, highlight=False, soft_wrap=True),
                      warn=lambda s: console.print(s, style="yellow", highlight=False,
                                                   soft_wrap=True))
    return opened.root, opened


@app.command("eval")
def evaluate(target: Annotated[Path, typer.Argument(help="A config file or a run directory.")],
             set_: Annotated[list[str] | None, typer.Option("--set", help=SET_HELP)] = None):
    """Greedy accuracy (and pass@k if eval.pass_k > 0) on the held-out split."""
    result = _stages_to_evaluate(target, set_ or []).evaluate()
    _print_task_table(result)
    console.print_json(json.dumps(result))  # last, so the output ends with one JSON object


def _stages_to_evaluate(target: Path, set_: list[str]):
    """The stages built from a config, or from a run directory with its latest checkpoint
    loaded and published to the engine."""
    from rollwise.learner.checkpoint import list_checkpoints, load_checkpoint
    from rollwise.pipeline.build import build

    is_run = target.is_dir()
    try:
        cfg = load_config(target / "config.toml" if is_run else target, set_)
        preload_allocator(cfg.run.allocator)  # may run this command again, with jemalloc
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
        stages.engine.publish(stages.engine.version)  # a converted (engine.dtype) copy
        console.print(f"evaluating {found[-1]}")
    return stages


def _print_task_table(result: dict) -> None:
    """The held-out figures per task, one row each."""
    from rich.table import Table

    from rollwise.observe.metrics import task_table

    rows = task_table(result)
    table = Table(title="held-out evaluation by task")
    columns = list(dict.fromkeys(k for row in rows for k in row))
    for c in columns:
        table.add_column(c, justify="left" if c == "task" else "right")
    for row in rows:
        table.add_row(*[f"{row[c]:.3f}" if isinstance(row.get(c), float) and c != "n"
                        else str(row.get(c, "")) for c in columns])
    console.print(table)


@app.command()
def report(path: Annotated[Path, typer.Argument(help="A run directory or a benchmark JSON.")],
           compare: Annotated[list[Path] | None, typer.Option(
               "--compare", help="Other run directories to overlay with PATH (repeatable); "
               "writes compare.html (see --out).")] = None,
           out: Annotated[Path, typer.Option(help="Where --compare writes its page.")] = Path(
               "compare.html")):
    """Write the HTML report of a run directory or a benchmark JSON file, or (--compare) one
    page overlaying the accuracy and reward of several runs vs step and wall time."""
    if compare:
        console.print(f"comparison: {_write_comparison([path, *compare], out)}")
    else:
        console.print(f"report: {_write_report(path)}")


def _write_report(path: Path) -> Path:
    """A run directory's report.html, or a benchmark JSON's page; the page's path."""
    from rollwise.observe import write_bench_report, write_report

    if path.is_dir():
        return write_report(path)
    if path.suffix == ".json" and path.is_file():
        return write_bench_report(path)
    _fail(f"{path}: expected a run directory or a benchmark .json file")


def _write_comparison(runs: list[Path], out: Path) -> Path:
    """One page overlaying `runs` (run directories); its path."""
    from rollwise.observe.completions import write_compare

    missing = [r for r in runs if not (r / "metrics.jsonl").is_file()]
    if missing:
        _fail(f"{missing[0]}: not a run directory (no metrics.jsonl)")
    return write_compare(runs, out)


@app.command("export")
def export_model(run_dir: Annotated[Path, typer.Argument(help="A run directory.")],
                 out_dir: Annotated[Path, typer.Argument(help="A new folder to write.")],
                 step: Annotated[int | None, typer.Option(
                     help="The checkpoint's step (default: the latest).")] = None):
    """Write a run's model as a Hugging Face folder (config.json, safetensors, tokenizer,
    chat template; LoRA merged) that AutoModelForCausalLM.from_pretrained loads."""
    from rollwise.run.export import export

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
          max_num_seqs: Annotated[int | None, typer.Option(
              help="Sequences decoded at once (default: the native engine's, as "
              "engine.batch_size).")] = None,
          kv_budget_tokens: Annotated[int | None, typer.Option(
              help="KV cache size in tokens (default: the native engine's, as "
              "engine.kv_budget_tokens).")] = None,
          device: Annotated[str, typer.Option(help="Torch device: cpu, cuda or cuda:N.")
                            ] = "cpu",
          threads: Annotated[int, typer.Option(help="Torch CPU threads (0: cores free at start).")
                             ] = 0,
          served_model_name: Annotated[str | None, typer.Option(
              help="The model id clients see (the model's own name stays accepted).")] = None,
          tiny_context: Annotated[int | None, typer.Option(
              help="Model 'tiny' only: its context in tokens (default 512; 2048 fits a chat "
              "with tools).")] = None):
    """Serve a model over an OpenAI-compatible HTTP API (docs/serve.md)."""
    import uvicorn

    from rollwise.compose.preflight import require_device
    from rollwise.serve import Limits, make_server
    from rollwise.system.runtime import configure

    require_device(device)

    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        console.print(f"[bold yellow]warning:[/] serving on {host} without --api-key: anyone "
                      "who can reach this port can use the model", highlight=False)
    configure(threads)
    limits = Limits(max_body_bytes=max_body_bytes, max_tokens=max_tokens, max_n=max_n)
    try:
        server = make_server(model, step=step, dtype=dtype, api_key=api_key, limits=limits,
                             max_num_seqs=max_num_seqs, kv_budget_tokens=kv_budget_tokens,
                             device=device, served_model_name=served_model_name,
                             tiny_context=tiny_context)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        _fail(str(e))
    console.print(f"serving '{server.name}' (policy version {server.engine.version}) on "
                  f"http://{host}:{port}/v1" + (" (API key required)" if api_key else ""),
                  highlight=False)
    uvicorn.run(server.app, host=host, port=port, log_level="warning")


@app.command("serve-vllm")
def serve_vllm(model: Annotated[str, typer.Argument(
                   help="'tiny', 'smollm2-135m', a Hugging Face folder, or a run directory.")],
               port: Annotated[int, typer.Option(help="TCP port (localhost).")] = 8000,
               dtype: Annotated[str, typer.Option(
                   help="vLLM's precision: float32 (fastest on AVX2-only CPUs) or bfloat16.")
                   ] = "float32",
               eager: Annotated[bool, typer.Option(
                   help="--enforce-eager: start in ~30 s instead of ~100 s (torch.compile "
                   "at every start).")] = True,
               max_model_len: Annotated[int, typer.Option(
                   help="Longest sequence (0: the model's context, at most 4096).")] = 0,
               kv_gb: Annotated[int, typer.Option(help="KV cache space in whole GiB.")] = 1,
               cores: Annotated[str, typer.Option(
                   help="Cores the server's threads bind to, as vLLM writes them ('0-1'); "
                   "default: every core this process may use.")] = "",
               lora_rank: Annotated[int, typer.Option(
                   help="Serve LoRA adapters up to this rank, loaded at run time (the run's "
                   "model.lora_rank).")] = 0,
               served_model_name: Annotated[str, typer.Option(
                   help="The model id clients see.")] = "rollwise",
               folder: Annotated[str, typer.Option(
                   help="Where the served copy of the model is written (default: under the "
                   "rollwise cache).")] = "",
               wait_s: Annotated[float, typer.Option(
                   help="Seconds to wait for the server to answer /health.")] = 300.0):
    """Serve MODEL with the real vLLM (`make vllm` installs it) for engine.remote_kind =
    'vllm' (docs/remote.md): an untied copy of the model, the development routes of the
    weight sync, threads bound over all cores; waits for /health, then for the server."""
    from rollwise.serve.vllm import VLLMServer, VLLMUnavailable, prepare_folder, serve_until_stopped

    if dtype not in ("float32", "bfloat16", "float16"):
        _fail(f"--dtype {dtype}: expected float32, bfloat16 or float16")
    try:
        served = prepare_folder(model, folder or None, dtype=dtype)
        server = VLLMServer(served, port, name=served_model_name, dtype=dtype, eager=eager,
                            max_model_len=max_model_len, kv_gb=kv_gb, cores=cores,
                            lora_rank=lora_rank)
        console.print(f"starting vLLM on {served} ({dtype}{', eager' if eager else ''})",
                      highlight=False)
        server.start(wait_s)
    except (VLLMUnavailable, RuntimeError, ValueError, FileNotFoundError) as e:
        _fail(str(e))
    console.print(f"vLLM serving '{served_model_name}' on {server.url}/v1 (started in "
                  f"{server.started_s:.0f} s); train with --set engine.name=remote --set "
                  f"engine.remote_kind=vllm --set \"engine.remote_urls=['{server.url}']\"",
                  highlight=False)
    serve_until_stopped(server)


def main() -> None:
    """The console entry point: an operating-system failure anywhere (disk full, permission,
    a file in the way) is one line with what to do, not a traceback."""
    allow_rerun()
    try:
        app()
    except OSError as e:
        console.print(f"[bold red]error:[/] {os_error_message(e)}", highlight=False)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
