"""``trainer.backend=megatron``: the actor's step on megatron-core's GPTModel equals the PyTorch
backend's, its published weights serve a Hugging Face model, its checkpoints resume bit for bit.

megatron keeps process-wide state, so the checks run once in a child process (this file as a
script, like test_model_cpu.py) that writes JSON; the tests assert on it. Same initial weights
(the tiny Qwen2 of the torch trainer tests, converted exactly), same batch, same config.
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


@pytest.fixture(scope="module")
def child(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("mcore-actor") / "actor.json"
    return run_child(HERE, out)


@pytest.mark.parametrize("layout", ["pack", "bucket"])
def test_one_actor_step_equals_the_pytorch_backend(child: dict[str, Any], layout: str) -> None:
    res = child[layout]
    print(res)
    assert res["loss_torch"] == pytest.approx(res["loss_megatron"], abs=1e-5)
    assert res["grad_norm_torch"] == pytest.approx(res["grad_norm_megatron"], rel=1e-5)
    assert res["grad_norm_torch"] > 0.1  # a real step, not a no-op on both sides
    assert res["max_weight_diff"] < 1e-5 and res["max_weight_change"] > 1e-4


def test_a_sampled_pad_token_gets_the_gradient_hugging_face_gives_it(child: dict[str, Any]) -> None:
    # HF embeds with padding_idx=pad_token_id: a pad token the policy sampled mid-response adds no
    # lookup gradient to its row; megatron's embedding would, and the steps would differ (by 2% of
    # the gradient norm in a tiny run before the fix)
    res = child["pad_token"]
    assert res["pads_in_batch"] >= 3
    assert res["grad_norm_megatron"] == pytest.approx(res["grad_norm_torch"], rel=1e-5)
    assert res["max_weight_diff"] < 1e-5


def test_packed_rows_give_the_unpacked_logprobs(child: dict[str, Any]) -> None:
    assert child["pack_vs_pad_logprob_diff"] < 1e-5


def test_published_weights_reproduce_the_megatron_logprobs_in_a_hf_model(child: dict[str, Any]) -> None:
    assert child["published_keys_match"]
    assert child["published_logprob_diff"] < 1e-4


def test_a_native_engine_serving_the_published_weights_samples_with_the_megatron_logprobs(
    child: dict[str, Any],
) -> None:
    assert child["engine_versions"] == ["1"] and child["engine_tokens"] >= 12
    assert child["engine_logprob_diff"] < 1e-4


def test_checkpoint_resume_is_bit_exact(child: dict[str, Any]) -> None:
    assert child["resume_bit_exact"]


def test_a_foreign_checkpoint_names_the_tensor(child: dict[str, Any]) -> None:
    assert "model.embed_tokens.weight" in child["foreign_error"] or "shape" in child["foreign_error"]


def _main(out: str) -> None:
    import copy

    import torch
    from tiny import tiny_batch, tiny_qwen2

    from relax.config import load_config
    from relax.trainers.megatron.policy import megatron_policy
    from relax.trainers.torch.actor import Actor

    result: dict[str, Any] = {}
    for layout in ("pack", "bucket"):
        cfg = load_config(None, ["trainer.warmup_steps=0", "trainer.lr=1e-3", "rollout.max_new_tokens=16",
                                 "algorithm.off_policy=none", f"trainer.micro_batch_layout={layout}",
                                 "trainer.micro_batch_tokens=40", "algorithm.entropy_coef=0.01"])
        hf = tiny_qwen2()
        torch_actor = Actor(copy.deepcopy(hf), cfg)
        mcore_actor = Actor(megatron_policy(copy.deepcopy(hf)), cfg)
        batch = tiny_batch()
        stale = [lp - 0.05 * m for lp, m in zip(torch_actor.logprobs(batch), batch.loss_mask, strict=True)]
        batch.old_logprobs = stale
        a, b = torch_actor.train_step(batch), mcore_actor.train_step(batch)
        after_t, after_m = torch_actor.model.state_dict(), mcore_actor.model.state_dict()
        result[layout] = {
            "loss_torch": a.loss, "loss_megatron": b.loss, "grad_norm_torch": a.grad_norm,
            "grad_norm_megatron": b.grad_norm,
            "max_weight_diff": max(float((after_t[k] - after_m[k]).abs().max()) for k in after_m),
            "max_weight_change": max(float((after_t[k] - hf.state_dict()[k]).abs().max()) for k in after_m),
        }
    pad_hf = tiny_qwen2(pad_token_id=0)
    torch_pad, mcore_pad = Actor(copy.deepcopy(pad_hf), cfg), Actor(megatron_policy(copy.deepcopy(pad_hf)), cfg)
    pad_batch = tiny_batch()
    for ids in pad_batch.input_ids[1::2]:  # the pad token sampled inside three responses
        ids[5] = 0
    a, b = torch_pad.train_step(pad_batch), mcore_pad.train_step(pad_batch)
    after_t, after_m = torch_pad.model.state_dict(), mcore_pad.model.state_dict()
    result["pad_token"] = {"pads_in_batch": sum(int((ids[4:] == 0).sum()) for ids in pad_batch.input_ids),
                           "grad_norm_torch": a.grad_norm, "grad_norm_megatron": b.grad_norm,
                           "max_weight_diff": max(float((after_t[k] - after_m[k]).abs().max()) for k in after_m)}
    # the same megatron model scores a batch alike whether its rows are packed or padded
    policy = mcore_actor.model
    pad_cfg = load_config(None, ["trainer.micro_batch_layout=pad", "rollout.max_new_tokens=16"])
    padded = Actor(policy, pad_cfg).logprobs(batch)
    packed = mcore_actor.logprobs(batch)
    result["pack_vs_pad_logprob_diff"] = max(float((x - y).abs().max()) for x, y in zip(packed, padded, strict=True))
    # publishing: the HF-layout state dict loads into a plain HF model that scores like megatron
    published = policy.state_dict()
    served = tiny_qwen2(seed=5)
    result["published_keys_match"] = set(published) <= set(served.state_dict())
    served.load_state_dict(published, strict=False)
    hf_lp = Actor(served, pad_cfg).logprobs(batch)
    result["published_logprob_diff"] = max(float((x - y).abs().max()) for x, y in zip(hf_lp, padded, strict=True))
    # ... and a native engine serving them samples with the megatron model's log-probs
    from relax.engines.native.engine import NativeEngine
    from relax.engines.types import GenerateRequest, SamplingParams

    engine = NativeEngine(tiny_qwen2(seed=7), None, max_batch_size=4, max_seq_len=64, seed=0, background=False)
    engine.update_weights(published, "1")
    prompts = [ids[:5].tolist() for ids in batch.input_ids[:3]]
    futures = [
        engine.submit(GenerateRequest(f"r{i}", p, SamplingParams(max_new_tokens=6))) for i, p in enumerate(prompts)
    ]
    while engine.step():
        pass
    gaps, versions = [], set()
    for p, fut in zip(prompts, futures, strict=True):
        c = fut.result()[0]
        versions.add(c.weight_version)
        with torch.no_grad():
            logits = policy(torch.tensor([p + c.output_ids])).logits[0].float()
        logp = torch.log_softmax(logits, -1)
        gaps += [abs(float(logp[len(p) - 1 + i, t]) - lp) for i, (t, lp) in enumerate(zip(c.output_ids, c.logprobs,
                                                                                          strict=True))]
    result["engine_logprob_diff"], result["engine_tokens"], result["engine_versions"] = (
        max(gaps),
        len(gaps),
        sorted(versions),
    )
    # checkpoint after one step, two more steps; a fresh actor resumed from it takes the same two steps
    url = f"file://{Path(out).parent}/ckpt"
    mcore_actor.trainer.save(url, {"step": 1})
    for _ in range(2):
        mcore_actor.train_step(batch)
    resumed = Actor(megatron_policy(tiny_qwen2(seed=9)), cfg)
    resumed.trainer.load(url)
    for _ in range(2):
        resumed.train_step(batch)
    end_a, end_b = mcore_actor.model.state_dict(), resumed.model.state_dict()
    result["resume_bit_exact"] = all(torch.equal(end_a[k], end_b[k]) for k in end_a)
    # a checkpoint of another shape is refused, naming what does not fit
    other = tiny_qwen2(hidden=64).state_dict()
    try:
        resumed.model.load_state_dict(other)
        result["foreign_error"] = ""
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        result["foreign_error"] = str(e)
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    _main(sys.argv[1])
