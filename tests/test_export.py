"""`rollwise export`: the trained model loads with plain transformers and writes what the run's
own greedy evaluation writes; `report --compare` and the report's completions view."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from rollwise.cli import app
from rollwise.compose.config import to_toml
from rollwise.engine.base import SamplingParams
from rollwise.learner.checkpoint import list_checkpoints, load_checkpoint
from rollwise.pipeline.build import build
from rollwise.pipeline.loop import train
from rollwise.rollout import generate_groups
from rollwise.run.export import export
from rollwise.run.rundir import Run
from test_runsafety import small


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A 3-step tiny run (float32 rollouts, so the engine and transformers compute alike)."""
    tmp = tmp_path_factory.mktemp("export")
    cfg = small(tmp, "run.num_steps=3", "engine.dtype='float32'", "run.checkpoint_every=2",
                "run.keep_checkpoints=3", "eval.num_prompts=8")
    root = tmp / "run"
    train(build(cfg), Run(root, resume=False, config_toml=to_toml(cfg), echo=lambda s: None,
                          keep_checkpoints=3), 3, checkpoint_every=2)
    return cfg, root


def test_exported_model_loads_and_writes_the_runs_greedy_outputs(trained_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg, root = trained_run
    out = CliRunner().invoke(app, ["export", str(root), str(tmp_path / "hf")])
    assert out.exit_code == 0, out.output
    names = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")

    stages = build(cfg)  # the run's own evaluation path: its engine, greedy, from step 3
    load_checkpoint(list_checkpoints(root / "checkpoints")[-1], stages.model)
    stages.engine.publish(stages.engine.version)
    prompts = stages.evaluator.prompts[:8]
    groups = generate_groups(stages.evaluator.engine, prompts, SamplingParams(
        n=1, temperature=0.0, max_tokens=cfg.rollout.max_tokens), stages.policy.decode)
    for (_, ids), group in zip(prompts, groups):
        with torch.no_grad():
            got = model.generate(torch.tensor([ids]), do_sample=False,
                                 max_new_tokens=cfg.rollout.max_tokens,
                                 eos_token_id=stages.policy.stop_ids,
                                 pad_token_id=tokenizer.pad_token_id)
        text = tokenizer.decode(got[0, len(ids):], skip_special_tokens=True)
        assert text == group.trajectories[0].text


def test_export_of_an_earlier_step_differs_and_a_missing_step_is_named(trained_run, tmp_path):
    _, root = trained_run
    export(root, tmp_path / "a", step=2)
    export(root, tmp_path / "b")
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "a/model.safetensors"), load_file(tmp_path / "b/model.safetensors")
    assert a.keys() == b.keys() and any(not torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="no checkpoint of step 1 .kept: 2, 3"):
        export(root, tmp_path / "c", step=1)


def test_report_shows_completions_and_compare_overlays_runs(trained_run, tmp_path):
    from rollwise.observe import write_report

    _, root = trained_run
    page = write_report(root).read_text()
    assert "<h2>Completions</h2>" in page and "<h3>step 1</h3>" in page
    assert "<h3>step 3</h3>" in page and "advantage" in page
    out = CliRunner().invoke(app, ["report", str(root), "--compare", str(root),
                                   "--out", str(tmp_path / "c.html")])
    assert out.exit_code == 0, out.output
    html = (tmp_path / "c.html").read_text()
    assert "2 runs compared" in html and html.count("<img") == 4
    bad = CliRunner().invoke(app, ["report", str(root), "--compare", str(tmp_path)])
    assert bad.exit_code == 2 and "not a run directory" in bad.output


def test_a_run_trained_on_a_gpu_exports_and_serves_on_a_cpu(trained_run, tmp_path):
    """A run directory that says run.device = 'cuda' (as a GPU run's does) loads on a machine
    without one: export and serve build the model on the CPU from its safetensors."""
    import shutil

    from rollwise.serve.model import load_served

    _, root = trained_run
    gpu_run = tmp_path / "gpu_run"
    shutil.copytree(root, gpu_run)
    text = (gpu_run / "config.toml").read_text()
    assert 'device = "cpu"' in text
    (gpu_run / "config.toml").write_text(text.replace('device = "cpu"', 'device = "cuda"'))
    export(gpu_run, tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    served = load_served(str(gpu_run))
    assert next(served.policy.model.parameters()).device.type == "cpu"
