"""``trainer.backend=megatron`` for the PPO critic: megatron-core's value model reads the values of
``ValueHeadModel``, takes the same critic step, and speaks its state-dict layout (checkpoints of
either backend load into the other); the critic role runs on it in the RL loop.

megatron keeps process-wide state, so the checks run once in a child process (this file as a
script, like test_actor_cpu.py) that writes JSON; the tests assert on it. Same initial weights
(the tiny Qwen2 of the torch trainer tests, converted exactly, with the same non-zero value
head), same batch, same config.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from relax.services.policy import build_model
from tests.relax.trainers.megatron.child_ranks import run_child

pytest.importorskip(
    "megatron.core",
    reason="megatron-core does not import; pip install --no-deps megatron-core==0.16.1",
    exc_type=ImportError,
)

HERE = Path(__file__).resolve()

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def child(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("mcore-critic") / "critic.json"
    return run_child(HERE, out)


@pytest.mark.parametrize("layout", ["pack", "bucket"])
def test_values_equal_the_value_head_model(child: dict[str, Any], layout: str) -> None:
    res = child[layout]
    assert res["packed_rows"] == (layout == "pack")  # the pack layout did put several samples in a row
    assert res["value_diff"] < 1e-5
    assert res["value_max"] > 0.1  # a non-zero head reads something: not 0 == 0


@pytest.mark.parametrize("layout", ["pack", "bucket"])
def test_one_critic_step_equals_the_pytorch_backend(child: dict[str, Any], layout: str) -> None:
    res = child[layout]
    assert res["keys_match"]
    assert res["loss_megatron"] == pytest.approx(res["loss_torch"], abs=1e-5)
    assert res["grad_norm_megatron"] == pytest.approx(res["grad_norm_torch"], rel=1e-5)
    assert res["grad_norm_torch"] > 1.0  # above trainer.grad_clip=1: the clipped update is what is compared
    assert res["max_weight_diff"] < 1e-5 and res["max_weight_change"] > 1e-4
    assert res["head_change"] > 1e-4  # the value head itself was trained


def test_return_logits_gives_the_value_head_models_logits_and_values(child: dict[str, Any]) -> None:
    assert child["return_logits_diff"] < 1e-4


def test_a_fresh_critic_predicts_zero_and_leaves_the_rng_alone(child: dict[str, Any]) -> None:
    assert child["fresh_values_all_zero"]
    assert child["rng_untouched"]


def test_state_dict_round_trip_is_exact(child: dict[str, Any]) -> None:
    assert child["round_trip_exact"]
    assert child["hf_strict_load"]  # ValueHeadModel's strict load_state_dict takes the megatron critic's
    assert child["version0_backbone_exact"]  # the role's start from the policy's published weights


def test_checkpoints_load_across_backends(child: dict[str, Any]) -> None:
    assert child["megatron_ckpt_in_hf_value_diff"] < 1e-5
    assert child["hf_ckpt_in_megatron_value_diff"] < 1e-5


def test_resume_is_bit_exact_and_crosses_backends(child: dict[str, Any]) -> None:
    assert child["resume_bit_exact"]
    # the optimizer's moments travel in ValueHeadModel's names: either backend resumes the other's run
    assert child["m_from_h_diff"] < 1e-5 and child["h_from_m_diff"] < 1e-5
    assert child["weights_only_diff"] > 1e-4  # without the moments the same two steps land elsewhere


def test_a_foreign_state_dict_names_the_tensor(child: dict[str, Any]) -> None:
    assert "extra.weight" in child["foreign_error"]


def test_the_critic_role_runs_on_megatron_in_the_rl_loop(child: dict[str, Any]) -> None:
    # values committed by the megatron critic in a PPO+GAE run are reproduced by an HF ValueHeadModel
    # loaded from the megatron critic's checkpoint
    run = child["run"]
    assert run["critic_is_megatron"] and run["steps"] == 2 and run["checkpoints"] == [0, 1]
    assert run["value_diff"] < 1e-5 and run["value_max"] > 1e-3


def _tiny_critics(cfg: Any) -> tuple[Any, Any]:
    """The HF and megatron critics of the same tiny Qwen2 with the same non-zero value head."""
    import copy

    import torch
    from tiny import tiny_qwen2

    from relax.models.value_head import ValueHeadModel
    from relax.trainers.megatron.value import megatron_value_model
    from relax.trainers.torch.critic import Critic

    hf = tiny_qwen2()
    hf_model = ValueHeadModel(copy.deepcopy(hf))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        hf_model.value_head.weight.copy_(torch.randn(hf_model.value_head.weight.shape, generator=g))
        hf_model.value_head.bias.fill_(0.25)
    mcore_model = megatron_value_model(copy.deepcopy(hf))
    mcore_model.load_state_dict(hf_model.state_dict())
    return Critic.for_run(hf_model, cfg), Critic.for_run(mcore_model, cfg)


def _max_diff(a: list[Any], b: list[Any]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def _step_checks(layout: str) -> tuple[dict[str, Any], Any, Any, Any]:
    import torch
    from tiny import tiny_batch

    from relax.config import load_config

    cfg = load_config(None, ["trainer.warmup_steps=0", "trainer.lr=1e-3", "rollout.max_new_tokens=16",
                             f"trainer.micro_batch_layout={layout}", "trainer.micro_batch_tokens=40",
                             "trainer.grad_clip=1.0", "algorithm.value_clip=0.2"])
    c_hf, c_m = _tiny_critics(cfg)
    batch = tiny_batch()
    before = {k: v.clone() for k, v in c_hf.model.state_dict().items()}  # HF's are views of the parameters
    v_hf, v_m = c_hf.values(batch), c_m.values(batch)
    res: dict[str, Any] = {"value_diff": _max_diff(v_hf, v_m), "value_max": max(float(v.abs().max()) for v in v_hf),
                           "packed_rows": any(mb.packed for mb in c_m.trainer.micro_batches(batch))}
    g = torch.Generator().manual_seed(3)
    batch.values = [
        (v + 0.1 * torch.randn(v.shape, generator=g)) * m for v, m in zip(v_hf, batch.loss_mask, strict=True)
    ]
    batch.returns = [torch.randn(v.shape, generator=g) * m for v, m in zip(v_hf, batch.loss_mask, strict=True)]
    a, b = c_hf.train_step(batch), c_m.train_step(batch)
    after_t, after_m = c_hf.model.state_dict(), c_m.model.state_dict()
    res.update(loss_torch=a.loss, loss_megatron=b.loss, grad_norm_torch=a.grad_norm, grad_norm_megatron=b.grad_norm,
               keys_match=set(after_t) == set(after_m),
               max_weight_diff=max(float((after_t[k] - after_m[k]).abs().max()) for k in after_t),
               max_weight_change=max(float((after_t[k] - before[k]).abs().max()) for k in after_t),
               head_change=float((after_m["value_head.weight"] - before["value_head.weight"]).abs().max()))
    return res, c_hf, c_m, cfg


def _run_checks(root: Path) -> dict[str, Any]:
    """A two-step PPO+GAE run with ``trainer.backend=megatron`` (actor and critic on megatron, one
    colocated process); the values its critic committed for step 1 (read after one update) come
    back from an HF ValueHeadModel loaded with the critic's step-0 checkpoint."""
    import numpy as np
    import torch

    from relax.config import load_config
    from relax.models.value_head import ValueHeadModel
    from relax.services.driver import train
    from relax.services.queue_contract import CRITIC_VALUES_GROUP
    from relax.services.roles.critic import CriticRole, critic_checkpoints
    from relax.services.run_context import RunContext
    from relax.trainers.checkpoint.trainer_state import load_checkpoint
    from relax.trainers.megatron.value import MegatronValueModel
    from relax.trainers.torch.batch import RolloutBatch
    from relax.trainers.torch.critic import Critic
    from relax.transfer.consumer import load_group_state

    cfg = load_config(
        "tiny-cpu",
        [
            f"root=file://{root}",
            "run_id=ppo-mcore",
            "data.tasks=[arithmetic]",
            "data.train_per_task=16",
            "data.eval_per_task=4",
            "rollout.prompts_per_step=2",
            "rollout.n_samples_per_prompt=2",
            "rollout.max_new_tokens=8",
            "trainer.total_steps=2",
            "trainer.checkpoint_every=1",
            "trainer.warmup_steps=0",
            "algorithm.advantage=gae",
            "model.value_head=true",
            "trainer.backend=megatron",
            "data.reward_fn=tests.relax.services.runtime_helpers:length_reward",
        ],
    )
    result = train(cfg, progress=False)
    ctx = RunContext(cfg)
    role = CriticRole(ctx)  # resumes from the run's newest critic checkpoint
    out: dict[str, Any] = {"critic_is_megatron": isinstance(role.critic.model, MegatronValueModel),
                           "steps": result.steps, "checkpoints": critic_checkpoints(result.run_url)}
    role.close()
    model = ValueHeadModel(build_model(ctx)[0])
    load_checkpoint(f"{result.run_url}/critic/checkpoints/step-000000", model, restore_rng=False)
    queue = ctx.queue()
    queue.refresh()
    ids = load_group_state(queue, CRITIC_VALUES_GROUP).steps[1]["ids"]
    fields = queue.read(ids, ["tokens", "loss_mask", "values"])
    batch = RolloutBatch(ids=ids, input_ids=[torch.tensor(t) for t in fields["tokens"]],
                         loss_mask=[torch.tensor(m, dtype=torch.float32) for m in fields["loss_mask"]])
    want = [torch.from_numpy(np.array(v)) for v in fields["values"]]
    got = Critic(model, lr=0.0).values(batch)
    out.update(value_diff=_max_diff(got, want), value_max=max(float(v.abs().max()) for v in want))
    return out


