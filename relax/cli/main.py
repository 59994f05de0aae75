"""``relax`` command line: one sub-command per area, each in its own module.

Errors a user can fix (bad config, bad data) print one ``error:`` line and exit with
status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from relax.cli import (
    config_cmd,
    data_cmd,
    export_cmd,
    genrm_cmd,
    lineage_cmd,
    replay_cmd,
    report_cmd,
    run_cmd,
    scale_cmd,
    train_cmd,
)
from relax.cli.args import CommandError
from relax.config import ConfigError
from relax.data.errors import DataError
from relax.services.run_record import RunConfigMismatch
from relax.transfer.errors import TransferError
from relax.transfer.lineage import LineageError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relax", description="Relax: asynchronous omni-modal RL post-training.")
    sub = parser.add_subparsers(
        dest="area", required=True, metavar="{config,data,run,eval,train,role,status,scale,lineage,replay,export,genrm}"
    )
    config_cmd.register(sub)
    data_cmd.register(sub)
    run_cmd.register(sub)
    train_cmd.register(sub)
    lineage_cmd.register(sub)
    report_cmd.register(sub)
    replay_cmd.register(sub)
    scale_cmd.register(sub)
    export_cmd.register(sub)
    genrm_cmd.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (CommandError, ConfigError, DataError, LineageError, TransferError, RunConfigMismatch) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
