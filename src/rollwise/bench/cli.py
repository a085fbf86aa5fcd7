"""The `rollwise bench` command group: each command declares its options and calls its bench
module's `command`, which runs, prints the tables and writes --json (`probe` calls
`compose.precision`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rollwise.bench.tree import command as tree_command

bench_app = typer.Typer(add_completion=False, no_args_is_help=True,
                        help="Benchmarks: print a table, write --json and an HTML page.")
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Write results here (+ .html).")]
ModelOpt = Annotated[str, typer.Option(help="'tiny' or 'smollm2-135m'.")]
ThreadsOpt = Annotated[int, typer.Option(help="Torch CPU threads (0: cores free at start).")]
DeviceOpt = Annotated[str, typer.Option(help="Torch device: cpu, cuda or cuda:N.")]


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

    b1.command(model=model, json=json, prompts=prompts, n=n, max_tokens=max_tokens,
               fixed_batch=fixed_batch, fixed_tokens=fixed_tokens, reps=reps, dtype=dtype,
               workload=workload, device=device, step_mode=step_mode, baseline=baseline,
               threads=threads)


@bench_app.command("reward")
def reward(json: JsonOpt = None,
           executions: Annotated[int, typer.Option(help="Programs per level and rep.")] = 40,
           reps: Annotated[int, typer.Option(help="Alternating repetitions.")] = 3,
           isolation: Annotated[list[str] | None, typer.Option(
               help="bwrap, unshare, landlock, rlimits (repeatable; default every one that works).")
           ] = None):
    """The code sandbox's cost per execution (pycode programs, every test passing)."""
    from rollwise.bench import reward as bench

    bench.command(json=json, executions=executions, reps=reps, isolation=isolation)


@bench_app.command("alloc")
def alloc(model: ModelOpt = "tiny", json: JsonOpt = None,
          allocator: Annotated[list[str] | None, typer.Option(
              help="Allocators to compare with uniform, alone or with options, e.g. "
              "aero:n0=2,max_n=8 (repeatable; default all).")] = None,
          seeds: Annotated[int, typer.Option(help="Seeds per allocator (medians).")] = 1,
          steps: Annotated[int, typer.Option(help="Training steps per run.")] = 120,
          eval_every: Annotated[int, typer.Option(help="Held-out evaluation interval.")] = 5,
          target: Annotated[float | None, typer.Option(
              help="Target held-out accuracy (default: target-frac x uniform's best).")] = None,
          target_frac: Annotated[float, typer.Option(help="See --target.")] = 0.9,
          train_prompts: Annotated[int, typer.Option(
              help="Training prompts (an epoch every pool/16 steps).")] = 512,
          eval_prompts: Annotated[int, typer.Option(help="Held-out prompts.")] = 400,
          smooth: Annotated[int, typer.Option(
              help="The target is crossed when the mean of this many evaluations reaches it "
              "(1: the first evaluation above it).")] = 3,
          set_: Annotated[list[str] | None, typer.Option(
              "--set", help="Config override for every run, e.g. control.explore=0.25.")] = None,
          threads: ThreadsOpt = 1):
    """B4: rollouts, tokens and seconds to a target accuracy, per allocator vs uniform."""
    from rollwise.bench import alloc as b4

    b4.command(model=model, json=json, allocator=allocator, seeds=seeds, steps=steps,
               eval_every=eval_every, target=target, target_frac=target_frac, set_=set_,
               threads=threads, train_prompts=train_prompts, eval_prompts=eval_prompts,
               smooth=smooth)


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

    ba.command(model=model, json=json, seeds=seeds, steps=steps, eval_every=eval_every,
               target=target, target_frac=target_frac, set_=set_, threads=threads)


