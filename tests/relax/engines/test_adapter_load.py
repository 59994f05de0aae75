"""The native engine loads adapter versions onto its base: its sampled log-probs equal the trainer's."""

from __future__ import annotations

import copy

import pytest
import torch

from relax.config import load_config
from relax.engines.adapter_load import load_into
from relax.engines.types import EngineError, SamplingParams
from relax.models import build_policy, build_tokenizer
from relax.models.lora import adapter_info, adapter_state, apply_lora, base_state
from relax.rollout.engine_pool import LocalEngines
from relax.rollout.prompts import EncodedPrompt
from relax.transfer.adapter_versions import load_version, publish_adapter
from relax.transfer.weights import WeightStore


def perturb(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def trainer_logprobs(model: torch.nn.Module, prompt: list[int], out: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(out)[:, None]).squeeze(-1)


def test_engine_log_probs_equal_the_trainers_after_each_adapter_reload(tmp_path):
    cfg = load_config(None, ["model.lora.rank=4", "model.lora.alpha=8"])
    tok = build_tokenizer(cfg.model.tokenizer)
    base, _ = build_policy(cfg.model, tok, seed=0)
    policy = apply_lora(copy.deepcopy(base), cfg.model).eval()
    store = WeightStore(str(tmp_path), "run")
    pool = LocalEngines(base, tok, max_batch_size=4, max_seq_len=128, seed=0)
    prompt = tok("12+7=")["input_ids"]
    params = SamplingParams(max_new_tokens=12, temperature=0.9, ignore_eos=True, sampling_seed=3)
    kept = None
    for version in range(3):
        perturb(policy, version)
        state = {**(base_state(policy) if version == 0 else {}), **adapter_state(policy)}
        publish_adapter(store, version, state, adapter_info(cfg.model))
        pool.load_weights(store, version)
        if version == 1:
            kept = {k: v.clone() for k, v in pool.engine.lora_base.weights.items()}
        [[done]] = pool.generate([EncodedPrompt(prompt, None, [], [])], [params], [f"r{version}"])
        assert done.weight_version == str(version)
        want = trainer_logprobs(policy, prompt, done.output_ids, 0.9)
        assert torch.allclose(torch.tensor(done.logprobs), want, atol=1e-5), (done.logprobs, want)
    # reloads merged onto the kept copy of the base, which none of them changed
    assert all(torch.equal(v, pool.engine.lora_base.weights[k]) for k, v in kept.items())
    assert all(torch.equal(v, base_state(policy)[k]) for k, v in kept.items())
    load_into(pool.engine, load_version(store, 0), "0")  # back to version 0 exactly
    merged = pool.engine.model.state_dict()
    perturb(policy, 0)
    want = copy.deepcopy(policy).merge_and_unload().state_dict()
    assert all(torch.allclose(merged[k], want[k], atol=1e-6) for k in want)
    pool.close()


def test_a_reload_rewrites_the_fused_copies_and_a_refused_one_writes_nothing(tmp_path):
    cfg = load_config(None, ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.target_modules=[k_proj,up_proj]"])
    tok = build_tokenizer(cfg.model.tokenizer)
    base, _ = build_policy(cfg.model, tok, seed=0)
    policy = apply_lora(copy.deepcopy(base), cfg.model).eval()
    store = WeightStore(str(tmp_path), "run")
    pool = LocalEngines(base, tok, max_batch_size=4, max_seq_len=64, seed=0)
    fused = pool.engine.fused
    assert fused is not None  # the tiny Qwen2 takes the fused decode path
    for version in range(2):
        perturb(policy, version)
        publish_adapter(store, version, {**(base_state(policy) if version == 0 else {}), **adapter_state(policy)},
                        adapter_info(cfg.model))
        pool.load_weights(store, version)
    # only k_proj and up_proj changed, in the middle and the tail of the fused tensors
    got = [(L.wqkv.clone(), L.wgu.clone()) for L in fused.layers]
    fused.refresh()
    assert all(torch.equal(q, L.wqkv) and torch.equal(g, L.wgu) for (q, g), L in zip(got, fused.layers, strict=True))
    k_base = pool.engine.lora_base.weights["model.layers.0.self_attn.k_proj.weight"]
    q_rows = pool.engine.model.model.layers[0].self_attn.q_proj.weight.shape[0]
    assert not torch.equal(got[0][0][q_rows:q_rows + k_base.shape[0]], k_base)  # the reload did change them

    before = {k: v.clone() for k, v in pool.engine.model.state_dict().items()}
    bad = load_version(store, 1)
    name = next(k for k in bad if k.endswith("up_proj.lora_A.weight"))
    bad[name] = bad[name][:2]  # a rank that does not match its lora_B
    with pytest.raises(EngineError, match="adapter version 9 adapts"):
        load_into(pool.engine, bad, "9")
    after = pool.engine.model.state_dict()
    assert pool.engine.weight_version == "1" and all(torch.equal(v, after[k]) for k, v in before.items())
    pool.close()
