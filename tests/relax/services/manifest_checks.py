"""Invariants of a finished run, read back from its manifests (not from the processes that ran it)."""

from __future__ import annotations

from collections import Counter

from relax.services.queue_contract import ACTOR_GROUP
from relax.services.run_context import RunContext
from relax.transfer.consumer import load_group_state
from relax.transfer.lineage import chain


def check_run(ctx: RunContext, steps: int) -> dict:
    """No sample consumed twice, steps contiguous, staleness within bound, lineage one chain."""
    queue = ctx.queue()
    queue.refresh()
    st = load_group_state(queue, ACTOR_GROUP)
    assert sorted(st.steps) == list(range(steps)), f"actor steps {sorted(st.steps)}"
    counts = Counter(sid for rec in st.steps.values() for sid in rec["ids"])
    twice = [sid for sid, n in counts.items() if n > 1]
    assert not twice, f"consumed more than once: {twice[:5]}"
    batch = ctx.batch_size
    worst = 0
    for step, rec in st.steps.items():
        assert len(rec["ids"]) == batch, f"step {step} has {len(rec['ids'])} samples, want {batch}"
        for sid in rec["ids"]:
            lag = rec["current_version"] - queue.state.samples[sid].policy_version
            assert 0 <= lag <= ctx.cfg.queue.max_staleness, f"{sid}: staleness {lag} at step {step}"
            worst = max(worst, lag)
    missing = set(counts) - set(queue.state.samples)
    assert not missing, f"consumed samples not in the manifest: {sorted(missing)[:3]}"
    records = chain(ctx.root, ctx.cfg.run_id)  # newest first, following parents
    assert records[0].step == steps - 1 and records[-1].parent is None  # one chain back to the first checkpoint
    assert sum(r.sample_count for r in records) == steps * batch
    return {"max_staleness_seen": worst, "consumed": len(counts), "dropped": len(st.dropped)}
