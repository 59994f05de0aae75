"""Run every benchmark (``make bench``). Pass ``--quick`` for the short variants where a script
has one, and ``--update-docs`` to publish: each script then writes benchmarks/results/<name>.json
and its table in docs/benchmarks.md; without it they go to the untracked results folder
(``$RELAX_BENCH_OUT`` or benchmarks/results/local/; see output.py)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
BENCHMARKS = [("bench_data.py", []), ("transfer_queue.py", ["--quick"]), ("snapshot_open.py", ["--quick"]),
              ("trainer.py", ["--quick"]), ("prefix.py", ["--quick"]),
              ("engine.py", ["--quick"]), ("engine_guard.py", []), ("rollout_media.py", ["--quick"]),
              ("async_vs_sync.py", ["--quick"]), ("dist_optim.py", ["--quick"]),
              ("checkpoint_shards.py", ["--quick"])]

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the short variants")
    parser.add_argument("--update-docs", action="store_true", help="publish the results (see output.py)")
    args = parser.parse_args()
    failed = []
    for script, quick_args in BENCHMARKS:
        print(f"== {script}", flush=True)
        cmd = [sys.executable, str(HERE / script), *(quick_args if args.quick else []),
               *(["--update-docs"] if args.update_docs else [])]
        if subprocess.run(cmd, cwd=HERE.parent).returncode != 0:
            failed.append(script)
    if failed:
        sys.exit(f"benchmarks failed: {failed}")
