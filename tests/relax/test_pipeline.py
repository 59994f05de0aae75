"""The pipeline steps the Flyte tasks call, run in-process on a tiny budget."""

from __future__ import annotations

import dataclasses

import pytest

from relax import objstore
from relax.config import ConfigError, load_config
from relax.pipeline import evaluate, latest_checkpoint, lineage, run, train_run, warm_start
from relax.rollout.evaluation import EvalReport, per_task_limit
from relax.services.driver import train
from relax.services.run_context import RunContext

TINY = ["data.tasks=[arithmetic,shapes,tones,tool_lookup]", "model.name_or_path=tiny-omni",
        "model.family=qwen2_5_omni", "data.train_per_task=8", "data.eval_per_task=4", "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=8", "trainer.total_steps=2",
        "trainer.checkpoint_every=1", "trainer.sft_steps=3"]


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return load_config("tiny-cpu", [f"root=file://{tmp_path_factory.mktemp('pipe')}/root", "run_id=p1", *TINY])


def test_warm_start_is_keyed_and_reused(cfg):
    sid = RunContext(cfg).snapshot_info.id
    url = warm_start(cfg, sid)
    meta = objstore.read_bytes(objstore.join(url, "meta.json"))
    assert b"format_warm_start" in meta
    assert warm_start(cfg, sid) == url  # reused, not retrained
    assert objstore.read_bytes(objstore.join(url, "meta.json")) == meta
    other = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, sft_steps=4))
    assert warm_start(other, sid) != url  # a different warm start lives elsewhere
    smaller = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, sft_batch_size=8))
    assert warm_start(smaller, sid) not in (url, warm_start(other, sid))  # fewer demonstrations a step: another
    assert warm_start(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, sft_steps=0)), sid) == ""
    with pytest.raises(ValueError, match="snapshot"):
        warm_start(cfg, "ds-0000000000000000")


def test_evaluate_reports_every_task_and_modality(cfg):
    report = evaluate(cfg, limit=2)
    assert set(report.accuracy) == {"arithmetic", "shapes", "tones", "tool_lookup"}
    assert report.n == {t: 2 for t in report.accuracy}
    assert set(report.by_modality) == {"text", "image", "audio"}
    assert all(0.0 <= v <= 1.0 for v in report.accuracy.values())
    # text = mean of arithmetic and tool_lookup
    assert report.by_modality["text"] == pytest.approx((report.accuracy["arithmetic"] +
                                                        report.accuracy["tool_lookup"]) / 2)
    assert "tones" in report.table() and "before" in report.table(report)
    # per kind of question: shapes and tones declare kinds, and their kinds split each task's prompts
    assert {k.split(":")[0] for k in report.by_kind} == {"shapes", "tones"}
    for task in ("shapes", "tones"):
        kinds = [k for k in report.by_kind if k.startswith(task + ":")]
        assert sum(report.n_by_kind[k] for k in kinds) == report.n[task]
        weighted = sum(report.by_kind[k] * report.n_by_kind[k] for k in kinds) / report.n[task]
        assert weighted == pytest.approx(report.accuracy[task])
    # the confusion counts every prompt of a kind once, and its diagonal is the kind's accuracy
    for key, rows in report.confusion.items():
        assert sum(sum(row.values()) for row in rows.values()) == report.n_by_kind[key]
        right = sum(row.get(truth, 0) for truth, row in rows.items())
        assert right / report.n_by_kind[key] == pytest.approx(report.by_kind[key])


def test_evaluation_is_greedy_and_deterministic(cfg):
    assert evaluate(cfg, limit=2).accuracy == evaluate(cfg, limit=2).accuracy


def test_train_from_warm_start_then_continue_in_a_second_run(cfg):
    sid = RunContext(cfg).snapshot_info.id
    init = warm_start(cfg, sid)
    first = train_run(cfg, init_checkpoint=init, progress=False)
    assert first.steps == 2 and first.checkpoint.endswith("checkpoints/step-000001")
    assert objstore.exists(objstore.join(first.report_dir, "curves.png"))
    again = train_run(cfg, init_checkpoint=init, progress=False)  # a finished run is not retrained
    assert again.steps == 2 and again.checkpoint == first.checkpoint
    assert latest_checkpoint(cfg.root) == first.checkpoint
    second = dataclasses.replace(cfg, run_id="p2")
    result = train_run(second, init_checkpoint=latest_checkpoint(cfg.root, exclude_run="p2"), progress=False)
    graph = lineage(second)["records"]
    assert graph["head"] == "p2/step-000001"
    # one chain: p2's steps, then p1's, each checkpoint pointing at its parent; both trained on the snapshot
    parents = {e["from"]: e["to"] for e in graph["edges"] if e["kind"] == "parent"}
    warm = f"checkpoint:warm-start/{init.rstrip('/').split('/')[-1]}"  # p1 began from the format warm start
    assert parents == {"checkpoint:p2/step-000001": "checkpoint:p2/step-000000",
                       "checkpoint:p2/step-000000": "checkpoint:p1/step-000001",
                       "checkpoint:p1/step-000001": "checkpoint:p1/step-000000",
                       "checkpoint:p1/step-000000": warm}
    warm_node = next(n for n in graph["nodes"] if n["id"] == warm)
    assert warm_node["step"] == cfg.trainer.sft_steps and warm_node["extra"]["checkpoint_url"] == init
    assert {e["to"] for e in graph["edges"] if e["kind"] == "trained_on"} == {f"dataset:{sid}"}
    first_record = next(n for n in graph["nodes"] if n["id"] == "checkpoint:p1/step-000000")
    assert first_record["extra"]["init_checkpoint"] == init  # the warm start it began from
    assert "<svg" in lineage(second)["svg"]
    # the trained policy is what evaluate loads
    assert evaluate(second, result.checkpoint, limit=1).checkpoint == result.checkpoint


