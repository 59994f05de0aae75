"""SGLang servers the rollout owns (``rollout.engine=sglang``): one process per engine, each on
its own GPUs, launched, supervised and replaced like native engine processes.

``python -m <rollout.sglang_module>`` (``sglang.launch_server`` unless a test names a stand-in)
with the flags of :func:`relax.engines.sglang.launch.server_args`. Each engine takes
``sglang_tp_size`` GPUs of the ones this process sees (``CUDA_VISIBLE_DEVICES``), handed to it as its
own ``CUDA_VISIBLE_DEVICES``; a GPU is free again once its engine's process has exited, so a
replacement takes the dead engine's GPUs. The engine dies with the rollout (a parent-death
signal) and leads its own process group, which a stop ends whole (SGLang's scheduler and
detokenizer processes with it). It is not recorded for the reaper: its command line carries
SGLang's flags only (docs/runtime.md, "Engine faults").

The rollout's bearer token reaches the server as ``--api-key`` (SGLang's own check), so only
the rollout may change its weights; the token is then visible in the host's process list,
which is why the servers bind the loopback address unless the config says otherwise.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from relax.config import RelaxConfig
from relax.config.cross import sglang_tp_size
from relax.config.preflight import server_module_problem, visible_gpus
from relax.engines.sglang.launch import server_args
from relax.faults import ATTEMPT_ENV
from relax.services.launchers.process import CapacityError, EngineProcess, free_port


class GPUPool:
    """GPU ids handed to engine processes; an id is free again once its holder has exited."""

    def __init__(self, gpus: list[str]):
        self.gpus = list(gpus)
        self._held: dict[str, EngineProcess] = {}
        self._lock = threading.Lock()

    def take(self, n: int, holder_name: str) -> list[str]:
        """``n`` free ids (raise :class:`CapacityError` naming the shortfall); bind them with :meth:`bind`."""
        with self._lock:
            busy = {g for g, p in self._held.items() if p.alive}
            free = [g for g in self.gpus if g not in busy]
            if len(free) < n:
                raise CapacityError(f"{holder_name} needs {n} GPU(s) and {len(free)} of {len(self.gpus)} visible "
                                    f"({','.join(self.gpus) or 'none'}) are free; lower rollout.num_engines or "
                                    f"resources.rollout_gpus per engine, or make more GPUs visible")
            return free[:n]

    def bind(self, gpus: list[str], holder: EngineProcess) -> None:
        with self._lock:
            for g in gpus:
                self._held[g] = holder


class SGLangEngineProcess(EngineProcess):
    """One SGLang server on ``gpus`` (its CUDA_VISIBLE_DEVICES), on a free port of ``host``."""

    name = "SGLang server"

    def __init__(self, cfg: RelaxConfig, model_dir: str | Path, gpus: list[str], *, host: str = "127.0.0.1",
                 log_dir: str | Path | None = None, api_token: str | None = None, attempt: int = 0):
        why = server_module_problem(cfg.rollout.sglang_module)
        if why is not None:  # checked before the run too (RunContext); here, where the token is handed over
            raise ValueError(why)
        self.host, self.port, self.gpus = host, free_port(host), gpus
        argv = server_args(cfg, str(model_dir), self.port, host, gpu_ids=list(range(len(gpus))) or None,
                           module=cfg.rollout.sglang_module, api_key=api_token,
                           trust_remote_code=cfg.model.trust_remote_code)
        env = {**os.environ, ATTEMPT_ENV: str(attempt)}
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        self._spawn(argv, env, log_dir, owned=True)


class SGLangEngines:
    """The launcher's ``factory`` for SGLang servers: each takes ``sglang_tp_size(cfg)`` GPUs of ``pool``
    (none when the pool is empty: a stand-in on CPU)."""

    def __init__(self, cfg: RelaxConfig, pool: GPUPool | None = None):
        self.cfg = cfg
        self.pool = pool if pool is not None else GPUPool(visible_gpus())
        self.gpus_per_engine = sglang_tp_size(cfg) if self.pool.gpus else 0

    def __call__(self, model_dir: str, *, attempt: int = 0, **kwargs) -> SGLangEngineProcess:
        gpus = self.pool.take(self.gpus_per_engine, "an SGLang server") if self.gpus_per_engine else []
        engine = SGLangEngineProcess(self.cfg, model_dir, gpus, attempt=attempt, **kwargs)
        self.pool.bind(gpus, engine)
        return engine
