"""The `rollwise bench` command group. Each command: run, print a table, write --json."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rollwise.bench.common import print_table, write_results

bench_app = typer.Typer(add_completion=False, no_args_is_help=True,
                        help="Benchmarks: print a table, write --json and an HTML page.")
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Write results here (+ .html).")]
ModelOpt = Annotated[str, typer.Option(help="'tiny' or 'smollm2-135m'.")]
ThreadsOpt = Annotated[int, typer.Option(help="Torch CPU threads (0: cores free at start).")]
DeviceOpt = Annotated[str, typer.Option(help="Torch device: cpu, cuda or cuda:N.")]


def _say(message: str) -> None:
    typer.echo(f"  {message}", err=True)


@bench_app.command("rollout")
def rollout(model: ModelOpt = "tiny", json: JsonOpt = None,
            prompts: Annotated[int, typer.Option(help="Natural workload: prompts.")] = 16,
            n: Annotated[int, typer.Option(help="Samples per prompt.")] = 8,
            max_tokens: Annotated[int, typer.Option(help="Natural workload: max tokens.")] = 256,
            fixed_batch: Annotated[int, typer.Option(help="Fixed workload: sequences.")] = 64,
            fixed_tokens: Annotated[int, typer.Option(help="Fixed workload: tokens.")] = 64,
            reps: Annotated[int, typer.Option(help="Alternating repetitions per side.")] = 3,
            dtype: Annotated[list[str] | None, typer.Option(
                help="Native engine dtype: float32, bfloat16, int8 or auto (what training "
                "picks on this machine); repeatable: the precision axis; default float32.")] = None,
            workload: Annotated[list[str] | None, typer.Option(
                help="natural and/or fixed (repeatable; default both).")] = None,
            device: DeviceOpt = "cpu",
            step_mode: Annotated[list[str] | None, typer.Option(
                help="Decode step: auto (CUDA graphs on a GPU, eager on a CPU), eager, "
                "padded, graph, compile (torch.compile), rows (the general chunk pass); "
                "repeatable: one side each; default auto.")] = None,
            baseline: Annotated[bool, typer.Option(
                help="Time Hugging Face generate too (--no-baseline: native sides only).")
                ] = True,
            threads: ThreadsOpt = 0):
    """B1: native engine vs Hugging Face generate, tokens/s and roofline fraction."""
    from rollwise.bench import rollout as b1
    from rollwise.compose.preflight import require_device
    from rollwise.system.runtime import configure

    require_device(device)
    configure(threads)
    data = b1.run(model, prompts=prompts, n=n, max_tokens=max_tokens, fixed_batch=fixed_batch,
                  fixed_tokens=fixed_tokens, reps=reps, dtypes=tuple(dtype or ("float32",)),
                  device=device, step_modes=tuple(step_mode or ("auto",)), baseline=baseline,
                  workloads=tuple(workload or ("natural", "fixed")), progress=_say)
    print_table(f"B1 rollout throughput: {model}, {data['threads']} threads", data["results"],
                ["workload", "engine", "tokens_per_s", "wall_s", "generated_tokens",
                 "forward_passes", "decode_step_ms", "dispatches_per_step", "latency_p50_s",
                 "latency_p99_s", "slot_waste", "roofline", "decode_roofline"])
    if data.get("auto_dtype"):
        typer.echo(f"auto = {data['auto_dtype']} on this machine")
    for r in data["results"]:
        if r.get("dispatches"):
            busy = (f"; GPU busy {r['device_busy_frac']:.0%}" if "device_busy_frac" in r
                    else "")
            typer.echo(f"{r['engine']}: {r['dispatches_per_step']:.0f} {r['dispatches']} per "
                       f"decode step at batch {fixed_batch}; {r['decode_step_ms']:.2f} ms a "
                       f"step{busy}")
    for r in data["ratios"]:
        vs32 = (f"; / native float32 = {r['over_native_float32']:.2f}x"
                if "over_native_float32" in r else "")
        vs32 += "".join(f"; / {k[5:-5]} mode = {v:.2f}x" for k, v in r.items()
                        if k.startswith("over_") and k.endswith("_mode"))
        vs_hf = (f" / hf tokens/s = {r['native_over_hf_tokens_per_s']:.2f}x"
                 if "native_over_hf_tokens_per_s" in r else "")
        typer.echo(f"{r['workload']}: {r['engine']}{vs_hf}{vs32} (median of {reps})")
    c = data["checks"]
    for d in data["dtypes"]:
        typer.echo(f"checks {d}: greedy identical to float32 generate on "
                   f"{c[f'greedy_identical_{d}']:.0%} of {c['greedy_prompts']} prompts; |log-prob "
                   f"error| vs a {'float32' if d == 'int8' else d} forward: max {c[f'max_logprob_error_{d}']:.2e}, mean "
                   f"{c[f'mean_logprob_error_{d}']:.2e}; publish {data['publish_seconds'][d]:.3f}s")
    page = write_results(data, json)
    if page:
        typer.echo(f"wrote {json} and {page}")


@bench_app.command("reward")
def reward(json: JsonOpt = None,
           executions: Annotated[int, typer.Option(help="Programs per level and rep.")] = 40,
           reps: Annotated[int, typer.Option(help="Alternating repetitions.")] = 3,
           isolation: Annotated[list[str] | None, typer.Option(
               help="bwrap, unshare, landlock, rlimits (repeatable; default every one that works).")
           ] = None):
    """The code sandbox's cost per execution (pycode programs, every test passing)."""
    from rollwise.bench import reward as bench

    data = bench.run(executions=executions, reps=reps, levels=tuple(isolation or ()),
                     progress=_say)
    base = next(k for k in data["results"][0] if k.startswith("over_"))
    print_table(f"sandbox cost per execution (target mean <= {data['target_mean_ms']:g} ms)",
                data["results"], ["isolation", "mean_ms", "median_ms", "p95_ms", base,
                                  "executions", "tests", "passed", "default", "meets_target"])
    typer.echo(f"detected here: {data['detected']['isolation']}")
    page = write_results(data, json)
    if page:
        typer.echo(f"wrote {json} and {page}")