def _main(out: str) -> None:
    import torch
    from tiny import tiny_batch, tiny_qwen2

    from relax.models.value_head import ValueHeadModel
    from relax.trainers.checkpoint.trainer_state import load_checkpoint
    from relax.trainers.megatron.value import megatron_value_model
    from relax.trainers.torch.critic import Critic

    tmp = Path(out).parent
    result: dict[str, Any] = {}
    for layout in ("pack", "bucket"):
        result[layout], c_hf, c_m, cfg = _step_checks(layout)  # the bucket critics go on below, one step taken
    batch = tiny_batch()
    batch.values, batch.returns = c_m.values(batch), [m * 0.5 for m in batch.loss_mask]

    ids = torch.stack([batch.input_ids[1][:10], batch.input_ids[3][:10]])
    with torch.no_grad():  # one pass for a policy and critic that share weights (ValueHeadModel's return_logits)
        (l_h, v_h), (l_m, v_m) = (c.model(input_ids=ids, return_logits=True) for c in (c_hf, c_m))
    result["return_logits_diff"] = max(float((l_h - l_m).abs().max()), float((v_h - v_m).abs().max()))
    other = tiny_qwen2(seed=9)
    rng = torch.get_rng_state()
    fresh = megatron_value_model(other)
    result["rng_untouched"] = torch.equal(rng, torch.get_rng_state())
    result["fresh_values_all_zero"] = all(not v.any() for v in Critic(fresh, lr=0.0).values(batch))
    # round trips: megatron -> megatron exact, megatron -> HF strict, the policy's weights -> backbone
    state = c_m.model.state_dict()
    fresh.load_state_dict(state)
    again = fresh.state_dict()
    result["round_trip_exact"] = set(again) == set(state) and all(torch.equal(again[k], state[k]) for k in state)
    hf_fresh = ValueHeadModel(tiny_qwen2(seed=9))
    result["hf_strict_load"] = not any(hf_fresh.load_state_dict(state, strict=True))
    policy = tiny_qwen2(seed=5).state_dict()
    fresh.backbone.load_state_dict(policy)
    got = fresh.state_dict()
    result["version0_backbone_exact"] = all(torch.equal(got[f"backbone.{k}"], v) for k, v in policy.items())
    # trainer checkpoints after one step: each backend's weights into the other's model
    m_url, h_url = f"file://{tmp}/ckpt-megatron", f"file://{tmp}/ckpt-hf"
    c_m.trainer.save(m_url, {"step": 0})
    c_hf.trainer.save(h_url, {"step": 0})
    hf_model = ValueHeadModel(tiny_qwen2(seed=9))
    load_checkpoint(m_url, hf_model, restore_rng=False)
    result["megatron_ckpt_in_hf_value_diff"] = _max_diff(Critic(hf_model, lr=0.0).values(batch), c_m.values(batch))
    m_model = megatron_value_model(tiny_qwen2(seed=9))
    load_checkpoint(h_url, m_model, restore_rng=False)
    result["hf_ckpt_in_megatron_value_diff"] = _max_diff(Critic(m_model, lr=0.0).values(batch), c_hf.values(batch))
    # resumes (weights, AdamW moments, schedule): megatron from megatron, megatron from HF, HF from
    # megatron, and a control that gets the weights only; then two steps of each and of the originals
    resumed = {}
    for name, url, make in (("m_from_m", m_url, megatron_value_model), ("m_from_h", h_url, megatron_value_model),
                            ("h_from_m", m_url, ValueHeadModel)):
        resumed[name] = Critic.for_run(make(tiny_qwen2(seed=9)), cfg)
        resumed[name].trainer.load(url)
    weights_only = Critic.for_run(megatron_value_model(tiny_qwen2(seed=9)), cfg)
    load_checkpoint(m_url, weights_only.model, restore_rng=False)
    for critic in (c_m, c_hf, weights_only, *resumed.values()):
        for _ in range(2):
            critic.train_step(batch)
    end = {k: c.model.state_dict() for k, c in (("m", c_m), ("h", c_hf), ("w", weights_only),
                                                *resumed.items())}

    def diff(a: str, b: str) -> float:
        return max(float((end[a][k] - end[b][k]).abs().max()) for k in end[a])

    result["resume_bit_exact"] = all(torch.equal(end["m"][k], end["m_from_m"][k]) for k in end["m"])
    result.update(m_from_h_diff=diff("m_from_h", "h"), h_from_m_diff=diff("h_from_m", "m"),
                  weights_only_diff=diff("w", "m"))
    try:
        fresh.load_state_dict({**state, "extra.weight": torch.zeros(1)})
        result["foreign_error"] = ""
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        result["foreign_error"] = str(e)
    result["run"] = _run_checks(tmp / "run")
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    _main(sys.argv[1])
