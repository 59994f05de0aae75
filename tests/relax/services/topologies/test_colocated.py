"""The colocated topology end to end: train, stop, resume, faulty rewards; invariants from the manifests."""

from __future__ import annotations

import numpy as np
import pytest

from relax import objstore
from relax.services.driver import train
from relax.services.run_context import RunContext
from tests.relax.services.manifest_checks import check_run
from tests.relax.services.runtime_helpers import FAULTY_PATH, tiny_config

pytestmark = pytest.mark.slow


def test_stop_and_resume_is_one_run(tmp_path):
    cfg = tiny_config(f"file://{tmp_path}", "resume")
    first = train(cfg, progress=False, max_steps=3)
    assert first.steps == 3
    second = train(cfg, progress=False)  # same command again: continues from the checkpoint at step 1
    assert second.steps == 4
    ctx = RunContext(cfg)
    stats = check_run(ctx, 4)
    assert stats["dropped"] == 0
    # step 2 ran before the restart and was replayed from the record (same samples), not retaken
    replayed = [m for m in second.metrics("actor") if m.get("replayed")]
    assert [m["step"] for m in replayed] == [2]
    assert second.report_dir.startswith("file://")
    for name in ("metrics.jsonl", "events.out.tfevents.relax", "curves.png"):
        assert objstore.exists(objstore.join(second.report_dir, name))


def test_faulty_reward_function_is_recorded_and_run_continues(tmp_path):
    cfg = tiny_config(f"file://{tmp_path}", "faulty", f"data.reward_fn={FAULTY_PATH}", "trainer.total_steps=2")
    result = train(cfg, progress=False)
    assert result.steps == 2
    assert sum(m["reward_errors"] for m in result.metrics("rollout")) > 0
    queue = RunContext(cfg).queue()
    queue.refresh()
    ids = [sid for sid in queue.state.samples]
    rows = queue.read(ids, ["error", "loss_mask", "reward"])
    errored = [i for i, e in enumerate(rows["error"]) if e]
    assert errored and all("judge unavailable" in rows["error"][i] for i in errored)
    assert all(not np.any(rows["loss_mask"][i]) and rows["reward"][i] == 0 for i in errored)
    clean = [i for i, e in enumerate(rows["error"]) if not e]
    assert clean and all(rows["reward"][i] == 1.0 for i in clean)
