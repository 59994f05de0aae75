"""benchmarks/gpu_check.py, the script a session lent a GPU runs once, works before it gets there: its
--tiny mode takes the same code paths (actor steps with and without bf16 autocast, native-engine and
HF decode) on this machine's CPU and writes the JSON the docs table is made from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_gpu_check_script_runs_its_tiny_mode_on_a_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--tiny", "--skip-tests", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["device"].startswith("cpu") and result["model"] == "tiny" and "gpu_tests" not in result
    step = result["actor_step"]
    assert step["bf16"]["tokens_per_s"] > 0 and step["fp32"]["tokens_per_s"] > 0 and step["bf16_speedup"] > 0
    mcore = result["megatron_step"]  # megatron-core is in the test environment
    assert mcore["adamw"]["tokens_per_s"] > 0 and mcore["distributed"]["tokens_per_s"] > 0
    assert mcore["adamw_over_torch"] > 0 and mcore["distributed_over_torch"] > 0
    decode = result["decode"]
    assert decode["native_tokens_per_s"] > 0 and decode["hf_tokens_per_s"] > 0
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == result  # the last line is the same JSON
