"""``rollout.engine=sglang``: the rollout launches its SGLang servers through the process
launcher, routes to them, reloads their weights from the WeightStore by local folder, and
replaces them when they die, shown end to end on CPU with a stand-in server
(tests/relax/engines/sglang/stand_in_server.py) in place of ``sglang.launch_server``."""

from __future__ import annotations

import json
import os

import pytest
import torch

from relax.engines.guards import TOKEN_ENV
from relax.services.driver import train
from relax.services.policy import build_model
from relax.services.run_context import RunContext
from relax.transfer.weights import WeightStore
from tests.relax.services.manifest_checks import check_run
from tests.relax.services.runtime_helpers import tiny_config

pytestmark = pytest.mark.slow

STAND_IN = "tests.relax.engines.sglang.stand_in_server"


def _flags(argv: list[str]) -> dict[str, str | None]:
    return {a: (argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None)
            for i, a in enumerate(argv) if a.startswith("--")}


def test_the_rollout_launches_routes_reloads_and_replaces_its_sglang_servers(tmp_path, monkeypatch):
    argv_dir = tmp_path / "argv"
    argv_dir.mkdir()
    cfg = tiny_config(f"file://{tmp_path}", "sg", "rollout.engine=sglang", "rollout.num_engines=2",
                      f"rollout.sglang_module={STAND_IN}", "queue.max_staleness=1", "queue.exact_staleness=true")
    monkeypatch.setenv("RELAX_STANDIN_ARGV_DIR", str(argv_dir))
    monkeypatch.setenv("RELAX_STANDIN_STORE", f"file://{tmp_path}|sg")
    monkeypatch.setenv("RELAX_FAULT", "engine:load:2:1")  # both first servers die loading version 2
    result = train(cfg, progress=False)
    assert result.steps == 4
    check_run(RunContext(cfg), 4)
    rollout = result.metrics("rollout")
    # batch k on version max(0, k - 1): versions 1 and 2 were loaded by /update_weights_from_disk, 2 by the
    # replacements after the first two died (the rollout waited for them instead of failing)
    assert [m["weight_version"] for m in rollout] == [0, 0, 1, 2]
    assert rollout[-1]["engines_replaced"] == 2 and rollout[-1]["engine_outages"] == 1
    launched = [json.loads(p.read_text()) for p in sorted(argv_dir.iterdir())]
    assert len(launched) == 4  # two at start, two replacements
    for record in launched:
        flags = _flags(record["argv"])
        assert flags["--api-key"] == os.environ[TOKEN_ENV]  # only the rollout may reload them
        assert "--trust-remote-code" not in flags  # the config did not ask for it
        assert flags["--tp-size"] == "1" and flags["--dtype"] == "float32" and flags["--context-length"] == "256"
        assert os.path.basename(flags["--model-path"]).startswith("relax-engine-model-")
        assert record["cuda_visible_devices"] is None  # no GPU here, none handed out
    assert not os.path.exists(flags["--model-path"])  # the model copy went with the rollout


def _served_logprob_gap(cfg, version: int) -> float:
    """Largest gap between the log-probs the servers reported for the response tokens of the samples
    they drew with weight ``version`` and a Hugging Face forward with that version's published weights."""
    from relax.services.queue_contract import ACTOR_GROUP
    from relax.trainers.packing import micro_batches
    from relax.trainers.torch.forward import compute_logprobs
    from relax.transfer.consumer import load_group_state

    ctx = RunContext(cfg)
    queue = ctx.queue()
    queue.refresh()
    ids = [sid for rec in load_group_state(queue, ACTOR_GROUP).steps.values() for sid in rec["ids"]
           if queue.state.samples[sid].policy_version == version]
    rows = queue.read(ids, ["tokens", "logprobs", "prompt_len"])
    model, _ = build_model(ctx)
    model.load_state_dict(WeightStore(cfg.root, cfg.run_id).load(version)[0])
    tokens = [torch.as_tensor(t).long() for t in rows["tokens"]]
    mine = compute_logprobs(model, micro_batches(tokens, 4096, "pad"), len(tokens))
    return max(float((torch.as_tensor(lp)[p:] - m[p:]).abs().max())
               for lp, m, p in zip(rows["logprobs"], mine, rows["prompt_len"], strict=True))


def test_weight_versions_broadcast_to_the_servers_are_the_ones_they_serve(tmp_path, monkeypatch):
    # rollout.weight_sync=broadcast: the rollout reads each version once and sends it over one process group
    # (gloo here, NCCL on GPUs) through SGLang's /update_weights_from_distributed, to both servers
    monkeypatch.delenv("RELAX_FAULT", raising=False)
    cfg = tiny_config(f"file://{tmp_path}", "sg", "rollout.engine=sglang", "rollout.num_engines=2",
                      f"rollout.sglang_module={STAND_IN}", "queue.max_staleness=1", "queue.exact_staleness=true",
                      "rollout.weight_sync=broadcast")
    monkeypatch.setenv("RELAX_STANDIN_STORE", f"file://{tmp_path}|sg")
    result = train(cfg, progress=False)
    check_run(RunContext(cfg), 4)
    rollout = result.metrics("rollout")
    assert [m["weight_version"] for m in rollout] == [0, 0, 1, 2]
    # versions 0 (at start), 1 and 2 reached the servers over the group, none by the disk fallback
    assert (rollout[-1]["weights_broadcast"], rollout[-1]["weight_broadcast_fallbacks"]) == (3, 0)
    # and the servers sampled with exactly those weights (version 1 is retired by retention by now)
    for version in (0, 2):
        assert _served_logprob_gap(cfg, version) < 1e-4