@bench_app.command("episodes")
def episodes(config: Annotated[Path | None, typer.Argument(
                 help="An environment task's config (default: the tiny model's guess game).")
             ] = None,
             json: JsonOpt = None,
             rounds: Annotated[int, typer.Option(help="Rounds; each runs both sides.")] = 3,
             prompts: Annotated[int, typer.Option(help="Prompts (groups) per round.")] = 8,
             set_: Annotated[list[str] | None, typer.Option(
                 "--set", help="Config override.")] = None,
             threads: ThreadsOpt = 1):
    """Multi-turn rollouts: the kept KV cache across turns vs recomputing the history."""
    from rollwise.bench import episodes as be

    be.command(config=config, json=json, rounds=rounds, prompts=prompts, set_=set_, threads=threads)


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

    b2.command(model=model, json=json, groups=groups, n=n, steps=steps, slots=slots,
               chunk_tokens=chunk_tokens, reps=reps, strategy=strategy, lenience=lenience,
               shift_steps=shift_steps, device=device, threads=threads)


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

    b3.command(configs=configs, json=json, part=part, steps=steps, warmup=warmup,
               accuracy_steps=accuracy_steps, eval_every=eval_every, target=target,
               target_frac=target_frac, set_=set_, baseline_set=baseline_set, best_set=best_set,
               precision=precision, vs=vs, trl_set=trl_set, no_baseline=no_baseline)


@bench_app.command("async")
def async_(configs: Annotated[list[Path] | None, typer.Argument(
               help="Training configs (default: configs/tiny_arith.toml configs/quickstart.toml).")
           ] = None,
           json: JsonOpt = None,
           steps: Annotated[int, typer.Option(help="Training steps per variant.")] = 6,
           warmup: Annotated[int, typer.Option(help="Warm-up steps left out of medians.")] = 1,
           variant: Annotated[list[str] | None, typer.Option(
               help="Variants (repeatable; default all): local-sync, local-async-1, ray-sync, "
               "ray-async-1, ray-async-2, remote-sync, remote-async-1 (remote: against a "
               "`rollwise serve` process the bench starts).")] = None,
           cpus: Annotated[int, typer.Option(
               help="CPUs of the local Ray cluster (0: the cores this process may use).")] = 0,
           set_: Annotated[list[str] | None, typer.Option(
               "--set", help="Config override for every variant, e.g. run.threads=1.")] = None):
    """Sync vs async (staleness 1 and 2), local, on Ray, on a server: step time, busy
    fractions, staleness, held-out accuracy; the overlap and Ray-overhead ratios."""
    from rollwise.bench import overlap

    overlap.command(configs=configs, json=json, steps=steps, warmup=warmup, variant=variant,
                    cpus=cpus, set_=set_)


@bench_app.command("compare")
def compare(runs: Annotated[list[Path], typer.Argument(help="Finished run directories.")],
            json: JsonOpt = None):
    """Runs side by side: accuracy, time split, mismatch metrics, curves in one page."""
    from rollwise.bench import e2e

    e2e.compare_command(runs=runs, json=json)


