"""The launcher a config asks for: native or SGLang servers as local processes, with the arguments
every engine of the run shares, and their logs beside the roles'. Nothing is started here."""

from __future__ import annotations

import os

from relax.engines.guards import TOKEN_ENV
from relax.services.launchers.factory import SGLANG_STARTUP_TIMEOUT_S, engine_launcher, first_engines
from relax.services.launchers.process import LocalProcessLauncher, NativeEngineProcess
from relax.services.launchers.sglang_process import SGLangEngines
from tests.relax.services.runtime_helpers import tiny_config


def test_native_engine_processes_share_the_runs_settings(tmp_path):
    cfg = tiny_config(f"file://{tmp_path}/root", "native", "rollout.engine_processes=1")
    run_url = f"file://{tmp_path}/root/runs/native"
    launcher = engine_launcher(cfg, str(tmp_path / "model"), 3, 16, run_url)
    assert isinstance(launcher, LocalProcessLauncher) and launcher.factory is NativeEngineProcess
    assert launcher.max_engines == 3 and launcher.startup_timeout_s == 180.0
    log_dir = str(tmp_path / "root" / "runs" / "native" / "logs" / "engines")
    assert launcher.engine_kwargs == {"api_token": os.environ[TOKEN_ENV], "max_batch_size": 16, "seed": cfg.seed,
                                      "weight_store_root": cfg.root, "run_id": "native", "record_routes": False,
                                      "log_dir": log_dir}
    assert os.path.isdir(log_dir)


def test_sglang_servers_take_their_settings_from_the_config_and_boot_longer(tmp_path):
    cfg = tiny_config(f"file://{tmp_path}/root", "sgl", "rollout.engine=sglang",
                      "rollout.sglang_module=tests.relax.engines.sglang.stand_in_server")
    launcher = engine_launcher(cfg, str(tmp_path / "model"), 2, 16, "memory://elsewhere/runs/sgl")
    assert isinstance(launcher, LocalProcessLauncher) and isinstance(launcher.factory, SGLangEngines)
    assert launcher.factory.cfg is cfg and launcher.startup_timeout_s == SGLANG_STARTUP_TIMEOUT_S
    # a root that is not a local folder: the engines log beside the model copy
    assert launcher.engine_kwargs == {"api_token": os.environ[TOKEN_ENV], "log_dir": str(tmp_path / "model")}


def test_a_launcher_without_survivors_launches_all_or_nothing():
    class Launcher:
        def launch(self, n):
            return [f"engine{i}" for i in range(n)]

    assert first_engines(Launcher(), 2) == (["engine0", "engine1"], 0)
