"""One actor step of the Megatron backend at context parallel 2 (two gloo ranks on CPU, each holding a
zigzag half of every sequence) equals the PyTorch backend's one-process step: the same log-probs, loss,
gradient norm and updated weights, for Qwen2 and for Qwen3 (grouped-query attention, per-head q/k norms)
with the trainer's AdamW, and for Qwen2 with megatron's DistributedOptimizer (its slices then split over
the context ranks, which hold the same data), and for Qwen3-MoE (each rank's tokens through the experts);
and on four ranks at tensor x context parallel 2 x 2 (Qwen3:
its heads split over the tensor ranks, each head's sequence over the context ranks) and pipeline x context
parallel 2 x 2 (each stage runs its context rank's share; the last gathers the logits).

Each rank is a child process (this file as a script; megatron keeps process-wide state) that first
takes the PyTorch steps, then joins the process group at cp=2 and takes the Megatron steps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.relax.trainers.megatron.child_ranks import run_ranks

pytest.importorskip(
    "megatron.core",
    reason="megatron-core does not import; pip install --no-deps megatron-core==0.16.1",
    exc_type=ImportError,
)

HERE = Path(__file__).resolve()
# name: (family, the DistributedOptimizer, sizes beside cp=2)
CASES = {"qwen2": ("qwen2", False, {}), "qwen3": ("qwen3", False, {}), "qwen2 distopt": ("qwen2", True, {}),
         "qwen3_moe": ("qwen3_moe", False, {})}
FOUR_RANKS = {"tp2": ("qwen3", False, {"tp": 2}), "pp2": ("qwen3", False, {"pp": 2})}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("mcore-cp2")
    run_ranks(HERE, 2, str(out), what="cp=2")
    return [json.loads((out / f"{r}.json").read_text()) for r in range(2)]


def test_tp2_or_pp2_x_cp2_on_four_ranks_equals_the_pytorch_backend(tmp_path: Path) -> None:
    run_ranks(HERE, 4, str(tmp_path), what="tp=2 x cp=2, pp=2 x cp=2")
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    for layout, res in ((layout, r[layout]) for r in ranks for layout in FOUR_RANKS):
        assert (res["tp"], res["pp"], res["cp"], res["dp"]) == ((2, 1) if layout == "tp2" else (1, 2)) + (2, 1)
        assert res["max_logprob_diff"] < 1e-5
        assert res["loss_megatron"] == pytest.approx(res["loss_torch"], abs=1e-5)
        assert res["grad_norm_megatron"] == pytest.approx(res["grad_norm_torch"], rel=1e-5)
        assert res["max_weight_diff"] < 1e-5 and res["max_weight_change"] > 1e-4


@pytest.mark.parametrize("case", list(CASES))
def test_a_cp2_actor_step_equals_the_pytorch_backend(ranks: list[dict[str, Any]], case: str) -> None:
    for res in (r[case] for r in ranks):
        assert (res["tp"], res["pp"], res["cp"], res["dp"]) == (1, 1, 2, 1)
        assert res["max_logprob_diff"] < 1e-5
        assert res["loss_megatron"] == pytest.approx(res["loss_torch"], abs=1e-5)
        # each rank's gradient is its tokens' part only: without the sum over the context ranks it differs
        assert res["grad_norm_megatron"] == pytest.approx(res["grad_norm_torch"], rel=1e-5)
        assert res["grad_norm_torch"] > 1.0  # above trainer.grad_clip=1: the clipped update is what is compared
        assert res["max_weight_diff_where_grad"] < 1e-6 and res["max_weight_change"] > 1e-4
        # AdamW's first step is lr * g / (|g| + eps): where a gradient is near eps, summation-order noise moves
        # it (measured: the MoE's q_proj, 2.0e-5, among the 0.4% of its elements with |g| <= 1e-6)
        assert res["max_weight_diff"] < (1e-4 if case == "qwen3_moe" else 1e-5)
    # the two ranks ran different halves of the sequences: their forwards saw different tokens
    assert ranks[0][case]["local_tokens"] != ranks[1][case]["local_tokens"]


def test_the_two_halves_are_megatrons_zigzag_of_the_padded_rows(ranks: list[dict[str, Any]]) -> None:
    for case in CASES:
        first, second = (torch.tensor(r[case]["local_tokens"]) for r in ranks)
        assert first.shape == second.shape and first.shape[1] % 2 == 0
        c = first.shape[1] // 2  # rank 0 holds chunks 0 and 3 of 4, rank 1 chunks 1 and 2
        rows = torch.cat([first[:, :c], second[:, :c], second[:, c:], first[:, c:]], dim=1)
        # causal rows right-padded with zeros: each row is its tokens then only padding
        for row in rows.tolist():
            n = next((i for i in range(len(row)) if all(t == 0 for t in row[i:])), len(row))
            assert n > c and all(t != 0 for t in row[:n])


def _main(rank: int, world: int, port: str, out: str) -> None:  # out: this rank's JSON file
    import copy

    import torch
    from tiny import VOCAB, tiny_batch, tiny_qwen2
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from relax.config import load_config
    from relax.trainers.torch.actor import Actor

    def cfg(*extra: str):
        return load_config(None, ["trainer.warmup_steps=0", "trainer.lr=1e-3", "rollout.max_new_tokens=16",
                                  "algorithm.off_policy=none", "trainer.micro_batch_layout=pack",
                                  "trainer.micro_batch_tokens=40", "trainer.grad_clip=1.0", *extra])

    torch.manual_seed(0)
    models = {"qwen2": tiny_qwen2(), "qwen3": Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512))}
    if world == 2:  # the experts see each context rank's tokens; their gradients are summed over both
        from relax.config import ModelConfig
        from relax.models import build_policy, build_tokenizer

        models["qwen3_moe"] = build_policy(ModelConfig(name_or_path="tiny-qwen2", family="qwen3_moe"),
                                           build_tokenizer("bpe-tiny"), seed=0)[0]
    steps = {}
    cases = CASES if world == 2 else FOUR_RANKS
    for case, (family, _, _) in cases.items():  # before any process group: the plain PyTorch step
        batch = tiny_batch()
        torch_actor = Actor(copy.deepcopy(models[family]), cfg())
        logprobs = torch_actor.logprobs(batch)
        batch.old_logprobs = [lp - 0.05 * m for lp, m in zip(logprobs, batch.loss_mask, strict=True)]
        done = torch_actor.train_step(batch)
        grads = {n: p.grad.detach().clone() for n, p in torch_actor.model.named_parameters()}  # clipped
        steps[case] = (batch, logprobs, done, torch_actor.model.state_dict(), grads)

    from megatron.core import parallel_state

    from relax.trainers.megatron.cpu import init_cpu_distributed, shutdown_distributed
    from relax.trainers.megatron.policy import megatron_policy

    result = {}
    for case, (family, distributed, sizes) in cases.items():
        if parallel_state.model_parallel_is_initialized():  # the next layout on the same gloo group
            parallel_state.destroy_model_parallel()
        init_cpu_distributed(rank, world, int(port), cp=2, **sizes)
        batch, logprobs_t, a, after_t, grads = steps[case]
        hf = models[family]
        policy = megatron_policy(copy.deepcopy(hf), distributed_optimizer=distributed)
        seen: list[torch.Tensor] = []  # the token rows this rank's GPTModel ran
        policy.gpt.register_forward_pre_hook(lambda _m, args, seen=seen: seen.append(args[0].detach().clone()))
        mcore_actor = Actor(policy, cfg())  # the policy hands the trainer its optimizer class
        logprobs_m = mcore_actor.logprobs(batch)
        b = mcore_actor.train_step(batch)
        after_m = mcore_actor.model.state_dict()  # gathered over tensor shards; whole on every context rank
        result[case] = {
            "cp": parallel_state.get_context_parallel_world_size(),
            "tp": parallel_state.get_tensor_model_parallel_world_size(),
            "pp": parallel_state.get_pipeline_model_parallel_world_size(),
            "dp": parallel_state.get_data_parallel_world_size(),
            "max_logprob_diff": max(float((x - y).abs().max()) for x, y in zip(logprobs_t, logprobs_m, strict=True)),
            "loss_torch": a.loss, "loss_megatron": b.loss, "grad_norm_torch": a.grad_norm,
            "grad_norm_megatron": b.grad_norm,
            "max_weight_diff": max(float((after_t[k] - after_m[k]).abs().max()) for k in after_m),
            # AdamW's first step is lr * g / (|g| + eps): where |g| is near eps, summation-order noise moves it
            "max_weight_diff_where_grad": max(float(((after_t[k] - after_m[k]).abs() * (grads[k].abs() > 1e-6)).max())
                                              for k in after_m if k in grads),  # tied: lm_head is embed_tokens
            "tiny_grad_fraction": sum(int((g.abs() <= 1e-6).sum()) for g in grads.values())
            / sum(g.numel() for g in grads.values()),
            "max_weight_change": max(float((after_t[k] - hf.state_dict()[k]).abs().max()) for k in after_m),
            "local_tokens": seen[0].tolist(), "local_width": seen[0].shape[1]}
    Path(out).write_text(json.dumps(result))
    shutdown_distributed()  # a gloo group left to the interpreter's exit can abort it


if __name__ == "__main__":
    _main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], str(Path(sys.argv[4]) / f"{sys.argv[1]}.json"))
