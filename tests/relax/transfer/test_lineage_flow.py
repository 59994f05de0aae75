"""A lineage query walks dataset snapshot -> consumed samples -> checkpoints, from real queue records."""

from __future__ import annotations

from transfer_helpers import ROLLOUT_FIELDS, rollout_group

from relax.config import DataConfig, RelaxConfig, config_hash
from relax.data.sources import snapshot_from_config
from relax.transfer.consumer import ConsumerGroup, load_group_state, trained_policy_versions
from relax.transfer.lineage import LineageRecord, ParentRef, chain, chain_to_json, code_version, write_record
from relax.transfer.queue import TransferQueue


def test_dataset_to_samples_to_checkpoint(any_url):
    cfg = RelaxConfig(root=any_url, run_id="run", data=DataConfig(tasks=["arithmetic"], train_per_task=4,
                                                                  eval_per_task=2))
    snap = snapshot_from_config(cfg.data, cfg.root)
    queue = TransferQueue.from_config(cfg, "rollouts")
    producer = queue.producer("rollout-0", ROLLOUT_FIELDS)
    for k in range(4):  # policy versions 0, 0, 1, 1
        producer.put(rollout_group(f"g{k}", policy_version=k // 2))
    group = ConsumerGroup(TransferQueue.from_config(cfg, "rollouts"), "actor", ["tokens"], batch_groups=1)
    parent = None
    for step in range(4):
        group.take(step, current_version=step // 2 + 1, timeout=5)
        if step % 2 == 1:  # a checkpoint every two steps
            counts = trained_policy_versions(queue, "actor", up_to_step=step, after_step=step - 2)
            record = LineageRecord(run_id="run", checkpoint=f"step-{step:06d}", step=step, parent=parent,
                                   dataset_snapshot=snap.id, config_hash=config_hash(cfg),
                                   code_version=code_version(), manifest_versions={"rollouts": queue.compact()},
                                   samples_by_policy_version=counts, created_at=float(step))
            write_record(cfg.root, record)
            parent = ParentRef("run", record.checkpoint)
    records = chain(cfg.root, "run")
    # two groups of two samples per checkpoint: the first saw version 0 only, the second version 1 only
    assert [(r.checkpoint, r.samples_by_policy_version) for r in records] == [
        ("step-000003", {1: 4}), ("step-000001", {0: 4})]
    assert records[0].manifest_versions == {"rollouts": 2} and records[1].manifest_versions == {"rollouts": 1}
    graph = chain_to_json(records)
    edges = {(e["from"], e["to"], e["kind"]) for e in graph["edges"]}
    assert ("checkpoint:run/step-000003", "checkpoint:run/step-000001", "parent") in edges
    assert ("checkpoint:run/step-000001", f"dataset:{snap.id}", "trained_on") in edges
    assert any(n["id"] == f"dataset:{snap.id}" for n in graph["nodes"])
    # and the checkpoint's samples are exactly what the consumer group recorded
    steps = load_group_state(queue, "actor").steps
    assert sum(len(steps[s]["ids"]) for s in (0, 1)) == records[1].sample_count == 4
