"""Launch SGLang servers (GPU) from a RelaxConfig, and push weights to them.

Why a subprocess of ``python -m sglang.launch_server`` instead of the in-process Engine:
the server is the same thing the router and the native engine expose (one
:class:`EngineClient` for both), it dies alone, and its flags are SGLang's documented CLI
(``ServerArgs``), which is stabler than its Python internals. sglang is optional
(``pip install relax[sglang]``) and imported nowhere in this module.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from relax.config import RelaxConfig
from relax.config.cross import sglang_tp_size
from relax.config.model import lora_targets
from relax.engines.client import EngineClient

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def server_args(cfg: RelaxConfig, model_path: str, port: int, host: str = "127.0.0.1",
                gpu_ids: list[int] | None = None, *, mem_fraction_static: float = 0.8,
                extra: list[str] | None = None, module: str = "sglang.launch_server", api_key: str | None = None,
                trust_remote_code: bool = False) -> list[str]:
    """argv for ``python -m sglang.launch_server`` (flag names of SGLang 0.5 ``ServerArgs``,
    pinned by tests/relax/engines/sglang/test_launch_args.py).

    ``gpu_ids`` only fixes the TP size when given (the GPUs themselves are chosen through
    ``CUDA_VISIBLE_DEVICES``). Seeds differ per port so replicas sample independently yet
    reproducibly. ``module``: what runs as the server (a stand-in in CPU tests); ``api_key``:
    the bearer token the server then requires; ``--trust-remote-code`` only when asked for.
    """
    tp = len(gpu_ids) if gpu_ids else sglang_tp_size(cfg)
    args = [
        sys.executable, "-m", module,
        "--model-path", str(model_path),
        "--host", host,
        "--port", str(port),
        "--tp-size", str(tp),
        "--dtype", _DTYPES[cfg.model.dtype],
        "--context-length", str(cfg.model.max_seq_len),
        "--mem-fraction-static", str(mem_fraction_static),
        "--random-seed", str(cfg.seed + port),
        "--skip-server-warmup",
    ]
    if api_key:
        args += ["--api-key", api_key]
    if trust_remote_code:
        args.append("--trust-remote-code")
    if cfg.algorithm.routing_replay:  # the rollout asks each request for its experts (R3)
        args.append("--enable-return-routed-experts")
    if cfg.model.lora.rank:  # adapters load at run time (/load_lora_adapter), so their rank and modules are fixed now
        args += ["--enable-lora", "--max-lora-rank", str(cfg.model.lora.rank),
                 "--lora-target-modules", *lora_targets(cfg.model)]
    return args + list(extra or [])


class SGLangServer:
    """A running ``sglang.launch_server`` process; ``close()`` (or ``with``) terminates it."""

    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path | None):
        self.proc, self.url, self.log_path = proc, url, log_path
        self.client = EngineClient(url)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self, timeout_s: float = 30.0) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> SGLangServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def launch(cfg: RelaxConfig, model_path: str, port: int, host: str = "127.0.0.1", gpu_ids: list[int] | None = None,
           *, timeout_s: float = 900.0, log_path: str | Path | None = None, **kwargs: Any) -> SGLangServer:
    """Start a server and wait until ``GET /health`` is 200; raises (and kills it) on timeout or exit."""
    argv = server_args(cfg, model_path, port, host, gpu_ids, **kwargs)
    env = dict(os.environ)
    if gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_ids))
    log = Path(log_path) if log_path else None
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 (owned by the child)
    proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    server = SGLangServer(proc, f"http://{host}:{port}", log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not server.alive():
            raise RuntimeError(f"sglang server exited with {proc.returncode} during startup (log: {log})")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
                if r.status == 200:
                    return server
        except OSError:
            pass
        time.sleep(1.0)
    server.close()
    raise TimeoutError(f"sglang server on {server.url} not healthy within {timeout_s} s (log: {log})")


async def update_weights_from_disk(client: EngineClient, path: str, version: int | str) -> dict[str, Any]:
    """Point the server at a published HF-format folder; raises if it refuses (old weights stay)."""
    r = await client.update_weights_from_disk(path, str(version))
    if not r.get("success"):
        raise RuntimeError(f"{client.url} refused weights {path}: {r.get('message')}")
    return r
