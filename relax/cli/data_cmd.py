"""``relax data``: snapshot a dataset, inspect snapshots."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import Counter

from relax.cli.args import split_overrides
from relax.config import ConfigError, load_config
from relax.data.errors import DataError
from relax.data.snapshot import Snapshot, SnapshotInfo, list_snapshots
from relax.data.sources import snapshot_from_config
from relax.objstore import absolute_url, exists, join


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="dataset snapshots")
    dsub = p.add_subparsers(dest="cmd", required=True)
    snap = dsub.add_parser(
        "snapshot",
        help="create (or reuse) the content-hashed snapshot of a dataset and print its id",
        description="relax data snapshot [TRAIN_URL] [--eval URL] [--format relax|gsm8k] [--root URL] "
        "[--config PRESET|FILE] [k=v ...]. Without TRAIN_URL the config's data section is used "
        "(the built-in task suite by default).",
    )
    snap.add_argument("items", nargs="*", help="an optional train file (jsonl/parquet, any fsspec URL), then k=v")
    snap.add_argument("--eval", dest="eval_url", default=None, help="held-out rows; default: split off train")
    snap.add_argument("--format", default=None, choices=("relax", "gsm8k"), help="row format of the files")
    snap.add_argument("--root", default=None, help="where snapshots live (default: the config's root)")
    snap.add_argument("--config", default=None, help="preset name or YAML file (default: tiny-cpu)")
    snap.add_argument("--json", action="store_true", help="print the snapshot info as JSON")
    snap.set_defaults(func=_snapshot)
    insp = dsub.add_parser("inspect", help="list snapshots under a root, or show one snapshot",
                           description="relax data inspect ROOT [ID] | relax data inspect SNAPSHOT_URL")
    insp.add_argument("target", help="a root URL (lists its snapshots) or a snapshot folder URL")
    insp.add_argument("snapshot_id", nargs="?", default=None, help="a snapshot id under ROOT")
    insp.add_argument("--split", default="train", help="split whose rows to show")
    insp.add_argument("--rows", type=int, default=3, help="rows to print")
    insp.add_argument("--json", action="store_true", help="print the manifest as JSON")
    insp.set_defaults(func=_inspect)


def _snapshot(args: argparse.Namespace) -> int:
    positional, overrides = split_overrides(args.items)
    if len(positional) > 1:
        raise ConfigError(f"expected at most one train file, got {positional}")
    if positional:
        overrides.append(f"data.train_url={positional[0]}")
    if args.eval_url:
        overrides.append(f"data.eval_url={args.eval_url}")
    if args.format:
        overrides.append(f"data.format={args.format}")
    cfg = load_config(args.config, overrides)
    info = snapshot_from_config(cfg.data, args.root or cfg.root, progress=True)
    if args.json:
        print(json.dumps(dataclasses.asdict(info), indent=2))
    else:
        state = "created" if info.created else "already existed, reused"
        rows = ", ".join(f"{k}={v}" for k, v in sorted(info.rows.items()))
        print(f"snapshot {info.id} ({state})\n  at    {info.url}\n  rows  {rows}\n"
              f"  media {info.media_files} files, {info.media_bytes} bytes")
        print("\n".join(usage_lines(info, args.root)))
    return 0


def usage_lines(info: SnapshotInfo, root: str | None) -> list[str]:
    """How to train and evaluate on the snapshot just made, with the preset docs/quickstart.md
    recommends for what its rows hold (omni-cpu; omni-video-cpu when they hold videos)."""
    modalities = set(Snapshot(info.url).manifest.get("modalities", {}).get("train", {}))
    preset = "omni-video-cpu" if "video" in modalities else "omni-cpu"
    where = f" root={root}" if root else ""
    return [f"train on it:  relax run {preset} data.snapshot={info.id}{where} run_id=mine",
            f"evaluate it:  relax eval {preset} data.snapshot={info.id}{where} --checkpoint CHECKPOINT --show 5",
            "  (docs/quickstart.md, \"Train on your own data\")"]


def _inspect(args: argparse.Namespace) -> int:
    target = absolute_url(args.target)
    if args.snapshot_id is None and not exists(join(target, "manifest.json")):
        ids = list_snapshots(target)
        if not ids:
            raise DataError(f"no dataset snapshots under {target}; create one with `relax data snapshot`")
        for sid in ids:
            info = Snapshot.open(target, sid).info()
            print(f"{sid}  " + " ".join(f"{k}={v}" for k, v in sorted(info.rows.items())))
        return 0
    snap = Snapshot.open(target, args.snapshot_id) if args.snapshot_id else Snapshot(target)
    if args.json:
        print(json.dumps(snap.manifest, indent=2, sort_keys=True))
        return 0
    m = snap.manifest
    print(f"snapshot {snap.id}\n  at     {snap.url}\n  media  {m['media']['files']} files, {m['media']['bytes']} bytes")
    for split in snap.splits:
        print(f"  {split:<6} {m['splits'][split]['rows']} rows; tasks {m['tasks'][split]}; "
              f"modalities {m['modalities'][split]}")
    print(f"  source {json.dumps(m.get('source', {}), sort_keys=True)}")
    shown = Counter()
    for sample in snap.samples(args.split):
        if sum(shown.values()) >= args.rows:
            break
        shown[sample.task] += 1
        media = f" [{len(sample.images)} image(s), {len(sample.audios)} audio]" if sample.modality != "text" else ""
        print(
            f"\n[{sample.id}] task={sample.task}{media}\n  prompt: {sample.prompt_text!r}\n  answer: {sample.answer!r}"
        )
    return 0
