"""`relax lineage` as a user runs it: a real subprocess of the installed entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from PIL import Image

from relax.transfer.lineage import LineageRecord, ParentRef, write_record

RELAX = str(Path(sys.executable).with_name("relax"))


def relax(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([RELAX, *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})


def write_runs(root: Path, with_run_b: bool = True) -> None:
    """run-a: step-000010 <- step-000020; run-b retrains from run-a/step-000020: step-000005 <- step-000010."""
    def rec(run: str, step: int, parent: ParentRef | None, ds: str) -> LineageRecord:
        return LineageRecord(run, f"step-{step:06d}", step, parent, ds, "3c9a1f0e2b7d4c55", "0.1.0+g0123456789ab",
                             {"rollouts": step}, {step: 16, step + 1: 16}, 1714560000.0 + step)

    write_record(str(root), rec("run-a", 10, None, "ds-aaaaaaaaaaaaaaaa"))
    write_record(str(root), rec("run-a", 20, ParentRef("run-a", "step-000010"), "ds-aaaaaaaaaaaaaaaa"))
    if with_run_b:
        write_record(str(root), rec("run-b", 5, ParentRef("run-a", "step-000020"), "ds-bbbbbbbbbbbbbbbb"))
        write_record(str(root), rec("run-b", 10, ParentRef("run-b", "step-000005"), "ds-bbbbbbbbbbbbbbbb"))


def test_single_run_is_shown_without_naming_it(tmp_path):
    write_runs(tmp_path / "store", with_run_b=False)
    out = relax("lineage", "store", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "lineage of run-a/step-000020: 2 checkpoints, 1 run, 1 dataset snapshot (newest first)"
    # {20: 16, 21: 16}: 32 samples from policy versions 20 to 21.
    assert lines[1].split()[:7] == ["run-a/step-000020", "step", "20", "samples", "32", "policy", "v20-v21"]


def test_several_runs_are_listed_then_one_is_traced(tmp_path):
    write_runs(tmp_path / "store")
    listing = relax("lineage", "store", cwd=tmp_path)
    assert listing.returncode == 0, listing.stderr
    assert listing.stdout.startswith(f"2 runs with lineage under file://{tmp_path}/store:")
    assert "run-b  2 checkpoint(s), latest step-000010 (step 10)" in listing.stdout
    assert "continues run-a/step-000020" in listing.stdout
    traced = relax("lineage", "store", "run-b", "--checkpoint", "step-000005", cwd=tmp_path)
    assert traced.returncode == 0, traced.stderr
    keys = [line.split()[0] for line in traced.stdout.splitlines() if line.startswith("run-")]
    assert keys == ["run-b/step-000005", "run-a/step-000020", "run-a/step-000010"]
    assert "  v parent (from earlier run run-a)" in traced.stdout


def test_json_output_is_the_graph(tmp_path):
    write_runs(tmp_path / "store")
    out = relax("lineage", f"file://{tmp_path}/store", "run-b", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    graph = json.loads(out.stdout)
    assert graph["head"] == "run-b/step-000010"
    # 2 datasets + 4 checkpoints; 4 trained_on + 3 parent edges.
    assert len(graph["nodes"]) == 6 and len(graph["edges"]) == 7


def test_graph_png_and_svg(tmp_path):
    write_runs(tmp_path / "store")
    png = relax("lineage", "store", "run-b", "--graph", "out/lineage.png", cwd=tmp_path)
    assert png.returncode == 0, png.stderr
    assert f"graph written to file://{tmp_path}/out/lineage.png" in png.stdout
    with Image.open(tmp_path / "out" / "lineage.png") as img:
        assert img.format == "PNG" and img.width > img.height
    svg = relax("lineage", "store", "run-b", "--graph", "lineage.svg", "--json", cwd=tmp_path)
    assert svg.returncode == 0, svg.stderr
    json.loads(svg.stdout)  # stdout stays pure JSON; the "written to" note goes to stderr
    assert "graph written to" in svg.stderr
    doc = ET.parse(tmp_path / "lineage.svg").getroot()
    assert sum(g.get("class") == "node checkpoint" for g in doc.iter("{http://www.w3.org/2000/svg}g")) == 4


def test_root_without_lineage_is_one_error_line(tmp_path):
    out = relax("lineage", "empty", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.startswith(f"error: no lineage records under file://{tmp_path}/empty/runs")
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr


def test_unknown_run_and_ambiguous_graph_are_errors(tmp_path):
    write_runs(tmp_path / "store")
    missing = relax("lineage", "store", "run-z", cwd=tmp_path)
    assert missing.returncode == 2 and missing.stderr.startswith("error: run 'run-z' has no lineage records")
    ambiguous = relax("lineage", "store", "--graph", "x.svg", cwd=tmp_path)
    assert ambiguous.returncode == 2 and "name one" in ambiguous.stderr and "run-a, run-b" in ambiguous.stderr


def test_run_listing_as_json_and_top_level_help(tmp_path):
    write_runs(tmp_path / "store")
    out = relax("lineage", "store", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    runs = {r["run_id"]: r for r in json.loads(out.stdout)["runs"]}
    assert runs["run-a"]["parent"] is None and runs["run-b"]["parent"] == "run-a/step-000020"
    assert runs["run-b"]["checkpoints"] == 2 and runs["run-b"]["latest"] == "step-000010"
    assert "lineage" in relax("--help", cwd=tmp_path).stdout


@pytest.mark.slow
def test_a_lora_runs_lineage_names_its_base_model_and_base_checkpoint(tmp_path):
    """A LoRA checkpoint holds its adapter alone: `relax lineage` must say what it applies to."""
    from relax.models import build_policy, build_tokenizer
    from relax.services.driver import train
    from relax.trainers.checkpoint.trainer_state import save_checkpoint
    from tests.relax.services.runtime_helpers import tiny_config

    cfg = tiny_config(f"file://{tmp_path}/store", "lo", "model.lora.rank=4", "trainer.total_steps=2")
    base, _ = build_policy(cfg.model, build_tokenizer(cfg.model.tokenizer), seed=cfg.seed)
    warm = save_checkpoint(f"file://{tmp_path}/warm", base)  # a full checkpoint, as a format warm start writes
    cfg = tiny_config(f"file://{tmp_path}/store", "lo", "model.lora.rank=4", "trainer.total_steps=2",
                      f"model.init_checkpoint={warm}")
    train(cfg, progress=False)
    out = relax("lineage", "store", "lo", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("lineage of lo/step-000001: 1 checkpoint")
    assert f"  LoRA adapter r=4 on base model tiny-qwen2, base checkpoint {warm}" in lines
    graph = json.loads(relax("lineage", "store", "lo", "--json", cwd=tmp_path).stdout)
    [node] = [n for n in graph["nodes"] if n["kind"] == "checkpoint"]
    assert node["extra"]["lora"]["base_model"] == "tiny-qwen2" and node["extra"]["lora"]["base_checkpoint"] == warm
