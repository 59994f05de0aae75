"""Shared-prefix training: groups found by prompt and media, plans within budget, and the two-pass
forward scores and differentiates exactly like full rows (text, image and audio prompts)."""

import copy

import pytest
import torch
from tiny import tiny_batch, tiny_qwen2

from relax.config import ModelConfig
from relax.data.suite import generate_suite
from relax.models import build_policy, build_tokenizer, prepare_inputs
from relax.trainers.packing import micro_batches
from relax.trainers.torch.batch import RolloutBatch
from relax.trainers.torch.critic import critic_layout
from relax.trainers.torch.forward import compute_logprobs
from relax.trainers.torch.prefix import plan_prefix, prefix_groups, prompt_length
from relax.trainers.torch.trainer import TorchTrainer, plan_micro_batches, sft_loss


def test_prompt_length_is_the_tokens_before_the_first_trained_one():
    ids = torch.tensor([5, 6, 7, 8])
    # mask 0 0 1 1: tokens 5 6 are the prompt
    assert prompt_length(ids, torch.tensor([0, 0, 1, 1])) == 2
    # a tool observation (0) inside the response stays in the response: first trained token is at 1
    assert prompt_length(ids, torch.tensor([0, 1, 0, 1])) == 1
    # nothing trained: all but the last token, so one response token is still scored
    assert prompt_length(ids, torch.tensor([0, 0, 0, 0])) == 3
    # token 0 has no prediction: the prompt keeps at least one token
    assert prompt_length(ids, torch.tensor([1, 1, 1, 1])) == 1


def test_samples_share_a_prefix_only_with_equal_prompt_and_media():
    a, b = {"pixel_values": torch.ones(2, 3)}, {"pixel_values": torch.zeros(2, 3)}
    ids = [torch.tensor([1, 2, 9]), torch.tensor([1, 2, 8, 8]), torch.tensor([1, 2, 7]), torch.tensor([1, 3, 7]),
           torch.tensor([1, 2, 6])]
    masks = [torch.tensor([0, 0, 1]), torch.tensor([0, 0, 1, 1]), torch.tensor([0, 0, 1]), torch.tensor([0, 0, 1]),
             torch.tensor([0, 0, 1])]
    media = [a, {"pixel_values": torch.ones(2, 3)}, b, a, None]
    # 0 and 1: prompt [1 2], equal pixels (distinct tensors); 2: same tokens, other pixels;
    # 3: other tokens; 4: same tokens, no image
    assert prefix_groups(ids, masks, media) == [(2, [0, 1]), (2, [2]), (2, [3]), (2, [4])]


def test_plan_keeps_groups_whole_within_budget_and_splits_a_group_too_large():
    prompt = torch.arange(1, 11)  # 10 prompt tokens
    ids, masks = [], []
    for g in range(3):
        for _ in range(4):
            ids.append(torch.cat([prompt + g, torch.tensor([3, 4])]))  # 2 response tokens
            masks.append(torch.tensor([0] * 10 + [1, 1]))
    # one group costs 10 + 4 * 2 = 18 positions, two cost 2 * 10 + 8 * 2 = 36
    plans = plan_prefix(ids, masks, None, token_budget=36)
    assert [[s.index for s in mb.spans] for mb in plans] == [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11]]
    assert plans[0].real_tokens == 2 * 10 + 8 * 2
    # budget 14: a group (18) is split, 10 + 2 * 2 = 14 fits two samples per part
    plans = plan_prefix(ids, masks, None, token_budget=14)
    assert [len(mb.spans) for mb in plans] == [2] * 6
    assert sorted(s.index for mb in plans for s in mb.spans) == list(range(12))


def _grads(model, fn):
    model.zero_grad()
    lps = fn()
    sum((lp * m).sum() for lp, m in lps).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _scores(model, mbs, n, masks):
    out = [None] * n
    from relax.trainers.torch.forward import token_logprobs

    for mb in mbs:
        lps = token_logprobs(model, mb).logprobs
        for s, lp in zip(mb.spans, lps, strict=True):
            out[s.index] = lp
    return list(zip(out, masks, strict=True))


