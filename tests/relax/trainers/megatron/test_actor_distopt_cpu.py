"""megatron-core's DistributedOptimizer in the Megatron actor (``trainer.distributed_optimizer``), on two
gloo ranks: at data parallel 2 (dense Qwen2), tensor parallel 2 (Qwen3: its q/k norms summed over the
shards), pipeline parallel 2 (tied embeddings summed over the stages) and data x expert parallel 2
(Qwen3-MoE), one actor step equals the PyTorch backend's one-process AdamW step on the whole batch (loss,
gradient norm, updated weights, AdamW moments gathered back by Hugging Face name), each data-parallel rank
holding only its slice of the moments; and resuming from the PyTorch backend's checkpoint (moments
scattered into the slices) takes the same second step as that backend.

Each rank is a child process (this file as a script) that takes the PyTorch steps first and writes their
checkpoint, then joins the process group and takes the Megatron steps, one parallel layout after another.
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
LAYOUTS = {"dp2": {}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "ep2": {"ep": 2}}
FAMILY = {"dp2": "qwen2", "tp2": "qwen3", "pp2": "qwen2 tied", "ep2": "qwen3_moe"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("mcore-distopt")
    run_ranks(HERE, 2, str(out), what="distributed optimizer", timeout=400)
    return [json.loads((out / f"{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_distributed_optimizer_step_equals_the_pytorch_adamw_step(ranks: list[dict[str, Any]], layout: str) -> None:
    for res in (r[layout] for r in ranks):
        assert res["optimizer"] == "DistributedAdam"
        assert res["loss_megatron"] == pytest.approx(res["loss_torch"], abs=1e-5)
        assert res["grad_norm_megatron"] == pytest.approx(res["grad_norm_torch"], rel=1e-5)
        assert res["grad_norm_torch"] > 0.005  # above trainer.grad_clip: the clipped update is compared
        assert res["max_weight_diff"] < 1e-5 and res["max_weight_change"] > 1e-4
        assert res["missing_moments"] == [] and res["max_moment_diff"] < 1e-6


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resuming_the_pytorch_checkpoint_takes_the_same_second_step(ranks: list[dict[str, Any]], layout: str) -> None:
    for res in (r[layout] for r in ranks):
        assert res["resumed_loss"] == pytest.approx(res["second_loss_torch"], abs=1e-5)
        assert res["resumed_grad_norm"] == pytest.approx(res["second_grad_norm_torch"], rel=1e-5)
        assert res["resumed_max_weight_diff"] < 1e-5


def test_each_data_parallel_rank_keeps_a_slice_of_the_moments(ranks: list[dict[str, Any]]) -> None:
    held = [r["dp2"]["slice_numel"] for r in ranks]  # two data-parallel ranks: half of every weight each
    total = ranks[0]["dp2"]["local_numel"]
    assert sum(held) == total and max(held) < 0.6 * total
    # dp=2 x ep=2: the dense weights split in two, each rank's experts (an expert-data-parallel group of 1) whole
    assert all(r["ep2"]["slice_numel"] < r["ep2"]["local_numel"] for r in ranks)
    for layout in ("tp2", "pp2"):  # one data-parallel rank: it holds its whole shard or stage
        assert all(r[layout]["slice_numel"] == r[layout]["local_numel"] for r in ranks)


def _models() -> dict[str, Any]:
    import torch
    from test_actor_pp2_cpu import _tiny_tied
    from tiny import VOCAB, tiny_qwen2
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from relax.config import ModelConfig
    from relax.models import build_policy, build_tokenizer

    torch.manual_seed(0)
    qwen3 = Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         max_position_embeddings=512))
    moe = build_policy(ModelConfig(name_or_path="tiny-qwen2", family="qwen3_moe"), build_tokenizer("bpe-tiny"),
                       seed=0)[0]
    return {"qwen2": tiny_qwen2(), "qwen3": qwen3, "qwen2 tied": _tiny_tied(), "qwen3_moe": moe}


def _main(rank: int, port: str, out_dir: str) -> None:
    import copy

    from tiny import tiny_batch

    from relax.config import load_config
    from relax.trainers.checkpoint.optim_state import optimizer_state
    from relax.trainers.torch.actor import Actor

    def cfg(*extra: str):
        return load_config(None, ["trainer.warmup_steps=2", "trainer.lr=1e-3", "trainer.weight_decay=0.1",
                                  "rollout.max_new_tokens=16", "algorithm.off_policy=none", "trainer.grad_clip=0.005",
                                  "trainer.micro_batch_tokens=40", *extra])

    models = _models()
    out = Path(out_dir)
    torch_side = {}
    for layout, family in FAMILY.items():  # before any process group: the plain PyTorch steps
        batch = tiny_batch(n=8) if family != "qwen3_moe" else tiny_batch(n=8, lengths=(3, 9, 5, 7))
        actor = Actor(copy.deepcopy(models[family]), cfg())
        first = actor.train_step(batch)
        ckpt = str(out / f"torch-{layout}-{rank}")
        actor.trainer.save(ckpt)
        # copies: the HF model's state dict and AdamW's state are the live tensors the second step updates
        state = copy.deepcopy(
            (actor.model.state_dict(), optimizer_state(actor.model, actor.trainer.optimizer)["state"])
        )
        second = actor.train_step(batch)
        torch_side[layout] = (batch, first, state, ckpt, second, actor.model.state_dict())

    from megatron.core import parallel_state

    from relax.trainers.megatron.cpu import init_cpu_distributed, shutdown_distributed
    from relax.trainers.megatron.policy import megatron_policy

    result: dict[str, Any] = {}
    for layout, sizes in LAYOUTS.items():
        family = FAMILY[layout]
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        init_cpu_distributed(rank, 2, int(port), **sizes)
        batch, a, (after_t, moments_t), ckpt, second, after_second = torch_side[layout]
        actor = Actor(megatron_policy(copy.deepcopy(models[family]), distributed_optimizer=True), cfg())
        b = actor.train_step(batch)
        after_m = actor.model.state_dict()
        moments_m = optimizer_state(actor.model, actor.trainer.optimizer)["state"]
        opt = actor.trainer.optimizer
        slices = sum(p.numel() for part in opt._parts for g in part.optimizer.param_groups for p in g["params"])
        resumed = Actor(megatron_policy(copy.deepcopy(models[family]), distributed_optimizer=True), cfg())
        resumed.trainer.load(ckpt)
        c = resumed.train_step(batch)
        after_c = resumed.model.state_dict()
        result[layout] = {
            "optimizer": type(opt).__name__, "slice_numel": slices,
            "local_numel": sum(p.numel() for p in actor.model.parameters()),
            "loss_torch": a.loss, "loss_megatron": b.loss, "grad_norm_torch": a.grad_norm,
            "grad_norm_megatron": b.grad_norm,
            "max_weight_diff": max(float((after_t[k] - after_m[k]).abs().max()) for k in after_m),
            "max_weight_change": max(float((after_t[k] - models[family].state_dict()[k]).abs().max())
                                     for k in after_m),
            "missing_moments": sorted(k for k in moments_t if moments_t[k] and not moments_m.get(k)),
            "max_moment_diff": max(float((moments_t[k][m] - moments_m[k][m]).abs().max()) for k in moments_t
                                   for m in ("exp_avg", "exp_avg_sq") if moments_m.get(k)),
            "second_loss_torch": second.loss, "second_grad_norm_torch": second.grad_norm,
            "resumed_loss": c.loss, "resumed_grad_norm": c.grad_norm,
            "resumed_max_weight_diff": max(float((after_second[k] - after_c[k]).abs().max()) for k in after_c)}
    (out / f"{rank}.json").write_text(json.dumps(result))
    shutdown_distributed()  # a gloo group left to the interpreter's exit can abort it


if __name__ == "__main__":
    _main(int(sys.argv[1]), sys.argv[3], sys.argv[4])
