"""Pipeline parallel 2 on CPU (gloo): one actor step through megatron-core's 1F1B schedule equals
the PyTorch backend's step (loss, gradient norm, metrics, updated weights gathered back to the
Hugging Face layout), and HF weights loaded into the two stages export back exactly, tied
embeddings included (megatron's last-stage copy of the embedding).

Each rank is a child process (this file as a script; megatron keeps process-wide state) that first
takes the PyTorch steps on copies of the same tiny Qwen2 models (4 layers: 2 per stage), then joins
the process group and repeats them at pp=2 (and tp=2 x pp=2 on four ranks), writing JSON.
"""

from __future__ import annotations

import json
import math
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

pytestmark = pytest.mark.slow

LAYOUTS = {"untied": "pack", "tied": "bucket"}  # the tied model also covers padded rows


def _run(tmp: Path, tp: int, pp: int) -> list[dict[str, Any]]:
    run_ranks(HERE, tp * pp, str(tp), str(pp), str(tmp), what=f"tp={tp} x pp={pp}")
    return [json.loads((tmp / f"{r}.json").read_text()) for r in range(tp * pp)]


@pytest.fixture(scope="module")
def pp2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _run(tmp_path_factory.mktemp("mcore-pp2"), tp=1, pp=2)


@pytest.fixture(scope="module")
def tp2pp2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _run(tmp_path_factory.mktemp("mcore-tp2pp2"), tp=2, pp=2)


def test_each_stage_holds_its_own_layers(pp2: list[dict[str, Any]]) -> None:
    assert [(r["pp_rank"], r["first_layer"], r["local_layers"]) for r in pp2] == [(0, 0, 2), (1, 2, 2)]
    assert pp2[0]["has_embedding"] and not pp2[0]["has_output_layer"]
    assert pp2[1]["has_output_layer"] and not pp2[1]["has_embedding"]
    assert pp2[1]["tied_output_copy"]  # megatron's copy of the tied embedding on the last stage


@pytest.mark.parametrize("model", list(LAYOUTS))
def test_load_export_round_trip_is_exact(pp2: list[dict[str, Any]], model: str) -> None:
    for res in pp2:
        assert res[model]["round_trip_exact"], res[model]["round_trip_diff"]


def _assert_step_equal(results: list[dict[str, Any]], model: str) -> None:
    for res in results:
        r = res[model]
        assert r["micro_batches"] >= 3  # the 1F1B schedule interleaves forward and backward passes
        assert r["loss_megatron"] == pytest.approx(r["loss_torch"], abs=1e-5)
        assert r["max_metric_diff"] < 1e-5
        assert r["max_weight_diff"] < 1e-5 and r["max_weight_change"] > 1e-4
        if model == "untied":
            assert r["grad_norm_torch"] > 1.0  # above trainer.grad_clip=1: the clipped update is compared
            assert r["grad_norm_megatron"] == pytest.approx(r["grad_norm_torch"], rel=1e-5)
        else:  # until MegatronPolicy.clip_grad_norm_ skips megatron's embedding copy (param.shared), it
            # counts the tied embedding's gradient twice; nothing else may differ
            twice = sum(other[model]["shared_grad_sq"] for other in results)
            assert twice > 0.1
            assert r["grad_norm_megatron"] == pytest.approx(r["grad_norm_torch"], rel=1e-5) or \
                math.sqrt(r["grad_norm_megatron"] ** 2 - twice) == pytest.approx(r["grad_norm_torch"], rel=1e-5)
    # every rank reports the last stage's loss and metrics
    assert len({res[model]["loss_megatron"] for res in results}) == 1


@pytest.mark.parametrize("model", list(LAYOUTS))
def test_a_pp2_actor_step_equals_the_pytorch_backend(pp2: list[dict[str, Any]], model: str) -> None:
    _assert_step_equal(pp2, model)


def test_a_tp2_pp2_actor_step_equals_the_pytorch_backend(tp2pp2: list[dict[str, Any]]) -> None:
    assert sorted((r["tp_rank"], r["pp_rank"]) for r in tp2pp2) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for model in LAYOUTS:
        for res in tp2pp2:
            assert res[model]["round_trip_exact"], res[model]["round_trip_diff"]
        _assert_step_equal(tp2pp2, model)