@pytest.fixture(scope="module")
def omni_batch():
    """2 prompts each of shapes (image), tones (audio) and largest (text), 3 answers of 2-4 tokens each."""
    tokenizer = build_tokenizer("bpe-tiny")
    model, processor = build_policy(ModelConfig(name_or_path="tiny-omni", family="qwen2_5_omni"), tokenizer, seed=0)
    g = torch.Generator().manual_seed(0)
    ids, masks, media = [], [], []
    for s in generate_suite(["shapes", "tones", "largest"], seed=0, train_per_task=2, eval_per_task=1)["train"]:
        kw = prepare_inputs(s, [r.data for r in s.images], [r.data for r in s.audios], tokenizer, processor)
        extra = {k: v for k, v in kw.items() if k not in ("input_ids", "attention_mask")} or None
        for j in range(3):
            response = torch.randint(5, 200, (2 + j,), generator=g)
            ids.append(torch.cat([kw["input_ids"][0], response]))
            masks.append(torch.cat([torch.zeros(kw["input_ids"].shape[1]), torch.ones(2 + j)]))
            media.append(extra)
    return model, RolloutBatch(ids=[str(i) for i in range(len(ids))], input_ids=ids, loss_mask=masks, media=media)


def test_shared_prefix_scores_and_gradients_equal_full_rows_with_image_audio_and_text(omni_batch):
    model, batch = omni_batch
    assert {"pixel_values", "input_features"} <= {k for m in batch.media if m for k in m}
    rows = micro_batches(batch.input_ids, 4096, "bucket", media=batch.media)
    shared = plan_prefix(batch.input_ids, batch.loss_mask, batch.media, 4096)
    assert len(shared) == 1 and len(shared[0].prompts) == 6  # 18 samples, 6 prompts run once each
    full = _grads(model, lambda: _scores(model, rows, len(batch), batch.loss_mask))
    mine = _grads(model, lambda: _scores(model, shared, len(batch), batch.loss_mask))
    # the image and audio towers get their gradient back through the shared prompt's cache
    assert any("visual" in n and g.abs().sum() > 0 for n, g in mine.items())
    assert any("audio_tower" in n and g.abs().sum() > 0 for n, g in mine.items())
    assert full.keys() == mine.keys()
    for name in full:
        # float32 sums in another order: absolute error scales with the tensor's largest entry
        # (the merger bias gradient reaches ~40 while some of its entries are near zero)
        scale = max(1.0, full[name].abs().max().item())
        torch.testing.assert_close(mine[name], full[name], atol=1e-6 * scale, rtol=1e-4, msg=name)
    a = compute_logprobs(model, rows, len(batch))
    b = compute_logprobs(model, shared, len(batch))
    for x, y, m in zip(a, b, batch.loss_mask, strict=True):
        torch.testing.assert_close(y * m, x * m, atol=1e-5, rtol=0)  # responses agree
        assert (y[m == 0][1:] == 0).all()  # the prompt is not scored


def test_a_prefix_step_has_the_loss_and_gradient_of_padded_rows():
    batch = tiny_batch(n=8, prompt=5)
    for i in range(1, 8, 2):  # pairs share a prompt: samples 2k and 2k+1
        batch.input_ids[i][:5] = batch.input_ids[i - 1][:5]
    models = {layout: tiny_qwen2(seed=3) for layout in ("bucket", "prefix")}
    losses = {}
    for layout, model in models.items():
        trainer = TorchTrainer(model, lr=1e-2, layout=layout)
        mbs = trainer.micro_batches(batch)
        assert sum(len(getattr(mb, "prompts", mb.spans)) for mb in mbs) == (4 if layout == "prefix" else 8)
        losses[layout] = trainer.step(copy.deepcopy(batch), sft_loss).loss
    assert losses["prefix"] == pytest.approx(losses["bucket"], rel=1e-6)
    # Adam turns float-rounding noise on near-zero gradients into full-size steps: compare what it was given
    for (name, p), q in zip(models["bucket"].named_parameters(), models["prefix"].parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_the_critic_reads_full_rows_when_the_actor_shares_prefixes():
    assert critic_layout("prefix") == "bucket"
    assert critic_layout("pack") == "pack"
    batch = tiny_batch(n=4)
    assert all(hasattr(mb, "input_ids") for mb in plan_micro_batches(batch, 4096, "bucket"))