@bench_app.command("alloc")
def alloc(model: ModelOpt = "tiny", json: JsonOpt = None,
          allocator: Annotated[list[str] | None, typer.Option(
              help="Allocators to compare with uniform (repeatable; default all).")] = None,
          seeds: Annotated[int, typer.Option(help="Seeds per allocator (medians).")] = 1,
          steps: Annotated[int, typer.Option(help="Training steps per run.")] = 120,
          eval_every: Annotated[int, typer.Option(help="Held-out evaluation interval.")] = 10,
          target: Annotated[float | None, typer.Option(
              help="Target held-out accuracy (default: target-frac x uniform's best).")] = None,
          target_frac: Annotated[float, typer.Option(help="See --target.")] = 0.9,
          set_: Annotated[list[str] | None, typer.Option(
              "--set", help="Config override for every run, e.g. control.explore=0.25.")] = None,
          threads: ThreadsOpt = 1):
    """B4: rollouts, tokens and seconds to a target accuracy, per allocator vs uniform."""
    from rollwise.bench import alloc as b4
    from rollwise.control import ALLOCATORS

    unknown = [a for a in allocator or [] if a not in ALLOCATORS]
    if unknown:
        raise typer.BadParameter(f"unknown allocator {unknown[0]!r}; "
                                 f"available: {', '.join(ALLOCATORS)}")
    data = b4.run(model, allocators=tuple(allocator or b4.DEFAULT_ALLOCATORS),
                  seeds=tuple(range(seeds)), steps=steps, eval_every=eval_every, target=target,
                  target_frac=target_frac, extra=[f"run.threads={threads}", *(set_ or [])],
                  progress=_say)
    print_table(f"B4 allocation: {model}, target accuracy {data['target']:.3f}",
                data["allocators"],
                ["allocator", "rollouts_to_target", "rollouts_speedup", "tokens_to_target",
                 "seconds_to_target", "final_accuracy", "zero_adv_frac", "zero_adv_frac_trained",
                 "rollouts_per_step"])
    page = write_results(data, json)
    if page:
        typer.echo(f"wrote {json} and {page}")


