"""The engines of a rollout's config, from one call: :func:`open_engines`.

Which engines a rollout drives follows from its config and ``--engine-url``:

* engine URLs: external engines behind the router (:class:`~relax.rollout.remote_engines.RemoteEngines`),
  routed around when they fail, never replaced;
* ``rollout.engine=sglang``: ``rollout.num_engines`` SGLang servers the pool owns;
* ``rollout.engine_processes=N``: ``N`` native engine servers the pool owns;
* otherwise one native engine in this process (:class:`~relax.rollout.engine_pool.LocalEngines`).

Owned engines serve a copy of the initial model and run as local processes or Ray actors
(``rollout.engine_launcher``, :mod:`relax.services.launchers.factory`); the pool supervises
them (docs/runtime.md, "Engine faults"). With ``rollout.api_port`` the elastic REST API scales
them: :meth:`RolloutEngines.start_api`.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from relax import objstore
from relax.config import ConfigError, RelaxConfig
from relax.config.preflight import check_api_engines
from relax.rollout.engine_pool import EnginePool, LocalEngines
from relax.rollout.remote_engines import RemoteEngines
from relax.services.api.elastic import ElasticRollout
from relax.services.api.server import APIStartError, RolloutAPIServer, preflight
from relax.services.launchers.factory import engine_launcher, first_engines
from relax.services.launchers.lifetime import owned_temp_dir
from relax.services.policy import build_model
from relax.services.report.role_logs import logs_url
from relax.services.run_context import RunContext
from relax.transfer.weights import WeightStore


def check_api_port(cfg: RelaxConfig, engine_urls: list[str] | None, check_port: bool = True) -> None:
    """Before the rollout starts anything: with ``rollout.api_port``, a run that cannot serve its
    API fails at once (a ConfigError). ``check_port``: the port must be free (this process binds it)."""
    r = cfg.rollout
    if not r.api_port:
        return
    check_api_engines(cfg, engine_urls)
    try:
        preflight(r.api_host, r.api_port, check_port=check_port)
    except APIStartError as e:
        raise ConfigError(str(e)) from None


class RolloutEngines:
    """A rollout's engine pool, with what came with it: the media processor the rollout encodes
    prompts with, the model copy owned engines serve (removed on :meth:`close`), and the elastic
    API once :meth:`start_api` ran (``api``: served from this process; ``elastic``: only built,
    for Ray Serve's ingress)."""

    def __init__(self, pool: EnginePool, processor: Any, run_url: str, model_dir: str | None = None):
        self.pool, self.processor, self.run_url, self.model_dir = pool, processor, run_url, model_dir
        self.api: RolloutAPIServer | None = None
        self.elastic: ElasticRollout | None = None

    def fault_counts(self) -> dict[str, int]:
        """Engine retries, unhealthy marks, replacements (HTTP engines; none in-process)."""
        return self.pool.fault_counts() if isinstance(self.pool, RemoteEngines) else {}

    def start_api(self, cfg: RelaxConfig, store: WeightStore, mode: str) -> None:
        """``rollout.api_port``: ``mode`` 'thread' serves the REST API from this process (uvicorn on a
        thread); 'ingress' only builds ``self.elastic`` for Ray Serve's ingress
        (relax.services.topologies.asynchronous)."""
        r = cfg.rollout
        if not r.api_port:
            return
        if mode == "ingress":
            self.elastic = ElasticRollout(self.pool, store, self.pool.launcher)
        else:
            self.api = RolloutAPIServer(self.pool, store, r.api_host, r.api_port).start()

    def stop_api(self) -> None:
        if self.api is not None:
            self.api.stop()

    def close(self) -> None:
        """Stop the engines the pool owns; keep their logs with the run and remove the model copy."""
        try:
            self.pool.close()
        finally:
            if self.model_dir is not None:
                self._keep_engine_logs()
                shutil.rmtree(self.model_dir, ignore_errors=True)

    def _keep_engine_logs(self) -> None:
        """On an object-store root the engines logged into the model copy: their logs go to the run."""
        logs = logs_url(self.run_url, "engines")
        if objstore.local_path(logs) is not None or self.model_dir is None:
            return
        for name in os.listdir(self.model_dir):
            if name.startswith("relax-engine-") and name.endswith(".log"):
                with open(os.path.join(self.model_dir, name), "rb") as f:
                    objstore.write_bytes(objstore.join(logs, name), f.read())


def open_engines(ctx: RunContext, engine_urls: list[str] | None, store: WeightStore) -> RolloutEngines:
    """The engines of ``ctx``'s config (module docstring), started and ready to generate; owned
    engines load their weight versions from ``store``."""
    cfg, r = ctx.cfg, ctx.cfg.rollout
    slots = max(r.n_samples_per_prompt * r.prompts_per_step, 8)
    sglang = r.engine == "sglang"  # SGLang servers it owns (with --engine-url: those URLs)
    faults = {"timeout_s": r.engine_timeout_s, "max_failures": r.engine_max_failures,
              "supervise_interval_s": r.supervise_interval_s, "weight_sync": r.weight_sync,
              "routed_experts": cfg.algorithm.routing_replay}
    # HTTP engines (by URL or owned): the rollout expands media placeholders itself, from the processor alone
    if engine_urls:
        return RolloutEngines(RemoteEngines(engine_urls, **faults), ctx.processor, ctx.run_url)
    if sglang or r.engine_processes > 0:
        return _owned_engines(ctx, r.num_engines if sglang else r.engine_processes, slots, store, faults,
                              ctx.processor)
    model, processor = build_model(ctx)
    pool = LocalEngines(model, ctx.tokenizer, max_batch_size=slots, max_seq_len=cfg.model.max_seq_len,
                        seed=cfg.seed, record_routes=cfg.algorithm.routing_replay)
    return RolloutEngines(pool, processor, ctx.run_url)


def _owned_engines(ctx: RunContext, n: int, slots: int, store: WeightStore, faults: dict[str, Any],
                   processor: Any) -> RolloutEngines:
    """Start ``n`` engine servers (native, or SGLang with rollout.engine=sglang) on the initial model;
    the pool owns and supervises them."""
    cfg = ctx.cfg
    model, _ = build_model(ctx)
    model_dir = owned_temp_dir("relax-engine-model-")  # swept by the next run if this process is killed
    model.save_pretrained(model_dir)
    ctx.tokenizer.save_pretrained(model_dir)
    text_cfg = getattr(model.config, "text_config", None) or model.config
    try:
        launcher = engine_launcher(cfg, model_dir, max(n, cfg.rollout.max_engine_processes), slots, ctx.run_url)
        started, killed = first_engines(launcher, n)
    except BaseException:
        shutil.rmtree(model_dir, ignore_errors=True)
        raise
    pool = RemoteEngines([], owned=started, launcher=launcher, store=store,
                         vocab_size=getattr(text_cfg, "vocab_size", None),
                         local_weights=cfg.rollout.engine == "sglang", **faults)
    pool.supervisor.vacancies += killed  # the pool's supervisor starts their replacements
    if killed and not started:
        pool.supervise()  # no engine to route to: replace one now rather than at the first request
    return RolloutEngines(pool, processor, ctx.run_url, model_dir)
