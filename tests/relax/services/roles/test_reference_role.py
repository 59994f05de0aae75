"""``algorithm.reference_role``: the reference policy scored by a role of its own.

The reference is a pure function of the row, so moving it from the actor (KL loss) or the
advantage role (``kl_in_reward``) into its own role must not change training: the same seed
gives the same rewards and, to float tolerance, the same weights, while the actor holds no
reference model. Disaggregated, the role is a fourth OS process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relax.config import ConfigError, load_config
from relax.services.driver import train
from relax.services.report.metrics import read_metrics
from relax.services.run_context import RunContext
from tests.relax.services.runtime_helpers import tiny_config

KL = ("algorithm.kl_coef=0.5", "algorithm.kl_estimator=k1", "trainer.total_steps=3", "trainer.lr=1e-2",
      "trainer.warmup_steps=0")


def _run(root, run_id: str, *extra: str):
    cfg = tiny_config(root, run_id, *KL, *extra)
    result = train(cfg, progress=False)
    ctx = RunContext(cfg)
    store = ctx.weights()
    return result, ctx, store.load(store.latest())[0]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["loss", "reward", "topk", "split"])
def test_a_reference_role_trains_exactly_like_a_held_reference(tmp_path, mode):
    extra = {"loss": (), "reward": ("algorithm.kl_in_reward=true",), "topk": ("algorithm.kl_topk=8",),
             "split": ("algorithm.kl_topk=8", "algorithm.kl_topk_weight=0.5")}[mode]
    held, _, w_held = _run(f"file://{tmp_path}/a", "held", *extra)
    role, ctx, w_role = _run(f"file://{tmp_path}/b", "role", *extra, "algorithm.reference_role=true")
    assert held.steps == role.steps == 3
    assert [m["reward"] for m in held.metrics("rollout")] == [m["reward"] for m in role.metrics("rollout")]
    for name, w in w_held.items():
        torch.testing.assert_close(torch.as_tensor(w_role[name]), torch.as_tensor(w), atol=1e-5, rtol=0)
    moved = any(not torch.equal(torch.as_tensor(w), torch.as_tensor(ctx.weights().load(0)[0][n]))
                for n, w in w_role.items())
    assert moved  # it trained (the KL term is not vacuous)
    assert len(read_metrics(ctx.run_url, "reference")) == 3
    queue = ctx.queue()
    queue.refresh()
    columns = {"topk": ["ref_topk_logprobs"], "split": ["ref_topk_logprobs", "ref_logprobs"]}.get(
        mode, ["ref_logprobs"]
    )
    trained = [m for m in queue.state.samples.values() if "advantages" in m.locs]
    assert trained and all(c in m.locs for m in trained for c in columns)
    assert mode == "split" or all("ref_logprobs" not in m.locs for m in trained) == (mode == "topk")
    if mode in ("topk", "split"):  # the top-k rows are stored from each row's first trained token on
        ids = [sid for sid, m in queue.state.samples.items() if "ref_topk_ids" in m.locs]
        got = queue.read(ids, ["tokens", "loss_mask", "ref_topk_ids"])
        for tokens, mask, top in zip(got["tokens"], got["loss_mask"], got["ref_topk_ids"], strict=True):
            first = int(np.flatnonzero(mask)[0])
            assert top.shape == (len(tokens) - first, 8) and first > 0


def test_the_actor_holds_no_reference_with_a_reference_role(tmp_path):
    from relax.services.roles.actor import ActorRole

    ctx = RunContext(tiny_config(f"file://{tmp_path}", "r", "algorithm.kl_coef=0.1", "algorithm.reference_role=true"))
    role = ActorRole(ctx)
    try:
        assert role.reference is None and "ref_logprobs" in role.consumer.fields
    finally:
        role.close()


def test_a_reference_role_without_kl_is_refused():
    with pytest.raises(ConfigError, match="reference_role=true scores a reference nobody uses"):
        load_config("tiny-cpu", ["algorithm.reference_role=true"])


@pytest.mark.slow
def test_disaggregated_runs_the_reference_as_a_fourth_process(tmp_path):
    result, ctx, _ = _run(f"file://{tmp_path}", "dis", "topology=disaggregated", "algorithm.reference_role=true")
    assert result.steps == 3
    assert [m["step"] for m in read_metrics(ctx.run_url, "reference")] == [0, 1, 2]


# the async topology serving the reference as its own Ray Serve deployment: one run with the
# async topology test (tests/relax/services/topologies/test_topologies.py::test_async_topology_on_ray_serve)
