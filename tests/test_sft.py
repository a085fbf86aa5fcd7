"""The supervised warm start ([sft]) on the built-in tiny model: the demonstrations are
learned (loss falls, the greedy turn reproduces the demonstrated tool call), only assistant
tokens are in the loss, a malformed line names file and line, and a resumed run does not
redo the warm start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rollwise.compose.config import ConfigError, load_config, to_toml
from rollwise.compose.preflight import check_config
from rollwise.envs.render import TurnRenderer
from rollwise.learner.sft import (
    DemonstrationError,
    SftSettings,
    encode_demonstration,
    read_demonstrations,
    sft_loss,
    train_sft,
)
from rollwise.models import load_policy
from rollwise.pipeline.build import build
from rollwise.pipeline.loop import train
from rollwise.run.rundir import Run
from test_cli import ROOT, rollwise

TINY = {"hidden": 64, "layers": 2}


def _demo(a: int, b: int) -> dict:
    return {"messages": [
        {"role": "user", "content": f"{a}+{b}=?"},
        {"role": "assistant", "content": f"<tool_call>calc({a}+{b})</tool_call>"},
        {"role": "tool", "content": f"calc({a}+{b}) = {a + b}"},
        {"role": "assistant", "content": f"#### {a + b}"}]}


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _encoded(policy, path: Path):
    renderer = TurnRenderer(policy.tokenizer, policy.chat, policy.stop_ids)
    return [encode_demonstration(m, policy, renderer.observation_ids)
            for m in read_demonstrations(path)]


@torch.no_grad()
def _greedy(model, ids: list[int], stop: int, limit: int = 40) -> list[int]:
    out: list[int] = []
    while len(out) < limit:
        nxt = int(model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax())
        out.append(nxt)
        if nxt == stop:
            break
    return out


def test_loss_falls_and_the_greedy_turn_is_the_demonstrated_call(tmp_path):
    torch.manual_seed(0)
    policy = load_policy("tiny", tiny=TINY)
    path = _write(tmp_path / "demos.jsonl", [_demo(12, 30), _demo(7, 41)])
    rows = _encoded(policy, path)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    records: list[dict] = []
    figures = train_sft(policy.model, rows, policy.tokenizer.pad_token_id,
                        SftSettings(steps=80, lr=3e-3, batch_size=2, log_every=10), records.append)
    assert figures["steps"] == 80 and len(records) == 8
    assert records[-1]["loss"] < records[0]["loss"] / 5, records
    assert records[-1]["token_accuracy"] > 0.9
    assert all(not torch.equal(before[n], p) for n, p in policy.model.named_parameters())
    prompt = policy.encode("12+30=?")
    turn = _greedy(policy.model, prompt, policy.tokenizer.eos_token_id)
    assert policy.decode(turn) == "<tool_call>calc(12+30)</tool_call>"


def test_only_assistant_tokens_are_in_the_loss(tmp_path):
    policy = load_policy("tiny", tiny=TINY)
    path = _write(tmp_path / "demos.jsonl", [_demo(2, 3)])
    [(ids, mask)] = _encoded(policy, path)
    eos = policy.tokenizer.eos_token_id
    learned = [i for i, m in zip(ids, mask) if m]
    assert policy.decode(learned) == "<tool_call>calc(2+3)</tool_call>#### 5"
    assert learned.count(eos) == 2  # each turn's stop token is learned too
    assert policy.decode(ids).count("calc(2+3) = 5") == 1  # the observation, not learned
    loss, tokens, _ = sft_loss(policy.model, [(ids, mask)], policy.tokenizer.pad_token_id)
    with torch.no_grad():
        logp = torch.log_softmax(policy.model(input_ids=torch.tensor([ids])).logits[0, :-1], -1)
    picked = [-logp[t - 1, ids[t]] for t in range(1, len(ids)) if mask[t]]
    assert tokens == len(picked) == len(learned)
    assert torch.allclose(loss.detach(), torch.stack(picked).sum(), rtol=1e-4)


def test_a_malformed_line_names_the_file_and_line(tmp_path):
    good = _demo(1, 2)
    bad_json = _write(tmp_path / "a.jsonl", [good, "", "{not json"])
    with pytest.raises(DemonstrationError, match=r"a\.jsonl:3: "):
        read_demonstrations(bad_json)
    no_answer = {"messages": good["messages"][:3]}
    with pytest.raises(DemonstrationError, match=r"b\.jsonl:2: .*last one an assistant"):
        read_demonstrations(_write(tmp_path / "b.jsonl", [good, no_answer]))
    no_role = {"messages": [{"content": "x"}]}
    with pytest.raises(DemonstrationError, match=r"c\.jsonl:1: message 0"):
        read_demonstrations(_write(tmp_path / "c.jsonl", [no_role]))
    cfg = load_config(None, ["model.name='tiny'", f"sft.path='{tmp_path / 'c.jsonl'}'"])
    with pytest.raises(ConfigError, match=r"sft\.path: .*c\.jsonl:1"):
        check_config(cfg)
    ray = load_config(None, ["model.name='tiny'", "run.backend='ray'",
                             f"sft.path='{tmp_path / 'b.jsonl'}'"])
    with pytest.raises(ConfigError, match=r"sft\.path: .*not supported"):
        check_config(ray)


def test_a_resumed_run_does_not_redo_the_warm_start(tmp_path, monkeypatch):
    path = _write(tmp_path / "demos.jsonl", [_demo(12, 30), _demo(7, 41)])
    cfg = load_config(ROOT / "configs" / "tiny_arith.toml", [
        f"run.output_dir='{tmp_path}'", "run.threads=1", "rollout.prompts_per_step=2",
        "task.num_eval=4", "eval.every=0", f"sft.path='{path}'", "sft.steps=4",
        "sft.batch_size=2", "sft.log_every=2"])
    root = tmp_path / cfg.run.name
    lines: list[str] = []
    stages = build(cfg)
    train(stages, Run(root, resume=False, config_toml=to_toml(cfg), echo=lines.append), 1,
          eval_before=False)
    records = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
    sft = [r for r in records if r["kind"] == "sft"]
    assert [r["sft_step"] for r in sft] == [2, 4] and sum(x.startswith("sft ") for x in lines) == 2
    assert {"loss", "token_accuracy", "tokens", "seconds"} <= set(sft[0])
    assert (root / "checkpoints" / "step_0").is_dir()  # the warm start's weights

    def refuse(self, log):
        raise AssertionError("the warm start ran again")

    resumed = build(cfg)
    monkeypatch.setattr(type(resumed), "warm_start", refuse)
    summary = train(resumed, Run(root, resume=True, echo=lambda s: None), 2, eval_before=False)
    assert summary["sft"]["steps"] == 4
    records = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["kind"] == "sft" for r in records) == 2
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]


@pytest.mark.slow  # three processes: ~50 s on a loaded 2-core machine
def test_the_sft_command_warm_starts_and_train_resume_continues_with_rl(tmp_path):
    path = _write(tmp_path / "demos.jsonl", [_demo(12, 30), _demo(7, 41)])
    config = str(ROOT / "configs/tiny_arith.toml")
    quick = ["--set", "run.threads=1", "--set", "task.num_eval=8", "--set",
             "rollout.prompts_per_step=2", "--set", "eval.every=0"]
    off = rollwise("sft", config, *quick, cwd=tmp_path)
    assert off.returncode == 2 and "sft.path is not set" in off.stdout + off.stderr
    out = rollwise("sft", config, *quick, "--set", f"sft.path='{path}'", "--set", "sft.steps=2",
                   "--set", "sft.log_every=1", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert sum(x.startswith("sft ") for x in out.stdout.splitlines()) == 2
    run = tmp_path / "runs/tiny_arith"
    assert json.loads((run / "summary.json").read_text())["sft"]["steps"] == 2
    more = rollwise("train", "--resume", str(run), "--set", "run.num_steps=1", cwd=tmp_path)
    assert more.returncode == 0, more.stderr[-2000:]
    assert not any(x.startswith("sft ") for x in more.stdout.splitlines())
    assert sum(x.startswith("step ") for x in more.stdout.splitlines()) == 1
