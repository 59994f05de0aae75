"""Expert parallelism: one Megatron actor step at data parallel 2 x expert parallel 2 (two gloo ranks
on CPU, each holding half of every MoE layer's experts) equals the PyTorch backend's one-process step
on the whole batch: the same loss, gradient norm (the experts' squares summed over the EP ranks) and
updated weights and AdamW moments (gathered back into the Hugging Face layout), for Qwen2-MoE (with
its shared expert) and Qwen3-MoE, routing itself and replaying the engine's experts.

The two ranks train on different shares of the batch with different numbers of micro-batches, so the
one with fewer runs idle forwards to keep megatron's token exchange in step (each forward gathers the
tokens of both ranks); without them the step would hang. Each rank is a child process (this file as
a script) that takes the PyTorch step first, then joins the process group and takes the Megatron one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.relax.trainers.megatron.child_ranks import run_ranks

pytest.importorskip(
    "megatron.core",
    reason="megatron-core does not import; pip install --no-deps megatron-core==0.16.1",
    exc_type=ImportError,
)

HERE = Path(__file__).resolve()
CASES = ("qwen2_moe", "qwen3_moe", "qwen3_moe replayed")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("mcore-ep2")
    run_ranks(HERE, 2, str(out), what="dp=2 ep=2", timeout=300)  # a lockstep bug hangs: fail, not wait
    return [json.loads((out / f"{r}.json").read_text()) for r in range(2)]


def test_each_rank_holds_half_of_the_experts_and_a_share_of_the_batch(ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        assert (res["dp"], res["ep"], res["tp"]) == (2, 2, 1)
        assert res["local_experts"] == 2  # tiny MoE: 4 experts per layer
    # different shares, different micro-batch counts: the lockstep fillers were needed
    assert ranks[0]["micro_batches"] != ranks[1]["micro_batches"]
    assert ranks[0]["expert_weights"] != ranks[1]["expert_weights"]  # each rank its own experts


@pytest.mark.parametrize("case", CASES)
def test_an_ep2_actor_step_equals_the_pytorch_backend(ranks: list[dict[str, Any]], case: str) -> None:
    for res in (r[case] for r in ranks):
        assert res["loss_megatron"] == pytest.approx(res["loss_torch"], abs=1e-5)
        assert res["grad_norm_megatron"] == pytest.approx(res["grad_norm_torch"], rel=1e-5)
        assert res["grad_norm_torch"] > 1e-3  # a real step
        assert res["max_weight_diff"] < 1e-5 and res["max_weight_change"] > 1e-4
        assert res["experts_changed"]  # experts on both EP ranks moved
        # the checkpoint's optimizer state: AdamW moments by HF name, the experts gathered from both ranks
        assert res["missing_moments"] == [] and res["max_moment_diff"] < 1e-6


def _main(rank: int, port: str, out: str) -> None:  # out: this rank's JSON file
    import copy

    import torch

    from relax.config import ModelConfig, load_config
    from relax.models import build_policy, build_tokenizer
    from relax.trainers.checkpoint.optim_state import optimizer_state
    from relax.trainers.torch.actor import Actor
    from relax.trainers.torch.batch import RolloutBatch

    tok = build_tokenizer("bpe-tiny")
    g = torch.Generator().manual_seed(0)
    lengths = (36, 2, 3, 4, 5, 6)  # rank 0 trains the long one alone, rank 1 the five others in two micro-batches
    ids = [torch.randint(3, 500, (4 + n,), generator=g) for n in lengths]
    masks = [torch.cat([torch.zeros(4), torch.ones(n)]) for n in lengths]
    routes = [torch.randint(0, 4, (len(x), 2, 2), generator=g) for x in ids]
    for r in routes:  # two distinct experts per token, -1 at the last token (never fed to the engine)
        r[..., 1] = (r[..., 0] + 1 + torch.randint(0, 3, r[..., 1].shape, generator=g)) % 4
        r[-1] = -1

    def batch(replay: bool) -> RolloutBatch:
        old = [-torch.rand(len(x), generator=torch.Generator().manual_seed(3)) * m for x, m in zip(ids, masks,
                                                                                                strict=True)]
        return RolloutBatch(ids=[f"s{i}" for i in range(len(ids))], input_ids=ids, loss_mask=masks, old_logprobs=old,
                            advantages=[m * (1.0 if i % 3 else -1.0) for i, m in enumerate(masks)],
                            routed_experts=routes if replay else None, policy_versions=[0] * len(ids))

    def cfg(family: str):
        return load_config(None, ["trainer.warmup_steps=0", "trainer.lr=1e-3", "rollout.max_new_tokens=16",
                                  "algorithm.off_policy=none", f"model.family={family}",
                                  "trainer.micro_batch_tokens=24"])

    cases = {c: (c.split()[0], c.endswith("replayed")) for c in CASES}
    models = {c: build_policy(ModelConfig(name_or_path="tiny-qwen2", family=f), tok, seed=0)[0] for c, (f, _) in
              cases.items()}
    torch_side = {}
    for case, (family, replay) in cases.items():  # before any process group: the plain PyTorch step
        actor = Actor(copy.deepcopy(models[case]), cfg(family))
        torch_side[case] = (actor.train_step(batch(replay)), actor.model.state_dict(),
                            optimizer_state(actor.model, actor.trainer.optimizer)["state"])

    from megatron.core import parallel_state

    from relax.trainers.megatron.cpu import init_cpu_distributed, shutdown_distributed
    from relax.trainers.megatron.policy import megatron_policy

    init_cpu_distributed(rank, 2, int(port), ep=2)
    result: dict[str, Any] = {"tp": parallel_state.get_tensor_model_parallel_world_size(),
                              "dp": parallel_state.get_data_parallel_world_size(),
                              "ep": parallel_state.get_expert_model_parallel_world_size()}
    for case, (family, replay) in cases.items():
        policy = megatron_policy(copy.deepcopy(models[case]), routing_replay=replay)
        actor = Actor(policy, cfg(family))
        expert = policy.gpt.decoder.layers[0].mlp.experts.local_experts
        result["local_experts"] = len(expert)
        result["expert_weights"] = float(expert[0].linear_fc1.weight.sum())
        before = expert[0].linear_fc1.weight.detach().clone()
        result["micro_batches"] = len(actor.trainer.micro_batches(actor.share(batch(replay))))
        b = actor.train_step(batch(replay))
        a, after_t, moments_t = torch_side[case]
        after_m = actor.model.state_dict()  # the export gathers the experts of both EP ranks
        moments_m = optimizer_state(actor.model, actor.trainer.optimizer)["state"]
        changed = torch.tensor(float(not torch.equal(before, expert[0].linear_fc1.weight)))
        torch.distributed.all_reduce(changed, op=torch.distributed.ReduceOp.MIN)
        result[case] = {
            "loss_torch": a.loss, "loss_megatron": b.loss, "grad_norm_torch": a.grad_norm,
            "grad_norm_megatron": b.grad_norm, "experts_changed": bool(changed),
            "max_weight_diff": max(float((after_t[k] - after_m[k]).abs().max()) for k in after_m),
            "max_weight_change": max(float((after_t[k] - models[case].state_dict()[k]).abs().max()) for k in after_m),
            "missing_moments": sorted(k for k in moments_t if not moments_m.get(k)),
            "max_moment_diff": max(float((moments_t[k][m] - moments_m[k][m]).abs().max()) for k in moments_t
                                   for m in ("exp_avg", "exp_avg_sq") if moments_m.get(k))}
    Path(out).write_text(json.dumps(result))
    shutdown_distributed()  # a gloo group left to the interpreter's exit can abort it


if __name__ == "__main__":
    _main(int(sys.argv[1]), sys.argv[3], str(Path(sys.argv[4]) / f"{sys.argv[1]}.json"))
