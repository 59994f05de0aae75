"""A LoRA policy (model.lora, relax.models.lora) in the actor: what trains, what the reference is, what resumes."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny import VOCAB, actor, on_policy, tiny_batch, tiny_qwen2

from relax.config import load_config
from relax.models.lora import adapter_state, apply_lora, base_state
from relax.trainers.checkpoint.trainer_state import read_state, trainer_state
from relax.trainers.torch.actor import Actor, AdapterOffReference, Reference
from relax.trainers.torch.batch import RolloutBatch

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


def grouped_batch(seed: int = 1) -> RolloutBatch:
    """3 prompt groups of 3 samples each: a shared 5-token prompt, responses of 2..6 tokens."""
    g = torch.Generator().manual_seed(seed)
    ids, masks, old, adv = [], [], [], []
    for p in range(3):
        prompt = torch.randint(0, VOCAB, (5,), generator=g)
        for k in range(3):
            r = 2 + k + p
            ids.append(torch.cat([prompt, torch.randint(0, VOCAB, (r,), generator=g)]))
            masks.append(torch.cat([torch.zeros(5), torch.ones(r)]))
            old.append(-torch.rand(5 + r, generator=g) * masks[-1])
            adv.append(masks[-1] * (1.0 if k % 2 else -1.0))
    n = len(ids)
    return RolloutBatch(ids=[f"s{i}" for i in range(n)], input_ids=ids, loss_mask=masks, old_logprobs=old,
                        advantages=adv, rewards=torch.zeros(n), policy_versions=[0] * n)


def test_the_prefix_layout_trains_and_references_a_lora_policy_as_packing_does():
    got = {}
    for layout in ("pack", "prefix"):
        a = lora_actor(0, f"trainer.micro_batch_layout={layout}")
        with torch.no_grad():  # an adapter that changes the policy, so the reference differs from it
            for name, p in a.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.5)
        batch = grouped_batch()
        ref = AdapterOffReference(a.model, temperature=1.0, layout=layout).logprobs(batch)
        policy = a.logprobs(batch)
        result = a.train_step(batch)
        got[layout] = (ref, policy, result, adapter_state(a.model))
    masks = grouped_batch().loss_mask
    for i in (0, 1):  # the adapter-off reference, then the policy: equal over the trained tokens
        diff = max(float(((x - y) * m).abs().max()) for x, y, m in zip(got["pack"][i], got["prefix"][i], masks,
                                                                       strict=True))
        assert diff < 1e-5, diff
    assert any(float(((r - p) * m).abs().max()) > 1e-2 for r, p, m in zip(*got["prefix"][:2], masks, strict=True))
    (_, _, pack, after), (_, _, prefix, prefix_after) = got["pack"], got["prefix"]
    assert prefix.loss == pytest.approx(pack.loss, abs=1e-6) and prefix.grad_norm == pytest.approx(pack.grad_norm,
                                                                                                     rel=1e-4)
    assert max(float((after[k] - prefix_after[k]).abs().max()) for k in after) < 1e-5


def test_a_seeded_adapter_starts_alike_whatever_the_global_rng_did():
    cfg = load_config(None, LORA)
    torch.manual_seed(5)
    first = adapter_state(apply_lora(tiny_qwen2(), cfg.model, seed=7))
    torch.rand(100)  # what another process (a data-parallel rank 0) may have drawn before
    second = adapter_state(apply_lora(tiny_qwen2(), cfg.model, seed=7))
    assert all(torch.equal(first[k], second[k]) for k in first)
    other = adapter_state(apply_lora(tiny_qwen2(), cfg.model, seed=8))
    assert any(not torch.equal(first[k], other[k]) for k in first if "lora_A" in k)