@bench_app.command("agents")
def agents(model: ModelOpt = "tiny", json: JsonOpt = None,
           seeds: Annotated[int, typer.Option(help="Seeds (sides alternate per seed).")] = 2,
           steps: Annotated[int, typer.Option(help="Training steps per run.")] = 60,
           eval_every: Annotated[int, typer.Option(help="Held-out evaluation interval.")] = 5,
           target: Annotated[float | None, typer.Option(
               help="Target held-out success (default: target-frac x the best of both).")] = None,
           target_frac: Annotated[float, typer.Option(help="See --target.")] = 0.9,
           set_: Annotated[list[str] | None, typer.Option(
               "--set", help="Config override for every run.")] = None,
           threads: ThreadsOpt = 1):
    """Step-level credit: episodes to a target success on the guess game, GiGPO vs GRPO."""
    from rollwise.bench import agents as ba

    data = ba.run(model, seeds=tuple(range(seeds)), steps=steps, eval_every=eval_every,
                  target=target, target_frac=target_frac,
                  extra=[f"run.threads={threads}", *(set_ or [])], progress=_say)
    print_table(f"GiGPO vs GRPO on guess-the-number: {model}, targets "
                f"{data['targets_per_seed']}", data["estimators"],
                ["estimator", "per_seed_episodes_to_target", "per_seed_tokens_to_target",
                 "per_seed_seconds_to_target", "seeds_reaching_target", "final_success",
                 "best_success"])
    typer.echo(f"GRPO episodes / GiGPO episodes to target, per seed: "
               f"{data['grpo_over_gigpo_episodes']} (median "
               f"{data['median_grpo_over_gigpo_episodes']})")
    page = write_results(data, json)
    if page:
        typer.echo(f"wrote {json} and {page}")


@bench_app.command("episodes")
def episodes(config: Annotated[Path | None, typer.Argument(
                 help="An environment task's config (default: the tiny model's guess game).")] = None,
             json: JsonOpt = None,
             rounds: Annotated[int, typer.Option(help="Rounds; each runs both sides.")] = 3,
             prompts: Annotated[int, typer.Option(help="Prompts (groups) per round.")] = 8,
             set_: Annotated[list[str] | None, typer.Option(
                 "--set", help="Config override.")] = None,
             threads: ThreadsOpt = 1):
    """Multi-turn rollouts: the kept KV cache across turns vs recomputing the history."""
    from rollwise.bench import episodes as be

    overrides = [] if config else ["task.name='guess'", "task.options={high=8, max_guesses=4}",
                                   "episodes.max_turns=4", "rollout.max_tokens=4"]
    data = be.run(config, rounds=rounds, prompts=prompts, progress=_say,
                  overrides=[*overrides, f"run.threads={threads}", *(set_ or [])])
    print_table(f"Kept KV cache vs recomputed history: {data['model']}, {data['task']}, "
                f"{data['rollout_dtype']}", data["sides"],
                ["side", "episodes", "turns", "prompt_tokens", "prefill_tokens",
                 "kv_reused_tokens", "generated_tokens", "forward_passes", "median_seconds",
                 "median_prefill_seconds"])
    typer.echo(f"recomputed / kept wall time: {data['median_recomputed_over_kept_seconds']:.2f}x "
               f"(median of {rounds}); prefill time "
               f"{data['median_recomputed_over_kept_prefill_seconds']:.2f}x; same episodes "
               f"{data['same_episodes']}")
    page = write_results(data, json)
    if page:
        typer.echo(f"wrote {json} and {page}")


