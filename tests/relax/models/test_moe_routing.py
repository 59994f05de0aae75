"""Rollout routing replay (R3): the native engine records each position's experts, and the
training forward that replays them reproduces the engine's log-probs exactly, while one without
them drifts once the router moves."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from relax.config import ModelConfig
from relax.engines.native.engine import NativeEngine
from relax.engines.types import GenerateRequest, SamplingParams
from relax.models import build_policy, build_tokenizer
from relax.models.builders import policy_config
from relax.models.moe_routing import (
    RouteRecorder,
    config_route_shape,
    replay_routes,
    replayed_scores,
    route_shape,
)
from relax.services.queue_contract import routes_column
from relax.trainers.torch.batch import RolloutBatch
from relax.trainers.torch.forward import compute_logprobs, token_logprobs
from relax.trainers.torch.trainer import plan_micro_batches

FAMILIES = ("qwen2_moe", "qwen3_moe")
PROMPTS = ("What is 3 + 4?", "Name a colour.", "2 * 5 =", "Which is larger, 12 or 21?")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("bpe-tiny")


def _moe(tok, family):
    return build_policy(ModelConfig(name_or_path="tiny-qwen2", family=family), tok, seed=0)[0]


def _rollout(model, tok, n=2):
    """A batch the engine sampled (two samples per prompt, all in one running batch), with its routes."""
    engine = NativeEngine(model, tok, max_batch_size=16, max_seq_len=96, seed=0, background=False, record_routes=True)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    futures = [engine.submit(GenerateRequest(f"r{i}", p, SamplingParams(max_new_tokens=8, n=n)))
               for i, p in enumerate(prompts)]
    while engine.step():
        pass
    rows = [(p, c) for p, f in zip(prompts, futures, strict=True) for c in f.result()]
    ids = [torch.tensor(p + c.output_ids) for p, c in rows]
    mask = [torch.tensor([0.0] * len(p) + [1.0] * len(c.output_ids)) for p, c in rows]
    old = [torch.tensor([0.0] * len(p) + c.logprobs) for p, c in rows]
    routes = [torch.tensor(routes_column(c.routed_experts, len(p) + len(c.output_ids), c.rid), dtype=torch.long)
              for p, c in rows]
    return RolloutBatch(ids=[f"s{i}" for i in range(len(rows))], input_ids=ids, loss_mask=mask, old_logprobs=old,
                        routed_experts=routes), rows


def test_replayed_weights_are_the_routers_softmax_at_the_replayed_experts():
    # logits (0, ln 2, ln 3): softmax = (1/6, 2/6, 3/6). Own top-2 is experts (2, 1).
    logits = torch.tensor([[0.0, math.log(2), math.log(3)]])
    own = torch.tensor([[2, 1]])
    # replaying (0, 2): raw weights (1/6, 3/6) (Qwen2-MoE), normalised over the two (1/4, 3/4) (Qwen3-MoE)
    raw, ids = replayed_scores(logits, torch.tensor([[0, 2]]), own, norm_topk_prob=False)
    assert ids.tolist() == [[0, 2]]
    assert raw[0].tolist() == pytest.approx([1 / 6, 3 / 6])
    normed, _ = replayed_scores(logits, torch.tensor([[0, 2]]), own, norm_topk_prob=True)
    assert normed[0].tolist() == pytest.approx([1 / 4, 3 / 4])
    # -1 keeps the router's own pick: (-1, 0) -> experts (2, 0), weights (3/6, 1/6)
    mixed, ids = replayed_scores(logits, torch.tensor([[-1, 0]]), own, norm_topk_prob=False)
    assert ids.tolist() == [[2, 0]] and mixed[0].tolist() == pytest.approx([3 / 6, 1 / 6])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_engine_records_the_experts_a_plain_forward_routes_to(tok, family):
    model = _moe(tok, family)
    assert config_route_shape(policy_config(ModelConfig(name_or_path="tiny-qwen2", family=family), tok)) \
        == route_shape(model) == (model.config.num_hidden_layers, 2)
    batch, rows = _rollout(model, tok)
    recorder = RouteRecorder(model)
    for (p, c), routes in zip(rows, batch.routed_experts, strict=True):
        fed = p + c.output_ids[:-1]  # the last sampled token is never fed to the model
        assert c.routed_experts.shape == (len(fed), *route_shape(model))
        with torch.no_grad(), recorder.capture() as got:
            model(input_ids=torch.tensor([fed]))
        assert np.array_equal(c.routed_experts, got[0].numpy())
        assert (routes[len(fed):] == -1).all() and routes.shape[0] == len(fed) + 1


@pytest.mark.parametrize("family", FAMILIES)
def test_with_replay_the_training_forward_equals_the_engine_and_without_it_the_moved_router_drifts(tok, family):
    model = _moe(tok, family)
    batch, _ = _rollout(model, tok)
    trained = [m.bool() for m in batch.loss_mask]

    def err(logprobs):
        return max(float((lp - old)[m].abs().max()) for lp, old, m in zip(logprobs, batch.old_logprobs, trained,
                                                                          strict=True))

    replayed = compute_logprobs(model, plan_micro_batches(batch, 4096, "pack"), len(batch))
    assert err(replayed) < 1e-5  # R3 on, same weights: the engine's log-probs, in a packed training row
    # one AdamW step (lr 1e-3) of a policy-gradient loss on the routers alone, through the replayed
    # experts' gate weights: near-tie tokens now route elsewhere, which is all the ratio would see without R3
    routers = [p for name, p in model.named_parameters() if name.endswith("gate.weight")]
    opt = torch.optim.AdamW(routers, lr=1e-3)
    (mb,) = plan_micro_batches(batch, 4096, "pack")
    advantages = torch.tensor([1.0, -1.0] * (len(batch) // 2))
    logprobs = token_logprobs(model, mb).logprobs
    loss = -sum(advantages[s.index] * (lp * batch.loss_mask[s.index]).sum() for s, lp in zip(mb.spans, logprobs,
                                                                                             strict=True))
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in routers)  # the router learns under R3
    opt.step()
    recorder = RouteRecorder(model)
    flat = torch.cat([r for r in batch.routed_experts])
    with torch.no_grad(), recorder.capture() as own:
        model(input_ids=torch.cat(batch.input_ids)[None])
    valid = (flat >= 0).all(-1)
    flipped = float((own[0].long() != flat).any(-1)[valid].float().mean())
    plain = RolloutBatch(ids=batch.ids, input_ids=batch.input_ids, loss_mask=batch.loss_mask,
                         old_logprobs=batch.old_logprobs)
    drift_without = err(compute_logprobs(model, plan_micro_batches(plain, 4096, "pack"), len(plain)))
    drift_with = err(compute_logprobs(model, plan_micro_batches(batch, 4096, "pack"), len(batch)))
    print(f"{family}: routes flipped at {flipped:.1%} of (token, layer) pairs; max |logprob - engine| "
          f"without R3 {drift_without:.2e}, with R3 {drift_with:.2e}")
    assert flipped > 0
    assert drift_without > drift_with


def test_routes_of_the_wrong_shape_are_refused_naming_both_shapes(tok):
    model = _moe(tok, "qwen3_moe")
    layers = model.config.num_hidden_layers
    with pytest.raises(ValueError, match=rf"shape \(5, {layers}, 3\).*{layers} MoE layers x top-2"):
        with replay_routes(model, torch.zeros(1, 5, layers, 3, dtype=torch.long)):
            pass
    with pytest.raises(ValueError, match="a forward of 4 tokens was given routes for 5"), torch.no_grad():
        with replay_routes(model, torch.zeros(1, 5, layers, 2, dtype=torch.long)):
            model(input_ids=torch.tensor([[1, 2, 3, 4]]))
    with pytest.raises(ValueError, match="routed_experts has shape"):
        RolloutBatch(ids=["a"], input_ids=[torch.tensor([1, 2, 3])], loss_mask=[torch.ones(3)],
                     routed_experts=[torch.zeros(2, layers, 2, dtype=torch.long)])
