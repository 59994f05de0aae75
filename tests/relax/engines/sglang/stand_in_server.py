"""A stand-in for ``python -m sglang.launch_server`` on a machine without a GPU.

The rollout launches it exactly as it launches SGLang (``rollout.sglang_module`` names this
module): it parses the flags Relax passes with an argparse that knows only the flags SGLang's
own parser was shown to accept (tests/relax/engines/sglang/test_launch_args.py), so an unknown
flag fails here as it would there; it records its argv and CUDA_VISIBLE_DEVICES as JSON in
``$RELAX_STANDIN_ARGV_DIR/<port>.json``; then it serves the native engine on SGLang's routes
(``/generate``, ``/update_weights_from_disk``, ``/health``...), with ``--api-key`` as its bearer
token, allowed to load the run's weight versions (``$RELAX_STANDIN_STORE`` = ``root|run_id``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from relax.engines.guards import TOKEN_ENV

RELAX_SGLANG_STAND_IN = True  # what lets rollout.sglang_module name this module (sglang_process.py)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sglang.launch_server (stand-in)")
    for flag in ("--model-path", "--host", "--dtype", "--api-key"):
        p.add_argument(flag)
    for flag in ("--port", "--tp-size", "--context-length", "--random-seed"):
        p.add_argument(flag, type=int)
    p.add_argument("--mem-fraction-static", type=float)
    for flag in ("--skip-server-warmup", "--trust-remote-code", "--disable-radix-cache"):
        p.add_argument(flag, action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    record = os.environ.get("RELAX_STANDIN_ARGV_DIR")
    if record:
        with open(os.path.join(record, f"{args.port}.json"), "w") as f:
            json.dump({"argv": argv, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}, f)
    if args.api_key:
        os.environ[TOKEN_ENV] = args.api_key
    root, _, run_id = os.environ.get("RELAX_STANDIN_STORE", "|").partition("|")
    from relax.engines.server import main as serve

    serve(["--model-path", args.model_path, "--host", args.host, "--port", str(args.port),
           "--seed", str(args.random_seed or 0), *(["--weight-store-root", root, "--run-id", run_id] if root else [])])


if __name__ == "__main__":
    main()