@bench_app.command("tail")
def tail(model: ModelOpt = "tiny", json: JsonOpt = None,
         groups: Annotated[int, typer.Option(help="Groups trained per step (target).")] = 32,
         n: Annotated[int, typer.Option(help="Samples per group.")] = 8,
         steps: Annotated[int, typer.Option(help="Steps per strategy.")] = 3,
         slots: Annotated[int, typer.Option(help="Sequences decoded at once.")] = 64,
         chunk_tokens: Annotated[int, typer.Option(help="Seer chunk size.")] = 16,
         reps: Annotated[int, typer.Option(help="Alternating repetitions.")] = 1,
         strategy: Annotated[list[str] | None, typer.Option(
             help="Strategies to run (repeatable; default all).")] = None,
         lenience: Annotated[float, typer.Option(
             help="spec-reuse-specrl: SPEC-RL lenience (1: none; e^0.5 = 1.65).")] = 1.0,
         shift_steps: Annotated[int, typer.Option(
             help="spec-reuse: optimizer steps that change the policy between epochs.")] = 4,
         device: DeviceOpt = "cpu", threads: ThreadsOpt = 0):
    """B2: rollout strategies on a long-tailed workload: tail time, tokens/s, forwards."""
    from rollwise.bench import tail as b2
    from rollwise.compose.preflight import require_device
    from rollwise.system.runtime import configure

    require_device(device)
    configure(threads)
    data = b2.run(model, groups=groups, n=n, steps=steps, slots=slots,
                  chunk_tokens=chunk_tokens, reps=reps,
                  strategies=tuple(strategy or b2.STRATEGIES), lenience=lenience,
                  shift_steps=shift_steps, device=device, progress=_say)
    print_table(f"B2 long tail: {model}, {groups} groups x {n} per step, {slots} slots",
                data["strategies"],
                ["strategy", "tokens_per_s", "makespan_s", "tail_time_s", "tail_vs_sync",
                 "tokens_per_s_vs_sync", "forward_passes_per_token", "row_forwards_per_token",
                 "mean_accepted_len", "offpolicy_token_frac", "mean_trained_len"])
    page = write_results(data, json)
    if page:
        typer.echo(f"wrote {json} and {page}")


