"""The ``async`` topology: each role is a Ray Serve deployment running its own loop.

A replica starts its role loop in a thread when it is constructed and answers ``status()``
(steps done, finished, restarts, error). A loop that fails is restarted in its replica after a
backoff (relax.services.supervision); ``error`` is set only once the supervisor gives up. A
replica whose process dies is replaced by Ray Serve, and its loop resumes the role; so is one the
driver kills because its role made no progress for ``supervisor.hang_timeout_s``. Roles talk only
through the run root (TransferQueue and WeightStore), so the rollout keeps generating while the
actor trains, at most ``queue.max_staleness`` versions ahead. The driver (``run_async``) polls the
statuses, mirrors the actor's metrics into the progress bar, and deletes the application when the
actor is done.

Each role process gets half the CPUs for torch threads, so rollout and actor overlap on
separate cores instead of fighting over the same ones.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from typing import Any

from relax.config import config_from_dict, config_to_dict
from relax.config.preflight import check_api_token
from relax.faults import FAULT_ENV
from relax.services.api.elastic import TOKEN_ENV
from relax.services.api.server import lazy_rollout_app
from relax.services.heartbeat import HangWatch
from relax.services.report.metrics import MetricsReader
from relax.services.roles.factory import role_names
from relax.services.run_context import RunContext
from relax.services.supervision import NOT_HEALED, RoleFailure, RunStopped, Supervisor
from relax.services.topologies.progress import Progress
from relax.services.topologies.runner import run_role

APP_PREFIX = "relax"


class RoleRunner:
    """One role's loop on a thread, with a status a controller can poll (the deployment body)."""

    api_mode = "thread"  # how a rollout with rollout.api_port serves its REST API

    def __init__(self, role: str, cfg: dict[str, Any], engine_urls: list[str] | None = None):
        self.role, self.cfg = role, config_from_dict(cfg)
        self.steps, self.done, self.error, self.restarts = 0, False, None, 0
        self.role_object: Any = None
        self.started = time.time()
        self._thread = threading.Thread(target=self._run, args=(engine_urls,), name=f"relax-{role}", daemon=True)
        self._thread.start()

    def _run(self, engine_urls: list[str] | None) -> None:
        """The role's loop, restarted in this replica when it fails (relax.services.supervision): it
        resumes from the queue and its checkpoint; ``error`` is set once the supervisor gives up."""
        supervisor = Supervisor(RunContext(self.cfg).run_url, self.cfg.supervisor)
        while True:
            try:
                run_role(self.role, self.cfg, engine_urls=engine_urls, on_step=self._count,
                         on_start=self._started, api_mode=self.api_mode, attempt=self.restarts)
                self.done = True
                return
            except Exception as e:
                failure = RoleFailure(self.role, self.restarts, "exception", traceback.format_exc(),
                                      "(the Ray Serve replica's log)", healable=not isinstance(e, NOT_HEALED))
                try:
                    delay = supervisor.failed(failure)
                except RunStopped as stop:
                    self.error = str(stop)
                    return
            self.restarts += 1
            time.sleep(delay)

    def _started(self, role_object: Any) -> None:
        self.role_object = role_object

    def _count(self, _metrics: dict[str, Any]) -> None:
        self.steps += 1

    def status(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "steps": self.steps,
            "done": self.done,
            "error": self.error,
            "restarts": self.restarts,
            "uptime_s": time.time() - self.started,
        }


class RolloutIngress(RoleRunner):
    """The rollout deployment when ``rollout.api_port`` is set: Ray Serve's HTTP proxy serves the
    elastic REST API at ``/<run_id>/rollout/...``, on the rollout's own engine pool."""

    api_mode = "ingress"

    def __serve_build_asgi_app__(self) -> Any:  # called by Serve after __init__, on the replica
        return lazy_rollout_app(lambda: getattr(self.role_object, "elastic", None))


REPLICA_GRACE_S = 180.0  # how long a role's replica may be gone while Ray Serve starts another


def _status(role: str, handle: Any, lost: dict[str, float]) -> dict[str, Any]:
    """The replica's status; while its process is gone (Serve replaces a dead replica, whose role loop
    then resumes from the queue) an unfinished status, until REPLICA_GRACE_S have passed."""
    try:
        state = handle.status.remote().result(timeout_s=60)
    except Exception as e:
        since = lost.setdefault(role, time.monotonic())
        if time.monotonic() - since > REPLICA_GRACE_S:
            raise RuntimeError(f"role {role}'s Ray Serve replica has not answered for {REPLICA_GRACE_S:.0f} s "
                               f"({type(e).__name__}: {e}); see the replica's log in the Ray session logs") from e
        return {"role": role, "done": False, "error": None}
    lost.pop(role, None)
    return state


