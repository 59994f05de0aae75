"""The run's judge record, ``runs/<id>/genrm.json``: which generative judge grades the run's rewards.

The first start of a run with ``genrm`` writes the judge's identity (its weights' content hash,
its template's hash, its verdict kind and where it came from: relax.services.judge_engines). A later
start (a restart, a resume) with another judge is refused: the rewards would change meaning
mid-run. With ``genrm.allow_change=true`` it grades on and the change is appended to the record.
Every checkpoint's lineage record carries the judge that graded up to it (:func:`judge_lineage`).
"""

from __future__ import annotations

import json
import time
from typing import Any

from relax import objstore
from relax.config import ConfigError
from relax.services.run_context import RunContext

RECORD = "genrm.json"


class JudgeChanged(ConfigError):
    """A resumed run's judge is not the one it started with: a user's choice, so no restart heals it."""


def read_judge_record(run_url: str) -> dict[str, Any] | None:
    """The run's judge record (the first start's judge and any allowed changes), or None without a judge."""
    url = objstore.join(run_url, RECORD)
    if not objstore.exists(url):
        return None
    record = json.loads(objstore.read_bytes(url))
    if not isinstance(record, dict) or not isinstance(record.get("judge"), dict) \
            or not isinstance(record.get("changes"), list):
        raise ValueError(f"{url} is not a judge record (an object with a 'judge' object and a 'changes' list); "
                         f"restore it from the run's history, or remove it to let the next start record its judge")
    return record


def check_judge_record(ctx: RunContext, identity: dict[str, Any]) -> None:
    """First start: record the judge. Later starts: the same judge, or (``genrm.allow_change``) the change recorded."""
    url = objstore.join(ctx.run_url, RECORD)
    record = read_judge_record(ctx.run_url)
    if record is None:
        objstore.write_bytes(url, json.dumps({"judge": identity, "changes": []}, indent=2).encode())
        return
    was = record["judge"]
    differs = {k: (was.get(k), identity[k]) for k in ("model_id", "template_hash", "verdict")
               if was.get(k) != identity[k]}
    if not differs:
        return
    if not ctx.cfg.genrm.allow_change:
        raise JudgeChanged(f"run {ctx.cfg.run_id} was graded by judge {was} and this start's judge differs in "
                           f"{differs}: rewards would change meaning mid-run. Restore that judge, or resume with "
                           f"genrm.allow_change=true to grade on with the new one (the change is recorded)")
    record["changes"].append({"at": time.time(), "from": was, "to": identity})
    record["judge"] = identity
    objstore.write_bytes(url, json.dumps(record, indent=2).encode())


def judge_lineage(run_url: str) -> dict[str, Any]:
    """``{"judge": identity, "judge_changes": n}`` for a checkpoint's lineage record; {} without a judge."""
    record = read_judge_record(run_url)
    if record is None:
        return {}
    return {"judge": record["judge"], **({"judge_changes": len(record["changes"])} if record["changes"] else {})}
