"""RelaxConfig -> ``sglang.launch_server`` flags (CPU), and a real launch (GPU + sglang only)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relax.config import RelaxConfig
from relax.config.model import LORA_MODULES
from relax.engines.sglang.launch import launch, server_args


def _flags(argv: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    rest = argv[3:]
    for i, a in enumerate(rest):
        if a.startswith("--"):
            nxt = rest[i + 1] if i + 1 < len(rest) else None
            out[a] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def test_mapping_from_config() -> None:
    cfg = RelaxConfig()
    cfg.model.dtype, cfg.model.max_seq_len, cfg.seed = "bfloat16", 4096, 7
    cfg.resources.rollout_gpus, cfg.rollout.num_engines = 8, 2
    argv = server_args(cfg, "/models/qwen", 31000, host="0.0.0.0", mem_fraction_static=0.7)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    f = _flags(argv)
    assert f["--model-path"] == "/models/qwen" and f["--host"] == "0.0.0.0" and f["--port"] == "31000"
    assert f["--tp-size"] == "4" and f["--dtype"] == "bfloat16" and f["--context-length"] == "4096"
    assert f["--mem-fraction-static"] == "0.7" and f["--random-seed"] == str(7 + 31000)
    assert "--skip-server-warmup" in f and f["--skip-server-warmup"] is None


def test_gpu_ids_fix_tp_and_defaults() -> None:
    cfg = RelaxConfig()  # tiny-cpu: no rollout GPUs -> tp 1
    assert _flags(server_args(cfg, "m", 1))["--tp-size"] == "1"
    f = _flags(server_args(cfg, "m", 1, gpu_ids=[2, 3], extra=["--disable-radix-cache"]))
    assert f["--tp-size"] == "2" and "--disable-radix-cache" in f and f["--dtype"] == "float32"


PARSER_DIR = Path(__file__).resolve().parents[4] / ".venv" / "sglang-parser"


def test_every_flag_is_accepted_by_sglangs_own_parser() -> None:
    # SGLang 0.5.23's ServerArgs parser (infra/setup.sh installs it beside the venv): an unknown
    # flag or value fails there with SGLang's own message, exactly as the real server would at start
    assert (PARSER_DIR / "sglang").is_dir(), f"{PARSER_DIR} is missing: run make setup (infra/setup.sh)"
    cfg = RelaxConfig()
    cfg.model.dtype, cfg.model.max_seq_len = "bfloat16", 4096
    cfg.algorithm.routing_replay = True  # R3: SGLang records each token's experts
    cfg.model.lora.rank, cfg.model.lora.target_modules = 16, ["q_proj", "v_proj"]  # adapters loaded at run time
    argv = server_args(cfg, "/models/qwen", 31000, host="0.0.0.0", gpu_ids=[0, 1], api_key="secret",
                       trust_remote_code=True, extra=["--disable-radix-cache"])
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("sglang_parser.py")), *argv[3:]],
                         env={**os.environ, "PYTHONPATH": str(PARSER_DIR)}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    parsed = json.loads(out.stdout.splitlines()[-1])
    assert (parsed["model_path"], parsed["host"], parsed["port"], parsed["tp_size"]) == ("/models/qwen", "0.0.0.0",
                                                                                        31000, 2)
    assert (parsed["dtype"], parsed["context_length"], parsed["mem_fraction_static"]) == ("bfloat16", 4096, 0.8)
    assert parsed["api_key"] == "secret" and parsed["trust_remote_code"] is True
    assert parsed["skip_server_warmup"] is True and parsed["disable_radix_cache"] is True
    assert parsed["enable_return_routed_experts"] is True
    assert parsed["enable_lora"] is True and parsed["max_lora_rank"] == 16  # (its list-valued target modules
    # are accepted by the parser but not printed by sglang_parser.py)
    # and the parser is real: a flag SGLang does not have is refused
    bad = subprocess.run([sys.executable, str(Path(__file__).with_name("sglang_parser.py")), "--model-path", "m",
                          "--no-such-flag"], env={**os.environ, "PYTHONPATH": str(PARSER_DIR)},
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--no-such-flag" in bad.stderr


def test_remote_code_only_when_the_config_asks() -> None:
    assert "--trust-remote-code" not in server_args(RelaxConfig(), "m", 1)
    assert "--api-key" not in server_args(RelaxConfig(), "m", 1)
    assert "--enable-return-routed-experts" not in server_args(RelaxConfig(), "m", 1)  # only with routing_replay
    assert "--enable-lora" not in server_args(RelaxConfig(), "m", 1)  # only with model.lora.rank > 0
    cfg = RelaxConfig()
    cfg.model.lora.rank = 8
    argv = server_args(cfg, "m", 1)
    assert argv[argv.index("--lora-target-modules") + 1:][:7] == list(LORA_MODULES["qwen2"])


@pytest.mark.gpu
def test_launch_generate_and_reload(tmp_path) -> None:
    """Real SGLang on one GPU with the tiny saved model: health, contract, weight reload by folder."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed")
    from tests.relax.engines.contract import free_port, run_contract, save_tiny_model

    model_dir = save_tiny_model(tmp_path / "model", max_positions=256)
    cfg = RelaxConfig()
    cfg.model.max_seq_len = 256
    with launch(cfg, str(model_dir), free_port(), gpu_ids=[0], log_path=tmp_path / "sglang.log",
                mem_fraction_static=0.3) as server:
        run_contract(server.url)

        async def reload() -> dict:
            r = await server.client.update_weights_from_disk(str(model_dir), "7")
            info = await server.client.model_info()
            await server.client.close()
            return {**r, "info": info}

        r = asyncio.run(reload())
        assert r["success"] is True and str(r["info"]["weight_version"]) == "7"