@bench_app.command("learner")
def learner(model: ModelOpt = "smollm2-135m", json: JsonOpt = None,
            reps: Annotated[int, typer.Option(help="Alternating repetitions.")] = 3,
            threads: ThreadsOpt = 0,
            variant: Annotated[list[str] | None, typer.Option(
                help="Variants to time (repeatable; default: float32, float32-unshared, "
                "float32+tis, bf16-autocast, bf16-autocast+tis; with --prompt-tokens: "
                "float32-unshared, float32, and both +ckpt).")] = None,
            device: DeviceOpt = "cpu",
            shards: Annotated[list[int] | None, typer.Option(
                "--shards", help="Compare the learner over these numbers of FSDP2 ranks "
                "(repeatable: --shards 1 --shards 2): per-rank bytes, update and publication "
                "time (docs/scaling.md).")] = None,
            engine_dtype: Annotated[str, typer.Option(
                help="With --shards: the rollout engine's dtype the publication installs "
                "into (float32, bfloat16, int8).")] = "float32",
            prompt_tokens: Annotated[int, typer.Option(
                help="Make every prompt this many tokens (filler before the question): the "
                "long-prompt workload, e.g. --prompt-tokens 512 --max-tokens 64.")] = 0,
            max_tokens: Annotated[int, typer.Option(
                help="Most tokens a sampled response has.")] = 64,
            prompts: Annotated[int, typer.Option(
                help="Prompts in the batch (each sampled 8 times).")] = 4,
            flops: Annotated[bool, typer.Option(
                help="Count each variant's FLOPs in one more update.")] = True):
    """One learner update on a fixed batch: float32 vs bfloat16 autocast (+ TIS), prompts
    shared or not; with --shards, one process against N ranks."""
    if shards:
        from rollwise.bench import shards as bs

        bs.command(model=model, json=json, reps=reps, threads=threads, shards=shards,
                   engine_dtype=engine_dtype)
        return
    from rollwise.bench import learner as bl

    bl.command(model=model, json=json, reps=reps, threads=threads, variant=variant, device=device,
               prompt_tokens=prompt_tokens, max_tokens=max_tokens, flops=flops, prompts=prompts)


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
           allocator: Annotated[str, typer.Option(
               help="run.allocator of each case (reuse, jemalloc, compact), or system: "
               "glibc's own settings.")] = "reuse",
           threads: ThreadsOpt = 0):
    """Peak resident set and update time of random-init models of real shapes, full
    fine-tuning and LoRA, each case in its own process."""
    from rollwise.bench import memory as bm

    bm.command(json=json, shape=shape, kind=kind, precision=precision, checkpointing=checkpointing,
               response_len=response_len, steps=steps, threads=threads, allocator=allocator)


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

    bs.command(model=model, json=json, prompts=prompts, clients=clients, max_tokens=max_tokens,
               reps=reps, natural=natural, device=device, threads=threads)

@bench_app.command("sync")
def sync(config: Annotated[Path | None, typer.Argument(
             help="Training config: model, threads, engine.remote_* (default "
             "configs/quickstart.toml).")] = None,
         json: JsonOpt = None,
         dtype: Annotated[list[str] | None, typer.Option(
             help="The server's --dtype (repeatable; default bfloat16).")] = None,
         file_dtype: Annotated[list[str] | None, typer.Option(
             help="server (the precision the server says) and/or float32 (repeatable; "
             "default server).")] = None,
         syncs: Annotated[int, typer.Option(help="Syncs timed per variant, after the "
                                            "first publication.")] = 12,
         set_: Annotated[list[str] | None, typer.Option(
             "--set", help="Config override, e.g. run.threads=1.")] = None):
    """Weight sync to a local `rollwise serve`: trainer write, server read, write into the
    model, conversion, per phase; median, p90, max."""
    from rollwise.bench import sync as bs

    bs.command(config=config, json=json, dtype=dtype, file_dtype=file_dtype, syncs=syncs,
               set_=set_)

@bench_app.command("remote")
def remote(config: Annotated[Path | None, typer.Argument(
               help="Training config (default configs/quickstart.toml).")] = None,
           json: JsonOpt = None,
           steps: Annotated[int, typer.Option(help="Training steps per side.")] = 20,
           side: Annotated[list[str] | None, typer.Option(
               help="in-process, rollwise-serve and/or vllm (repeatable; default all).")
               ] = None,
           vllm_dtype: Annotated[str, typer.Option(
               help="vLLM's precision (float32: the fast one on AVX2-only CPUs).")
               ] = "float32",
           out: Annotated[Path, typer.Option(help="Where the runs are written.")
                          ] = Path("bench_results/remote"),
           set_: Annotated[list[str] | None, typer.Option(
               "--set", help="Config override for every side, e.g. run.seed=1.")] = None):
    """One config in process, against `rollwise serve` and against vLLM: step time, rollout
    tokens/s, weight sync per version, server start-up, accuracy (docs/remote.md)."""
    from rollwise.bench import remote as br

    try:
        br.command(config=config, json=json, steps=steps, sides=side, set_=set_,
                   vllm_dtype=vllm_dtype, out=out)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


bench_app.command("tree")(tree_command)  # B-tree: its options are declared in bench/tree.py
