"""Model loading: the tiny model's tokenizer and warm start, SmolLM2 conversion parity."""

from __future__ import annotations

import pytest
import torch

from rollwise.models import load_policy
from rollwise.models.tiny import build_tokenizer, load_tiny


def test_tiny_tokenizer_is_character_level_and_round_trips():
    tok = build_tokenizer()
    ids = tok("23+45=")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 7
    assert tok.decode(ids, skip_special_tokens=True) == "23+45="
    text = "What is 7 * 8?"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_tiny_warm_start_is_cached_and_learns(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLWISE_CACHE", str(tmp_path))
    examples = [(f"{a}+{b}=", f"{a + b}") for a in range(10) for b in range(10)]
    kwargs = {"hidden": 32, "layers": 1, "heads": 2, "kv_heads": 1, "sft_steps": 60,
              "sft_lr": 1e-2, "sft_batch": 32}
    model, tok = load_tiny(examples, **kwargs)
    untrained, _ = load_tiny(None, **kwargs)
    cached, _ = load_tiny(examples, **kwargs)
    assert len(list((tmp_path / "tiny").iterdir())) == 1
    for (n, p), (_, q) in zip(model.named_parameters(), cached.named_parameters()):
        assert torch.equal(p, q), n

    def nll(m):  # mean loss of the reference answers under the model
        total = 0.0
        for prompt, ref in examples[:20]:
            ids = tok(prompt + ref)["input_ids"]
            logits = m(torch.tensor([ids])).logits[0]
            lp = logits[:-1].log_softmax(-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
            total += -lp[len(tok(prompt)["input_ids"]) - 1:].mean().item()
        return total / 20

    with torch.no_grad():
        assert nll(model) < nll(untrained) - 1.0


def test_policy_encode_plain_and_chat():
    policy = load_policy("tiny")
    assert policy.decode(policy.encode("1+2=")) == "1+2=" and not policy.chat
    with pytest.raises(ValueError, match="no chat template"):
        policy.encode([{"role": "user", "content": "hi"}])


def test_unknown_model_names_the_choices():
    with pytest.raises(FileNotFoundError, match="smollm2-135m"):
        load_policy("no-such-model")


@pytest.mark.slow
def test_smollm2_converted_logits_equal_the_gguf_model():
    from transformers import AutoModelForCausalLM

    from rollwise.models.smollm2 import GGUF_FILE, gguf_dir

    policy = load_policy("smollm2-135m")
    ids = policy.encode([{"role": "user",
                          "content": "What is 12 + 30? Put the final answer after ####."}])
    reference = AutoModelForCausalLM.from_pretrained(gguf_dir(), gguf_file=GGUF_FILE,
                                                     dtype=torch.float32)
    with torch.no_grad():
        a = policy.model(torch.tensor([ids])).logits
        b = reference(torch.tensor([ids])).logits
    assert torch.equal(a, b)
    assert getattr(policy.model, "hf_quantizer", None) is None  # plain floats, no GGUF quantizer
    assert policy.chat and policy.stop_ids == [policy.tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_converted_config_loses_only_the_gguf_quantization(tmp_path):
    """The converted SmolLM2 folder holds plain float weights: its config must not send
    every later load through transformers' GGUF quantizer (a cache written before the fix is
    rewritten in place)."""
    import json

    from rollwise.models.smollm2 import drop_gguf_quantization

    config = {"model_type": "llama", "hidden_size": 8,
              "quantization_config": {"quant_method": "gguf", "dequantize": False}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert drop_gguf_quantization(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == {"hidden_size": 8,
                                                                 "model_type": "llama"}
    assert not drop_gguf_quantization(tmp_path)  # nothing left to drop
    other = {"model_type": "llama", "quantization_config": {"quant_method": "bitsandbytes"}}
    (tmp_path / "config.json").write_text(json.dumps(other))
    assert not drop_gguf_quantization(tmp_path)  # another method's config is left alone
    assert json.loads((tmp_path / "config.json").read_text()) == other