@bench_app.command("e2e")
def e2e(configs: Annotated[list[Path] | None, typer.Argument(
            help="Training configs (default: configs/tiny_arith.toml configs/quickstart.toml).")
        ] = None,
        json: JsonOpt = None,
        part: Annotated[list[str] | None, typer.Option(
            help="steps and/or accuracy (repeatable; default both).")] = None,
        steps: Annotated[int, typer.Option(help="Steps part: measured steps per variant.")] = 5,
        warmup: Annotated[int, typer.Option(help="Steps part: warm-up steps dropped.")] = 1,
        accuracy_steps: Annotated[int | None, typer.Option(
            help="Accuracy part: training steps (default: the config's).")] = None,
        eval_every: Annotated[int | None, typer.Option(
            help="Accuracy part: evaluation interval (default: the config's).")] = None,
        target: Annotated[float | None, typer.Option(
            help="Target held-out accuracy (default: target-frac x baseline's best).")] = None,
        target_frac: Annotated[float, typer.Option(help="See --target.")] = 0.9,
        set_: Annotated[list[str] | None, typer.Option(
            "--set", help="Config override for every variant, e.g. run.threads=1.")] = None,
        baseline_set: Annotated[list[str] | None, typer.Option(
            help="Overrides of the baseline variant (default: hf engine, no zero-advantage "
            "skip, float32 learner).")] = None,
        best_set: Annotated[list[str] | None, typer.Option(
            help="Overrides of the best variant (default: none, the config as shipped).")] = None,
        precision: Annotated[bool, typer.Option(
            "--precision", help="Compare float32 with bfloat16 rollouts + bfloat16 learner + "
            "TIS instead of baseline/best (docs/precision.md).")] = False,
        vs: Annotated[str | None, typer.Option(
            help="'trl': TRL's GRPOTrainer alongside, step for step (needs TRL).")] = None,
        trl_set: Annotated[list[str] | None, typer.Option(
            help="GRPOConfig field for the TRL side, e.g. gradient_checkpointing=true.")] = None,
        no_baseline: Annotated[bool, typer.Option(
            "--no-baseline", help="Run only the best variant (e.g. against TRL alone).")] = False):
    """B3: step time split (rollout/reward/train/other) and time to a target accuracy."""
    from rollwise.bench import e2e as b3
    from rollwise.compose.config import parse_value

    if vs not in (None, "trl"):
        raise typer.BadParameter(f"--vs {vs!r}: only 'trl' is supported")
    parts = tuple(part or ("steps", "accuracy"))
    bad = [p for p in parts if p not in ("steps", "accuracy")]
    if bad:
        raise typer.BadParameter(f"--part {bad[0]!r}: use steps or accuracy")
    variants = {"baseline": tuple(baseline_set) if baseline_set is not None else b3.BASELINE,
                "best": tuple(best_set or ())}
    if precision:
        variants = dict(b3.PRECISIONS)
    elif no_baseline:
        variants.pop("baseline")
    trl_options = {k.strip(): parse_value(v.strip())
                   for k, v in (item.split("=", 1) for item in trl_set or [])}
    paths = configs or [Path("configs/tiny_arith.toml"), Path("configs/quickstart.toml")]
    data = b3.run(paths, parts=parts, variants=variants, steps=steps, warmup=warmup,
                  accuracy_steps=accuracy_steps, eval_every=eval_every, target=target,
                  target_frac=target_frac, extra=list(set_ or []), vs_trl=vs == "trl",
                  trl_options=trl_options, progress=_say)
    for s in data["step_split"]:
        print_table(f"B3 step time: {s['config']} (median of {steps} steps)", s["variants"],
                    ["variant", "step_s", "rollout_s", "reward_s", "train_s", "other_s",
                     "tokens_per_step", "rows_trained_per_step", "rows_skipped_per_step"])
        for name, r in s["ratios"].items():
            typer.echo(f"{name}: " + ", ".join(
                f"{k} {v['median']:.2f}x ({v['min']:.2f}-{v['max']:.2f})"
                for k, v in r.items() if v))
    for a in data["time_to_accuracy"]:
        print_table(f"B3 time to {a['target']:.3f} held-out accuracy: {a['config']}",
                    a["variants"], ["variant", "accuracy_before", "final_accuracy",
                                    "best_accuracy", "seconds_to_target", "rollouts_to_target",
                                    "tokens_to_target", "seconds_speedup", "train_seconds"])
    page = write_results(data, json)
    if page:
        typer.echo(f"wrote {json} and {page}")


@bench_app.command("async")
def async_(configs: Annotated[list[Path] | None, typer.Argument(
               help="Training configs (default: configs/tiny_arith.toml configs/quickstart.toml).")
           ] = None,
           json: JsonOpt = None,
           steps: Annotated[int, typer.Option(help="Training steps per variant.")] = 6,
           warmup: Annotated[int, typer.Option(help="Warm-up steps left out of medians.")] = 1,
           variant: Annotated[list[str] | None, typer.Option(
               help="Variants (repeatable; default all): local-sync, ray-sync, ray-async-1, "
               "ray-async-2.")] = None,
           cpus: Annotated[int, typer.Option(
               help="CPUs of the local Ray cluster (0: the cores this process may use).")] = 0,
           set_: Annotated[list[str] | None, typer.Option(
               "--set", help="Config override for every variant, e.g. run.threads=1.")] = None):
    """Sync vs async (staleness 1 and 2) on Ray, and local: step time, busy fractions,
    staleness, held-out accuracy; the overlap and Ray-overhead ratios."""
    from rollwise.bench import overlap

    names = tuple(variant or overlap.VARIANTS)
    bad = [v for v in names if v not in overlap.VARIANTS]
    if bad:
        raise typer.BadParameter(f"unknown variant {bad[0]!r}; known: "
                                 f"{', '.join(overlap.VARIANTS)}")
    paths = configs or [Path("configs/tiny_arith.toml"), Path("configs/quickstart.toml")]
    data = overlap.run(paths, variants={n: overlap.VARIANTS[n] for n in names}, steps=steps,
                       warmup=warmup, extra=list(set_ or []), num_cpus=cpus or None,
                       progress=_say)
    for r in data["results"]:
        print_table(f"async: {r['config']} ({steps} steps, {warmup} warm-up)", r["variants"],
                    ["variant", "step_s", "rollout_s", "train_s", "wait_s", "rollout_busy",
                     "learner_busy", "stale_frac", "stale_dropped", "trajectories", "tokens",
                     "accuracy"])
        typer.echo(", ".join(f"{k} {v:.3f}" for k, v in r["derived"].items()))
    page = write_results(data, json)
    if page:
        typer.echo(f"wrote {json} and {page}")


