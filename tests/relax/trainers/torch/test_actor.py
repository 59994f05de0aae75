"""The actor wires config -> relax.algorithms -> TorchTrainer; checked on a tiny Qwen2."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from tiny import VOCAB, actor, full_logprobs, on_policy, tiny_batch, tiny_qwen2

from relax.config import load_config
from relax.trainers.torch.actor import Actor, Reference


def test_on_policy_ppo_loss_is_minus_the_mean_advantage():
    # ratio = 1 everywhere, so the PPO loss per token is -A_t; token-mean over the masked tokens.
    # tiny_batch: responses of 3, 9, 5, 12, 2, 7 tokens with advantages -1, +1, -1, +1, -1, +1:
    # sum of A over tokens = -3 + 9 - 5 + 12 - 2 + 7 = 18 over 38 tokens -> loss = -18/38
    a = actor("algorithm.off_policy=none")
    result = a.train_step(on_policy(a))
    assert result.loss == pytest.approx(-18 / 38, abs=1e-6)


def test_updates_move_probability_towards_positive_advantages():
    a = actor("algorithm.off_policy=none")
    batch = on_policy(a)
    before = a.logprobs(batch)
    for _ in range(5):
        a.train_step(on_policy(a))
    after = a.logprobs(batch)
    for i, (b, f, m) in enumerate(zip(before, after, batch.loss_mask, strict=True)):
        gain = float(((f - b) * m).sum())
        assert gain > 0 if i % 2 else gain < 0, (i, gain)  # odd samples have A = +1, even A = -1


@pytest.mark.parametrize("policy_loss", ["ppo", "dual_clip", "gspo", "gspo_token", "cispo"])
@pytest.mark.parametrize("off_policy", ["none", "recompute", "decoupled", "tis", "icepop"])
def test_every_loss_and_correction_trains(policy_loss, off_policy):
    a = actor(f"algorithm.policy_loss={policy_loss}", f"algorithm.off_policy={off_policy}",
              "algorithm.entropy_coef=0.01")
    batch = on_policy(a)
    batch.old_logprobs = [lp - 0.05 * m for lp, m in zip(batch.old_logprobs, batch.loss_mask, strict=True)]  # stale
    result = a.train_step(batch)
    assert not result.skipped and torch.isfinite(torch.tensor(result.loss)) and result.grad_norm > 0
    if off_policy != "none":
        assert batch.prox_logprobs is not None  # recomputed from the current policy before the update


def test_recompute_anchors_the_ratio_at_the_trainers_logprobs():
    # stale behaviour log-probs (0.5 below the policy's on every token): with off_policy=none the ratio is
    # exp(0.5) = 1.65 > 1.28 on every token, so the A > 0 tokens are clipped and give loss -1.28 * A, the
    # A < 0 ones -1.65 * A; with recompute (verl's, slime's) the ratio is 1 again and the loss is the
    # on-policy -18/38 (tiny_batch: 18 = sum of A over its 38 tokens)
    for off_policy, expected in (("recompute", -18 / 38), ("none", (-1.28 * 28 + math.exp(0.5) * 10) / 38)):
        a = actor(f"algorithm.off_policy={off_policy}")
        batch = on_policy(a)
        batch.old_logprobs = [lp - 0.5 * m for lp, m in zip(batch.old_logprobs, batch.loss_mask, strict=True)]
        assert a.train_step(batch).loss == pytest.approx(expected, abs=1e-5), off_policy


def test_is_level_sequence_weighs_whole_sequences():
    # TIS with cap 2 on behaviour log-probs 0.1 below the policy's per token: token level weighs every token
    # exp(0.1) = 1.105; sequence level weighs sequence i by min(exp(0.1 n_i), 2), which is 2 for every
    # tiny_batch row longer than 6 tokens (exp(0.7) = 2.01): the losses differ
    losses = {}
    for level in ("token", "sequence"):
        a = actor("algorithm.off_policy=tis", f"algorithm.is_level={level}")
        batch = on_policy(a)
        batch.prox_logprobs = [lp.clone() for lp in batch.old_logprobs]
        batch.old_logprobs = [lp - 0.1 * m for lp, m in zip(batch.old_logprobs, batch.loss_mask, strict=True)]
        losses[level] = a.train_step(batch).loss
    # rows 3, 9, 5, 12, 2, 7 tokens, A = -1, +1, -1, +1, -1, +1; ratio 1, so the loss is -sum(w A) / 38
    token = -math.exp(0.1) * 18 / 38
    rows = list(zip((3, 9, 5, 12, 2, 7), (-1, 1, -1, 1, -1, 1), strict=True))
    sequence = -sum(min(math.exp(0.1 * n), 2.0) * n * sign for n, sign in rows) / 38
    assert losses["token"] == pytest.approx(token, abs=1e-5)
    assert losses["sequence"] == pytest.approx(sequence, abs=1e-5)


def test_loss_agg_norm_sets_the_sum_norm_constant():
    # seq-mean-token-sum-norm on tiny_batch at ratio 1: loss = -(sum of A over tokens) / (L_norm * 6 rows)
    # = -18 / (8 * 6) with loss_agg_norm=8; 0 falls back to rollout.max_new_tokens = 16: -18 / 96
    for norm, expected in ((8, -18 / 48), (0, -18 / 96)):
        a = actor("algorithm.off_policy=none", "algorithm.loss_agg=seq-mean-token-sum-norm",
                  f"algorithm.loss_agg_norm={norm}")
        assert a.train_step(on_policy(a)).loss == pytest.approx(expected, abs=1e-6), norm


def test_kl_term_needs_reference_logprobs_and_uses_them():
    a = actor("algorithm.kl_coef=0.5", "algorithm.off_policy=none")
    batch = on_policy(a)
    with pytest.raises(ValueError, match=r"needs batch field\(s\) \['ref_logprobs'\]"):
        a.train_step(batch)
    ref = Reference(copy.deepcopy(a.model))
    batch.ref_logprobs = ref.logprobs(batch)
    # policy == reference: every KL estimator is 0, so the loss is the plain PPO loss again (-18/38)
    assert a.train_step(batch).loss == pytest.approx(-18 / 38, abs=1e-6)


def test_kl_clamp_keeps_one_avoided_token_from_taking_over_the_step():
    # The reference puts probability 1 (log 0) on one sampled token the policy gives about 1/VOCAB:
    # log rho ~ ln VOCAB, so k3's gradient there is ~VOCAB times a normal token's. Unbounded, it
    # dominates the step's gradient norm; with kl_clamp=10 (k3 > 10 once log rho > ~2.5) it adds none.
    a = actor("algorithm.off_policy=none")
    batch = on_policy(a)
    batch.ref_logprobs = [lp.detach().clone() for lp in batch.old_logprobs]  # policy == reference ...
    batch.ref_logprobs[1][batch.loss_mask[1].nonzero()[0, 0]] = 0.0          # ... but for one token
    steps = {clamp: actor("algorithm.kl_coef=0.5", "algorithm.off_policy=none", f"algorithm.kl_clamp={clamp}",
                          model=copy.deepcopy(a.model)).train_step(batch) for clamp in (0.0, 10.0)}
    plain = actor("algorithm.off_policy=none", model=copy.deepcopy(a.model)).train_step(batch).grad_norm
    assert steps[0.0].grad_norm > 5 * plain
    assert steps[10.0].grad_norm == pytest.approx(plain, rel=1e-4)  # the clamped token adds nothing, the rest k3 = 0
    # the metric names the term: that token's k3 = rho - 1 - log rho with log rho = 0 - logp, times kl_coef 0.5;
    # clamped, 0.5 * 10 = 5. Every other token has k3 = 0, and PPO's |-A| = 1 there
    log_rho = -float(batch.old_logprobs[1][batch.loss_mask[1].nonzero()[0, 0]])
    k3 = 0.5 * (math.exp(log_rho) - 1 - log_rho)
    assert steps[0.0].metrics["kl_sampled_token_max"] == pytest.approx(k3, rel=1e-4) and k3 > 5
    assert steps[10.0].metrics["kl_sampled_token_max"] == pytest.approx(5.0)
    assert steps[0.0].metrics["pg_token_max"] == pytest.approx(1.0, rel=1e-5)


def test_decoupled_cap_keeps_one_stale_token_from_taking_over_the_step():
    # One token the (stale) behaviour policy found e^6 ~ 403 times less likely than pi_prox does:
    # decoupled PPO weights it w = pi_prox / pi_behav = 403, so its gradient is ~400 times a
    # normal token's. With is_cap=2 it is dropped (w > 2), and the step equals one where that
    # token carries no gradient (A = 0 there, same token count); with is_cap=1000 it is kept
    # and the step's gradient norm grows several-fold (the main job's 1e5 spikes at scale).
    quiet = ("algorithm.off_policy=decoupled", "algorithm.entropy_coef=0", "algorithm.kl_coef=0")
    a = actor(*quiet)
    stale = on_policy(a)
    j = int(stale.loss_mask[1].nonzero()[0, 0])
    stale.old_logprobs[1][j] -= 6.0
    silent = on_policy(a)
    silent.advantages[1][j] = 0.0

    def step(batch, cap):
        return actor(*quiet, f"algorithm.is_cap={cap}", model=copy.deepcopy(a.model)).train_step(batch)
    capped, kept, clean = step(stale, 2.0), step(stale, 1000.0), step(silent, 2.0)
    assert capped.grad_norm == pytest.approx(clean.grad_norm, rel=1e-5)
    assert capped.metrics["kept_frac"] < 1.0 and clean.metrics["kept_frac"] == 1.0
    assert kept.grad_norm > 5 * clean.grad_norm and kept.metrics["is_weight_max"] > 100
    # PPO at ratio 1: that token's loss is -w * A = -e^6 * (+1) (odd samples have A = +1); the others' |-A| = 1
    assert kept.metrics["pg_token_max"] == pytest.approx(math.exp(6.0), rel=1e-4)
    assert capped.metrics["pg_token_max"] == pytest.approx(1.0, rel=1e-5)


def test_topk_kl_needs_the_reference_top_k_and_is_zero_at_the_reference():
    a = actor("algorithm.kl_coef=0.5", "algorithm.kl_topk=4", "algorithm.off_policy=none")
    batch = on_policy(a)
    with pytest.raises(ValueError, match=r"needs batch field\(s\) \['ref_topk_ids', 'ref_topk_logprobs'\]"):
        a.train_step(batch)
    batch.ref_topk_ids, batch.ref_topk_logprobs, _ = Reference(copy.deepcopy(a.model)).topk(batch, 4)
    with pytest.raises(ValueError, match="pass read=PolicyLoss.reader"):
        a.trainer.step(batch, a.loss)  # a step that does not read the KL off the forward
    # policy == reference: sum_j p_j (log p_j - log q_j) = 0, so the loss is the plain PPO loss (-18/38)
    result = a.train_step(batch)
    assert result.loss == pytest.approx(-18 / 38, abs=1e-6) and result.metrics["kl_topk"] == pytest.approx(0, abs=1e-7)


@pytest.mark.parametrize("layout", ["bucket", "pack", "prefix"])
def test_reference_topk_is_the_head_of_the_full_distribution_in_every_layout(layout):
    model = tiny_qwen2()
    batch = tiny_batch()
    ref = Reference(copy.deepcopy(model), layout=layout)
    ids, lps, sampled = ref.topk(batch, 5)
    for want, got in zip(ref.logprobs(batch), sampled, strict=True):  # the same forward scores the sample
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    for full, i, lp, m in zip(full_logprobs(model, batch), ids, lps, batch.loss_mask, strict=True):
        rows = m > 0
        want_lp, want_ids = torch.topk(full[rows], 5, dim=-1)
        torch.testing.assert_close(lp[rows], want_lp, atol=1e-5, rtol=0)
        assert torch.equal(i[rows], want_ids)
        unscored = slice(0, 1) if layout != "prefix" else ~rows  # the prefix layout skips the whole prompt
        assert not lp[unscored].any() and not i[unscored].any()


def test_topk_kl_over_the_whole_vocabulary_is_the_exact_forward_kl():
    a = actor("algorithm.kl_coef=0.5", f"algorithm.kl_topk={VOCAB}", "algorithm.off_policy=none")
    ref_model = copy.deepcopy(a.model)
    with torch.no_grad():  # move the policy away from the reference
        for p in a.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = on_policy(a)
    batch.ref_topk_ids, batch.ref_topk_logprobs, _ = Reference(ref_model).topk(batch, VOCAB)
    # token-mean over response tokens of sum_v p_v (log p_v - log q_v), from the two models' full logits
    kl = [((r.exp() * (r - q)).sum(-1) * m).sum() for r, q, m in
          zip(full_logprobs(ref_model, batch), full_logprobs(a.model, batch), batch.loss_mask, strict=True)]
    want = float(sum(kl) / sum(m.sum() for m in batch.loss_mask))
    assert want > 1e-3
    assert a.train_step(batch).metrics["kl_topk"] == pytest.approx(want, rel=1e-4)


def test_topk_weight_splits_the_kl_between_the_top_k_and_the_sampled_tokens():
    # loss_t = pg_t + c * (w * KL_topk_t + (1 - w) * k3_t), linear in w, and the token mean is linear too:
    # L(w = 0.25) = 0.25 * L(top-k alone, w = 1) + 0.75 * L(k3 alone, kl_topk = 0), from one policy and batch
    model, ref_model = tiny_qwen2(), tiny_qwen2()
    with torch.no_grad():  # the policy away from the reference, so both KL terms are > 0
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = on_policy(actor(model=copy.deepcopy(model)))
    batch.ref_topk_ids, batch.ref_topk_logprobs, batch.ref_logprobs = Reference(ref_model).topk(batch, 8)
    losses = {}
    for name, extra in {"mix": ("algorithm.kl_topk=8", "algorithm.kl_topk_weight=0.25"),
                        "topk": ("algorithm.kl_topk=8",), "k3": ()}.items():
        losses[name] = actor("algorithm.kl_coef=0.5", "algorithm.off_policy=none", *extra,
                             model=copy.deepcopy(model)).train_step(batch).loss
    assert abs(losses["topk"] - losses["k3"]) > 1e-3  # the two terms differ, so the split is visible
    assert losses["mix"] == pytest.approx(0.25 * losses["topk"] + 0.75 * losses["k3"], abs=1e-6)
    split = actor("algorithm.kl_coef=0.5", "algorithm.kl_topk=8", "algorithm.kl_topk_weight=0.5")
    batch.ref_logprobs = None
    with pytest.raises(ValueError, match=r"needs batch field\(s\) \['ref_logprobs'\]"):
        split.train_step(batch)


def test_critic_fits_returns_and_needs_them():
    from relax.trainers.torch.critic import Critic, ValueModel, clipped_value_loss

    # clipped value loss by hand: V=[1, 3], V_old=[0, 0], R=[2, 2], clip 0.5
    # unclipped (V-R)^2 = [1, 1]; clipped V' = [0.5, 0.5] -> (V'-R)^2 = [2.25, 2.25]; 0.5*max = [1.125, 1.125]
    got = clipped_value_loss(torch.tensor([1.0, 3.0]), torch.zeros(2), torch.tensor([2.0, 2.0]), 0.5)
    assert got.tolist() == [1.125, 1.125]
    lm = tiny_qwen2()
    critic = Critic(ValueModel(lm.model, lm.config.hidden_size), lr=0.05, value_clip=100.0)
    batch = tiny_batch()
    with pytest.raises(ValueError, match=r"needs batch field\(s\) \['values', 'returns'\]"):
        critic.train_step(batch)
    batch.values = critic.values(batch)
    assert all(float(v.abs().max()) == 0.0 for v in batch.values)  # zero-initialised head
    batch.returns = [m * (1.0 if i % 2 else -1.0) for i, m in enumerate(batch.loss_mask)]
    first = critic.train_step(batch).loss
    for _ in range(40):
        batch.values = critic.values(batch)
        last = critic.train_step(batch).loss
    assert last < 0.1 * first


def test_mini_batches_are_sequential_updates_on_the_batch_parts():
    # mini_batches=2 on 6 samples = one update on samples 0-2, then one on 3-5, each normalised
    # over its own part; the same two steps taken by hand give identical weights
    split = actor("algorithm.off_policy=none", "trainer.mini_batches=2")
    by_hand = actor("algorithm.off_policy=none", model=copy.deepcopy(split.model))
    batch = on_policy(split)
    result = split.train_step(batch)
    first = by_hand.trainer.step(batch.select([0, 1, 2]), by_hand.loss)
    second = by_hand.trainer.step(batch.select([3, 4, 5]), by_hand.loss)
    for p, q in zip(split.model.parameters(), by_hand.model.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    assert result.loss == pytest.approx((first.loss + second.loss) / 2)
    assert split.trainer.steps_done == 2


def test_ppo_epochs_repeat_the_mini_batches():
    a = actor("algorithm.off_policy=none", "trainer.mini_batches=3", "trainer.ppo_epochs=2")
    a.train_step(on_policy(a))
    assert a.trainer.steps_done == 6  # 2 passes x 3 parts


def test_encoder_lr_scale_reaches_the_vision_and_audio_towers_only():
    from relax.models import build_policy, build_tokenizer

    cfg = load_config(
        "omni-cpu", ["trainer.encoder_lr_scale=3", "trainer.warmup_steps=0", "trainer.freeze_encoders=[]"]
    )
    model, _ = build_policy(cfg.model, build_tokenizer(cfg.model.tokenizer), seed=0)
    a = Actor(model, cfg)
    group_of = {id(p): g for g in a.trainer.optimizer.param_groups for p in g["params"]}
    lrs = {name: group_of[id(p)]["lr"] for name, p in model.named_parameters()}
    towers = {n: lr for n, lr in lrs.items() if ".visual." in f".{n}" or ".audio_tower." in f".{n}"}
    assert {n.split(".")[1] for n in towers} == {"visual", "audio_tower"}
    # the cosine schedule starts at factor 1 without warm-up: 3 x 2e-3 on the towers, 2e-3 elsewhere
    assert sorted(set(towers.values())) == pytest.approx([3 * cfg.trainer.lr])
    assert sorted({lr for n, lr in lrs.items() if n not in towers}) == pytest.approx([cfg.trainer.lr])


def test_encoders_that_thaw_later_sit_frozen_in_the_optimizer_at_their_own_lr():
    from relax.models import build_policy, build_tokenizer

    cfg = load_config(
        "omni-cpu",
        [
            "trainer.warmup_steps=0",
            "trainer.freeze_encoders=[vision]",
            "trainer.thaw_encoders_at=5",
            "trainer.encoder_lr_scale=2",
            "trainer.thaw_lr_scale=0.25",
            "trainer.thaw_warmup_steps=0",
        ],
    )
    model, _ = build_policy(cfg.model, build_tokenizer(cfg.model.tokenizer), seed=0)
    a = Actor(model, cfg)
    group_of = {id(p): g for g in a.trainer.optimizer.param_groups for p in g["params"]}
    params = dict(model.named_parameters())
    assert set(group_of) == {id(p) for p in params.values()}  # the frozen tower is in the optimizer already
    visual = [n for n in params if "visual" in n.split(".")]
    audio = [n for n in params if "audio_tower" in n.split(".")]
    assert visual and not any(params[n].requires_grad for n in visual)
    # 2e-3 x encoder scale 2 x thaw scale 0.25 = 1e-3 on the vision tower; 2 x 2e-3 on the audio tower
    assert sorted({group_of[id(params[n])]["lr"] for n in visual}) == pytest.approx([0.5 * cfg.trainer.lr])
    assert sorted({group_of[id(params[n])]["lr"] for n in audio}) == pytest.approx([2 * cfg.trainer.lr])
    # a copy of that model arrives with the tower frozen: its optimizer must still hold the tower, or the thaw does
    # nothing
    twin = copy.deepcopy(model)
    held = {id(p) for g in Actor(twin, cfg).trainer.optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for p in twin.parameters()}
    assert not any(p.requires_grad for n, p in twin.named_parameters() if "visual" in n.split("."))


def test_a_thaw_warm_up_holds_the_tower_at_zero_then_ramps_it_from_the_thaw():
    from relax.models import build_policy, build_tokenizer

    cfg = load_config("omni-cpu", ["trainer.warmup_steps=0", "trainer.lr_schedule=constant",
                                   "trainer.thaw_encoders_at=600", "trainer.thaw_warmup_steps=2"])
    model, _ = build_policy(cfg.model, build_tokenizer(cfg.model.tokenizer), seed=0)
    a = Actor(model, cfg)
    index = {id(p): i for i, g in enumerate(a.trainer.optimizer.param_groups) for p in g["params"]}
    params = dict(model.named_parameters())
    vision = {index[id(p)] for n, p in params.items() if "visual" in n.split(".")}
    audio = {index[id(p)] for n, p in params.items() if "audio_tower" in n.split(".")}
    assert vision and audio and not vision & audio  # the ramped tower has groups of its own
    # vision thaws at RL step 600 with the preset's 4 updates a step: optimizer step 2400; 2 RL steps of
    # warm-up are 8 updates, so the factor is (step - 2400 + 1) / 8, clamped to [0, 1]
    steps = (0, 2399, 2400, 2403, 2407, 2408)
    for i in vision:
        assert [a.trainer.scheduler.lr_lambdas[i](s) for s in steps] == pytest.approx([0, 0, 1 / 8, 4 / 8, 1, 1])
    for i in audio:  # trained from the start, at the schedule's factor
        assert [a.trainer.scheduler.lr_lambdas[i](s) for s in steps] == pytest.approx([1] * 6)
