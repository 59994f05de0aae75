"""The run record: created once, a different config is refused naming the field, total_steps may grow."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from relax import objstore
from relax.config.preflight import check_model_folder, preflight
from relax.services.queue_contract import pad_topk_rows, topk_response_start
from relax.services.run_context import RunContext
from relax.services.run_record import RunConfigMismatch, ensure_run
from relax.services.trainable import check_trainable
from tests.relax.services.runtime_helpers import tiny_config


def test_run_record_written_then_checked(tmp_path):
    cfg = tiny_config(f"file://{tmp_path}")
    ctx = RunContext(cfg)
    record = ensure_run(ctx)
    saved = json.loads(objstore.read_bytes(objstore.join(ctx.run_url, "run.json")))
    assert saved["dataset_snapshot"] == record["dataset_snapshot"] == ctx.snapshot_info.id
    assert saved["config"]["rollout"]["n_samples_per_prompt"] == 4

    longer = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, total_steps=40))
    ensure_run(RunContext(longer))  # extending a run is allowed

    other = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, lr=0.5))
    with pytest.raises(RunConfigMismatch, match=r"trainer\.lr: 0\.001 -> 0\.5.*fork"):
        ensure_run(RunContext(other))
    ensure_run(RunContext(other), fork=True)  # the user asked for it


def test_a_setting_added_after_the_run_started_is_compared_by_its_default(tmp_path):
    cfg = tiny_config(f"file://{tmp_path}")
    ctx = RunContext(cfg)
    ensure_run(ctx)
    # rewrite run.json as an older Relax would have: without rollout.engine_timeout_s
    url = objstore.join(ctx.run_url, "run.json")
    record = json.loads(objstore.read_bytes(url))
    del record["config"]["rollout"]["engine_timeout_s"]
    objstore.write_bytes(url, json.dumps(record).encode())
    ensure_run(RunContext(cfg))  # at its default: the same run
    changed = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, engine_timeout_s=5.0))
    with pytest.raises(RunConfigMismatch, match=r"rollout\.engine_timeout_s: None -> 5\.0"):
        ensure_run(RunContext(changed))


def test_top_k_columns_keep_the_rows_from_the_first_trained_token():
    # a prompt of 3 tokens then 2 answer tokens: positions 3 and 4 are trained
    assert topk_response_start([0, 0, 0, 1, 1]) == 3
    # a tool turn between two answers stays inside the kept rows (its mask is 0, but it is after the start)
    assert topk_response_start(np.array([0, 0, 1, 0, 1], dtype=np.int8)) == 2
    assert topk_response_start([0, 0, 0]) == 3  # nothing trained: no rows kept


def test_a_stored_top_k_column_is_padded_back_to_its_row():
    kept = np.array([[7, 8], [9, 10]], dtype=np.int32)  # (R=2, k=2), rows of positions 3 and 4
    full = pad_topk_rows(kept, 5)
    # positions 0-2 (the prompt) come back as zero rows, 3-4 as stored
    assert full.shape == (5, 2) and full.dtype == np.int32
    assert full[:3].tolist() == [[0, 0]] * 3 and full[3:].tolist() == [[7, 8], [9, 10]]
    assert pad_topk_rows(full, 5) is full  # a column written whole (before this layout) is read as it is
    with pytest.raises(ValueError, match="3 rows for a row of 2 tokens"):
        pad_topk_rows(np.zeros((3, 2)), 2)


def test_sglang_engine_is_refused_before_the_run_record_where_its_servers_cannot_start(tmp_path):
    # rollout.engine=sglang used to train with native engines and exit 0; now the rollout launches SGLang
    # servers, and the pre-flight says why they cannot start here (no sglang package / no GPU) and writes nothing
    import importlib.util

    from relax.config import ConfigError

    ctx = RunContext(tiny_config(f"file://{tmp_path}", "sg", "rollout.engine=sglang"))
    why = "sglang package is not installed" if importlib.util.find_spec("sglang") is None else "GPUs and 0 are visible"
    with pytest.raises(ConfigError, match=why):
        check_trainable(ctx)
    assert not objstore.exists(objstore.join(ctx.run_url, "run.json"))
    check_trainable(ctx, engine_urls=["http://127.0.0.1:30000"])  # servers the user started: theirs to run
    with pytest.raises(ConfigError, match="'no_such.server' is not an importable module"):
        check_trainable(RunContext(tiny_config(f"file://{tmp_path}", "sg", "rollout.engine=sglang",
                               "rollout.sglang_module=no_such.server")))
    for module in ("os", "http.server", "json.tool"):  # importable, and would run with the token in its argv
        with pytest.raises(ConfigError, match=f"'{module}' is neither sglang.launch_server nor a stand-in"):
            check_trainable(RunContext(tiny_config(f"file://{tmp_path}", "sg", "rollout.engine=sglang",
                                   f"rollout.sglang_module={module}")))
    # settings that would be ignored are refused as the config loads
    for overrides, why in ((("rollout.engine_launcher=ray", "resources.num_gpus=4", "resources.rollout_gpus=4",
                             "rollout.num_engines=2", "rollout.engine_gpus=1"),
                            "engine_gpus=1 per Ray engine actor, but each SGLang server runs tensor parallel 2"),
                           (("rollout.engine_processes=2",), "SGLang servers the rollout launches are "
                                                             "rollout.num_engines")):
        with pytest.raises(ConfigError, match=why):
            tiny_config(f"file://{tmp_path}", "sg", "rollout.engine=sglang", *overrides)
    with pytest.raises(ConfigError, match="rollout.engine=native launches none"):
        tiny_config(f"file://{tmp_path}", "sg", "rollout.sglang_module=x.y")
    remote = RunContext(tiny_config("memory://bucket", "sg", "rollout.engine=sglang",
                                    "rollout.sglang_module=tests.relax.engines.sglang.stand_in_server"))
    with pytest.raises(ConfigError, match="SGLang loads each weight version from a local folder"):
        preflight(remote.cfg)


def test_a_local_model_folder_of_another_family_is_refused_before_the_run(tmp_path):
    # a local folder's config.json decides its classes; model.family naming another was silently ignored
    from relax.config import ConfigError

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    ctx = RunContext(tiny_config(f"file://{tmp_path}", "m", f"model.name_or_path={folder}", "model.family=qwen3"))
    with pytest.raises(
        ConfigError, match=r"model.family='qwen3', but .* holds a 'qwen2' model .*set model.family=qwen2"
    ):
        check_trainable(ctx)
    assert not objstore.exists(objstore.join(ctx.run_url, "run.json"))
    check_model_folder(tiny_config(f"file://{tmp_path}", "m", f"model.name_or_path={folder}"))


def test_external_agents_need_a_gateway_token_of_their_own(tmp_path, monkeypatch):
    from relax.config import ConfigError

    # the engines' token would let an agent swap the weights the run samples from
    ctx = RunContext(tiny_config(f"file://{tmp_path}", "ag", "rollout.agents=external", "data.tasks=[tool_lookup]"))
    monkeypatch.delenv("RELAX_AGENT_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="set RELAX_AGENT_TOKEN to a secret your agents send"):
        check_trainable(ctx)
    monkeypatch.setenv("RELAX_AGENT_TOKEN", os.environ["RELAX_ENGINE_TOKEN"])
    with pytest.raises(ConfigError, match="not RELAX_ENGINE_TOKEN"):
        check_trainable(ctx)
    monkeypatch.setenv("RELAX_AGENT_TOKEN", "agents-own-secret")
    check_trainable(ctx)
