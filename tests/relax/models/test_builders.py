"""Tiny policies: deterministic under the seed, run a forward pass, save/load round trip."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from relax.config import ModelConfig  # noqa: E402
from relax.models.builders import build_policy, count_parameters  # noqa: E402
from relax.models.tokenizers import build_tokenizer  # noqa: E402

CASES = [
    ("tiny-qwen2", "qwen2", "Qwen2ForCausalLM"),
    ("tiny-qwen2", "qwen3", "Qwen3ForCausalLM"),
    ("tiny-qwen2", "llama", "LlamaForCausalLM"),
    ("tiny-qwen2-vl", "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    ("tiny-qwen2-audio", "qwen2_audio", "Qwen2AudioForConditionalGeneration"),
    ("tiny-omni", "qwen2_5_omni", "Qwen2_5OmniThinkerForConditionalGeneration"),
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("bpe-tiny")


def _ids(tok) -> torch.Tensor:
    text = tok.apply_chat_template([{"role": "user", "content": "What is 1 + 5?"}], tokenize=False,
                                   add_generation_prompt=True)
    return torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])


@pytest.mark.parametrize(("name", "family", "cls"), CASES)
def test_builds_deterministically_and_runs(tok, name: str, family: str, cls: str) -> None:
    cfg = ModelConfig(name_or_path=name, family=family)
    rng_before = torch.random.get_rng_state()
    a, proc_a = build_policy(cfg, tok, seed=3)
    assert torch.equal(torch.random.get_rng_state(), rng_before), "building must not consume the caller's RNG"
    b, _ = build_policy(cfg, tok, seed=3)
    c, _ = build_policy(cfg, tok, seed=4)
    assert type(a).__name__ == cls
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    assert all(v.dtype == torch.float32 for v in sa.values())
    assert (proc_a is None) == (name == "tiny-qwen2")
    assert 100_000 < count_parameters(a) < 1_000_000
    ids = _ids(tok)
    with torch.no_grad():
        logits = a(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert torch.isfinite(logits).all()


def test_sizes_follow_config(tok) -> None:
    model, _ = build_policy(ModelConfig(hidden_size=32, num_layers=1, num_heads=2), tok, seed=0)
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 1
    assert model.config.vocab_size == len(tok)
    with pytest.raises(ValueError, match="divisible"):
        build_policy(ModelConfig(hidden_size=30, num_heads=4), tok, seed=0)


@pytest.mark.parametrize(("name", "family"), [("tiny-qwen2", "qwen2"), ("tiny-qwen2-vl", "qwen2_5_vl"),
                                               ("tiny-qwen2-audio", "qwen2_audio")])
def test_save_load_round_trip(tok, tmp_path, name: str, family: str) -> None:
    model, _ = build_policy(ModelConfig(name_or_path=name, family=family), tok, seed=1)
    model.save_pretrained(tmp_path)
    loaded, proc = build_policy(ModelConfig(name_or_path=str(tmp_path), family=family), tok, seed=999)
    assert type(loaded) is type(model)
    assert (proc is None) == (name == "tiny-qwen2")
    ids = _ids(tok)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)


def test_unknown_name_is_a_clear_error(tok, tmp_path) -> None:
    with pytest.raises(ValueError, match="never downloaded"):
        build_policy(ModelConfig(name_or_path="Qwen/Qwen2-0.5B"), tok, seed=0)
    with pytest.raises(ValueError, match="text model"):
        build_policy(ModelConfig(name_or_path="tiny-qwen2", family="qwen2_audio"), tok, seed=0)

