"""Engines as Ray actors (``rollout.engine_launcher=ray``): Ray places them and accounts for them.

Each engine is an actor holding ``rollout.engine_cpus`` CPUs and ``rollout.engine_gpus`` GPUs
of the cluster, and the custom resources of ``rollout.engine_resources`` (``relax.config.rollout.parse_resources``):
``rollout_node=1`` keeps engines on nodes started with ``--resources '{"rollout_node": N}'``.
The actor runs a native engine server (``python -m relax.engines.server``), or with
``rollout.engine=sglang`` an SGLang server on the GPUs Ray assigned it, on its node's address,
as a child that dies with the actor. The rollout's pool routes to it by URL like any
engine, so supervision, draining and weight loading are the pool's as before.

A launch is all or nothing. It is refused up front (:class:`CapacityError`) when the cluster's
free resources cannot hold every engine asked for, and if any actor fails to start or to be
placed within the startup timeout, the ones already created are killed: no half scale-out.
The model folder must be readable at the same path on the nodes the actors land on (one host,
or a shared filesystem).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from relax.config.rollout import parse_resources
from relax.services.launchers.process import CapacityError, NativeEngineProcess


class EngineActor:
    """The actor body: one engine server on this node, stopped with the actor: a native engine, or
    with ``sglang`` (the run's config) an SGLang server on the GPUs Ray gave this actor."""

    def __init__(self, model_dir: str, engine_kwargs: dict[str, Any], sglang: Any = None):
        import ray

        host = ray.util.get_node_ip_address()
        if sglang is not None:  # Ray set CUDA_VISIBLE_DEVICES for this actor; the server gets the same devices
            from relax.services.launchers.sglang_process import SGLangEngineProcess

            self.proc = SGLangEngineProcess(sglang, model_dir, [str(g) for g in ray.get_gpu_ids()], host=host,
                                            **engine_kwargs)
        else:
            self.proc = NativeEngineProcess(model_dir, host=host, die_with_parent=True, **engine_kwargs)

    def wait_healthy(self, timeout_s: float) -> str:
        self.proc.wait_healthy(timeout_s)
        return self.proc.url

    def alive(self) -> bool:
        return self.proc.alive

    def stop(self) -> None:
        self.proc.stop()


class RayEngine:
    """A launched engine (:class:`~relax.rollout.engine_supervisor.LaunchedEngine`) backed by an actor."""

    def __init__(self, actor: Any, url: str):
        self.actor, self._url = actor, url

    @property
    def url(self) -> str:
        return self._url

    @property
    def alive(self) -> bool:
        import ray

        try:
            return bool(ray.get(self.actor.alive.remote(), timeout=10))
        except Exception:  # the actor died, or hangs: either way it serves nothing
            return False

    def stop(self) -> None:
        import ray

        try:
            ray.get(self.actor.stop.remote(), timeout=20)
        except Exception:  # already dead, or stuck: the kill below ends it (and its engine)
            pass
        ray.kill(self.actor)


class RayEngineLauncher:
    """Engines as Ray actors (native, or SGLang servers given ``sglang``), at most ``max_engines`` alive at once.

    Each actor holds ``num_cpus``, ``num_gpus`` and ``resources`` (``'name=amount,...'``, see
    ``relax.config.rollout.parse_resources``, which also checks it as the config loads).
    """

    def __init__(self, model_dir: str | Path, max_engines: int, *, num_cpus: float = 1.0, num_gpus: float = 0.0,
                 resources: str = "", startup_timeout_s: float = 180.0, sglang: Any = None, **engine_kwargs: Any):
        import ray

        if not ray.is_initialized():
            raise RuntimeError("rollout.engine_launcher=ray needs Ray: run inside a Ray cluster (ray.init(), the "
                               "async topology, or RAY_ADDRESS pointing at `ray start --head`)")
        if max_engines < 1:
            raise ValueError(f"max_engines must be >= 1, got {max_engines}")
        self.model_dir, self.max_engines = str(model_dir), max_engines
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.resources = parse_resources(resources)
        self.startup_timeout_s = startup_timeout_s
        self.engine_kwargs = engine_kwargs
        self.sglang = sglang  # the RelaxConfig of a run whose engines are SGLang servers (rollout.engine=sglang)
        self._actor_class = ray.remote(EngineActor)
        self._engines: list[RayEngine] = []
        self._lock = threading.Lock()

    def running(self) -> list[RayEngine]:
        with self._lock:
            self._engines = [e for e in self._engines if e.alive]
            return list(self._engines)

    def _check_capacity(self, n: int) -> None:
        import ray

        free = self.max_engines - len(self._engines)
        if n > free:
            raise CapacityError(f"cannot launch {n} engine actor(s): {len(self._engines)} of max_engines="
                                f"{self.max_engines} are running, so {free} more fit; ask for at most {free}")
        # cluster-wide totals: a launch short of any one resource is refused whole; one that fits
        # the totals but not any single node's share is caught by the startup timeout instead
        available = ray.available_resources()
        for name, each in (("CPU", self.num_cpus), ("GPU", self.num_gpus), *self.resources.items()):
            have = float(available.get(name, 0.0))
            if each > 0 and n * each > have + 1e-9:
                raise CapacityError(f"cannot launch {n} engine actor(s): they need {n * each:g} {name} "
                                    f"({each:g} each) and the Ray cluster has {have:g} free; ask for at most "
                                    f"{int(have // each)} or add nodes")

    def launch(self, n: int) -> list[RayEngine]:
        import ray

        if n < 1:
            raise ValueError(f"launch needs n >= 1, got {n}")
        with self._lock:  # checked and created together, so two launches cannot overshoot
            self._engines = [e for e in self._engines if e.alive]
            self._check_capacity(n)
            actors = [self._actor_class.options(num_cpus=self.num_cpus, num_gpus=self.num_gpus,
                                                resources=dict(self.resources))
                      .remote(self.model_dir, self.engine_kwargs, self.sglang) for _ in range(n)]
        try:
            # placement and boot share the timeout: an actor Ray cannot place never answers
            urls = ray.get([a.wait_healthy.remote(self.startup_timeout_s) for a in actors],
                           timeout=self.startup_timeout_s + 30)
        except BaseException as e:
            for a in actors:
                ray.kill(a)
            if isinstance(e, ray.exceptions.GetTimeoutError):
                raise CapacityError(f"{n} engine actor(s) were not placed and healthy within "
                                    f"{self.startup_timeout_s:.0f} s (resources taken meanwhile?); none kept") from None
            raise
        started = [RayEngine(a, u) for a, u in zip(actors, urls, strict=True)]
        with self._lock:
            self._engines += started
        return started

    def stop_all(self) -> None:
        for e in self.running():
            e.stop()
