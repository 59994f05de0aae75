"""Checkpoint registration pieces (deck page, lineage conversion, checkpoint directory) and the
nightly config task, on hand-made lineage records: no training needed."""

from __future__ import annotations

import base64
import re
from dataclasses import replace
from datetime import datetime

from relax.config import load_config
from relax.data.snapshot import SnapshotInfo
from relax.pipeline import EvalReport, TrainSummary
from relax.transfer.lineage import LineageRecord, ParentRef, chain, chain_to_json, chain_to_text, write_record
from tasks.register import OmniRLResult, checkpoint_dir, deck_html, lineage_from_graph
from tasks.retrain import retrain_config

PNG = b"\x89PNG\r\n\x1a\nnot-really-a-png"


def record(run: str, step: int, parent: ParentRef | None, created: float, root: str) -> LineageRecord:
    name = f"step-{step:06d}"
    return LineageRecord(run, name, step, parent, "ds-0123456789abcdef", "cfg0", "code0", {"rollouts": step},
                         {step: 4}, created, {"checkpoint_url": f"{root}/runs/{run}/checkpoints/{name}"})


def two_runs(root: str) -> None:
    """Run a: steps 0, 1; run b starts from a's step 1 and makes step 0."""
    write_record(root, record("a", 0, None, 100.0, root))
    write_record(root, record("a", 1, ParentRef("a", "step-000000"), 200.0, root))
    write_record(root, record("b", 0, ParentRef("a", "step-000001"), 300.0, root))


def test_lineage_is_newest_first_with_parents_across_runs(tmp_path):
    root = f"file://{tmp_path}/root"
    two_runs(root)
    records = chain(root, "b")
    lineage = lineage_from_graph({"records": chain_to_json(records), "chain_text": chain_to_text(records), "svg": ""})
    assert lineage.head == "b/step-000000"
    assert [(s.run_id, s.checkpoint, s.parent) for s in lineage.steps] == [
        ("b", "step-000000", "a/step-000001"), ("a", "step-000001", "a/step-000000"), ("a", "step-000000", "")]
    assert all(s.samples == 4 and s.dataset_snapshot == "ds-0123456789abcdef" for s in lineage.steps)


def test_deck_page_embeds_curves_lineage_and_the_table():
    before = EvalReport(accuracy={"arithmetic": 0.25, "shapes": 0.0}, by_modality={"text": 0.25, "image": 0.0},
                        n={"arithmetic": 4, "shapes": 4})
    after = replace(before, accuracy={"arithmetic": 0.75, "shapes": 0.5}, by_modality={"text": 0.75, "image": 0.5})
    summary = TrainSummary(run_id="r<1>", steps=3, checkpoint="file:///x/ckpt", reward_first=0.1, reward_last=0.4)
    page = deck_html(before, after, PNG, '<svg id="lineage"></svg>', summary)
    embedded = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert embedded and base64.b64decode(embedded.group(1)) == PNG
    assert '<svg id="lineage"></svg>' in page
    assert re.search(r"arithmetic\s+4\s+0\.250\s+0\.750", page) and re.search(r"\[image\]\s+0\.000\s+0\.500", page)
    assert "r&lt;1&gt;" in page and "r<1>" not in page  # names are escaped, never markup
    assert "<img" not in deck_html(before, after, None, "", summary)  # no curves yet: no broken image


def test_result_prints_as_a_summary_not_a_repr(tmp_path):
    root = f"file://{tmp_path}/root"
    two_runs(root)
    records = chain(root, "b")
    lineage = lineage_from_graph({"records": chain_to_json(records), "chain_text": chain_to_text(records), "svg": ""})
    before = EvalReport(accuracy={"shapes": 0.25}, by_modality={"image": 0.25}, n={"shapes": 4},
                        confusion={"shapes:count": {"3": {"2": 4}}})
    after = replace(before, accuracy={"shapes": 0.75}, by_modality={"image": 0.75})
    summary = TrainSummary(run_id="b", steps=7, checkpoint=f"{root}/runs/b/checkpoints/step-000000",
                           report_dir=f"{root}/runs/b/report", reward_first=0.125, reward_last=0.5)
    result = OmniRLResult(snapshot=SnapshotInfo(id="ds-0123456789abcdef"), eval_before=before, eval_after=after,
                          train=summary, checkpoint=checkpoint_dir(summary.checkpoint), lineage=lineage)
    text = str(result)
    assert text.splitlines()[0] == "run b: 7 actor steps on data ds-0123456789abcdef, training reward 0.125 -> 0.500"
    assert re.search(r"^shapes\s+4\s+0\.250\s+0\.750$", text, re.M)
    assert f"checkpoint: {tmp_path}/root/runs/b/checkpoints/step-000000" in text
    assert text.splitlines()[-1] == "lineage: 3 checkpoints, newest b/step-000000"
    assert "confusion" not in text and "LineageStep" not in text  # the repr's detail stays in the object


def test_checkpoint_dir_points_at_the_checkpoint_without_copying():
    local = checkpoint_dir("file:///data/relax/runs/r/checkpoints/step-000001")
    assert local.path == "/data/relax/runs/r/checkpoints/step-000001" and local.remote_directory is False
    assert checkpoint_dir("s3://bucket/relax/runs/r/checkpoints/step-000001").path.startswith("s3://bucket/")


def test_retrain_config_continues_from_the_newest_other_run(tmp_path):
    root = f"file://{tmp_path}/root"
    cfg = load_config(None, [f"root={root}", "run_id=nightly", "trainer.sft_steps=5"])
    tick = datetime(2026, 1, 2, 3, 0)
    fresh = retrain_config(cfg=cfg, kickoff_time=tick)  # nothing under the root yet: warm-start as configured
    assert (fresh.run_id, fresh.model.init_checkpoint, fresh.trainer.sft_steps) == ("nightly-20260102-0300", "", 5)

    two_runs(root)
    cont = retrain_config(cfg=cfg, kickoff_time=tick)
    assert cont.model.init_checkpoint == f"{root}/runs/b/checkpoints/step-000000"  # newest record: run b
    assert cont.trainer.sft_steps == 0 and cont.run_id == "nightly-20260102-0300"
    assert replace(cont, run_id=cfg.run_id, model=cfg.model, trainer=cfg.trainer) == cfg  # nothing else changes

    # this tick's own run is never its own starting point (a retried tick keeps its config)
    write_record(root, record("nightly-20260102-0300", 0, ParentRef("b", "step-000000"), 400.0, root))
    assert retrain_config(cfg=cfg, kickoff_time=tick) == cont