@bench_app.command("compare")
def compare(runs: Annotated[list[Path], typer.Argument(help="Finished run directories.")],
            json: JsonOpt = None):
    """Runs side by side: accuracy, time split, mismatch metrics, curves in one page."""
    from rollwise.bench.e2e import compare_runs

    data = compare_runs(runs)
    print_table("runs compared", data["runs"],
                ["run", "accuracy_before", "accuracy_after", "best_accuracy", "train_seconds",
                 "rollout_s", "train_s", "publish_s", "kl", "weight_mean", "clipped_frac"])
    page = write_results(data, json)
    if page:
        typer.echo(f"wrote {json} and {page}")


@bench_app.command("learner")
def learner(model: ModelOpt = "smollm2-135m", json: JsonOpt = None,
            reps: Annotated[int, typer.Option(help="Alternating repetitions.")] = 3,
            threads: ThreadsOpt = 0,
            variant: Annotated[list[str] | None, typer.Option(
                help="Variants to time (repeatable; default all): float32, float32-unshared, "
                "float32+tis, bf16-autocast, bf16-autocast+tis.")] = None,
            device: DeviceOpt = "cpu"):
    """One learner update on a fixed batch: float32 vs bfloat16 autocast (+ TIS), prompts
    shared or not."""
    from rollwise.bench import learner as bl
    from rollwise.compose.preflight import require_device
    from rollwise.system.runtime import configure

    require_device(device)
    configure(threads)
    variants = tuple(variant or bl.VARIANTS)
    bad = [v for v in variants if v not in bl.VARIANTS]
    if bad:
        raise typer.BadParameter(f"unknown variant(s) {bad}; known: {', '.join(bl.VARIANTS)}")
    data = bl.run(model, reps=reps, variants=variants, device=device, progress=_say)
    print_table(f"learner update: {model}, {data['rows']} rows, {data['tokens']} tokens, "
                f"{data['threads']} threads", data["variants"],
                ["variant", "update_s", "min_s", "max_s", "speedup_vs_float32", "peak_rss_mb",
                 "added_rss_mb"])
    print_table("peak resident set per phase (MiB)", data["phases"],
                ["phase", "peak_rss_mb", "added_rss_mb"])
    page = write_results(data, json)
    if page:
        typer.echo(f"wrote {json} and {page}")


