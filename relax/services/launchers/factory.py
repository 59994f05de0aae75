"""The one place an engine launcher is chosen and built from the config.

``rollout.engine_launcher`` says where the engine servers a rollout owns run (``process``:
children of the rollout; ``ray``: Ray actors) and ``rollout.engine`` what they are (native
servers, or SGLang with ``sglang``): :func:`engine_launcher` returns the launcher for that pair,
with the arguments every engine of the run shares. :func:`first_engines` starts a pool's
first engines through it.
"""

from __future__ import annotations

import os

from relax import objstore
from relax.config import ConfigError, RelaxConfig
from relax.engines.guards import ensure_token
from relax.rollout.engine_supervisor import EngineLauncher, LaunchedEngine
from relax.services.launchers.process import LocalProcessLauncher
from relax.services.launchers.sglang_process import SGLangEngines
from relax.services.report.role_logs import logs_url

# an SGLang server loads its model for minutes on a GPU; a native one in seconds (the launchers' default)
SGLANG_STARTUP_TIMEOUT_S = 900.0


def engine_launcher(cfg: RelaxConfig, model_dir: str, max_engines: int, max_batch_size: int,
                    run_url: str) -> EngineLauncher:
    """The launcher of ``cfg``'s owned engines, serving the model copy in ``model_dir``, at most
    ``max_engines`` alive at once; a native engine batches up to ``max_batch_size`` requests.
    Local engines log to ``runs/<id>/logs/engines/`` on a local root (``run_url``), else beside
    the model copy."""
    r = cfg.rollout
    if r.engine_launcher == "ray":
        _connect_ray()
    sglang = r.engine == "sglang"
    timeouts = {"startup_timeout_s": SGLANG_STARTUP_TIMEOUT_S} if sglang else {}
    # the engines get this process's token, as SGLang's --api-key or inherited by a native server
    # (and its clients send it): only the rollout may change an engine
    engine_kwargs = {"api_token": ensure_token()}
    if not sglang:  # an SGLang server takes its settings from the config (relax.engines.sglang.launch)
        engine_kwargs.update(max_batch_size=max_batch_size, seed=cfg.seed, weight_store_root=cfg.root,
                             run_id=cfg.run_id, record_routes=cfg.algorithm.routing_replay)
    if r.engine_launcher == "ray":
        from relax.services.launchers.ray_actors import RayEngineLauncher  # imports ray: only when asked for

        return RayEngineLauncher(model_dir, max_engines, num_cpus=r.engine_cpus, num_gpus=r.engine_gpus,
                                 resources=r.engine_resources, sglang=cfg if sglang else None, **timeouts,
                                 **engine_kwargs)
    log_dir = objstore.local_path(logs_url(run_url, "engines")) or model_dir
    os.makedirs(log_dir, exist_ok=True)
    if sglang:
        return LocalProcessLauncher(model_dir, max_engines=max_engines, factory=SGLangEngines(cfg), log_dir=log_dir,
                                    **timeouts, **engine_kwargs)
    return LocalProcessLauncher(model_dir, max_engines=max_engines, log_dir=log_dir, **engine_kwargs)


def _connect_ray() -> None:
    """Join the running Ray cluster (``ray start --head``, or RAY_ADDRESS); never start a new local one."""
    import ray

    if ray.is_initialized():
        return
    try:
        ray.init(address="auto", log_to_driver=False)
    except ConnectionError as e:
        raise ConfigError(f"rollout.engine_launcher=ray needs a running Ray cluster ({e}); start one "
                          f"with `ray start --head`, or use engine_launcher=process") from None


def first_engines(launcher: EngineLauncher, n: int) -> tuple[list[LaunchedEngine], int]:
    """A pool's first ``n`` engines and how many were killed as they started. Local processes: one
    killed by a signal is counted, for the pool's supervisor to replace, rather than fatal. Ray
    actors: any failure fails the launch, quoting the engine's error."""
    if isinstance(launcher, LocalProcessLauncher):
        return launcher.launch_surviving(n)
    return launcher.launch(n), 0
