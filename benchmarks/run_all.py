"""Run every benchmark (``make bench``); each writes benchmarks/results/<name>.json and its
table in docs/benchmarks.md. Pass ``--quick`` for the short variants where a script has one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
BENCHMARKS = [("bench_data.py", []), ("transfer_queue.py", ["--quick"]), ("snapshot_open.py", ["--quick"]),
              ("trainer.py", ["--quick"]), ("prefix.py", ["--quick"]),
              ("engine.py", ["--quick"]), ("rollout_media.py", ["--quick"]),
              ("async_vs_sync.py", ["--quick"])]

if __name__ == "__main__":
    quick = "--quick" in sys.argv[1:]
    failed = []
    for script, quick_args in BENCHMARKS:
        print(f"== {script}", flush=True)
        cmd = [sys.executable, str(HERE / script), *(quick_args if quick else [])]
        if subprocess.run(cmd, cwd=HERE.parent).returncode != 0:
            failed.append(script)
    if failed:
        sys.exit(f"benchmarks failed: {failed}")