def test_per_task_limit_keeps_split_order():
    from relax.data.suite import generate_suite

    samples = generate_suite(["arithmetic", "shapes"], seed=0, train_per_task=1, eval_per_task=3)["eval"]
    picked = per_task_limit(samples, 2)
    assert [s.task for s in picked].count("arithmetic") == 2 and len(picked) == 4
    assert picked == [s for s in samples if s in picked]
    assert isinstance(EvalReport().table(), str)


def test_table_lists_each_kind_of_question_under_its_task():
    # shapes: 1 of 3 count questions right (0.333), 3 of 3 colour questions right (1.0): task mean 4/6
    before = EvalReport(accuracy={"shapes": 0.5}, n={"shapes": 6}, by_kind={"shapes:count": 0.0, "shapes:colour": 1.0},
                        n_by_kind={"shapes:count": 3, "shapes:colour": 3})
    after = EvalReport(accuracy={"largest": 0.25, "shapes": 4 / 6}, n={"largest": 4, "shapes": 6},
                       by_kind={"shapes:count": 1 / 3, "shapes:colour": 1.0},
                       n_by_kind={"shapes:count": 3, "shapes:colour": 3})
    lines = after.table(before).splitlines()
    names = [line.split()[0] for line in lines[1:]]
    assert names == ["largest", "shapes", "colour", "count"]  # kinds sorted, right under their task
    assert lines[3].startswith("  colour") and lines[3].split()[1:] == ["3", "1.000", "1.000"]
    assert lines[4].split()[1:] == ["3", "0.000", "0.333"]
    assert lines[2].split()[1:] == ["6", "0.500", "0.667"]


def test_never_answered_names_the_classes_the_policy_never_gives():
    # colour: red -> red twice; yellow -> red, orange -> "" (no answer). Answers given: {red, ""},
    # so yellow and orange are never answered. count: 3 -> 4 and 4 -> 3: both are given somewhere.
    report = EvalReport(confusion={"shapes:colour": {"red": {"red": 2}, "yellow": {"red": 1}, "orange": {"": 1}},
                                   "shapes:count": {"3": {"4": 1}, "4": {"3": 1}}})
    assert report.never_answered() == {"shapes:colour": ["orange", "yellow"]}
    assert report.table().splitlines()[-1] == "never answered (shapes:colour): orange, yellow"
    assert "never answered" not in EvalReport(confusion={"shapes:count": {"3": {"3": 1}}}).table()


def test_a_text_model_on_media_tasks_fails_before_any_work(tmp_path):
    from relax.config import ConfigError

    cfg = load_config("tiny-cpu", [f"root=file://{tmp_path}", "data.tasks=[largest,shapes]", "data.train_per_task=4",
                                   "data.eval_per_task=2"])
    with pytest.raises(ConfigError, match=r"tasks \['shapes'\] carry images.*qwen2_5_omni"):
        evaluate(cfg)


def test_training_from_a_vanished_checkpoint_names_the_cache_fix(cfg, tmp_path):
    gone = f"file://{tmp_path}/root/warm_start/deleted"
    with pytest.raises(FileNotFoundError, match=r"deleted, is gone.*--overwrite-cache"):
        train_run(dataclasses.replace(cfg, run_id="vanished"), init_checkpoint=gone, progress=False)
    assert not objstore.exists(RunContext(dataclasses.replace(cfg, run_id="vanished")).run_url)  # nothing started


def test_the_pipeline_warm_starts_the_runtime_does_not(cfg):
    third = dataclasses.replace(cfg, run_id="p3")
    with pytest.raises(ConfigError, match=r"trainer.sft_steps=3 .*pipeline"):
        train(third, progress=False)  # the runtime alone would skip the warm start: refused, naming the fix
    assert not objstore.exists(RunContext(third).run_url)
    result = run(third, progress=False, eval_limit=1)
    assert result.start == warm_start(cfg, RunContext(cfg).snapshot_info.id)  # the keyed warm start, reused
    assert result.before.checkpoint == result.start and result.after.checkpoint == result.train.checkpoint
    assert result.train.steps == 2 and result.train.checkpoint.endswith("runs/p3/checkpoints/step-000001")
    assert "p3/step-000001" in result.lineage_text
    first = next(n for n in lineage(third)["records"]["nodes"] if n["id"] == "checkpoint:p3/step-000000")
    assert first["extra"]["init_checkpoint"] == result.start
