"""``trainer.backend=megatron`` on mixture-of-experts policies (Qwen2-MoE with its gated shared expert,
Qwen3-MoE): megatron's MoE layers hold the Hugging Face weights exactly, one actor step equals the
PyTorch backend's, published weights serve a Hugging Face model, and with routing replay both
backends route through the engine's experts, not their own.

One child process (megatron keeps process-wide state) writes JSON; the tests assert on it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.relax.trainers.megatron.child_ranks import run_child

pytest.importorskip(
    "megatron.core",
    reason="megatron-core does not import; pip install --no-deps megatron-core==0.16.1",
    exc_type=ImportError,
)

HERE = Path(__file__).resolve()
FAMILIES = ("qwen2_moe", "qwen3_moe")


@pytest.fixture(scope="module")
def child(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_child(HERE, tmp_path_factory.mktemp("mcore-moe") / "moe.json")


@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_moe_layers_hold_the_hf_weights_exactly(child: dict[str, Any], family: str) -> None:
    res = child[family]
    assert res["roundtrip_exact"] and res["logit_diff"] < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("replay", ["own routing", "replayed routes"])
def test_one_moe_actor_step_equals_the_pytorch_backend(child: dict[str, Any], family: str, replay: str) -> None:
    res = child[family][replay]
    assert res["loss_torch"] == pytest.approx(res["loss_megatron"], abs=1e-5)
    assert res["grad_norm_torch"] == pytest.approx(res["grad_norm_megatron"], rel=1e-5)
    assert res["grad_norm_torch"] > 1e-3  # a real step (the tiny builders initialise small)
    assert res["max_weight_diff"] < 1e-5
    assert res["router_moved"]  # the router learns on both backends, through the (replayed) gate weights


@pytest.mark.parametrize("family", FAMILIES)
def test_replayed_routes_are_the_ones_megatron_uses(child: dict[str, Any], family: str) -> None:
    res = child[family]
    # the routes came from the model before its routers moved: some tokens would route elsewhere now
    assert res["routes_changed_share"] > 0
    assert res["replayed_vs_hf_replayed"] < 1e-5  # megatron replaying == HF replaying
    assert res["replayed_vs_own"] > 1e-4  # and replay is not a no-op


@pytest.mark.parametrize("family", FAMILIES)
def test_published_moe_weights_serve_a_hf_model(child: dict[str, Any], family: str) -> None:
    assert child[family]["published_logprob_diff"] < 1e-5


def _main(out: str) -> None:
    import copy

    import torch

    from relax.config import ModelConfig, load_config
    from relax.models import build_policy, build_tokenizer
    from relax.models.moe_routing import RouteRecorder
    from relax.trainers.megatron.model import forward_logits
    from relax.trainers.megatron.policy import megatron_policy
    from relax.trainers.torch.actor import Actor
    from relax.trainers.torch.batch import RolloutBatch

    tok = build_tokenizer("bpe-tiny")
    result: dict[str, Any] = {}
    g = torch.Generator().manual_seed(0)
    lengths = (7, 12, 9, 15)
    ids = [torch.randint(3, 500, (4 + n,), generator=g) for n in lengths]
    masks = [torch.cat([torch.zeros(4), torch.ones(n)]) for n in lengths]
    for family in FAMILIES:
        hf = build_policy(ModelConfig(name_or_path="tiny-qwen2", family=family), tok, seed=0)[0].eval()
        res: dict[str, Any] = {}
        policy = megatron_policy(copy.deepcopy(hf), routing_replay=True)
        back = policy.state_dict()
        res["roundtrip_exact"] = all(torch.equal(back[k], v) for k, v in hf.state_dict().items())
        probe = torch.stack([i[:11] for i in ids])
        with torch.no_grad():
            res["logit_diff"] = float((hf(input_ids=probe).logits - forward_logits(policy.gpt, probe)).abs().max())
        # routes the "engine" recorded before the routers moved (each sample's own forward, as the engine does)
        recorder = RouteRecorder(hf)
        routes = []
        for x in ids:
            with torch.no_grad(), recorder.capture() as got:
                hf(input_ids=x[None, :-1])
            routes.append(torch.cat([got[0].long(), torch.full((1, *got[0].shape[1:]), -1)]))
        moved = copy.deepcopy(hf)
        with torch.no_grad():
            for name, p in moved.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)
        recorder = RouteRecorder(moved)
        changed = total = 0
        for x, r in zip(ids, routes, strict=True):
            with torch.no_grad(), recorder.capture() as got:
                moved(input_ids=x[None, :-1])
            changed += int((got[0].long().sort(-1).values != r[:-1].sort(-1).values).any(-1).sum())
            total += got[0].shape[0] * got[0].shape[1]
        res["routes_changed_share"] = changed / total
        cfg = load_config(
            None,
            [
                "trainer.warmup_steps=0",
                "trainer.lr=1e-3",
                "rollout.max_new_tokens=16",
                "algorithm.off_policy=none",
                f"model.family={family}",
                "trainer.micro_batch_tokens=40",
            ],
        )

        def batch(with_routes: bool, routes: list = routes) -> RolloutBatch:
            old = [-torch.rand(len(x), generator=torch.Generator().manual_seed(3)) * m for x, m in zip(ids, masks,
                                                                                                    strict=True)]
            return RolloutBatch(
                ids=[f"s{i}" for i in range(len(ids))],
                input_ids=ids,
                loss_mask=masks,
                old_logprobs=old,
                advantages=[m * (1.0 if i % 2 else -1.0) for i, m in enumerate(masks)],
                routed_experts=routes if with_routes else None,
                policy_versions=[0] * len(ids),
            )

        mcore_moved = megatron_policy(copy.deepcopy(moved), routing_replay=True)
        with torch.no_grad():
            hf_replayed = Actor(copy.deepcopy(moved), cfg).logprobs(batch(True))
            mc_replayed = Actor(mcore_moved, cfg).logprobs(batch(True))
            mc_own = Actor(mcore_moved, cfg).logprobs(batch(False))
        trained = [m.bool() for m in masks]
        res["replayed_vs_hf_replayed"] = max(float((a - b)[m].abs().max()) for a, b, m in zip(hf_replayed, mc_replayed,
                                                                                              trained, strict=True))
        res["replayed_vs_own"] = max(float((a - b)[m].abs().max()) for a, b, m in zip(mc_replayed, mc_own, trained,
                                                                                      strict=True))
        for label, with_routes in (("own routing", False), ("replayed routes", True)):
            torch_actor = Actor(copy.deepcopy(moved), cfg)
            mcore_actor = Actor(megatron_policy(copy.deepcopy(moved), routing_replay=True), cfg)
            a, b = torch_actor.train_step(batch(with_routes)), mcore_actor.train_step(batch(with_routes))
            after_t, after_m = torch_actor.model.state_dict(), mcore_actor.model.state_dict()
            gate = "model.layers.0.mlp.gate.weight"
            res[label] = {"loss_torch": a.loss, "loss_megatron": b.loss, "grad_norm_torch": a.grad_norm,
                          "grad_norm_megatron": b.grad_norm,
                          "max_weight_diff": max(float((after_t[k] - after_m[k]).abs().max()) for k in after_m),
                          "router_moved": bool(not torch.equal(after_m[gate], moved.state_dict()[gate])
                                               and not torch.equal(after_t[gate], moved.state_dict()[gate]))}
        # publishing: the HF-layout weights of the trained megatron actor score like it in a plain HF model
        served = build_policy(ModelConfig(name_or_path="tiny-qwen2", family=family), tok, seed=5)[0]
        served.load_state_dict(mcore_actor.model.state_dict())
        with torch.no_grad():
            lp_hf, lp_mc = Actor(served, cfg).logprobs(batch(False)), mcore_actor.logprobs(batch(False))
        res["published_logprob_diff"] = max(float((a - b).abs().max()) for a, b in zip(lp_hf, lp_mc, strict=True))
        result[family] = res
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    _main(sys.argv[1])