def _tiny_tied() -> Any:
    import torch
    from tiny import VOCAB
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                        tie_word_embeddings=True))


def _main(rank: int, tp: int, pp: int, port: str, out: str) -> None:
    import copy

    import torch
    from tiny import tiny_batch, tiny_qwen2

    from relax.config import load_config
    from relax.trainers.torch.actor import Actor

    models = {"untied": tiny_qwen2(layers=4), "tied": _tiny_tied()}
    batch = tiny_batch(n=8)
    cfgs, torch_steps, batches = {}, {}, {}
    for name, hf in models.items():
        # tied: no clipping, since MegatronPolicy.clip_grad_norm_ counts megatron's embedding copy twice
        cfgs[name] = load_config(None, ["trainer.warmup_steps=0", "trainer.lr=1e-3", "rollout.max_new_tokens=16",
                                        "algorithm.off_policy=none", f"trainer.micro_batch_layout={LAYOUTS[name]}",
                                        "trainer.micro_batch_tokens=24", "algorithm.entropy_coef=0.01",
                                        f"trainer.grad_clip={1.0 if name == 'untied' else 0.0}"])
        torch_actor = Actor(copy.deepcopy(hf), cfgs[name])  # before any process group: the plain PyTorch step
        b = copy.deepcopy(batch)
        b.old_logprobs = [lp - 0.05 * m for lp, m in zip(torch_actor.logprobs(b), b.loss_mask, strict=True)]
        batches[name] = b
        torch_steps[name] = (torch_actor.train_step(b), torch_actor.model.state_dict())

    from megatron.core import parallel_state

    from relax.trainers.megatron.cpu import init_cpu_distributed
    from relax.trainers.megatron.model import pipeline_stage
    from relax.trainers.megatron.pipeline import attach_pipeline
    from relax.trainers.megatron.policy import megatron_policy

    init_cpu_distributed(rank, tp * pp, int(port), tp=tp, pp=pp)
    result: dict[str, Any] = {"tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                              "pp_rank": parallel_state.get_pipeline_model_parallel_rank()}
    for name, hf in models.items():
        policy = megatron_policy(copy.deepcopy(hf))
        if name == "tied":
            result["tied_output_copy"] = getattr(policy.gpt, "output_layer", None) is not None and \
                policy.gpt.output_layer.weight is not None
        else:
            first, n, pre, post = pipeline_stage(policy.gpt)
            result.update(first_layer=first, local_layers=n, has_embedding=pre,
                          has_output_layer=post and policy.gpt.output_layer.weight is not None)
        exported, given = policy.state_dict(), hf.state_dict()
        diff = sorted(set(exported) ^ set(given)) + [k for k in given if k in exported
                                                      and not torch.equal(exported[k], given[k])]
        attach_pipeline(policy)
        actor = Actor(policy, cfgs[name])
        b = actor.train_step(batches[name])
        a, after_t = torch_steps[name]
        after_m = policy.state_dict()
        result[name] = {
            "round_trip_exact": not diff, "round_trip_diff": diff[:10], "micro_batches": b.micro_batches,
            "loss_torch": a.loss, "loss_megatron": b.loss, "grad_norm_torch": a.grad_norm,
            "grad_norm_megatron": b.grad_norm,
            "shared_grad_sq": sum(float(p.grad.double().pow(2).sum()) for p in policy.parameters()
                                  if getattr(p, "shared", False) and p.grad is not None),
            "max_metric_diff": max([abs(a.metrics[k] - b.metrics[k]) for k in a.metrics] + [0.0])
            if set(a.metrics) == set(b.metrics) else float("inf"),
            "max_weight_diff": max(float((after_t[k] - after_m[k]).abs().max()) for k in after_t),
            "max_weight_change": max(float((after_t[k] - given[k]).abs().max()) for k in after_t),
        }
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    rank = sys.argv[1]  # argv: RANK WORLD PORT TP PP OUT_DIR (child_ranks.run_ranks)
    _main(int(rank), int(sys.argv[4]), int(sys.argv[5]), sys.argv[3], str(Path(sys.argv[6]) / f"{rank}.json"))
