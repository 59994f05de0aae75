"""The engines of a config from one call: without HTTP engines, one native engine in this process,
with no faults to count and no API; an API the rollout cannot serve is refused before anything starts.
(Owned and external engines: tests/relax/services/api/test_rollout_api.py, test_engine_failure.py.)"""

from __future__ import annotations

import pytest

from relax.config import ConfigError
from relax.rollout.engine_pool import LocalEngines
from relax.services.rollout_engines import check_api_port, open_engines
from relax.services.run_context import RunContext
from tests.relax.services.runtime_helpers import tiny_config


def test_a_config_without_http_engines_gets_the_in_process_engine(tmp_path):
    ctx = RunContext(tiny_config(f"file://{tmp_path}/root", "inproc"))
    engines = open_engines(ctx, None, ctx.weights())
    try:
        assert isinstance(engines.pool, LocalEngines) and engines.model_dir is None
        assert engines.pool.engine.max_batch_size == 16  # n_samples_per_prompt x prompts_per_step
        assert engines.fault_counts() == {}
        engines.start_api(ctx.cfg, ctx.weights(), "thread")  # rollout.api_port=0: no API
        assert engines.api is None and engines.elastic is None
    finally:
        engines.close()


def test_an_api_port_needs_http_engines(tmp_path):
    cfg = tiny_config(f"file://{tmp_path}/root", "inproc", "rollout.api_port=8123")
    with pytest.raises(ConfigError, match="engine_processes"):
        check_api_port(cfg, None)
    check_api_port(tiny_config(f"file://{tmp_path}/root", "noapi"), None)  # no port: nothing to check
