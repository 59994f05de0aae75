"""A LoRA policy (model.lora, relax.models.lora) in the actor: what trains, what the reference is, what resumes."""

from __future__ import annotations

import copy

import torch
from tiny import actor, on_policy, tiny_batch, tiny_qwen2

from relax.config import load_config
from relax.models.lora import adapter_state, apply_lora, base_state
from relax.trainers.checkpoint.trainer_state import read_state, trainer_state
from relax.trainers.torch.actor import Actor, AdapterOffReference, Reference

LORA = ["model.lora.rank=4", "model.lora.alpha=8"]


def lora_actor(seed: int = 0, *overrides: str) -> Actor:
    cfg = load_config(None, ["trainer.warmup_steps=0", "trainer.lr=0.01", "rollout.max_new_tokens=16", *LORA,
                             *overrides])
    base = tiny_qwen2()  # seeded by itself
    torch.manual_seed(seed)  # PEFT draws lora_A from the global RNG
    return actor(*LORA, *overrides, model=apply_lora(base, cfg.model))


def test_only_the_adapter_trains_and_holds_optimizer_state():
    a = lora_actor()
    base_before = {k: v.clone() for k, v in base_state(a.model).items()}
    adapter_before = {k: v.clone() for k, v in adapter_state(a.model).items()}
    a.train_step(on_policy(a))
    names = {id(p): n for n, p in a.model.named_parameters()}
    held = [names[id(p)] for group in a.trainer.optimizer.param_groups for p in group["params"]]
    with_state = [names[id(p)] for p in a.trainer.optimizer.state]
    assert held and all(".lora_" in n for n in held), held
    assert sorted(with_state) == sorted(held)
    assert len(held) == 2 * 7 * 2  # A and B of 7 projections in each of 2 layers
    assert all(torch.equal(v, base_before[k]) for k, v in base_state(a.model).items())
    moved = [k for k, v in adapter_state(a.model).items() if not torch.equal(v, adapter_before[k])]
    assert moved, "no adapter tensor moved"
    state = trainer_state(a.model, a.trainer.optimizer, a.trainer.scheduler)
    assert set(state["model"]) == set(adapter_state(a.model))  # the checkpoint holds the adapter alone
    assert all(".lora_" in name for name in state["optimizer"]["state"])


def test_the_adapter_off_reference_is_the_base_model_bit_for_bit():
    base = tiny_qwen2()
    twin = copy.deepcopy(base)
    cfg = load_config(None, LORA)
    model = apply_lora(base, cfg.model)
    with torch.no_grad():  # an adapter that changes the policy: B = 0 would hide a reference that kept it
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    batch = tiny_batch()
    ref = AdapterOffReference(model, temperature=0.7)
    got = ref.logprobs(batch)
    want = Reference(twin, temperature=0.7).logprobs(batch)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    policy = Reference(copy.deepcopy(model), temperature=0.7).logprobs(batch)
    assert any(not torch.allclose(p, w) for p, w in zip(policy, want, strict=True))  # the adapter is on again
    top = ref.topk(batch, 5)
    assert all(torch.equal(g, w) for g, w in zip(top.sampled, want, strict=True))
    trainable = [p for n, p in model.named_parameters() if "lora_" in n]
    assert model.training and all(p.requires_grad for p in trainable)  # the shared model is left as it was


def test_resume_from_an_adapter_checkpoint_is_bit_exact(tmp_path):
    a = lora_actor(0)
    first, second = on_policy(a, seed=1), tiny_batch(seed=2)
    a.train_step(first)
    url = a.trainer.save(str(tmp_path / "ckpt"), {"step": 0})
    second.old_logprobs = [lp.detach() * m for lp, m in zip(a.logprobs(second), second.loss_mask, strict=True)]
    a.train_step(second)
    b = lora_actor(1)  # another starting adapter: everything must come from the checkpoint
    b.trainer.load(url)
    b.train_step(second)
    want, got = adapter_state(a.model), adapter_state(b.model)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(torch.equal(x, y) for x, y in zip(base_state(a.model).values(), base_state(b.model).values(),
                                                  strict=True))
    _, saved = read_state(url)
    assert set(saved["model"]) == set(want)  # adapter tensors only: the base is rebuilt from the config


def test_a_seeded_adapter_starts_alike_whatever_the_global_rng_did():
    cfg = load_config(None, LORA)
    torch.manual_seed(5)
    first = adapter_state(apply_lora(tiny_qwen2(), cfg.model, seed=7))
    torch.rand(100)  # what another process (a data-parallel rank 0) may have drawn before
    second = adapter_state(apply_lora(tiny_qwen2(), cfg.model, seed=7))
    assert all(torch.equal(first[k], second[k]) for k in first)
    other = adapter_state(apply_lora(tiny_qwen2(), cfg.model, seed=8))
    assert any(not torch.equal(first[k], other[k]) for k in first if "lora_A" in k)