def _kill_replica(app: str, role: str) -> None:
    """End the Ray Serve replica of deployment ``role`` in application ``app`` (Serve starts another)."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#{role}#"
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith(prefix):
            try:
                ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
            except ValueError:  # gone already
                pass


def run_async(ctx: RunContext, progress: bool = True, engine_urls: list[str] | None = None,
              poll_s: float = 0.5) -> None:
    import ray
    from ray import serve

    cfg = ctx.cfg
    if not ray.is_initialized():
        ray.init(num_cpus=cfg.resources.num_cpus, include_dashboard=False, log_to_driver=False,
                 ignore_reinit_error=True)
    # replicas are other processes: a fault to inject (RELAX_FAULT, tests) travels in their runtime environment
    fault = {FAULT_ENV: os.environ[FAULT_ENV]} if os.environ.get(FAULT_ENV) else {}
    options = {"ray_actor_options": {"num_cpus": 0.01, **({"runtime_env": {"env_vars": fault}} if fault else {})},
               "max_ongoing_requests": 8}
    deployment = serve.deployment(RoleRunner, **options)
    api = cfg.rollout.api_port > 0
    if api:  # the proxy's address is cluster-wide: a Serve already running keeps its own
        token = check_api_token(cfg)
        serve.start(http_options={"host": cfg.rollout.api_host, "port": cfg.rollout.api_port})
        # the replica is another process: the token goes to it in its runtime environment
        ingress = serve.deployment(serve.ingress()(RolloutIngress), **{
            **options, "ray_actor_options": {**options["ray_actor_options"],
                                             "runtime_env": {"env_vars": {TOKEN_ENV: token, **fault}}}})
    body = config_to_dict(cfg)
    handles = {}
    names = {role: f"{APP_PREFIX}-{cfg.run_id}-{role}" for role in role_names(cfg)}
    try:
        for role in names:  # the actor first: it publishes version 0 that the rollout waits for
            serves_api = api and role == "rollout"
            app = (ingress if serves_api else deployment).options(name=role).bind(
                role, body, engine_urls if role == "rollout" else None)
            handles[role] = serve.run(app, name=names[role], route_prefix=f"/{cfg.run_id}" if serves_api else None)
        bar = Progress(cfg.trainer.total_steps, 0, progress)
        actor = MetricsReader(ctx.run_url, "actor")
        rollout = MetricsReader(ctx.run_url, "rollout")  # the reward on the progress line
        lost: dict[str, float] = {}  # role -> since when its replica does not answer
        hangs = HangWatch(ctx.run_url, cfg.supervisor.hang_timeout_s, max(poll_s, cfg.supervisor.heartbeat_s))
        driver = Supervisor(ctx.run_url, cfg.supervisor, notify=bar.note)  # counts the replicas it kills
        since = {role: time.time() for role in handles}  # each replica's start, as far as the driver knows
        attempts = {role: 0 for role in handles}
        while True:
            states = {role: _status(role, h, lost) for role, h in handles.items()}
            for role, s in states.items():
                attempts[role] = s.get("restarts", attempts[role])
                idle = None if s["done"] else hangs.stalled(role, attempts[role], since[role])
                if idle is not None:  # Ray Serve replaces the replica, whose loop resumes the role
                    _kill_replica(names[role], role)
                    driver.failed(RoleFailure(role, attempts[role], f"no progress for {idle:.0f} s (hung; killed)",
                                              "(its Ray Serve replica was killed; its stacks are not kept)",
                                              "(the Ray Serve replica's log)"))  # raises past max_restarts
                    since[role], attempts[role] = time.time(), 0
                    hangs.forget(role)
            failed = {r: s for r, s in states.items() if s["error"]}
            if failed:
                role, s = next(iter(failed.items()))
                raise RuntimeError(f"role {role} failed:\n{s['error']}")
            bar.follow(actor, rollout)
            if all(s["done"] for s in states.values()):
                break
            time.sleep(poll_s)
        bar.close()
    finally:
        for name in names.values():
            try:
                serve.delete(name)
            except Exception:  # best effort: an app that never started has nothing to delete
                pass
