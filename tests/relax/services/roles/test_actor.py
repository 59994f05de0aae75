"""The actor role: on-policy rows from the native float32 engine reuse their behaviour logprobs
instead of a recomputing forward pass, and train the same; a checkpoint without its lineage record
(a kill between the two writes) is not resumed from but redone."""

from __future__ import annotations

import pytest
import torch

import relax.services.roles.actor as actor_role
from relax import objstore
from relax.services.driver import train
from relax.services.policy import build_model
from relax.services.roles.actor import behaviour_is_proximal
from relax.services.run_context import RunContext
from relax.trainers.checkpoint.trainer_state import load_checkpoint
from relax.trainers.torch.actor import Actor
from relax.transfer.lineage import ParentRef, chain, read_record, record_url
from tests.relax.services.runtime_helpers import tiny_config


def _cfg(*overrides: str):
    return tiny_config("file:///unused", "p", *overrides)


def test_only_rows_of_the_current_weights_from_an_exact_engine_reuse_their_logprobs():
    cfg = _cfg()
    assert behaviour_is_proximal(cfg, [3, 3, 3], version=3)
    assert not behaviour_is_proximal(cfg, [3, 2, 3], version=3)  # one stale row: recompute the batch
    sglang = _cfg("rollout.engine=sglang", "resources.num_gpus=1", "resources.rollout_gpus=1")
    assert not behaviour_is_proximal(sglang, [3, 3, 3], version=3)
    assert not behaviour_is_proximal(_cfg("model.dtype=bfloat16"), [3, 3, 3], version=3)
    assert not behaviour_is_proximal(_cfg("algorithm.off_policy=none"), [3, 3, 3], version=3)


def _run(root: str, monkeypatch, reuse: bool) -> tuple[dict, int]:
    calls = []
    original = Actor.logprobs
    monkeypatch.setattr(Actor, "logprobs", lambda self, batch: calls.append(1) or original(self, batch))
    if not reuse:
        monkeypatch.setattr(actor_role, "behaviour_is_proximal", lambda *a: False)
    cfg = tiny_config(root, "p", "trainer.total_steps=3", "trainer.lr=1e-2", "trainer.warmup_steps=0",
                      "trainer.mini_batches=2")
    train(cfg, progress=False)
    store = RunContext(cfg).weights()
    monkeypatch.undo()
    return store.load(store.latest())[0], len(calls)


@pytest.mark.slow
def test_reusing_behaviour_logprobs_trains_like_recomputing_them(tmp_path, monkeypatch):
    reused, forwards_reused = _run(f"file://{tmp_path}/a", monkeypatch, reuse=True)
    recomputed, forwards_recomputed = _run(f"file://{tmp_path}/b", monkeypatch, reuse=False)
    assert forwards_recomputed == 3 and forwards_reused == 0  # colocated steps are on-policy
    for name, w in recomputed.items():
        torch.testing.assert_close(torch.as_tensor(reused[name]), torch.as_tensor(w), atol=1e-4, rtol=0)


def _checkpoint_weights(ctx: RunContext, url: str) -> dict[str, torch.Tensor]:
    model, _ = build_model(ctx)
    load_checkpoint(url, model, restore_rng=False)  # the project's reader: checks the sha256 too
    return model.state_dict()


@pytest.mark.slow
def test_a_checkpoint_killed_before_its_lineage_record_is_redone_and_the_chain_stays_whole(tmp_path):
    # a kill between ActorRole.checkpoint's meta.json and its lineage record leaves exactly this
    # state: the checkpoint's files complete, its record absent
    cfg = tiny_config(f"file://{tmp_path}", "k", "trainer.total_steps=4", "trainer.checkpoint_every=2")
    train(cfg, progress=False)
    ctx = RunContext(cfg)
    before = read_record(ctx.root, "k", "step-000003")
    checkpoint_url = f"{ctx.run_url}/checkpoints/step-000003"
    final = _checkpoint_weights(ctx, checkpoint_url)
    objstore.delete(record_url(ctx.root, "k", "step-000003"))
    assert objstore.exists(f"{ctx.run_url}/checkpoints/step-000003/meta.json")
    assert actor_role.list_checkpoints(ctx) == [1]  # the record-less checkpoint is not resumable

    train(cfg, progress=False)  # resumes from step 1, replays steps 2 and 3 from the queue's records

    assert actor_role.list_checkpoints(ctx) == [1, 3]
    after = read_record(ctx.root, "k", "step-000003")
    assert after.parent == ParentRef("k", "step-000001")  # not a parent without a record
    assert after.samples_by_policy_version == before.samples_by_policy_version  # steps 2-3, counted once
    assert [r.checkpoint for r in chain(ctx.root, "k")] == ["step-000003", "step-000001"]
    replayed = _checkpoint_weights(ctx, checkpoint_url)  # rewritten by the replay
    for name, w in final.items():  # the replay trains the same batches to the same weights
        torch.testing.assert_close(torch.as_tensor(replayed[name]), torch.as_tensor(w), atol=1e-6, rtol=0)


def test_the_actor_role_trains_with_the_exact_top_k_kl(tmp_path):
    # the role scores its reference's top-k and the loss reads it: at step 0 the policy is the
    # reference (KL exactly 0), after two updates it has moved (KL > 0), and the run finishes
    cfg = tiny_config(f"file://{tmp_path}", "topk", "trainer.total_steps=3", "trainer.lr=1e-2",
                      "trainer.warmup_steps=0", "algorithm.kl_coef=0.5", "algorithm.kl_topk=8")
    result = train(cfg, progress=False)
    kl = [m["kl_topk"] for m in sorted(result.metrics("actor"), key=lambda m: m["step"])]
    assert result.steps == 3 and len(kl) == 3
    assert kl[0] == pytest.approx(0.0, abs=1e-6) and kl[2] > 1e-6


def test_a_corrupt_newest_checkpoint_is_skipped_and_the_run_ends_where_it_would_have(tmp_path, caplog):
    # a 6-step run stopped after 4 steps (checkpoints at steps 1 and 3) and resumed, twice; in one, a byte of the
    # newest checkpoint is flipped before the resume. That run resumes from step 1 with a warning naming step 3,
    # replays steps 2-3 from the queue's records (the redone checkpoint keeps its lineage record), and ends with
    # the same weights as the other, bit for bit (exact staleness, CPU)
    from relax.transfer.weights import WeightStore

    finals = {}
    for name in ("clean", "corrupt"):
        cfg = tiny_config(f"file://{tmp_path}/{name}", "c", "trainer.total_steps=6", "trainer.checkpoint_every=2",
                          "queue.exact_staleness=true")
        train(cfg, progress=False, max_steps=4)
        if name == "corrupt":
            pt = tmp_path / name / "runs" / "c" / "checkpoints" / "step-000003" / "trainer.pt"
            data = bytearray(pt.read_bytes())
            data[len(data) // 3] ^= 0x01
            pt.write_bytes(bytes(data))
        train(cfg, progress=False)
        finals[name], _ = WeightStore(cfg.root, "c").load()
        assert [r.checkpoint for r in chain(cfg.root, "c")] == ["step-000005", "step-000003", "step-000001"]
    assert "step-000003/trainer.pt fails its sha256 check" in caplog.text
    assert finals["clean"].keys() == finals["corrupt"].keys()
    for key, w in finals["clean"].items():
        assert torch.equal(torch.as_tensor(finals["corrupt"][key]), torch.as_tensor(w)), key
