"""Start a benchmark script as two gloo ranks on this machine and read rank 0's result.

The script is run again once per rank with ``--rank R --port P --rank-out PATH`` (and ``--quick``):
it joins the group on 127.0.0.1:P and rank 0 writes its JSON result to PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from output import add_arguments

REPO = Path(__file__).resolve().parents[1]


def parse_and_launch(script: str, doc: str, rank_main: Callable[[int, int, bool, str], None]
                     ) -> tuple[argparse.Namespace, dict] | None:
    """A two-rank benchmark's entry: its flags (``--quick`` and output.py's) parsed; started as a rank,
    run ``rank_main(rank, port, quick, out)`` and return None; otherwise launch both ranks and return
    (the flags, rank 0's result)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rank-out", default=None, help=argparse.SUPPRESS)
    add_arguments(parser)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.port, args.quick, args.rank_out)
        return None
    return args, launch(script, args.quick)


def launch(script: str, quick: bool, timeout_s: float = 1800) -> dict:
    """Run ``script`` as ranks 0 and 1; rank 0's JSON result. A failed rank exits naming it, with its log."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{Path(script).parent}", "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        procs = [subprocess.Popen([sys.executable, script, "--rank", str(r), "--port", str(port), "--rank-out",
                                   str(out), *(["--quick"] if quick else [])], env=env, cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
        logs = [p.communicate(timeout=timeout_s)[0] for p in procs]
        for r, (p, log) in enumerate(zip(procs, logs, strict=True)):
            if p.returncode != 0:
                raise SystemExit(f"rank {r} failed (rc={p.returncode}):\n{log[-3000:]}")
        return json.loads(out.read_text())
