"""Tiny Hugging Face models and batches built from a config with a fixed seed (never downloaded)."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from relax.config import load_config
from relax.trainers.torch.actor import Actor
from relax.trainers.torch.batch import RolloutBatch

VOCAB = 64


def tiny_qwen2(seed: int = 0, hidden: int = 32, layers: int = 2, pad_token_id: int | None = None) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      attention_dropout=0.0, pad_token_id=pad_token_id)
    return Qwen2ForCausalLM(cfg)


def tiny_batch(
    n: int = 6, seed: int = 1, prompt: int = 4, lengths: tuple[int, ...] = (3, 9, 5, 12, 2, 7)
) -> RolloutBatch:
    """``n`` samples: ``prompt`` prompt tokens then a response of ``lengths[i % len]`` tokens."""
    g = torch.Generator().manual_seed(seed)
    ids, masks, old, adv = [], [], [], []
    for i in range(n):
        r = lengths[i % len(lengths)]
        ids.append(torch.randint(0, VOCAB, (prompt + r,), generator=g))
        m = torch.cat([torch.zeros(prompt), torch.ones(r)])
        masks.append(m)
        old.append(-torch.rand(prompt + r, generator=g) * m)
        adv.append(m * (1.0 if i % 2 else -1.0))
    return RolloutBatch(ids=[f"s{i}" for i in range(n)], input_ids=ids, loss_mask=masks, old_logprobs=old,
                        advantages=adv, rewards=torch.tensor([float(i % 2) for i in range(n)]),
                        policy_versions=[0] * n)


def actor(*overrides: str, model=None) -> Actor:
    cfg = load_config(None, ["trainer.warmup_steps=0", "trainer.lr=0.01", "rollout.max_new_tokens=16", *overrides])
    return Actor(model or tiny_qwen2(), cfg)


def on_policy(a: Actor, seed: int = 1):
    batch = tiny_batch(seed=seed)
    batch.old_logprobs = [lp * m for lp, m in zip(a.logprobs(batch), batch.loss_mask, strict=True)]
    return batch


def full_logprobs(model, batch) -> list[torch.Tensor]:
    """(L_i, V) log-softmax per sample, row t scoring token t (row 0 unused)."""
    with torch.no_grad():
        return [torch.cat([torch.zeros(1, VOCAB), torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1], -1)])
                for ids in batch.input_ids]