@bench_app.command("memory")
def memory(json: JsonOpt = None,
           shape: Annotated[list[str] | None, typer.Option(
               help="Model shapes of configs/shapes (repeatable; default smollm2-135m, "
               "qwen2-0.5b, qwen2-1.5b).")] = None,
           kind: Annotated[list[str] | None, typer.Option(
               help="full and/or lora (repeatable; default both).")] = None,
           precision: Annotated[str, typer.Option(
               help="Learner precision: float32 or bf16-autocast.")] = "float32",
           checkpointing: Annotated[bool, typer.Option(
               help="learner.activation_checkpointing.")] = False,
           response_len: Annotated[int, typer.Option(help="Response tokens per row.")] = 64,
           steps: Annotated[int, typer.Option(help="Updates per case (>= 2).")] = 2,
           threads: ThreadsOpt = 0):
    """Peak resident set and update time of random-init models of real shapes, full
    fine-tuning and LoRA, each case in its own process."""
    from rollwise.bench import memory as bm
    from rollwise.system.runtime import configure

    threads = configure(threads)
    bad = [k for k in kind or [] if k not in ("full", "lora")]
    if bad:
        raise typer.BadParameter(f"unknown kind(s) {bad}; known: full, lora")
    data = bm.run(tuple(shape or ("smollm2-135m", "qwen2-0.5b", "qwen2-1.5b")),
                  tuple(kind or ("full", "lora")), progress=_say, precision=precision,
                  checkpointing=checkpointing, response_len=response_len, steps=steps,
                  threads=threads)
    for row in data["rows"]:
        row["peak_rss_gib"] = row["peak_rss_mb"] / 1024 if "peak_rss_mb" in row else None
    print_table(f"learner memory: {precision}, {threads} threads", data["rows"],
                ["shape", "kind", "params_m", "trained_m", "tokens", "peak_rss_gib",
                 "weights_mb", "grads_mb", "adamw_mb", "update_s", "error"])
    page = write_results(data, json)
    if page:
        typer.echo(f"wrote {json} and {page}")


@bench_app.command("probe")
def probe(model: Annotated[str, typer.Option(help="A model name or folder: its shapes are "
                                             "timed.")] = "smollm2-135m",
          threads: ThreadsOpt = 0):
    """Measure this CPU's speed per precision again on a model's shapes, replace the cached
    probe, and print what `auto` picks (docs/precision.md)."""
    from rollwise.compose import precision as P
    from rollwise.models import load_policy
    from rollwise.system.runtime import configure

    threads = configure(threads)
    shapes = P.ModelShapes.of(load_policy(model).model)
    found = P.probe(shapes, threads=threads, fresh=True)
    rollout, learner = P.choose(found) if shapes.hidden >= P.MIN_HIDDEN else (
        "float32", "float32")  # as `auto` decides for narrow models
    auto = {"rollout": "auto", "learner": "auto", "correction": "auto"}
    typer.echo(P.PrecisionChoice(rollout, learner, P.default_correction(rollout, learner), auto,
                                 found).line())


@bench_app.command("serve")
def serve(model: ModelOpt = "tiny", json: JsonOpt = None,
          prompts: Annotated[int, typer.Option(help="Prompts per side and repetition.")] = 32,
          clients: Annotated[list[int] | None, typer.Option(
              help="Concurrent openai clients (repeatable; default 8 and 32).")] = None,
          max_tokens: Annotated[int, typer.Option(help="Tokens per request.")] = 64,
          reps: Annotated[int, typer.Option(help="Alternating repetitions.")] = 3,
          natural: Annotated[bool, typer.Option(
              "--natural", help="Let EOS end requests (default: exactly max_tokens each).")
              ] = False,
          device: DeviceOpt = "cpu", threads: ThreadsOpt = 0):
    """The OpenAI-compatible server vs the engine's own generate: requests/s, tokens/s."""
    from rollwise.bench import serve as bs
    from rollwise.compose.preflight import require_device
    from rollwise.system.runtime import configure

    require_device(device)
    configure(threads)
    data = bs.run(model, prompts=prompts, clients=tuple(clients or (8, 32)),
                  max_tokens=max_tokens, reps=reps, ignore_eos=not natural, device=device,
                  progress=_say)
    print_table(f"serve: {model}, {prompts} prompts x {max_tokens} tokens, "
                f"{data['threads']} threads (median of {reps})", data["results"],
                ["side", "clients", "requests_per_s", "tokens_per_s", "wall_s", "tokens",
                 "forward_passes", "rows_per_pass", "errors"])
    for r in data["ratios"]:
        typer.echo(f"{r['clients']} clients: server / engine tokens/s = "
                   f"{r['server_over_engine_tokens_per_s']:.2f}x (median of {len(r['per_rep'])})")
    page = write_results(data, json)
    if page:
        typer.echo(f"wrote {json} and {page}")
