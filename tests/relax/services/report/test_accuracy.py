"""The README's accuracy table against the file a run writes (``make check-readme``)."""

from __future__ import annotations

import json
from pathlib import Path

from relax.rollout.evaluation import EvalReport
from relax.services.report.accuracy import main, readme_mismatches, write_accuracy

README = Path(__file__).resolve().parents[4] / "README.md"


def _record_from_readme() -> dict:
    import re

    rows = re.findall(r"^\|\s*(\w+)\s*\|\s*`([\w-]+)`\s*\|\s*([0-9.]+)\s*\|\s*([0-9.]+)\s*\|\s*$",
                      README.read_text(), re.M)
    assert len(rows) == 3, "the README's table of make run's accuracy moved or changed shape"
    return {"tasks": {task: {"before": float(b), "after": float(a)} for _, task, b, a in rows}}


def test_the_readme_agrees_with_a_run_that_printed_its_table_and_names_each_row_that_does_not():
    record = _record_from_readme()
    assert readme_mismatches(README.read_text(), record) == []
    record["tasks"]["tones"]["after"] = 0.914  # a later commit changed what make run prints
    assert readme_mismatches(README.read_text(), record) == [
        f"audio/tones after RL: README {_record_from_readme()['tasks']['tones']['after']:.3f}, the run 0.914"]
    del record["tasks"]["largest"]
    assert any("names a task this run did not evaluate" in m for m in readme_mismatches(README.read_text(), record))
    assert readme_mismatches("no table here", record)[0].startswith("README.md has no accuracy table")


def test_a_run_writes_its_table_and_the_check_exits_by_it(tmp_path, capsys):
    before = EvalReport(accuracy={"largest": 0.03125}, by_modality={"text": 0.03125})
    after = EvalReport(accuracy={"largest": 1.0}, by_modality={"text": 1.0})
    url = write_accuracy(f"file://{tmp_path}/report", before, after)
    assert json.loads((tmp_path / "report" / "accuracy.json").read_text())["tasks"] == {
        "largest": {"before": 0.031, "after": 1.0}}  # rounded as the table prints it
    readme = tmp_path / "README.md"
    readme.write_text(
        "| modality | task | before RL | after RL |\n|---|---|---|---|\n| text | `largest` | 0.031 | 1.000 |\n"
    )
    assert main([str(readme), url]) == 0
    readme.write_text(readme.read_text().replace("1.000", "0.977"))
    assert main([str(readme), url]) == 1
    assert "text/largest after RL: README 0.977, the run 1.000" in capsys.readouterr().err
    assert main([str(readme), f"file://{tmp_path}/nowhere.json"]) == 2
